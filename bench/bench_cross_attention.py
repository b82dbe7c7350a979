"""``python -m bench run cross_attention``: ``ae.cross_attention`` vs PyTorch SDPA on the CPU.

Workload: B=8, H=4, M=128 queries, D=Dv=64, fp32, no mask, default scale; N keys in
:data:`FULL_NS` (the quick grid: :data:`QUICK_NS`). **ours** = ``ae.cross_attention(q, k, v,
backend=...)``; **sdpa** = ``torch.nn.functional.scaled_dot_product_attention`` with PyTorch's own
kernel choice (the flash CPU kernel here); **sdpa-math** = SDPA forced onto its math path, which holds
the ``[B, H, M, N]`` scores, used only to check the memory method against a known size. Passes:
``fwd`` and ``fwd+bwd`` (:func:`bench.harness.calls.make_call`).

Per N it measures, in this process, the median wall time of both passes for ours and SDPA with their
repeats interleaved (so background load hits both alike), and, in a fresh subprocess per
(implementation, N), the peak extra memory of one forward (:mod:`bench.harness.memory`); then it
checks the memory method on SDPA's math path. Writes ``cross_attention.{md,json,png}``.

The pytest-benchmark functions at the end time the same calls:
``python -m pytest bench/bench_cross_attention.py --benchmark-only [--bench-large]``.
"""

from __future__ import annotations

import gc
import importlib
import sys
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.harness import BenchOptions
from bench.harness.calls import PASSES, Attention, check_ours, make_call, start_run
from bench.harness.machine import load_average, machine_markdown
from bench.harness.memory import PeakMemory, measure_peak_extra
from bench.harness.plot import Series, plot_time_and_memory
from bench.harness.report import format_ms, markdown_table, progress, publish_run
from bench.harness.timing import WARMUP_TEXT, time_interleaved

NAME = "cross_attention"
B, H, M, D, DV = 8, 4, 128, 64, 64
DTYPE = torch.float32
QUICK_NS: tuple[int, ...] = (1_000, 10_000)
FULL_NS: tuple[int, ...] = (1_000, 10_000, 100_000, 300_000)
IMPLS: tuple[str, ...] = ("ours", "sdpa")
#: Flops per B*H*M*N*D. Forward: QK^T and PV, 2 flops per multiply-add each.
#: Backward: recomputed QK^T, dO V^T, P^T dO, dS K, dS^T Q (D == Dv here).
FLOP_FACTOR = {"fwd": 4, "fwd+bwd": 4 + 10}
_PROBE = "bench.bench_cross_attention:memory_probe"
#: The math path must show at least this share of its score matrix, or the method is off.
_CHECK_MIN_SHARE = 0.95
#: Large enough that the scores (164 MB) dwarf allocator noise, small enough to take seconds.
_CHECK_N = 10_000


def flops(n: int, pass_: str) -> int:
    """Flops counted for one call of ``pass_`` with ``n`` keys (see FLOP_FACTOR)."""
    return FLOP_FACTOR[pass_] * B * H * M * n * D


def input_bytes(n: int) -> int:
    """Bytes of K and V together with ``n`` keys, to put memory figures in scale."""
    return B * H * n * (D + DV) * torch.finfo(DTYPE).bits // 8


def score_bytes(n: int) -> int:
    """Bytes of one fp32 ``[B, H, M, N]`` score matrix, the math path's minimum."""
    return B * H * M * n * 4


def make_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q [B,H,M,D]``, ``k [B,H,n,D]``, ``v [B,H,n,Dv]`` (fp32, CPU, no grad)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, M, D, generator=gen, dtype=DTYPE), torch.randn(B, H, n, D, generator=gen, dtype=DTYPE),
            torch.randn(B, H, n, DV, generator=gen, dtype=DTYPE))


def implementation(impl: str, backend: str = "cpp") -> Attention:
    """Attention callable ``f(q, k, v) -> out`` of ``impl`` ("ours", "sdpa" or "sdpa-math")."""
    if impl == "ours":
        # Looked up at call time so a stand-in assigned to attn_ext.cross_attention is used.
        op = importlib.import_module("attn_ext").cross_attention
        return lambda q, k, v: op(q, k, v, backend=backend)
    if impl == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention
    if impl == "sdpa-math":
        def sdpa_math(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        return sdpa_math
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS + ('sdpa-math',)}")


