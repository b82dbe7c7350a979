"""``CMAB``: the Constant Memory Attention Block of CMANP (Feng et al., §3.2; docs/spec.md §2).

``CMAB(L_I, D) = SA(CA(L_I, SA(CA(L_B, D))))``. Only the first cross attention, ``CA(L_B, D)``, sees
the context, and its queries are the block's own learned latents ``L_B``, fixed whatever the
context is. Its attention state therefore summarises the context in constant size and absorbs or
forgets context points in O(points) (:mod:`attn_ext.ops.attention.state`); everything after it works on
``num_latents`` tokens. The context is layer-normed per token, so an update only touches new tokens.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Type

import torch
from torch import Tensor, nn

from attn_ext.nn.latents import learned_latents
from attn_ext.nn.prenorm_block import PreNormBlock
from attn_ext.ops.attention.state import DEFAULT_MIN_REMAINING, AttentionState
from attn_ext.ops.utils.validation import is_int_scalar


class CMABState(NamedTuple):
    """What a :class:`CMAB` keeps of its context: the per-head state of ``CA(L_B, D)``.

    ``attention.out [B, H, num_latents, dim / H]`` and ``attention.lse [B, H, num_latents]``;
    the size does not depend on the number of context points.
    """

    attention: AttentionState


class CMAB(nn.Module):
    """Constant Memory Attention Block: ``CMAB(L_I, D) = SA(CA(L_I, SA(CA(L_B, D))))``.

    Four residual attention blocks, by default pre-norm (LayerNorm → attention → residual, LayerNorm
    → Linear(dim, ff_dim) → ReLU → Linear(ff_dim, dim) → residual), all on :class:`MultiheadCrossAttention`. ``L_B`` is a
    learned ``[num_latents, dim]`` parameter, so ``CA(L_B, D)`` has fixed queries: its attention
    state (a :class:`CMABState`, constant size in ``|D|``) supports :meth:`update` and :meth:`remove`
    of context points in O(points), and :meth:`output` finishes the block from the state in constant
    memory. ``forward(latents, context) == output(init_state(context), latents)``.

    Parameters
    ----------
    dim : int
        Width of latents and context tokens (embed the context to ``dim`` first).
    num_latents : int
        ``|L_B|``, the number of block latents summarising the context.
    num_heads : int
        Heads of every attention (must divide ``dim``).
    ff_dim : int
        Hidden width of the feed-forward layers.
    chunk_size : int, optional
        Keys per chunk of the fused attention kernel (default: the kernel's).
    block : type, optional
        The class of the four blocks: :class:`~attn_ext.nn.PreNormBlock` (default) or a subclass,
        e.g. :class:`~attn_ext.nn.PerceiverBlock`, the official CMANP code's.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> block = ae.nn.CMAB(dim=32, num_latents=16, num_heads=4, ff_dim=64)
    >>> latents, context = torch.randn(2, 8, 32), torch.randn(2, 100, 32)
    >>> out = block(latents, context)
    >>> out.shape
    torch.Size([2, 8, 32])
    >>> state = block.init_state(context[:, :90])
    >>> state = block.update(state, context[:, 90:])          # O(10 points), not O(100)
    >>> bool(torch.allclose(block.output(state, latents), out, atol=1e-5))
    True
    >>> state.attention.out.shape                               # independent of the context size
    torch.Size([2, 4, 16, 8])
    """

    def __init__(self, dim: int, num_latents: int, num_heads: int, ff_dim: int, *,
                 chunk_size: Optional[int] = None, block: Type[PreNormBlock] = PreNormBlock) -> None:
        super().__init__()
        if num_latents <= 0 or ff_dim <= 0:
            raise ValueError(f"num_latents and ff_dim must be positive, got {num_latents}, {ff_dim}")
        self.dim, self.num_latents, self.num_heads, self.ff_dim = dim, num_latents, num_heads, ff_dim
        self.latents = learned_latents(num_latents, dim)
        self.compress = block(dim, num_heads, ff_dim, cross=True)        # CA(L_B, D)
        self.latent_self = block(dim, num_heads, ff_dim, cross=False)    # SA(·) -> L_B'
        self.cross = block(dim, num_heads, ff_dim, cross=True)           # CA(L_I, L_B')
        self.output_self = block(dim, num_heads, ff_dim, cross=False)    # SA(·) -> L_I'
        for block in (self.compress, self.latent_self, self.cross, self.output_self):
            block.attention.chunk_size = chunk_size

    # ------------------------------------------------------------------------------------------

    def _check_context(self, context: Tensor, mask: Optional[Tensor], name: str) -> None:
        if not isinstance(context, Tensor) or context.dim() != 3 or context.shape[-1] != self.dim:
            shape = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
            raise ValueError(f"attn_ext.nn.CMAB: {name} must be [B, N, {self.dim}], got {shape}")
        if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool):
            raise TypeError(f"attn_ext.nn.CMAB: the mask of {name} must be a bool tensor [B, N] (True = padding)")

    def _block_queries(self, batch: int) -> Tensor:
        """``LN(L_B)`` broadcast over the batch ``[B, num_latents, dim]`` (a view: no copy per item)."""
        return self.compress.norm_query(self.latents).expand(batch, -1, -1)

    def _keys(self, context: Tensor) -> Tensor:
        return self.compress.norm_context(context)

    # ------------------------------------------------------------------------------------------

    def init_state(self, context: Tensor, context_mask: Optional[Tensor] = None, *,
                   chunk_size: Optional[int] = None) -> CMABState:
        """Summarise ``context [B, N, dim]`` (bool ``context_mask [B, N]``, True = padding).

        With ``chunk_size``, the context is normalised and projected ``chunk_size`` tokens at a
        time and streamed into the state, so besides the context itself only one chunk's keys and
        values are held at once (without autograd; under autograd each chunk is kept for backward).
        """
        self._check_context(context, context_mask, "context")
        attention = self.compress.attention
        queries = self._block_queries(context.shape[0])
        if chunk_size is None:
            keys = self._keys(context)
            return CMABState(attention.state(queries, keys, keys, context_mask))
        if not is_int_scalar(chunk_size) or chunk_size <= 0:
            raise ValueError(f"attn_ext.nn.CMAB: chunk_size must be a positive int, got {chunk_size!r}")
        chunk_size = int(chunk_size)  # NumPy integers too
        if context.shape[1] == 0:
            return CMABState(attention.empty_state(queries))

        def chunks():
            for start in range(0, context.shape[1], chunk_size):
                keys = self._keys(context[:, start:start + chunk_size])
                mask = None if context_mask is None else context_mask[:, start:start + chunk_size]
                yield keys, keys, mask

        return CMABState(attention.stream(queries, chunks()))

    def update(self, state: CMABState, new_context: Tensor, new_mask: Optional[Tensor] = None) -> CMABState:
        """Add context points ``new_context [B, N_new, dim]``: cost O(N_new · num_latents), whatever
        the size of the context already in ``state``."""
        self._check_context(new_context, new_mask, "new_context")
        keys = self._keys(new_context)
        queries = self._block_queries(new_context.shape[0])
        return CMABState(self.compress.attention.update(state.attention, queries, keys, keys, new_mask))

    def remove(self, state: CMABState, old_context: Tensor, old_mask: Optional[Tensor] = None, *,
               min_remaining: float = DEFAULT_MIN_REMAINING) -> CMABState:
        """Remove context points that were added before (the caller's responsibility: points never
        added give a meaningless state). Raises ``ValueError`` where less than ``min_remaining`` of a
        latent's softmax mass would remain (see :func:`attn_ext.remove_from_state`)."""
        self._check_context(old_context, old_mask, "old_context")
        keys = self._keys(old_context)
        queries = self._block_queries(old_context.shape[0])
        return CMABState(self.compress.attention.remove(state.attention, queries, keys, keys, old_mask,
                                                        min_remaining=min_remaining))

    def output(self, state: CMABState, latents: Tensor) -> Tensor:
        """``CMAB(latents, D)`` for the context ``D`` summarised by ``state``: ``[B, L_I, dim]``.

        ``latents`` is ``[B, L_I, dim]`` or ``[L_I, dim]`` (shared by the batch, e.g. the learned
        ``L_0`` of the first block of a stack). Memory and time are independent of ``|D|``.
        """
        if not isinstance(state, tuple) or len(state) != 1:
            raise TypeError(f"attn_ext.nn.CMAB: state must be a CMABState, got {type(state).__name__}")
        batch = state.attention.out.shape[0]
        if latents.dim() == 2:
            latents = latents.expand(batch, -1, -1)
        if latents.dim() != 3 or latents.shape[0] != batch or latents.shape[-1] != self.dim:
            raise ValueError(f"attn_ext.nn.CMAB: latents must be [{batch}, L_I, {self.dim}] or [L_I, {self.dim}] "
                             f"for a state of batch {batch}, got {tuple(latents.shape)}")
        # The block finishes CA(L_B, D) from its attention output as its forward would.
        compressed = self.compress.finish(self.latents, self.compress.norm_query(self.latents),
                                          self.compress.attention.query(state.attention))
        compressed = self.latent_self(compressed)
        return self.output_self(self.cross(latents, compressed))

    def packed(self, latents: Tensor, cu_seqlens_latents: Tensor, context: Tensor, cu_seqlens_context: Tensor) -> Tensor:
        """``CMAB(latents, D)`` of each task of a packed batch: ``latents [T_l, dim]`` and ``context [T_c, dim]``
        packed by task (int32 offsets ``[B + 1]``, the layout of :func:`attn_ext.varlen_attention`); returns
        ``[T_l, dim]``, row for row what :meth:`forward` gives each task alone (its exact attention over its own
        context: no state, no padding)."""
        tasks = cu_seqlens_context.numel() - 1
        cu_block = torch.arange(tasks + 1, dtype=torch.int32, device=cu_seqlens_context.device) * self.num_latents
        compressed = self.compress.packed(self.latents.repeat(tasks, 1), cu_block, context, cu_seqlens_context)
        compressed = self.latent_self.packed(compressed, cu_block)
        return self.output_self.packed(self.cross.packed(latents, cu_seqlens_latents, compressed, cu_block),
                                       cu_seqlens_latents)

    def forward(self, latents: Tensor, context: Tensor, context_mask: Optional[Tensor] = None) -> Tensor:
        """``CMAB(latents, context)``: ``latents [B, L_I, dim]`` (or ``[L_I, dim]``), ``context
        [B, N, dim]``, bool ``context_mask [B, N]`` with True = padding; returns ``[B, L_I, dim]``."""
        return self.output(self.init_state(context, context_mask), latents)
