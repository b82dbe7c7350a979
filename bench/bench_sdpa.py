"""``python -m bench run sdpa``: ``ae.scaled_dot_product_attention`` vs PyTorch's SDPA on the CPU.

Three parts, all timed in this process against PyTorch with the samples interleaved (so background
load hits both alike), fp32, CPU, PyTorch's default thread count:

1. **Causal self-attention**, B=4, H=8, D=64, L = S in :data:`FULL_LS` (quick grid :data:`QUICK_LS`),
   forward and forward+backward (:func:`bench.harness.calls.make_call`): ours ``is_causal=True`` vs
   SDPA ``is_causal=True`` (goal: ours / SDPA <= :data:`~bench.bench_sdpa_goals.MAX_SDPA_RATIO`), and ours
   causal vs ours non-causal (goal: <= :data:`~bench.bench_sdpa_goals.MAX_CAUSAL_RATIO` at L =
   :data:`~bench.bench_sdpa_goals.CAUSAL_GOAL_L`: the causal kernels skip
   the key chunks above the diagonal, about half the work). SDPA non-causal is timed too, for scale,
   up to :data:`SDPA_NONCAUSAL_MAX_L` (at 16k it would add many minutes and judges nothing).
2. **Padding-plus-causal bool mask** ``[B, 1, L, S]`` (:func:`padding_causal_mask`) given to both as
   ``attn_mask`` (goal: ours / SDPA <= 1.0), L in :data:`MASK_FULL_LS`; for comparison, ours with the
   same pairs expressed as ``is_causal=True`` + ``key_padding_mask`` (no goal).
3. **Transformer encoder training step** before and after ``ae.nn.swap_attention``
   (:mod:`bench.bench_sdpa_transformer`; no goal, the ratio is reported).

Before timing, ours is checked against SDPA on a small problem (:func:`check_sdpa`). A failing or
borderline goal is re-measured before it is judged (:mod:`bench.harness.goals`); the goals, their limits
and the implementations' labels are :mod:`bench.bench_sdpa_goals`. The tables, goal text and figure are
:mod:`bench.bench_sdpa_report`; writes ``sdpa.{md,json,png}``.

Large sizes take long on a 2-core machine (16k causal forward+backward: tens of seconds per call), so
rows at L >= :data:`LARGE_L` take :data:`LARGE_REPEATS` samples without a warm-up round
(:func:`timing_plan`) and print one dot per call on stderr. ``ATTN_EXT_BENCH_SDPA_TINY=1`` swaps in a
tiny debug grid (L = 64, 128), e.g. for ``--backend reference``, which is far too slow at 1k.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

import attn_ext as ae
from bench import bench_sdpa_report as report
from bench import bench_sdpa_transformer as transformer
from bench.bench_sdpa_goals import CAUSAL_GOAL_L, GOALS, LABELS, ratio
from bench.harness import BenchOptions
from bench.harness.calls import PASSES, make_call
from bench.harness.goals import combined, confirm, grid_note
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import format_ms, progress, publish_run, timing_dict
from bench.harness.timing import MIN_WARMUP_S, time_interleaved

NAME = "sdpa"
B, H, D = 4, 8, 64
DTYPE = torch.float32
FULL_LS: tuple[int, ...] = (1024, 4096, 16384)
QUICK_LS: tuple[int, ...] = (512, 1024)
TINY_LS: tuple[int, ...] = (64, 128)
MASK_FULL_LS: tuple[int, ...] = (1024, 4096)
MASK_QUICK_LS: tuple[int, ...] = (1024,)
MASK_TINY_LS: tuple[int, ...] = (64,)
#: The last batch entry pads this share of its keys; entry b pads (b + 1) / B of it.
PAD_FRACTION = 0.25
#: SDPA without the causal rule is timed (for scale only) up to this L.
SDPA_NONCAUSAL_MAX_L = 4096
#: From this L on a call takes seconds to minutes: few samples, no warm-up round, a dot per call.
LARGE_L = 8192
LARGE_REPEATS = 2
#: Timed rounds of a small row span at least this long (see time_interleaved's min_timed_s).
MIN_TIMED_S, QUICK_MIN_TIMED_S = 3.0, 1.0
TINY_ENV = "ATTN_EXT_BENCH_SDPA_TINY"
#: Max abs difference of ours to SDPA (fp32, outputs and gradients of order 1) above which the report warns.
CHECK_ATOL = 1e-4

CAUSAL_IMPLS: tuple[str, ...] = ("ours_causal", "sdpa_causal", "ours_full", "sdpa_full")
MASK_IMPLS: tuple[str, ...] = ("ours_mask", "sdpa_mask", "ours_causal_kpm")


@dataclass(frozen=True)
class Grid:
    """The sizes of one run: ``name`` ("full", "quick" or "tiny"), the causal part's L, the mask part's L,
    the Transformer's sequence lengths and batch."""

    name: str
    causal_ls: tuple[int, ...]
    mask_ls: tuple[int, ...]
    transformer_ls: tuple[int, ...]
    transformer_batch: int


