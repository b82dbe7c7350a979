"""``ATTN_EXT_TRITON_PIN=1``: the configs each autotuned Triton kernel's autotuner gets, with and without it.

Without the variable every kernel keeps its full list and pruning; with it, each call runs one config:
the kernel's named default when its pruning keeps it, else the largest survivor below it, and always
one that the unpinned pruning keeps for that call (shared memory, problem size). The autotuner itself
needs a GPU driver, so these tests call the config builders and ``tuning_plan`` directly and record
what ``lazily_autotuned`` passes to ``triton.autotune``. That every config computes the right result is
python_tests/gpu/test_gpu_triton_configs.py's part.
"""
import itertools

import pytest
import torch

from attn_ext.ops.utils import triton as tu

triton = pytest.importorskip("triton")

from attn_ext.ops.attention import triton_tiles  # noqa: E402
from attn_ext.ops.intention import triton_ridge  # noqa: E402
from attn_ext.ops.tree import triton_fwd as tree_fwd  # noqa: E402

PIN = tu.PIN_ENV


def _tiles(config):
    return (config.kwargs.get("BLOCK_M"), config.kwargs.get("BLOCK_N"), config.num_warps, config.num_stages)


def _cross_call(dtype, d, m, n, chunk):
    """``early_config_prune``'s arguments for a launch (on the CPU the budget is the 99 KiB default)."""
    q = torch.empty(1, dtype=dtype)
    # BLOCK_N_MAX as _block_n computes it on a GPU (under the interpreter it is capped at 64 too)
    bn_max = max(16, min(triton_tiles._pow2_floor(chunk), 128, triton_tiles.next_pow2(n)))
    named = {"Q": q, "BLOCK_N_MAX": bn_max, "M_BUCKET": triton_tiles._bucket(m),
             "N_BUCKET": triton_tiles._bucket(n)}
    return named, {"BLOCK_D": triton_tiles.block_d(d), "BLOCK_DV": triton_tiles.block_d(d)}


def _plan(kind, monkeypatch, pinned):
    if pinned:
        monkeypatch.setenv(PIN, "1")
    else:
        monkeypatch.delenv(PIN, raising=False)
    preferred = triton_tiles._tiles_key(*triton_tiles.PINNED_TILES[kind])
    return tu.tuning_plan(triton_tiles._gpu_configs, triton_tiles._prune_configs, preferred)


@pytest.mark.parametrize("value", [None, "0", ""])
def test_unpinned_cross_attention_keeps_every_config_and_its_pruning(value, monkeypatch):
    if value is not None:
        monkeypatch.setenv(PIN, value)
    else:
        monkeypatch.delenv(PIN, raising=False)
    configs, prune = tu.tuning_plan(triton_tiles._gpu_configs, triton_tiles._prune_configs,
                                    triton_tiles._tiles_key(*triton_tiles.PINNED_TILES["forward"]))
    assert [_tiles(c) for c in configs] == list(triton_tiles._GPU_TILES)
    assert prune is triton_tiles._prune_configs


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_pinned_cross_attention_runs_one_survivor_of_every_call(kind, monkeypatch):
    configs, prune = _plan(kind, monkeypatch, pinned=True)
    assert len(configs) == len(triton_tiles._GPU_TILES)  # all kept: the pruning chooses per call
    for dtype, d, m, n, chunk in itertools.product((torch.float32, torch.float16), (16, 64, 128, 256),
                                                   (1, 16, 40, 1000), (1, 33, 5000), (16, 64, 128)):
        named, kw = _cross_call(dtype, d, m, n, chunk)
        survivors = triton_tiles._prune_configs(configs, named, **kw)
        pinned = prune(configs, named, **kw)
        assert len(pinned) == 1 and pinned[0] in survivors, (dtype, d, m, n, chunk)
        want = triton_tiles.PINNED_TILES[kind]
        if any(_tiles(c) == want for c in survivors):
            assert _tiles(pinned[0]) == want, (dtype, d, m, n, chunk)


