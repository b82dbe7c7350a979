"""Triton forward kernel for chunked cross attention (SPEC section 1).

One program per (query block, batch*head) streams over the keys in blocks of
``BLOCK_N`` with an online softmax, so no ``[M, N]`` matrix ever exists.
Internally the running max and the log-sum-exp are kept in base 2 (``exp2``
is the cheap instruction on GPUs); the returned ``lse`` is converted to the
natural log at the boundary.

The helpers at the top (block sizes, autotune configs, input checks) are
shared with :mod:`attn_ext.triton.cross_attention_bwd`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from attn_ext._validation import check_cross_attention_args

__all__ = ["cross_attention_forward"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- helpers

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _check_device(kernel, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    # triton.jit chooses interpreter vs compiler when the kernel is decorated,
    # so an env var set after import would otherwise fail deep inside Triton.
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interpreted:
        raise RuntimeError("Triton kernels got CPU tensors but were not built for the interpreter; "
                           "set TRITON_INTERPRET=1 before importing attn_ext.triton")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels need cuda tensors (or cpu under the interpreter), got {device}")


def _check_dtypes(**tensors: torch.Tensor) -> torch.dtype:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    dtype = next(iter(dtypes.values()))
    if dtype == torch.float64:
        raise TypeError("the Triton backend does not support float64; use the cpp or reference backend")
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the Triton backend supports float32/float16/bfloat16, got {dtype}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"q, k, v must share one dtype, got {dtypes}")
    return dtype


def _mask_arg(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor):
    """Return (pointer tensor, stride_b, stride_n, has_mask) for the kernels."""
    if mask is None:
        # Never dereferenced (HAS_MASK is a constexpr False); any tensor will do.
        return q, 0, 0, False
    # dtype, shape and device were checked by check_cross_attention_args.
    # bool loads as i1 which some Triton paths treat awkwardly; uint8 is a free view.
    m8 = mask.contiguous().view(torch.uint8)
    return m8, m8.stride(0), m8.stride(1), True


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _block_n(chunk_size: int, n: int) -> int:
    block = min(max(_pow2_floor(chunk_size), 16), 128)
    if _interpreting():
        block = min(block, 64)  # each interpreted op is a numpy call: keep tiles modest
    # Never tile far past the real key count (tl.dot needs >= 16).
    return max(16, min(block, triton.next_power_of_2(max(n, 1))))


def _block_m_interp(m: int) -> int:
    return max(16, min(32, triton.next_power_of_2(max(m, 1))))


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(max(d, 1)))


def _bucket(x: int) -> int:
    # Autotune keys use power-of-two buckets so that every new M or N does not retune.
    return min(triton.next_power_of_2(max(x, 1)), 1 << 16)


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N is capped by the chunk_size hint.
# The 16x16 single-stage tile is the last resort for huge D/Dv and tiny M/N.
_GPU_TILES = ((16, 16, 2, 1), (16, 64, 4, 2), (16, 128, 4, 2), (32, 32, 4, 2), (64, 16, 4, 2),
              (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2),
              (64, 128, 4, 2), (128, 128, 8, 2))


def _gpu_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in _GPU_TILES]


def _smem_estimate(c, elem: int, d: int, dv: int) -> int:
    # Fitted on sm_80 compiles of these kernels: the pipelined operand tiles
    # dominate; rough, misses are caught by the autotuner as OutOfResources.
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    return elem * (d + dv) * (max(c.num_stages - 1, 1) * max(bm, bn) + min(bm, bn))


def _prune_configs(configs, named_args, **kwargs):
    """Keep configs within the chunk_size hint, the problem size and shared memory."""
    elem = named_args["Q"].element_size()
    d, dv = kwargs["BLOCK_D"], kwargs["BLOCK_DV"]
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(named_args["Q"].device.index or 0)
        budget = props["max_shared_mem"]
    except Exception:  # pragma: no cover - conservative default (sm_86 class)
        budget = 99 * 1024
    bn_max, m_b, n_b = named_args["BLOCK_N_MAX"], named_args["M_BUCKET"], named_args["N_BUCKET"]
    kept = [c for c in configs
            if c.kwargs["BLOCK_N"] <= max(16, min(bn_max, n_b)) and c.kwargs["BLOCK_M"] <= max(16, m_b)
            and _smem_estimate(c, elem, d, dv) <= budget]
    return kept or [min(configs, key=lambda c: _smem_estimate(c, elem, d, dv))]


_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "BLOCK_N_MAX", "M_BUCKET", "N_BUCKET"]


def autotuned(kernel):
    """Wrap ``kernel`` in triton.autotune lazily: the autotuner needs a GPU driver."""
    return functools.lru_cache(maxsize=None)(
        lambda: triton.autotune(configs=_gpu_configs(), key=_TUNE_KEY,
                                prune_configs_by={"early_config_prune": _prune_configs})(kernel))


def launch(kernel, tuned, grid, args, meta, m: int, n: int, chunk_size: int) -> None:
    """Launch with fixed tiles under the interpreter, autotuned tiles on GPU.

    ``args`` must end with the (unused in-kernel) tuning-key slots
    ``BLOCK_N_MAX, M_BUCKET, N_BUCKET`` which this fills in; ``grid`` maps
    ``(BLOCK_M, BLOCK_N)`` to the launch grid.
    """
    bn = _block_n(chunk_size, n)
    args = (*args, bn, _bucket(m), _bucket(n))
    if _interpreting():
        bm = _block_m_interp(m)
        kernel[grid(bm, bn)](*args, BLOCK_M=bm, BLOCK_N=bn, **meta)
    else:
        tuned()[lambda META: grid(META["BLOCK_M"], META["BLOCK_N"])](*args, **meta)


# --------------------------------------------------------------------------- kernel

@triton.jit
def _fwd_kernel(
    Q, K, V, MASK, OUT, LSE,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smn,
    sob, soh, som, sod,
    slb, slh, slm,
    H, M, N, D, DV,
    qk_scale, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # int64 batch/head offsets: B*H*L*D can exceed 2**31 elements.
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < M
    d_ok = offs_d < D
    dv_ok = offs_dv < DV

    q = tl.load(Q + off_b * sqb + off_h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + off_b * skb + off_h * skh
    v_base = V + off_b * svb + off_h * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    for start_n in range(0, N, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_MASK:
            pad = tl.load(MASK + off_b * smb + offs_n * smn, mask=n_ok, other=1)
            n_ok = n_ok & (pad == 0)
        # Padded keys are not even loaded: garbage (NaN/inf) there must not leak via 0*NaN.
        kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, kt, input_precision="ieee") * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen no valid key its max is -inf; shift by 0 instead
        # so that no (-inf) - (-inf) = NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(OUT + off_b * sob + off_h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
             out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + off_b * slb + off_h * slh + offs_m * slm, lse, mask=m_ok)


_fwd_kernel_tuned = autotuned(_fwd_kernel)


# --------------------------------------------------------------------------- wrapper

def cross_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            key_padding_mask: torch.Tensor | None, scale: float,
                            chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax cross attention with a fused online softmax (Triton).

    Parameters
    ----------
    q : torch.Tensor
        Queries ``[B, H, M, D]``; any strides.
    k : torch.Tensor
        Keys ``[B, H, N, D]``; any strides.
    v : torch.Tensor
        Values ``[B, H, N, Dv]``; any strides. q, k, v share one dtype among
        float32, float16, bfloat16 (float64 raises ``TypeError``).
    key_padding_mask : torch.Tensor or None
        Bool ``[B, N]``, True marks a padded key that is ignored.
    scale : float
        Multiplier of ``q @ k^T`` before the softmax.
    chunk_size : int
        Hint for the key tile ``BLOCK_N``: the largest power of two not above
        it, clamped to [16, 128] and to N (to 64 under the interpreter, where
        it is used as is; on CUDA it is the upper bound of the tuned tile).

    Returns
    -------
    out : torch.Tensor
        ``[B, H, M, Dv]`` in q's dtype, contiguous. Rows without any valid
        key are 0.
    lse : torch.Tensor
        float32 ``[B, H, M]``, natural-log log-sum-exp of the scaled scores;
        ``-inf`` for rows without any valid key.

    Notes
    -----
    Accumulation is float32 and float32 dots use ``input_precision="ieee"``
    (no TF32). On CUDA, ``BLOCK_M``/``BLOCK_N``/warps/stages are autotuned
    per (padded D, padded Dv, chunk hint, power-of-two buckets of M and N,
    dtype); under ``TRITON_INTERPRET=1`` a fixed small configuration is used
    because autotuning needs a GPU. Results do not depend on the tiles
    beyond float rounding.
    """
    # Shapes, mask and scale as for every backend; then what is particular to Triton.
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size)
    _check_device(_fwd_kernel, q, k, v)
    _check_dtypes(q=q, k=k, v=v)
    mask, smb, smn, has_mask = _mask_arg(key_padding_mask, q, k)

    B, H, M, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return out, lse  # an empty launch grid is an error in Triton

    args = (q, k, v, mask, out, lse,
            *q.stride(), *k.stride(), *v.stride(), smb, smn, *out.stride(), *lse.stride(),
            H, M, N, D, DV, float(scale) * LOG2E)
    meta = dict(HAS_MASK=has_mask, UPCAST=_interpreting(), BLOCK_D=_block_d(D), BLOCK_DV=_block_d(DV))
    launch(_fwd_kernel, _fwd_kernel_tuned, lambda bm, bn: (triton.cdiv(M, bm), B * H),
           args, meta, M, N, chunk_size)
    return out, lse
