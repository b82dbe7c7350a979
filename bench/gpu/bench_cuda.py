"""GPU benchmark of the CUDA and Triton kernels against PyTorch, for a machine WITH a GPU.

Never run on the project's machines (they have no GPU); written so that the first person with one
gets a table in one command::

    python bench/gpu/bench_cuda.py                 # forward and forward+backward, fp16/bf16/fp32
    python bench/gpu/bench_cuda.py --dtype bf16 --out bench/results/cuda_gpu.md

Rows: cross attention (B=8, H=4, M=128 latents as in CMANP, N keys, D=64) with ``backend="cuda"``
and ``backend="triton"`` vs ``scaled_dot_product_attention`` (``cuda``: tensor-core forward for fp16/bf16,
SIMT for fp32, SIMT backward); the state merge of two [8, 4, 4096, 64] states; Intention (M = N) and the batched
Cholesky + solve ``[4096, 64, 64]`` vs ``torch.linalg``. Timed with CUDA events, median of
``--repeats`` after warm-up; peak memory from ``torch.cuda.max_memory_allocated``. A backend that
cannot run is reported with its reason instead of a time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def cuda_time_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> tuple[float, float]:
    """(median ms, peak MiB above the inputs) of ``fn`` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def attention_rows(dtype: torch.dtype, repeats: int) -> list[list[str]]:
    import attn_ext as ae

    rows = []
    for n in (1_000, 10_000, 100_000):
        q = torch.randn(8, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(8, 4, n, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        grad = torch.randn_like(q)
        calls = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
        for backend in ("cuda", "triton"):
            reason = ae.available_backends(q)[backend]
            calls[backend] = reason or (lambda b=backend: ae.cross_attention(q, k, v, backend=b))
        for name, fn in calls.items():
            if isinstance(fn, str):
                rows.append([f"{n:,}", name, "-", "-", f"unavailable: {fn}"])
                continue
            fwd, mem = cuda_time_ms(lambda: fn().detach(), repeats)
            bwd, _ = cuda_time_ms(lambda: torch.autograd.grad(fn(), (q, k, v), grad), repeats)
            rows.append([f"{n:,}", name, f"{fwd:.3f}", f"{bwd:.3f}", f"{mem:.1f}"])
    return rows


def merge_rows(dtype: torch.dtype, repeats: int) -> list[list[str]]:
    """merge_states of two [8, 4, 4096, 64] states: memory bound, compared with the same math in torch ops."""
    import attn_ext as ae

    a, b = (ae.AttentionState(torch.randn(8, 4, 4096, 64, device="cuda", dtype=dtype),
                              torch.randn(8, 4, 4096, device="cuda")) for _ in range(2))

    def torch_ops():
        lse = torch.logaddexp(a.lse, b.lse)
        return (torch.exp(a.lse - lse)[..., None] * a.out + torch.exp(b.lse - lse)[..., None] * b.out), lse

    rows = []
    for name, fn in (("merge_states cuda", lambda: ae.merge_states(a, b, backend="cuda")),
                     ("merge_states triton", lambda: ae.merge_states(a, b, backend="triton")),
                     ("torch ops", torch_ops)):
        try:
            rows.append([name, f"{cuda_time_ms(fn, repeats)[0]:.3f}"])
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append([name, f"failed: {type(exc).__name__}: {exc}"])
    return rows


def linalg_rows(repeats: int) -> list[list[str]]:
    import attn_ext as ae

    rows = []
    q, k, v = (torch.randn(8, 4, 4096, 64, device="cuda") for _ in range(3))
    for name, fn in (("intention cuda", lambda: ae.intention(q, k, v, backend="cuda")),
                     ("intention triton", lambda: ae.intention(q, k, v, backend="triton")),
                     ("sdpa (same shape)", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))):
        try:
            rows.append([name, f"{cuda_time_ms(fn, repeats)[0]:.3f}"])
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append([name, f"failed: {type(exc).__name__}: {exc}"])
    z = torch.randn(4096, 64, 64, device="cuda")
    a, b = z @ z.mT / 64 + torch.eye(64, device="cuda"), torch.randn(4096, 64, 64, device="cuda")
    for name, fn in (("cholesky+solve ours", lambda: torch.ops.attn_ext.batched_cholesky_solve(
                         torch.ops.attn_ext.batched_cholesky(a)[0], b)),
                     ("cholesky+solve torch", lambda: torch.cholesky_solve(b, torch.linalg.cholesky(a)))):
        try:
            rows.append([name, f"{cuda_time_ms(fn, repeats)[0]:.3f}"])
        except Exception as exc:  # noqa: BLE001
            rows.append([name, f"failed: {type(exc).__name__}: {exc}"])
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+", default=["fp16", "bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cuda_gpu.md"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (nothing measured)", file=sys.stderr)
        return 2
    parts = [f"# GPU benchmark on {torch.cuda.get_device_name()} (torch {torch.__version__})", ""]
    for key in args.dtype:
        print(f"cross attention {key} ...", file=sys.stderr, flush=True)
        parts += [f"## Cross attention, {key}, B=8 H=4 M=128 D=64", "",
                  markdown(["N", "impl", "fwd ms", "fwd+bwd ms", "peak MiB / note"],
                           attention_rows(DTYPES[key], args.repeats)), ""]
        parts += [f"## State merge, {key}, [8, 4, 4096, 64]", "", markdown(["impl", "ms"], merge_rows(DTYPES[key], args.repeats)),
                  ""]
    print("intention and Cholesky ...", file=sys.stderr, flush=True)
    parts += ["## Intention (B=8 H=4 M=N=4096 D=64, fp32) and batched Cholesky [4096, 64, 64]", "",
              markdown(["impl", "ms"], linalg_rows(args.repeats)), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(parts))
    print("\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
