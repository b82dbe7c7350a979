"""Predicted H200 times of the GPU benchmark's rows, committed before a GPU window and read beside the
measured ones after it (issue 41; ``python -m bench.gpu.predicted`` rewrites bench/results/gpu_predicted.md).

Each row's time is its work over a ceiling, divided by the share of that ceiling the implementation is
expected to reach:

* **ceilings**, measured on this workplace's H200s (the device tool's KINDS.md, 2026-10-28 and 2026-11-04):
  dense bf16/fp16 matrix products 790 TFLOP/s on random data (8192³, through PyTorch), device copy
  4.3 TB/s counting bytes read and written; fp32 on the CUDA cores the datasheet's 67 TFLOP/s;
* **work**: attention flops as the benchmark counts them (``bench.gpu.attention.attention_flops``; causal
  rows half of them, the convention of FlashAttention's papers); bytes as the inputs and outputs each
  read or written once; launch-bound rows a fixed cost per kernel launch (:data:`LAUNCH_US`);
* **shares**: what each implementation's machine code is expected to reach (:data:`ATTENTION_SHARE`,
  forward and backward, with a causal factor), from the published numbers of FlashAttention-2/3 and
  cuDNN on H100 (same SMs and clocks as the H200) and, for ours, from the machine code read on the CPU
  machine (issue 43's table: Triton with wgmma but no TMA, no warp specialisation and spills in the
  backward; the CUDA kernels with HMMA only, shared-memory accumulators and 2-byte loads).

These are predictions with stated assumptions, not measurements; a measured time more than 2x away from
its row is worth a sentence in bench/results/gpu.md.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench.gpu.attention import B, DTYPES, H, HEAD_DIMS, NS, attention_flops
from bench.gpu.other_ops import CHOLESKY_SHAPE, INTENTION_SHAPE
from bench.gpu.states import MERGE_SHAPE

MATMUL_TFLOPS = 790.0   # bf16/fp16 dense, measured on the H200 (random data)
FP32_TFLOPS = 67.0      # CUDA cores, datasheet
COPY_TBPS = 4.3         # device-to-device copy, bytes read + written, measured
LAUNCH_US = 5.0         # one kernel launch and its tail, through PyTorch's dispatcher

#: Expected share of MATMUL_TFLOPS by implementation, (forward, backward), at D = 128 and long sequences.
ATTENTION_SHARE = {
    "sdpa-cudnn": (0.75, 0.55),      # cuDNN 9 on H100: about FlashAttention-3's rates
    "flex": (0.50, 0.35),            # FlexAttention compiled: about 90 % of FA2's forward, less backward
    "sdpa-flash": (0.45, 0.35),      # FlashAttention-2 (sm_80 code on Hopper): 35-45 % of the dense peak
    "sdpa-efficient": (0.30, 0.22),  # xformers' CUTLASS kernel
    "triton": (0.40, 0.18),
    # The Hopper kernels through TMA (opt-in, never measured). Forward, warp-specialised: FlashAttention-3's
    # structure without its ping-pong scheduling, about 55 % (the general forward measured 53 %). Backward
    # (predicted 2026-11-28, before a GPU ran it): TMA loads and stores, no warp specialisation, spill-free
    # tiles at D = 128 but for causal dK/dV (112-648 B): a little over the general backward's 18 %.
    "triton-tma": (0.55, 0.21),
    # FlashAttention-2's instruction mix (mma.sync, ldmatrix, 16-byte cp.async, registers), first versions
    # untuned on a GPU (predicted 2026-11-28 before any GPU ran them; the WMMA kernels they replaced measured
    # 0.014 forward and about 0.02 backward). Forward: one K and one V buffer, about 2/3 of FA2's share.
    # Backward: 16 rows per warp (twice FA2's shared-memory reads per MMA), no overlap of the streamed
    # tile's load with compute, and dQ recomputing S and dP: under half of FA2's.
    "cuda": (0.30, 0.15),
}
IMPLEMENTATIONS = tuple(ATTENTION_SHARE)
#: D = 64 halves the work per loaded tile: the same kernels reach about this fraction of their D = 128 share.
SMALL_HEAD_FACTOR = 0.8
#: Causal rows skip half the tiles but pay the diagonal tiles' masking and a less even schedule.
CAUSAL_FACTOR = 0.85
#: Short sequences (L = 1k) leave the pipeline's start and end a larger part of each tile loop.
SHORT_FACTOR = 0.75


@dataclass(frozen=True)
class Row:
    section: str
    label: str
    implementation: str
    work: str
    predicted_ms: float


def _attention_share(implementation: str, pass_: str, d: int, n: int, causal: bool) -> float:
    fwd, bwd = ATTENTION_SHARE[implementation]
    if pass_ == "fwd":
        share = fwd
    else:  # forward + backward: the flops weigh 4 : 10
        share = 14.0 / (4.0 / fwd + 10.0 / bwd)
    share *= SMALL_HEAD_FACTOR if d < 128 else 1.0
    share *= CAUSAL_FACTOR if causal else 1.0
    share *= SHORT_FACTOR if n <= 1024 else 1.0
    return share


def attention_label(dtype: str, d: int, n: int, causal: bool, pass_: str) -> str:
    """The case of an attention row (self-attention, L = S = n) as gpu_predicted.md names it; the key under which
    ``bench.gpu.measured_vs_predicted`` finds a measured row's prediction."""
    return f"{dtype} D={d} L=S={n} {'causal' if causal else 'full'} {pass_}"


