"""Parameter and input dtypes of attn_ext.nn.MultiheadAttention, as torch 2.13's module takes them.

torch runs an ``in_proj_bias`` of another float dtype than the weights and the query (it adds it in place,
``(x Wᵀ).add_(b)``, rounding once to the query's dtype, wherever its input is not contiguous: batch-first
batched calls) and returns the query's dtype; we do the same in every layout. A query, key or value of
another dtype than its projection weight is refused by both (ours names the module).
"""
import pytest
import torch

from attn_ext.nn import MultiheadAttention

F64 = torch.float64
# A few roundings of each dtype.
TOL = {F64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-6, atol=2e-6),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _pair(dtype, bias_dtype, **kwargs):
    torch.manual_seed(0)
    reference = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=dtype, **kwargs)
    with torch.no_grad():
        reference.in_proj_bias.data = torch.randn(24, dtype=F64).to(bias_dtype)
        reference.out_proj.bias.normal_()
    ours = MultiheadAttention(8, 2, batch_first=True, dtype=dtype, **kwargs)
    ours.in_proj_bias.data = reference.in_proj_bias.data.clone()
    ours.load_state_dict(reference.state_dict())
    assert ours.in_proj_bias.dtype == bias_dtype
    return reference, ours


def _call(module, layout, q, k, v, need_weights):
    """``module`` on batch-first ``q, k, v`` laid out as ``layout``; out ``[B, L, E]``, weights ``[B, L, S]``."""
    if layout == "batch-first":
        return module(q, k, v, need_weights=need_weights)
    if layout == "seq-first":
        out, weights = module(*(x.transpose(0, 1) for x in (q, k, v)), need_weights=need_weights)
        return out.transpose(0, 1), weights
    outs = [module(q[i], k[i], v[i], need_weights=need_weights) for i in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([w for _, w in outs]) if need_weights else None


def _with_grads(module, layout, q, k, v, need_weights):
    out, weights = _call(module, layout, q, k, v, need_weights)
    total = out.sum() if weights is None else out.sum() + weights.sum()
    return out, weights, torch.autograd.grad(total, [q, k, v, *module.parameters()])


CASES = [(F64, torch.float16, {}), (F64, torch.float32, dict(kdim=6, vdim=5)), (torch.float32, F64, {}),
         (torch.float32, torch.bfloat16, {})]


@pytest.mark.parametrize("dtype, bias_dtype, kwargs", CASES, ids=lambda c: str(c).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["batch-first", "seq-first", "unbatched"])
def test_in_proj_bias_of_another_dtype_runs_as_in_torch(dtype, bias_dtype, kwargs, layout):
    reference, ours = _pair(dtype, bias_dtype, **kwargs)
    ours.batch_first = layout == "batch-first"
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, generator=g, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(2, 5, kwargs.get("kdim", 8), generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(2, 5, kwargs.get("vdim", 8), generator=g, dtype=F64).to(dtype).requires_grad_()
    for need_weights in (False, True):
        # torch runs on its batch-first batched call; the other layouts are the same attention.
        expected = _with_grads(reference, "batch-first", q, k, v, need_weights)
        got = _with_grads(ours, layout, q, k, v, need_weights)
        assert got[0].dtype == dtype and (got[1] is None or got[1].dtype == dtype)
        torch.testing.assert_close(got[0], expected[0], **TOL[dtype])
        if need_weights:
            torch.testing.assert_close(got[1], expected[1], **TOL[dtype])
        for a, b in zip(got[2], expected[2]):
            # The bias's gradient comes in the bias's dtype, as torch's, accurate to the coarser of the two
            # dtypes (rounded to the bias's once per call: twice when unbatched).
            assert a.dtype == b.dtype
            coarser = max(dtype, a.dtype, key=lambda d: torch.finfo(d).eps)
            torch.testing.assert_close(a, b, **TOL[coarser])


def test_input_of_another_dtype_than_its_weight_is_refused_by_name():
    reference, ours = _pair(torch.float32, torch.float32)
    x = torch.randn(2, 4, 8, dtype=F64)
    with pytest.raises(RuntimeError, match="dtype"):
        reference(x, x, x)
    with pytest.raises(TypeError, match=r"attn_ext.nn.MultiheadAttention: query is torch.float64 but its projection "
                                        r"weight is torch.float32"):
        ours(x, x, x)
    y = torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match="attn_ext.nn.MultiheadAttention: value is torch.float64"):
        ours(y, y, x)
