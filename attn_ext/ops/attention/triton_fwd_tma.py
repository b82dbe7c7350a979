"""The attention forward for Hopper (sm_90): Q, K and V loaded and the output stored through TMA tensor
descriptors, and the key loop warp-specialised without the causal rule. Opt-in (``ATTN_EXT_TRITON_TMA=1``)
until a GPU has measured it; :func:`tma_forward_unavailable_reason` says why a call cannot take it, and
``launch_forward`` (:mod:`.triton_fwd`) then runs the general kernel.

Only the common path: fp16/bf16, no key padding mask, no attention mask, no dropout; the causal rule
(top-left) or none; grouped key/value heads. The results follow the general forward's convention: scores
``dot * scale`` in natural units, ``lse`` the natural-log log-sum-exp, a row without a key of nonzero weight
``out = 0``, ``lse = -inf``, NaN propagated; the general backward takes its outputs.

Descriptors are made on the device (``tl.make_tensor_descriptor``), one per batch and head over its
``[rows, head dim]`` matrix: TMA fills rows past ``M`` or ``N`` and columns past ``D`` with zeros and drops
them on the store, so tails need no load masks, and a key past ``N`` (a zero row, never another head's
data) only needs its score set to ``-inf``. Without the causal rule the one key loop is warp-specialised
(``tl.range(..., warp_specialize=True)``: a producer warp issuing the TMA loads, consumer warpgroups doing
the MMAs and the softmax), which Triton does with 4 warps only (8 are silently ignored); as in Triton's
attention tutorial, not under the causal rule, whose loop is split at the diagonal as the general kernel's.
Device-side descriptors need global scratch, asked of ``triton.set_allocator``'s allocator at launch:
:func:`ensure_allocator` sets a torch one unless the caller has set their own.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn_ext.ops.attention.triton_spills import device_arch, spill_free_configs
from attn_ext.ops.attention.triton_tiles import block_d, launch
from attn_ext.ops.utils.cuda_capability import device_capability
from attn_ext.ops.utils.triton import interpreting, lazily_autotuned
from attn_ext.ops.utils.triton_jit import attention_rows, load_box, rows_descriptor

__all__ = ["MAX_BLOCK_D", "TMA_ENV", "TMA_TILES", "ensure_allocator", "launch_forward_tma",
           "tma_forward_unavailable_reason", "tma_ready", "within_problem"]

#: The opt-in: exactly ``1`` lets calls that qualify take this kernel (any other value or unset: never).
TMA_ENV = "ATTN_EXT_TRITON_TMA"


# --------------------------------------------------------------------------- kernel

@triton.jit
def _exact_causal_pv_into(acc, p, v, start_n, offs_m, N, BLOCK_N: tl.constexpr):
    """``acc`` plus the exact product of the weights ``p`` and value rows ``v`` over the pairs the causal rule
    allows (key ``start_n + j`` for the queries ``offs_m >= start_n + j``, keys below ``N``), one key at a
    time and added in place, with the causal test per key computed from the indices (the general kernel's
    ``pair_dot_into`` reduces a pair-mask tile per key, which spilled here)."""
    ks = tl.arange(0, BLOCK_N)
    for j in range(0, BLOCK_N):
        p_j = tl.sum(tl.where((ks == j)[None, :], p, 0.0), 1)
        v_j = tl.sum(tl.where((ks == j)[:, None], v, 0.0), 0).to(tl.float32)
        ok_j = (start_n + j <= offs_m) & (start_n + j < N)
        acc += tl.where(ok_j[:, None], p_j[:, None] * v_j[None, :], 0.0)
    return acc


@triton.jit
def _causal_pv_into(acc, p, v, allowed, m_ok, n_ok, start_n, offs_m, N, BLOCK_N: tl.constexpr):
    """``acc + p @ v`` for a block the diagonal crosses: the GEMM unless a masked pair of a real query and key
    meets a value row holding inf or NaN (0 times it would be NaN), then :func:`_exact_causal_pv_into`."""
    masked = tl.sum((m_ok[:, None] & n_ok[None, :] & (allowed == 0)).to(tl.int32)) > 0
    nonfinite = tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)) > 0
    if masked & nonfinite:
        acc = _exact_causal_pv_into(acc, p, v, start_n, offs_m, N, BLOCK_N)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return acc


@triton.jit
def _tma_key_blocks(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, offs_m, m_ok, N, scale,
                    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The online softmax of one query block over the key blocks ``[lo, hi)``. ``MASKED``: these blocks hold
    keys past ``N`` or (``IS_CAUSAL``) pairs above the diagonal, whose scores become ``-inf`` and whose value
    rows are read through :func:`_causal_pv_into`'s guard; else every pair counts (the plain loop)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = load_box(k_desc, start_n, UPCAST)
        v = load_box(v_desc, start_n, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < N
            allowed = n_ok[None, :]
            if IS_CAUSAL:
                allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # While a row has seen no key of nonzero weight its max is -inf: shift by 0, so no (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_CAUSAL:
            # A masked pair's weight is 0, but 0 times an inf or NaN value row above the diagonal is NaN.
            acc = _causal_pv_into(acc * alpha[:, None], p, v, allowed, m_ok, n_ok, start_n, offs_m, N, BLOCK_N)
        else:  # keys past N: TMA filled their value rows with zeros
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_tma_tile(
    Q, K, V, OUT, LSE, pid_m, pid_bh,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, slb, slh, slm,
    H, GROUP, M, N, D, DV, scale,
    IS_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One output tile: query block ``pid_m`` of batch-head ``pid_bh`` over every key it may see."""
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP  # GQA: GROUP query heads share a key/value head
    # One descriptor per batch and head over its [rows, head dim] matrix: TMA bounds every box by it.
    k_desc = rows_descriptor(K + off_b * skb + off_kvh * skh, N, D, skn, BLOCK_N, BLOCK_D)
    v_desc = rows_descriptor(V + off_b * svb + off_kvh * svh, N, DV, svn, BLOCK_N, BLOCK_DV)
    o_desc = rows_descriptor(OUT + off_b * sob + off_h * soh, M, DV, som, BLOCK_M, BLOCK_DV)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    q = load_box(rows_descriptor(Q + off_b * sqb + off_h * sqh, M, D, sqm, BLOCK_M, BLOCK_D), pid_m * BLOCK_M, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    if IS_CAUSAL:
        # Key blocks before `full_hi` are whole and wholly below the diagonal: the plain loop. From there
        # to `hi`, the blocks the diagonal crosses and a last, partial key block test each pair.
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
        full_hi = tl.minimum((N // BLOCK_N) * BLOCK_N, (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N)
        acc, l_i, m_i = _tma_key_blocks(acc, l_i, m_i, q, k_desc, v_desc, 0, full_hi, offs_m, m_ok, N, scale,
                                        False, False, False, UPCAST, BLOCK_M, BLOCK_N, BLOCK_DV)
        acc, l_i, m_i = _tma_key_blocks(acc, l_i, m_i, q, k_desc, v_desc, full_hi, hi, offs_m, m_ok, N, scale,
                                        True, True, False, UPCAST, BLOCK_M, BLOCK_N, BLOCK_DV)
    else:
        # One loop over every key block, each testing its keys against N unless N is a multiple of every key
        # tile (EVEN_N): with a second loop for the last block, before or after it, Triton 3.9 fails to
        # compile the warp specialisation (an assertion in its pass), and with that block under an `if`
        # it drops the specialisation silently.
        acc, l_i, m_i = _tma_key_blocks(acc, l_i, m_i, q, k_desc, v_desc, 0, N, offs_m, m_ok, N, scale,
                                        not EVEN_N, False, WARP_SPECIALIZE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_DV)

    out, lse = attention_rows(acc, l_i, m_i)  # the general forward's: empty rows (0, -inf), NaN rows NaN
    o_desc.store([pid_m * BLOCK_M, 0], out.to(OUT.dtype.element_ty))
    tl.store(LSE + off_b * slb + off_h * slh + offs_m * slm, lse, mask=m_ok)


@triton.jit
def _fwd_tma_kernel(
    Q, K, V, OUT, LSE,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, slb, slh, slm,
    H, GROUP, M, N, D, DV, scale, BH, BLOCK_N_MAX, M_BUCKET, N_BUCKET,
    IS_CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    if PROGRAMS_PER_SM > 0:
        # A fixed number of programs, each taking the tiles t, t + P, t + 2P, ... of the list ordered by query
        # block, the last (under the causal rule the longest) first, then by batch and head. Not software-
        # pipelined (num_stages=1): prefetching the next tile's loads spilled 8-16 bytes at D = 128 (Triton 3.9).
        blocks_m = tl.cdiv(M, BLOCK_M)
        for t in tl.range(tl.program_id(0), blocks_m * BH, tl.num_programs(0), num_stages=1):
            _fwd_tma_tile(Q, K, V, OUT, LSE, blocks_m - 1 - t // BH, t % BH,
                          sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, slb, slh, slm,
                          H, GROUP, M, N, D, DV, scale, IS_CAUSAL, EVEN_N, WARP_SPECIALIZE, UPCAST,
                          BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        pid_m = tl.program_id(0)
        if IS_CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m  # the longest query blocks first, as the general forward
        _fwd_tma_tile(Q, K, V, OUT, LSE, pid_m, tl.program_id(1),
                      sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, slb, slh, slm,
                      H, GROUP, M, N, D, DV, scale, IS_CAUSAL, EVEN_N, WARP_SPECIALIZE, UPCAST,
                      BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)


# --------------------------------------------------------------------------- tiles

#: (BLOCK_M, BLOCK_N, num_warps, num_stages). wgmma takes 64 query rows per warpgroup. Measured ahead of time
#: (sm_90, Triton 3.9, bf16 and fp16 at D = 64 and 128, bench/gpu/triton_aot.py): without the causal rule every
#: 4-warp tile is warp-specialised (SETMAXREG) and no tile spills; with it (no warp specialisation) the 4-warp
#: 128-row tiles and the 128-key tiles spill (48-640 bytes at D = 64 and 128), so the AOT table's pruning drops
#: them there. Listed so that the pinned config (``ATTN_EXT_TRITON_PIN=1``, :data:`_PINNED`) falls back to 128x64
#: with 8 warps, 2 stages, under the causal rule.
TMA_TILES = ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 4, 3),
             (128, 128, 4, 2), (128, 128, 8, 2))
#: Triton's attention tutorial's pick on Hopper, warp-specialised.
_PINNED = ((("BLOCK_M", 128), ("BLOCK_N", 64), ("PROGRAMS_PER_SM", 0)), 4, 2)
#: The persistent grid's programs per SM, tried beside one program per tile under the causal rule: one (a
#: 128-row tile with 8 warps fills an SM's registers at D = 128), and two for 4-warp tiles where shared memory
#: holds both. The autotuner measures which pays.
_PROGRAMS_PER_SM = {4: (1, 2), 8: (1,)}
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "BLOCK_N_MAX", "M_BUCKET", "N_BUCKET", "IS_CAUSAL"]
#: The padded head dims these tiles are compiled and checked for: 256 would not fit with them.
MAX_BLOCK_D = 128


def _configs():
    # One program per tile first, then the persistent ones (the pinned fallback searches this order).
    per_tile = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "PROGRAMS_PER_SM": 0}, num_warps=w, num_stages=s)
                for bm, bn, w, s in TMA_TILES]
    persistent = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "PROGRAMS_PER_SM": p}, num_warps=w, num_stages=s)
                  for bm, bn, w, s in TMA_TILES for p in _PROGRAMS_PER_SM[w]]
    return per_tile + persistent


