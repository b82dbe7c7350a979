"""Variance of the Intention map Z = Q Kᵀ(KKᵀ)⁻¹ vs dimension: unscaled, √d-scaled, scaled + convex regulariser (Fig. 15).

The Intention paper's appendix on normalisation asks what attention's ``1/√d`` is for Intention.
With queries and keys drawn from a standard normal distribution (``N`` keys, ``M`` queries in
``d`` dimensions) it measures the variance of the entries of the map that Intention applies to the
values,

- unscaled: ``Z = Q Kᵀ(KKᵀ)⁻¹``,
- scaled: ``Z = √d · Q Kᵀ(KKᵀ)⁻¹``,
- scaled with the convex regulariser: ``Z = 0.5·√d · Q Kᵀ[σ(θ)KKᵀ + (1 − σ(θ))I]⁻¹`` at ``θ = 0``,

for ``N = 16, 32, 64`` and a growing ``d`` (its Figure 15, from top to bottom in that order).

``Z`` is Intention's output for identity values ``V = I_N``, i.e. the query-side reading of the
fitted map ``w(K, I_N)``, and is computed with attn_ext's ops (float64):

- ``d <= N``: ``w = ae.intention_map(K, I_N, alpha=0)`` = ``(KᵀK)⁻¹Kᵀ`` (a ``d × d`` system), ``Z = Q w``;
- ``d > N``: ``KᵀK`` is singular, and the paper's ``Kᵀ(KKᵀ)⁻¹`` is the minimum-norm map; we read it
  off the transposed regression, ``Zᵀ = (KKᵀ)⁻¹K Qᵀ = ae.intention_map(Kᵀ, Qᵀ, alpha=0)`` (an
  ``N × N`` system). Both branches are the pseudo-inverse ``Z = Q pinv(K)``, which is also what
  the literal formula means for ``d < N``, where ``KKᵀ`` has no inverse;
- the regulariser: ``ae.convex_intention(Q, K, I_N, theta=0, scale=ae.intention_variance_scale(d, convex=True))``.

Closed forms (the expectations of inverse Wishart matrices) for the unscaled variance:
``1/(d − N − 1)`` for ``d > N + 1`` and ``d/(N(N − d − 1))`` for ``d < N − 1``; infinite for
``N − 1 <= d <= N + 1``. Scaling multiplies them by ``d``. No training is involved: the
regulariser's logit starts at 0 in the paper, and that starting point is what the figure shows.
"""
from __future__ import annotations

import datetime
import math
import sys
import time
from pathlib import Path

import torch

import attn_ext as ae
from bench.harness.machine import load_average, machine_info, machine_markdown
from bench.harness.report import markdown_table, progress, publish
from bench.intention import command_line

