"""torch.nn.MultiheadAttention and attn_ext's drop-in with the same state dict, for the tests that compare them."""
from __future__ import annotations

from typing import Tuple

import torch

from attn_ext.nn import MultiheadAttention


def make_pair(embed_dim: int, num_heads: int, dtype=torch.float64, **kwargs) -> Tuple[torch.nn.Module, MultiheadAttention]:
    """torch's module with random biases (zero at initialisation, which would hide them) and ours with its state dict."""
    reference = torch.nn.MultiheadAttention(embed_dim, num_heads, dtype=dtype, **kwargs)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = MultiheadAttention(embed_dim, num_heads, dtype=dtype, **kwargs)
    ours.load_state_dict(reference.state_dict())
    return reference, ours