def _smem_estimate(c, elem: int, d: int, dv: int) -> int:
    # Q (and the output's staging tile), num_stages buffers of K and V, and the barriers: an upper bound of
    # every compile above (a warp-specialised 64-row tile holds a second [64, D] buffer: 128 rows counted).
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    return elem * (max(bm, 128) * (d + dv) + c.num_stages * bn * (d + dv)) + 1024


def _shared_memory(q: Tensor) -> int:
    """The most shared memory a block may use on ``q``'s device (sm_90: 232448 bytes)."""
    try:
        return triton.runtime.driver.active.utils.get_device_properties(q.device.index or 0)["max_shared_mem"]
    except Exception:  # pragma: no cover - conservative default (sm_86 class)
        return 99 * 1024


def within_problem(c, named_args) -> bool:
    """Whether config ``c``'s tiles stay within the chunk-size hint and the problem's size buckets (64 rows and
    keys allowed at least: wgmma's row tile), for the TMA kernels' pruning."""
    return (c.kwargs["BLOCK_N"] <= max(64, named_args["BLOCK_N_MAX"])
            and c.kwargs["BLOCK_M"] <= max(64, named_args["M_BUCKET"]))


def _prune(configs, named_args, **kwargs):
    """Keep the configs within the chunk-size hint, the problem size and the device's shared memory (each of
    a persistent config's programs on an SM holding its own), the persistent grid under the causal rule only
    (it balances unequal tiles; without the rule every tile is the same work), then those that do not spill
    on this card where the AOT table knows (:func:`~.triton_spills.spill_free_configs`; e.g. under the
    causal rule the 4-warp 128-row tiles, the 128-key tiles and, at D = 128, persistent ones)."""
    elem = named_args["Q"].element_size()
    d, dv = kwargs["BLOCK_D"], kwargs["BLOCK_DV"]
    budget = _shared_memory(named_args["Q"])
    causal = bool(kwargs.get("IS_CAUSAL"))
    kept = [c for c in configs
            if within_problem(c, named_args)
            and max(1, c.kwargs["PROGRAMS_PER_SM"]) * _smem_estimate(c, elem, d, dv) <= budget
            and (causal or not c.kwargs["PROGRAMS_PER_SM"])]
    if not kept:
        return [min(configs, key=lambda c: _smem_estimate(c, elem, d, dv))]
    return spill_free_configs(kept, "_fwd_tma_kernel", device_arch(), elem, d, dv, kwargs)


