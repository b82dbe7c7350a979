"""Triton forward and backward of Intention, primal form (docs/spec.md §4): ``out = scale·Q (KᵀK + αI)⁻¹ KᵀV``.

The math is that of csrc/cpu/intention.cpp; the readable reference is
:func:`attn_ext.ops.intention.naive.intention_primal`. With ``A = G + αI = L Lᵀ`` and ``W = A⁻¹ C``:

* forward: ``G = KᵀK``, ``C = KᵀV`` over the valid keys; ``L``, ``W`` (:mod:`.intention_solve`);
  ``out = scale·Q W``;
* backward: ``dQ = scale·dY Wᵀ``, ``dB = A⁻¹(scale·Qᵀ dY)``, ``dV = K dB``,
  ``dK = −K(dB Wᵀ + W dBᵀ) + V dBᵀ = (V − K W) dBᵀ − dV Wᵀ``, ``dα = −Σ dB ⊙ W``.

Kernels (all accumulate in fp32; ``D``, ``Dv`` are padded to powers of two ≥ 16 for ``tl.dot``):

``_transposed_product_kernel``
    ``OUT = scale·Aᵀ X`` summed over rows, grid ``(B·H, column tiles of X)``, looping over row blocks of
    ``BLOCK_N`` with ``tl.dot`` on ``[BLOCK_D, BLOCK_N] × [BLOCK_N, BLOCK_E]``; masked rows (padding
    keys, the tail) are never loaded. ``G`` (``X = K``), ``C`` (``X = V``) and ``scale·Qᵀ dY``.
``_row_product_kernel``
    ``OUT = scale·X Wmat`` for a small fp32 ``Wmat`` given by strides, grid
    ``(row blocks, column tiles, B·H)``: ``out`` (``Wmat = W``) and ``dQ`` (``Wmat = Wᵀ``).
``_dkdv_kernel``
    one program per (key block, ``B·H``), looping over ``Dv`` chunks: ``dV`` chunk by chunk, ``dK``
    accumulated; padding keys are never loaded, so their rows come out exactly 0.

Launches use fixed tiles under ``TRITON_INTERPRET=1`` (whole ``D``/``Dv`` tiles: each interpreted op is
one numpy call); on CUDA the row tiles and warps are autotuned and the column tiles capped (64, and 32
for the ``Dv`` chunks of ``_dkdv_kernel``) so that the configs fit in about 99 KB of shared memory, all
but one: at D = 128, ``_dkdv_kernel``'s 64-row, 3-stage tile needs 112 KB (fp16) to 120 KB (fp32), within
sm_80's and sm_90's limits but not that of sm_86/sm_89 cards, whose autotuner then skips it
(bench/gpu/triton_aot.py compiles every config for sm_80 and sm_90; no GPU run has been made). The factorisation needs a
host sync anyway (a singular system raises), so ``out`` is computed only after the info codes were
checked; heads whose statistics are not finite are NaN instead (docs/intention.md).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attn_ext.ops.intention import naive
from attn_ext.ops.intention.triton_solve import cholesky_solve_batched
from attn_ext.ops.utils.triton import SUPPORTED_DTYPES, block_dim, check_device, interpreting, lazily_autotuned
from attn_ext.ops.utils.triton_jit import load_tile, valid_rows
from attn_ext.ops.utils.validation import check_scale

__all__ = ["intention_fwd_triton", "intention_bwd_triton"]
MAX_HEAD_DIM = 128  # the factor tile [D, D] of the solve kernel lives in registers
MAX_VALUE_DIM = 256


# --------------------------------------------------------------------------- kernels

@triton.jit
def _transposed_product_kernel(
    A, X, MASK, OUT,
    sab, sah, san, sad,
    sxb, sxh, sxn, sxe,
    smb, smn,
    H, N, D, E, scale,
    HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    bh = tl.program_id(0)
    off_b = (bh // H).to(tl.int64)
    off_h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    d_ok = offs_d < D
    e_ok = offs_e < E
    a_base = A + off_b * sab + off_h * sah
    x_base = X + off_b * sxb + off_h * sxh
    acc = tl.zeros([BLOCK_D, BLOCK_E], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = valid_rows(MASK, off_b * smb, smn, offs_n, N, HAS_MASK)
        a_t = load_tile(a_base, offs_d, offs_n, sad, san, d_ok, n_ok, UPCAST)  # padding keys never loaded
        x = load_tile(x_base, offs_n, offs_e, sxn, sxe, n_ok, e_ok, UPCAST)
        # fp16/bf16 products are exact in fp32, so tensor-core dots lose nothing before accumulation.
        acc += tl.dot(a_t, x, input_precision="ieee")
    out_ptrs = OUT + bh.to(tl.int64) * D * E + offs_d[:, None] * E + offs_e[None, :]
    tl.store(out_ptrs, acc * scale, mask=d_ok[:, None] & e_ok[None, :])


@triton.jit
def _row_product_kernel(
    X, WMAT, OUT,
    sxb, sxh, sxm, sxr,
    swb, swh, swr, swc,
    sob, soh, som, soc,
    H, M, R, C, scale,
    NAN_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    bh = tl.program_id(2)
    off_b = (bh // H).to(tl.int64)
    off_h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    m_ok = offs_m < M
    c_ok = offs_c < C
    x_rows = X + off_b * sxb + off_h * sxh + offs_m[:, None] * sxm
    w_cols = WMAT + off_b * swb + off_h * swh + offs_c[None, :] * swc
    out = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    row_nan = tl.zeros([BLOCK_M], tl.float32)  # NaN for rows of X holding NaN/inf (NAN_ROWS)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + offs_r
        r_ok = r < R
        # The weights are fp32: the rows are upcast so that the product keeps fp32 accuracy on any dtype.
        x = tl.load(x_rows + r[None, :] * sxr, mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_cols + r[:, None] * swr, mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        out += tl.dot(x, w, input_precision="ieee")
        if NAN_ROWS:
            row_nan += tl.sum(tl.where(tl.abs(x) < float("inf"), 0.0, float("nan")), axis=1)
    out *= scale
    if NAN_ROWS:  # a ±inf query gives a NaN row, as a NaN one does (not ±inf)
        out += row_nan[:, None]
    tl.store(OUT + off_b * sob + off_h * soh + offs_m[:, None] * som + offs_c[None, :] * soc,
             out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])


@triton.jit
def _dkdv_kernel(
    K, V, MASK, DB, W, DK, DV_OUT,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sdkb, sdkh, sdkn, sdkd,
    sdvb, sdvh, sdvn, sdvd,
    H, N, D, DV,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    bh = tl.program_id(1)
    off_b = (bh // H).to(tl.int64)
    off_h = (bh % H).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    in_range = offs_n < N
    n_ok = valid_rows(MASK, off_b * smb, smn, offs_n, N, HAS_MASK)
    d_ok = offs_d < D
    # A padding key's row stays 0, so its dk and dv rows below are 0, and are stored as exact zeros
    # by the tl.where (0·NaN would be NaN where the forward of this head was NaN).
    k = tl.load(K + off_b * skb + off_h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    small_base = bh.to(tl.int64) * D * DV + offs_d[:, None] * DV
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for c0 in range(0, DV, BLOCK_C):
        cols = c0 + offs_c
        c_ok = cols < DV
        small_ok = d_ok[:, None] & c_ok[None, :]
        db = tl.load(DB + small_base + cols[None, :], mask=small_ok, other=0.0)
        w = tl.load(W + small_base + cols[None, :], mask=small_ok, other=0.0)
        v = tl.load(V + off_b * svb + off_h * svh + offs_n[:, None] * svn + cols[None, :] * svd,
                    mask=n_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        dv = tl.dot(k, db, input_precision="ieee")
        tl.store(DV_OUT + off_b * sdvb + off_h * sdvh + offs_n[:, None] * sdvn + cols[None, :] * sdvd,
                 tl.where(n_ok[:, None], dv, 0.0).to(DV_OUT.dtype.element_ty), mask=in_range[:, None] & c_ok[None, :])
        # −K(dB Wᵀ + W dBᵀ) + V dBᵀ regrouped to need no [D, D] tile: (V − K W) dBᵀ − (K dB) Wᵀ.
        residual = v - tl.dot(k, w, input_precision="ieee")
        dk += tl.dot(residual, tl.trans(db), input_precision="ieee")
        dk -= tl.dot(dv, tl.trans(w), input_precision="ieee")
    tl.store(DK + off_b * sdkb + off_h * sdkh + offs_n[:, None] * sdkn + offs_d[None, :] * sdkd,
             tl.where(n_ok[:, None], dk, 0.0).to(DK.dtype.element_ty), mask=in_range[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------- launch configuration

def _column_tile(width: int, gpu_cap: int = 64) -> int:
    # Whole tiles under the interpreter (fewer, larger numpy calls); on a GPU the tiles are capped so
    # that the operand tiles of the largest row tile fit in shared memory (about 99 KB, sm_86 class).
    return block_dim(width) if interpreting() else min(block_dim(width), gpu_cap)


#: (row tile, warps, stages) of the autotuned kernels, from the smallest tile to the largest.
_ROW_TILES = ((16, 2, 1), (32, 4, 2), (64, 4, 2), (64, 8, 3))
#: The one under ``ATTN_EXT_TRITON_PIN=1``: the largest tile that fits about 99 KB of shared memory for
#: every kernel, dtype and head dim (64 x 8 x 3 does not for ``_dkdv_kernel`` at D = 128 on sm_86/sm_89,
#: where the autotuner skips it but a pinned launch would fail).
_PINNED_ROW_TILE = (64, 4, 2)


def row_configs(row_block: str) -> list:
    """The autotune configs over ``row_block`` (the kernel's row tile name) and warps/stages."""
    return [triton.Config({row_block: r}, num_warps=w, num_stages=s) for r, w, s in _ROW_TILES]


@functools.lru_cache(maxsize=None)
def _tuned(kernel, row_block: str, key: tuple):
    """``kernel`` autotuned over its row tile and warps (lazily: the autotuner needs a GPU driver)."""
    configs = row_configs(row_block)
    return lazily_autotuned(kernel, configs, key, preferred=configs[_ROW_TILES.index(_PINNED_ROW_TILE)])()


def _launch(kernel, row_block: str, key: tuple, rows: int, grid, args, meta) -> None:
    """Fixed row tile (16 to 64) under the interpreter, autotuned per ``key`` on CUDA; ``grid(row tile)``."""
    if interpreting():
        block = max(16, min(64, triton.next_power_of_2(max(rows, 1))))
        kernel[grid(block)](*args, **{row_block: block}, **meta)
    else:
        _tuned(kernel, row_block, key)[lambda META: grid(META[row_block])](*args, **meta)


def _transposed_product(a, x, mask_u8, scale: float, out: torch.Tensor) -> None:
    """``out [B, H, D, E] = scale·aᵀ x`` over the rows of ``a [B, H, N, D]``, ``x [B, H, N, E]`` not masked."""
    B, H, N, D = a.shape
    E = x.shape[3]
    block_e = _column_tile(E)
    has_mask = mask_u8 is not None
    args = (a, x, mask_u8 if has_mask else a, out, *a.stride(), *x.stride(),
            *(mask_u8.stride() if has_mask else (0, 0)), H, N, D, E, float(scale))
    meta = dict(HAS_MASK=has_mask, UPCAST=interpreting(), BLOCK_D=block_dim(D), BLOCK_E=block_e)
    _launch(_transposed_product_kernel, "BLOCK_N", ("D", "E", "HAS_MASK"), N,
            lambda bn: (B * H, triton.cdiv(E, block_e)), args, meta)


def _row_product(x, wmat_strides, wmat, R: int, C: int, scale: float, out: torch.Tensor,
                 nan_rows: bool = False) -> None:
    """``out [B, H, M, C] = scale·x [B, H, M, R] · Wmat [B, H, R, C]`` (``Wmat`` through its strides);
    with ``nan_rows``, rows where ``x`` is not finite are NaN."""
    B, H, M, _ = x.shape
    block_c = _column_tile(C)
    args = (x, wmat, out, *x.stride(), *wmat_strides, *out.stride(), H, M, R, C, float(scale))
    meta = dict(NAN_ROWS=nan_rows, BLOCK_R=_column_tile(R), BLOCK_C=block_c)
    _launch(_row_product_kernel, "BLOCK_M", ("R", "C", "NAN_ROWS"), M,
            lambda bm: (triton.cdiv(M, bm), triton.cdiv(C, block_c), B * H), args, meta)


# --------------------------------------------------------------------------- checks

def _check_args(q, k, v, key_padding_mask, scale):
    """Shapes, dtypes and devices as the C++ op checks them; returns the uint8 view of the mask or None."""
    if v is None:  # the op's schema takes v=None (the compiled op's: C = I gives σIntention's transformed queries)
        raise ValueError("attn_ext.intention: the Triton kernels need the values v; without values (C = I, "
                         "σIntention's transformed queries) the compiled kernels (backend cpp or cuda) run it")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attn_ext: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attn_ext: q, k, v must be 4-D [B, H, M, D], [B, H, N, D], [B, H, N, Dv]; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2] or q.shape[3] != k.shape[3] \
            or k.shape[2] != v.shape[2]:
        raise ValueError(f"attn_ext: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "[B, H, M, D], [B, H, N, D], [B, H, N, Dv]")
    D, DV = q.shape[3], v.shape[3]
    if not 0 < D <= MAX_HEAD_DIM or DV > MAX_VALUE_DIM:
        raise ValueError(f"attn_ext: the Triton Intention kernels need 0 < D <= {MAX_HEAD_DIM} and Dv <= "
                         f"{MAX_VALUE_DIM} (the D x D factor is held in registers), got D = {D}, Dv = {DV}; "
                         "use the cpp or reference backend")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attn_ext: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype == torch.float64:
        raise TypeError("attn_ext: the Triton backend does not support float64; use the cpp or reference backend")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attn_ext: the Triton backend supports float32/float16/bfloat16, got {q.dtype}")
    check_scale(scale)
    tensors = [q, k, v]
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("attn_ext: key_padding_mask must be a bool tensor (True = padding)")
        if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(f"attn_ext: key_padding_mask must be [B, N] = {[k.shape[0], k.shape[2]]}, got "
                             f"{list(key_padding_mask.shape)}")
        tensors.append(key_padding_mask)
    check_device(_transposed_product_kernel, *tensors)
    # bool loads as i1, which some Triton paths treat awkwardly; uint8 is a free view.
    return None if key_padding_mask is None else key_padding_mask.contiguous().view(torch.uint8)


def _check_small(name: str, t, shape) -> torch.Tensor:
    """``t`` as a contiguous fp32 tensor of ``shape`` on the inputs' device."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"attn_ext: {name} must be a tensor of shape {list(shape)}, got {got}")
    return t.to(torch.float32).contiguous()


# --------------------------------------------------------------------------- wrappers

def intention_fwd_triton(q, k, v, key_padding_mask, alpha, scale: float):
    """Intention, primal form: ``out = scale·Q (KᵀK + αI)⁻¹ KᵀV`` per (batch, head), on Triton.

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[B, H, M, D]``, ``[B, H, N, D]``, ``[B, H, N, Dv]``, any strides, one dtype among float32,
        float16, bfloat16 (float64: ``TypeError``, use the cpp backend); ``D ≤ 128``, ``Dv ≤ 256``.
    key_padding_mask : torch.Tensor or None
        Bool ``[B, N]``, True = padding: the key is left out of ``KᵀK`` and ``KᵀV``.
    alpha : torch.Tensor
        ``[B, H]`` ridge parameters (converted to fp32).
    scale : float
        Multiplier of the output.

    Returns
    -------
    out : torch.Tensor
        ``[B, H, M, Dv]`` in q's dtype (computed in fp32).
    factor : torch.Tensor
        fp32 ``[B, H, D, D]``: the lower Cholesky factor ``L`` of ``KᵀK + αI`` (strict upper triangle 0).
    weights : torch.Tensor
        fp32 ``[B, H, D, Dv]``: ``W = (KᵀK + αI)⁻¹ KᵀV``.

    A (batch, head) whose ``[KᵀK | KᵀV]`` is not finite gets NaN ``out``, ``factor`` and ``weights``;
    a query row holding NaN/inf gets a NaN row.

    Raises
    ------
    RuntimeError
        When finite ``KᵀK + αI`` is singular for some (batch, head): ``α = 0`` with fewer valid keys
        than ``D``, or a pivot that is not positive (:func:`naive.singular_error`); devices the
        kernels cannot run on.
    ValueError
        Bad shapes; ``D > 128``.
    TypeError
        Unsupported or mismatched dtypes.
    """
    mask_u8 = _check_args(q, k, v, key_padding_mask, scale)
    B, H, M, D = q.shape
    DV = v.shape[3]
    alpha32 = _check_small("alpha", alpha, (B, H)).to(q.device)
    factor = torch.empty((B, H, D, D), dtype=torch.float32, device=q.device)
    weights = torch.empty((B, H, D, DV), dtype=torch.float32, device=q.device)
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=q.device)
    if B * H == 0:
        return out, factor, weights  # an empty launch grid is an error in Triton
    if DV == 0:
        weights.zero_()
    else:
        _transposed_product(k, v, mask_u8, 1.0, weights)
    _transposed_product(k, k, mask_u8, 1.0, factor)
    # One pass over [G | C] per head, before the factorisation overwrites G: not finite means NaN
    # outputs for that head, a failed factorisation of finite statistics an error.
    nonfinite = ~(torch.isfinite(factor).flatten(2).all(-1) & torch.isfinite(weights).flatten(2).all(-1))
    info, _ = cholesky_solve_batched(factor, weights, alpha=alpha32, block_c=_column_tile(DV))
    naive.check_solvable("intention", info, alpha32, naive.valid_key_count(k, key_padding_mask), nonfinite, D)
    factor.masked_fill_(nonfinite[..., None, None], float("nan"))
    weights.masked_fill_(nonfinite[..., None, None], float("nan"))
    if M * DV > 0:
        _row_product(q, weights.stride(), weights, D, DV, scale, out, nan_rows=True)
    return out, factor, weights


def intention_bwd_triton(grad_out, q, k, v, key_padding_mask, factor, weights, scale: float):
    """Gradients of :func:`intention_fwd_triton`'s ``out`` with respect to q, k, v and α.

    Parameters
    ----------
    grad_out : torch.Tensor
        ``[B, H, M, Dv]`` upstream gradient (any strides and floating dtype).
    q, k, v, key_padding_mask, scale
        As given to the forward.
    factor, weights : torch.Tensor
        The forward's ``L`` ``[B, H, D, D]`` (only its lower triangle is read) and ``W`` ``[B, H, D, Dv]``.

    Returns
    -------
    dq, dk, dv : torch.Tensor
        In the inputs' dtype, contiguous; padding keys get exactly zero ``dk``/``dv`` rows.
    dalpha : torch.Tensor
        fp32 ``[B, H]``, ``−Σ dB ⊙ W`` with ``dB = (KᵀK + αI)⁻¹(scale·Qᵀ dY)``.
    """
    mask_u8 = _check_args(q, k, v, key_padding_mask, scale)
    B, H, M, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != (B, H, M, DV):
        got = tuple(grad_out.shape) if isinstance(grad_out, torch.Tensor) else type(grad_out).__name__
        raise ValueError(f"attn_ext: grad_out must be [B, H, M, Dv] = {[B, H, M, DV]}, got {got}")
    factor = _check_small("factor", factor, (B, H, D, D))
    weights = _check_small("weights", weights, (B, H, D, DV))
    # The solve below takes the factor as is: the upper triangle the forward may have left is cleared.
    factor = factor.tril()
    check_device(_transposed_product_kernel, grad_out, factor, weights, q)
    # One dtype for the dots of scale·Qᵀ dY (fp16 x fp32 operands do not mix in tl.dot).
    grad_out = grad_out.to(q.dtype)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    grad_b = torch.empty((B, H, D, DV), dtype=torch.float32, device=q.device)
    if B * H == 0:
        return dq, dk, dv, torch.zeros((B, H), dtype=torch.float32, device=q.device)
    if DV == 0 or M == 0:
        dq.zero_()
        grad_b.zero_()
    else:
        # dQ = scale·dY Wᵀ: the weights read through transposed strides.
        w_t_strides = (weights.stride(0), weights.stride(1), weights.stride(3), weights.stride(2))
        _row_product(grad_out, w_t_strides, weights, DV, D, scale, dq)
        _transposed_product(q, grad_out, None, scale, grad_b)
    _, dalpha = cholesky_solve_batched(factor, grad_b, weights=weights, block_c=_column_tile(DV))
    if N > 0:
        block_c = _column_tile(DV, gpu_cap=32)
        has_mask = mask_u8 is not None
        args = (k, v, mask_u8 if has_mask else k, grad_b, weights, dk, dv, *k.stride(), *v.stride(),
                *(mask_u8.stride() if has_mask else (0, 0)), *dk.stride(), *dv.stride(), H, N, D, DV)
        meta = dict(HAS_MASK=has_mask, BLOCK_D=block_dim(D), BLOCK_C=block_c)
        _launch(_dkdv_kernel, "BLOCK_N", ("D", "DV", "HAS_MASK"), N, lambda bn: (triton.cdiv(N, bn), B * H), args, meta)
    return dq, dk, dv, dalpha
