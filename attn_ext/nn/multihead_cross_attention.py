"""``MultiheadCrossAttention``: the earlier name of :class:`attn_ext.nn.MultiheadAttention`, with its defaults.

Kept so that code written for it runs unchanged: it is :class:`~attn_ext.nn.MultiheadAttention`
with two defaults of its own, ``batch_first=True`` and ``need_weights=False``. Changing either would
silently change what an existing call computes (the layout it reads, or a ``[B, L, S]`` weight
matrix formed on every call), so new code should use ``MultiheadAttention``, whose defaults are
torch's.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from attn_ext.nn.multihead_attention import MultiheadAttention


class MultiheadCrossAttention(MultiheadAttention):
    """:class:`~attn_ext.nn.MultiheadAttention` with ``batch_first=True`` and ``need_weights=False``
    as defaults (this module's defaults before it became a full ``torch.nn.MultiheadAttention``).

    Everything else — parameters, state dicts, masks, dropout, the incremental path — is
    ``MultiheadAttention``'s. To be equivalent to ``torch.nn.MultiheadAttention(..., batch_first=True)``
    it needs ``need_weights=True`` where torch's call relies on its default.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> torch_mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    >>> mha = ae.nn.MultiheadCrossAttention(32, 4)
    >>> _ = mha.load_state_dict(torch_mha.state_dict())
    >>> q, kv = torch.randn(2, 5, 32), torch.randn(2, 100, 32)
    >>> out, weights = mha(q, kv, kv)
    >>> expected, _ = torch_mha(q, kv, kv, need_weights=False)
    >>> bool(torch.allclose(out, expected, atol=1e-5)), weights
    (True, None)
    >>> state = mha.state(q, kv[:, :60], kv[:, :60])
    >>> state = mha.update(state, q, kv[:, 60:], kv[:, 60:])
    >>> bool(torch.allclose(mha.query(state), out, atol=1e-5))
    True
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = True, device=None, dtype=None, *,
                 chunk_size: Optional[int] = None, backend: Optional[str] = None) -> None:
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                         device, dtype, chunk_size=chunk_size, backend=backend)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """:meth:`MultiheadAttention.forward <attn_ext.nn.MultiheadAttention.forward>` with ``need_weights=False``
        by default."""
        return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                               is_causal)
