"""``torch.nn.LayerNorm`` whose second-order forward-mode derivatives are right.

PyTorch's fused layer norm (``torch.nn.functional.layer_norm``, torch 2.13 and earlier) gives wrong
second derivatives under forward over forward (``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``) without
an error: its forward-mode rule drops a term when it is differentiated again (pytorch/pytorch#196700;
measured here: 0.39 where finite differences and reverse mode give 0.87). Every LayerNorm of
``attn_ext.nn`` and ``attn_ext.models`` is this subclass: the fused op in every other case (same
parameters, state dict and values), and the same math written in differentiable elementary ops while
two ``torch.func.jvp`` levels are open.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from attn_ext.ops.utils.nested_forward import forward_over_forward


def layer_norm(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
               bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.layer_norm``, exact under forward over forward (see the module docstring)."""
    if not (torch._C._are_functorch_transforms_active() and forward_over_forward()):
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)
    dims = tuple(range(-len(normalized_shape), 0))
    centred = x - x.mean(dim=dims, keepdim=True)
    y = centred * torch.rsqrt(centred.square().mean(dim=dims, keepdim=True) + eps)  # biased variance, as torch's
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (a subclass: same arguments, parameters and state dict) through :func:`layer_norm`."""

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