def impl_label(impl: str, backend: str) -> str:
    """Human-readable name of ``impl`` for tables and progress lines."""
    return {"ours": f"cross_attention[{backend}]", "sdpa": "sdpa", "sdpa-math": "sdpa[math]"}[impl]


def memory_probe(impl: str, n: int, backend: str = "cpp") -> Callable[[], object]:
    """Target of :func:`bench.harness.memory.measure_peak_extra`: one forward, inputs built now."""
    q, k, v = make_inputs(n)
    return make_call(implementation(impl, backend), "fwd", q, k, v)


def sdpa_kernel_name() -> str:
    """Which kernel SDPA picks for the benchmark's dtype/shapes, read off its grad_fn."""
    q, k, v = (t[:, :, :64].requires_grad_() for t in make_inputs(64))
    name = type(torch.nn.functional.scaled_dot_product_attention(q, k, v).grad_fn).__name__
    return "flash (CPU)" if "FlashAttentionForCpu" in name else f"other ({name})"


def _memory_dict(n: int, impl: str, mem: PeakMemory) -> dict:
    return {"N": n, "impl": impl, "peak_extra_mb": mem.mb, "method": mem.method, "note": mem.note}


def _measure(options: BenchOptions, ns: tuple[int, ...]) -> tuple[list[dict], list[dict], dict]:
    """Time and memory-probe every (N, impl, pass); then check the memory method."""
    total = len(ns) * (len(IMPLS) * len(PASSES) + len(IMPLS)) + 1
    step = 0
    timings: list[dict] = []
    memory: list[dict] = []
    fns = {impl: implementation(impl, options.backend) for impl in IMPLS}
    labels = {impl: impl_label(impl, options.backend) for impl in IMPLS}
    for n in ns:
        q, k, v = make_inputs(n)
        for pass_ in PASSES:
            # Announce the first line now; results arrive together since the repeats interleave.
            progress(f"[{step + 1}/{total}] N={n:,} {labels[IMPLS[0]]} {pass_} ...", end="")
            calls = {impl: make_call(fns[impl], pass_, q, k, v) for impl in IMPLS}
            measured = time_interleaved(calls, repeats=options.repeats)
            for i, impl in enumerate(IMPLS):
                step += 1
                if i:
                    progress(f"[{step}/{total}] N={n:,} {labels[impl]} {pass_} ...", end="")
                entry = {"N": n, "impl": impl, "pass": pass_, "flops": flops(n, pass_)}
                t = measured[impl]
                if isinstance(t, Exception):
                    entry.update(median_ms=None, samples_ms=[], gflops=None, error=f"{type(t).__name__}: {t}")
                    progress(f" failed: {entry['error']}")
                else:
                    gflops = flops(n, pass_) / (t.median_ms * 1e-3) / 1e9
                    entry.update(median_ms=t.median_ms, samples_ms=list(t.samples_ms), gflops=gflops)
                    progress(f" {t.median_ms:.1f} ms ({gflops:.1f} GFLOP/s)")
                timings.append(entry)
        # Free this N's inputs (the calls' closures and any exception tracebacks hold them
        # too) before the probes, so two copies never coexist on the machine.
        del q, k, v, calls, measured
        gc.collect()
        for impl in IMPLS:
            step += 1
            progress(f"[{step}/{total}] N={n:,} {labels[impl]} fwd peak extra memory ...", end="")
            mem = measure_peak_extra(_PROBE, {"impl": impl, "n": n, "backend": options.backend})
            progress(f" {mem.mb:.1f} MB ({mem.method})" if mem.mb is not None else f" n/a ({mem.note})")
            memory.append(_memory_dict(n, impl, mem))
    step += 1
    progress(f"[{step}/{total}] memory method check ...", end="")
    check = _check_memory_method(_CHECK_N)
    progress(f" {check['summary']}")
    return timings, memory, check


def _check_memory_method(n: int) -> dict:
    """Probe SDPA's math path, whose fp32 scores alone take B*H*M*N*4 bytes."""
    mem = measure_peak_extra(_PROBE, {"impl": "sdpa-math", "n": n})
    expected_mb = score_bytes(n) / 1e6
    if mem.mb is None:
        ok, summary = None, f"n/a ({mem.note})"
    else:
        ok = mem.mb >= _CHECK_MIN_SHARE * expected_mb
        summary = (f"SDPA math path at N={n:,}: peak extra {mem.mb:.1f} MB ({mem.method}); one [B,H,M,N] fp32 "
                   f"score matrix is {expected_mb:.1f} MB -> {'consistent' if ok else 'INCONSISTENT'}")
    return {**_memory_dict(n, "sdpa-math", mem), "expected_min_mb": expected_mb, "ok": ok, "summary": summary}


