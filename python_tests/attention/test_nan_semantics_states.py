"""NaN and empty states through the state API on every backend: ``merge_states`` (forward and
backward), ``update_state``, ``stream_attention`` (forward and backward), ``remove_from_state`` and
``sharded_cross_attention`` on two gloo processes (docs/cross_attention.md, "NaN, inf and empty rows").

A NaN state merged with anything is NaN; merging with the empty state ``(0, −inf)`` returns the other
state bit for bit; a chunk of NaN keys poisons exactly the (batch, head) it belongs to, and a fully
padded chunk full of garbage changes nothing.
"""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext import distributed as aed

from _helpers import ALL_BACKENDS, require_backend
from _nan_rule import B, DV, H, M, assert_nan_rule, base_inputs, rule_attention, rule_grads
from test_sharded_cross_attention import run_ranks

NAN, INF = math.nan, math.inf


def _merge_inputs():
    g = torch.Generator().manual_seed(7)
    out_a, out_b = torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, DV, generator=g)
    lse_a, lse_b = 3 * torch.randn(B, H, M, generator=g), 3 * torch.randn(B, H, M, generator=g)
    lse_a[0, 0, 0] = NAN                                  # NaN lse: the whole merged row is NaN
    out_a[0, 0, 1, 2] = NAN                               # NaN in out only: that entry, lse finite
    lse_b[0, 1, 0], out_b[0, 1, 0] = -INF, 0.0            # b empty: the merge is a, bit for bit
    lse_a[0, 1, 1], out_a[0, 1, 1] = -INF, 0.0            # a empty: the merge is b, bit for bit
    lse_a[0, 1, 2], lse_b[0, 1, 2], out_b[0, 1, 2] = NAN, -INF, 0.0  # NaN with empty: NaN
    lse_a[1, 0, 0] = lse_b[1, 0, 0] = -INF                # both empty: empty, zero gradients
    out_a[1, 0, 0] = out_b[1, 0, 0] = 0.0
    lse_a[1, 0, 1], out_a[1, 0, 1, 0] = -INF, NAN         # "empty" lse but NaN out: 0 · NaN is NaN
    return out_a, lse_a, out_b, lse_b


