"""Triton backward of chunked cross attention and of the general attention op (FlashAttention-2 style).

Three launches, all deterministic (every output element is written by exactly
one program, no atomics):

1. ``_bwd_preprocess``: ``delta_i = dO_i . o_i - dlse_i`` (float32). Folding
   ``dlse`` into delta turns ``dS = P (dP - Delta + dlse)`` into the usual
   ``dS = P (dP - delta)`` so the two main kernels stay oblivious of it.
2. ``_bwd_dkdv``: one program per key block (and key/value head), looping over query blocks (and the
   query heads of its group).
3. ``_bwd_dq``: one program per query block, looping over key blocks.

The main kernels (:mod:`.triton_bwd_kernels`) say how ``P`` is recomputed, how empty and NaN rows
and masked pairs are handled, and what their constexpr flags add for the general op. On Hopper, with
``ATTN_EXT_TRITON_TMA=1``, calls without masks or dropout take 2 and 3 through TMA descriptors instead
(:mod:`.triton_bwd_tma`), after the same preprocess.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn_ext.ops.attention import naive
from attn_ext.ops.attention.triton_args import check_attention_args
from attn_ext.ops.attention.triton_bwd_kernels import _bwd_dkdv, _bwd_dq
from attn_ext.ops.attention.triton_bwd_tma import launch_backward_tma, tma_backward_unavailable_reason
from attn_ext.ops.attention.band import Band
from attn_ext.ops.attention.triton_pairs import all_finite, attn_mask_arg, dropout_arg
from attn_ext.ops.attention.triton_score_mod import ScoreArgs, kernel_scores, score_args
from attn_ext.ops.attention.triton_varlen import Packed, packed_args, packed_call, packed_scores
from attn_ext.ops.attention.triton_tiles import autotuned, block_d, block_m_interpreted, launch
from attn_ext.ops.utils.triton import check_device, check_dtypes, interpreting, mask_arg
from attn_ext.ops.utils.validation import check_cross_attention_args

__all__ = ["attention_backward", "backward_route", "cross_attention_backward", "has_saturated_rows", "launch_backward"]


@triton.jit
def _bwd_preprocess(
    OUT, DO, DLSE, DELTA,
    sob, soh, som, sod,
    sdob, sdoh, sdom, sdod,
    sgb, sgh, sgm,
    H, M, DV,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    tile_ok = m_ok[:, None] & (offs_dv[None, :] < DV)
    o = tl.load(OUT + off_b * sob + off_h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
                mask=tile_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * sdob + off_h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :] * sdod,
                 mask=tile_ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + off_b * sgb + off_h * sgh + offs_m * sgm, mask=m_ok, other=0.0).to(tl.float32)
    # DELTA is a fresh contiguous [B*H, M] buffer.
    tl.store(DELTA + pid_bh.to(tl.int64) * M + offs_m, delta, mask=m_ok)


_bwd_dkdv_tuned = autotuned(_bwd_dkdv, "backward")
_bwd_dq_tuned = autotuned(_bwd_dq, "backward")


def has_saturated_rows(lse: torch.Tensor) -> bool:
    """Whether a finite lse reaches the magnitude where fp32 has rounded its log(sum) away."""

    return bool(_saturated(lse))


def _saturated(lse: Tensor) -> Tensor:
    return (torch.isfinite(lse) & (lse.abs() >= naive.PRECISE_NORMALISER_LSE)).any()


def backward_route(lse: Tensor, q: Tensor, k: Tensor, pair_rules: bool) -> tuple[bool, bool]:
    """``(saturated, guard_rows)`` of a backward call, read with one host sync: whether a row's ``lse`` is
    saturated (the reference backward then runs), and whether the kernels must guard their products against a
    non-finite row of ``q`` (dK's ``dSᵀQ``) or ``k`` (dQ's ``dS K``) met through a masked pair. Only calls with
    per-pair rules (``pair_rules``: the causal rule or an attention mask) have such pairs, and only a non-finite
    ``q`` or ``k`` makes the guard do anything; the guard's code costs the dK/dV kernel its registers (D = 128:
    spills in every full-rate tile on sm_90), so the common, finite call runs the kernels without it."""
    if not pair_rules:
        return bool(_saturated(lse)), False
    saturated, finite = torch.stack([_saturated(lse), all_finite(q, k)]).tolist()
    return bool(saturated), not finite


def cross_attention_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                             out: torch.Tensor, lse: torch.Tensor, scale: float,
                             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`cross_attention_forward` (Triton, deterministic).

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, H, M, Dv]``, gradient of ``out``, same dtype as q; any strides.
    grad_lse : torch.Tensor or None
        ``[B, H, M]`` gradient of ``lse`` (read as float32; any strides,
        including the stride-0 result of ``expand``). ``None`` means zeros.
    q, k, v : torch.Tensor
        The forward inputs, ``[B, H, M, D]``, ``[B, H, N, D]``,
        ``[B, H, N, Dv]``; one dtype among float32, float16, bfloat16.
    key_padding_mask : torch.Tensor or None
        Bool ``[B, N]``, True marks a padded key.
    out : torch.Tensor
        The forward output ``[B, H, M, Dv]``.
    lse : torch.Tensor
        The forward float32 natural-log log-sum-exp ``[B, H, M]``.
    scale : float
        The forward scale.
    chunk_size : int
        Hint for the key tile ``BLOCK_N``, as in the forward.

    Returns
    -------
    grad_q, grad_k, grad_v : torch.Tensor
        Contiguous, in the dtypes of q, k and v. Padded keys and query rows
        without any valid key get exactly zero gradient; NaN rows get NaN.

    Notes
    -----
    Implements ``dS = P (dO v^T - Delta + dlse)`` with ``Delta = rowsum(dO o)``,
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``, in float32.
    The key-side and query-side gradients come from two separate kernels
    that each recompute ``P``: about 2.5x the forward's FLOPs but no atomics,
    so results are bitwise reproducible run to run.
    """
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op="cross_attention")
    if has_saturated_rows(lse):  # no per-pair rules here, so no guard to decide
        # The kernels rebuild P = exp(s - lse) from the fp32 lse, which at |lse| >= 512 has rounded log(sum)
        # away (tied keys would each get P = 1). Until the forward saves (max, log sum) apart, such calls run
        # the reference backward, which recomputes those rows' normaliser. Costs one host sync per call.
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grads = naive.cross_attention_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)
        return tuple(g.contiguous() for g in grads)
    return launch_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size)


