"""IntentionNP: TNP-D with Intention (ridge-regression attention, docs/spec.md §4) in place of softmax attention."""
from __future__ import annotations

from attn_ext.models.tnpd import TNPD


class IntentionNP(TNPD):
    """TNP-D whose layers use :class:`attn_ext.nn.Intention`: every token reads the context through
    the per-head statistics ``K̂ᵀK̂`` and ``K̂ᵀV̂`` (learned ridge ``α`` per head), so the context
    enters in memory independent of its size beyond its own embeddings.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import IntentionNP
    >>> model = IntentionNP(num_layers=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).mean.shape
    torch.Size([2, 7, 1])
    """

    attention = "intention"
