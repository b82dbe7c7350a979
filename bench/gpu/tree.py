"""GPU benchmark: Tree Cross Attention against full cross attention over all tokens, as the CPU benchmark
``bench/bench_tree_attention.py`` measures it.

The CPU benchmark's problem on the GPU (its constants: B=1, H=4, M=1024 queries, D=Dv=64, fp32, random
1-D token positions; N in 1e3 … 1e6 tokens; branching b in {2, 16}): **tree** is greedy
``ae.tree_cross_attention`` over the mean-aggregated nodes, per backend (cuda, triton); **full CA** is
``ae.cross_attention`` over all N tokens with the same backend, and SDPA (its own kernel choice for fp32)
on the same inputs; **build + aggregate** is ``ae.build_tree`` then ``ae.tree_aggregate`` of the keys and
of the values on the GPU (timed once per N and b; it runs on the ``cuda`` tree-aggregate kernel).

Checks before timing: the tree result against attn_ext's ``reference`` backend on the same tree
(:func:`check_tree`: the same nodes selected but for near-ties, the output within :data:`FP32_TOLERANCE`),
full CA and SDPA against the fp64 ``reference`` backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import attn_ext as ae
from bench.bench_tree_attention import (B, D, DV, FULL_NS, GOAL_B, GOAL_N, H, M, MIN_SPEEDUP, QUICK_BRANCHINGS,
                                        build_and_aggregate, heads)
from bench.gpu.checks import WrongResult, require_close
from bench.gpu.timing import TIME_LIMIT_NOTE, Budget, cuda_time
from bench.harness.report import format_ms, markdown_table

NAME = "tree"
BACKENDS = ("cuda", "triton")
BRANCHINGS = QUICK_BRANCHINGS
FP32_TOLERANCE = 1e-4
#: SDPA's fp32 kernels may multiply in TF32 (about 1e-3 relative); it is the baseline, not under test.
SDPA_TOLERANCE = 2e-3
#: Fraction of queries whose greedy descent may differ from the reference's (near-ties, see check_tree).
MAX_ELSEWHERE = 0.01


@dataclass(frozen=True)
class Case:
    n: int

    @property
    def label(self) -> str:
        return f"tree N={self.n:,}"


def cases() -> list[Case]:
    return [Case(n) for n in FULL_NS]


def make_problem(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q [B,H,M,D]``, positions ``[B,N,1]``, leaf keys ``[B,N,H*D]`` and values ``[B,N,H*Dv]`` on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, H, M, D, device="cuda", generator=gen), torch.rand(B, n, 1, device="cuda", generator=gen),
            torch.randn(B, n, H * D, device="cuda", generator=gen), torch.randn(B, n, H * DV, device="cuda", generator=gen))


def _tree(q, node_k, node_v, tree, backend: str) -> Callable[[], object]:
    return lambda: ae.tree_cross_attention(q, node_k, node_v, tree, policy="greedy", backend=backend)


def _full(backend: str, q, k, v) -> Callable[[], object]:
    if backend == "sdpa":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return lambda: ae.cross_attention(q, k, v, backend=backend)


def _available(backend: str) -> str | None:
    x = torch.zeros(1, device="cuda")
    return ae.available_backends(x, "tree_cross_attention")[backend] or ae.available_backends(x)[backend]


def check_tree(label: str, got, expected) -> tuple[float, int]:
    """``(relative error of out, queries that descended elsewhere)`` against the reference backend's result.

    Greedy descent takes the larger of the children's policy values; where two are within rounding of each
    other the backends may choose differently, which is not an error. Such queries are left out of the
    comparison of ``out``; more than :data:`MAX_ELSEWHERE` of them is.
    """
    same = (got.selected == expected.selected).all(dim=-1)  # [B, M]
    elsewhere = int((~same).sum())
    if elsewhere > MAX_ELSEWHERE * same.numel():
        raise WrongResult(f"{label}: {elsewhere} of {same.numel()} queries selected other nodes than the reference")
    keep = same[:, None, :, None].expand_as(got.out)
    return require_close(f"{label} vs reference", {"out": (got.out[keep], expected.out[keep])}, FP32_TOLERANCE), elsewhere


def measure(case: Case, budget: Budget, progress: Callable[[str], None]) -> list[dict]:
    if budget.expired():  # no problem drawn, no fp64 reference over up to 1e6 keys
        return ([{"section": NAME, "what": "full", "impl": impl, "N": case.n, "note": TIME_LIMIT_NOTE}
                 for impl in ("sdpa", *BACKENDS)]
                + [{"section": NAME, "what": "tree", "N": case.n, "b": b, "note": TIME_LIMIT_NOTE} for b in BRANCHINGS])
    rows = []
    q, points, leaf_k, leaf_v = make_problem(case.n)
    k, v = heads(leaf_k, D).contiguous(), heads(leaf_v, DV).contiguous()
    ref = ae.cross_attention(q.double(), k.double(), v.double(), backend="reference")
    for impl in ("sdpa", *BACKENDS):
        row = {"section": NAME, "what": "full", "impl": impl, "N": case.n}
        reason = None if impl == "sdpa" else _available(impl)
        if reason or budget.expired():
            rows.append({**row, "note": f"not measured: {reason}" if reason else TIME_LIMIT_NOTE})
            continue
        call = _full(impl, q, k, v)
        bound = SDPA_TOLERANCE if impl == "sdpa" else FP32_TOLERANCE
        row["rel_err"] = require_close(f"full CA {impl} N={case.n:,} vs fp64", {"out": (call(), ref)}, bound)
        t = cuda_time(call)
        rows.append({**row, "ms": t.median_ms, "samples_ms": list(t.samples_ms), "peak_mib": t.peak_mib})
    del ref, k, v
    for b in BRANCHINGS:
        if budget.expired():
            rows.append({"section": NAME, "what": "tree", "N": case.n, "b": b, "note": TIME_LIMIT_NOTE})
            continue
        build = cuda_time(lambda: build_and_aggregate(points, leaf_k, leaf_v, b), warmup=1, min_repeats=3, max_repeats=5)
        tree, node_k, node_v = build_and_aggregate(points, leaf_k, leaf_v, b)
        expected = _tree(q, node_k, node_v, tree, "reference")()
        rows.append({"section": NAME, "what": "build", "N": case.n, "b": b, "ms": build.median_ms,
                     "num_selected": ae.tree_num_selected(case.n, b)})
        for backend in BACKENDS:
            row = {"section": NAME, "what": "tree", "impl": backend, "N": case.n, "b": b}
            reason = _available(backend)
            if reason:
                rows.append({**row, "note": f"not measured: {reason}"})
                continue
            call = _tree(q, node_k, node_v, tree, backend)
            row["rel_err"], row["queries_elsewhere"] = check_tree(f"tree {backend} N={case.n:,} b={b}", call(), expected)
            t = cuda_time(call, number=5)
            rows.append({**row, "ms": t.median_ms, "samples_ms": list(t.samples_ms), "peak_mib": t.peak_mib})
            progress(f"{case.label} b={b} tree {backend}: {t.median_ms:.4f} ms (build + aggregate {build.median_ms:.3f} ms)")
        del tree, node_k, node_v, expected
    return rows


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    q, points, leaf_k, leaf_v = make_problem(case.n)
    _full("triton", q, heads(leaf_k, D).contiguous(), heads(leaf_v, DV).contiguous())()
    for b in BRANCHINGS:
        tree, node_k, node_v = build_and_aggregate(points, leaf_k, leaf_v, b)
        _tree(q, node_k, node_v, tree, "triton")()


def markdown(rows: list[dict]) -> str:
    full = {(r["impl"], r["N"]): r.get("ms") for r in rows if r["what"] == "full"}
    build = {(r["N"], r["b"]): r for r in rows if r["what"] == "build"}
    body, speedups = [], []
    for r in (r for r in rows if r["what"] == "tree" and "ms" in r):
        f = full.get((r["impl"], r["N"]))
        s = full.get(("sdpa", r["N"]))
        body.append([r["impl"], f"{r['N']:,}", r["b"], f"{r['ms']:.4f}", format_ms(f), format_ms(s),
                     None if not f else f"{f / r['ms']:,.1f}x", format_ms(build[(r["N"], r["b"])]["ms"]),
                     f"{build[(r['N'], r['b'])]['num_selected']:,}"])
        if r["N"] == GOAL_N and r["b"] == GOAL_B and f:
            speedups.append(f"{r['impl']} {f / r['ms']:,.1f}x")
    lines = [f"Tree Cross Attention on the GPU, the CPU benchmark's problem: B={B}, H={H}, M={M} queries, "
             f"D=Dv={D}, fp32. **tree**: greedy `ae.tree_cross_attention` (median of samples of 5 calls); **full "
             "CA**: `ae.cross_attention` over all N tokens with the same backend; **SDPA**: the same full attention "
             "by `scaled_dot_product_attention` (its own kernel choice); **build + agg**: `ae.build_tree` + "
             "`ae.tree_aggregate` of keys and values on the GPU. Checked first: tree vs the reference backend "
             f"(same nodes, relative error below {FP32_TOLERANCE:.0e}), full CA and SDPA vs fp64.", "",
             markdown_table(["backend", "N", "b", "tree ms", "full CA ms", "SDPA ms", "full CA / tree",
                             "build + agg ms", "nodes read"], body, align="lrrrrrrrr")]
    if speedups:
        lines += ["", f"Full CA / tree at N={GOAL_N:,}, b={GOAL_B} (the CPU goal: >= {MIN_SPEEDUP:.0f}x): "
                  + ", ".join(speedups) + "."]
    notes = [f"- {r.get('impl', '')} N={r['N']:,} {r['what']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + (["", "Not measured:", *notes] if notes else []))
