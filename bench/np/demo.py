"""``python -m bench run np_demo``: a short end-to-end Neural Process run, the last part of ``make bench``.

Trains a small TNP-D (:data:`OVERRIDES`: d_model 32, 2 layers; every attention on ``ae.cross_attention``)
on GP regression for :data:`STEPS` steps on one thread (the GP protocol's budget, docs/spec.md §6), then scores
it on the first :data:`EVAL_BATCHES` batches of the fixed-seed RBF evaluation set, next to the same
model untrained. About 10 s on an idle core. It shows the whole pipeline working (sampler, model, fused
attention forward and backward, training loop, checkpoint, evaluation), not an accuracy figure: the
paper's TNP-D (docs/spec.md §5 sizes, 100k steps) scores 1.39, reproduced by ``bench/results/gp_full.md``.
Writes ``np_demo.{md,json,png}`` (the PNG: the training loss).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from attn_ext.models import build_model
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import markdown_table, progress, provenance, publish
from bench.harness.timing import torch_threads
from bench.np.data.eval_set import evaluation_set
from bench.np.evaluate import evaluate, score
from bench.np.train import train
from bench.np.training_curves import collect_curves, plot_training_curves

NAME = "np_demo"
MODEL = "tnpd"
OVERRIDES = {"d_model": 32, "num_layers": 2, "num_heads": 2, "ff_dim": 64, "emb_depth": 2}
STEPS, LR, EVAL_BATCHES = 1000, 2e-3, 50
#: The level of a model that predicts from global statistics of the context only (issue 7).
PLATEAU = -0.57


def _flags() -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in OVERRIDES.items())


def run(options) -> int:
    """Train, evaluate, publish; exit status 0, or 1 when training or publishing failed."""
    machine = machine_info()
    progress(f"{NAME}: {MODEL} ({_flags()}) on GP RBF tasks, {STEPS} steps on 1 thread, then "
             f"{EVAL_BATCHES} evaluation batches; {machine_markdown(machine)}")
    with torch_threads(1), tempfile.TemporaryDirectory(prefix="attn_ext_np_demo_") as tmp:
        run_dir = Path(tmp) / MODEL
        batches = evaluation_set("rbf", EVAL_BATCHES)
        torch.manual_seed(0)  # as train() does before building the model: the same initial weights
        before = score(build_model(MODEL, **OVERRIDES, dim_x=1, dim_y=1), batches)[0].mean().item()
        start = time.perf_counter()
        try:
            summary = train(MODEL, STEPS, run_dir, overrides=OVERRIDES, lr=LR, checkpoint_every=STEPS,
                            log_every=STEPS // 5, log=lambda msg: progress("  " + msg))
        except (ValueError, FloatingPointError) as exc:
            progress(f"error: {NAME}: training failed: {exc}")
            return 1
        seconds = time.perf_counter() - start
        after = evaluate(run_dir, "rbf", num_batches=EVAL_BATCHES)
        curves = collect_curves(Path(tmp), {MODEL: f"{MODEL} ({_flags()})"}, {})
    parameters = sum(p.numel() for p in build_model(MODEL, **OVERRIDES, dim_x=1, dim_y=1).parameters())
    machine["load_average_end"] = load_average()
    table = markdown_table(
        ["model", "parameters", "steps", "train s (1 thread)", "RBF log-likelihood untrained", f"after {STEPS} steps"],
        [[f"{MODEL} ({_flags()})", f"{parameters:,}", f"{summary['final_step']:,}", f"{seconds:.1f}", f"{before:.3f}",
          f"{after['log_likelihood_mean']:.3f} ± {after['log_likelihood_std']:.3f}"]])
    text = "\n".join([
        f"A short end-to-end run: {MODEL} trained on GP regression (RBF kernel; batch 16, Adam {LR:g}, cosine "
        f"schedule) with every attention on `ae.cross_attention`, then scored on the first {EVAL_BATCHES} batches "
        "of 16 of the fixed-seed evaluation set (mean per-target log-likelihood ± std over batches).",
        "",
        table,
        "",
        f"For scale: a model that ignores where its targets sit scores about {PLATEAU} (the prior-level plateau); "
        "the paper's TNP-D (docs/spec.md §5 sizes, 100k steps) 1.39, which ours reproduces (`bench/results/gp_full.md`). "
        f"The same run by hand: `python -m bench train gp --model {MODEL} --steps {STEPS} --lr {LR:g} {_flags()} "
        f"--out runs/demo` then `python -m bench eval gp --ckpt runs/demo --num-batches {EVAL_BATCHES}`.",
        "",
        machine_markdown(machine),
        "",
        provenance(options, NAME, "the demo has one size on every grid"),
    ])
    result = {"benchmark": NAME, "grid": options.grid, "command": options.command, "machine": machine,
              "config": {"model": MODEL, "overrides": OVERRIDES, "steps": STEPS, "lr": LR, "eval_batches": EVAL_BATCHES,
                         "threads": 1},
              "parameters": parameters, "train_seconds": seconds, "log_likelihood_untrained": before,
              "evaluation": after, "curves": curves}

    def plot(_result, path):
        plot_training_curves(curves, path, f"{NAME}: training loss of {MODEL} on GP RBF tasks")

    # No README block: the README's tables are the op benchmarks' and the NP protocols'.
    return 0 if publish(NAME, text, result, options.out_dir, plot if curves else None) else 1
