"""LinearTNP: TNP-D with linear attention ``φ = elu + 1`` (the chapter's linear-attention NP, docs/spec.md §5)."""
from __future__ import annotations

from attn_ext.models.tnpd import TNPD


class LinearTNP(TNPD):
    """TNP-D whose attention is :class:`attn_ext.models.linear_attention.LinearAttention`: time and
    memory linear in ``N_c + N_t``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import LinearTNP
    >>> model = LinearTNP(num_layers=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).scale.shape
    torch.Size([2, 7, 1])
    """

    attention = "linear"
