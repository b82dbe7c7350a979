"""What the GPU tests share: which backends can run on this machine's CUDA device, and why not.

Every GPU test takes a ``backend`` parameter (``cuda``, ``triton``, or only ``cuda`` for the ops without a
Triton kernel: tree aggregation, the batched Cholesky), so ``-k cuda`` / ``-k triton`` select one backend's
kernels (the sanitize stage of ``make gpu-check`` does). A backend that cannot run is skipped with the
library's own reason; ``make gpu-check`` sets ``ATTN_EXT_REQUIRE_GPU=1``, under which such a skip fails
instead (see conftest.py here), so a check that tested nothing cannot pass.

``ATTN_EXT_GPU_SANITIZE=1`` shrinks every grid to its small cases: under compute-sanitizer every launch
is serialised and instrumented, 10-100 times slower.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import pytest
import torch

import attn_ext as ae
from _helpers import naive_attention, naive_grads, worse_of

SANITIZE = os.environ.get("ATTN_EXT_GPU_SANITIZE") == "1"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def grid(full, small):
    """``small`` under compute-sanitizer (``ATTN_EXT_GPU_SANITIZE=1``), else ``full`` (a grid or one value)."""
    return small if SANITIZE else full


def unavailable(backend: str, op: str = "cross_attention") -> Optional[str]:
    """Why ``backend`` cannot run ``op`` on CUDA tensors here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): the GPU kernels are not tested on this machine"
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # The kernels were decorated for the interpreter, which would run them on copies in host memory.
        return ("TRITON_INTERPRET=1: attn_ext's Triton kernels were built for the interpreter, so CUDA tensors would "
                "not test the compiled kernels; run with TRITON_INTERPRET=0 (make gpu-check does)")
    return ae.available_backends(torch.zeros(1, device="cuda"), op)[backend]


def backends(op: str = "cross_attention", names: Sequence[str] = ("cuda", "triton")) -> list:
    """``pytest.param`` per backend in ``names``, each skipped with its reason when it cannot run ``op``."""
    params = []
    for name in names:
        reason = unavailable(name, op)
        marks = [pytest.mark.skipif(True, reason=f"{name} backend not tested: {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytorch_same_precision(q, k, v, mask, scale, cpu_result, ref):
    """The worse of PyTorch's same-precision (out, lse) on the CPU (``cpu_result``) and on the GPU.

    FlashAttention's rule compares with PyTorch's own computation in the inputs' precision, done on the
    device under test: a GPU dot product accumulates its D terms one FMA at a time per thread (cuBLAS
    and our kernels alike), while the CPU's BLAS blocks them, so its fp32 error is often smaller by
    luck of the summation order. Taking the worse of the two keeps the rule about the precision, not
    about which summation order PyTorch happened to use. TF32 is off for the GPU reference.
    """
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gpu = naive_attention(*cuda(q, k, v, mask), scale)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return tuple(worse_of(a, b.cpu(), r) for a, b, r in zip(cpu_result, gpu, ref))


def pytorch_grads_same_precision(q, k, v, mask, scale, grad_out, grad_lse, cpu_grads, ref_grads):
    """Gradients: the worse of PyTorch's same-precision ones on the CPU and on the GPU (see above)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        gpu = naive_grads(*cuda(q, k, v, mask), scale, *cuda(grad_out, grad_lse))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return tuple(worse_of(a, b.cpu(), r) for a, b, r in zip(cpu_grads, gpu, ref_grads))


def cuda(*tensors):
    """The tensors on the current CUDA device (None stays None)."""
    return tuple(None if t is None else t.cuda() for t in tensors)