def grid(quick: bool, env: Mapping[str, str] = os.environ) -> Grid:
    """The grid of a run: the tiny debug grid when ``env`` sets :data:`TINY_ENV`, else quick or full."""
    if env.get(TINY_ENV, "") not in ("", "0"):
        return Grid("tiny", TINY_LS, MASK_TINY_LS, transformer.TINY_LS, transformer.TINY_BATCH)
    if quick:
        return Grid("quick", QUICK_LS, MASK_QUICK_LS, transformer.QUICK_LS, transformer.QUICK_BATCH)
    return Grid("full", FULL_LS, MASK_FULL_LS, transformer.FULL_LS, transformer.BATCH)


def timing_plan(length: int, quick: bool, repeats: int) -> dict:
    """How one row at ``length`` is timed: ``{"repeats", "warmup", "min_warmup_s", "min_timed_s"}`` for
    :func:`bench.harness.timing.time_interleaved`. Calls of tens of seconds get :data:`LARGE_REPEATS`
    samples and no warm-up: one-off costs are a negligible share of them, and each round costs minutes."""
    if length >= LARGE_L:
        return {"repeats": min(repeats, LARGE_REPEATS), "warmup": 0, "min_warmup_s": 0.0, "min_timed_s": 0.0}
    return {"repeats": repeats, "warmup": 1, "min_warmup_s": MIN_WARMUP_S,
            "min_timed_s": QUICK_MIN_TIMED_S if quick else MIN_TIMED_S}


def causal_impls(length: int) -> tuple[str, ...]:
    """The implementations timed in a causal row at ``length`` (SDPA non-causal only up to its limit)."""
    return CAUSAL_IMPLS if length <= SDPA_NONCAUSAL_MAX_L else CAUSAL_IMPLS[:3]


def make_inputs(length: int, seed: int = 0, batch: int = B, heads: int = H) -> tuple[torch.Tensor, ...]:
    """Random ``q, k, v`` of shape ``[batch, heads, length, D]`` (fp32, CPU, no grad)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, D, generator=gen, dtype=DTYPE) for _ in range(3))


def padding(length: int, batch: int = B) -> torch.Tensor:
    """Bool ``[batch, S]``, True = padding: entry b pads its last ``round(PAD_FRACTION·S·(b+1)/batch)`` keys,
    so the entries differ and the last pads :data:`PAD_FRACTION` of them. Key 0 is never padded, so with
    the causal rule no query row is left without keys (where SDPA would give NaN and ours 0)."""
    pads = [round(PAD_FRACTION * length * (b + 1) / batch) for b in range(batch)]
    return torch.arange(length)[None, :] >= torch.tensor([length - p for p in pads])[:, None]


def padding_causal_mask(length: int, batch: int = B) -> torch.Tensor:
    """Bool ``[batch, 1, L, S]``, True = the pair takes part: causal (key <= query) and not padding."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal[None, None] & ~padding(length, batch)[:, None, None, :]


