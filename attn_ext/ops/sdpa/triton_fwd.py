"""Triton forward of the attention op pair (``attention_fwd_triton``): softmax attention with an optional
strided attention mask, key padding, the causal rule, dropout and grouped key/value heads.

The kernel is the cross-attention forward kernel with its per-pair flags on
(:mod:`attn_ext.ops.cross_attention.triton_fwd`); its tiles, autotuning and NaN handling are the same.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from attn_ext.ops.cross_attention.triton_fwd import launch_forward
from attn_ext.ops.sdpa.triton_args import check_attention_args
from attn_ext.ops.utils.score_range import check_scores_in_range

__all__ = ["attention_forward"]


def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      key_padding_mask: Optional[Tensor], scale: float, is_causal: bool, dropout_p: float,
                      dropout_seed: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor]:
    """Exact attention with a fused online softmax (Triton).

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[B, Hq, L, D]``, ``[B, Hkv, S, D]``, ``[B, Hkv, S, Dv]``, any strides, one dtype among
        float32, float16, bfloat16; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
    attn_mask : torch.Tensor or None
        ``[B, Hq, L, S]`` view (broadcast dims of stride 0 are read as such, never copied): bool,
        True = the pair takes part, or q's dtype, added to the scaled score (``-inf`` masks).
    key_padding_mask : torch.Tensor or None
        Bool ``[B, S]``, True marks a padded key.
    scale : float
        Multiplier of ``q @ k^T``.
    is_causal : bool
        Query ``m`` attends key ``n`` only if ``n <= m`` (top-left aligned).
    dropout_p : float
        Probability in ``[0, 1)`` of dropping a weight (kept weights scaled by ``1 / (1 - p)``).
    dropout_seed : torch.Tensor or None
        int64 one-element tensor, the Philox key; needed when ``dropout_p > 0``.
    chunk_size : int
        Hint for the key tile, as for cross attention.

    Returns
    -------
    out : torch.Tensor
        ``[B, Hq, L, Dv]`` in q's dtype, contiguous; 0 for rows without an allowed key.
    lse : torch.Tensor
        float32 ``[B, Hq, L]``, log-sum-exp of the masked scaled scores before dropout; ``-inf``
        for those empty rows.
    """
    check_attention_args(q, k, v, attn_mask, key_padding_mask, scale, dropout_p, dropout_seed, chunk_size)
    out, lse = launch_forward(q, k, v, key_padding_mask, scale, chunk_size, attn_mask=attn_mask,
                              is_causal=is_causal, dropout_p=float(dropout_p), dropout_seed=dropout_seed)
    check_scores_in_range("scaled_dot_product_attention", q, k, v, out, lse, scale, attn_mask, key_padding_mask,
                          is_causal)
    return out, lse