NAME = "intention_map_variance"
FORMS = ("unscaled", "scaled", "regularised")
#: The paper's numbers of keys (its appendix on normalisation).
PAPER_KEYS = (16, 32, 64)
DEFAULT_DIMS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
#: What the paper says of its Figure 15 (the figure's values are not in the text).
PAPER_CLAIMS = {
    "unscaled": "explodes for very small d, vanishes as d grows",
    "scaled": "converges smoothly to 1",
    "regularised": "stabilises the small-d behaviour too",
}


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench/out"), help="output folder (default bench/out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--keys", type=int, nargs="+", default=list(PAPER_KEYS), help="numbers of keys N")
    parser.add_argument("--dims", type=int, nargs="+", default=list(DEFAULT_DIMS), help="dimensions d")
    parser.add_argument("--draws", type=int, default=256, help="key sets drawn per (N, d) (default 256)")
    parser.add_argument("--queries", type=int, default=16, help="queries per key set (default 16)")


def sample_keys_queries(n_keys: int, dim: int, n_queries: int, draws: int, generator):
    """Standard-normal queries ``[draws, 1, M, d]`` and keys ``[draws, 1, N, d]`` (float64)."""
    if min(n_keys, dim, n_queries, draws) < 1:
        raise ValueError(f"sample_keys_queries: need positive sizes, got N={n_keys}, d={dim}, M={n_queries}, "
                         f"draws={draws}")
    q = torch.randn(draws, 1, n_queries, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(draws, 1, n_keys, dim, generator=generator, dtype=torch.float64)
    return q, k


def intention_z(q, k, form: str):
    """The map ``Z [B, 1, M, N]`` of ``form`` (one of :data:`FORMS`) for queries ``q`` and keys ``k``."""
    if form not in FORMS:
        raise ValueError(f"intention_z: unknown form {form!r}; choose one of {', '.join(FORMS)}")
    n_keys, dim = k.shape[-2], k.shape[-1]
    eye = torch.eye(n_keys, dtype=k.dtype).expand(*k.shape[:2], n_keys, n_keys)
    if form == "regularised":
        return ae.convex_intention(q, k, eye, theta=0.0, scale=ae.intention_variance_scale(dim, convex=True))
    if dim <= n_keys:
        z = q @ ae.intention_map(k, eye, alpha=0.0)                  # (KᵀK)⁻¹Kᵀ: a d × d system
    else:
        # KᵀK is singular here; the transposed regression (d "points" with N features) is regular and
        # gives (KKᵀ)⁻¹K Qᵀ = Zᵀ with an N × N system, without the d × d pseudo-inverse.
        z = ae.intention_map(k.mT, q.mT, alpha=0.0).mT
    return z * math.sqrt(dim) if form == "scaled" else z


def theory_variance(n_keys: int, dim: int, form: str):
    """Closed-form variance of an entry of ``Z`` (None for the regulariser, ``inf`` where it diverges)."""
    if form == "regularised":
        return None
    if dim > n_keys + 1:
        var = 1.0 / (dim - n_keys - 1)
    elif dim < n_keys - 1:
        var = dim / (n_keys * (n_keys - dim - 1))
    else:
        return math.inf
    return var * dim if form == "scaled" else var


def explicit_inverse_variance(q, k):
    """Variance of the literal ``Q Kᵀ inv(KKᵀ)`` with a float64 LU inverse, over the draws LU accepts.

    For ``d < N`` the matrix ``KKᵀ`` has rank ``d``, so an explicit inverse returns rounding noise blown
    up by the reciprocal of a tiny pivot: what a literal implementation of the formula produces there.
    Plain PyTorch on purpose: it shows a failure mode, it is not a model.
    """
    inverse, info = torch.linalg.inv_ex(k @ k.mT)
    ok = info.flatten(1).eq(0).all(1)          # draws where LU met an exactly zero pivot are left out
    if not bool(ok.any()):
        return None
    return float((q @ k.mT @ inverse)[ok].var())


def measure(keys, dims, *, draws: int, queries: int, seed: int, log=None) -> list:
    """One row per (N, d): the pooled variance of the entries of ``Z`` for every form, and the theory."""
    rows = []
    cells = [(n, d) for n in keys for d in dims]
    for i, (n, d) in enumerate(cells, 1):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + n * 10_007 + d)  # each cell reproducible alone
        q, k = sample_keys_queries(n, d, queries, draws, gen)
        row = {"N": n, "d": d, "explicit_inverse": explicit_inverse_variance(q, k)}
        for form in FORMS:
            z = intention_z(q, k, form)
            row[form] = float(z.var())
            row[f"{form}_theory"] = theory_variance(n, d, form)
        rows.append(row)
        if log is not None:
            log(f"[{i}/{len(cells)}] N={n} d={d}: " + ", ".join(f"{f} {row[f]:.3g}" for f in FORMS))
    return rows


def _fmt(x) -> str:
    if x is None:
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.3g}"


def verdicts(rows: list) -> dict:
    """The paper's three claims checked on our numbers: form -> (what we see, holds)."""
    out = {}
    largest_d = max(r["d"] for r in rows)
    at_end = [r for r in rows if r["d"] == largest_d]
    peak = {f: max(r[f] for r in rows) for f in FORMS}
    first = [r for r in rows if r["d"] == min(r["d"] for r in rows)]
    unscaled_end = max(r["unscaled"] for r in at_end)
    out["unscaled"] = (f"peaks at {peak['unscaled']:.3g} near d = N (KKᵀ or KᵀK nearly singular); "
                       f"≤ {unscaled_end:.3g} at d = {largest_d}",
                       peak["unscaled"] > 10 and unscaled_end < 0.05)
    scaled_end = [r["scaled"] for r in at_end]
    out["scaled"] = (f"{min(scaled_end):.3g}–{max(scaled_end):.3g} at d = {largest_d} (theory d/(d − N − 1)); "
                     f"peak {peak['scaled']:.3g} near d = N", all(abs(v - 1) < 0.15 for v in scaled_end))
    reg_end = [r["regularised"] for r in at_end]
    # "Stabilises" read as: no divergence near d = N, i.e. bounded within an order of magnitude of 1.
    out["regularised"] = (f"bounded: at most {peak['regularised']:.3g} over all d (vs {peak['scaled']:.3g} scaled); "
                          f"{min(reg_end):.3g}–{max(reg_end):.3g} at d = {largest_d}; like the other two it is "
                          f"≪ 1 for d ≪ N ({min(r['regularised'] for r in first):.3g}–"
                          f"{max(r['regularised'] for r in first):.3g} at d = {first[0]['d']})",
                          peak["regularised"] < 10 and peak["regularised"] < peak["scaled"] / 100)
    return out


