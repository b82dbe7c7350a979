"""The ``np_step`` benchmark's report: the Markdown table, the goal text, the README summary and the figure of a
result (the measurements are :mod:`bench.bench_np_step`, which writes its report with this module; the goal and
the ratios both use are :mod:`bench.bench_np_step_goals`). Every ratio is a time ratio, ours over the other:
below 1 = ours faster."""

from __future__ import annotations

from bench.bench_np_step_goals import MAX_ATTENTION_RATIO, attention_ratio, step_ratio
from bench.np_step_attention import ATTENTION_OPS
from bench.harness.goals import confirmed_text
from bench.harness.machine import timing_footer
from bench.harness.plot import Series, plot_panel
from bench.harness.report import format_ms, markdown_table
from bench.harness.timing import WARMUP_TEXT


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _ms(impls: dict | None, name: str) -> str:
    return format_ms((impls or {}).get(name, {}).get("median_ms")) or "—"


def _share(row: dict) -> str:
    return f"{row['attention']['share']:.0%}"


def _other_ops(row: dict) -> str:
    """attn_ext's ops of the step that are not softmax attention (not replayed), with their counts."""
    return ", ".join(f"`{op}` {n}" for op, n in row["attention"]["ops_per_step"].items()
                     if op not in ATTENTION_OPS)


def goal_text(goals: dict) -> str:
    return (f"the step's attention, ours / SDPA on the same calls <= {goals['limit']:g} for "
            f"{', '.join(goals['models'])}")


def tables(result: dict) -> str:
    """The report: the setup, a row per workload, the goal, what was not replayed, the machine."""
    cfg = result["config"]
    body = []
    for r in result["rows"]:
        a, c = r["attention"], r["check"]
        body.append([r["label"], r["replaced"] or "—", _ms(r["impls"], "ours"), _ms(r["impls"], "twin"),
                     _x(step_ratio(r)), _share(r), a["calls"] or "—", _ms(a.get("impls"), "ours"),
                     _ms(a.get("impls"), "sdpa"), _x(attention_ratio(r)),
                     confirmed_text(r["judged"], lambda v: f"{v:.2f}x") if "judged" in r else "—",
                     *(f"{c[k]:.1e}" if k in c else "—" for k in ("loss_rel_diff_fp32", "grad_max_rel_diff_fp64")),
                     f"{a['replay_rel_diff_fp64']:.1e}" if "replay_rel_diff_fp64" in a else "—"])
    g = result["goals"]
    no_twin = "; ".join(f"{r['label']}: {r['no_twin']}" for r in result["rows"] if r["no_twin"])
    others = "; ".join(f"{r['label']}: {_other_ops(r)}" for r in result["rows"] if _other_ops(r))
    return "\n".join([
        f"One GP training step per model: `loss = model(batch)`, `loss.backward()`, `Adam(lr={cfg['lr']:g}).step()`, "
        f"`zero_grad()`, {cfg['threads']} thread, fp32, CPU. Batch: {cfg['batch']} GP tasks "
        f"(`GPSampler(\"{cfg['kernel']}\")`), "
        f"N_c = {cfg['num_context']}, N_t = {cfg['num_target']} (the means of the training sampler's counts), the same "
        "batch every step; models with the `NPConfig` defaults"
        + (f" and {cfg['overrides']}" if cfg["overrides"] else "")
        + ". **twin**: a deep copy with every attn_ext multi-head attention replaced by `torch.nn.MultiheadAttention` "
        f"holding the same weights (the count in the table). Steps: median of at least {cfg['repeats']} steps spread "
        f"over at least {cfg['min_timed_s']:g} s per model, after {WARMUP_TEXT}, ours and the twin interleaved.",
        "",
        "**Attention.** *share*: the part of ours' step spent inside attn_ext's ops (forward and backward kernels; "
        f"`torch.profiler`, {cfg['profiled_steps']} steps). *calls*: the softmax attention calls of one step "
        "(`cross_attention`, `scaled_dot_product_attention`), recorded with their tensors and replayed, forward and "
        "backward, on attn_ext's op and on `torch.nn.functional.scaled_dot_product_attention` with the same "
        f"tensors (a key padding mask folded into `attn_mask`), interleaved, at least {cfg['min_replay_s']:g} s; "
        "*ours / SDPA* is what the step's attention decides, *step ours / twin* what the whole step shows (the "
        "rest of it, linear layers, norms and the optimizer, is the same work in both).",
        "",
        "Checks before timing: the twin's loss relative to ours (fp32, the timed batch), the largest "
        f"parameter-gradient difference (fp64 copies, {cfg['check_tasks']} tasks), and the replayed attention of "
        "attn_ext against SDPA's (outputs and input gradients, fp64 copies).",
        "",
        markdown_table(["model", "attention modules replaced", "ours step ms", "twin step ms", "step: ours / twin",
                        "share of ours' step in attn_ext ops", "softmax attention calls", "ours attention ms",
                        "SDPA attention ms", "attention: ours / SDPA", f"goal <= {MAX_ATTENTION_RATIO:g}",
                        "check: loss rel diff (fp32)", "grads max rel diff (fp64)", "attention rel diff (fp64)"],
                       body, align="lrrrrrrrrrlrrr"),
        "",
        f"- Goal{g['grid_note']}: {goal_text(g)}: met in {g['rows_met']} of {g['rows']} models, **{g['verdict']}**.",
        f"- No twin: {no_twin or 'none'}.",
        f"- attn_ext ops of the step that are not softmax attention (in the share, not replayed): {others or 'none'}.",
        "",
        *timing_footer(result["machine"]),
    ])


