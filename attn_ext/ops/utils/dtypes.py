"""The dtype rules every op follows (docs/spec.md §0): what it accepts and what it accumulates in."""
from __future__ import annotations

import torch

#: Input dtypes of the attention ops (float64 on the cpp and reference backends only, for gradcheck).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for fp16/bf16/fp32 inputs, fp64 for fp64: the dtype of every returned lse,
    log-probability, Cholesky factor and ridge weight."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the PyTorch references compute in: fp16/bf16 are upcast to fp32, others kept."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
