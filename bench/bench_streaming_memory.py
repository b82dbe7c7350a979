"""``python -m bench run streaming_memory``: peak memory of streaming keys vs materialising them.

For each key count N (B=1, H=4, M=128, D=Dv=64, fp32, CPU) it measures, in a
fresh subprocess per (implementation, N) (see :mod:`.memory`), the peak extra
memory of

``stream``
    ``ae.stream_attention(q, chunks)`` where ``chunks`` is a generator drawing
    (k, v) chunks of 4096 keys with ``torch.randn`` on the fly, so the full key
    set never exists;
``sdpa``
    what a non-streaming user must do: draw the full k and v with
    ``torch.randn``, then call ``torch.nn.functional.scaled_dot_product_attention``.
    Materialising k and v is inside the measured call, so it counts.

The goal of the issue: ours flat in N (the report gives max/min over N), while
SDPA's grows with N; the quick grid stops at N = 1e5 and says so. Writes ``streaming_memory.{md,json,png}`` to the output
directory and prints the Markdown table to stdout; progress goes to stderr.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.calls import start_run
from bench.harness.goals import confirm, confirmed_text, grid_note, sizes
from bench.harness.machine import load_average, machine_markdown
from bench.harness.memory import measure_peak_extra
from bench.harness.plot import Series, plot_panel
from bench.harness.report import markdown_table, progress, publish_run

NAME = "streaming_memory"
B, H, M, D, DV = 1, 4, 128, 64, 64
DTYPE = torch.float32
CHUNK = 4096
FULL_NS: tuple[int, ...] = (10_000, 100_000, 1_000_000)
#: Without N = 1e6, whose two probes draw 2 GB of keys twice each (about 20 s).
QUICK_NS: tuple[int, ...] = (10_000, 100_000)
IMPLS: tuple[str, ...] = ("stream", "sdpa")
#: "Flat": the largest peak of ``stream`` over N at most this many times its smallest.
FLAT_MAX_RATIO = 1.2
_PROBE = "bench.bench_streaming_memory:memory_probe"


def kv_bytes(n: int) -> int:
    """Bytes of k and v together with ``n`` keys."""
    return B * H * n * (D + DV) * torch.finfo(DTYPE).bits // 8


def make_query(seed: int = 0) -> torch.Tensor:
    """Random ``q [B, H, M, D]``."""
    return torch.randn(B, H, M, D, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def chunk_stream(n: int, chunk: int = CHUNK, seed: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(k, v)`` chunks of ``chunk`` keys (the last one shorter), ``n`` keys in all.

    Each chunk is drawn only when asked for, as from a data loader or a sensor,
    so at most the chunks the consumer still holds exist at a time.
    """
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        yield (torch.randn(B, H, size, D, generator=gen, dtype=DTYPE),
               torch.randn(B, H, size, DV, generator=gen, dtype=DTYPE))


def memory_probe(impl: str, n: int, backend: str = "cpp") -> Callable[[], object]:
    """Target of :func:`bench.harness.memory.measure_peak_extra`.

    Builds ``q`` now (part of the baseline) and returns the call to measure,
    which creates its keys itself: chunk by chunk for ``"stream"``, all at once
    for ``"sdpa"``. Each call starts a fresh generator, since the probe calls
    it twice (warm-up, then measured).
    """
    q = make_query()
    if impl == "stream":
        return lambda: ae.stream_attention(q, chunk_stream(n), backend=backend)
    if impl == "sdpa":
        def sdpa():
            gen = torch.Generator().manual_seed(1)
            k = torch.randn(B, H, n, D, generator=gen, dtype=DTYPE)
            v = torch.randn(B, H, n, DV, generator=gen, dtype=DTYPE)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        return sdpa
    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def _label(impl: str, backend: str) -> str:
    return {"stream": f"stream_attention[{backend}], chunks of {CHUNK}",
            "sdpa": "randn k, v + SDPA"}[impl]