def attention_rows() -> list[Row]:
    rows = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            for n in NS:
                for causal in (False, True):
                    for pass_ in ("fwd", "fwd+bwd"):
                        flops = attention_flops(B, H, n, n, d, pass_, causal)
                        label = attention_label(dtype, d, n, causal, pass_)
                        for impl in IMPLEMENTATIONS:
                            share = _attention_share(impl, pass_, d, n, causal)
                            ms = flops / (MATMUL_TFLOPS * 1e12 * share) * 1e3
                            rows.append(Row("attention", label, impl, f"{flops / 1e12:.3g} TFLOP", ms))
    return rows


def other_rows() -> list[Row]:
    """The rows only attn_ext has, each against what PyTorch does instead."""
    rows = []
    # State update: 16 new keys into a state over 1M (B = 1, H = 4, M = 128, D = 64, fp32): a handful of
    # launches, against recomputing attention over all 1M keys (fp32 on the CUDA cores, K and V read once).
    b, h, m, d, n = 1, 4, 128, 64, 1_000_000
    recompute_flops = 4 * b * h * m * n * d
    recompute_bytes = 2 * b * h * n * d * 4
    rows.append(Row("states", "update 16 keys into N=1e6", "ours (3 launches)", "launch-bound", 3 * LAUNCH_US / 1e3))
    rows.append(Row("states", "update 16 keys into N=1e6", "recompute over all keys", f"{recompute_flops / 1e9:.3g} GFLOP fp32",
                    max(recompute_flops / (0.5 * FP32_TFLOPS * 1e12), recompute_bytes / (COPY_TBPS * 1e12)) * 1e3))
    mb, mh, mm, md = MERGE_SHAPE
    merge_bytes = 3 * mb * mh * mm * (md + 1) * 4   # two states read, one written (fp32)
    rows.append(Row("states", f"merge {MERGE_SHAPE} fp32", "ours (1 kernel)", f"{merge_bytes / 1e6:.3g} MB",
                    merge_bytes / (0.7 * COPY_TBPS * 1e12) * 1e3 + LAUNCH_US / 1e3))
    rows.append(Row("states", f"merge {MERGE_SHAPE} fp32", "PyTorch (about 10 elementwise kernels)",
                    f"{merge_bytes / 1e6:.3g} MB x 3", 3 * merge_bytes / (0.7 * COPY_TBPS * 1e12) * 1e3 + 10 * LAUNCH_US / 1e3))
    # Greedy tree retrieval (M = 1024 queries, H = 4, D = 64, N = 1e6, b = 2): each query reads about
    # 2·log2(N) ≈ 40 nodes by dependent gathers, latency-bound; full attention over all N keys (fp32).
    full_flops = 4 * 1 * 4 * 1024 * n * d
    rows.append(Row("tree", "greedy retrieval, N=1e6, M=1024, b=2", "ours", "~40 nodes/query, 20 levels",
                    20 * LAUNCH_US / 1e3))
    rows.append(Row("tree", "greedy retrieval, N=1e6, M=1024, b=2", "full attention (fp32)", f"{full_flops / 1e12:.3g} TFLOP fp32",
                    full_flops / (0.5 * FP32_TFLOPS * 1e12) * 1e3))
    ib, ih, in_, idim = INTENTION_SHAPE
    gram_flops = 2 * ib * ih * in_ * idim * (2 * idim) + 2 * ib * ih * in_ * idim * idim  # KᵀK, KᵀV; Q·W
    sdpa_flops = 4 * ib * ih * in_ * in_ * idim
    rows.append(Row("intention", f"intention {INTENTION_SHAPE} fp32", "ours (triton)", f"{gram_flops / 1e9:.3g} GFLOP",
                    gram_flops / (0.3 * FP32_TFLOPS * 1e12) * 1e3 + 4 * LAUNCH_US / 1e3))
    rows.append(Row("intention", f"intention {INTENTION_SHAPE} fp32", "SDPA (same shape)", f"{sdpa_flops / 1e9:.3g} GFLOP",
                    sdpa_flops / (0.5 * FP32_TFLOPS * 1e12) * 1e3))
    cb, cn, _ = CHOLESKY_SHAPE
    chol_flops = cb * cn ** 3 / 3
    rows.append(Row("cholesky", f"batched Cholesky {CHOLESKY_SHAPE} fp32", "ours (triton)", f"{chol_flops / 1e9:.3g} GFLOP",
                    max(chol_flops / (0.1 * FP32_TFLOPS * 1e12), 2 * cb * cn * cn * 4 / (COPY_TBPS * 1e12)) * 1e3))
    rows.append(Row("cholesky", f"batched Cholesky {CHOLESKY_SHAPE} fp32", "torch.linalg.cholesky", f"{chol_flops / 1e9:.3g} GFLOP",
                    max(chol_flops / (0.05 * FP32_TFLOPS * 1e12), 2 * cb * cn * cn * 4 / (COPY_TBPS * 1e12)) * 1e3))
    return rows


