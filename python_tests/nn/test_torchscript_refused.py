"""TorchScript: attn_ext.nn.MultiheadAttention refuses torch.jit.script by name, and swap_attention's report
names every module that stops being scriptable (docs/nn.md, "TorchScript")."""
import warnings

import pytest
import torch
from torch import nn

import attn_ext as ae

REFUSAL = r"attn_ext\.nn\.{}: TorchScript \(torch\.jit\.script\) is not supported.*torch\.compile"


def _script(module):
    with warnings.catch_warnings():  # torch 2.13 deprecates torch.jit.script; and its notes on nn.Transformer
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(module)


@pytest.mark.parametrize("cls", [ae.nn.MultiheadAttention, ae.nn.MultiheadCrossAttention])
def test_script_of_the_module_names_it(cls):
    with pytest.raises(RuntimeError, match=REFUSAL.format(cls.__name__)):
        _script(cls(8, 2))


def test_modules_built_on_it_name_it_too():
    with pytest.raises(RuntimeError, match=REFUSAL.format("MultiheadCrossAttention")):
        _script(ae.nn.PreNormBlock(8, 2, 16, cross=True))


def test_swapped_transformer_is_refused_by_name_and_the_report_says_what_stopped_being_scriptable():
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8,
                           dropout=0.0, batch_first=True)
    _script(model)  # torch's own modules script
    report = ae.nn.swap_attention(model)
    with pytest.raises(RuntimeError, match=REFUSAL.format("MultiheadAttention")):
        _script(model)
    assert report.not_scriptable == [
        "", "encoder", "encoder.layers", "encoder.layers.0", "encoder.layers.0.self_attn", "decoder",
        "decoder.layers", "decoder.layers.0", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"]
    assert "not scriptable any more: the model and 9 of its modules" in str(report)
    modules = dict(model.named_modules())
    for name in report.not_scriptable[1:]:
        with pytest.raises(RuntimeError, match=REFUSAL.format("MultiheadAttention")):
            _script(modules[name])
    # Modules holding no replaced one still script.
    for name in ("encoder.layers.0.linear1", "decoder.layers.0.norm1", "encoder.norm"):
        assert name not in report.not_scriptable
        _script(modules[name])


def test_nothing_replaced_nothing_unscriptable():
    report = ae.nn.swap_attention(nn.Sequential(nn.Linear(4, 4)))
    assert report.replaced == [] and report.not_scriptable == [] and "not scriptable" not in str(report)
