"""The benchmark and paper-reproduction harness of attn_ext, run from a clone: ``python -m bench``.

Not part of the installed package. ``python -m bench run`` times attn_ext's ops against PyTorch
(:data:`BENCHMARKS`, one ``bench_<op>.py`` module each); ``python -m bench train|eval|bandit|memory``
train and score the reference Neural Processes (:mod:`bench.np`). The shared timing, memory, report
and plot code is :mod:`bench.harness`.

Each benchmark is a module exposing ``run(options: BenchOptions) -> int`` (an exit status); modules
are imported only when run, so ``python -m bench --help`` stays fast and one broken benchmark does
not stop the others from being listed.
"""

from __future__ import annotations

import importlib

#: Benchmark name -> module implementing ``run(options) -> int``.
BENCHMARKS: dict[str, str] = {
    "cross_attention": "bench.bench_cross_attention",
    "state_update": "bench.bench_state_update",
    "streaming_memory": "bench.bench_streaming_memory",
    "tree_attention": "bench.bench_tree_attention",
    "intention": "bench.bench_intention",
    "batched_cholesky": "bench.bench_batched_cholesky",
    "sdpa": "bench.bench_sdpa",
    "sdpa_window": "bench.bench_sdpa_window",
    "sdpa_bias": "bench.bench_sdpa_bias",
    "varlen": "bench.bench_varlen",
    "decoding": "bench.bench_decoding",
    "paged": "bench.bench_paged",
    "call_overhead": "bench.bench_call_overhead",
    "te_attention": "bench.bench_te_attention",
    "np_step": "bench.bench_np_step",
    "np_demo": "bench.np.demo",
    "np_memory": "bench.np.np_memory",
    "chapter_memory": "bench.np.chapter_memory",
    "gp_quick": "bench.np.gp_report",
}
#: What ``python -m bench run`` runs when no names are given: the op benchmarks, the NP training step and the NP demo.
#: ``np_memory`` (about an hour at the full grid), ``chapter_memory`` (the chapter's 2-D grid, minutes) and
#: ``gp_quick`` (hours) run only when named.
DEFAULT_BENCHMARKS: tuple[str, ...] = (
    "cross_attention", "state_update", "streaming_memory", "tree_attention", "intention", "batched_cholesky",
    "sdpa", "sdpa_window", "sdpa_bias", "varlen", "decoding", "paged", "call_overhead", "te_attention", "np_step",
    "np_demo",
)


def run_benchmark(name: str, options) -> int:
    """Run benchmark ``name`` with ``options`` (a :class:`bench.harness.BenchOptions`); its exit status.

    Raises
    ------
    KeyError
        If ``name`` is not in :data:`BENCHMARKS`.
    """
    module = importlib.import_module(BENCHMARKS[name])
    return module.run(options)