_fwd_tma_kernel_tuned = lazily_autotuned(_fwd_tma_kernel, _configs, _TUNE_KEY, prune=_prune, preferred=_PINNED)


# --------------------------------------------------------------------------- host side

def _scratch(size: int, alignment: int, stream: Optional[int]):
    # Global scratch for the descriptors the kernel makes: on the device Triton launches on (the current one).
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    """Give Triton an allocator for the descriptors' global scratch unless one is set: Triton reads it from a
    context variable (``triton.set_allocator`` sets it, nothing public reads it), whose default raises at
    the launch of a kernel that needs scratch. A caller's own allocator is kept."""
    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # a Triton without that variable: ours, as its tutorial does
        unset = True
    if unset:
        triton.set_allocator(_scratch)


def tma_ready(t: Tensor) -> Optional[str]:
    """Why ``t`` ``[B, H, rows, cols]`` cannot be a TMA source, or None: unit stride along the head dim, and
    a 16-byte aligned address and row stride, and batch and head strides where those dims index memory."""
    elem = t.element_size()
    if t.stride(3) != 1:
        return f"its last dim has stride {t.stride(3)}, TMA needs 1"
    if t.data_ptr() % 16:
        return f"its address is {t.data_ptr() % 16} bytes past a 16-byte boundary"
    for dim, name in ((2, "row"), (1, "head"), (0, "batch")):
        if (dim == 2 or t.shape[dim] > 1) and (t.stride(dim) * elem) % 16:
            return f"its {name} stride is {t.stride(dim) * elem} bytes, not a multiple of 16"
    return None


