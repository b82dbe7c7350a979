"""The card's ceilings, measured in the same run as the benchmark: the dense bf16 matrix-product rate and the
device-to-device copy bandwidth. Each benchmark row's TFLOP/s and each prediction
(bench/results/gpu_predicted.md, :mod:`bench.gpu.predicted`) is read against these, not against a datasheet.

* matmul: ``8192 × 8192 × 8192`` bf16 products on random data (zeros would run faster: less switching),
  2·n³ flops each, median of CUDA-event timings;
* copy: ``Tensor.copy_`` of 2 GiB (several times any L2), bytes read plus bytes written over the time.
"""
from __future__ import annotations

import torch

from bench.gpu.timing import cuda_time

MATMUL_N = 8192
COPY_BYTES = 2 * 2**30


def measure() -> dict:
    """``{"matmul_bf16_tflops": ..., "copy_tbps": ...}`` on the current device."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    matmul_ms = cuda_time(lambda: a @ b, warmup=3, min_repeats=10, max_repeats=10).median_ms
    del a, b
    src = torch.empty(COPY_BYTES, device="cuda", dtype=torch.uint8).random_(generator=gen)
    dst = torch.empty_like(src)
    copy_ms = cuda_time(lambda: dst.copy_(src), warmup=3, min_repeats=10, max_repeats=10).median_ms
    del src, dst
    torch.cuda.empty_cache()
    return {"matmul_bf16_tflops": 2 * MATMUL_N ** 3 / (matmul_ms * 1e-3) / 1e12,
            "copy_tbps": 2 * COPY_BYTES / (copy_ms * 1e-3) / 1e12}


def sentence(ceilings: dict) -> str:
    return (f"Ceilings measured in this run: dense bf16 products {ceilings['matmul_bf16_tflops']:.0f} TFLOP/s "
            f"({MATMUL_N}³, random data), device copy {ceilings['copy_tbps']:.2f} TB/s (bytes read + written, "
            f"{COPY_BYTES // 2**30} GiB).")
