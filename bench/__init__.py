"""Benchmarks of attn_ext ops, run by ``attn-ext bench`` (see :mod:`attn_ext.cli`).

Each benchmark is a module exposing ``run(options: BenchOptions) -> int`` (an
exit status) and is listed in :data:`BENCHMARKS`; modules are imported only
when run, so ``attn-ext --help`` stays fast and one broken benchmark does not
stop the others from being listed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

#: Benchmark name -> module implementing ``run(options) -> int``.
BENCHMARKS: dict[str, str] = {
    "cross_attention": "attn_ext.bench.cross_attention",
    "gp_quick": "attn_ext.bench.gp_quick",
    "intention": "attn_ext.bench.intention",
    "np_memory": "attn_ext.bench.np_memory",
    "state_update": "attn_ext.bench.state_update",
    "streaming_memory": "attn_ext.bench.streaming_memory",
    "tree_attention": "attn_ext.bench.tree_attention",
}


@dataclass(frozen=True)
class BenchOptions:
    """Options shared by every benchmark.

    Attributes
    ----------
    quick : bool
        Smaller problem sizes, for a run of a few minutes.
    out_dir : Path
        Directory receiving ``<name>.md``, ``<name>.json`` and ``<name>.png``.
    backend : str
        attn_ext backend to measure (``backend=`` of the op).
    repeats : int
        Timed repeats per measurement; the median is reported.
    update_readme : Path or None
        README whose ``<!-- bench:<name>:start/end -->`` block is rewritten.
    """

    quick: bool = False
    out_dir: Path = Path("bench/results")
    backend: str = "cpp"
    repeats: int = 5
    update_readme: Path | None = None


def run_benchmark(name: str, options: BenchOptions) -> int:
    """Run benchmark ``name`` and return its exit status.

    Raises
    ------
    KeyError
        If ``name`` is not in :data:`BENCHMARKS`.
    """
    module = importlib.import_module(BENCHMARKS[name])
    return module.run(options)
