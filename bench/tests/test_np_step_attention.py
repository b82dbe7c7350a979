"""The attention of an NP training step (bench.np_step_attention): every softmax-attention call recorded, the SDPA
replay computing what attn_ext's computes (masks folded right), the check seeing a wrong fold, and the profiled
share counting attn_ext's ops once."""
import math
from types import SimpleNamespace

import pytest
import torch

import attn_ext as ae
import bench.bench_np_step as ns
import bench.np_step_attention as na
from attn_ext.models import build_model
from attn_ext.ops.utils import dispatch

F64 = torch.float64
SMALL = {"d_model": 16, "num_layers": 2, "num_heads": 2, "ff_dim": 32, "emb_depth": 2, "num_latents": 8}


def _leaf(*shape, seed, grad=True):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_(grad)


def _recorded(call):
    """The calls recorded from one step that makes ``call()`` and nothing else."""
    calls, counts = na.record_calls(call)
    return calls, counts


def test_every_attention_call_of_a_step_is_recorded_and_dispatch_restored():
    torch.manual_seed(0)
    model = build_model("tnpd", **SMALL)
    calls, counts = na.record_calls(ns.training_step(model, ns.gp_batch(2)))
    modules = sum(isinstance(m, ae.nn.MultiheadAttention) for m in model.modules())
    assert modules == 2 and counts == {"cross_attention": modules} and len(calls) == modules
    for call in calls:
        q, k, v = call.qkv
        assert q.shape == (2, 2, ns.NUM_CONTEXT + ns.NUM_TARGET, 8) and k.shape[-2] == ns.NUM_CONTEXT
        assert all(t.requires_grad and t.grad_fn is None for t in (q, k, v)) and call.grad_out.shape == q.shape
        assert not q.is_contiguous()  # the heads' view of the projection, strides kept

    def failing():
        ae.cross_attention(*(torch.randn(1, 1, 2, 4) for _ in range(3)))
        raise RuntimeError("deliberate")

    original = dispatch.entry
    with pytest.raises(RuntimeError, match="deliberate"):
        na.record_calls(failing)
    assert dispatch.entry is original


def test_other_ops_are_counted_not_replayed():
    q, k, v = _leaf(1, 2, 3, 4, seed=0), _leaf(1, 2, 9, 4, seed=1), _leaf(1, 2, 9, 4, seed=2)
    calls, counts = _recorded(lambda: ae.intention(q, k, v, alpha=1.0).sum().backward())
    assert counts == {"intention": 1} and not calls


@pytest.mark.parametrize("case", ["padding", "padding+causal", "bool+padding", "float+padding", "causal", "gqa+bool",
                                  "cross_attention+padding", "empty rows"])
def test_sdpa_replay_computes_what_attn_ext_computes(case):
    """Each recorded form on attn_ext's op and on SDPA with the masks folded gives the same outputs and
    gradients (fp64); a fold that dropped the padding or the causal flag would differ."""
    B, H, L, S, D = 2, 4, 5, 7, 8
    q, k, v = _leaf(B, H, L, D, seed=0), _leaf(B, H if "gqa" not in case else 2, S, D, seed=1), \
        _leaf(B, H if "gqa" not in case else 2, S, 3, seed=2)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, 4:] = True
    if case == "empty rows":
        padding[1] = True
    mask = None
    if "bool" in case:
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(3)) > 0.3
    if "float" in case:
        mask = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(3), dtype=F64)

    def step():
        if case.startswith("cross_attention") or case == "empty rows":
            out = ae.cross_attention(q, k, v, key_padding_mask=padding, scale=0.3)
        else:
            out = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal="causal" in case, scale=0.3,
                                                  key_padding_mask=None if "padding" not in case else padding,
                                                  enable_gqa="gqa" in case)
        out.sum().backward()

    calls, _ = _recorded(step)
    assert len(calls) == 1
    assert na.check_replay(calls) < 1e-12
    # The masks matter here: without them the attention would be another one (so a lost fold would show).
    q, k, v = calls[0].qkv
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa="gqa" in case)
    assert (na.ours_call(calls[0]) - plain).abs().max().item() > 1e-3


def test_check_replay_sees_a_wrong_fold(monkeypatch):
    q, k, v = _leaf(1, 2, 4, 8, seed=0), _leaf(1, 2, 6, 8, seed=1), _leaf(1, 2, 6, 8, seed=2)
    padding = torch.tensor([[False, False, False, True, True, True]])
    calls, _ = _recorded(lambda: ae.cross_attention(q, k, v, key_padding_mask=padding).sum().backward())
    assert na.check_replay(calls) < 1e-12
    monkeypatch.setattr(na, "_sdpa_mask", lambda L, S, mask, padding, is_causal, device: (mask, is_causal))
    assert na.check_replay(calls) > 1e-2


def test_replay_differentiates_what_required_grad():
    q, k, v = _leaf(1, 2, 4, 8, seed=0), _leaf(1, 2, 6, 8, seed=1, grad=False), _leaf(1, 2, 6, 8, seed=2)
    calls, _ = _recorded(lambda: ae.cross_attention(q, k, v).sum().backward())
    assert [t.shape for t in calls[0].leaves()] == [q.shape, v.shape]
    na.replay(calls, na.ours_call)
    na.replay(calls, na.sdpa_call)


def _event(name, us, parent=None):
    return SimpleNamespace(name=name, cpu_time_total=us, cpu_parent=parent)


def test_op_time_counts_nested_attn_ext_events_once():
    outer = _event("attn_ext::scaled_dot_product_attention_fwd", 100.0)
    inner = _event("attn_ext::cross_attention_fwd", 60.0, outer)
    aten = _event("aten::mm", 500.0)
    under_aten = _event("attn_ext::merge_states_fwd", 7.0, _event("aten::linear", 50.0))
    assert na._outermost_op_time_us([outer, inner, aten, under_aten]) == 107.0


def test_share_is_the_part_of_the_step_in_attn_ext_ops():
    q, k, v = (torch.randn(4, 4, 64, 32, requires_grad=True) for _ in range(3))
    w = torch.randn(512, 512)

    def attention_only():
        ae.cross_attention(q, k, v).sum().backward()

    def with_matmuls():
        attention_only()
        for _ in range(20):
            w @ w

    alone, diluted = na.attention_share(attention_only, 2), na.attention_share(with_matmuls, 2)
    # No lower bound on the share itself: it is a fraction of wall time, which a loaded machine stretches
    # (0.99 alone on the AMD EPYC 2-core machine; 0.23 once inside the full suite beside two compiles).
    assert 0.0 < alone["share"] <= 1.0 and diluted["share"] < alone["share"]
    assert na.attention_share(lambda: w @ w, 1)["share"] == 0.0
    assert alone["steps"] == 2 and alone["op_ms"] <= alone["step_ms"] and not math.isnan(diluted["op_ms"])
