"""The attention kernels' spill pruning (``attn_ext/ops/attention/triton_spills.py``): which configs the autotuner
keeps on sm_80 and sm_90 given the AOT table of spilled bytes, on a made-up table (the rule) and on the committed
ones, one per Triton version (that they cover the kernels, and which code paths are known gaps).

That the committed table matches the kernels' machine code is the AOT check's part (``bench/gpu/triton_aot.py``:
a kept config that spills outside the known gaps fails CI).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

import pkgutil  # noqa: E402

from attn_ext.ops.attention import (spill_tables, triton_bwd_tma, triton_fwd_tma, triton_spills,  # noqa: E402
                                    triton_tiles)

#: The Triton versions with a committed table ("3.9", ...).
VERSIONS = sorted(m.name.removeprefix("triton_").replace("_", ".") for m in pkgutil.iter_modules(spill_tables.__path__))


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _tiles(configs):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]


BIG, SMALL, NARROW = (128, 64, 8, 2), (16, 16, 2, 1), (32, 128, 8, 2)
FLAGS = {"plain": {"HAS_MASK": True}, "causal": {"IS_CAUSAL": True},
         "pairs": {"HAS_MASK": True, "ATTN_MASK": 2, "HAS_DROPOUT": True}}


@pytest.fixture
def table(monkeypatch):
    spills = {("_fwd_kernel", 90, 2, 64, 64, "plain"): {BIG: 0, SMALL: 0, NARROW: 0},
              ("_fwd_kernel", 90, 2, 64, 64, "causal"): {BIG: 96, SMALL: 0, NARROW: 0},
              ("_fwd_kernel", 90, 2, 64, 64, "pairs"): {BIG: 40, SMALL: 0, NARROW: 8}}
    monkeypatch.setattr(triton_spills, "spill_table", lambda version=None: spills)
    monkeypatch.delenv(triton_spills.SPILL_TABLE_ENV, raising=False)
    return spills


def _prune(tiles, flags, arch=90, kernel="_fwd_kernel", d=64, elem=2):
    configs = [_config(*t) for t in tiles]
    return _tiles(triton_spills.spill_free_configs(configs, kernel, arch, elem, d, d, flags))


def test_launch_variants_cover_each_code_path():
    assert triton_spills.launch_variants({}) == ("plain",)
    assert triton_spills.launch_variants({"HAS_MASK": True}) == ("plain",)
    assert triton_spills.launch_variants({"IS_CAUSAL": True}) == ("causal",)
    assert triton_spills.launch_variants({"IS_CAUSAL": True, "HAS_MASK": True}) == ("plain", "causal")
    assert triton_spills.launch_variants({"HAS_DROPOUT": True}) == ("pairs",)
    assert triton_spills.launch_variants({"IS_CAUSAL": True, "ATTN_MASK": 1}) == ("causal_pairs",)
    assert triton_spills.launch_variants({"IS_CAUSAL": True, "HAS_DROPOUT": True, "HAS_MASK": True}) == \
        ("plain", "causal_pairs")
    # the TMA forward's persistent grid, a config's choice
    assert triton_spills.launch_variants({"IS_CAUSAL": True, "PROGRAMS_PER_SM": 2}) == ("causal_persistent",)
    assert triton_spills.launch_variants({"IS_CAUSAL": True, "PROGRAMS_PER_SM": 0}) == ("causal",)


def test_a_persistent_config_is_judged_by_its_own_entry(table):
    def config(tiles, programs):
        bm, bn, w, s = tiles
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "PROGRAMS_PER_SM": programs}, num_warps=w, num_stages=s)

    table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal")] = {BIG: 0, SMALL: 0}
    table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal_persistent")] = {BIG: 8, SMALL: 0}
    configs = [config(BIG, 0), config(SMALL, 0), config(BIG, 1), config(SMALL, 1)]
    kept = triton_spills.spill_free_configs(configs, "_fwd_tma_kernel", 90, 2, 64, 64, FLAGS["causal"])
    assert [(_tiles([c])[0], c.kwargs["PROGRAMS_PER_SM"]) for c in kept] == [(BIG, 0), (SMALL, 0), (SMALL, 1)]
    # the persistent entry missing: unmeasured, nothing pruned
    del table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal_persistent")]
    assert triton_spills.spill_free_configs(configs, "_fwd_tma_kernel", 90, 2, 64, 64, FLAGS["causal"]) == configs
    # a gap only where neither grid has a spill-free full-rate tile
    table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal_persistent")] = {BIG: 0, SMALL: 0}
    table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal")] = {BIG: 16, SMALL: 0}
    assert not [g for g in triton_spills.spill_gaps() if g[0] == "_fwd_tma_kernel"]
    table[("_fwd_tma_kernel", 90, 2, 64, 64, "causal_persistent")] = {BIG: 24, SMALL: 0}
    (gap,) = [g for g in triton_spills.spill_gaps() if g[0] == "_fwd_tma_kernel"]
    assert gap[4] == ("causal",) and "128x64 w8 s2 uses 16 bytes" in gap[5] and "16x16 w2 s1 persistent" in gap[5]


def test_spilling_configs_dropped_where_a_full_rate_one_is_free(table):
    assert _prune([BIG, SMALL, NARROW], FLAGS["plain"]) == [BIG, SMALL, NARROW]
    # causal: the 128 x 64 tile spills, the 32 x 128 one is spill-free but runs wgmma at half height on sm_90
    # (32 query rows): not full-rate there, so the spilling full-rate tile stays (a known gap) ...
    assert _prune([BIG, SMALL, NARROW], FLAGS["causal"]) == [BIG, SMALL, NARROW]
    # ... while on the table's sm_80 entry, 32 x 128 is full-rate and the spilling tile goes
    table[("_fwd_kernel", 80, 2, 64, 64, "causal")] = table[("_fwd_kernel", 90, 2, 64, 64, "causal")]
    assert _prune([BIG, SMALL, NARROW], FLAGS["causal"], arch=86) == [SMALL, NARROW]
    # a launch with key padding and the causal rule takes the most either spills
    table[("_fwd_kernel", 80, 2, 64, 64, "plain")] = {BIG: 0, SMALL: 0, NARROW: 16}
    assert _prune([BIG, SMALL, NARROW], {**FLAGS["causal"], "HAS_MASK": True}, arch=80) == [BIG, SMALL, NARROW]
    # the pairs variant (with key padding, FLAGS["pairs"]): NARROW spills 8 B there, BIG 40: no spill-free
    # full-rate tile is left, all are kept; once NARROW is spill-free the spilling BIG goes
    table[("_fwd_kernel", 80, 2, 64, 64, "plain")] = {BIG: 0, SMALL: 0, NARROW: 0}
    table[("_fwd_kernel", 80, 2, 64, 64, "pairs")] = table[("_fwd_kernel", 90, 2, 64, 64, "pairs")]
    assert _prune([BIG, SMALL, NARROW], FLAGS["pairs"], arch=80) == [BIG, SMALL, NARROW]
    table[("_fwd_kernel", 80, 2, 64, 64, "pairs")] = {BIG: 40, SMALL: 0, NARROW: 0}
    assert _prune([BIG, SMALL, NARROW], FLAGS["pairs"], arch=80) == [SMALL, NARROW]


def test_small_problems_keep_only_spill_free_tiles(table):
    # no full-rate config survives the size pruning: the spill-free ones are kept, spilling ones dropped
    table[("_fwd_kernel", 90, 2, 64, 64, "causal")][(16, 64, 4, 2)] = 24
    assert _prune([SMALL, (16, 64, 4, 2)], FLAGS["causal"]) == [SMALL]


def test_no_table_entry_leaves_the_configs(table, monkeypatch):
    tiles = [BIG, SMALL, NARROW]
    assert _prune(tiles, FLAGS["causal"], d=128) == tiles          # head dim not in the table
    assert _prune(tiles, FLAGS["causal"], elem=4) == tiles         # fp32
    assert _prune(tiles, FLAGS["causal"], arch=100) == tiles       # a card the table does not cover
    assert _prune(tiles, FLAGS["causal"], arch=None) == tiles      # no GPU target
    assert _prune(tiles, {**FLAGS["causal"], "UPCAST": True}) == tiles
    assert _prune(tiles + [(64, 64, 4, 2)], FLAGS["causal"]) == tiles + [(64, 64, 4, 2)]  # an unmeasured config
    table[("_fwd_kernel", 80, 2, 64, 64, "causal")] = {BIG: 96, SMALL: 0, NARROW: 0}
    monkeypatch.setenv(triton_spills.SPILL_TABLE_ENV, "0")
    assert _prune(tiles, FLAGS["causal"], arch=80) == tiles


def test_table_arch():
    assert [triton_spills.table_arch(a) for a in (70, 75, 80, 86, 89, 90, 100, 120, None)] == \
        [None, None, 80, 80, 80, 90, None, None, None]


_BUDGET = {80: 166912, 90: 232448}  # the cards' shared memory per block (bench/gpu/triton_aot_target.py)


def _too_big(kernel, arch, d, variant):
    """The general kernels' tiles that the shared-memory pruning drops on ``arch`` (the TMA kernels' all fit)."""
    if kernel.endswith("_tma_kernel"):
        return set()
    pairs = variant in ("pairs", "causal_pairs")
    return {t for t in triton_tiles._GPU_TILES
            if triton_tiles._smem_estimate(_config(*t), 2, d, d, pairs) > _BUDGET[arch]}


def test_the_tables_of_the_cpu_and_gpu_machines_tritons_are_committed_and_the_running_one_is_read():
    assert {"3.6", "3.9"} <= set(VERSIONS)
    assert triton_spills.spill_table() is triton_spills.spill_table(triton.__version__)
    assert triton_spills.spill_table("2.1.0") == {}  # no table: no spill pruning


@pytest.mark.parametrize("version", VERSIONS)
def test_committed_table_covers_the_kernels_and_their_configs(version):
    spills = triton_spills.spill_table(version)
    general = ("plain", "causal", "pairs", "causal_pairs")
    for kernel, archs, tiles, variants in (
            ("_fwd_kernel", (80, 90), triton_tiles._GPU_TILES, general),
            ("_bwd_dkdv", (80, 90), triton_tiles._GPU_TILES, general),
            ("_bwd_dq", (80, 90), triton_tiles._GPU_TILES, general),
            ("_fwd_tma_kernel", (90,), triton_fwd_tma.TMA_TILES, ("plain", "causal", "causal_persistent")),
            ("_bwd_dkdv_tma_kernel", (90,), triton_bwd_tma.TMA_BWD_TILES["dkdv"], ("plain", "causal")),
            ("_bwd_dq_tma_kernel", (90,), triton_bwd_tma.TMA_BWD_TILES["dq"], ("plain", "causal"))):
        for arch in archs:
            for d in (64, 128):
                for variant in variants:
                    entry = spills[(kernel, arch, 2, d, d, variant)]
                    # every config the size pruning keeps at large M and N is measured
                    assert set(entry) == set(tiles) - _too_big(kernel, arch, d, variant), (kernel, arch, d, variant)


@pytest.mark.parametrize("version", VERSIONS)
def test_committed_gaps_are_the_code_paths_without_a_free_full_rate_tile(version):
    gaps = {(k, a, d, v) for k, a, d, _, v, _ in triton_spills.spill_gaps(version)}
    # (Triton 3.9's table has no gap since 2026-11-29, 3.6's one; each entry below is checked either way.)
    assert all(len(v) == 1 for _, _, _, v in gaps)
    table = triton_spills.spill_table(version)
    assert table
    for (kernel, arch, elem, d, dv, variant), entry in table.items():
        if variant.endswith(triton_spills.PERSISTENT):  # weighed with its path's own grid
            assert not any(g[:3] == (kernel, arch, d) and g[3][0] == variant for g in gaps)
            continue
        # a launch's configs: the path's, and the path's in the persistent grid where measured
        stacks = [(t, s) for e in (entry, table.get((kernel, arch, elem, d, dv, variant + triton_spills.PERSISTENT), {}))
                  for t, s in e.items()]
        free_full = any(s == 0 and triton_spills.full_rate(kernel, arch, t) for t, s in stacks)
        spilling_full = any(s > 0 and triton_spills.full_rate(kernel, arch, t) for t, s in stacks)
        assert ((kernel, arch, d, (variant,)) in gaps) == (elem == 2 and spilling_full and not free_full)


def test_prune_configs_on_a_gpu_target_uses_the_table(monkeypatch):
    """Through ``triton_tiles``' pruning, with a stand-in driver saying sm_90 (as the AOT check's) and Triton 3.9's
    table whatever Triton runs the test."""
    class Driver:
        class utils:
            @staticmethod
            def get_device_properties(index):
                return {"max_shared_mem": 232448}

        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", 90, 32)

    table = triton_spills.spill_table("3.9")
    monkeypatch.setattr(triton_spills, "spill_table", lambda version=None: table)
    driver = triton.runtime.driver
    monkeypatch.setattr(driver, "_active", None, raising=False)  # restored after: the lazily made CPU one
    driver.set_active(Driver())
    named = {"Q": torch.empty(1, dtype=torch.bfloat16), "BLOCK_N_MAX": 128, "M_BUCKET": 4096, "N_BUCKET": 4096}
    configs = triton_tiles._gpu_configs()
    pruned_some = False
    for variant, flags in FLAGS.items():
        kw = {"BLOCK_D": 128, "BLOCK_DV": 128, **flags}
        kept = _tiles(triton_tiles._prune_configs(configs, named, kernel_name="_fwd_kernel", **kw))
        sized = _tiles(triton_tiles._prune_configs(configs, named, **kw))  # no kernel name: no table
        stack = {t: max(table[("_fwd_kernel", 90, 2, 128, 128, v)][t] for v in triton_spills.launch_variants(flags))
                 for t in sized}
        free = [t for t in sized if stack[t] == 0]
        if any(triton_spills.full_rate("_fwd_kernel", 90, t) for t in free):
            assert kept == free, variant
            pruned_some = pruned_some or len(free) < len(sized)
        else:
            assert kept == sized, variant
    assert pruned_some


def test_prune_configs_on_sm80_keeps_only_pipelined_configs_up_to_d128(monkeypatch):
    """On sm_80-sm_89 a one-stage config loads without cp.async: up to a padded head dim of 128 the pruning offers
    only pipelined configs (issue 43's LDGSTS in every config the autotuner may pick); above, the one-stage 16 x 16
    tile stays, the last resort when two stages do not fit."""
    class Driver:
        class utils:
            @staticmethod
            def get_device_properties(index):
                return {"max_shared_mem": 166912}  # A100's opt-in shared memory per block

        @staticmethod
        def get_current_target():
            return GPUTarget("cuda", 80, 32)

    driver = triton.runtime.driver
    monkeypatch.setattr(driver, "_active", None, raising=False)  # restored after: the lazily made CPU one
    driver.set_active(Driver())
    configs = triton_tiles._gpu_configs()
    assert any(c.num_stages == 1 for c in configs)
    for elem_dtype in (torch.bfloat16, torch.float32):
        named = {"Q": torch.empty(1, dtype=elem_dtype), "BLOCK_N_MAX": 128, "M_BUCKET": 4096, "N_BUCKET": 4096}
        for d in (64, 128):
            kept = triton_tiles._prune_configs(configs, named, BLOCK_D=d, BLOCK_DV=d)
            assert kept and all(c.num_stages > 1 for c in kept), (elem_dtype, d)
    named = {"Q": torch.empty(1, dtype=torch.float32), "BLOCK_N_MAX": 16, "M_BUCKET": 16, "N_BUCKET": 16}
    kept = triton_tiles._prune_configs(configs, named, BLOCK_D=256, BLOCK_DV=256)
    assert any(c.num_stages == 1 for c in kept)  # D = 256: the one-stage tile is still offered
