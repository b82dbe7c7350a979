"""Tiles and autotuning of the attention Triton kernels (forward, and the backward's two kernels), shared
by cross attention and the general attention op.

Under the interpreter the tiles are fixed and small (each interpreted op is a numpy call); on a GPU
``BLOCK_M``/``BLOCK_N``/warps/stages are autotuned per padded head dims, the chunk-size hint and
power-of-two buckets of M and N, within the shared memory of the device.
With ``ATTN_EXT_TRITON_PIN=1`` each launch runs one of the kept configs (``PINNED_TILES``; docs/backends.md).
"""
from __future__ import annotations

import triton

from attn_ext.ops.attention.triton_spills import device_arch, spill_free_configs, table_arch
from attn_ext.ops.utils.triton import block_dim as block_d
from attn_ext.ops.utils.triton import interpreting, lazily_autotuned, next_pow2

__all__ = ["FIXED_TILES", "FIXED_TILES_PIPELINED", "PINNED_TILES", "autotuned", "block_d", "block_m_interpreted", "launch", "launch_fixed"]


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _block_n(chunk_size: int, n: int) -> int:
    block = min(max(_pow2_floor(chunk_size), 16), 128)
    if interpreting():
        block = min(block, 64)  # each interpreted op is a numpy call: keep tiles modest
    # Never tile far past the real key count (tl.dot needs >= 16).
    return max(16, min(block, next_pow2(max(n, 1))))


def block_m_interpreted(m: int) -> int:
    return max(16, min(32, next_pow2(max(m, 1))))


def _bucket(x: int) -> int:
    # Autotune keys use power-of-two buckets so that every new M or N does not retune.
    return min(next_pow2(max(x, 1)), 1 << 16)


# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N is capped by the chunk_size hint.
# The 16x16 single-stage tile is the last resort for huge D/Dv and tiny M/N.
# The last four, 8 warps over mid-sized tiles, are the backward's: at D = 128 in 16-bit on sm_90 (Triton 3.9,
# make sass-report) dK/dV 64x64 and 32x128 and dQ 64x64 and 128x32 compile to wgmma with no spill, where the
# 4-warp tiles of those sizes spill (dK/dV 64x64, 4 warps: 48 bytes) and the larger 8-warp ones too (dK/dV
# 128x64: 432 bytes). Which is fastest is the autotuner's to measure on the card, among the configs that do not
# spill for the call's code path where the AOT table has such a full-rate one (:mod:`.triton_spills`).
# The last three are dK/dV's with dropout at D = 128: on sm_90 128 keys (two warpgroups' wgmma rows) against 16
# queries, or 32 queries unpipelined, are the full-rate tiles whose registers hold dK, dV, K, V and the
# dropout mask without a spill (32 x 128 pipelined: 80 bytes causal, 232 with a mask; Triton 3.9); 64 x 32 with
# 8 warps is sm_80's with a mask and dropout in Triton 3.6 (every other full-rate tile spills 40 bytes or more).
_GPU_TILES = ((16, 16, 2, 1), (16, 64, 4, 2), (16, 128, 4, 2), (32, 32, 4, 2), (64, 16, 4, 2),
              (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2),
              (64, 128, 4, 2), (128, 128, 8, 2),
              (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2),
              (16, 128, 8, 2), (32, 128, 8, 1), (64, 32, 8, 2))


def _gpu_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in _GPU_TILES]


def _smem_estimate(c, elem: int, d: int, dv: int, pair_rules: bool = False) -> int:
    # An estimate, meant as an upper bound, of the shared memory of all three kernels (forward, dK/dV, dQ), from their
    # ahead-of-time compiles for sm_80 and sm_90 (bench/gpu/triton_aot.py, Triton 3.9): the streamed
    # operand tiles, one buffer per stage (sm_90 keeps num_stages buffers, sm_80 num_stages - 1; at
    # least 2 counted, as the unpipelined backward still holds the transposed operands), the resident
    # tile, and the [BLOCK_M, BLOCK_N] scores tile converted through shared memory. The former
    # estimate (num_stages - 1 buffers, no scores tile) was below the real use for most configs and
    # kept configs beyond the device's limit (e.g. dQ 16x128 for fp16 at D = 256 needs 176 KiB on
    # sm_80, 64x128 needs 320 KiB on sm_90), which the autotuner then compiled for nothing.
    # With a mask or dropout (``pair_rules``: the attention op's per-pair rules) one more [BLOCK_M, BLOCK_N]
    # tile: without it the estimate was below the compiled use of 12 of 1149 configs (make sass-report and the
    # CI scope, Triton 3.9) and kept one beyond sm_80's limit (dK/dV, additive mask and dropout, fp32, D = 16,
    # 128x128: 168448 bytes). Still not a bound everywhere: of 1137 compiled configs, the same kernel's 128x64
    # with 3 stages uses 142336 bytes against 122880 estimated (within both limits).
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    return elem * ((d + dv) * (max(c.num_stages, 2) * max(bm, bn) + min(bm, bn)) + bm * bn * (2 if pair_rules else 1))


