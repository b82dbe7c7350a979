"""``attn-ext bench gp_quick``: every reference NP model trained on one budget, then evaluated (SPEC §6).

Quick mode (``--quick``): 100 steps of a small configuration per model (2 layers, 32 latents) and
20 evaluation batches — a smoke test of the whole pipeline, not an accuracy figure (``gp_smoke.md``). Full mode: the
quick protocol of ``bench/gp_quick.sh`` (SPEC §5 sizes, 5000 steps, 200 evaluation batches). The
paper protocol (100k steps, 3000 batches) is ``attn-ext train gp --steps 100000`` per model.
``python -m attn_ext.bench.gp_quick RUNS_DIR [OUT_DIR [README]]`` rewrites the report (and the README
block) from finished runs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

NAME = "gp_quick"
MODELS = ("tnpd", "lbanp", "cmanp", "cmanp_and", "retreever", "intention_np", "linear_tnp")
KERNELS = ("rbf", "matern52")
#: SPEC §6: (RBF, Matern 5/2) after 100k steps, from the papers.
PAPER = {"tnpd": (1.39, 0.95, "CMANP Table 3"), "lbanp": (1.27, 0.85, "CMANP Table 3"),
         "cmanp": (1.24, 0.80, "CMANP Table 3"), "cmanp_and": (1.48, 0.96, "CMANP Table 3"),
         "retreever": (1.25, 0.81, "TCA Table 13")}
QUICK = {"steps": 100, "eval_batches": 20, "overrides": {"num_layers": 2, "num_latents": 32}}
FULL = {"steps": 5000, "eval_batches": 200, "overrides": {}}


def report(runs_dir: Path, command: str) -> tuple[str, dict]:
    """Markdown and JSON of the runs in ``runs_dir/<model>`` (``train.json`` or the checkpoint, ``eval_*.json``)."""
    from .report import markdown_table

    rows, raw = [], {}
    for model in MODELS:
        run = runs_dir / model
        evals = {k: json.loads((run / f"eval_{k}.json").read_text()) for k in KERNELS if (run / f"eval_{k}.json").exists()}
        if not evals:
            continue
        first = next(iter(evals.values()))
        raw[model] = evals
        cells = [f"{evals[k]['log_likelihood_mean']:.3f} ± {evals[k]['log_likelihood_std']:.3f}" if k in evals else None
                 for k in KERNELS]
        paper = PAPER.get(model)
        rows.append([model, first["train_steps"], f"{first['train_seconds'] / 60:.1f}", *cells,
                     f"{paper[0]:.2f} / {paper[1]:.2f} ({paper[2]})" if paper else "—"])
    eval_batches = next(iter(next(iter(raw.values())).values()))["num_batches"] if raw else None
    text = "\n".join([
        f"GP meta-regression, **quick protocol**: every model trained on RBF tasks for the same number of steps "
        f"(batch 16, Adam 5e-4, cosine) on one CPU thread, then scored on the first {eval_batches} batches of 16 of "
        f"the fixed-seed evaluation sets (mean per-target log-likelihood ± std over batches; CMANP-AND "
        f"block-autoregressive with b_Q = 5). The paper figures are after 100k steps and 3000 batches: "
        f"**the full 100k-step protocol was not run**, so the gap below is the training budget, not the models. "
        f"`train min` is wall time on one thread of a 2-core machine shared with other jobs.",
        "",
        markdown_table(["model", "steps", "train min", "RBF", "Matern 5/2", "paper RBF / Matern (source)"], rows),
        "",
        f"Command: `{command}`",
    ])
    return text, raw


def run_protocol(out_dir: Path, runs_dir: Path, steps: int, eval_batches: int, overrides: dict,
                 readme: Path | None = None, name: str = NAME) -> int:
    """Train and evaluate every model into ``runs_dir``, then publish ``<name>.md/.json``."""

    from attn_ext.evaluate import evaluate
    from attn_ext.train import train

    from .report import progress, publish
    from .timing import torch_threads

    with torch_threads(1):  # the protocol's budget is one thread; the benchmarks after it keep theirs
        for model in MODELS:
            progress(f"{NAME}: training {model} for {steps} steps")
            train(model, steps, runs_dir / model, overrides=overrides, checkpoint_every=steps,
                  log_every=max(steps // 2, 1))
            for kernel in KERNELS:
                evaluate(runs_dir / model, kernel, num_batches=eval_batches)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items())
    text, raw = report(runs_dir, f"attn-ext train gp --model MODEL --steps {steps} {flags} && attn-ext eval gp "
                                 f"--ckpt RUN --kernel KERNEL --num-batches {eval_batches}")
    return 0 if publish(name, text, {"benchmark": name, "runs": raw}, out_dir, None, readme) else 1


def run(options) -> int:
    """``attn-ext bench gp_quick``; quick mode publishes as ``gp_smoke`` so that it never overwrites the
    accuracy table of the full quick protocol."""
    import tempfile

    cfg = QUICK if options.quick else FULL
    with tempfile.TemporaryDirectory(prefix="attn_ext_gp_") as runs_dir:
        return run_protocol(Path(options.out_dir), Path(runs_dir), cfg["steps"], cfg["eval_batches"],
                            cfg["overrides"], options.update_readme, "gp_smoke" if options.quick else NAME)


if __name__ == "__main__":
    from .report import publish

    # python -m attn_ext.bench.gp_quick RUNS_DIR [OUT_DIR [README]]
    runs = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("bench/results")
    readme = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    evals = sorted(runs.glob("*/eval_rbf.json"))
    if not evals:
        sys.exit(f"no finished runs (<model>/eval_rbf.json) in {runs}")
    first = json.loads(evals[0].read_text())
    steps, batches = first["train_steps"], first["num_batches"]
    text, raw = report(runs, f"bench/gp_quick.sh {steps} {batches} {runs} (per model: attn-ext train gp --model MODEL "
                             f"--steps {steps} --out {runs}/MODEL --log-every 100 --checkpoint-every 250; then "
                             f"attn-ext eval gp --ckpt {runs}/MODEL --kernel rbf|matern52 --num-batches {batches}), "
                             "OMP_NUM_THREADS=1; two shells each took part of the models (MODELS=...)")
    publish(NAME, text, {"benchmark": NAME, "runs": raw}, out, None, readme)
