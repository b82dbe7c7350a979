"""The order the GPU tests start in: the longest first, so that pytest-xdist's workers end together.

pytest-xdist (``-n``, its ``load`` scheduling) hands the first quarter of the collected tests out one at a
time, round robin, and the rest in chunks as workers finish. In collection order the longest tests, the
Triton tests that compile fp32 kernels (tl.dot in ieee fp32 spills at the pinned 64 x 64 tiles; ptxas then
takes 10-30 s per kernel), came last: on the H200 window of 2026-11-28 (tests.progress) they started 40-140 s
into a 150 s stage, and several had not finished at its end. Started first, the longest run beside one
another on separate workers and the short ones fill in behind them.

The cost classes, from that record and from compiling the same launches ahead of time for sm_90
(bench/gpu/triton_aot.py; 15-90 s per test for fp32 forward and backward, 1-8 s for 16-bit), longest first:

0. Triton, fp32 (a test without a 16-bit dtype in its id computes in fp32), forward and backward (a
   ``backward`` test, sdpa's forward-and-backward, opcheck): three kernels or more, compiled one after another;
1. Triton, fp32 forward only; every tile config of the attention kernels (test_gpu_triton_configs.py: three
   16-bit kernels per test);
2. Triton, 16-bit;
3. the ``cuda`` backend (compiled by the build stage: no compile at all).

Within a class, the collection order. The sort is a pure function of the node ids, so that every xdist worker
orders its collection alike (xdist requires identical collections).
"""
from __future__ import annotations

SIXTEEN_BIT = ("float16", "bfloat16")
BOTH_PASSES = ("backward", "opcheck")


def cost_class(nodeid: str) -> int:
    """0 (longest) to 3 (shortest): see the module docstring."""
    params = nodeid[nodeid.index("["):] if "[" in nodeid else ""
    configs = "test_gpu_triton_configs.py" in nodeid
    if not (configs or params.endswith("triton]")):
        return 3
    if configs and "tree" not in nodeid:
        return 1
    if any(dtype in params for dtype in SIXTEEN_BIT):
        return 2
    name = nodeid.split("::")[-1]
    return 0 if any(word in name for word in BOTH_PASSES) else 1


def longest_first(nodeids: list[str]) -> list[int]:
    """The indices of ``nodeids`` in the order to run them (stable within a cost class)."""
    return sorted(range(len(nodeids)), key=lambda i: cost_class(nodeids[i]))