def _prune_configs(configs, named_args, kernel_name: str = "", **kwargs):
    """Keep configs within the chunk_size hint, the problem size and shared memory, then those that do not
    spill on this card where the AOT table knows (:func:`~.triton_spills.spill_free_configs`)."""
    elem = named_args["Q"].element_size()
    d, dv = kwargs["BLOCK_D"], kwargs["BLOCK_DV"]
    pair_rules = bool(kwargs.get("ATTN_MASK")) or bool(kwargs.get("HAS_DROPOUT"))
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(named_args["Q"].device.index or 0)
        budget = props["max_shared_mem"]
    except Exception:  # pragma: no cover - conservative default (sm_86 class)
        budget = 99 * 1024
    bn_max, m_b, n_b = named_args["BLOCK_N_MAX"], named_args["M_BUCKET"], named_args["N_BUCKET"]
    kept = [c for c in configs
            if c.kwargs["BLOCK_N"] <= max(16, min(bn_max, n_b)) and c.kwargs["BLOCK_M"] <= max(16, m_b)
            and _smem_estimate(c, elem, d, dv, pair_rules) <= budget
            and (elem < 4 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= _FP32_MAX_TILE)]
    if not kept:
        return [min(configs, key=lambda c: _smem_estimate(c, elem, d, dv, pair_rules))]
    if kwargs.get("PAGED"):
        # A paged cache's keys come through per-row addresses (block table): with 128-key tiles the forward at
        # D = 128 spills 16 bytes on sm_90 (16x128, 8 warps; Triton 3.9 AOT), 64-key tiles none.
        kept = [c for c in kept if c.kwargs["BLOCK_N"] <= _MAX_PAGED_BLOCK_N] or kept
    arch = device_arch()
    if table_arch(arch) == 80 and max(d, dv) <= _MAX_PIPELINED_D:
        # On sm_80-sm_89 a one-stage config loads its tiles without cp.async (no pipeline: every load waits for
        # the MMAs before it); up to D = 128 a pipelined config always fits, and the one-stage ones stay the last
        # resort of the larger head dims (issue 43: LDGSTS in every config the autotuner may pick there).
        kept = [c for c in kept if c.num_stages > 1] or kept
    return spill_free_configs(kept, kernel_name, arch, elem, d, dv, kwargs)


#: The widest key tile of a forward reading a paged cache.
_MAX_PAGED_BLOCK_N = 64
#: The largest padded head dim at which the configs of sm_80-sm_89 are all pipelined (above: the one-stage
#: 16 x 16 tile may be the only one whose stages fit shared memory).
_MAX_PIPELINED_D = 128


# fp32 runs its products as exact fp32 FMAs (no tensor cores), whose operand tiles live in registers: from
# 64 x 32 on, ptxas gives up on registers altogether (32 registers and 8-13 KiB of local memory per thread
# for the forward, dK/dV and dQ at D = 128 on sm_90, Triton 3.9, make sass-report's AOT compile) and takes
# 17-42 s per kernel to compile, so a first fp32 call on a GPU spent minutes compiling configs that could
# never win. The tiles up to 1024 pairs spill 0.1-2.7 KiB and compile in 3-7 s.
_FP32_MAX_TILE = 1024