def _fmt(x: float | None, spec: str) -> str | None:
    return None if x is None else format(x, spec)


def _ratio(a: dict, s: dict) -> float | None:
    return a["median_ms"] / s["median_ms"] if a["median_ms"] and s["median_ms"] else None


def _tables(result: dict) -> str:
    """Markdown block: shapes, time table, memory table, machine line."""
    cfg = result["config"]
    ours = f"attn_ext ({cfg['backend']})"
    by_key = {(t["N"], t["impl"], t["pass"]): t for t in result["timings"]}
    time_rows = []
    for n in cfg["Ns"]:
        for pass_ in PASSES:
            a, s = by_key[(n, "ours", pass_)], by_key[(n, "sdpa", pass_)]
            time_rows.append([f"{n:,}", pass_, format_ms(a["median_ms"]), format_ms(s["median_ms"]),
                              _fmt(_ratio(a, s), ".2f"), _fmt(a["gflops"], ".1f"), _fmt(s["gflops"], ".1f")])
    mem = {(m["N"], m["impl"]): m for m in result["memory"]}
    mem_rows = [[f"{n:,}", f"{input_bytes(n) / 1e6:.1f}", _fmt(mem[(n, "ours")]["peak_extra_mb"], ".1f"),
                 _fmt(mem[(n, "sdpa")]["peak_extra_mb"], ".1f")] for n in cfg["Ns"]]
    return "\n".join([
        f"Cross attention, B={cfg['B']}, H={cfg['H']}, M={cfg['M']}, D=Dv={cfg['D']}, {cfg['dtype']}, CPU; "
        f"median of {cfg['repeats']} repeats after {WARMUP_TEXT}, the two implementations' repeats interleaved; "
        f"SDPA kernel: {result['sdpa_kernel']}.",
        "",
        markdown_table(["N (keys)", "pass", f"{ours} ms", "SDPA ms", f"{ours} / SDPA", f"{ours} GFLOP/s",
                        "SDPA GFLOP/s"], time_rows, align="lcrrrrr"),
        "",
        "GFLOP/s counts 4·B·H·M·N·D flops for fwd (QKᵀ, PV) and 14·B·H·M·N·D for fwd+bwd "
        "(4 forward + 10 backward: recomputed QKᵀ, dO·Vᵀ, Pᵀ·dO, dS·K, dSᵀ·Q).",
        "",
        markdown_table(["N (keys)", "K+V inputs MB", f"{ours} fwd peak extra MB", "SDPA fwd peak extra MB"], mem_rows),
        "",
        "Peak extra memory = peak RSS during one forward minus RSS before it, in a fresh process "
        "(inputs excluded, output included; MB = 10⁶ bytes). "
        f"Method check: {result['memory_check']['summary']}.",
        "",
        machine_markdown(result["machine"]),
    ])


def _summary(result: dict) -> tuple[str, str]:
    """The README's short table (time ratios and peak memory per N) and its sentence."""
    cfg = result["config"]
    by_key = {(t["N"], t["impl"], t["pass"]): t for t in result["timings"]}
    mem = {(m["N"], m["impl"]): m["peak_extra_mb"] for m in result["memory"]}
    rows = [[f"{n:,}", *(_fmt(_ratio(by_key[(n, "ours", p)], by_key[(n, "sdpa", p)]), ".2f") for p in PASSES),
             f"{input_bytes(n) / 1e6:,.0f}", _fmt(mem[(n, "ours")], ".1f"), _fmt(mem[(n, "sdpa")], ".1f")]
            for n in cfg["Ns"]]
    return (markdown_table(["N (keys)", "fwd time ours / SDPA", "fwd+bwd time ours / SDPA", "K+V MB",
                            "ours fwd peak extra MB", "SDPA fwd peak extra MB"], rows),
            f"`ae.cross_attention` vs SDPA ({result['sdpa_kernel']}), B={cfg['B']}, H={cfg['H']}, M={cfg['M']}, "
            f"D={cfg['D']}, fp32, {result['machine']['torch_threads']} threads; a time ratio below 1 = ours faster.")


