"""``ae.paged_attention``: new tokens over a paged key/value cache equal the same attention over the cache laid out
contiguously (fp64, outputs, lse and gradients), with the blocks in any order, partial last blocks, empty entries,
grouped heads, the causal rule among the new tokens, windows, softcap and ALiBi; bad tables and lengths named."""
import pytest
import torch

import attn_ext as ae
from _sdpa_ref import backends, require

F64 = torch.float64


def cache(lengths, block_size=4, Hkv=2, D=8, Dv=6, spare=3, seed=0, grad=False):
    """``(k_cache, v_cache, block_table, cache_seqlens, contiguous keys and values per entry)``: each entry's blocks
    drawn at random from the pool (never shared), the unused table slots holding an out-of-range id."""
    g = torch.Generator().manual_seed(seed)
    per_entry = [(n + block_size - 1) // block_size for n in lengths]
    max_blocks = max(per_entry + [1])
    num_blocks = sum(per_entry) + spare
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g, dtype=F64)
    v_cache = torch.randn(num_blocks, block_size, Hkv, Dv, generator=g, dtype=F64)
    k_cache.requires_grad_(grad), v_cache.requires_grad_(grad)
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lengths), max_blocks), 10_000, dtype=torch.int32)  # never read past the used blocks
    contiguous = []
    for b, (n, nb) in enumerate(zip(lengths, per_entry)):
        ids = [order.pop() for _ in range(nb)]
        table[b, :nb] = torch.tensor(ids, dtype=torch.int32)
        rows = lambda c: c[ids].reshape(nb * block_size, Hkv, c.shape[-1])[:n].transpose(0, 1)  # noqa: E731
        contiguous.append((rows(k_cache), rows(v_cache)))
    return k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32), contiguous


CASES = [  # is_causal, window, softcap, alibi
    (False, None, None, False),
    (True, None, None, False),
    (True, (5, 0), 2.0, True),
]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("M", [1, 3])
def test_equals_the_contiguous_cache(backend, case, M):
    is_causal, window, softcap, alibi = case
    lengths = [13, 4, 0, 9]
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, grad=True)
    require(backend, k_cache)
    H = 4
    q = torch.randn(len(lengths), H, M, 8, dtype=F64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    out, lse = ae.paged_attention(q, k_cache, v_cache, table, seqlens, is_causal=is_causal, window_size=window,
                                  softcap=softcap, alibi_slopes=slopes, return_lse=True, backend=backend)
    assert out.shape == (len(lengths), H, M, 6) and lse.shape == (len(lengths), H, M)
    refs = []
    for b, (keys, values) in enumerate(contiguous):
        o, l = ae.scaled_dot_product_attention(q[b:b + 1], keys[None], values[None], is_causal=is_causal,
                                               alignment="bottom_right", window_size=window, softcap=softcap,
                                               alibi_slopes=slopes, enable_gqa=True, return_lse=True,
                                               backend="reference")
        refs.append((o, l))
    ref = torch.cat([o for o, _ in refs])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, torch.cat([l for _, l in refs]), rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    leaves = (q, k_cache, v_cache)
    for a, r, name in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g), ("q", "k", "v")):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


def test_a_block_no_entry_uses_gets_no_gradient_and_is_never_read():
    k_cache, v_cache, table, seqlens, _ = cache([6, 3], spare=2)
    used = set(table[0, :2].tolist()) | {int(table[1, 0])}
    unused = [i for i in range(k_cache.shape[0]) if i not in used]
    k_cache[unused] = float("nan")  # never read
    k_cache.requires_grad_()
    out = ae.paged_attention(torch.randn(2, 2, 1, 8, dtype=F64), k_cache, v_cache, table, seqlens)
    assert torch.isfinite(out).all()
    (grad,) = torch.autograd.grad(out.sum(), k_cache)
    assert (grad[unused] == 0).all()


