"""``python -m bench run np_step``: one GP training step of every reference NP model, on attn_ext's attention
vs its torch twin (issue 29).

**Step**: the loop of ``python -m bench train gp`` (:func:`bench.np.train.train`) without its logging,
schedule and checkpoints: loss ``model(batch)`` (forward on a GP batch), ``backward``, ``Adam(lr=5e-4).step()``,
``zero_grad(set_to_none=True)``, on one thread (training's ``--threads`` default), the same batch every step.
**Batch**: :class:`attn_ext.data.GPSampler` ("rbf", training's default task), 16 tasks on the full grid (training's
``--batch-size``), :data:`QUICK_BATCH` on the quick grid, with N_c = :data:`NUM_CONTEXT` and N_t =
:data:`NUM_TARGET` fixed at the means of the sampler's counts (N_c ~ U{3..46}: 24.5; N_t ~ U{3..49 − N_c}:
13.5 at N_c = 25), so that both implementations and every sample do the same work. **Models**: every entry
of :data:`attn_ext.models.MODELS` with the :class:`attn_ext.models.NPConfig` defaults (docs/spec.md §5: d_model
64, 6 layers, 4 heads, ff 128, 128 latents) and weights drawn from seed 0.

**Twin** (:func:`bench.torch_twin.torch_twin`): a deep copy of the model with every attn_ext multi-head
attention replaced by ``torch.nn.MultiheadAttention`` holding the same weights; both take a step with their own
optimizer, samples interleaved (:func:`bench.harness.timing.time_interleaved`). CMANP and CMANP-AND condition
through the attention state, which torch's module lacks: their steps/s are reported without a twin, and
**CMANP block stack** (:class:`bench.torch_twin.CMANPBlockStack`: CMANP's loss through its blocks' forward
calls) is the CMANP row with a twin. IntentionNP and LinearTNP have no softmax multi-head attention (their
attention is Intention, linear attention): steps/s only. ReTreever's twin replaces its encoder's and
aggregator's attention; its tree attention stays attn_ext's.

**Check**, before timing: the twin's loss against ours on the timed batch (fp32, relative, warned above
:data:`CHECK_RTOL`), and loss and every parameter gradient on fp64 copies (the first :data:`CHECK_TASKS` tasks;
in fp32 a ReLU pre-activation within rounding of 0 may flip and move a gradient by a percent), each relative
to its tensor's largest entry (floored at :data:`GRAD_FLOOR` of the largest gradient, for gradients zero but
for rounding, e.g. a key bias under softmax).

**Goal** (the issue's): ours / twin step time <= :data:`MAX_RATIO` for TNP-D, LBANP and CMANP's block stack,
re-measured first when failing or borderline (:func:`bench.harness.goals.confirm`); judged on the quick
grid's smaller batch too, with a note. Writes ``np_step.{md,json,png}``; progress on stderr.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench.harness import BenchOptions
from bench.harness.goals import combined, confirm, confirmed_text, grid_note
from bench.harness.machine import load_average, machine_info, machine_markdown, timing_footer
from bench.harness.plot import Series, plot_panel
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import WARMUP_TEXT, gc_frozen, time_interleaved, torch_threads

NAME = "np_step"
NUM_CONTEXT, NUM_TARGET = 25, 14
KERNEL = "rbf"
LR = 5e-4
THREADS = 1
MAX_RATIO = 0.8
GOAL_KEYS: tuple[str, ...] = ("tnpd", "lbanp", "cmanp_stack")
CHECK_RTOL, CHECK_TASKS, GRAD_FLOOR = 1e-5, 2, 1e-6
#: Batch of the quick grid (the full grid's is the training config's 16).
QUICK_BATCH = 4
#: Workload key -> (label, model name in attn_ext.models.MODELS).
WORKLOADS: dict[str, tuple[str, str]] = {
    "tnpd": ("TNP-D", "tnpd"), "lbanp": ("LBANP", "lbanp"), "cmanp_stack": ("CMANP block stack", "cmanp"),
    "cmanp": ("CMANP", "cmanp"), "cmanp_and": ("CMANP-AND", "cmanp_and"), "retreever": ("ReTreever", "retreever"),
    "intention_np": ("IntentionNP", "intention_np"), "linear_tnp": ("LinearTNP", "linear_tnp"),
    "tnp_nd": ("TNP-ND", "tnp_nd"), "lbanp_nd": ("LBANP-ND", "lbanp_nd"), "hypermix_np": ("HyperMixNP", "hypermix_np"),
    "ist": ("IST", "ist"), "convnp": ("ConvNP", "convnp"), "tetnp": ("TETNP", "tetnp"),
    "perceiver_io": ("Perceiver IO", "perceiver_io"), "transformer_ca": ("Transformer + CA", "transformer_ca"),
}
_STATE = "conditions through the attention state (`state`/`query`), which torch's module lacks (see the block stack)"
#: Workloads timed without a twin, and why; the others without any attention to replace say so themselves.
NO_TWIN: dict[str, str] = {"cmanp": _STATE, "cmanp_and": _STATE}
NOTHING_TO_REPLACE = "no softmax multi-head attention to replace"


@dataclass(frozen=True)
class Grid:
    """The sizes of a run: batch size, :class:`attn_ext.models.NPConfig` overrides (none: the spec's), the
    minimum timed span per workload and the workloads."""

    name: str
    batch: int
    overrides: dict = field(default_factory=dict)
    min_timed_s: float = 3.0
    keys: tuple[str, ...] = tuple(WORKLOADS)


FULL = Grid("full", 16)
QUICK = Grid("quick", QUICK_BATCH, min_timed_s=1.0)


def gp_batch(batch: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """One GP training batch (:class:`attn_ext.data.NPBatch`) of ``batch`` tasks, N_c and N_t fixed."""
    from attn_ext.data import GPSampler

    return GPSampler(KERNEL).sample(batch, torch.Generator().manual_seed(seed), num_context=NUM_CONTEXT,
                                    num_target=NUM_TARGET, dtype=dtype)


def build(key: str, overrides: dict, backend: str) -> tuple[torch.nn.Module, torch.nn.Module | None, dict]:
    """``(ours, twin or None, info)`` for a workload; ``info`` holds the replaced modules' count and why there
    is no twin. Ours runs ``backend`` in every attn_ext module that takes one."""
    from attn_ext.models import build_model
    from bench.torch_twin import CMANPBlockStack, torch_twin

    torch.manual_seed(0)
    model = build_model(WORKLOADS[key][1], **overrides).train()
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    ours = CMANPBlockStack(model) if key == "cmanp_stack" else model
    if key in NO_TWIN:
        return ours, None, {"replaced": 0, "no_twin": NO_TWIN[key]}
    twin, replaced = torch_twin(ours)
    if not replaced:
        return ours, None, {"replaced": 0, "no_twin": NOTHING_TO_REPLACE}
    return ours, twin, {"replaced": len(replaced), "no_twin": None}


def check_twin(ours: torch.nn.Module, twin: torch.nn.Module, batch) -> tuple[float, float]:
    """``(loss, gradients)``: the twin's loss relative to ours, and the largest difference of a parameter
    gradient relative to ours's largest entry (floored, see the module docstring); both models' gradients are
    cleared again. A parameter with a gradient in one model only gives ``inf``."""
    losses, grads = [], []
    for model in (ours, twin):
        torch.manual_seed(1)  # ReTreever samples its tree descent: both draw the same
        loss = model(batch)
        loss.backward()
        losses.append(loss.detach())
        # By name: the twin keeps the parameter names (and objects) of its copy.
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    loss_diff = ((losses[0] - losses[1]).abs() / losses[0].abs().clamp_min(1e-30)).item()
    if set(grads[0]) != set(grads[1]):
        return loss_diff, math.inf
    floor = GRAD_FLOOR * max(g.abs().max().item() for g in grads[0].values())
    return loss_diff, max(((a - grads[1][n]).abs().max() / max(a.abs().max().item(), floor, 1e-30)).item()
                          for n, a in grads[0].items())


def training_step(model: torch.nn.Module, batch) -> Callable[[], object]:
    """A zero-argument training step of ``model`` on ``batch`` with its own Adam optimizer (training's lr)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step():
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _check(key: str, ours, twin, batch) -> tuple[dict, list[str]]:
    """The fp32 loss check on the timed batch and the fp64 check of loss and gradients, with their warnings."""
    if twin is None:
        return {}, []
    loss32, _ = check_twin(ours, twin, batch)
    small = type(batch)(*(t[:CHECK_TASKS].double() for t in batch))
    loss64, grads64 = check_twin(copy.deepcopy(ours).double(), copy.deepcopy(twin).double(), small)
    check = {"loss_rel_diff_fp32": loss32, "loss_rel_diff_fp64": loss64, "grad_max_rel_diff_fp64": grads64}
    bad = [f"{what} {value:.3g}" for what, value in check.items() if not value <= CHECK_RTOL]
    return check, ([f"{WORKLOADS[key][0]}: the torch twin differs from ours ({', '.join(bad)}; > {CHECK_RTOL:g})"]
                   if bad else [])


def time_steps(steps: dict[str, Callable[[], object]], options: BenchOptions, min_timed_s: float,
               scale: int = 1) -> dict:
    """The steps' samples interleaved, with the garbage collector's old objects frozen (after the check's
    calls, so that what those imported is frozen too)."""
    with gc_frozen():
        timed = time_interleaved(steps, repeats=options.repeats * scale, min_timed_s=min_timed_s * scale)
    return {name: timing_dict(t) for name, t in timed.items()}


def measure(options: BenchOptions, grid: Grid) -> tuple[list[dict], dict, list[str]]:
    """Build, check and time every workload; returns the rows, the steps (for re-measuring) and the warnings."""
    rows, all_steps, warnings = [], {}, []
    batch = gp_batch(grid.batch)
    with torch_threads(THREADS):
        for i, key in enumerate(grid.keys, 1):
            ours, twin, info = build(key, grid.overrides, options.backend)
            check, bad = _check(key, ours, twin, batch)
            warnings += bad
            progress(f"[{i}/{len(grid.keys)}] {WORKLOADS[key][0]}: ours" + (" and torch twin interleaved (check: "
                     + ", ".join(f"{k} {v:.2g}" for k, v in check.items()) + ")" if twin is not None else "")
                     + " ...", end="")
            steps = {"ours": training_step(ours, batch)}
            if twin is not None:
                steps["twin"] = training_step(twin, batch)
            all_steps[key] = steps
            row = {"key": key, "label": WORKLOADS[key][0], "model": WORKLOADS[key][1], **info, "check": check,
                   "impls": time_steps(steps, options, grid.min_timed_s)}
            rows.append(row)
            progress(" " + ", ".join(f"{n} failed: {t['error']}" if t.get("error")
                                     else f"{n} {format_ms(t['median_ms'])} ms" for n, t in row["impls"].items()))
    return rows, all_steps, warnings


def step_ratio(impls: dict) -> float | None:
    """Ours' median step time over the twin's; None without a twin or when either failed."""
    a, b = (impls.get(i, {}).get("median_ms") for i in ("ours", "twin"))
    return a / b if a and b else None


def judge_goals(rows: list[dict], grid: Grid, remeasure: Callable[[dict], dict] | None) -> dict:
    """Judge :data:`GOAL_KEYS`'s rows against :data:`MAX_RATIO`, re-measuring a failing or borderline row once
    (``remeasure(row) -> impls``); returns ``{"met", "verdict", "grid_note", ...}``."""
    picked = [r for r in rows if r["key"] in GOAL_KEYS]
    for r in picked:
        again = None if remeasure is None else (lambda r=r: step_ratio(remeasure(r)))
        r["judged"] = confirm(step_ratio(r["impls"]), MAX_RATIO, False, again, f"ours / twin, {r['label']} step",
                              progress)
    met, verdict = combined([r["judged"] for r in picked])
    note = grid_note(grid.name != "full", "batch 16", None if not picked else f"batch {grid.batch}")
    return {"limit": MAX_RATIO, "models": [r["label"] for r in picked], "met": met, "verdict": verdict,
            "grid_note": note, "rows_met": sum(r["judged"]["met"] is True for r in picked), "rows": len(picked)}


def _rate(impls: dict, name: str) -> str | None:
    t = impls.get(name, {}).get("median_ms")
    return None if not t else f"{1e3 / t:.1f}"


def tables(result: dict) -> str:
    """The Markdown block: the setup, a row per workload, the goal, the machine."""
    cfg = result["config"]
    body = []
    for r in result["rows"]:
        ratio, c = step_ratio(r["impls"]), r["check"]
        body.append([r["label"], r["replaced"] or "—", format_ms(r["impls"]["ours"]["median_ms"]),
                     _rate(r["impls"], "ours"), format_ms(r["impls"].get("twin", {}).get("median_ms")) or "—",
                     _rate(r["impls"], "twin") or "—", "—" if ratio is None else f"{ratio:.2f}x",
                     confirmed_text(r["judged"], lambda v: f"{v:.2f}x") if "judged" in r else "—",
                     *(f"{c[k]:.1e}" if k in c else "—" for k in ("loss_rel_diff_fp32", "grad_max_rel_diff_fp64"))])
    g = result["goals"]
    no_twin = "; ".join(f"{r['label']}: {r['no_twin']}" for r in result["rows"] if r["no_twin"])
    return "\n".join([
        f"One GP training step per model: `loss = model(batch)`, `loss.backward()`, `Adam(lr={cfg['lr']:g}).step()`, "
        f"`zero_grad()`, {cfg['threads']} thread, fp32, CPU. Batch: {cfg['batch']} GP tasks "
        f"(`GPSampler(\"{cfg['kernel']}\")`), "
        f"N_c = {cfg['num_context']}, N_t = {cfg['num_target']} (the means of the training sampler's counts), the same "
        "batch every step; models with the `NPConfig` defaults"
        + (f" and {cfg['overrides']}" if cfg["overrides"] else "")
        + ". **twin**: a deep copy with every "
        "attn_ext multi-head attention replaced by `torch.nn.MultiheadAttention` holding the same weights "
        f"(the count in the table). Median of at least {cfg['repeats']} steps spread over at least "
        f"{cfg['min_timed_s']:g} s per model, after {WARMUP_TEXT}, ours and the twin interleaved. Check before timing: "
        f"the twin's loss relative to ours (fp32, the timed batch) and the largest parameter-gradient difference "
        f"(fp64 copies, {cfg['check_tasks']} tasks).",
        "",
        markdown_table(["model", "attention modules replaced", "ours step ms", "ours steps/s", "twin step ms",
                        "twin steps/s", "ours / twin", f"goal <= {MAX_RATIO:g}", "check: loss rel diff (fp32)",
                        "grads max rel diff (fp64)"], body, align="lrrrrrrlrr"),
        "",
        f"- Goal{g['grid_note']}: ours / twin step time <= {g['limit']:g} for {', '.join(g['models'])}: "
        f"met in {g['rows_met']} of {g['rows']} models, **{g['verdict']}**.",
        f"- No twin: {no_twin or 'none'}.",
        "",
        *timing_footer(result["machine"]),
    ])


def summary(result: dict) -> tuple[str, str]:
    """The README's short table (steps/s per model) and its sentence with the goal."""
    body = [[r["label"], _rate(r["impls"], "ours"), _rate(r["impls"], "twin") or "—",
             "—" if (x := step_ratio(r["impls"])) is None else f"{x:.2f}x", r.get("judged", {}).get("verdict", "—")]
            for r in result["rows"]]
    g, cfg = result["goals"], result["config"]
    return (markdown_table(["model", "ours steps/s", "torch twin steps/s", "ours / twin", "verdict"], body),
            f"One GP training step (batch {cfg['batch']}, N_c = {cfg['num_context']}, N_t = {cfg['num_target']}, "
            f"Adam, {cfg['threads']} thread) of each reference model vs its torch twin (the same model and weights "
            f"on `torch.nn.MultiheadAttention`). Goal{g['grid_note']}: ours / twin <= {g['limit']:g} for "
            f"{', '.join(g['models'])}: **{g['verdict']}**.")


def plot(result: dict, path) -> None:
    """Twin step time vs ours, one point per model with a twin, the lines of equality and of the goal."""
    rows = [r for r in result["rows"] if step_ratio(r["impls"]) is not None]
    series = [Series(r["label"], [r["impls"]["ours"]["median_ms"]], [r["impls"]["twin"]["median_ms"]], "",
                     "os^vD<>ph"[i % 9]) for i, r in enumerate(rows)]
    span = [min((r["impls"]["ours"]["median_ms"] for r in rows), default=1) / 2,
            max((r["impls"]["ours"]["median_ms"] for r in rows), default=1) * 2]
    series += [Series("twin = ours", span, span, "--", "", "k"),
               Series(f"goal: ours = {MAX_RATIO:g} x twin", span, [x / MAX_RATIO for x in span], ":", "", "C3")]
    plot_panel(series, path, title=f"NP training step, batch {result['config']['batch']}, {THREADS} thread",
               xlabel="ours step (ms, median)", ylabel="torch twin step (ms, median)")


def run(options: BenchOptions, grid: Grid | None = None) -> int:
    """Run the benchmark (module docstring) on ``grid`` (default: the options' quick or full grid). Exit
    status 0 whether or not the goal is met (the report says); 1 when a step failed or the README could not
    be updated."""
    grid = grid or (QUICK if options.quick else FULL)
    machine = machine_info()
    progress(f"{NAME} benchmark ({grid.name} grid): {len(grid.keys)} models, batch {grid.batch}, "
             f"N_c={NUM_CONTEXT}, N_t={NUM_TARGET}, {THREADS} thread, backend={options.backend}; "
             f"{machine_markdown(machine)}")
    rows, steps, warnings = measure(options, grid)
    with torch_threads(THREADS):
        # Twice the samples over twice the span: a re-measurement should settle what the first left in doubt.
        goals = judge_goals(rows, grid, lambda r: time_steps(steps[r["key"]], options, grid.min_timed_s, scale=2))
    machine["load_average_end"] = load_average()
    result = {"benchmark": NAME, "grid": grid.name, "command": options.command,
              "config": {"batch": grid.batch, "num_context": NUM_CONTEXT, "num_target": NUM_TARGET, "kernel": KERNEL,
                         "lr": LR, "optimizer": "Adam", "threads": THREADS, "overrides": grid.overrides,
                         "backend": options.backend, "quick": options.quick, "repeats": options.repeats,
                         "min_timed_s": grid.min_timed_s, "check_tasks": CHECK_TASKS, "check_rtol": CHECK_RTOL},
              "machine": machine, "rows": rows, "goals": goals, "warnings": warnings}
    failed = [f"{r['label']} {n} step failed: {t['error']}" for r in rows for n, t in r["impls"].items()
              if t.get("error")]
    return publish_run(NAME, result, tables, summary, options, plot, failed)


# ------------------------------------------------------------------------------ pytest-benchmark
# Defined only under pytest (bench/conftest.py collects bench_*.py), so `python -m bench` needs no pytest.
if "pytest" in sys.modules:
    import pytest

    @pytest.mark.parametrize("impl", ["ours", "twin"])
    @pytest.mark.parametrize("key", GOAL_KEYS)
    def test_np_step(benchmark, request: pytest.FixtureRequest, key: str, impl: str, backend: str):
        ours, twin, _ = build(key, {}, backend)
        benchmark.group = f"np_step {WORKLOADS[key][0]}"
        benchmark.extra_info.update(model=key, impl=impl, batch=QUICK_BATCH, backend=backend)
        with torch_threads(THREADS):
            benchmark.pedantic(training_step(ours if impl == "ours" else twin, gp_batch(QUICK_BATCH)),
                               rounds=request.config.getoption("--bench-rounds"), warmup_rounds=1, iterations=1)