def implementation(impl: str, backend: str, mask: torch.Tensor | None = None,
                   pad: torch.Tensor | None = None) -> Callable:
    """Callable ``f(q, k, v) -> out`` of ``impl`` (see :data:`LABELS`); ``mask``/``pad`` for the mask part."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {
        "ours_causal": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend),
        "sdpa_causal": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "ours_full": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, backend=backend),
        "sdpa_full": sdpa,
        "ours_mask": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend),
        "sdpa_mask": lambda q, k, v: sdpa(q, k, v, attn_mask=mask),
        "ours_causal_kpm": lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                            key_padding_mask=pad, backend=backend),
    }
    if impl not in fns:
        raise ValueError(f"unknown implementation {impl!r}; expected one of {list(fns)}")
    return fns[impl]


def check_sdpa(backend: str, length: int = 96) -> tuple[str | None, list[str], dict]:
    """Ours vs SDPA on ``[2, 2, length, 64]`` before minutes of timing: causal, non-causal, the bool mask
    and its ``is_causal`` + ``key_padding_mask`` form, outputs and the gradients of q, k, v.

    Returns ``(error, warnings, max_abs_diff)``: ``error`` when ours cannot run at all (nothing is timed
    then), a warning per case that differs by more than :data:`CHECK_ATOL` (a wrong kernel's speed is
    not reported silently), and the differences by case.
    """
    q, k, v = (t.requires_grad_() for t in make_inputs(length, seed=1, batch=2, heads=2))
    mask, pad = padding_causal_mask(length, 2), padding(length, 2)
    cases = {"causal": ("ours_causal", "sdpa_causal"), "non-causal": ("ours_full", "sdpa_full"),
             "mask": ("ours_mask", "sdpa_mask"), "is_causal + key_padding_mask": ("ours_causal_kpm", "sdpa_mask")}
    grad_out = torch.randn(2, 2, length, D, generator=torch.Generator().manual_seed(2))
    diffs, warnings = {}, []
    for case, (ours, theirs) in cases.items():
        results = []
        for impl in (ours, theirs):
            try:
                out = implementation(impl, backend, mask, pad)(q, k, v)
            except Exception as exc:  # noqa: BLE001 - any failure is reported, not raised
                if impl == theirs:
                    raise
                return (f"attn_ext.scaled_dot_product_attention(backend={backend!r}) cannot run ({case}): "
                        f"{type(exc).__name__}: {exc}"), warnings, diffs
            results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
        diffs[case] = max((a - b).abs().max().item() for a, b in zip(*results))
        if not diffs[case] <= CHECK_ATOL:
            warnings.append(f"attn_ext.scaled_dot_product_attention(backend={backend!r}) differs from SDPA by "
                            f"{diffs[case]:.3g} (> {CHECK_ATOL:g}) in the {case} case (outputs or gradients)")
    return None, warnings, diffs


def sdpa_kernel_names() -> dict:
    """Which kernel SDPA picks here, causal and with the bool mask, read off its grad_fn."""
    q, k, v = (t.requires_grad_() for t in make_inputs(64, batch=1, heads=1))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = {"causal": sdpa(q, k, v, is_causal=True), "mask": sdpa(q, k, v, attn_mask=padding_causal_mask(64, 1))}
    names = {case: type(out.grad_fn).__name__ for case, out in outs.items()}
    return {case: "flash (CPU)" if "FlashAttentionForCpu" in n else f"other ({n})" for case, n in names.items()}


def _dotted(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` printing a dot on stderr after each call: rows of minutes show they are moving."""
    def call():
        result = fn()
        progress(".", end="")
        return result
    return call


def time_row(section: str, length: int, pass_: str, impls: tuple[str, ...], options: BenchOptions,
             inputs=None, mask=None, pad=None) -> dict:
    """One row: ``impls`` on the same inputs, their samples interleaved (:func:`timing_plan`)."""
    plan = timing_plan(length, options.quick, options.repeats)
    q, k, v = inputs or make_inputs(length)
    calls = {i: make_call(implementation(i, options.backend, mask, pad), pass_, q, k, v) for i in impls}
    if length >= LARGE_L:
        calls = {i: _dotted(c) for i, c in calls.items()}
    timed = time_interleaved(calls, repeats=plan["repeats"], warmup=plan["warmup"],
                             min_warmup_s=plan["min_warmup_s"], min_timed_s=plan["min_timed_s"])
    row = {"section": section, "L": length, "pass": pass_, "plan": plan,
           "impls": {i: timing_dict(timed[i]) for i in impls}}
    del calls, timed
    gc.collect()
    return row


