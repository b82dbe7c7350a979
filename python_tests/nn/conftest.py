"""Temporary: a plain-PyTorch stand-in for ``attn_ext.scaled_dot_product_attention`` until the op lands.

Installed only when attn_ext has no such attribute, so the real op is tested as soon as it exists.
"""
import math

import torch

import attn_ext


def _stand_in(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              key_padding_mask=None, return_lse=False, chunk_size=None, backend=None):
    assert not (is_causal and attn_mask is not None) and not enable_gqa and not return_lse
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = scale * query @ key.transpose(-2, -1)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    empty = (s == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    return p @ value


if not hasattr(attn_ext, "scaled_dot_product_attention"):
    attn_ext.scaled_dot_product_attention = _stand_in
