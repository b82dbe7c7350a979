"""The measured rows of ``bench.json`` files (``python -m bench.gpu.bench_cuda``), each time matched with its
prediction in :mod:`bench.gpu.predicted`; :mod:`bench.gpu.measured_vs_predicted` prints them side by side.

Matching: an attention row is found by its dtype, D, N (= M), mask and pass through
:func:`bench.gpu.predicted.attention_label`, and its implementation; the other sections' rows by the problem
their prediction models (state update at N = 1e6, merge in fp32, greedy tree at N = 1e6 and b = 2, Intention
forward, Cholesky). Where a prediction names one of our backends ("ours (triton)") but its model has nothing
backend-specific, both of our backends are set against it. A measured time without a prediction keeps None
as its prediction: it is listed, never dropped. Labels are read in any of the spellings in :func:`normalise`.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.bench_state_update import NEW_KEYS
from bench.gpu import predicted
from bench.gpu.attention_impls import OURS
from bench.gpu.other_ops import CHOLESKY_SHAPE, INTENTION_SHAPE
from bench.gpu.states import MERGE_SHAPE

#: A time this many times above or below its prediction gets a mark.
MARK_FACTOR = 2.0
#: bench.json's sections in the order bench.gpu.bench_cuda runs them, and the sections of bench.gpu.predicted
#: they hold.
SECTIONS = {"attention": ("attention",), "states": ("states",), "tree": ("tree",), "other": ("intention", "cholesky")}
#: The fields that name a bench.json row (the rest are what was measured).
ID_FIELDS = ("section", "dtype", "D", "N", "M", "causal", "pass", "impl", "kind", "backend", "what", "b")
_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
_PASSES = {"fwd_bwd": "fwd+bwd", "fwd-bwd": "fwd+bwd", "fwdbwd": "fwd+bwd", "forward": "fwd",
           "forward+backward": "fwd+bwd"}
_LARGE_N = 1_000_000
#: Longest reason kept in the summary of the rows not measured (an error's first line can be long).
REASON_CHARS = 120

# The non-attention predictions, (label, implementation) as bench.gpu.predicted.other_rows writes them.
UPDATE_OURS = ("update 16 keys into N=1e6", "ours (3 launches)")
UPDATE_RECOMPUTE = ("update 16 keys into N=1e6", "recompute over all keys")
MERGE_OURS = (f"merge {MERGE_SHAPE} fp32", "ours (1 kernel)")
MERGE_TORCH = (f"merge {MERGE_SHAPE} fp32", "PyTorch (about 10 elementwise kernels)")
TREE_OURS = ("greedy retrieval, N=1e6, M=1024, b=2", "ours")
TREE_FULL = ("greedy retrieval, N=1e6, M=1024, b=2", "full attention (fp32)")
INTENTION_OURS = (f"intention {INTENTION_SHAPE} fp32", "ours (triton)")
INTENTION_SDPA = (f"intention {INTENTION_SHAPE} fp32", "SDPA (same shape)")
CHOLESKY_OURS = (f"batched Cholesky {CHOLESKY_SHAPE} fp32", "ours (triton)")
CHOLESKY_TORCH = (f"batched Cholesky {CHOLESKY_SHAPE} fp32", "torch.linalg.cholesky")
OTHER_PREDICTIONS = (UPDATE_OURS, UPDATE_RECOMPUTE, MERGE_OURS, MERGE_TORCH, TREE_OURS, TREE_FULL, INTENTION_OURS,
                     INTENTION_SDPA, CHOLESKY_OURS, CHOLESKY_TORCH)


@dataclass(frozen=True)
class Measurement:
    """One measured time of a bench.json row (a row may hold several: update and recompute, fwd and fwd+bwd)."""
    section: str
    case: str
    impl: str
    ms: float
    flops: float | None = None                    # the row's own flop count, where it has one
    predicted_as: tuple[str, str] | None = None   # (label, implementation) of its prediction

    @property
    def key(self) -> tuple[str, str, str]:
        return self.section, self.case, self.impl


@dataclass(frozen=True)
class Run:
    path: Path
    header: str
    ceilings: dict
    measured: tuple[Measurement, ...]
    measured_rows: frozenset            # identities (ID_FIELDS) of the rows that hold a time
    not_measured: dict                  # identity -> (section, reason)


@dataclass(frozen=True)
class Line:
    """A line of the output: the last run's measurement of a key and what the other runs gave."""
    measurement: Measurement
    run: int                                       # 1-based, the order of the files given
    others: tuple[tuple[int, float], ...]          # (run, ms) of the other runs that measured it
    prediction: predicted.Row | None

    @property
    def ratio(self) -> float | None:
        return None if self.prediction is None else self.measurement.ms / self.prediction.predicted_ms

    @property
    def flops(self) -> float | None:
        return self.measurement.flops or (work_flops(self.prediction) if self.prediction else None)

    @property
    def tflops(self) -> float | None:
        return None if not self.flops else self.flops / (self.measurement.ms * 1e9)

    @property
    def marked(self) -> bool:
        return self.ratio is not None and (self.ratio > MARK_FACTOR or self.ratio < 1 / MARK_FACTOR)