def _device_reason(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot run the TMA forward, or None: a GPU of compute capability 9.x (sm_90, where the
    kernel is compiled and checked), or any device under the interpreter."""
    if interpreting():
        return None
    if device.type != "cuda":
        return f"needs a CUDA device of compute capability 9.x (or the Triton interpreter), got {device}"
    major, minor = device_capability(device.index if device.index is not None else torch.cuda.current_device())
    if major != 9:
        return f"needs compute capability 9.x (Hopper: TMA and warp specialisation), this device is {major}.{minor}"
    return None


def tma_forward_unavailable_reason(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None,
                                   attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0) -> Optional[str]:
    """Why the TMA forward cannot run this call (checked arguments, as for ``launch_forward``), or None."""
    if os.environ.get(TMA_ENV) != "1":
        return f"opt-in: {TMA_ENV}=1 is not set (the TMA forward is not measured on a GPU yet)"
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"Triton {triton.__version__} has no tl.make_tensor_descriptor"
    why = _device_reason(q.device)
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype}: the TMA forward is for the 16-bit types (their tensor-core path)"
    if key_padding_mask is not None:
        return "a key padding mask (the TMA forward has none)"
    if attn_mask is not None:
        return "an attention mask (the TMA forward has none)"
    if dropout_p > 0.0:
        return "dropout (the TMA forward has none)"
    if q.numel() == 0 or k.shape[2] == 0:
        return "an empty problem (no query or no key to load)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if block_d(t.shape[3]) > MAX_BLOCK_D:
            return f"{name}'s head dim {t.shape[3]} is over {MAX_BLOCK_D} (the TMA forward's tiles are sized up to it)"
        why = tma_ready(t)
        if why is not None:
            return f"{name} is not a TMA source: {why}"
    if (v.shape[3] * v.element_size()) % 16:
        return f"the output's rows ({v.shape[3]} values) are not a multiple of 16 bytes, as a TMA store needs"
    return None


def _grid(meta: dict, M: int, BH: int, programs: Optional[int], device: torch.device) -> tuple[int, int]:
    """One program per (query block, batch-head), or with ``PROGRAMS_PER_SM`` that many per SM of ``device``
    (``programs`` in all where given: the interpreter's tests), never more than there are tiles."""
    blocks_m = triton.cdiv(M, meta["BLOCK_M"])
    if not meta["PROGRAMS_PER_SM"]:
        return blocks_m, BH
    if programs is None:
        programs = meta["PROGRAMS_PER_SM"] * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks_m * BH, programs)), 1


