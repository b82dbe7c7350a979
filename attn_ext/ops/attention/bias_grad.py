"""The gradient of an additive ``attn_mask`` (a learned bias: relative positions, pair biases, a learned mask) of
``ae.scaled_dot_product_attention``, key chunk by key chunk, in the mask's own shape.

The score gradient ``dS = P∘(dP − Δ)`` is the mask's gradient, summed over the dimensions the mask is broadcast
along. The composite (PyTorch's math path does the same) holds ``[B, H, L, S]`` scores, probabilities and their
gradients. Here the forward is the call's fused kernel, and the backward recomputes ``P`` one key chunk at a time
from the saved log-sum-exp (the reference kernels' FlashAttention backward) and sums each chunk's ``dS`` straight
into a gradient of the mask's shape: a bias ``[H, L, S]`` shared by the batch gets a ``[H, L, S]`` gradient, and
nothing of size ``[B, H, L, S]`` beyond one chunk's ``[B, H, L, c]`` ever exists.

This is the rule of the first-order reverse mode (a training step). A backward whose own derivatives are wanted
(``create_graph=True``), forward mode, ``torch.func`` transforms and ``torch.compile`` (whose graph the backward's
data-dependent checks would break) take the op's differentiable composite, as the other derivatives of the mask do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from attn_ext.ops.attention import composite, naive
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error

__all__ = ["BiasGradient", "attention_with_bias_gradient", "takes_bias_gradient"]

#: Elements of one key chunk's ``[B, H, L, c]`` tiles in the backward (the chunk width follows from it).
CHUNK_ELEMENTS = 1 << 22


class BiasGradient:
    """The gradient of a mask of shape ``bias_shape`` broadcast to ``lead + (S,)`` (``lead``: the query's shape
    without its last dim, ``(..., Hq, L)``), summed one key chunk of ``dS`` at a time."""

    def __init__(self, bias_shape: Tuple[int, ...], lead: Tuple[int, ...], dtype: torch.dtype, device):
        self.shape, self.lead = tuple(bias_shape), tuple(lead)
        self.grad = torch.zeros(self.shape, dtype=dtype, device=device)
        self.keys_broadcast = len(self.shape) == 0 or self.shape[-1] == 1

    def add(self, grad_scores: Tensor, n0: int, n1: int) -> None:
        """Adds ``grad_scores`` ``[B, Hq, L, n1 − n0]``, the score gradient of the keys ``[n0, n1)``."""
        ds = grad_scores.reshape(self.lead + (n1 - n0,))
        if self.keys_broadcast:
            self.grad += ds.sum_to_size(self.shape)
        else:
            self.grad[..., n0:n1] += ds.sum_to_size(self.shape[:-1] + (n1 - n0,))


@dataclass(frozen=True)
class _Call:
    """The call's other arguments: the fused forward ``entry`` and what it and the backward take besides q, k, v,
    the mask (already checked and 4-D where they are tensors); ``compiled``: the backward is op
    ``attention_bwd_bias`` (the cpp kernels), else the reference kernels' chunked backward."""
    entry: Callable
    compiled: bool
    lead: Tuple[int, ...]
    padding: Optional[Tensor]
    scale: float
    is_causal: bool
    dropout_p: float
    seed: Optional[Tensor]
    chunk_size: int
    window_left: int
    window_right: int
    diagonal: int
    softcap: float
    alibi_slopes: Optional[Tensor]

    def mask(self, bias: Tensor, q: Tensor, keys: int) -> Tensor:
        """The ``[B, Hq, L, S]`` view of ``bias`` the op takes."""
        return bias.expand(self.lead + (keys,)).reshape(tuple(q.shape[:3]) + (keys,))

    def op_args(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple:
        return (q, k, v, mask, self.padding, self.scale, self.is_causal, self.dropout_p, self.seed, self.chunk_size,
                self.window_left, self.window_right, self.diagonal, self.softcap, self.alibi_slopes)


def _in_bias_shape(grad_mask: Tensor, bias: Tensor, lead: Tuple[int, ...]) -> Tensor:
    """Op ``attention_bwd_bias``'s mask gradient (``[B | 1, Hq | 1, L | 1, S | 1]``, size 1 where the op's mask
    view was broadcast) as the gradient of ``bias``: the batch dims of ``lead`` restored, the dims ``bias``
    broadcasts summed."""
    batch = lead[:-2]
    g = grad_mask.reshape((batch if grad_mask.shape[0] != 1 else (1,) * len(batch)) + tuple(grad_mask.shape[1:]))
    extra = g.dim() - bias.dim()
    if extra > 0 and all(size == 1 for size in g.shape[:extra]):
        g = g.reshape(g.shape[extra:])  # a view: summing size-1 dims away would copy a gradient of the bias's size
    return g.sum_to_size(bias.shape).to(bias.dtype)


def _chunk_keys(q: Tensor) -> int:
    rows = max(1, q.shape[0] * q.shape[1] * q.shape[2])
    return max(16, min(1024, 1 << max(0, (CHUNK_ELEMENTS // rows).bit_length() - 1)))


class _AttentionWithBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, call: _Call):
        out, lse = call.entry(*call.op_args(q, k, v, call.mask(bias, q, k.shape[2])))
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]):
        q, k, v, bias, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
        if torch.is_grad_enabled():  # create_graph: this backward's own derivatives are wanted
            def dense(q, k, v, bias):
                return composite.attention(call.op_args(q, k, v, call.mask(bias, q, k.shape[2])), (out, lse))

            _, vjp = torch.func.vjp(dense, q, k, v, bias)
            return (*vjp((grad_out, grad_lse.to(lse.dtype))), None)
        if call.compiled:  # the cpp kernels' backward sums dS into the mask's shape tile by tile
            grad_q, grad_k, grad_v, grad_mask = torch.ops.attn_ext.attention_bwd_bias(
                grad_out, grad_lse, q, k, v, call.mask(bias, q, k.shape[2]), call.padding, out, lse, call.scale,
                call.is_causal, call.dropout_p, call.seed, call.chunk_size, call.window_left, call.window_right,
                call.diagonal, call.softcap, call.alibi_slopes)
            return grad_q, grad_k, grad_v, _in_bias_shape(grad_mask, bias, call.lead), None
        gradient = BiasGradient(tuple(bias.shape), call.lead, accumulation_dtype(q.dtype), q.device)
        grad_q, grad_k, grad_v = naive.attention_backward(
            grad_out, grad_lse, q, k, v, call.mask(bias, q, k.shape[2]), call.padding, out, lse, call.scale,
            call.is_causal, call.dropout_p, call.seed, _chunk_keys(q), call.window_left, call.window_right,
            call.diagonal, call.softcap, call.alibi_slopes, bias_grad=gradient)
        return grad_q, grad_k, grad_v, gradient.grad.to(bias.dtype), None


def takes_bias_gradient(attn_mask: Optional[Tensor], *tensors: Tensor) -> bool:
    """Whether a call's mask gradient takes the chunked rule: a float mask that requires grad, in plain reverse
    mode (no forward-mode tangent, no ``torch.func`` transform, whose derivatives the composite gives)."""
    if attn_mask is None or not attn_mask.is_floating_point() or not attn_mask.requires_grad:
        return False
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return False
    if torch.compiler.is_compiling():  # its data-dependent checks (saturated rows) would break the graph
        return False
    if forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None
                                              for t in (attn_mask, *tensors)):
        return False
    return True


def _fake_bwd_bias(grad_out, grad_lse, q, k, v, attn_mask, *_rest):
    sizes = [1 if attn_mask.stride(d) == 0 else attn_mask.shape[d] for d in range(4)]
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            attn_mask.new_empty(sizes, dtype=accumulation_dtype(q.dtype)))


if extension_error() is None and hasattr(torch.ops.attn_ext, "attention_bwd_bias"):
    torch.library.register_fake("attn_ext::attention_bwd_bias")(_fake_bwd_bias)


def attention_with_bias_gradient(backend: str, entry: Callable, q: Tensor, k: Tensor, v: Tensor, bias: Tensor,
                                 lead: Tuple[int, ...], padding: Optional[Tensor], scale: float, is_causal: bool,
                                 dropout_p: float, seed: Optional[Tensor], chunk_size: int, window_left: int,
                                 window_right: int, diagonal: int, softcap: float,
                                 alibi_slopes: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(out [B, Hq, L, Dv], lse [B, Hq, L])`` of the op ``entry`` with ``bias`` (the user's mask, broadcastable to
    ``lead + (S,)``) as its additive mask, differentiable in ``bias`` by the chunked rule above."""
    compiled = backend == "cpp" and hasattr(torch.ops.attn_ext, "attention_bwd_bias") and q.device.type == "cpu"
    call = _Call(entry, compiled, tuple(lead), padding, scale, is_causal, dropout_p, seed, chunk_size, window_left,
                 window_right, diagonal, softcap, alibi_slopes)
    return _AttentionWithBias.apply(q, k, v, bias, call)