def markdown() -> str:
    lines = ["# Predicted H200 times of the GPU benchmark", "",
             "Written by `python -m bench.gpu.predicted` (the model and its assumptions are that module's docstring) "
             "before any GPU window measured these rows. Ceilings: dense bf16/fp16 products "
             f"{MATMUL_TFLOPS:g} TFLOP/s and device copy {COPY_TBPS:g} TB/s, both measured on this workplace's H200s; "
             f"fp32 {FP32_TFLOPS:g} TFLOP/s (datasheet). Attention: B = {B}, H = {H}, self-attention L = S; causal rows "
             "count half the flops. A measured time more than 2x away from its prediction gets a sentence in "
             "bench/results/gpu.md.", "",
             "## Attention (predicted ms; TFLOP/s in brackets)", "",
             "| case | work | " + " | ".join(IMPLEMENTATIONS) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in IMPLEMENTATIONS) + " |"]
    by_label: dict[str, list[Row]] = {}
    for row in attention_rows():
        by_label.setdefault(row.label, []).append(row)
    for label, rows in by_label.items():
        flops = float(rows[0].work.split()[0]) * 1e12
        cells = [f"{r.predicted_ms:.3g} ({flops / (r.predicted_ms * 1e9):.0f})" for r in rows]
        lines.append(f"| {label} | {rows[0].work} | " + " | ".join(cells) + " |")
    lines += ["", "## What only attn_ext does, against what PyTorch does instead", "",
              "| section | case | implementation | work | predicted ms |", "| --- | --- | --- | --- | ---: |"]
    for r in other_rows():
        lines.append(f"| {r.section} | {r.label} | {r.implementation} | {r.work} | {r.predicted_ms:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "gpu_predicted.md")
    args = parser.parse_args(argv)
    args.out.write_text(markdown())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
