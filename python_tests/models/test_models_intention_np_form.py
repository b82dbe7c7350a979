"""IntentionNP's ``intention_form`` option: both forms train, the option survives a checkpoint, the
default model is the one built before the option existed."""
import argparse

import pytest
import torch

from attn_ext.data import GPSampler
from attn_ext.models import IntentionNP, build_model
from attn_ext.nn import Intention

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)

# IntentionNP(**SMALL) after torch.manual_seed(0), predicting the inputs of _fixed_inputs(), computed
# before ``intention_form`` was added: the default must still build and compute exactly this model.
PRE_EDIT_MEAN = [0.09015560150146484, 0.14573338627815247, 0.06983815133571625, 0.15420523285865784,
                 -0.04834181070327759, 0.051815956830978394, 0.05387909710407257, -0.06387434899806976]
PRE_EDIT_SCALE = [0.9887216687202454, 1.0780978202819824, 0.9394799470901489, 0.8348866701126099,
                  1.127301573753357, 1.1098289489746094, 1.1126446723937988, 1.109705924987793]


def _fixed_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 6, 1, generator=g), torch.randn(2, 6, 1, generator=g),
            torch.randn(2, 4, 1, generator=g))


def test_default_output_unchanged_from_before_the_option():
    torch.manual_seed(0)
    model = IntentionNP(**SMALL)
    with torch.no_grad():
        pred = model.predict(*_fixed_inputs())
    assert torch.allclose(pred.mean.flatten(), torch.tensor(PRE_EDIT_MEAN), atol=1e-6, rtol=0)
    assert torch.allclose(pred.scale.flatten(), torch.tensor(PRE_EDIT_SCALE), atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["linear", "paper"])
def test_layers_use_the_requested_form(form):
    model = IntentionNP(**SMALL, intention_form=form)
    attentions = [layer.attention for layer in model.encoder.layers]
    assert all(isinstance(a, Intention) and a.form == form for a in attentions)


@pytest.mark.parametrize("form", ["linear", "paper"])
def test_form_trains_on_gp(form):
    torch.manual_seed(0)
    model = IntentionNP(**SMALL, intention_form=form)
    sampler, gen = GPSampler(), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(200):
        loss = model(sampler.sample(16, generator=gen))
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:30]) / 30, sum(losses[-30:]) / 30
    assert last < first - 0.05, (form, first, last)


@pytest.mark.parametrize("form", ["linear", "paper"])
def test_option_round_trips_through_options(form):
    torch.manual_seed(0)
    model = build_model("intention_np", **SMALL, intention_form=form)
    assert model.options() == {"intention_form": form}
    rebuilt = build_model("intention_np", **model.config.to_dict(), **model.options())
    rebuilt.load_state_dict(model.state_dict())  # strict: same parameters, so the same architecture
    xc, yc, xt = _fixed_inputs()
    with torch.no_grad():
        assert torch.equal(model.predict(xc, yc, xt).mean, rebuilt.predict(xc, yc, xt).mean)


def test_unknown_form_raises_naming_the_class():
    with pytest.raises(ValueError, match="IntentionNP.*intention_form"):
        IntentionNP(**SMALL, intention_form="kernel")


def test_harness_flag_and_legacy_checkpoints():
    from bench.np.checkpoint import stored_options
    from bench.np.train import model_options

    args = argparse.Namespace(model="intention_np", intention_form="paper")
    assert model_options(args) == {"intention_form": "paper"}
    with pytest.raises(ValueError, match="--intention-form applies to intention_np"):
        model_options(argparse.Namespace(model="tnpd", intention_form="paper"))
    # A checkpoint written before the option existed holds the linear form.
    assert stored_options({"model": "intention_np"}) == {"intention_form": "linear"}