@pytest.mark.parametrize("change, error, match", [
    (lambda a: dict(a, block_table=a["block_table"].long()), TypeError, "int32"),
    (lambda a: dict(a, cache_seqlens=torch.tensor([99, 3], dtype=torch.int32)), ValueError, "outside"),
    (lambda a: dict(a, cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, "outside"),
    (lambda a: dict(a, block_table=torch.tensor([[0, 50], [1, 2]], dtype=torch.int32)), ValueError, "block outside"),
    (lambda a: dict(a, q=a["q"][:1]), ValueError, "batch"),
    (lambda a: dict(a, v_cache=a["v_cache"][:, :2]), ValueError, "agree"),
    (lambda a: dict(a, q=a["q"][..., :4]), ValueError, "head dim"),
    (lambda a: dict(a, window_size=(-3, 0)), ValueError, "paged_attention: window_size"),
])
def test_bad_arguments_are_named(change, error, match):
    k_cache, v_cache, table, seqlens, _ = cache([6, 3])
    args = dict(q=torch.randn(2, 2, 1, 8, dtype=F64), k_cache=k_cache, v_cache=v_cache, block_table=table,
                cache_seqlens=seqlens)
    with pytest.raises(error, match=match):
        ae.paged_attention(**change(args))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("block_size", [4, 64])  # chunks spanning blocks (gathered) and within one (a view)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_inference_reads_the_cache_through_the_table(backend, block_size, case):
    is_causal, window, softcap, alibi = case
    lengths = [130, 7, 0, 64]
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, block_size=block_size)
    require(backend, k_cache)
    q = torch.randn(len(lengths), 4, 2, 8, dtype=F64)
    slopes = torch.rand(len(lengths), 4, generator=torch.Generator().manual_seed(3)) if alibi else None
    out, lse = ae.paged_attention(q, k_cache, v_cache, table, seqlens, is_causal=is_causal, window_size=window,
                                  softcap=softcap, alibi_slopes=slopes, return_lse=True, backend=backend)
    for b, (keys, values) in enumerate(contiguous):
        o, l = ae.scaled_dot_product_attention(q[b:b + 1], keys[None], values[None], is_causal=is_causal,
                                               alignment="bottom_right", window_size=window, softcap=softcap,
                                               alibi_slopes=None if slopes is None else slopes[b], enable_gqa=True,
                                               return_lse=True, backend="reference")
        torch.testing.assert_close(out[b:b + 1], o, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lse[b:b + 1], l, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inference_in_low_precision_equals_the_contiguous_kernels(dtype):
    k_cache, v_cache, table, seqlens, contiguous = cache([77, 33], block_size=8)
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    q, k_cache, v_cache = (t.to(dtype) for t in (q, k_cache, v_cache))
    out = ae.paged_attention(q, k_cache, v_cache, table, seqlens, is_causal=True)
    for b, (keys, values) in enumerate(contiguous):
        ref = ae.scaled_dot_product_attention(q[b:b + 1], keys[None].to(dtype), values[None].to(dtype),
                                              is_causal=True, alignment="bottom_right", enable_gqa=True)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=0, atol=2e-3 if dtype == torch.bfloat16 else 1e-6)


def test_the_op_refuses_derivatives_and_bad_tables():
    k_cache, v_cache, table, seqlens, _ = cache([6, 3])
    q = torch.randn(2, 2, 1, 8, dtype=F64)
    ops = [torch.ops.attn_ext.paged_attention_fwd_reference]
    if hasattr(torch.ops.attn_ext, "paged_attention_fwd"):
        ops.append(torch.ops.attn_ext.paged_attention_fwd)
    for op in ops:
        with pytest.raises(RuntimeError, match="not differentiable"):
            op(q.requires_grad_(), k_cache, v_cache, table, seqlens, 0.3, False, -1, -1, 0.0, None, 512)
        q = q.detach()
        torch.library.opcheck(op, (q, k_cache, v_cache, table, seqlens, 0.3, True, 2, 0, 1.5, None, 512),
                              test_utils=("test_schema", "test_faketensor"))
    if hasattr(torch.ops.attn_ext, "paged_attention_fwd"):
        bad = table.clone()
        bad[0, 1] = 999
        with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
            torch.ops.attn_ext.paged_attention_fwd(q, k_cache, v_cache, bad, seqlens, 0.3, False, -1, -1, 0.0, None,
                                                   512)


@pytest.mark.parametrize("M", [1, 16, 17])  # decoding (all heads of an entry in one unit, chunk by chunk) and not
def test_long_cache_split_over_keys_equals_the_contiguous_cache(M):
    """One entry, a long cache of 16-key blocks: the decoding path splits the keys among the threads and merges the
    parts; M = 17 takes the general loop."""
    k_cache, v_cache, table, seqlens, contiguous = cache([9000], block_size=16, Hkv=2, D=64, Dv=64)  # ≥ 2^22 MACs
    require("cpp", k_cache)
    q = torch.randn(1, 4, M, 64, dtype=F64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, lse = ae.paged_attention(q, k_cache, v_cache, table, seqlens, is_causal=True, softcap=3.0,
                                      return_lse=True, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    keys, values = contiguous[0]
    o, l = ae.scaled_dot_product_attention(q, keys[None], values[None], is_causal=True, alignment="bottom_right",
                                           softcap=3.0, enable_gqa=True, return_lse=True, backend="reference")
    torch.testing.assert_close(out, o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, l, rtol=1e-10, atol=1e-12)
