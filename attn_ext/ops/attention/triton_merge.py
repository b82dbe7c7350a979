"""Triton kernels merging two attention states over disjoint key sets (docs/spec.md §1).

A state is ``(out, lse)`` with ``out`` of shape ``[..., Dv]`` and ``lse`` of
shape ``out.shape[:-1]``. The leading dims are flattened to rows and each
program handles ``BLOCK_R`` whole rows (``Dv`` padded to ``BLOCK_DV``), so the
backward's per-row reduction over ``Dv`` never crosses programs. The math
mirrors ``csrc/cpu/merge_states.cpp`` and ``attn_ext/online_softmax.h``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ext.ops.utils.triton import block_dim, check_device, check_dtypes, interpreting
from attn_ext.ops.utils.triton_jit import load_tile

__all__ = ["merge_states_backward", "merge_states_forward"]


@triton.jit
def _merge_fwd_kernel(
    OA, LA, OB, LB, OUT, LSE,
    soa_r, soa_d, sla, sob_r, sob_d, slb, so_r, so_d, sl,
    R, DV,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # int64 rows: rows * row_stride can exceed 2**31 elements.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    r_ok = rows < R
    d_ok = cols < DV
    ok = r_ok[:, None] & d_ok[None, :]

    la = tl.load(LA + rows * sla, mask=r_ok, other=float("-inf"))
    lb = tl.load(LB + rows * slb, mask=r_ok, other=float("-inf"))
    hi = tl.maximum(la, lb)
    lo = tl.minimum(la, lb)
    empty = hi == float("-inf")
    # Factor out the larger lse so the exponent is <= 0 (no overflow, exact for
    # a -inf side); shifting an empty row by 0 avoids (-inf) - (-inf) = NaN.
    rest = tl.exp(lo - tl.where(empty, 0.0, hi))
    # log1p is not available under the interpreter; Goldberg's trick
    # log(u) * x / (u - 1), u = 1 + x, cancels the rounding of 1 + x.
    u = 1.0 + rest
    log1p_rest = tl.where(u == 1.0, rest, tl.log(u) * (rest / tl.where(u == 1.0, 1.0, u - 1.0)))
    lse = tl.where(empty, float("-inf"), hi + log1p_rest)
    w_hi = tl.where(empty, 0.0, 1.0 / u)
    w_lo = rest * w_hi
    a_hi = la > lb  # ties go to the else branch as in the C++ kernel; both weights are 1/2 then
    w_a = tl.where(a_hi, w_hi, w_lo)
    w_b = tl.where(a_hi, w_lo, w_hi)
    # A NaN lse poisons the merge. Said explicitly: on GPUs maximum/minimum may return the non-NaN
    # operand (then NaN beside an empty side would read as empty). A NaN in out needs nothing:
    # w * NaN is NaN even for w = 0.
    nan_row = (la != la) | (lb != lb)
    lse = tl.where(nan_row, float("nan"), lse)
    w_a = tl.where(nan_row, float("nan"), w_a)
    w_b = tl.where(nan_row, float("nan"), w_b)

    oa = load_tile(OA, rows, cols, soa_r, soa_d, r_ok, d_ok, True)
    ob = load_tile(OB, rows, cols, sob_r, sob_d, r_ok, d_ok, True)
    out = w_a[:, None] * oa + w_b[:, None] * ob
    tl.store(OUT + rows[:, None] * so_r + cols[None, :] * so_d, out.to(OUT.dtype.element_ty), mask=ok)
    tl.store(LSE + rows * sl, lse, mask=r_ok)


@triton.jit
def _merge_bwd_kernel(
    G, GL, OA, LA, OB, LB, O, L, GOA, GLA, GOB, GLB,
    sg_r, sg_d, sgl, soa_r, soa_d, sla, sob_r, sob_d, slb, so_r, so_d, sl,
    sgoa_r, sgoa_d, sgla, sgob_r, sgob_d, sglb,
    R, DV,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    r_ok = rows < R
    d_ok = cols < DV
    ok = r_ok[:, None] & d_ok[None, :]

    la = tl.load(LA + rows * sla, mask=r_ok, other=float("-inf"))
    lb = tl.load(LB + rows * slb, mask=r_ok, other=float("-inf"))
    lse = tl.load(L + rows * sl, mask=r_ok, other=float("-inf"))
    gl = tl.load(GL + rows * sgl, mask=r_ok, other=0.0)
    # An empty merged row (lse = -inf) has both sides empty: weight 0, and the
    # shift by 0 keeps (-inf) - (-inf) out of even the unselected branch.
    empty = lse == float("-inf")
    shift = tl.where(empty, 0.0, lse)
    w_a = tl.where(empty, 0.0, tl.exp(la - shift))
    w_b = tl.where(empty, 0.0, tl.exp(lb - shift))

    g = load_tile(G, rows, cols, sg_r, sg_d, r_ok, d_ok, True)
    o = load_tile(O, rows, cols, so_r, so_d, r_ok, d_ok, True)
    oa = load_tile(OA, rows, cols, soa_r, soa_d, r_ok, d_ok, True)
    ob = load_tile(OB, rows, cols, sob_r, sob_d, r_ok, d_ok, True)
    dot_a = tl.sum(g * (oa - o), 1)
    dot_b = tl.sum(g * (ob - o), 1)

    tl.store(GOA + rows[:, None] * sgoa_r + cols[None, :] * sgoa_d,
             (w_a[:, None] * g).to(GOA.dtype.element_ty), mask=ok)
    tl.store(GOB + rows[:, None] * sgob_r + cols[None, :] * sgob_d,
             (w_b[:, None] * g).to(GOB.dtype.element_ty), mask=ok)
    tl.store(GLA + rows * sgla, w_a * (dot_a + gl), mask=r_ok)
    tl.store(GLB + rows * sglb, w_b * (dot_b + gl), mask=r_ok)


# --------------------------------------------------------------------------- wrappers

def _blocks(rows: int, dv: int) -> tuple[int, int]:
    block_dv = block_dim(dv)
    # Each interpreted op is one numpy call per program, so fewer, larger
    # tiles are much faster there; on GPU a ~4K-element tile keeps registers modest.
    tile, cap = (1 << 17, 1024) if interpreting() else (4096, 128)
    block_r = max(1, min(cap, tile // block_dv, triton.next_power_of_2(max(rows, 1))))
    return 1 << (block_r.bit_length() - 1), block_dv


def _check_states(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.dim() < 1 or out_a.shape != out_b.shape:
        raise ValueError(f"attn_ext.merge_states: merged states must have the same out shape, got "
                         f"{tuple(out_a.shape)} and {tuple(out_b.shape)}")
    if lse_a.shape != out_a.shape[:-1] or lse_b.shape != lse_a.shape:
        raise ValueError(f"attn_ext.merge_states: lse must be out.shape[:-1] = {tuple(out_a.shape[:-1])}, got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    check_dtypes(out_a=out_a)  # float64 / unsupported dtypes raise TypeError here
    if out_b.dtype != out_a.dtype:
        raise TypeError(f"attn_ext.merge_states: merged states must share a dtype, got {out_a.dtype} and "
                        f"{out_b.dtype}")
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise TypeError(f"attn_ext.merge_states: lse must be float32 for {out_a.dtype} states, got {lse_a.dtype} "
                        f"and {lse_b.dtype}")


def _rows2d(t: torch.Tensor, rows: int, dv: int) -> torch.Tensor:
    # reshape is a view whenever the leading dims collapse; the kernels take
    # strides, so only genuinely uncollapsible layouts are copied.
    return t.reshape(rows, dv)


def merge_states_forward(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (Triton).

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        Normalised outputs ``[..., Dv]`` (same shape, any strides) in one of
        float32, float16, bfloat16; float64 raises ``TypeError``.
    lse_a, lse_b : torch.Tensor
        float32 log-sum-exp of shape ``out.shape[:-1]``; ``-inf`` marks an
        empty state (no key), whose ``out`` should be 0.

    Returns
    -------
    out : torch.Tensor
        ``w_a * out_a + w_b * out_b`` with ``w_x = exp(lse_x - lse)``, in
        out_a's dtype, contiguous; 0 where both states are empty.
    lse : torch.Tensor
        float32 ``logaddexp(lse_a, lse_b)``, ``-inf`` where both are ``-inf``.

    Notes
    -----
    Math is float32. ``lse`` is formed as ``max + log1p(exp(min - max))`` and
    the weights as ``1 / (1 + r)`` and ``r / (1 + r)`` with ``r = exp(min - max)``,
    as in the C++ kernel, so no exponent is ever positive and finite or empty
    states give no NaN. A NaN lse on either side gives NaN lse and out; a NaN
    in either out gives NaN in those entries of out.
    """
    _check_states(out_a, lse_a, out_b, lse_b)
    check_device(_merge_fwd_kernel, out_a, lse_a, out_b, lse_b)
    dv, rows = out_a.shape[-1], lse_a.numel()
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    if rows == 0:
        return out, lse  # an empty launch grid is an error in Triton
    oa, ob, o2 = (_rows2d(t, rows, dv) for t in (out_a, out_b, out))
    la, lb, l1 = (t.reshape(rows) for t in (lse_a, lse_b, lse))
    block_r, block_dv = _blocks(rows, dv)
    _merge_fwd_kernel[(triton.cdiv(rows, block_r),)](
        oa, la, ob, lb, o2, l1,
        *oa.stride(), *la.stride(), *ob.stride(), *lb.stride(), *o2.stride(), *l1.stride(),
        rows, dv, BLOCK_R=block_r, BLOCK_DV=block_dv)
    return out, lse


