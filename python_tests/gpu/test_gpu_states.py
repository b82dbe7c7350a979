"""Attention states on CUDA tensors, ``backend="cuda"`` and ``backend="triton"``: the merge kernels
(forward and backward) against the C++ kernels on the CPU, and states over key chunks merged on the GPU
against one pass over all keys (FlashAttention's rule against fp64). Skipped without a CUDA device."""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from _gpu import DTYPES, backends, cuda, grid, pytorch_same_precision
from _helpers import assert_within_flash_rule, forward_case


@pytest.mark.parametrize("backend", backends("merge_states"))
def test_merge_states_matches_cpu(backend):
    g = torch.Generator().manual_seed(0)
    out_a, out_b = torch.randn(2, 3, 5, 7, generator=g), torch.randn(2, 3, 5, 7, generator=g)
    lse_a, lse_b = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    lse_b[0, 0, 0] = lse_a[0, 0, 0] = float("-inf")  # the (−inf) − (−inf) guard
    expected = torch.ops.attn_ext.merge_states_fwd(out_a, lse_a, out_b, lse_b)
    got = dispatch.kernel("merge_states", backend)(*cuda(out_a, lse_a, out_b, lse_b))
    for x, y in zip(got, expected):
        assert x.device.type == "cuda"
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", backends("merge_states"))
@pytest.mark.parametrize("dtype", grid(DTYPES, (torch.float32,)), ids=str)
def test_merge_states_backward_matches_cpu(backend, dtype):
    g = torch.Generator().manual_seed(1)
    out_a, out_b, grad_out = (torch.randn(2, 3, 5, 7, generator=g).to(dtype) for _ in range(3))
    lse_a, lse_b, grad_lse = (torch.randn(2, 3, 5, generator=g) for _ in range(3))
    lse_b[0, 0, 0] = lse_a[0, 0, 0] = float("-inf")  # an empty merged row: zero gradients, not NaN
    out, lse = torch.ops.attn_ext.merge_states_fwd(out_a, lse_a, out_b, lse_b)
    args = (grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)
    expected = torch.ops.attn_ext.merge_states_bwd(*args)
    got = dispatch.backward_kernel("merge_states", backend)(*cuda(*args))
    for x, y in zip(got, expected):
        assert x.dtype == y.dtype and not bool(x.isnan().any())
        torch.testing.assert_close(x.cpu().float(), y.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", grid(DTYPES, (torch.float32, torch.float16)), ids=str)
def test_chunked_states_merge_to_full_attention(backend, dtype):
    """attention_state over two key halves + merge_states on CUDA equals one pass over all keys."""
    q, k, v, mask, scale, refs = forward_case(2, 2, 33, 150, 64, 40, dtype, layout="contiguous", mask_kind="lengths")
    (out64, lse64), cpu_pt = refs
    out_pt, lse_pt = pytorch_same_precision(q, k, v, mask, scale, cpu_pt, (out64, lse64))
    qc, kc, vc, mc = cuda(q, k, v, mask)
    halves = [ae.attention_state(qc, kc[:, :, sl], vc[:, :, sl], key_padding_mask=None if mc is None else mc[:, sl],
                                 scale=scale, backend=backend) for sl in (slice(0, 70), slice(70, None))]
    merged = ae.merge_states(halves, backend=backend)
    assert_within_flash_rule(merged.out.cpu(), out64, out_pt, name=f"{backend} merged out")
    assert_within_flash_rule(merged.lse.cpu(), lse64, lse_pt, name=f"{backend} merged lse")


@pytest.mark.parametrize("backend", backends())
def test_update_state_matches_recomputation(backend):
    """update_state with new keys on CUDA equals the state recomputed over all keys (the state benchmark's call)."""
    q, k, v, mask, scale, refs = forward_case(1, 4, 128, 80, 64, 64, torch.float32, layout="contiguous")
    (out64, lse64), cpu_pt = refs
    out_pt, lse_pt = pytorch_same_precision(q, k, v, mask, scale, cpu_pt, (out64, lse64))
    qc, kc, vc = cuda(q, k, v)
    state = ae.attention_state(qc, kc[:, :, :64], vc[:, :, :64], scale=scale, backend=backend)
    updated = ae.update_state(state, qc, kc[:, :, 64:], vc[:, :, 64:], scale=scale, backend=backend)
    assert_within_flash_rule(updated.out.cpu(), out64, out_pt, name=f"{backend} updated out")
    assert_within_flash_rule(updated.lse.cpu(), lse64, lse_pt, name=f"{backend} updated lse")
