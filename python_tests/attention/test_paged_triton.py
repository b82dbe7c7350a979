"""``ae.paged_attention`` on the Triton kernels (the interpreter): the forward reads each key and value row through the
block table in place (never gathered) and equals the attention over each entry's cache laid out contiguously (fp64
reference), with blocks in any order, block sizes that do not divide the key tiles, partial last blocks, an empty
entry, grouped heads, the causal rule among the new tokens, a window with softcap and ALiBi; caches that are views of
a larger pool (block and feature strides); NaN in blocks no entry uses never reaches an output; the split over keys
of a decoding step (forced here, chosen by shape on a GPU) gives the same; the op's schema and fake kernel.
"""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils.triton import triton_unavailable_reason
from test_paged_attention import CASES, cache

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")


def _reference(q, contiguous, slopes, **kw):
    """Per entry: the contiguous cache's attention in fp64 (reference backend)."""
    outs, lses = [], []
    for b, (keys, values) in enumerate(contiguous):
        o, l = ae.scaled_dot_product_attention(q[b:b + 1].double(), keys[None].double(), values[None].double(),
                                               alignment="bottom_right", enable_gqa=True, return_lse=True,
                                               alibi_slopes=None if slopes is None else slopes[b],
                                               backend="reference", **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("M", [1, 3])
def test_reads_the_cache_through_the_table(block_size, case, M):
    is_causal, window, softcap, alibi = case
    lengths = [130, 7, 0, 64]
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, block_size=block_size)
    q = torch.randn(len(lengths), 4, M, 8, dtype=torch.float64)
    slopes = torch.rand(len(lengths), 4, generator=torch.Generator().manual_seed(3)) if alibi else None
    kw = dict(is_causal=is_causal, window_size=window, softcap=softcap)
    out, lse = ae.paged_attention(q.float(), k_cache.float(), v_cache.float(), table, seqlens, alibi_slopes=slopes,
                                  return_lse=True, backend="triton", **kw)
    ref, ref_lse = _reference(q, contiguous, slopes, **kw)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()  # the entry without keys


def test_caches_that_are_views_of_a_pool_and_nan_in_unused_blocks():
    lengths = [40, 23]
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, block_size=4, D=8, Dv=6)
    pool_k = torch.full((2 * k_cache.shape[0], 4, 2, 11), float("nan"), dtype=torch.float32)
    pool_v = torch.full((2 * v_cache.shape[0], 4, 2, 9), float("nan"), dtype=torch.float32)
    pool_k[::2, :, :, :8], pool_v[::2, :, :, :6] = k_cache.float(), v_cache.float()
    k_view, v_view = pool_k[::2, :, :, :8], pool_v[::2, :, :, :6]  # block stride doubled, rows padded with NaN
    used = table[0, :10].tolist() + table[1, :6].tolist()
    unused = [i for i in range(k_cache.shape[0]) if i not in used]
    assert unused
    k_view[unused], v_view[unused] = float("nan"), float("inf")  # blocks no entry uses: never read
    q = torch.randn(2, 4, 2, 8, dtype=torch.float64)
    out = ae.paged_attention(q.float(), k_view, v_view, table, seqlens, is_causal=True, backend="triton")
    ref, _ = _reference(q, contiguous, None, is_causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 3])
def test_split_over_keys_equals_one_program_per_head(parts):
    from attn_ext.ops.attention.triton_paged import paged_forward

    lengths = [300, 129, 0]
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, block_size=16, D=16, Dv=16)
    q = torch.randn(3, 4, 1, 16)
    args = (q, k_cache.float(), v_cache.float(), table, lengths, 0.25, True, -1, -1, 0.0, None, 64)
    whole = paged_forward(*args)
    split = paged_forward(*args, key_parts=parts)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-5)
    ref, _ = _reference(q.double(), contiguous, None, is_causal=True, scale=0.25)
    torch.testing.assert_close(split[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_the_op_schema_fake_kernel_and_refusals():
    k_cache, v_cache, table, seqlens, _ = cache([6, 3])
    q = torch.randn(2, 2, 1, 8)
    op = torch.ops.attn_ext.paged_attention_fwd_triton
    args = (q, k_cache.float(), v_cache.float(), table, seqlens, 0.3, True, 2, 0, 1.5, None, 512)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="not differentiable"):
        op(q.requires_grad_(), *args[1:])
    assert math.isfinite(float(op(q.detach(), *args[1:])[0].abs().max()))