def _measure_section(section: str, lengths: tuple[int, ...], options: BenchOptions, first_step: int,
                     total: int) -> list[dict]:
    rows, step = [], first_step
    for length in lengths:
        inputs = make_inputs(length)
        mask = padding_causal_mask(length) if section == "mask" else None
        pad = padding(length) if section == "mask" else None
        impls = causal_impls(length) if section == "causal" else MASK_IMPLS
        # fwd first: make_call switches requires_grad on the shared inputs for the pass it builds.
        for pass_ in PASSES:
            step += 1
            slow = " (tens of seconds per call; a dot per call)" if length >= LARGE_L else ""
            progress(f"[{step}/{total}] {section} L=S={length:,} {pass_}: {', '.join(LABELS[i] for i in impls)} "
                     f"interleaved{slow} ...", end="")
            row = time_row(section, length, pass_, impls, options, inputs, mask, pad)
            rows.append(row)
            progress(" " + ", ".join(f"{LABELS[i]} failed: {t['error']}" if t.get("error")
                                     else f"{LABELS[i]} {format_ms(t['median_ms'])} ms" for i, t in row["impls"].items()))
        del inputs, mask, pad
        gc.collect()
    return rows


def goal_rows(goal: str, rows: list[dict]) -> list[dict]:
    """The rows a goal is judged on: its section's rows; for the causal/non-causal goal only L =
    :data:`CAUSAL_GOAL_L` (none on the quick and tiny grids, which lack it)."""
    section = GOALS[goal][0]
    picked = [r for r in rows if r["section"] == section]
    if goal == "causal_vs_noncausal":
        picked = [r for r in picked if r["L"] == CAUSAL_GOAL_L]
    return picked


def judge_goals(rows: list[dict], grid_: Grid, remeasure: Callable[[dict], dict] | None = None) -> dict:
    """Judge every goal on its rows (:func:`bench.harness.goals.confirm`); a failing or borderline row is
    re-measured once with ``remeasure(row) -> row`` (shared by the goals of that row; None: no
    re-measurement). Each judged row gets ``row["judged"][goal]``. Returns goal -> summary."""
    again: dict[int, dict] = {}

    def remeasured(row: dict, a: str, b: str) -> float | None:
        if id(row) not in again:
            again[id(row)] = remeasure(row)
        return ratio(again[id(row)], a, b)

    out = {}
    for goal, (section, a, b, limit) in GOALS.items():
        picked = goal_rows(goal, rows)
        for row in picked:
            fresh = id(row) not in again
            row.setdefault("judged", {})[goal] = confirm(
                ratio(row, a, b), limit, False,
                None if remeasure is None else (lambda row=row, a=a, b=b: remeasured(row, a, b)),
                f"{LABELS[a]} / {LABELS[b]} at L={row['L']:,} {row['pass']}", progress, quiet=fresh)
        met, verdict = combined([r["judged"][goal] for r in picked])
        defined = ([CAUSAL_GOAL_L] if goal == "causal_vs_noncausal" else
                   list(FULL_LS if section == "causal" else MASK_FULL_LS))
        judged_on = sorted({r["L"] for r in picked}) or None
        note = grid_note(grid_.name != "full", _ls(defined), None if judged_on is None else _ls(judged_on))
        out[goal] = {"limit": limit, "numerator": a, "denominator": b, "met": met, "verdict": verdict,
                     "rows_met": sum(r["judged"][goal]["met"] is True for r in picked), "rows": len(picked),
                     "grid_note": note}
    return out


def _ls(lengths) -> str:
    return "L = S = " + ", ".join(f"{n:,}" for n in lengths)


