"""Fig. 14: few-shot accuracy of Intention vs its kernelised version as the embedding size grows.

The Intention paper's kernel experiment (its §5.1 of the appendix, Figure 14): 5-way 5-shot
classification with Intention as an LS-SVM, plain or with Gaussian-kernel features, at latent sizes
16, 32, 64 and 128; the kernelised version is more accurate at the small sizes. Here the episodes
come from a synthetic stand-in for MiniImageNet (:mod:`bench.intention.kernelised_size_data`) and
the models are :mod:`bench.intention.kernelised_size_models`; every (model, size, seed) trains from
scratch and is scored on the same fixed evaluation episodes.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.harness.machine import machine_markdown
from bench.harness.report import markdown_table
from bench.intention.kernelised_size_data import EpisodeSampler
from bench.intention.kernelised_size_models import MODELS, build_classifier, evaluate, train_classifier
from bench.intention.report_common import pyplot, run_sweep, save_figure

NAME = "intention_kernelised_size"
DEFAULT_LATENTS = (16, 32, 64, 128)
PAPER_BUDGET = ("SGD with momentum 0.9, weight decay 5e-4, lr 0.1 decayed ×0.8 from step 10,000, trained to "
                "convergence; ResNet-12 encoder on 28×28 MiniImageNet; 1000 evaluation episodes")
EVAL_SEED = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/out"), help="output directory (default bench/out)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per (model, size) (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--latents", type=int, nargs="+", default=list(DEFAULT_LATENTS),
                        help="embedding sizes (default: the paper's 16 32 64 128)")
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per training (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="episodes per step (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--eval-episodes", type=int, default=500, help="fixed evaluation episodes (default 500)")
    parser.add_argument("--landmarks", type=int, default=None,
                        help="Nyström landmarks of the kernelised model (default: exact, all 25 context points)")
    parser.add_argument("--jitter", type=float, default=1e-4,
                        help="diagonal jitter of k(K, K) in the kernelised model (default 1e-4)")


def _validate(args) -> None:
    if min(args.latents) < 1 or min(args.steps, args.batch, args.eval_episodes, args.seeds) < 1:
        raise ValueError("kernelised_size: --latents, --steps, --batch, --eval-episodes and --seeds must be >= 1")
    if not args.lr > 0 or args.jitter < 0 or (args.landmarks is not None and args.landmarks < 1):
        raise ValueError(f"kernelised_size: need --lr > 0, --jitter >= 0, --landmarks >= 1; got "
                         f"{args.lr}, {args.jitter}, {args.landmarks}")


def sweep(args, log) -> list[dict]:
    """Train and evaluate every (latent size, model, seed)."""
    sampler = EpisodeSampler()
    gen = torch.Generator().manual_seed(args.seed + EVAL_SEED)
    # Evaluated in chunks of 100 episodes so that memory stays small whatever --eval-episodes is.
    eval_set = [sampler.sample(min(100, args.eval_episodes - i), generator=gen)
                for i in range(0, args.eval_episodes, 100)]
    rows = []
    for latent in args.latents:
        for name in MODELS:
            for seed in range(args.seed, args.seed + args.seeds):
                torch.manual_seed(seed)
                model = build_classifier(name, sampler.obs_dim, latent, sampler.ways, landmarks=args.landmarks,
                                         jitter=args.jitter)
                start = time.perf_counter()
                result = train_classifier(model, sampler, steps=args.steps, batch=args.batch, lr=args.lr,
                                          generator=torch.Generator().manual_seed(seed))
                result.update(evaluate(model, eval_set))
                seconds = time.perf_counter() - start
                log(f"latent {latent} {name} seed {seed}: accuracy {result['accuracy']:.3f} ({seconds:.1f} s)")
                rows.append({"model": name, "latent": latent, "seed": seed, **result, "seconds": round(seconds, 2),
                             "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)})
    return rows


def summary(rows: list[dict], model: str, latent: int) -> tuple[float, float]:
    """Mean accuracy over the seeds and its spread (half the range between the seeds)."""
    accs = [r["accuracy"] for r in rows if r["model"] == model and r["latent"] == latent]
    return sum(accs) / len(accs), (max(accs) - min(accs)) / 2


def tables(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    models = ("intention", "kernelised")

    def cell(m, s):
        mean, spread = summary(rows, m, s)
        return f"{100 * mean:.1f} % ± {100 * spread:.1f}"

    main = markdown_table(["latent size"] + [f"{m} accuracy" for m in models] + ["kernelised − intention"],
                          [[s] + [cell(m, s) for m in models]
                           + [f"{100 * (summary(rows, 'kernelised', s)[0] - summary(rows, 'intention', s)[0]):+.1f} pt"]
                           for s in cfg["latents"]])
    every = markdown_table(["model", "latent", "seed", "parameters", "first loss", "last loss", "accuracy", "± 95%",
                            "seconds"],
                           [[r["model"], r["latent"], r["seed"], f"{r['parameters']:,}", f"{r['first_loss']:.4f}",
                             f"{r['last_loss']:.4f}", f"{100 * r['accuracy']:.1f} %", f"{100 * r['ci95']:.1f}",
                             f"{r['seconds']:.1f}"] for r in rows])
    kernel = "exact (all 25 context points)" if cfg["landmarks"] is None else f"Nyström, {cfg['landmarks']} landmarks"
    seeds = f"seeds {cfg['seed']}–{cfg['seed'] + cfg['seeds'] - 1}"
    return "\n".join([
        f"5-way 5-shot accuracy (15 targets per class) on {cfg['eval_episodes']} fixed synthetic evaluation "
        f"episodes, mean over {cfg['seeds']} seed(s) ± half their range; the kernelised model's Gaussian kernel is "
        f"{kernel}, jitter {cfg['jitter']:g}.",
        "",
        main,
        "",
        f"**Budget** (ours): {cfg['steps']} Adam steps of {cfg['batch']} episodes at lr {cfg['lr']:g} per "
        f"(model, size, seed), {seeds}, {cfg['threads']} torch thread(s); total wall time "
        f"{result['wall_seconds']:.0f} s. **The paper's**: {PAPER_BUDGET}.",
        "",
        "**Beside the paper.** Figure 14 of the Intention paper plots MiniImageNet accuracy against latent sizes "
        "16, 32, 64 and 128 and states that \"the kernelised version is able to achieve higher accuracy even with "
        "smaller latent sizes\" (the curve's values are only in the figure); its Table 2 gives, at its own full "
        "sizes (8192 plain, 32 kernelised), 70.05 % ± 0.51 for Intention and 70.43 % ± 0.52 for the kernelised "
        "version. Compare the *shape* here, not the level: our episodes are synthetic (a fixed random "
        "renderer of multi-modal classes, not images), our encoder a two-layer MLP (not a ResNet-12), and "
        f"{cfg['steps']} Adam steps replace training to convergence, so our accuracies are not on the paper's "
        "scale. The claim checked is the ordering: whether the kernelised model is ahead at the small sizes and "
        "whether the gap closes as the plain model's embedding grows. Why it can be ahead: the plain model fits "
        "a linear map of its `latent` embedding coordinates, while the kernelised one regresses on one Gaussian "
        "feature per context point (25 here) whatever the latent size, so a small embedding limits it much less.",
        "",
        "Every training run (accuracy ± the 95% interval over the evaluation episodes):",
        "",
        every,
        "",
        machine_markdown(result["machine"]),
    ])


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    cfg, rows = result["config"], result["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, m in enumerate(("intention", "kernelised")):
        stats = [summary(rows, m, s) for s in cfg["latents"]]
        ax.errorbar(cfg["latents"], [100 * a for a, _ in stats], yerr=[100 * e for _, e in stats], fmt="-o",
                    color=f"C{i}", capsize=3, label="Intention" if m == "intention" else "Intention, Gaussian kernel")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cfg["latents"], [str(s) for s in cfg["latents"]])
    ax.set(xlabel="latent size", ylabel="accuracy (%)",
           title="5-way 5-shot accuracy vs model size (synthetic episodes)")
    save_figure(fig, path, 120, legends=(ax,))


def run(args: argparse.Namespace) -> int:
    return run_sweep(NAME, "kernelised_size", args, validate=_validate, sweep=lambda log: sweep(args, log),
                     tables=tables, plot=plot,
                     config={"latents": list(args.latents), "steps": args.steps, "batch": args.batch, "lr": args.lr,
                             "eval_episodes": args.eval_episodes, "seed": args.seed, "seeds": args.seeds,
                             "landmarks": args.landmarks, "jitter": args.jitter, "threads": args.threads})