def _merge_rule(out_a, lse_a, out_b, lse_b):
    """The merge in the inputs' dtype, differentiable, zero gradient for two empty sides."""
    both = (lse_a == -INF) & (lse_b == -INF)
    zero = torch.zeros((), dtype=lse_a.dtype)
    la, lb = torch.where(both, zero, lse_a), torch.where(both, zero, lse_b)
    lse = torch.logaddexp(la, lb)
    w_a = torch.where(both, zero, torch.exp(la - lse))[..., None]
    w_b = torch.where(both, zero, torch.exp(lb - lse))[..., None]
    return w_a * out_a + w_b * out_b, torch.where(both, -INF, lse)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_states_forward(backend):
    out_a, lse_a, out_b, lse_b = _merge_inputs()
    require_backend(backend, out_a)
    out, lse = ae.merge_states(ae.AttentionState(out_a, lse_a), ae.AttentionState(out_b, lse_b), backend=backend)
    out64, lse64 = _merge_rule(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    out32, lse32 = _merge_rule(out_a, lse_a, out_b, lse_b)
    assert_nan_rule(out, out64, out32, f"{backend} merged out")
    assert_nan_rule(lse, lse64, lse32, f"{backend} merged lse")
    assert torch.isnan(out[0, 0, 1]).tolist() == [c == 2 for c in range(DV)] and not math.isnan(lse[0, 0, 1])
    assert bool(torch.isnan(out[0, 0, 0]).all() and torch.isnan(out[0, 1, 2]).all())
    assert torch.equal(out[0, 1, 0], out_a[0, 1, 0]) and float(lse[0, 1, 0]) == float(lse_a[0, 1, 0])
    assert torch.equal(out[0, 1, 1], out_b[0, 1, 1]) and float(lse[0, 1, 1]) == float(lse_b[0, 1, 1])
    assert bool((out[1, 0, 0] == 0).all()) and float(lse[1, 0, 0]) == -INF
    assert bool(torch.isnan(out[1, 0, 1, 0])) and float(lse[1, 0, 1]) == float(lse_b[1, 0, 1])
    assert int(torch.isnan(lse).sum()) == 2 and int(torch.isnan(out).any(-1).sum()) == 4  # nothing else


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_states_backward(backend):
    inputs = _merge_inputs()
    require_backend(backend, inputs[0])
    g = torch.Generator().manual_seed(8)
    grad_out, grad_lse = torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, generator=g)
    leaves = [t.clone().requires_grad_() for t in inputs]
    merged = ae.merge_states(ae.AttentionState(*leaves[:2]), ae.AttentionState(*leaves[2:]), backend=backend)
    ours = torch.autograd.grad(tuple(merged), leaves, (grad_out, grad_lse))

    def rule(dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
        return torch.autograd.grad(_merge_rule(*xs), xs, (grad_out.to(dtype), grad_lse.to(dtype)))

    def formula():  # the specified backward in fp32: w_x·g and w_x·(g·(o_x − o) + g_lse), w_x = exp(lse_x − lse)
        out, lse = _merge_rule(*inputs)
        grads = []
        for o_x, l_x in (inputs[:2], inputs[2:]):
            w = torch.where(lse == -INF, 0.0, torch.exp(l_x - torch.where(lse == -INF, 0.0, lse)))
            grads += [w[..., None] * grad_out, w * ((grad_out * (o_x - out)).sum(-1) + grad_lse)]
        return grads

    # Calibrated, as for attention, by the worse of fp32 autograd and the fp32 formula, which cancels
    # in o_x − o where autograd need not.
    for name, a, b64, b32, f32 in zip(("d out_a", "d lse_a", "d out_b", "d lse_b"), ours, rule(torch.float64),
                                      rule(torch.float32), formula()):
        keep = ~torch.isnan(b64)
        worse = f32 if (f32 - b64)[keep].abs().max() > (b32 - b64)[keep].abs().max() else b32
        assert_nan_rule(a, b64, worse, f"{backend} {name}", grad=True)
    for grad in ours:  # two empty sides: zero gradients, not NaN
        assert bool((grad[1, 0, 0] == 0).all())


def _concat_rule(q, ks, vs, masks, grads=None):
    k, v, mask = torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(masks, 1)
    if grads is None:
        return (rule_attention(q.double(), k.double(), v.double(), mask), rule_attention(q, k, v, mask))
    return rule_grads(q, k, v, mask, *grads), rule_grads(q, k, v, mask, *grads, dtype=torch.float32)


def _chunks():
    """Three key chunks of the base inputs: clean; a NaN valid key in (1, 1); fully padded garbage."""
    q, k, v, mask = base_inputs()
    mask[0] = False  # every batch entry has keys here
    ks, vs, masks = [k[:, :, :8].clone(), k[:, :, 8:16].clone(), k[:, :, 16:].clone()], \
        [v[:, :, :8].clone(), v[:, :, 8:16].clone(), v[:, :, 16:].clone()], [mask[:, :8], mask[:, 8:16], mask[:, 16:]]
    ks[1][1, 1, 2, 0] = NAN
    masks[2] = torch.ones_like(masks[2])
    ks[2][:], vs[2][:] = NAN, INF
    return q, ks, vs, masks


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_update_state(backend):
    q, ks, vs, masks = _chunks()
    require_backend(backend, q)
    first = ae.attention_state(q, ks[0], vs[0], key_padding_mask=masks[0], backend=backend)
    poisoned = ae.update_state(first, q, ks[1], vs[1], key_padding_mask=masks[1], backend=backend)
    (out64, lse64), (out32, lse32) = _concat_rule(q, ks[:2], vs[:2], masks[:2])
    assert_nan_rule(poisoned.out, out64, out32, f"{backend} update out")
    assert_nan_rule(poisoned.lse, lse64, lse32, f"{backend} update lse")
    assert bool(torch.isnan(poisoned.lse[1, 1]).all()) and int(torch.isnan(poisoned.lse).sum()) == M
    # A fully padded chunk of garbage is the empty state: the state comes back bit for bit.
    same = ae.update_state(first, q, ks[2], vs[2], key_padding_mask=masks[2], backend=backend)
    assert torch.equal(same.out, first.out) and torch.equal(same.lse, first.lse)
    # A NaN state stays NaN whatever is added.
    again = ae.update_state(poisoned, q, ks[0], vs[0], key_padding_mask=masks[0], backend=backend)
    assert torch.equal(torch.isnan(again.lse), torch.isnan(poisoned.lse))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_stream_attention_forward_and_backward(backend):
    q, ks, vs, masks = _chunks()
    require_backend(backend, q)
    g = torch.Generator().manual_seed(9)
    grads = (torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, generator=g))
    leaves = [q.clone().requires_grad_()] + [t.clone().requires_grad_() for t in ks + vs]
    state = ae.stream_attention(leaves[0], iter(list(zip(leaves[1:4], leaves[4:7], masks))), backend=backend)
    (out64, lse64), (out32, lse32) = _concat_rule(q, ks, vs, masks)
    assert_nan_rule(state.out, out64, out32, f"{backend} stream out")
    assert_nan_rule(state.lse, lse64, lse32, f"{backend} stream lse")
    ours = torch.autograd.grad(tuple(state), leaves, grads)
    dq, dk, dv = ours[0], torch.cat(ours[1:4], 2), torch.cat(ours[4:7], 2)
    ref64, ref32 = _concat_rule(q, ks, vs, masks, grads)
    for name, a, b64, b32 in zip(("dq", "dk", "dv"), (dq, dk, dv), ref64, ref32):
        assert_nan_rule(a, b64, b32, f"{backend} stream {name}", grad=True)
    assert bool(torch.isnan(dq[1, 1]).all()) and not bool(torch.isnan(dq[:, 0]).any() or torch.isnan(dq[2]).any())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_remove_from_state(backend):
    q, ks, vs, masks = _chunks()
    require_backend(backend, q)
    clean = ae.attention_state(q, ks[0], vs[0], key_padding_mask=masks[0], backend=backend)
    # Removing keys that hold NaN (here: were clean when added) gives NaN, as the removed state is NaN, ...
    k1_clean = base_inputs()[1][:, :, 8:16]
    added = ae.update_state(clean, q, k1_clean, vs[1], key_padding_mask=masks[1], backend=backend)
    removed = ae.remove_from_state(added, q, ks[1], vs[1], key_padding_mask=masks[1], backend=backend)
    assert torch.equal(torch.isnan(removed.lse), torch.isnan(removed.out).any(-1))
    assert bool(torch.isnan(removed.lse[1, 1]).all()) and int(torch.isnan(removed.lse).sum()) == M
    # ... NaN cannot be removed again, ...
    both = ae.update_state(clean, q, ks[1], vs[1], key_padding_mask=masks[1], backend=backend)
    back = ae.remove_from_state(both, q, ks[1], vs[1], key_padding_mask=masks[1], backend=backend)
    assert bool(torch.isnan(back.lse[1, 1]).all()) and int(torch.isnan(back.lse).sum()) == M
    finite = ~torch.isnan(back.lse)
    torch.testing.assert_close(back.lse[finite], clean.lse[finite], rtol=1e-4, atol=1e-4)
    # ... and removing a fully padded chunk of garbage changes nothing.
    same = ae.remove_from_state(clean, q, ks[2], vs[2], key_padding_mask=masks[2], backend=backend)
    assert torch.equal(same.out, clean.out) and torch.equal(same.lse, clean.lse)