def launch_forward_tma(q: Tensor, k: Tensor, v: Tensor, scale: float, chunk_size: int,
                       is_causal: bool = False, persistent_programs: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the TMA forward for a call :func:`tma_forward_unavailable_reason` accepts (the
    general forward's ``launch_forward`` without masks or dropout). ``persistent_programs``: under the
    interpreter, run the persistent grid with that many programs (on a GPU the autotuner chooses)."""
    B, H, M, D = q.shape
    N, DV = k.shape[2], v.shape[3]
    out = torch.empty((B, H, M, DV), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    ensure_allocator()
    args = (q, k, v, out, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *out.stride()[:3], *lse.stride(),
            H, H // k.shape[1], M, N, D, DV, float(scale), B * H)
    # Every key tile (GPU and interpreter) is a power of two up to 128: N % 128 == 0 means no partial block.
    meta = dict(IS_CAUSAL=bool(is_causal), EVEN_N=N % 128 == 0, WARP_SPECIALIZE=not is_causal, UPCAST=interpreting(),
                BLOCK_D=block_d(D), BLOCK_DV=block_d(DV))
    if interpreting():  # fixed tiles: the persistent grid only when asked
        meta["PROGRAMS_PER_SM"] = 1 if persistent_programs else 0
    launch(_fwd_tma_kernel, _fwd_tma_kernel_tuned, lambda m: _grid(m, M, B * H, persistent_programs, q.device),
           args, meta, M, N, chunk_size)
    return out, lse
