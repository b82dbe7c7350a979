"""Backend selection asks about the CUDA kernel of the op being called, not always cross_attention_fwd.

Runs on the CPU: the dispatch-table query is monkeypatched, and a stand-in for a CUDA tensor
(only ``device`` and ``dtype`` are read by the CUDA check) reaches the per-op test.
"""
from types import SimpleNamespace

import pytest
import torch

import attn_ext as ae
from attn_ext import backends
from attn_ext.tree import build_tree, tree_aggregate, tree_cross_attention

FAKE_CUDA_Q = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16)


@pytest.fixture
def dispatch_table(monkeypatch):
    """CUDA kernels exist for the ops in the returned set only; every queried name is recorded."""
    present, asked = set(), []

    def has_kernel(op, key):
        asked.append((op, key))
        return op in present

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", has_kernel)
    return present, asked


def test_cuda_check_uses_the_named_op(dispatch_table):
    present, asked = dispatch_table
    present.add("attn_ext::tree_cross_attention_fwd")
    assert backends._cuda_rejection(FAKE_CUDA_Q, "attn_ext::tree_cross_attention_fwd") is None
    reason = backends._cuda_rejection(FAKE_CUDA_Q, "attn_ext::cross_attention_fwd")
    assert "no CUDA kernel for attn_ext::cross_attention_fwd" in reason
    assert asked == [("attn_ext::tree_cross_attention_fwd", "CUDA"), ("attn_ext::cross_attention_fwd", "CUDA")]


def test_default_op_is_cross_attention_fwd(dispatch_table):
    _, asked = dispatch_table
    backends._cuda_rejection(FAKE_CUDA_Q, backends.DEFAULT_OP)
    assert asked == [("attn_ext::cross_attention_fwd", "CUDA")]


def test_public_functions_name_their_op(monkeypatch):
    seen = []
    real = backends.rejection_reasons

    def recording(q, op=backends.DEFAULT_OP):
        seen.append(op)
        return real(q, op)

    monkeypatch.setattr(backends, "rejection_reasons", recording)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 10, 10))

    def called(fn):
        seen.clear()
        fn()
        return set(seen)

    assert called(lambda: ae.cross_attention(q, k, v)) == {"attn_ext::cross_attention_fwd"}
    state = ae.attention_state(q, k, v)
    assert called(lambda: ae.merge_states(state, state)) == {"attn_ext::merge_states_fwd"}
    assert called(lambda: ae.intention(q, k, v)) == {"attn_ext::intention_fwd"}
    tree = build_tree(torch.rand(1, 10, 1, generator=g), branching=2)
    assert called(lambda: tree_aggregate(tree, torch.randn(1, 10, 8, generator=g))) == {
        "attn_ext::tree_aggregate_fwd"}
    node_k = tree_aggregate(tree, k[:, 0])[:, None].expand(1, 2, -1, -1)
    assert called(lambda: tree_cross_attention(q, node_k, node_k, tree)) == {"attn_ext::tree_cross_attention_fwd"}
