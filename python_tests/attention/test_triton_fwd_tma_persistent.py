"""The TMA forward's persistent grid (``PROGRAMS_PER_SM`` > 0, a config the autotuner weighs under the causal rule):
a fixed number of programs, each looping over the tiles ``t, t + P, ...`` of the list ordered longest query block
first. In the Triton interpreter: every tile is computed exactly as the one-program-per-tile grid computes it
(bit for bit), whatever the number of programs, including fewer programs than heads and more than tiles.
"""
from __future__ import annotations

import pytest
import torch

from attn_ext.ops.utils.triton import triton_unavailable_reason

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

if triton_unavailable_reason("cpu") is None:
    from test_triton_fwd_tma import _qkv

    from attn_ext.ops.attention import triton_fwd_tma


@pytest.mark.parametrize("programs", [1, 3, 1000])
@pytest.mark.parametrize("name", ["causal-M<N-gqa-bf16", "causal-M>N-fp16", "plain-tails-fp16"])
def test_the_persistent_grid_computes_every_tile_as_one_program_per_tile(name, programs):
    q, k, v, causal = _qkv(name)
    scale = q.shape[-1] ** -0.5
    out, lse = triton_fwd_tma.launch_forward_tma(q, k, v, scale, 16, causal)
    out_p, lse_p = triton_fwd_tma.launch_forward_tma(q, k, v, scale, 16, causal, persistent_programs=programs)
    assert torch.equal(out_p, out) and torch.equal(lse_p, lse)


def test_a_nan_query_row_stays_in_its_tile():
    # A tile's rows never leak into the next tile a program takes (its state starts afresh).
    q, k, v, causal = _qkv("causal-M=N-bf16")
    q[0, 1, 50, 3] = float("nan")
    out, lse = triton_fwd_tma.launch_forward_tma(q, k, v, q.shape[-1] ** -0.5, 16, causal, persistent_programs=2)
    nan_rows = out.isnan().any(-1) | lse.isnan()
    assert nan_rows[0, 1, 50] and nan_rows.sum() == 1


def test_the_grid_has_no_more_programs_than_tiles():
    meta = {"BLOCK_M": 32, "PROGRAMS_PER_SM": 0}
    assert triton_fwd_tma._grid(meta, 100, 6, None, None) == (4, 6)  # one program per (query block, batch-head)
    meta["PROGRAMS_PER_SM"] = 1
    assert triton_fwd_tma._grid(meta, 100, 6, 5, None) == (5, 1)
    assert triton_fwd_tma._grid(meta, 100, 6, 500, None) == (24, 1)


def test_the_persistent_configs_are_tried_only_under_the_causal_rule(monkeypatch):
    monkeypatch.setattr(triton_fwd_tma, "_shared_memory", lambda q: 232448)
    monkeypatch.setattr(triton_fwd_tma, "device_arch", lambda: None)  # no spill table: only the rules here
    named = {"Q": torch.empty(1, dtype=torch.bfloat16), "BLOCK_N_MAX": 128, "M_BUCKET": 4096, "N_BUCKET": 4096}
    configs = triton_fwd_tma._configs()
    for causal in (False, True):
        kept = triton_fwd_tma._prune(configs, named, BLOCK_D=64, BLOCK_DV=64, IS_CAUSAL=causal)
        persistent = [c for c in kept if c.kwargs["PROGRAMS_PER_SM"]]
        assert bool(persistent) == causal
    # Two programs per SM only where two of them fit its shared memory (D = 128: a 4-warp tile's estimate is
    # over half of 232448 bytes).
    kept = triton_fwd_tma._prune(configs, named, BLOCK_D=128, BLOCK_DV=128, IS_CAUSAL=True)
    assert all(c.kwargs["PROGRAMS_PER_SM"] < 2 for c in kept)
