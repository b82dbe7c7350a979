"""``python -m bench run gp_quick``: every reference NP model trained on one budget, then evaluated (docs/spec.md §6).

Quick mode (``--quick``): 100 steps of a small configuration per model (2 layers, 32 latents) and
20 evaluation batches — a smoke test of the whole pipeline, not an accuracy figure (``gp_smoke.md``). Full mode: the
quick protocol of ``bench/np/gp_quick.sh`` (docs/spec.md §5 sizes, 5000 steps, 200 evaluation batches). The
paper protocol (100k steps, 3000 batches) is ``python -m bench train gp --steps 100000`` per model.
``python -m bench.np.gp_report RUNS_DIR [OUT_DIR [README]]`` rewrites the report (and the README
block) from finished runs; with ``--protocol paper`` it reports runs of the paper protocol, finished or
stopped on the way, as ``gp_full``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from attn_ext.models import MODELS as MODEL_CLASSES
# The modules of publish, train and evaluate, not the functions: looked up at each call, so that a test can
# stand in for them.
from bench.harness import report as harness_report
from bench.harness.report import markdown_table, progress
from bench.harness.timing import torch_threads
from bench.np import evaluate, train
from bench.np.checkpoint import CHECKPOINT, stored_options
from bench.np.train_history import HISTORY
from bench.np.training_curves import collect_curves, plot_training_curves

NAME = "gp_quick"
MODELS = ("tnpd", "lbanp", "cmanp", "cmanp_and", "retreever", "intention_np", "linear_tnp", "tnp_nd", "lbanp_nd",
          "hypermix_np", "ist", "convnp", "tetnp", "perceiver_io", "transformer_ca")
KERNELS = ("rbf", "matern52")
#: docs/spec.md §6: (RBF, Matern 5/2) after 100k steps, from the papers.
PAPER = {"tnpd": (1.39, 0.95, "CMANP Table 3"), "lbanp": (1.27, 0.85, "CMANP Table 3"),
         "cmanp": (1.24, 0.80, "CMANP Table 3"), "cmanp_and": (1.48, 0.96, "CMANP Table 3"),
         "retreever": (1.25, 0.81, "TCA Table 13"),
         # The Not-Diagonal models' figures are joint log-likelihoods per target, as ours are.
         "tnp_nd": (1.46, 1.02, "CMANP ICML Table 4"), "lbanp_nd": (1.24, 0.78, "CMANP ICML Table 4"),
         "perceiver_io": (1.06, 0.58, "TCA Table 2"), "transformer_ca": (1.35, 0.91, "TCA Table 2")}
#: Models whose training loss is not the per-target NLL, so not comparable with the papers' figures.
#: ReTreever's TCA objective sums the NLL of the retrieval, the NLL over all leaves and a policy term.
OTHER_TRAINING_LOSS = {"retreever": "TCA objective"}
QUICK = {"steps": 100, "eval_batches": 20, "overrides": {"num_layers": 2, "num_latents": 32}}
FULL = {"steps": 5000, "eval_batches": 200, "overrides": {}}


#: What each published table measured: (protocol sentence, caveat sentence).
PROTOCOLS = {
    "quick": ("**quick protocol**: every model trained on RBF tasks for the same number of steps (batch 16, "
              "Adam 5e-4, cosine schedule over those steps) on one CPU thread",
              "The paper figures are after 100k steps and 3000 batches: **these runs stop far earlier**, so the gap "
              "below is the training budget, not the models (the 100k-step paper protocol: `gp_full.md`)."),
    "paper": ("**paper protocol** (docs/spec.md §6): Adam 5e-4 with a cosine schedule over 100k steps, batch 16, on one "
              "CPU thread",
              "A run that did not reach the end of its schedule in the time there was is shown at the step it "
              "reached (`steps` = reached / scheduled): its learning rate had not decayed yet, so it is a "
              "snapshot on the way, not the protocol's result."),
}


def _steps_cell(result: dict) -> str:
    done, scheduled = result["train_steps"], result.get("schedule_steps", result["train_steps"])
    return f"{done:,}" if done >= scheduled else f"{done:,} / {scheduled:,}"


def _label(result: dict) -> str:
    """The model's name, and the options it was trained with that differ from the model's defaults
    (e.g. ReTreever's aggregator)."""
    model, options = result["model"], stored_options(result)
    params = inspect.signature(MODEL_CLASSES[model].__init__).parameters if model in MODEL_CLASSES else {}
    shown = [f"{k}={v}" for k, v in options.items() if k not in params or params[k].default != v]
    return model + (f" ({', '.join(shown)})" if shown else "")


def _runs(runs_dir: Path) -> list:
    """``(run name, {kernel: eval result})`` of every run directory of ``runs_dir`` with an evaluation,
    in :data:`MODELS` order, variants of one model by their directory name."""
    found = []
    for run in sorted(p for p in runs_dir.iterdir() if p.is_dir()):
        evals = {k: json.loads((run / f"eval_{k}.json").read_text()) for k in KERNELS if (run / f"eval_{k}.json").exists()}
        if evals:
            model = next(iter(evals.values()))["model"]
            found.append((MODELS.index(model) if model in MODELS else len(MODELS), run.name, evals))
    return [(name, evals) for _, name, evals in sorted(found, key=lambda t: t[:2])]


def _checkpoint_identity(run: Path) -> Optional[dict]:
    """``{"model", "model_options"}`` of a run without an evaluation yet, from its checkpoint."""
    path = run / CHECKPOINT
    if not path.exists():
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return {key: ckpt[key] for key in ("model", "model_options") if key in ckpt}


def _curves(runs_dir: Path, evaluated: dict) -> dict:
    """Training curves of every run with a history, labelled like the table's rows."""
    identities = {name: next(iter(evals.values())) for name, evals in evaluated.items()}
    for run in sorted(p for p in runs_dir.iterdir() if (p / HISTORY).exists()):
        if run.name not in identities:
            found = _checkpoint_identity(run)
            if found is not None:
                identities[run.name] = found
    labels = {name: _label(first) + (f" [{OTHER_TRAINING_LOSS[first['model']]}]"
                                     if first["model"] in OTHER_TRAINING_LOSS else "")
              for name, first in identities.items()}
    targets = {name: PAPER[first["model"]][0]
               if first["model"] in PAPER and first["model"] not in OTHER_TRAINING_LOSS else None
               for name, first in identities.items()}
    return collect_curves(runs_dir, labels, targets)


def report(runs_dir: Path, command: str, protocol: str = "quick", published_as: str = NAME) -> tuple[str, dict, dict]:
    """Markdown, JSON and training curves of the runs in ``runs_dir/<run>`` (``eval_*.json`` next to each
    checkpoint; one row per run, so variants of a model sit side by side); ``protocol`` ("quick" or
    "paper") picks the text that says what was measured; ``published_as`` is the stem the curves' PNG
    is published under."""
    rows, raw = [], {}
    for name, evals in _runs(runs_dir):
        first = next(iter(evals.values()))
        model = first["model"]
        raw[name] = evals
        cells = [f"{evals[k]['log_likelihood_mean']:.3f} ± {evals[k]['log_likelihood_std']:.3f}" if k in evals else None
                 for k in KERNELS]
        paper = PAPER.get(model)
        rows.append([_label(first), _steps_cell(first), f"{first['train_seconds'] / 60:.1f}", *cells,
                     f"{paper[0]:.2f} / {paper[1]:.2f} ({paper[2]})" if paper else "—"])
    eval_batches = next(iter(next(iter(raw.values())).values()))["num_batches"] if raw else None
    what, caveat = PROTOCOLS[protocol]
    curves = _curves(runs_dir, raw)
    shown = (f"\n\nTraining curves (`{published_as}.png`, written with this table): the training loss against step of "
             "every run with a history (`loss_history.csv`), unfinished runs included; dotted, the paper's RBF "
             "log-likelihood, negated. ReTreever trains on the TCA objective (the NLL of the retrieval plus the NLL "
             "over all leaves plus a policy term), which is on another scale." if curves else "")
    text = "\n".join([
        f"GP meta-regression, {what}, then scored on the first {eval_batches} batches of 16 of the fixed-seed "
        f"evaluation sets (mean per-target log-likelihood ± std over batches; CMANP-AND block-autoregressive with "
        f"b_Q = 5). {caveat} `train min` is wall time on one thread of a 2-core machine shared with other jobs.",
        "",
        markdown_table(["model", "steps", "train min", "RBF", "Matern 5/2", "paper RBF / Matern (source)"], rows),
        "",
        f"Command: `{command}`",
    ]) + shown
    return text, raw, curves


def _publish(name: str, text: str, result: dict, curves: dict, out_dir: Path, readme: Optional[Path]) -> bool:
    """Publish the report, with the curves' PNG when there are curves."""
    def plot(_result, path):
        plot_training_curves(curves, path, f"GP meta-regression ({name}): training loss on RBF tasks")

    return harness_report.publish(name, text, {**result, "curves": curves}, out_dir, plot if curves else None, readme)


def run_protocol(out_dir: Path, runs_dir: Path, steps: int, eval_batches: int, overrides: dict,
                 readme: Path | None = None, name: str = NAME) -> int:
    """Train and evaluate every model into ``runs_dir``, then publish ``<name>.md/.json``."""
    with torch_threads(1):  # the protocol's budget is one thread; the benchmarks after it keep theirs
        for model in MODELS:
            progress(f"{NAME}: training {model} for {steps} steps")
            train.train(model, steps, runs_dir / model, overrides=overrides, checkpoint_every=steps,
                        log_every=max(steps // 2, 1))
            for kernel in KERNELS:
                evaluate.evaluate(runs_dir / model, kernel, num_batches=eval_batches)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items())
    text, raw, curves = report(runs_dir, f"python -m bench train gp --model MODEL --steps {steps} {flags} && python -m bench eval "
                                         f"gp --ckpt RUN --kernel KERNEL --num-batches {eval_batches}", published_as=name)
    return 0 if _publish(name, text, {"benchmark": name, "runs": raw}, curves, out_dir, readme) else 1


def run(options) -> int:
    """``python -m bench run gp_quick``; quick mode publishes as ``gp_smoke`` so that it never overwrites the
    accuracy table of the full quick protocol."""
    cfg = QUICK if options.quick else FULL
    with tempfile.TemporaryDirectory(prefix="attn_ext_gp_") as runs_dir:
        return run_protocol(Path(options.out_dir), Path(runs_dir), cfg["steps"], cfg["eval_batches"],
                            cfg["overrides"], options.update_readme, "gp_smoke" if options.quick else NAME)


def main(argv=None) -> int:
    """``python -m bench.np.gp_report RUNS_DIR [OUT_DIR [README]] [--protocol paper]``: the report
    of finished runs (``RUNS_DIR/<model>/eval_rbf.json``), as ``gp_quick`` or, for the paper protocol,
    ``gp_full``."""
    parser = argparse.ArgumentParser(prog="python -m bench.np.gp_report")
    parser.add_argument("runs", type=Path)
    parser.add_argument("out", type=Path, nargs="?", default=Path("bench/out"))
    parser.add_argument("readme", type=Path, nargs="?", default=None)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="quick")
    parser.add_argument("--name", default=None,
                        help="file stem of the report (default gp_quick / gp_full): to publish the runs of some models "
                             "beside an earlier table instead of replacing it")
    args = parser.parse_args(argv)
    evals = sorted(args.runs.glob("*/eval_rbf.json"))
    if not evals:
        parser.error(f"no finished runs (<model>/eval_rbf.json) in {args.runs}")
    first = json.loads(evals[0].read_text())
    steps, batches = first.get("schedule_steps", first["train_steps"]), first["num_batches"]
    if args.protocol == "quick":
        name = NAME
        command = (f"bench/np/gp_quick.sh {steps} {batches} {args.runs} (per model: python -m bench train gp --model MODEL "
                   f"--steps {steps} --out {args.runs}/MODEL --log-every 100 --checkpoint-every 250; then "
                   f"python -m bench eval gp --ckpt {args.runs}/MODEL --kernel rbf|matern52 --num-batches {batches}), "
                   "OMP_NUM_THREADS=1; two shells each took part of the models (MODELS=...)")
    else:
        name = "gp_full"
        command = (f"python -m bench train gp --model MODEL --steps 100000 --out {args.runs}/MODEL (rerun to resume); "
                   f"python -m bench eval gp --ckpt {args.runs}/MODEL --kernel rbf|matern52 --num-batches {batches}")
    name = args.name or name
    text, raw, curves = report(args.runs, command, args.protocol, name)
    return 0 if _publish(name, text, {"benchmark": name, "protocol": args.protocol, "runs": raw}, curves, args.out,
                         args.readme) else 1


if __name__ == "__main__":
    sys.exit(main())
