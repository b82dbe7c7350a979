"""``python -m bench bandit``: deploy wheel-bandit models pre-trained with ``python -m bench train wheel`` (CMANP App. C.2).

Writes ``bandit.json``, ``bandit_table.md`` (cumulative regret as % of uniform per δ, next to CMANP Table
7, and the per-step cost at the first and last steps) and ``bandit.png`` (cumulative regret vs step
at one δ; per-step time vs step: constant for CMANP's update path, growing for recomputation).

Example (the paper's protocol; the reduced run of bench/results/bandit.md uses fewer steps/seeds)::

    python -m bench train wheel --model cmanp --steps 100000 --out runs/wheel-cmanp
    python -m bench train wheel --model tnpd --steps 100000 --out runs/wheel-tnpd
    python -m bench bandit --ckpt runs/wheel-cmanp runs/wheel-tnpd --steps 2000 --seeds 50 --out bench/results
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.np.checkpoint import load_checkpoint
from bench.np.data.wheel import DELTAS
from bench.np.tasks.bandit import PAPER, binned, history_blind_regret_pct, mean_std, run_bandits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", type=Path, nargs="+", required=True,
                        help="run directories of `python -m bench train wheel` (one per model)")
    parser.add_argument("--deltas", type=float, nargs="+", default=list(DELTAS), help="wheel radii δ")
    parser.add_argument("--steps", type=int, default=2000, help="bandit steps per episode (paper: 2000)")
    parser.add_argument("--seeds", type=int, default=50, help="episodes per δ (paper: 50)")
    parser.add_argument("--mode", choices=["auto", "incremental", "recompute"], default="auto",
                        help="auto: CMANP updates its state, other models recompute from the history")
    parser.add_argument("--plot-delta", type=float, default=None, help="δ of the regret curve (default: the middle one)")
    parser.add_argument("--out", type=Path, default=Path("bench/out"),
                        help="directory of bandit.{json,md,png} (default bench/out; bench/results for the committed run)")
    parser.add_argument("--threads", type=int, default=1)


def _label(name: str, res: dict) -> str:
    return f"{name} ({res['mode']})"


def write_table(results: dict, deltas, steps: int, seeds: int, path: Path, header: str = "") -> str:
    """Markdown: regret per δ (ours ± std over seeds, the paper's), per-step cost at the start and end."""
    cols = " | ".join(f"δ = {d}" for d in deltas)
    lines = [header, f"Cumulative regret after {steps} steps, % of the uniform policy (mean ± std over {seeds} "
             f"seeds; lower is better). Paper: CMANP Table 7 (2000 steps, 50 seeds).", "",
             f"| model | {cols} |", "| --- |" + " ---: |" * len(deltas)]
    for name, res in results.items():
        cells = [("%.2f ± %.2f" % mean_std(res["regret_pct"][d])) for d in deltas]
        lines.append(f"| {_label(name, res)} | " + " | ".join(cells) + " |")
        base = name.split("-")[0]
        if base in PAPER:
            lines.append(f"| {base}, paper | " + " | ".join(f"{PAPER[base].get(d, float('nan')):.2f}" for d in deltas) + " |")
    blind = [("%.2f ± %.2f" % mean_std(history_blind_regret_pct(d, steps, seeds))) for d in deltas]
    lines += ["| history-blind (always the quadrant arm; no model) | " + " | ".join(blind) + " |", "",
              "The history-blind row is the best policy under the prior δ ~ U(0, 1) alone: a model that does "
              "not beat it has not learned to read δ from its history."]
    lines += ["", "Per-step cost (ms, mean over δ and seeds): decide = predict + UCB arm, update = absorb the "
              "observation.", "", "| model | steps 1–10: decide / update | last 10 steps: decide / update |",
              "| --- | ---: | ---: |"]
    for name, res in results.items():
        d, u = res["decide_seconds"] * 1e3, res["update_seconds"] * 1e3
        lines.append(f"| {_label(name, res)} | {d[1:11].mean():.2f} / {u[1:11].mean():.2f} | "
                     f"{d[-10:].mean():.2f} / {u[-10:].mean():.2f} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(results: dict, delta: float, path: Path) -> Path:
    """Cumulative regret at ``delta`` (with the uniform policy's) and per-step time vs step."""
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    uniform = None
    for i, (name, res) in enumerate(results.items()):
        cum = res["cum_regret"][delta]
        left.plot(range(1, len(cum) + 1), cum.numpy(), color=f"C{i}", label=_label(name, res))
        uniform = res["uniform_cum_regret"][delta]
        for key, style in (("step_seconds", "-"), ("update_seconds", ":")):
            x, y = binned(res[key], 50)
            right.plot(x.numpy(), 1e3 * y.numpy(), style, color=f"C{i}", label=f"{_label(name, res)}, {key.split('_')[0]}")
    left.plot(range(1, len(uniform) + 1), uniform.numpy(), "k--", label="uniform (expected)")
    left.set(xlabel="step", ylabel="cumulative regret", title=f"wheel bandit, δ = {delta}", yscale="log")
    right.set(xlabel="step (context size)", ylabel="ms per step", title="cost per step", yscale="log")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    try:
        models = {}
        for ckpt_dir in args.ckpt:
            model, ckpt = load_checkpoint(ckpt_dir)
            if ckpt.get("task") != "wheel":
                raise ValueError(f"{ckpt_dir} is a {ckpt.get('task', 'gp')!r} run; pre-train with `python -m bench train wheel`")
            name = ckpt["model"] if ckpt["model"] not in models else f"{ckpt['model']}-{len(models)}"
            models[name] = model
        results = run_bandits(models, args.deltas, args.steps, args.seeds, args.mode,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m bench bandit: error: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    delta = args.plot_delta if args.plot_delta in args.deltas else args.deltas[len(args.deltas) // 2]
    plot(results, delta, args.out / "bandit.png")
    header = (f"# wheel bandit (CMANP App. C.2)\n\nCommand: `python -m bench bandit --ckpt {' '.join(map(str, args.ckpt))} "
              f"--steps {args.steps} --seeds {args.seeds} --deltas {' '.join(map(str, args.deltas))}`\n")
    print(write_table(results, args.deltas, args.steps, args.seeds, args.out / "bandit_table.md", header))
    serial = {n: {k: (v.tolist() if isinstance(v, torch.Tensor) else
                      {str(d): (x.tolist() if isinstance(x, torch.Tensor) else x) for d, x in v.items()}
                      if isinstance(v, dict) else v) for k, v in r.items()} for n, r in results.items()}
    (args.out / "bandit.json").write_text(json.dumps({"steps": args.steps, "seeds": args.seeds,
                                                      "deltas": args.deltas, "results": serial}) + "\n")
    return 0