def launch_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, key_padding_mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                    scale: float, chunk_size: int, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None,
                    guard_rows: Optional[bool] = None, scores: Optional[ScoreArgs] = None,
                    packed: Optional[Packed] = None):
    """The three backward kernels on checked q, k, v and masks (``k``, ``v`` may have fewer heads than
    ``q``; the mask, causal, dropout and ``scores`` arguments as for ``launch_forward``). ``guard_rows``: whether q or k may
    hold a non-finite row (:func:`backward_route` decides it with its other check); None: found out here, with a
    host sync, for calls with the causal rule or an attention mask."""
    tensors = [grad_out, q, k, v, out, lse] + [t for t in (grad_lse, key_padding_mask, attn_mask) if t is not None]
    check_device(_bwd_dq, *tensors)
    dtype = check_dtypes(q=q, k=k, v=v)
    B, H, M, D = q.shape
    HKV, N, DV = k.shape[1], k.shape[2], v.shape[3]
    if tuple(grad_out.shape) != (B, H, M, DV) or tuple(out.shape) != (B, H, M, DV):
        raise ValueError(f"grad_out and out must have shape {(B, H, M, DV)}, "
                         f"got {tuple(grad_out.shape)} and {tuple(out.shape)}")
    if grad_out.dtype != dtype:
        raise TypeError(f"grad_out must have dtype {dtype}, got {grad_out.dtype}")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is not None and tuple(t.shape) != (B, H, M):
            raise ValueError(f"{name} must have shape {(B, H, M)}, got {tuple(t.shape)}")
    mask, smb, smn, has_mask = mask_arg(key_padding_mask, q)
    attn, attn_strides, attn_kind = attn_mask_arg(attn_mask, q)
    seed, threshold, drop_scale, has_dropout = dropout_arg(dropout_p, dropout_seed, q)

    grad_q = torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    grad_k = torch.empty((B, HKV, N, D), dtype=k.dtype, device=k.device)
    grad_v = torch.empty((B, HKV, N, DV), dtype=v.dtype, device=v.device)
    if B * H == 0 or M == 0 or N == 0:
        # Nothing to attend to or from: every gradient is identically zero.
        return grad_q.zero_(), grad_k.zero_(), grad_v.zero_()

    interp = interpreting()
    block_dv = block_d(DV)
    delta = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    pre_m = block_m_interpreted(M) if interp else 64
    has_dlse = grad_lse is not None
    dlse = grad_lse if has_dlse else lse
    _bwd_preprocess[(triton.cdiv(M, pre_m), B * H)](
        out, grad_out, dlse, delta, *out.stride(), *grad_out.stride(), *dlse.stride(), H, M, DV,
        HAS_DLSE=has_dlse, BLOCK_M=pre_m, BLOCK_DV=block_dv)

    if scores is None:
        scores = score_args(None, 0.0, None, 0, M, N, q)
    if guard_rows is None:
        guard_rows = (bool(is_causal) or scores.window or attn_mask is not None) and not bool(all_finite(q, k))
    if (not any(scores.meta.values()) and packed is None
            and tma_backward_unavailable_reason(grad_out, q, k, v, key_padding_mask, attn_mask, dropout_p) is None):
        return launch_backward_tma(grad_out, q, k, v, lse, delta, scale, chunk_size, is_causal, guard_rows)

    common = (q, k, v, mask, attn, seed, grad_out, lse, delta)
    strides = (*q.stride(), *k.stride(), *v.stride(), smb, smn, *attn_strides, *grad_out.stride(), *lse.stride())
    cu_args, varlen_meta = packed_args(packed, q)
    sizes = (H, H // HKV, M, N, D, DV, float(scale), threshold, drop_scale, *scores.args, *cu_args)
    meta = dict(HAS_MASK=has_mask, ATTN_MASK=attn_kind, IS_CAUSAL=bool(is_causal), HAS_DROPOUT=has_dropout,
                GUARD_ROWS=bool(guard_rows), UPCAST=interp, **scores.meta, **varlen_meta, BLOCK_D=block_d(D),
                BLOCK_DV=block_dv)
    # A packed batch: programs per block of the longest sequence, per sequence and head (triton_varlen).
    rows, keys, entries = (M, N, B) if packed is None else (packed.max_q, packed.max_k, packed.sequences)
    if packed is not None:
        # A key of no sequence (total_k beyond the last offset cannot happen: checked) or of a sequence without
        # queries gets no program that writes it otherwise.
        grad_k.zero_(), grad_v.zero_()
    launch(_bwd_dkdv, _bwd_dkdv_tuned, lambda meta: (max(1, triton.cdiv(keys, meta["BLOCK_N"])), entries * HKV),
           (*common, grad_k, grad_v, *strides, *grad_k.stride(), *grad_v.stride(), *sizes),
           meta, rows, keys, chunk_size)
    launch(_bwd_dq, _bwd_dq_tuned, lambda meta: (max(1, triton.cdiv(rows, meta["BLOCK_M"])), entries * H),
           (*common, grad_q, *strides, *grad_q.stride(), *sizes), meta, rows, keys, chunk_size)
    return grad_q, grad_k, grad_v


# --------------------------------------------------------------------------- the general op (attention_bwd_triton)


def attention_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                       attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], out: Tensor, lse: Tensor,
                       scale: float, is_causal: bool, dropout_p: float, dropout_seed: Optional[Tensor],
                       chunk_size: int, window_left: int = -1, window_right: int = -1, diagonal: int = 0,
                       softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                       cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                       bottom_right: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attn_ext.ops.attention.triton_fwd.attention_forward` (Triton, deterministic).

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, Hq, L, Dv]`` gradient of ``out``, q's dtype, any strides.
    grad_lse : torch.Tensor or None
        ``[B, Hq, L]`` gradient of ``lse`` (read as float32, any strides); None means zeros.
    q, k, v, attn_mask, key_padding_mask, scale, is_causal, dropout_p, dropout_seed, chunk_size
        The forward's arguments (the same seed: dropout drops the same pairs).
    window_left, window_right, diagonal, softcap, alibi_slopes
        The forward's band and score modifications (the soft cap's factor ``1 − tanh²`` enters ``dS``; ALiBi's
        slopes get no gradient).
    cu_seqlens_q, cu_seqlens_k, bottom_right
        The forward's packed batch, if any.
    out, lse : torch.Tensor
        The forward's results.

    Returns
    -------
    grad_q, grad_k, grad_v : torch.Tensor
        Contiguous, shapes and dtypes of q, k, v. Pairs that are not allowed contribute nothing;
        padded keys, keys no query attends and rows without an allowed key get exactly zero.

    Notes
    -----
    ``dV = (P∘Z)ᵀ dO``, ``dS = P ∘ ((dO Vᵀ)∘Z − Δ + dlse)``, ``Δ = rowsum(dO ∘ out)``, ``Z`` the
    keep mask over ``1 − p``, in float32. Rows whose finite ``lse`` reaches 512 in magnitude (fp32
    has rounded their ``log(sum)`` away) run the reference backward instead, as cross attention does.
    """
    check_attention_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size)
    packed = None
    if cu_seqlens_q is not None:
        packed = packed_call(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], bottom_right)
        scores = packed_scores(packed, is_causal, window_left, window_right, softcap, alibi_slopes, q)
    else:
        band = Band.of(is_causal, window_left, window_right, diagonal)
        scores = kernel_scores(band, is_causal, softcap, alibi_slopes, diagonal, q, k)
    saturated, guard_rows = backward_route(lse, q, k, bool(is_causal) or attn_mask is not None or scores.window)
    if saturated:
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        grads = torch.ops.attn_ext.attention_bwd_reference(grad_out, grad_lse, q, k, v, attn_mask, key_padding_mask,
                                                           out, lse, scale, is_causal, dropout_p, dropout_seed,
                                                           chunk_size, window_left, window_right, diagonal, softcap,
                                                           alibi_slopes, cu_seqlens_q, cu_seqlens_k, bottom_right)
        return tuple(g.contiguous() for g in grads)
    return launch_backward(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, scale, chunk_size,
                           attn_mask=attn_mask, is_causal=is_causal and not scores.window, dropout_p=float(dropout_p),
                           dropout_seed=dropout_seed, guard_rows=guard_rows, scores=scores, packed=packed)
