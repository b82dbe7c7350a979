"""The attention-sharpness diagnostic (bench.np.attention_entropy): exact on hand-made
attentions, transparent to the model it watches, and runnable on a checkpoint."""
import math

import pytest
import torch

from bench.np.attention_entropy import AttentionSharpness, main, record_attention, sharpness_table
from attn_ext.data import GPSampler
from attn_ext.models import build_model
from attn_ext.nn import MultiheadCrossAttention

SMALL = {"num_layers": 2, "num_latents": 8, "d_model": 16, "ff_dim": 32, "emb_depth": 2}


def test_identical_keys_read_as_uniform_and_one_dominant_key_as_sharp():
    q = torch.randn(2, 4, 3, 8)
    same = torch.randn(1, 1, 1, 8).expand(2, 4, 5, 8)
    uniform = AttentionSharpness()
    uniform.add(q, same, None)
    assert uniform.mean_entropy == pytest.approx(1.0, abs=1e-6)
    assert uniform.mean_logit_std == pytest.approx(0.0, abs=1e-5)

    keys = torch.zeros(2, 4, 5, 8)
    keys[..., 2, :] = 1e3  # key 2 wins by a huge margin for positive queries
    sharp = AttentionSharpness()
    sharp.add(torch.ones(2, 4, 3, 8), keys, None)
    assert sharp.mean_entropy == pytest.approx(0.0, abs=1e-6)


def test_padding_is_left_out_of_the_entropy_and_its_normaliser():
    q = torch.randn(1, 2, 3, 8)
    keys = torch.randn(1, 1, 1, 8).expand(1, 2, 6, 8).clone()
    keys[..., 4:, :] = torch.randn(2, 8) * 10  # distinct keys, all padding
    mask = torch.tensor([[False, False, False, False, True, True]])
    rec = AttentionSharpness()
    rec.add(q, keys, mask)
    # Four identical real keys: uniform over them, normalised by log 4, not log 6.
    assert rec.mean_entropy == pytest.approx(1.0, abs=1e-6)
    # A single real key leaves no choice and counts as sharp.
    one = AttentionSharpness()
    one.add(q, keys, torch.tensor([[False, True, True, True, True, True]]))
    assert one.mean_entropy == 0.0


def test_matches_a_direct_computation_on_a_module():
    torch.manual_seed(0)
    mha = MultiheadCrossAttention(16, 4)
    query, context = torch.randn(3, 5, 16), torch.randn(3, 11, 16)
    with record_attention(torch.nn.ModuleList([mha])) as records:
        mha(query, context, context)
    q, k = mha._heads_q(query), mha._heads_kv(context, context)[0]
    w = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)  # head_dim 4
    expected = (-(w * w.log()).sum(-1) / math.log(11)).mean().item()
    assert records["0"].mean_entropy == pytest.approx(expected, rel=1e-5)
    assert records["0"].calls == 1


def test_recording_leaves_predictions_unchanged_and_unpatches():
    torch.manual_seed(0)
    model = build_model("cmanp", **SMALL).eval()
    batch = GPSampler().sample(2, generator=torch.Generator().manual_seed(1))
    before = model.predict(batch.xc, batch.yc, batch.xt).mean
    rows = sharpness_table(model, [batch])
    after = model.predict(batch.xc, batch.yc, batch.xt).mean
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    names = [r[0] for r in rows]
    # Every CMAB has four attentions, the decoder one per block.
    assert len(names) == 4 * SMALL["num_layers"] + SMALL["num_layers"]
    assert all(0.0 <= r[2] <= 1.0 + 1e-6 for r in rows), rows
    assert not any("state" in vars(m) for m in model.modules() if isinstance(m, MultiheadCrossAttention))


def test_cli_reads_a_checkpoint(tmp_path, capsys):
    from bench.np.train import train

    train("lbanp", 2, tmp_path, overrides=SMALL, checkpoint_every=2, log_every=2, log=lambda msg: None)
    assert main([str(tmp_path), "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "lbanp at step 2" in out and "decoder.blocks.1.attention" in out