def work_flops(row: predicted.Row) -> float | None:
    """The flops of a prediction whose work is a flop count ("131 GFLOP fp32"); None for bytes or launches."""
    found = re.match(r"([0-9.]+(?:e[+-]?\d+)?) ([GT])FLOP\b", row.work)
    return None if not found else float(found[1]) * (1e9 if found[2] == "G" else 1e12)


def normalise(row: dict) -> dict:
    """The row with its labels in one spelling: dtype fp16/bf16/fp32, pass fwd/fwd+bwd, integer sizes, causal
    False when absent, M = N when absent (bench.json writes them so; older or hand-made files may not)."""
    out = dict(row)
    if "dtype" in out:
        name = str(out["dtype"]).removeprefix("torch.")
        out["dtype"] = _DTYPES.get(name, name)
    if "pass" in out:
        out["pass"] = _PASSES.get(str(out["pass"]), str(out["pass"]))
    for size in ("D", "N", "M", "b"):
        if out.get(size) is not None:
            out[size] = int(out[size])
    if out.get("section") == "attention":
        out["causal"] = bool(out.get("causal", False))
        out.setdefault("M", out["N"])
    return out


def identity(row: dict) -> tuple:
    return tuple(row.get(f) for f in ID_FIELDS)


def _attention(r: dict) -> list[Measurement]:
    if r["M"] == r["N"]:
        case = predicted.attention_label(r["dtype"], r["D"], r["N"], r["causal"], r["pass"])
        key = (case, r["impl"])
    else:  # the predictions are for self-attention shapes only
        case = f"{r['dtype']} D={r['D']} M={r['M']} N={r['N']} {'causal' if r['causal'] else 'full'} {r['pass']}"
        key = None
    return [Measurement("attention", case, r["impl"], r["ms"], r.get("flops"), key)]


def _states(r: dict) -> list[Measurement]:
    backend = r["backend"]
    if r["kind"] == "update":
        case, large = f"update {NEW_KEYS} keys, N={r['N']:,}", r["N"] == _LARGE_N
        return [Measurement("states", case, f"{backend} update", r["update_ms"], None, UPDATE_OURS if large else None),
                Measurement("states", case, f"{backend} recompute", r["recompute_ms"], None,
                            UPDATE_RECOMPUTE if large else None)]
    fp32 = r["dtype"] == "fp32"
    return [Measurement("states", f"merge {r['dtype']}", backend, r["ms"], None, MERGE_OURS if fp32 else None),
            Measurement("states", f"merge {r['dtype']}", f"PyTorch ops (beside {backend})", r["torch_ms"], None,
                        MERGE_TORCH if fp32 else None)]


def _tree(r: dict) -> list[Measurement]:
    large = r["N"] == _LARGE_N
    if r["what"] == "full":
        return [Measurement("tree", f"full attention, N={r['N']:,}", r["impl"], r["ms"], None,
                            TREE_FULL if large else None)]
    if r["what"] == "tree":
        return [Measurement("tree", f"greedy tree, N={r['N']:,}, b={r['b']}", r["impl"], r["ms"], None,
                            TREE_OURS if large and r["b"] == 2 else None)]
    return [Measurement("tree", f"{r['what']}, N={r['N']:,}, b={r.get('b')}", r.get("impl", "cuda"), r["ms"])]


