"""Which dtypes the hand-written CUDA kernels take on the GPU a call runs on.

The tensor-core kernels (the ``cuda`` backend of ``cross_attention``, forward and backward) take
bfloat16 only from compute capability 8.0 (Ampere): CUDA has no bfloat16 tensor-core operations on
older GPUs such as the V100 (7.0) and T4 (7.5), where the extension compiles those kernels to a trap.
The kernels' launch plans refuse bfloat16 there with the same reason; asking here as well lets dispatch
pick another backend for such a call instead of raising.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

#: The oldest compute capability whose tensor cores take bfloat16.
BF16_MIN_CAPABILITY = (8, 0)

_capabilities: Dict[int, Tuple[int, int]] = {}


@torch.compiler.assume_constant_result
def device_capability(index: int) -> Tuple[int, int]:
    """``(major, minor)`` of CUDA device ``index``, read once per device since dispatch asks on every call.
    Under ``torch.compile`` the result is taken as a constant while tracing, so the query stays out of
    the graph."""
    capability = _capabilities.get(index)
    if capability is None:
        major, minor = torch.cuda.get_device_capability(index)
        capability = _capabilities[index] = (int(major), int(minor))
    return capability


def bf16_tensor_core_reason(x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    """Requirement of the ``cuda`` implementations that run the tensor-core kernels: None unless ``x`` is
    bfloat16 on a GPU older than compute capability 8.0, else the reason."""
    if x.dtype != torch.bfloat16:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    major, minor = device_capability(index)
    if (major, minor) >= BF16_MIN_CAPABILITY:
        return None
    return (f"bf16 needs compute capability 8.0; this device ({x.device}) is {major}.{minor}: the CUDA "
            "tensor-core kernels have no bfloat16 before Ampere (float16 and float32 run on it)")
