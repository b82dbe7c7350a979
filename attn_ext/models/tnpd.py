"""TNP-D (Nguyen & Grover 2022): a Transformer over ``[xc, yc]`` and ``[xt, 0]`` whose targets attend
only to the context, with a diagonal Gaussian head (docs/spec.md §5)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points
from attn_ext.models.layers import ContextEncoder
from attn_ext.models.packed import per_task_prediction


class TNPD(NeuralProcess):
    """TNP-D on attn_ext's fused cross attention.

    Each layer is one cross attention with all ``N_c + N_t`` tokens as queries and the ``N_c``
    context tokens as keys, which is exactly TNP-D's masked self attention; the ``[N, N]`` mask and
    score matrix are never formed (time stays quadratic in ``N_c``, memory becomes linear).

    Parameters
    ----------
    config : NPConfig, optional
        Sizes (docs/spec.md §5 defaults); keyword overrides are applied on top, e.g. ``TNPD(num_layers=2)``.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import TNPD
    >>> from attn_ext.data import GPSampler
    >>> model = TNPD(num_layers=2, d_model=32)
    >>> batch = GPSampler().sample(4, generator=torch.Generator().manual_seed(0))
    >>> bool(torch.isfinite(model(batch)))
    True
    >>> model.predict(batch.xc, batch.yc, batch.xt).mean.shape == batch.yt.shape
    True
    """

    #: Attention of the encoder layers (see :data:`attn_ext.models.layers.ATTENTIONS`).
    attention = "softmax"

    def __init__(self, config: Optional[NPConfig] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        self.encoder = ContextEncoder(c.num_layers, c.d_model, c.num_heads, c.ff_dim, self.attention)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        tokens = torch.cat([self.embed_pairs(xc, yc), self.embed_pairs(xt, None)], 1)
        h = self.encoder(tokens, xc.shape[1])
        return self.head(h[:, xc.shape[1]:])

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of tasks packed end to end (the layout of
        :class:`~attn_ext.data.PackedNPBatch`): each task's tokens attend over its own context only, by
        :func:`attn_ext.varlen_attention`, with no padding formed; per task, what :meth:`predict` gives it alone.
        Layers of another attention (Intention, linear attention: no packed kernel) predict one task at a time."""
        if self.attention != "softmax":
            return per_task_prediction(self, xc, yc, xt, cu_seqlens_c, cu_seqlens_t)
        h = self.encoder.packed(self.embed_pairs(xc, yc), self.embed_pairs(xt, None), cu_seqlens_c, cu_seqlens_t)
        return self.head(h)