def _other(r: dict) -> list[Measurement]:
    impl = r["impl"]
    if r["what"] == "cholesky":
        key = CHOLESKY_OURS if impl in OURS else CHOLESKY_TORCH if impl == "torch" else None
        return [Measurement("other", "batched Cholesky + solve", impl, r["ms"], None, key)]
    fwd_key = {("intention", True): INTENTION_OURS, ("sdpa", False): INTENTION_SDPA}.get((r["what"], impl in OURS))
    return [Measurement("other", f"{r['what']} fwd", impl, r["fwd_ms"], None, fwd_key),
            Measurement("other", f"{r['what']} fwd+bwd", impl, r["fwd_bwd_ms"])]


_MEASUREMENTS = {"attention": _attention, "states": _states, "tree": _tree, "other": _other}


def measurements(row: dict) -> list[Measurement]:
    """The times a measured row holds, each with the key of its prediction (or None); [] for a row without."""
    r = normalise(row)
    expand = _MEASUREMENTS.get(r.get("section"))
    if r.get("note") or expand is None:
        return []
    try:
        return expand(r)
    except KeyError:  # a row without its times (a run stopped while writing it): counted as not measured
        return []


def reason(note: str) -> str:
    """A not-measured row's reason as one kind: the ways of saying "time limit" as one, numbers as "#" (a call
    over its time limit says how long it took), cut to :data:`REASON_CHARS`."""
    text = note.removeprefix("not measured:").strip()
    if text.startswith("time limit"):
        return "time limit of the bench stage"
    text = re.sub(r"\b\d[\d.,]*(?:e[+-]?\d+)?", "#", text)
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def read_run(path: Path) -> Run:
    data = json.loads(Path(path).read_text())
    measured, with_time, without = [], set(), {}
    for row in data.get("rows", []):
        found = measurements(row)
        ident = identity(normalise(row))
        if found:
            measured += found
            with_time.add(ident)
        else:
            without[ident] = (row.get("section", "?"), reason(row.get("note", "no time in the row")))
    return Run(Path(path), data.get("header", ""), data.get("ceilings") or {}, tuple(measured), frozenset(with_time),
               without)


def predictions() -> dict[tuple[str, str], predicted.Row]:
    return {(r.label, r.implementation): r for r in predicted.attention_rows() + predicted.other_rows()}


def compare(runs: list[Run]) -> list[Line]:
    """Every measured key once, in the order first met, with the last run's time and its prediction."""
    by_key: dict[tuple, list[tuple[int, Measurement]]] = {}
    for i, run in enumerate(runs, 1):
        for m in run.measured:
            by_key.setdefault(m.key, []).append((i, m))
    table = predictions()
    lines = []
    for found in by_key.values():
        run, last = found[-1]
        lines.append(Line(last, run, tuple((i, m.ms) for i, m in found[:-1]),
                          table.get(last.predicted_as) if last.predicted_as else None))
    return lines


def not_measured(runs: list[Run]) -> dict[str, Counter]:
    """Per section, the reasons of the rows no run measured (the last run's reason), counted."""
    measured = set().union(*(r.measured_rows for r in runs))
    last: dict[tuple, tuple[str, str]] = {}
    for run in runs:
        last.update({k: v for k, v in run.not_measured.items() if k not in measured})
    counts: dict[str, Counter] = {}
    for section, why in last.values():
        counts.setdefault(section, Counter())[why] += 1
    return counts


def unmeasured_predictions(lines: list[Line]) -> Counter:
    """Per bench.json section, the predictions that no measured time was set against."""
    used = {(ln.prediction.label, ln.prediction.implementation) for ln in lines if ln.prediction}
    section_of = {p: s for s, parts in SECTIONS.items() for p in parts}
    return Counter(section_of[r.section] for r in predicted.attention_rows() + predicted.other_rows()
                   if (r.label, r.implementation) not in used)