def _sharded_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        q, ks, vs, masks = _chunks()
        # Rank 0: the clean chunk and the padded garbage; rank 1: the chunk with the NaN key.
        mine = [0, 2] if rank == 0 else [1]
        k, v = (torch.cat([t[i] for i in mine], 2).requires_grad_() for t in (ks, vs))
        mask = torch.cat([masks[i] for i in mine], 1)
        mask[0] = True  # batch entry 0 has no valid key on any rank
        q = q.requires_grad_()
        out, lse = aed.sharded_cross_attention(q, k, v, key_padding_mask=mask)
        g = torch.Generator().manual_seed(9)
        grads = (torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, generator=g))
        dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), grads)
        torch.save(dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_cross_attention_over_two_ranks(tmp_path):
    run_ranks(_sharded_worker, (2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    q, ks, vs, masks = _chunks()
    order = [0, 2, 1]  # the keys in rank order
    ks, vs, masks = [ks[i] for i in order], [vs[i] for i in order], [m.clone() for m in (masks[i] for i in order)]
    for m in masks:
        m[0] = True
    (out64, lse64), (out32, lse32) = _concat_rule(q, ks, vs, masks)
    g = torch.Generator().manual_seed(9)
    grads = (torch.randn(B, H, M, DV, generator=g), torch.randn(B, H, M, generator=g))
    ref64, ref32 = _concat_rule(q, ks, vs, masks, grads)
    for r, res in enumerate(got):
        assert_nan_rule(res["out"], out64, out32, f"rank {r} out")
        assert_nan_rule(res["lse"], lse64, lse32, f"rank {r} lse")
        assert bool((res["out"][0] == 0).all() and torch.isneginf(res["lse"][0]).all())
        # The mean-over-ranks loss convention: dq is the full gradient, dk/dv this rank's shard.
        assert_nan_rule(res["dq"], ref64[0], ref32[0], f"rank {r} dq", grad=True)
        shard = slice(0, 20 - 8) if r == 0 else slice(20 - 8, 20)
        for name, a, b64, b32 in (("dk", res["dk"], ref64[1], ref32[1]), ("dv", res["dv"], ref64[2], ref32[2])):
            assert_nan_rule(a, b64[:, :, shard], b32[:, :, shard], f"rank {r} {name}", grad=True)
