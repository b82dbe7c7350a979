"""Which autotune configs of the attention kernels spill, read from their ahead-of-time compile, and the
pruning that keeps them out of the autotuner's choice (issue 43: no spills in any config it can pick).

Spilling is a property of the machine code, known before a GPU runs anything: ``bench/gpu/spill_table.py``
compiles every kept config of the forward, dK/dV and dQ kernels for sm_80 and sm_90, and of the TMA forward's
and backward's for sm_90 (fp16/bf16, head dims 64 and 128, each code path, the persistent grid's too), and writes the local memory each one uses to
a module of :mod:`.spill_tables`, one per Triton minor version. The pruning here reads the running Triton's, so
what it drops is measured, not guessed.

A launch is matched to the table's variants by what its code path does: ``plain`` (key padding only),
``causal`` (the causal rule), ``pairs`` (an attention mask and dropout, the heaviest path without the causal
rule) and ``causal_pairs`` (the causal rule with dropout); a launch with key padding besides the causal rule or
per-pair rules takes the most ``plain`` and that variant spill (register use grows with the code path in
these kernels; the four variants themselves are what the AOT check verifies). A window, soft cap or ALiBi adds
``scored`` (compiled with all three); a packed batch has its own ``causal_varlen`` and ``scored_varlen`` (the first
also bounds a packed call without the causal rule). Where no table entry matches
(a Triton version without a table, another head dim, fp32, a card outside sm_80-sm_89 and sm_90, a changed
config list) the pruning leaves the configs as they are.

The rule keeps the spill-free configs unless dropping the spilling ones would leave no *full-rate* tile
(at least 2048 query-key pairs, and on sm_90 an MMA row tile of 64, what one wgmma warpgroup takes) where
the spilling ones had one: there a spill of tens of bytes costs less than a 16 x 16 tile, and the table
says so in :func:`spill_gaps` (the machine-code check lists those as known gaps).
``ATTN_EXT_TRITON_SPILL_TABLE=0`` turns the pruning off (the table's generator needs every config).
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Iterable, Optional

import triton

__all__ = ["CHECKED_VARIANTS", "GUARDED", "PAGED", "PERSISTENT", "SCORED", "SPILL_TABLE_ENV", "SPLIT", "VARLEN", "device_arch",
           "full_rate", "launch_variants", "spill_free_configs", "spill_gaps", "spill_table", "table_arch"]

SPILL_TABLE_ENV = "ATTN_EXT_TRITON_SPILL_TABLE"


@functools.lru_cache(maxsize=None)
def spill_table(version: Optional[str] = None) -> dict:
    """The table of Triton ``version`` (default: the running one), by its minor version (``3.9.1``: ``triton_3_9``
    of :mod:`.spill_tables`); ``{}`` where none was measured: register allocation differs between Triton
    versions (3.6 spills 8-64 bytes in tiles 3.9 compiles without), so another version's table would guess."""
    major, minor = (version or triton.__version__).split(".")[:2]
    try:
        return importlib.import_module(f"attn_ext.ops.attention.spill_tables.triton_{major}_{minor}").SPILLS
    except ModuleNotFoundError:
        return {}


#: The smallest tile (query-key pairs per program) counted as full-rate.
_FULL_RATE_PAIRS = 2048


def device_arch() -> Optional[int]:
    """The compute capability Triton compiles for (``90``, ``86``; the AOT check's stand-in driver's too), or None
    without a GPU target (a CPU machine)."""
    try:
        return int(triton.runtime.driver.active.get_current_target().arch)
    except Exception:  # no driver: no table applies
        return None


def table_arch(arch: Optional[int]) -> Optional[int]:
    """The table's target for a compute capability as Triton writes it (``90``, ``86``): 80 for sm_80-sm_89
    (one instruction set and register file), 90 for sm_90; None for others."""
    if arch is None:
        return None
    if 80 <= arch < 90:
        return 80
    return 90 if arch == 90 else None


#: The variant of launches with a sliding window, a soft cap or ALiBi (:mod:`.triton_score_mod`).
SCORED = "scored"
#: The suffix of a packed batch's variants (``causal_varlen``, ``scored_varlen``; :mod:`.triton_varlen`).
VARLEN = "_varlen"
#: The suffix of a variant compiled in the persistent grid (``causal_persistent``).
PERSISTENT = "_persistent"
#: The suffix of a forward reading a paged cache (:mod:`.triton_paged`): not in the table (left as they are).
PAGED = "_paged"
#: The suffix of a forward split over keys (decoding, :mod:`.triton_split_keys`): not in the table (its configs are
#: left as they are), its own compiles (the part's bounds and offsets change the code around the loop).
SPLIT = "_split"
#: The suffix of the backward's guarded variants (``causal_guarded``): the code a call takes only when its q or k
#: holds a NaN or inf (``backward_route`` in :mod:`.triton_bwd`), never measured into the table, so its configs
#: are left as they are (the guard's exact product spills at D = 128; a rare call's cost, not training's).
GUARDED = "_guarded"