def _measure(options: BenchOptions, ns: tuple[int, ...]) -> list[dict]:
    """One fresh-process probe per (N, implementation)."""
    rows: list[dict] = []
    total, step = len(ns) * len(IMPLS), 0
    for n in ns:
        for impl in IMPLS:
            step += 1
            progress(f"[{step}/{total}] N={n:,} {_label(impl, options.backend)} peak extra memory ...", end="")
            start = time.perf_counter()
            mem = measure_peak_extra(_PROBE, {"impl": impl, "n": n, "backend": options.backend})
            elapsed = time.perf_counter() - start
            progress(f" {mem.mb:.1f} MB ({mem.method}, {elapsed:.0f} s)" if mem.mb is not None
                     else f" n/a ({mem.note})")
            rows.append({"N": n, "impl": impl, "peak_extra_mb": mem.mb, "method": mem.method, "note": mem.note,
                         "probe_seconds": elapsed})
    return rows


def _goals(rows: list[dict], options: BenchOptions | None = None) -> dict:
    """Flatness of ``stream`` (max/min over N; re-probed once when it fails or is borderline, given
    ``options``) and growth of ``sdpa`` (largest N / smallest N)."""
    def peaks(impl: str, of: list[dict]) -> list[float] | None:
        values = [r["peak_extra_mb"] for r in of if r["impl"] == impl]
        return values if values and all(v for v in values) else None

    def ratio(of: list[dict]) -> float | None:
        ours = peaks("stream", of)
        return max(ours) / min(ours) if ours else None

    def remeasure() -> float | None:
        ns = sorted({r["N"] for r in rows})
        return ratio([{"impl": "stream", "peak_extra_mb": measure_peak_extra(
            _PROBE, {"impl": "stream", "n": n, "backend": options.backend}).mb} for n in ns])

    sdpa = peaks("sdpa", rows)
    judged = confirm(ratio(rows), FLAT_MAX_RATIO, False, remeasure if options else None,
                     "stream peak max/min over N", progress)
    return {"stream_max_over_min": ratio(rows), "max_ratio": FLAT_MAX_RATIO, "judged": judged, "flat": judged["met"],
            "sdpa_largest_over_smallest": sdpa[-1] / sdpa[0] if sdpa else None}


def _tables(result: dict) -> str:
    cfg = result["config"]
    peak = {(r["N"], r["impl"]): r["peak_extra_mb"] for r in result["rows"]}

    def cell(x: float | None) -> str | None:
        return None if x is None else f"{x:.1f}"

    table_rows = [[f"{n:,}", f"{kv_bytes(n) / 1e6:.1f}", cell(peak[(n, "stream")]), cell(peak[(n, "sdpa")])]
                  for n in cfg["Ns"]]
    ours = [peak[(n, "stream")] for n in cfg["Ns"] if peak[(n, "stream")] is not None]
    # In chunks, because "holds only the state and the current chunk" is the claim to check.
    chunks_text = f"; ours peaks at {max(ours) / (kv_bytes(cfg['chunk']) / 1e6):.1f} chunks' worth" if ours else ""
    lines = [
        f"Streaming memory, B={cfg['B']}, H={cfg['H']}, M={cfg['M']}, D=Dv={cfg['D']}, {cfg['dtype']}, CPU, "
        f"backend {cfg['backend']}. **ours**: `ae.stream_attention(q, chunks)` with `chunks` a generator "
        f"drawing (k, v) chunks of {cfg['chunk']} keys with `torch.randn` on the fly (the full key set never "
        f"exists). **SDPA**: draw the full k and v `[{cfg['B']},{cfg['H']},N,{cfg['D']}]` with `torch.randn`, "
        "then `scaled_dot_product_attention`; materialising k and v is inside the measured call, as a "
        "non-streaming user must do it.",
        "",
        markdown_table(["N (keys)", "K+V MB (for scale)", "ours peak extra MB", "SDPA peak extra MB (incl. k, v)"],
                       table_rows),
        "",
        f"Peak extra memory = peak RSS during one call minus RSS before it, in a fresh process per cell "
        f"(q excluded, output included; MB = 10⁶ bytes). One chunk's k and v take "
        f"{kv_bytes(cfg['chunk']) / 1e6:.1f} MB{chunks_text}.",
        "",
        _goal_line(result),
        "",
        machine_markdown(result["machine"]),
    ]
    return "\n".join(lines)