def summary(result: dict) -> tuple[str, str]:
    """The README's short table (time ratios per model) and its sentence with the goal."""
    body = [[r["label"], _share(r), _x(step_ratio(r)), _x(attention_ratio(r)),
             r.get("judged", {}).get("verdict", "—")] for r in result["rows"]]
    g, cfg = result["goals"], result["config"]
    return (markdown_table(["model", "attn_ext ops' share of the step", "step time, ours / torch twin",
                            "attention time, ours / SDPA (same calls)", "goal"], body),
            f"One GP training step (batch {cfg['batch']}, N_c = {cfg['num_context']}, N_t = {cfg['num_target']}, "
            f"Adam, {cfg['threads']} thread) of each reference model: the share of the step in attn_ext's ops; the "
            "step against its torch twin (the same model and weights on `torch.nn.MultiheadAttention`); the step's "
            "softmax attention calls replayed forward and backward on attn_ext and on PyTorch's SDPA. Time ratios, "
            f"below 1 = ours faster. Goal{g['grid_note']}: {goal_text(g)}: **{g['verdict']}**.")


def plot(result: dict, path) -> None:
    """SDPA's attention time against ours, one point per model with softmax attention, and the lines of
    equality and of the goal."""
    rows = [r for r in result["rows"] if attention_ratio(r) is not None]
    times = [(r["attention"]["impls"]["ours"]["median_ms"], r["attention"]["impls"]["sdpa"]["median_ms"]) for r in rows]
    series = [Series(r["label"], [ours], [sdpa], "", "os^vD<>ph"[i % 9]) for i, (r, (ours, sdpa)) in
              enumerate(zip(rows, times))]
    span = [min((t[0] for t in times), default=1) / 2, max((t[0] for t in times), default=1) * 2]
    limit = MAX_ATTENTION_RATIO
    series += [Series("SDPA = ours", span, span, "--", "", "k")]
    if limit != 1:
        series.append(Series(f"goal: ours = {limit:g} x SDPA", span, [x / limit for x in span], ":", "", "C3"))
    plot_panel(series, path, title=f"The attention of an NP training step, batch {result['config']['batch']}, "
               f"{result['config']['threads']} thread", xlabel="attn_ext (ms per step, median)", ylabel="SDPA (ms per step, median)")