def launch_variants(flags) -> tuple[str, ...]:
    """The table variants whose code covers a launch with these constexprs (``HAS_MASK``, ``ATTN_MASK``,
    ``IS_CAUSAL``, ``HAS_DROPOUT``, ``WINDOW``, ``SOFTCAP``, ``ALIBI``; a config's ``PROGRAMS_PER_SM``). A launch with
    a window or a score modification adds ``scored``, compiled with all three (and key padding)."""
    causal, pairs = bool(flags.get("IS_CAUSAL")), bool(flags.get("ATTN_MASK") or flags.get("HAS_DROPOUT"))
    variants = ["plain"] if flags.get("HAS_MASK") or not (causal or pairs) else []
    if causal or pairs:
        variants.append({(True, False): "causal", (False, True): "pairs", (True, True): "causal_pairs"}[causal, pairs])
    scored = bool(flags.get("WINDOW") or flags.get("SOFTCAP") or flags.get("ALIBI"))
    if scored:
        variants.append(SCORED)
    if flags.get("VARLEN"):  # a packed batch (no masks, no dropout): its own compiles, the causal path bounding
        variants = [(SCORED if scored else "causal") + VARLEN]  # the plain one (one loop less)
    if flags.get("PROGRAMS_PER_SM"):  # the TMA forward's persistent grid: the same path inside a loop over tiles
        variants = [f"{v}{PERSISTENT}" for v in variants]
    if flags.get("PAGED"):
        variants = [f"{v}{PAGED}" for v in variants]
    if flags.get("SPLIT_K"):
        variants = [f"{v}{SPLIT}" for v in variants]
    if flags.get("GUARD_ROWS"):  # the backward's path for a non-finite q or k: not in the table, not pruned
        variants = [f"{v}{GUARDED}" for v in variants]
    return tuple(variants)


def _tiles(config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def full_rate(kernel: str, arch: int, tiles: tuple[int, int, int, int]) -> bool:
    """Whether a tile ``(BLOCK_M, BLOCK_N, warps, stages)`` runs the MMA at full rate: enough pairs, and on sm_90
    the MMA's row tile (the queries; dK/dV's keys) of 64."""
    bm, bn = tiles[0], tiles[1]
    mma_rows = bn if kernel.startswith("_bwd_dkdv") else bm
    return bm * bn >= _FULL_RATE_PAIRS and (arch != 90 or mma_rows >= 64)


def _stack(kernel: str, arch: int, elem: int, d: int, dv: int, variants: Iterable[str], tiles) -> Optional[int]:
    """The most local memory (bytes per thread) this config uses in any of ``variants``; None if the table lacks one."""
    worst = 0
    for variant in variants:
        entry = spill_table().get((kernel, arch, elem, d, dv, variant))
        if entry is None or tiles not in entry:
            return None
        worst = max(worst, entry[tiles])
    return worst


def spill_free_configs(configs: list, kernel: str, arch: Optional[int], elem: int, d: int, dv: int, flags) -> list:
    """``configs`` (already pruned by size and shared memory) without the ones the table says spill, as the
    module's rule says; unchanged where the table has no entry for every one of them."""
    arch = table_arch(arch)
    if arch is None or os.environ.get(SPILL_TABLE_ENV) == "0" or flags.get("UPCAST"):
        return configs
    # A config may choose its code path too (the persistent grid): its variants from the launch's and its own.
    stacks = [_stack(kernel, arch, elem, d, dv, launch_variants({**flags, **c.kwargs}), _tiles(c)) for c in configs]
    if not configs or any(s is None for s in stacks):
        return configs
    free = [c for c, s in zip(configs, stacks) if s == 0]
    if free and (any(full_rate(kernel, arch, _tiles(c)) for c in free)
                 or not any(full_rate(kernel, arch, _tiles(c)) for c in configs)):
        return free
    return configs


#: The code paths the AOT check compiles the general kernels in (cross attention; causal; the attention op with a
#: mask and dropout; causal with dropout); the TMA kernels have the first two. A launch's configs may also run
#: the same path in the persistent grid (:data:`PERSISTENT` variants), which the rule weighs with the others.
CHECKED_VARIANTS = (("plain",), ("causal",), ("pairs",), ("causal_pairs",), (SCORED,), ("causal" + VARLEN,),
                    (SCORED + VARLEN,))


def _label(tiles, variants) -> str:
    return "%dx%d w%d s%d" % tiles + (" persistent" if variants[0].endswith(PERSISTENT) else "")


def spill_gaps(version: Optional[str] = None) -> list[tuple[str, int, int, int, tuple[str, ...], str]]:
    """``(kernel, arch, d, dv, variants, why)`` for each 16-bit kernel, target, head dims and code path of
    :data:`CHECKED_VARIANTS` where the rule keeps spilling configs in Triton ``version``'s table (default: the
    running Triton's): no full-rate config is spill-free, so the autotuner may still pick one that spills.
    A launch's configs are those of the path and, where the table has them, of the path in the persistent grid."""
    out = []
    table = spill_table(version)
    keys = sorted({(k, a, d, dv) for k, a, e, d, dv, _ in table if e == 2})
    for kernel, arch, d, dv in keys:
        for variants in CHECKED_VARIANTS:
            stack = {}  # (variants, tiles) -> the most stack over the variants
            for group in (variants, tuple(v + PERSISTENT for v in variants)):
                entries = [table.get((kernel, arch, 2, d, dv, v)) for v in group]
                if any(e is None for e in entries):
                    continue
                stack.update({(group, t): max(e[t] for e in entries) for t in set.intersection(*map(set, entries))})
            if not any(group == variants for group, _ in stack):
                continue
            spilling_full = sorted((s, t, g) for (g, t), s in stack.items() if s > 0 and full_rate(kernel, arch, t))
            if spilling_full and not any(s == 0 and full_rate(kernel, arch, t) for (_, t), s in stack.items()):
                free = sorted(_label(t, g) for (g, t), s in stack.items() if s == 0)
                least, tile, group = spilling_full[0]
                out.append((kernel, arch, d, dv, variants,
                            f"spill-free only {', '.join(free) or 'none'}; the least "
                            f"spilling full-rate tile {_label(tile, group)} uses {least} bytes"))
    return out