def run(options: BenchOptions) -> int:
    """Run the benchmark (module docstring). Exit status 0 on success whether or not the goals are met
    (the report says); 2 when ours cannot run with the backend; 1 when a measurement failed or the
    README could not be updated."""
    grid_ = grid(options.quick)
    error, warnings, check = check_sdpa(options.backend)
    if error:
        progress(f"error: {error}")
        return 2
    for w in warnings:
        progress(f"warning: {w}")
    machine = machine_info()
    progress(f"{NAME} benchmark ({grid_.name} grid): causal L in {list(grid_.causal_ls)}, mask L in "
             f"{list(grid_.mask_ls)}, backend={options.backend}; {machine_markdown(machine)}")
    total = 2 * (len(grid_.causal_ls) + len(grid_.mask_ls))
    rows = _measure_section("causal", grid_.causal_ls, options, 0, total)
    rows += _measure_section("mask", grid_.mask_ls, options, 2 * len(grid_.causal_ls), total)

    def remeasure(row: dict) -> dict:
        # The goal's implementations only: SDPA non-causal judges nothing and costs most at large L.
        impls = CAUSAL_IMPLS[:3] if row["section"] == "causal" else MASK_IMPLS[:2]
        length = row["L"]
        mask = padding_causal_mask(length) if row["section"] == "mask" else None
        return time_row(row["section"], length, row["pass"], impls, options, mask=mask,
                        pad=padding(length) if mask is not None else None)

    goals = judge_goals(rows, grid_, remeasure)
    progress(f"transformer training step, L in {list(grid_.transformer_ls)} ...")
    train = transformer.measure(options, grid_.transformer_ls, grid_.transformer_batch)
    warnings += train.get("warnings", [])
    machine["load_average_end"] = load_average()
    result = {
        "benchmark": NAME, "grid": grid_.name, "command": options.command,
        "config": {"B": B, "H": H, "D": D, "dtype": "fp32", "device": "cpu", "causal_Ls": list(grid_.causal_ls),
                   "mask_Ls": list(grid_.mask_ls), "pad_fraction": PAD_FRACTION, "backend": options.backend,
                   "quick": options.quick, "repeats": options.repeats, "large_L": LARGE_L,
                   "large_repeats": LARGE_REPEATS, "sdpa_noncausal_max_L": SDPA_NONCAUSAL_MAX_L,
                   "min_timed_s": QUICK_MIN_TIMED_S if options.quick else MIN_TIMED_S},
        "machine": machine, "sdpa_kernels": sdpa_kernel_names(), "check_max_abs_diff": check, "rows": rows,
        "goals": goals, "transformer": train, "warnings": warnings,
    }
    failed = [f"{r['section']} L={r['L']:,} {r['pass']} {LABELS[i]} failed: {t['error']}"
              for r in rows for i, t in r["impls"].items() if t.get("error")]
    failed += [f"transformer L={r['L']:,} {i} failed: {t['error']}" for r in train.get("rows", [])
               for i, t in r["impls"].items() if t.get("error")]
    notes = ["tiny debug grid (set by the environment): not the benchmark's sizes."] if grid_.name == "tiny" else []
    return publish_run(NAME, result, report.tables, report.summary, options, report.plot, failed, notes)


# ------------------------------------------------------------------------------ pytest-benchmark
# Defined only under pytest (bench/conftest.py collects bench_*.py), so `python -m bench` needs no pytest.
if "pytest" in sys.modules:
    import pytest

    @pytest.fixture(scope="module", params=QUICK_LS, ids=lambda n: f"L={n}")
    def inputs(request: pytest.FixtureRequest):
        return request.param, make_inputs(request.param)

    @pytest.mark.parametrize("pass_", PASSES)
    @pytest.mark.parametrize("impl", ["ours_causal", "sdpa_causal", "ours_full"])
    def test_sdpa_causal(benchmark, request: pytest.FixtureRequest, inputs, impl: str, pass_: str, backend: str):
        length, (q, k, v) = inputs
        if impl.startswith("ours") and (error := check_sdpa(backend, length=32)[0]):
            pytest.skip(error)
        benchmark.group = f"sdpa causal L=S={length} {pass_}"
        benchmark.extra_info.update(L=length, impl=LABELS[impl], backend=backend, shape=f"B={B} H={H} D={D} fp32")
        benchmark.pedantic(make_call(implementation(impl, backend), pass_, q, k, v),
                           rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1, iterations=1)
