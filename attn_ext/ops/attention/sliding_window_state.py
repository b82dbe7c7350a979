"""``attn_ext.SlidingWindowState``: the exact attention of fixed queries over the last ``W`` keys of an endless
stream, in memory O(W) and time O(chunk) per new chunk.

The keys that have left the window are never *subtracted* from a state (:func:`~attn_ext.remove_from_state` is
ill-conditioned as the removed share of the weight nears 1): the window is kept as a ring of per-chunk states,
each the exact state of its chunk's keys (with the chunk's keys and values, W rows in all), and merged at query
time (:func:`~attn_ext.merge_states`, a balanced tree). A chunk partly out of the window is cut to its rows still
inside and its state recomputed from them: O(chunk) work.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, NamedTuple, Optional

from torch import Tensor

from attn_ext.ops.attention.state import AttentionState, attention_state, empty_state, merge_states

__all__ = ["SlidingWindowState"]

_OP = "attn_ext.SlidingWindowState"


class _Chunk(NamedTuple):
    k: Tensor  # [B, H, n, D]
    v: Tensor  # [B, H, n, Dv]
    padding: Optional[Tensor]  # [B, n], True = padding
    state: AttentionState


class SlidingWindowState:
    """The attention of ``q`` over the last ``window`` keys given to :meth:`update`.

    Parameters
    ----------
    q : Tensor
        ``[B, H, M, D]``: the fixed queries.
    window : int
        Keys (rows of the stream, padded ones included) the window holds, ``>= 1``.
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    dv : int, optional
        The values' width, for :attr:`out` before any key arrived (default: ``D``).
    backend : str, optional
        As for :func:`attn_ext.cross_attention`.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q = torch.randn(1, 2, 3, 8)
    >>> s = ae.SlidingWindowState(q, window=50)
    >>> keys, values = torch.randn(1, 2, 130, 8), torch.randn(1, 2, 130, 8)
    >>> for i in range(0, 130, 20):
    ...     _ = s.update(keys[:, :, i:i + 20], values[:, :, i:i + 20])
    >>> bool(torch.allclose(s.out, ae.cross_attention(q, keys[:, :, -50:], values[:, :, -50:]), atol=1e-6))
    True
    """

    def __init__(self, q: Tensor, window: int, *, scale: Optional[float] = None, dv: Optional[int] = None,
                 backend: Optional[str] = None) -> None:
        if not isinstance(q, Tensor) or q.dim() != 4:
            raise ValueError(f"{_OP}: q must be a [B, H, M, D] tensor, got "
                             f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{_OP}: window must be a number of keys >= 1, got {window!r}")
        self.q, self.window, self.scale, self.backend = q, window, scale, backend
        self._dv = q.shape[-1] if dv is None else int(dv)
        self._chunks: Deque[_Chunk] = deque()
        self._rows = 0  # keys in the window
        self._merged: Optional[AttentionState] = None

    def _state(self, k: Tensor, v: Tensor, padding: Optional[Tensor]) -> AttentionState:
        return attention_state(self.q, k, v, key_padding_mask=padding, scale=self.scale, backend=self.backend)

    def update(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None) -> "SlidingWindowState":
        """Append the keys ``k [B, H, n, D]``, ``v [B, H, n, Dv]`` (``key_padding_mask [B, n]``, True = padding) to the
        stream, and drop the keys that leave the window. Returns ``self``."""
        if k.dim() != 4 or k.shape[:2] != self.q.shape[:2] or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"{_OP}.update: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, H, n, ·] with "
                             f"(B, H) = {tuple(self.q.shape[:2])} of q")
        if self._chunks and v.shape[-1] != self._chunks[0].v.shape[-1]:
            raise ValueError(f"{_OP}.update: the values' width changed from {self._chunks[0].v.shape[-1]} to "
                             f"{v.shape[-1]}")
        n = k.shape[2]
        if n == 0:
            return self
        if n > self.window:  # only the last `window` rows can ever be seen
            k, v = k[:, :, n - self.window:], v[:, :, n - self.window:]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[:, n - self.window:]
            n = self.window
        self._chunks.append(_Chunk(k, v, key_padding_mask, self._state(k, v, key_padding_mask)))
        self._rows += n
        while self._rows > self.window:
            oldest = self._chunks.popleft()
            excess = self._rows - self.window
            kept = oldest.k.shape[2] - excess
            self._rows -= min(excess, oldest.k.shape[2])
            if kept > 0:  # the oldest chunk's last rows stay: its state recomputed from them, never subtracted
                k_kept, v_kept = oldest.k[:, :, excess:], oldest.v[:, :, excess:]
                pad = None if oldest.padding is None else oldest.padding[:, excess:]
                self._chunks.appendleft(_Chunk(k_kept, v_kept, pad, self._state(k_kept, v_kept, pad)))
        self._merged = None
        return self

    @property
    def state(self) -> AttentionState:
        """The ``(out, lse)`` state of the queries over the window's keys (merged once per update)."""
        if self._merged is None:
            if not self._chunks:
                self._merged = empty_state(self.q, self._dv)
            else:
                self._merged = merge_states([c.state for c in self._chunks], backend=self.backend)
        return self._merged

    @property
    def out(self) -> Tensor:
        """``[B, H, M, Dv]``: the attention over the window's keys (0 before any key)."""
        return self.state.out

    @property
    def lse(self) -> Tensor:
        """``[B, H, M]``: its log-sum-exp (−inf before any key)."""
        return self.state.lse

    @property
    def keys_in_window(self) -> int:
        """How many rows of the stream the window holds now (at most ``window``)."""
        return self._rows

    def __repr__(self) -> str:
        return (f"SlidingWindowState(window={self.window}, keys_in_window={self._rows}, chunks={len(self._chunks)}, "
                f"q={tuple(self.q.shape)})")
