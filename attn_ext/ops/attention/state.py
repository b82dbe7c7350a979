"""Attention states: cross attention that absorbs, merges and forgets keys (docs/spec.md §1, CMANP §3.1).

A state ``(out, lse)`` is the exact attention of fixed queries over a set of keys. Because softmax
attention over a union of disjoint key sets is a log-sum-exp-weighted average of the parts, a state
can be updated with new keys in O(new keys), merged with another state (associative, commutative,
identity ``empty_state``), streamed from an iterator in constant memory, and have keys removed
again. Every function is differentiable; gradients equal those of one ``cross_attention`` over the
union (docs/spec.md §1 backward).
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.attention.chunked import named_cross_attention
from attn_ext.ops.attention.errors import named_after
from attn_ext.ops.attention.registration import MERGE_STATES
from attn_ext.ops.attention.scaled_dot_product import attention_by_position, scaled_dot_product_attention, window_sides
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.dtypes import accumulation_dtype

DEFAULT_MIN_REMAINING = 1e-2


class AttentionState(NamedTuple):
    """Exact attention of queries over a key set: ``out [B, H, M, Dv]`` and ``lse [B, H, M]``."""

    out: Tensor
    lse: Tensor


def empty_state(q: Tensor, dv: int) -> AttentionState:
    """The state of no keys (out 0, lse −inf): the identity of :func:`merge_states`.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> st = ae.empty_state(torch.randn(1, 2, 3, 8), dv=5)
    >>> st.out.shape, bool(torch.isinf(st.lse).all())
    (torch.Size([1, 2, 3, 5]), True)
    """
    if q.dim() != 4:
        raise ValueError(f"attn_ext.empty_state: q must be [B, H, M, D], got {tuple(q.shape)}")
    B, H, M, _ = q.shape
    out = q.new_zeros((B, H, M, dv))
    lse = torch.full((B, H, M), -math.inf, dtype=accumulation_dtype(q.dtype), device=q.device)
    return AttentionState(out, lse)


class Positions(NamedTuple):
    """Where a state's queries and keys sit in their sequence, for the causal rule and a sliding window: query
    ``i`` at ``query_start + i``, key ``j`` at ``key_start + j``; key ``j`` takes part for query ``i`` only if
    ``qpos − left ≤ kpos ≤ qpos + right`` (``window_size = (left, right)``, ``-1``: no limit on that side;
    ``is_causal`` sets ``right = 0``)."""

    is_causal: bool = False
    window_size: Optional[Tuple[int, int]] = None
    query_start: int = 0
    key_start: int = 0

    @property
    def banded(self) -> bool:
        return self.is_causal or self.window_size is not None

    def checked(self, op: str) -> "Positions":
        if not isinstance(self.is_causal, bool):
            raise TypeError(f"attn_ext.{op}: is_causal must be a bool, got {type(self.is_causal).__name__}")
        for name, value in (("query_start", self.query_start), ("key_start", self.key_start)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"attn_ext.{op}: {name} must be an int (a position in the sequence), got {value!r}")
        with named_after(op):
            window_sides(self.window_size, "top_left", self.is_causal)
        return self


def attention_state(
    q: Tensor, k: Tensor, v: Tensor, *, key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
    scale: Optional[float] = None, chunk_size: Optional[int] = None, backend: Optional[str] = None,
    is_causal: bool = False, window_size: Optional[Tuple[int, int]] = None, query_start: int = 0, key_start: int = 0,
) -> AttentionState:
    """The state of ``q`` over the keys ``k, v``: :func:`attn_ext.cross_attention` with its LSE.

    ``attn_mask`` (optional) is a per-pair mask of these keys, broadcastable to ``[B, H, M, N]``, with
    :func:`attn_ext.scaled_dot_product_attention`'s convention (bool: **True = takes part**; float:
    added to the scores), next to ``key_padding_mask`` (True = padding). A row for which no key takes
    part is the empty state (0, −inf), so masked states merge like any other.

    ``is_causal`` and ``window_size = (left, right)`` restrict each query to the keys near it by position, with
    query ``i`` at ``query_start + i`` and key ``j`` at ``key_start + j`` of one sequence: key ``j`` takes part
    only if ``qpos − left ≤ kpos ≤ qpos + right`` (``-1``: no limit on that side; ``is_causal``: ``right = 0``).
    A state built chunk by chunk passes each chunk's ``key_start`` (:func:`stream_attention` counts them).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    >>> # the last 4 positions of a 100-key sequence, each seeing itself and the 15 keys before it
    >>> st = ae.attention_state(q, k[:, :, :60], v[:, :, :60], window_size=(15, 0), query_start=96)
    >>> st = ae.update_state(st, q, k[:, :, 60:], v[:, :, 60:], window_size=(15, 0), query_start=96, key_start=60)
    >>> ref = ae.scaled_dot_product_attention(q, k, v, window_size=(15, 0), alignment="bottom_right")
    >>> bool(torch.allclose(st.out, ref, atol=1e-6))
    True
    """
    return named_attention_state("attention_state", q, k, v, key_padding_mask, attn_mask, scale, chunk_size, backend,
                                 Positions(is_causal, window_size, query_start, key_start))


def named_attention_state(op: str, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          attn_mask: Optional[Tensor], scale: Optional[float], chunk_size: Optional[int],
                          backend: Optional[str], positions: Positions = Positions()) -> AttentionState:
    """:func:`attention_state`, its argument errors named after ``op``, the public op that was called."""
    positions.checked(op)
    if attn_mask is None and not positions.banded:
        return AttentionState(*named_cross_attention(op, q, k, v, key_padding_mask, scale, chunk_size, backend))
    with named_after(op):
        if positions.banded:
            out, lse = attention_by_position(q, k, v, diagonal=positions.query_start - positions.key_start,
                                             attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                             is_causal=positions.is_causal, window_size=positions.window_size,
                                             scale=scale, chunk_size=chunk_size, backend=backend)
        else:
            out, lse = scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                                    scale=scale, chunk_size=chunk_size, return_lse=True,
                                                    backend=backend)
    return AttentionState(out, lse)


def _check_state(op: str, state: AttentionState, name: str = "state") -> None:
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"attn_ext.{op}: {name} must be an AttentionState(out, lse), got {type(state).__name__}")
    out, lse = state
    if out.dim() < 1 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(f"attn_ext.{op}: {name} has out {tuple(out.shape)} and lse {tuple(lse.shape)}; "
                         "lse must be out.shape[:-1]")
    if lse.dtype != accumulation_dtype(out.dtype):
        raise TypeError(f"attn_ext.{op}: {name}.lse must be {accumulation_dtype(out.dtype)} for {out.dtype} out, "
                        f"got {lse.dtype}")


def _merge_pair(op: str, a: AttentionState, b: AttentionState, backend: Optional[str]) -> AttentionState:
    """The state of the union of ``a``'s and ``b``'s keys; a mismatch raises naming ``op``."""
    if tuple(a.out.shape) != tuple(b.out.shape) or a.out.dtype != b.out.dtype or a.out.device != b.out.device:
        raise ValueError(f"attn_ext.{op}: cannot merge states with out {tuple(a.out.shape)} {a.out.dtype} "
                         f"{a.out.device} and {tuple(b.out.shape)} {b.out.dtype} {b.out.device}")
    name = dispatch.select_backend(MERGE_STATES, backend, a.out)
    out, lse = dispatch.entry(MERGE_STATES, name)(a.out, a.lse, b.out, b.lse)
    return AttentionState(out, lse)


def merge_states(
    a: Union[AttentionState, Sequence[AttentionState]], b: Optional[AttentionState] = None, *,
    backend: Optional[str] = None,
) -> AttentionState:
    """Merge states of the same queries over disjoint key sets into the state of their union.

    ``merge_states(a, b)`` or ``merge_states([s1, s2, ...])`` (merged as a balanced tree, so the
    rounding error grows with log of the count). Exact, commutative and associative; fused kernel
    per backend.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    >>> parts = [ae.attention_state(q, k[:, :, i:i + 10], v[:, :, i:i + 10]) for i in (0, 10, 20)]
    >>> merged = ae.merge_states(parts)
    >>> bool(torch.allclose(merged.out, ae.cross_attention(q, k, v), atol=1e-6))
    True
    """
    states = list(a) if b is None and isinstance(a, (list, tuple)) and not isinstance(a, AttentionState) else [a, b]
    if not states or any(s is None for s in states):
        raise ValueError("attn_ext.merge_states: needs two states or a non-empty sequence of states")
    for i, s in enumerate(states):
        _check_state("merge_states", s, f"state {i}")
    states = [AttentionState(*s) for s in states]  # plain (out, lse) tuples too, as update_state takes
    while len(states) > 1:
        pairs = [_merge_pair("merge_states", states[i], states[i + 1], backend) for i in range(0, len(states) - 1, 2)]
        states = pairs + ([states[-1]] if len(states) % 2 else [])
    return AttentionState(*states[0])


def update_state(
    state: AttentionState, q: Tensor, k_new: Tensor, v_new: Tensor, *, key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None, scale: Optional[float] = None, chunk_size: Optional[int] = None,
    backend: Optional[str] = None, is_causal: bool = False, window_size: Optional[Tuple[int, int]] = None,
    query_start: int = 0, key_start: int = 0,
) -> AttentionState:
    """Add keys to a state in O(new keys · M): the UPDATE of the CMANP paper (§3.1.1).

    ``state`` must be the state of the same ``q`` (and ``scale``) over keys disjoint from ``k_new``.
    ``attn_mask``: the new keys' per-pair mask; ``is_causal``, ``window_size``, ``query_start`` and
    ``key_start`` (the new keys' first position): as in :func:`attention_state`.
    """
    _check_state("update_state", state)
    new = named_attention_state("update_state", q, k_new, v_new, key_padding_mask, attn_mask, scale, chunk_size,
                                backend, Positions(is_causal, window_size, query_start, key_start))
    return _merge_pair("update_state", AttentionState(*state), new, backend)


def remove_from_state(
    state: AttentionState, q: Tensor, k_old: Tensor, v_old: Tensor, *, key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None, scale: Optional[float] = None, min_remaining: float = DEFAULT_MIN_REMAINING,
    chunk_size: Optional[int] = None, backend: Optional[str] = None, is_causal: bool = False,
    window_size: Optional[Tuple[int, int]] = None, query_start: int = 0, key_start: int = 0,
) -> AttentionState:
    """Remove keys from a state (downdate): the inverse of :func:`update_state`.

    With ``r = exp(lse_R − lse)`` the share of the softmax mass held by the removed keys,
    ``lse' = lse + log1p(−r)`` and ``out' = (out − r·out_R) / (1 − r)``. Division by ``1 − r``
    amplifies rounding errors by ``1/(1 − r)``, so rows whose remaining mass ``1 − r`` would fall
    below ``min_remaining`` (default 1e-2: at most 100× the rounding error of the state) raise a
    ``ValueError`` instead of returning cancelled garbage; removing every key of a row always does.

    The keys must have been added to ``state`` before (with the same ``q`` and ``scale``): the
    function cannot tell, and removing keys that were never added returns a meaningless state.
    ``attn_mask`` and the positions (``is_causal``, ``window_size``, ``query_start``, ``key_start``) must be
    those the keys were added with.
    NaN cannot be removed: a NaN row of ``state`` or of the removed keys' state stays NaN.
    """
    _check_state("remove_from_state", state)
    if not (0.0 < min_remaining <= 1.0):
        raise ValueError(f"attn_ext.remove_from_state: min_remaining must be in (0, 1], got {min_remaining}")
    removed = named_attention_state("remove_from_state", q, k_old, v_old, key_padding_mask, attn_mask, scale,
                                    chunk_size, backend, Positions(is_causal, window_size, query_start, key_start))
    out, lse = state
    # Only the empty marker −inf means "nothing removed": a NaN removed state (NaN keys) must not
    # pass the row through as if nothing had happened, and a NaN share makes the result NaN.
    removes_something = removed.lse != -math.inf
    # r = 0 where nothing is removed, so those rows (including empty ones) pass through unchanged;
    # the −inf entries are replaced before subtracting so that no NaN reaches the backward pass.
    zero = torch.zeros_like(lse)
    share = torch.where(
        removes_something,
        torch.exp(torch.where(removes_something, removed.lse, zero) - torch.where(removes_something, lse, zero)),
        zero,
    )
    remaining = 1.0 - share
    too_little = removes_something & (remaining < min_remaining)
    if bool(too_little.any()):
        worst = float(remaining.detach()[too_little].min())
        raise ValueError(
            f"attn_ext.remove_from_state: would leave {worst:.3g} of the softmax mass in {int(too_little.sum())} "
            f"row(s) (min_remaining={min_remaining}); the result would be dominated by cancellation. Recompute the "
            "state from the remaining keys instead."
        )
    acc = accumulation_dtype(out.dtype)
    new_out = (out.to(acc) - share[..., None] * removed.out.to(acc)) / remaining[..., None]
    new_lse = lse + torch.log1p(-share)
    return AttentionState(new_out.to(out.dtype), new_lse)


ChunkLike = Union[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor, Optional[Tensor]],
                  Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]]


def stream_attention(
    q: Tensor, chunks: Iterable[ChunkLike], *, scale: Optional[float] = None, chunk_size: Optional[int] = None,
    backend: Optional[str] = None, is_causal: bool = False, window_size: Optional[Tuple[int, int]] = None,
    query_start: int = 0,
) -> AttentionState:
    """Attention of ``q`` over keys delivered by an iterator, holding only the state and one chunk.

    ``chunks`` yields ``(k, v)``, ``(k, v, key_padding_mask)`` or ``(k, v, key_padding_mask, attn_mask)``
    (the chunk's per-pair mask, as in :func:`attention_state`); peak memory is that of one chunk
    plus the state, however many chunks come (CMANP §3.1.2). Differentiable, but under autograd
    each chunk's inputs stay alive for the backward pass like any other saved tensor.

    ``is_causal`` and ``window_size`` as in :func:`attention_state`, the keys counted from position 0 in the
    order they come and the queries at ``query_start + i`` (the cpp and reference kernels skip the key tiles
    outside every query's band, so a chunk no band reaches costs next to nothing).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q = torch.randn(1, 2, 4, 8)
    >>> kv = [(torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)) for _ in range(4)]
    >>> st = ae.stream_attention(q, iter(kv))
    >>> k, v = torch.cat([c[0] for c in kv], 2), torch.cat([c[1] for c in kv], 2)
    >>> bool(torch.allclose(st.out, ae.cross_attention(q, k, v), atol=1e-6))
    True
    """
    positions = Positions(is_causal, window_size, query_start).checked("stream_attention")
    state: Optional[AttentionState] = None
    # No enumerate(): it keeps its last (index, chunk) tuple, and so the previous chunk, alive while
    # the iterator makes the next one, which doubles the peak memory.
    i, key_start = -1, 0
    for chunk in chunks:
        i += 1
        if not isinstance(chunk, (tuple, list)) or len(chunk) not in (2, 3, 4):
            raise TypeError(f"attn_ext.stream_attention: chunk {i} must be (k, v), (k, v, key_padding_mask) or "
                            "(k, v, key_padding_mask, attn_mask)")
        k, v = chunk[0], chunk[1]
        mask = chunk[2] if len(chunk) >= 3 else None
        pair_mask = chunk[3] if len(chunk) == 4 else None
        here = positions._replace(key_start=key_start)
        key_start += k.shape[-2]
        new = named_attention_state("stream_attention", q, k, v, mask, pair_mask, scale, chunk_size, backend, here)
        state = new if state is None else _merge_pair("stream_attention", state, new, backend)
        # Drop this chunk before the iterator makes the next one, so at most one chunk is alive.
        del chunk, k, v, mask, pair_mask, new
    if state is None:
        raise ValueError("attn_ext.stream_attention: got no chunks; the value dim Dv is unknown (use empty_state)")
    return state
