"""Dense references of ``ae.scaled_dot_product_attention`` for the tests, and the cases they run.

``dense_attention`` is the textbook full-matrix computation with the library's conventions (a row
with no pair taking part gives 0 and lse = -inf; a masked pair is never read), in the inputs' dtype:
run on fp64 inputs it is the ground truth, on the inputs as they are it is PyTorch's same-precision
computation of the FlashAttention rule.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

import attn_ext as ae
from attn_ext.ops.attention.dropout import keep_mask


def allowed_pairs(attn_mask, key_padding_mask, is_causal, B, H, L, S, device=None) -> Tensor:
    allowed = torch.ones(B, H, L, S, dtype=torch.bool, device=device)
    if attn_mask is not None:
        allowed = allowed & (attn_mask if attn_mask.dtype == torch.bool else attn_mask != -math.inf)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.reshape(B, 1, 1, S)
    if is_causal:
        allowed = allowed & torch.ones(L, S, dtype=torch.bool, device=allowed.device).tril()
    return allowed


def dense_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                    key_padding_mask: Optional[Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
                    keep: Optional[Tensor] = None, dropout_p: float = 0.0):
    """``(out, lse)`` of 4-D inputs (GQA by repeating heads); differentiable; finite inputs only."""
    B, H, L, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + torch.where(torch.isneginf(attn_mask), torch.zeros_like(attn_mask), attn_mask)
    allowed = allowed_pairs(attn_mask, key_padding_mask, is_causal, B, H, L, S, device=q.device)
    scores = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    empty = ~allowed.any(dim=-1)
    safe = torch.where(empty[..., None], torch.zeros_like(scores), scores)
    lse_safe = torch.logsumexp(safe, dim=-1) if S > 0 else torch.zeros(B, H, L, dtype=q.dtype)
    probs = torch.where(empty[..., None], torch.zeros_like(scores), torch.exp(safe - lse_safe[..., None]))
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1.0 - dropout_p)
    out = torch.matmul(probs, v)
    return out, torch.where(empty, torch.full_like(lse_safe, -math.inf), lse_safe.float() if q.dtype in (
        torch.float16, torch.bfloat16) else lse_safe)


def dense_keep(seed: int, dropout_p: float, B: int, H: int, L: int, S: int) -> Tensor:
    return keep_mask(seed, dropout_p, (B, H, L, S))


def backends():
    """Backends that run the op on CPU tensors here (triton only under the interpreter, tested apart)."""
    return ("reference", "cpp")


def require(backend: str, x: Tensor) -> None:
    import pytest

    reason = ae.available_backends(x, "scaled_dot_product_attention")[backend]
    if reason is not None:
        pytest.skip(f"backend {backend!r} unavailable: {reason}")


def attention_ops():
    """The attention forward ops that run on CPU tensors here: the reference, and the compiled one when built."""
    ops = [torch.ops.attn_ext.attention_fwd_reference]
    if hasattr(torch.ops.attn_ext, "attention_fwd"):
        ops.append(torch.ops.attn_ext.attention_fwd)
    return ops