def _plot(result: dict, path) -> None:
    cfg = result["config"]
    ns = cfg["Ns"]
    by_key = {(t["N"], t["impl"], t["pass"]): t["median_ms"] for t in result["timings"]}
    mem = {(m["N"], m["impl"]): m["peak_extra_mb"] for m in result["memory"]}
    names = {"ours": f"attn_ext ({cfg['backend']})", "sdpa": "SDPA"}
    styles = {"ours": ("-", "C0"), "sdpa": ("--", "C1")}
    time_series = [Series(f"{names[i]} {p}", ns, [by_key[(n, i, p)] for n in ns], styles[i][0],
                          "o" if p == "fwd" else "s", styles[i][1]) for i in IMPLS for p in PASSES]
    memory_series = [Series(f"{names[i]} fwd", ns, [mem[(n, i)] for n in ns], styles[i][0], "o", styles[i][1])
                     for i in IMPLS]
    # The inputs' size gives the flat memory lines a scale to be read against.
    memory_series.append(Series("K+V inputs (for scale)", ns, [input_bytes(n) / 1e6 for n in ns], ":", "", "0.5"))
    plot_time_and_memory(
        time_series, memory_series, path, xlabel="N (keys)",
        title=f"cross attention, B={cfg['B']} H={cfg['H']} M={cfg['M']} D={cfg['D']} fp32, "
              f"{result['machine']['torch_threads']} threads",
        memory_label="peak extra memory of one forward (MB)",
    )


def run(options: BenchOptions) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        0 on success; 2 when ``ae.cross_attention`` cannot run with the requested backend (nothing is
        timed then); 1 when a measurement failed or the README could not be updated.
    """
    started = start_run(NAME, options, QUICK_NS, FULL_NS)
    if isinstance(started, int):
        return started
    ns, machine, warnings = started
    timings, memory, check = _measure(options, ns)
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME, "grid": options.grid, "command": options.command,
        "config": {"B": B, "H": H, "M": M, "D": D, "Dv": DV, "dtype": "fp32", "device": "cpu", "Ns": list(ns),
                   "repeats": options.repeats, "warmup": 1, "backend": options.backend, "quick": options.quick},
        "flop_factor_per_BHMND": dict(FLOP_FACTOR), "sdpa_kernel": sdpa_kernel_name(), "machine": machine,
        "timings": timings, "memory": memory, "memory_check": check, "warnings": warnings,
    }
    if check["ok"] is False:
        result["warnings"].append(f"memory method check failed: {check['summary']}")
    failed = [f"N={t['N']} {impl_label(t['impl'], options.backend)} {t['pass']} failed: {t['error']}"
              for t in timings if t.get("error")]
    return publish_run(NAME, result, _tables, _summary, options, _plot, failed)


# ------------------------------------------------------------------------------ pytest-benchmark
# Defined only under pytest (bench/conftest.py collects bench_*.py), so `python -m bench` needs no pytest.
if "pytest" in sys.modules:
    import pytest

    @pytest.fixture(scope="session")
    def ours_error(backend: str) -> str | None:
        """Why 'ours' cannot run (then its benchmarks skip and SDPA's still run)."""
        return check_ours(backend)[0]

    # Module scope + params: each N's inputs (1.6 GB of K and V at N=1e5) are built once.
    @pytest.fixture(scope="module", params=FULL_NS, ids=lambda n: f"N={n}")
    def inputs(request: pytest.FixtureRequest):
        n = request.param
        if n > 100_000 and not request.config.getoption("--bench-large"):
            pytest.skip(f"N={n} runs only with --bench-large")
        return n, make_inputs(n)

    @pytest.mark.parametrize("pass_", PASSES)
    @pytest.mark.parametrize("impl", IMPLS)
    def test_cross_attention(benchmark, request, inputs, impl: str, pass_: str, backend: str, ours_error):
        n, (q, k, v) = inputs
        if impl == "ours" and ours_error:
            pytest.skip(ours_error)
        benchmark.group = f"cross_attention N={n} {pass_}"
        benchmark.extra_info.update(N=n, impl=impl_label(impl, backend), pass_=pass_, flops=flops(n, pass_),
                                    shape=f"B={B} H={H} M={M} D=Dv={D} fp32")
        benchmark.pedantic(make_call(implementation(impl, backend), pass_, q, k, v),
                           rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1, iterations=1)
        stats = getattr(benchmark, "stats", None)
        if stats is not None:  # None under --benchmark-disable
            benchmark.extra_info["gflops_median"] = flops(n, pass_) / stats.stats.median / 1e9