def tables(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    body = markdown_table(
        ["N", "d", "unscaled", "theory", "explicit inv(KKᵀ)", "scaled (√d)", "theory",
         "scaled + regulariser (0.5√d, θ = 0)"],
        [[r["N"], r["d"], _fmt(r["unscaled"]), _fmt(r["unscaled_theory"]), _fmt(r["explicit_inverse"]), _fmt(r["scaled"]),
          _fmt(r["scaled_theory"]), _fmt(r["regularised"])] for r in rows])
    checks = verdicts(rows)
    beside = markdown_table(["Figure 15 row", "the paper", "ours", "agrees"],
                            [[f, PAPER_CLAIMS[f], checks[f][0], "yes" if checks[f][1] else "no"] for f in FORMS],
                            align="llll")
    return "\n".join([
        f"Variance of the entries of the Intention map `Z` (queries and keys standard normal, float64, "
        f"{cfg['draws']} key sets × {cfg['queries']} queries per cell, seed {cfg['seed']}). `∞`: the closed form "
        "diverges there (N − 1 ≤ d ≤ N + 1), so the measured value is whatever the heaviest draw made it. "
        "`explicit inv(KKᵀ)`: the unscaled formula taken literally, with a float64 LU inverse, over the draws where LU "
        "met no exactly zero pivot; for d < N it is rounding noise, not a map.",
        "",
        body,
        "",
        "**Beside the paper** (its Figure 15 is a plot; the text states only these claims):",
        "",
        beside,
        "",
        "Where ours differ: the paper does not say how it defines `(KKᵀ)⁻¹` for d < N, where `KKᵀ` is "
        "singular; we use the pseudo-inverse (the minimum-norm map, as the paper recommends for singular systems), "
        "whose variance `d/(N(N − d − 1))` is small for d ≪ N and diverges only as d approaches N. The paper's "
        "\"exploding variance for very small d\" matches either this divergence near d ≈ N or the literal "
        "formula's explicit inverse of the singular `KKᵀ` (column `explicit inv(KKᵀ)`), which explodes for every "
        "d < N. Both readings agree from d = N + 2 on, where the map is unique.",
        "",
        f"Wall time {result['wall_seconds']:.1f} s. " + machine_markdown(result["machine"]),
    ])


def plot(result: dict, path: Path) -> None:
    # matplotlib is optional (figures only): imported when plotting, on the Agg backend (files, no display).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    titles = {"unscaled": "unscaled Intention  Z = Q Kᵀ(KKᵀ)⁻¹", "scaled": "scaled Intention  √d · Q Kᵀ(KKᵀ)⁻¹",
              "regularised": "scaled Intention with regulariser  0.5√d · Q Kᵀ[σ(θ)KKᵀ + (1−σ(θ))I]⁻¹, θ = 0"}
    fig, axes = plt.subplots(len(FORMS), 1, figsize=(7, 9.5), sharex=True)
    for ax, form in zip(axes, FORMS):
        for i, n in enumerate(result["config"]["keys"]):
            mine = [r for r in rows if r["N"] == n]
            ax.plot([r["d"] for r in mine], [r[form] for r in mine], "o-", color=f"C{i}", ms=3, label=f"N = {n}")
            theory = [(r["d"], r[f"{form}_theory"]) for r in mine
                      if r[f"{form}_theory"] is not None and math.isfinite(r[f"{form}_theory"])]
            if theory:
                # Drawn per side of the divergence, so no line crosses d ≈ N.
                for side in ([t for t in theory if t[0] < n], [t for t in theory if t[0] > n]):
                    if side:
                        ax.plot(*zip(*side), ":", color=f"C{i}", lw=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("variance of Z")
        ax.set_title(titles[form], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small", title="points (dotted: closed form)", title_fontsize="small")
    axes[-1].set_xlabel("dimension d")
    fig.suptitle("Variance of the Intention map (cf. the Intention paper's Figure 15)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    if args.draws < 2 or args.queries < 1 or min(args.keys) < 1 or min(args.dims) < 1:
        raise ValueError(f"map_variance: need draws >= 2 and positive keys, dims, queries; got draws={args.draws}, "
                         f"keys={args.keys}, dims={args.dims}, queries={args.queries}")
    torch.set_num_threads(args.threads)
    machine = machine_info()
    start = time.perf_counter()
    rows = measure(args.keys, sorted(set(args.dims)), draws=args.draws, queries=args.queries, seed=args.seed,
                   log=progress)
    machine["load_average_end"] = load_average()
    command = command_line("map_variance", args)
    result = {"benchmark": NAME, "machine": machine, "rows": rows, "command": command.strip(),
              "wall_seconds": time.perf_counter() - start,
              "config": {"keys": list(args.keys), "dims": sorted(set(args.dims)), "draws": args.draws,
                         "queries": args.queries, "seed": args.seed, "threads": args.threads}}
    text = (tables(result) + f"\n\nProduced by `{result['command']}` (1 thread: `--threads {args.threads}`), "
            f"{datetime.date.today().isoformat()}.")
    publish(NAME, text, result, args.out, plot)
    bad = [r for r in rows for f in FORMS if not math.isfinite(r[f])]
    for r in bad:
        print(f"warning: non-finite variance at N={r['N']} d={r['d']}", file=sys.stderr)
    return 1 if bad else 0