def test_pinned_cross_attention_picks_the_named_tiles_or_the_largest_smaller_survivor(monkeypatch):
    _, prune = _plan("forward", monkeypatch, pinned=True)
    configs = triton_tiles._gpu_configs()
    # fp16, D = 64, large M and N: 128 x 64, 8 warps (96 KiB, within the 99 KiB default budget)
    named, kw = _cross_call(torch.float16, 64, 4096, 4096, 128)
    assert _tiles(prune(configs, named, **kw)[0]) == (128, 64, 8, 2)
    # a 10-query problem (M bucket 16): the largest 16-row tile
    named, kw = _cross_call(torch.float16, 64, 10, 4096, 128)
    assert _tiles(prune(configs, named, **kw)[0]) == (16, 128, 4, 2)
    # fp32 at D = 128: 128 x 64 needs ~352 KiB; the largest survivor listed before it
    named, kw = _cross_call(torch.float32, 128, 4096, 4096, 128)
    survivors = triton_tiles._prune_configs(configs, named, **kw)
    assert _tiles(prune(configs, named, **kw)[0]) == _tiles(survivors[-1]) != (128, 64, 8, 2)
    _, prune = _plan("backward", monkeypatch, pinned=True)
    named, kw = _cross_call(torch.float16, 64, 4096, 4096, 128)
    assert _tiles(prune(configs, named, **kw)[0]) == (64, 64, 4, 2)


@pytest.mark.parametrize("row_block", ["BLOCK_N", "BLOCK_M"])
def test_intention_row_tiles_pinned_to_the_one_that_fits_every_card(row_block, monkeypatch):
    configs = triton_ridge.row_configs(row_block)
    preferred = configs[triton_ridge._ROW_TILES.index(triton_ridge._PINNED_ROW_TILE)]
    monkeypatch.delenv(PIN, raising=False)
    assert tu.tuning_plan(configs, None, preferred) == (configs, None)
    monkeypatch.setenv(PIN, "1")
    pinned, prune = tu.tuning_plan(configs, None, preferred)
    assert prune is None and [(c.kwargs, c.num_warps, c.num_stages) for c in pinned] == [({row_block: 64}, 4, 2)]


@pytest.mark.parametrize("m", [1, 9, 100, 5000])
def test_tree_forward_pinned_to_its_largest_tile(m, monkeypatch):
    caps = tuple(tree_fwd._block_m_cap(m, 4, 64, w) for w in tree_fwd._WARPS)
    configs = tree_fwd.tree_configs(caps)
    monkeypatch.delenv(PIN, raising=False)
    assert tu.tuning_plan(configs) == (configs, None)
    monkeypatch.setenv(PIN, "1")
    pinned, _ = tu.tuning_plan(configs)
    assert pinned == [configs[-1]]
    assert pinned[0].num_warps == max(tree_fwd._WARPS) and pinned[0].kwargs["BLOCK_M"] == caps[-1]


def test_pinned_configs_rejects_an_empty_pruning():
    with pytest.raises(ValueError, match="pinned_configs"):
        tu.pinned_configs([])


def test_lazily_autotuned_reads_the_variable_when_the_autotuner_is_built(monkeypatch):
    calls = []
    monkeypatch.setattr(triton, "autotune", lambda **kw: (lambda kernel: calls.append(kw) or kernel))
    configs = triton_tiles._gpu_configs()
    preferred = triton_tiles._tiles_key(*triton_tiles.PINNED_TILES["forward"])
    monkeypatch.delenv(PIN, raising=False)
    build = tu.lazily_autotuned("kernel", configs, ("K",), prune=triton_tiles._prune_configs, preferred=preferred)
    monkeypatch.setenv(PIN, "1")  # set before the first launch: that is when it counts
    assert build() == "kernel" and build() == "kernel"
    assert len(calls) == 1 and calls[0]["key"] == ["K"] and calls[0]["configs"] == configs
    prune = calls[0]["prune_configs_by"]["early_config_prune"]
    named, kw = _cross_call(torch.float16, 64, 4096, 4096, 128)
    assert [_tiles(c) for c in prune(configs, named, **kw)] == [(128, 64, 8, 2)]
    monkeypatch.delenv(PIN)
    tu.lazily_autotuned("kernel", configs, ("K",), prune=triton_tiles._prune_configs, preferred=preferred)()
    assert calls[1]["prune_configs_by"]["early_config_prune"] is triton_tiles._prune_configs
