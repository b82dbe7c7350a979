"""GPU benchmark: attention states. The state update against recomputing the state, as the CPU benchmark
``bench/bench_state_update.py`` measures it, and the merge of two states against the same math in PyTorch.

**Update**: the CPU benchmark's problem on the GPU (its constants: B=1, H=4, M=128 latents, D=Dv=64, fp32,
16 new keys, N in 1e3 … 1e6 keys in the state): ``ae.update_state(state, q, k_new, v_new)`` given the state
over N keys, against recomputing ``ae.attention_state(q, k_all, v_all)`` over all N + 16 keys, per
backend (cuda, triton). The CPU goals (update flat in N within 1.2x; 1000x faster than recomputing at
N = 1e6) are printed for reference; on a GPU the update is one launch-bound call. Both results are
checked against attn_ext's fp64 ``reference`` backend before timing.

**Merge**: ``ae.merge_states`` of two ``[8, 4, 4096, 64]`` states, per backend and for fp32 and bf16,
against ``logaddexp`` and two scaled sums in PyTorch (memory-bound; checked against the PyTorch result).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import attn_ext as ae
from bench.bench_state_update import B, D, DV, FLAT_MAX_RATIO, FULL_NS, H, M, MIN_SPEEDUP, NEW_KEYS
from bench.gpu.checks import require_close
from bench.gpu.timing import TIME_LIMIT_NOTE, Budget, cuda_time
from bench.harness.report import format_ms, markdown_table

NAME = "states"
BACKENDS = ("cuda", "triton")
#: Relative error allowed against fp64 for fp32 results (fp32 accumulation over up to 1e6 keys).
FP32_TOLERANCE = 1e-4
#: Back-to-back calls per timed sample of the update, which takes tens of microseconds.
UPDATE_NUMBER = 20
MERGE_SHAPE = (8, 4, 4096, 64)
MERGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MERGE_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


@dataclass(frozen=True)
class Case:
    kind: str  # "update" (n = keys in the state) or "merge" (n unused)
    backend: str
    n: int = 0
    dtype: str = "fp32"

    @property
    def label(self) -> str:
        return f"update N={self.n:,} {self.backend}" if self.kind == "update" else f"merge {self.dtype} {self.backend}"


def cases() -> list[Case]:
    return ([Case("update", b, n) for b in BACKENDS for n in FULL_NS]
            + [Case("merge", b, dtype=dt) for dt in MERGE_DTYPES for b in BACKENDS])


def update_problem(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q, k_all, v_all`` on the GPU: the CPU benchmark's shapes, drawn on the device (1e6 keys in seconds)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, length, dim, device="cuda", generator=gen)
                 for length, dim in ((M, D), (n + NEW_KEYS, D), (n + NEW_KEYS, DV)))


def _update_calls(case: Case) -> tuple[Callable[[], object], Callable[[], object], tuple]:
    """``(update, recompute, (q, k_all, v_all))`` for ``case``; the state over the first N keys is made now."""
    q, k_all, v_all = update_problem(case.n)
    n = case.n
    state = ae.attention_state(q, k_all[:, :, :n], v_all[:, :, :n], backend=case.backend)
    k_new, v_new = k_all[:, :, n:].contiguous(), v_all[:, :, n:].contiguous()
    return (lambda: ae.update_state(state, q, k_new, v_new, backend=case.backend),
            lambda: ae.attention_state(q, k_all, v_all, backend=case.backend), (q, k_all, v_all))


def merge_problem(dtype: str, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(ae.AttentionState(torch.randn(MERGE_SHAPE, device="cuda", generator=gen).to(MERGE_DTYPES[dtype]),
                                   torch.randn(MERGE_SHAPE[:-1], device="cuda", generator=gen)) for _ in range(2))


def merge_in_torch(a, b):
    """The merge written in PyTorch ops (fp32 math, output in the states' dtype)."""
    lse = torch.logaddexp(a.lse, b.lse)
    out = torch.exp(a.lse - lse)[..., None] * a.out.float() + torch.exp(b.lse - lse)[..., None] * b.out.float()
    return out.to(a.out.dtype), lse


def _measure_update(case: Case) -> dict:
    update, recompute, (q, k_all, v_all) = _update_calls(case)
    ref_out, ref_lse = ae.cross_attention(q.double(), k_all.double(), v_all.double(), return_lse=True,
                                          backend="reference")
    errors = {}
    for what, call in (("update", update), ("recompute", recompute)):
        got = call()
        errors[what] = require_close(f"{what} {case.label} vs fp64 reference",
                                     {"out": (got.out, ref_out), "lse": (got.lse, ref_lse)}, FP32_TOLERANCE)
    del ref_out, ref_lse
    up = cuda_time(update, number=UPDATE_NUMBER, min_repeats=10, max_repeats=30)
    rc = cuda_time(recompute)
    return {"update_ms": up.median_ms, "update_samples_ms": list(up.samples_ms), "update_peak_mib": up.peak_mib,
            "recompute_ms": rc.median_ms, "recompute_samples_ms": list(rc.samples_ms),
            "rel_err_update": errors["update"], "rel_err_recompute": errors["recompute"]}


def _measure_merge(case: Case) -> dict:
    a, b = merge_problem(case.dtype)
    out, lse = merge_in_torch(a, b)
    got = ae.merge_states(a, b, backend=case.backend)
    err = require_close(f"{case.label} vs PyTorch", {"out": (got.out, out), "lse": (got.lse, lse)},
                        MERGE_TOLERANCE[case.dtype])
    ours, torch_ops = cuda_time(lambda: ae.merge_states(a, b, backend=case.backend)), cuda_time(lambda: merge_in_torch(a, b))
    return {"ms": ours.median_ms, "samples_ms": list(ours.samples_ms), "torch_ms": torch_ops.median_ms,
            "peak_mib": ours.peak_mib, "rel_err": err}


def measure(case: Case, budget: Budget, progress: Callable[[str], None]) -> list[dict]:
    row = {"section": NAME, "kind": case.kind, "backend": case.backend, "N": case.n, "dtype": case.dtype}
    reason = ae.available_backends(torch.zeros(1, device="cuda"))[case.backend]
    if reason or budget.expired():
        return [{**row, "note": f"not measured: {reason}" if reason else TIME_LIMIT_NOTE}]
    row.update(_measure_update(case) if case.kind == "update" else _measure_merge(case))
    if case.kind == "update":
        progress(f"{case.label}: update {row['update_ms']:.4f} ms, recompute {row['recompute_ms']:.3f} ms")
    else:
        progress(f"{case.label}: {row['ms']:.4f} ms (PyTorch ops {row['torch_ms']:.4f} ms)")
    return [row]


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    if case.backend != "triton":
        return
    if case.kind == "update":
        update, recompute, _ = _update_calls(case)
        update(), recompute()
    else:
        ae.merge_states(*merge_problem(case.dtype), backend="triton")


def markdown(rows: list[dict]) -> str:
    updates = [r for r in rows if r["kind"] == "update"]
    merges = [r for r in rows if r["kind"] == "merge"]
    body, verdicts = [], []
    for backend in BACKENDS:
        mine = [r for r in updates if r["backend"] == backend and "update_ms" in r]
        for r in mine:
            body.append([backend, f"{r['N']:,}", format_ms(r["recompute_ms"]), f"{r['update_ms']:.4f}",
                         f"{r['recompute_ms'] / r['update_ms']:,.1f}x", f"{r['update_peak_mib']:.1f}"])
        if len(mine) >= 2:
            flat, speed = mine[-1]["update_ms"] / mine[0]["update_ms"], mine[-1]["recompute_ms"] / mine[-1]["update_ms"]
            verdicts.append(f"{backend}: update at N={mine[-1]['N']:,} / N={mine[0]['N']:,} = {flat:.2f}x (CPU goal "
                            f"<= {FLAT_MAX_RATIO}x), recompute / update at N={mine[-1]['N']:,} = {speed:,.0f}x "
                            f"(CPU goal >= {MIN_SPEEDUP:,.0f}x).")
    lines = [f"State update on the GPU, the CPU benchmark's problem: B={B}, H={H}, M={M} latents, D=Dv={D}, fp32. "
             f"**update**: `ae.update_state(state, q, k_new, v_new)` with {NEW_KEYS} new keys given the state over "
             f"N keys, median of samples of {UPDATE_NUMBER} back-to-back calls; **recompute**: `ae.attention_state` "
             "over all N + 16 keys. Both checked against the fp64 reference backend first "
             f"(relative error below {FP32_TOLERANCE:.0e}).", "",
             markdown_table(["backend", "N (keys in state)", "recompute ms", "update ms", "speed-up",
                             "update peak MiB"], body, align="lrrrrr"), ""] + verdicts
    merge_body = [[r["dtype"], r["backend"], f"{r['ms']:.4f}", f"{r['torch_ms']:.4f}", f"{r['torch_ms'] / r['ms']:.2f}"]
                  for r in merges if "ms" in r]
    lines += ["", f"State merge of two `{list(MERGE_SHAPE)}` states (`ae.merge_states`) vs the same math in PyTorch "
              "ops (`logaddexp`, two scaled sums), checked against it first.", "",
              markdown_table(["dtype", "backend", "ms", "PyTorch ops ms", "PyTorch / ours"], merge_body, align="llrrr")]
    notes = [f"- {r['kind']} {r['backend']} N={r['N']:,} {r['dtype']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines + (["", "Not measured:", *notes] if notes else []))