def merge_states_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor, out_a: torch.Tensor,
                                    lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                                    out: torch.Tensor, lse: torch.Tensor):
    """Backward of :func:`merge_attention_states` (Triton).

    Parameters
    ----------
    grad_out : torch.Tensor
        Gradient of the merged ``out``, shape and dtype of ``out_a``, any strides.
    grad_lse : torch.Tensor
        float32 gradient of the merged ``lse`` (may be zeros, or an expanded view).
    out_a, lse_a, out_b, lse_b : torch.Tensor
        The forward inputs.
    out, lse : torch.Tensor
        The forward outputs.

    Returns
    -------
    grad_out_a, grad_lse_a, grad_out_b, grad_lse_b : torch.Tensor
        ``grad_out_x = w_x * grad_out`` (dtype of out_a) and
        ``grad_lse_x = w_x * (sum_d grad_out * (out_x - out) + grad_lse)``
        (float32), with ``w_x = exp(lse_x - lse)``, 0 where ``lse = -inf``;
        all contiguous.
    """
    _check_states(out_a, lse_a, out_b, lse_b)
    if grad_out.shape != out_a.shape or out.shape != out_a.shape or grad_lse.shape != lse_a.shape \
            or lse.shape != lse_a.shape:
        raise ValueError(f"attn_ext.merge_states: merge backward got grad_out {tuple(grad_out.shape)}, grad_lse "
                         f"{tuple(grad_lse.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)} for "
                         f"states of shape {tuple(out_a.shape)}")
    if grad_out.dtype != out_a.dtype or out.dtype != out_a.dtype or grad_lse.dtype != torch.float32 \
            or lse.dtype != torch.float32:
        raise TypeError("attn_ext.merge_states: merge backward dtypes must match the states'")
    check_device(_merge_bwd_kernel, grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse)
    dv, rows = out_a.shape[-1], lse_a.numel()
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (out_a, lse_a, out_b, lse_b)]
    if rows == 0:
        return tuple(grads)
    g, oa, ob, o, goa, gob = (_rows2d(t, rows, dv) for t in (grad_out, out_a, out_b, out, grads[0], grads[2]))
    gl, la, lb, l1, gla, glb = (t.reshape(rows) for t in (grad_lse, lse_a, lse_b, lse, grads[1], grads[3]))
    block_r, block_dv = _blocks(rows, dv)
    _merge_bwd_kernel[(triton.cdiv(rows, block_r),)](
        g, gl, oa, la, ob, lb, o, l1, goa, gla, gob, glb,
        *g.stride(), *gl.stride(), *oa.stride(), *la.stride(), *ob.stride(), *lb.stride(),
        *o.stride(), *l1.stride(), *goa.stride(), *gla.stride(), *gob.stride(), *glb.stride(),
        rows, dv, BLOCK_R=block_r, BLOCK_DV=block_dv)
    return tuple(grads)