# The per-pair flags too: causal halves the work per program and the masks and dropout add to it, so
# their best tiles may differ from cross attention's.
# The backward's GUARD_ROWS too (a call with a non-finite q or k runs another code path), and the forward's
# SPLIT_K (a decoding call's parts hold few queries and a slice of the keys).
_TUNE_KEY = ["BLOCK_D", "BLOCK_DV", "BLOCK_N_MAX", "M_BUCKET", "N_BUCKET", "ATTN_MASK", "IS_CAUSAL", "HAS_DROPOUT",
             "GUARD_ROWS", "WINDOW", "SOFTCAP", "ALIBI", "SPLIT_K", "PAGED"]


#: The tiles each kernel runs under ``ATTN_EXT_TRITON_PIN=1`` when its pruning keeps them (else the largest
#: smaller survivor, see ``pinned_configs``): not measured (no GPU run yet), the usual picks of
#: FlashAttention-2-style Triton kernels. The forward streams K/V past a 128-row query tile with 8 warps
#: (estimated 96 KiB of shared memory at D = 64 in 16-bit: within every card's limit; 176 KiB at D = 128:
#: sm_90, while sm_80 falls back to 64 x 64, 3 stages). The backward kernels each hold two fp32
#: accumulators per program, so a 64 x 64 tile keeps them in registers (56 / 104 KiB at D = 64 / 128).
PINNED_TILES = {"forward": (128, 64, 8, 2), "backward": (64, 64, 4, 2)}


def _tiles_key(bm: int, bn: int, warps: int, stages: int) -> tuple:
    # config_tiles() of the triton.Config of these tiles
    return (("BLOCK_M", bm), ("BLOCK_N", bn)), warps, stages


def autotuned(kernel, pinned: str):
    """``kernel`` in ``triton.autotune`` over the tiles above, built on first use; ``pinned`` names its entry
    of ``PINNED_TILES`` (the one config under ``ATTN_EXT_TRITON_PIN=1``)."""
    name = kernel.__name__

    def prune(configs, named_args, **kwargs):
        return _prune_configs(configs, named_args, kernel_name=name, **kwargs)

    key = [arg for arg in _TUNE_KEY if arg in kernel.arg_names]
    return lazily_autotuned(kernel, _gpu_configs, key, prune=prune, preferred=_tiles_key(*PINNED_TILES[pinned]))


#: The one config of a launch that is not autotuned (:func:`launch_fixed`): the smallest tile, which fits every
#: head dim, dtype and card; two stages (a cp.async pipeline on sm_80 and later) up to a padded head dim of 128,
#: one beyond (fp32 at D = 256 would need 99 KiB of shared memory for two).
FIXED_TILES = (16, 16, 4, 1)
FIXED_TILES_PIPELINED = (16, 16, 4, 2)


def launch_fixed(kernel, grid, args, meta, m: int, n: int, chunk_size: int) -> None:
    """Launch ``kernel`` as :func:`launch` does, but with :data:`FIXED_TILES` on a GPU too: for a rare code path
    (the forward's fix-up of rows with non-finite operands), where autotuning would time programs that exit."""
    if interpreting():
        launch(kernel, None, grid, args, meta, m, n, chunk_size)
        return
    pipelined = max(meta["BLOCK_D"], meta["BLOCK_DV"]) <= _MAX_PIPELINED_D
    bm, bn, warps, stages = FIXED_TILES_PIPELINED if pipelined else FIXED_TILES
    args = (*args, bn, _bucket(m), _bucket(n))
    kernel[grid({**meta, "BLOCK_M": bm, "BLOCK_N": bn})](*args, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                                         num_stages=stages, **meta)


def launch(kernel, tuned, grid, args, meta, m: int, n: int, chunk_size: int) -> None:
    """Launch with fixed tiles under the interpreter, autotuned tiles on GPU.

    ``args`` must end with the (unused in-kernel) tuning-key slots
    ``BLOCK_N_MAX, M_BUCKET, N_BUCKET`` which this fills in; ``grid`` maps the launch's constexprs
    (``meta``, and the config's ``BLOCK_M``, ``BLOCK_N`` and any other kwarg it sets) to the launch grid.
    """
    bn = _block_n(chunk_size, n)
    args = (*args, bn, _bucket(m), _bucket(n))
    if interpreting():
        bm = block_m_interpreted(m)
        kernel[grid({**meta, "BLOCK_M": bm, "BLOCK_N": bn})](*args, BLOCK_M=bm, BLOCK_N=bn, **meta)
    else:
        tuned()[grid](*args, **meta)