def _goal_line(result: dict) -> str:
    cfg, goals = result["config"], result["goals"]
    growth = goals["sdpa_largest_over_smallest"]
    note = grid_note(cfg["quick"], sizes(FULL_NS), sizes(cfg["Ns"]))
    return (f"Goal{note}, ours flat in N: max/min over N (flat: <= {goals['max_ratio']}) = "
            f"{confirmed_text(goals['judged'], lambda x: f'{x:.2f}')}. SDPA grows "
            f"{'n/a' if growth is None else f'{growth:,.0f}x'} from N={cfg['Ns'][0]:,} to N={cfg['Ns'][-1]:,}.")


def _summary(result: dict) -> tuple[str, str]:
    """The README's short table and its sentence with the goal."""
    cfg = result["config"]
    peak = {(r["N"], r["impl"]): r["peak_extra_mb"] for r in result["rows"]}

    def cell(x: float | None) -> str | None:
        return None if x is None else f"{x:,.1f}"

    rows = [[f"{n:,}", f"{kv_bytes(n) / 1e6:,.0f}", cell(peak[(n, "stream")]), cell(peak[(n, "sdpa")])]
            for n in cfg["Ns"]]
    return (markdown_table(["N (keys)", "K+V MB", "stream peak extra MB", "SDPA peak extra MB (incl. k, v)"], rows),
            f"`ae.stream_attention(q, chunks)` over a generator of {cfg['chunk']}-key chunks vs drawing k, v and "
            f"calling SDPA, B={cfg['B']}, H={cfg['H']}, M={cfg['M']}, D={cfg['D']}, fp32. " + _goal_line(result))


def _plot(result: dict, path) -> None:
    cfg = result["config"]
    ns = cfg["Ns"]
    peak = {(r["N"], r["impl"]): r["peak_extra_mb"] for r in result["rows"]}
    plot_panel(
        [Series(f"stream_attention, chunks of {cfg['chunk']}", ns, [peak[(n, "stream")] for n in ns], "-", "o", "C0"),
         Series("randn k, v + SDPA", ns, [peak[(n, "sdpa")] for n in ns], "--", "s", "C1"),
         # The inputs' size gives the flat line a scale to be read against.
         Series("K+V of N keys (for scale)", ns, [kv_bytes(n) / 1e6 for n in ns], ":", "", "0.5")],
        path,
        title=f"streaming memory, B={cfg['B']} H={cfg['H']} M={cfg['M']} D={cfg['D']} fp32",
        xlabel="N (keys)", ylabel="peak extra memory of one call (MB)",
    )


def run(options: BenchOptions) -> int:
    """Run the benchmark; see the module docstring.

    Returns
    -------
    int
        0 on success (whether or not ours is flat: the report says); 2 when
        attn_ext's op cannot run with the requested backend; 1 when a probe
        failed or the README could not be updated.
    """
    started = start_run(NAME, options, QUICK_NS, FULL_NS)
    if isinstance(started, int):
        return started
    ns, machine, warnings = started
    rows = _measure(options, ns)
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME, "grid": options.grid, "command": options.command,
        "config": {"B": B, "H": H, "M": M, "D": D, "Dv": DV, "dtype": "fp32", "device": "cpu", "Ns": list(ns),
                   "chunk": CHUNK, "backend": options.backend, "quick": options.quick},
        "machine": machine,
        "rows": rows,
        "goals": _goals(rows, options),
        "warnings": warnings,
    }
    failed = [f"N={r['N']:,} {r['impl']}: {r['note']}" for r in rows if r["peak_extra_mb"] is None]
    return publish_run(NAME, result, _tables, _summary, options, _plot, failed)
