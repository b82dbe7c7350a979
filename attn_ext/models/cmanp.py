"""CMANP (Feng et al., §3.2; docs/spec.md §2): stacked CMABs over the embedded context, conditioned, updated
and queried through constant-size attention states."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points, mlp
from attn_ext.models.layers import CLONED_STACKS, LatentDecoder, block_class, layer_stack, packed_latents
from attn_ext.nn import CMAB, CMABState
from attn_ext.nn.latents import learned_latents
from attn_ext.ops.attention.state import DEFAULT_MIN_REMAINING
from attn_ext.ops.utils.validation import is_int_scalar

#: Context points embedded at a time when ``config.chunk_size`` is None. Conditioning, updating and
#: removing then hold one chunk's embedding at a time: peak memory flat in N_c (with all points at once it grew
#: linearly, 12 MB at N_c = 1e4 to 1 GB at 1e6), while chunks this long keep the per-chunk overhead small.
DEFAULT_CHUNK_SIZE = 1024


class CMANPState(NamedTuple):
    """The context summary of a CMANP: one :class:`attn_ext.nn.CMABState` per block, each
    ``[B, num_heads, num_latents, d_model / num_heads]`` (plus its LSE) whatever ``N_c`` is."""

    blocks: Tuple[CMABState, ...]


class CMANP(NeuralProcess):
    """Constant Memory Attentive Neural Process.

    Conditioning (:meth:`condition`) embeds the context ``chunk_size`` points at a time and streams
    each chunk into the attention state of every CMAB's ``CA(L_B, D)``; :meth:`update` absorbs new
    points in O(new points); :meth:`query` rebuilds the latents ``L_i = CMAB_i(L_{i−1}, D)`` from
    the states and decodes ``X^i = CA(X^{i−1}, L_i)``. Peak memory is independent of ``N_c``
    (beyond the raw context passed in) and linear in ``N_t``.

    Parameters
    ----------
    config : NPConfig, optional
        Sizes (docs/spec.md §2 defaults: 6 CMABs of 128 latents); keyword overrides on top.
    block : {"prenorm", "perceiver", "official"}
        The attention blocks, as :class:`~attn_ext.models.LBANP`'s: ``"perceiver"`` is the official
        code's structure (:class:`~attn_ext.nn.PerceiverBlock`, an ``x``-only target embedder);
        ``"official"`` adds its projections and its layers copied from one (CMABs with their ``L_B``).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import CMANP
    >>> model = CMANP(num_layers=2, num_latents=8, chunk_size=4).eval()
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> state = model.condition(xc[:, :6], yc[:, :6])
    >>> state = model.update(state, xc[:, 6:], yc[:, 6:])
    >>> full = model.predict(xc, yc, xt)
    >>> bool(torch.allclose(model.query(state, xt).mean, full.mean, atol=1e-5))
    True
    """

    def __init__(self, config: Optional[NPConfig] = None, *, block: str = "prenorm", **overrides) -> None:
        super().__init__(config, **overrides)
        c, Block, self.block = self.config, block_class(type(self).__name__, block), block
        # L_0, the first block's input latents L_I; each later block takes the previous output.
        self.latents = learned_latents(c.num_latents, c.d_model)
        cloned = block in CLONED_STACKS
        self.blocks = layer_stack(lambda: CMAB(c.d_model, c.num_latents, c.num_heads, c.ff_dim, block=Block),
                                  c.num_layers, cloned=cloned)
        self.decoder = LatentDecoder(c.num_layers, c.d_model, c.num_heads, c.ff_dim, block=Block, cloned=cloned)
        if block != "prenorm":
            self.query_embedder = mlp(c.dim_x, c.d_model, c.d_model, c.emb_depth)
        self.head = self.make_head()

    def options(self) -> dict:
        """``block`` (what ``python -m bench train gp --block`` sets in the repository's harness)."""
        return {"block": self.block}

    def make_head(self) -> nn.Module:
        c = self.config
        return GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    # -- conditioning, updating, querying --------------------------------------------------------

    def condition(self, xc: Tensor, yc: Tensor, chunk_size: Optional[int] = None) -> CMANPState:
        """Summarise the context ``xc [B, N_c, dim_x]``, ``yc [B, N_c, dim_y]``, ``chunk_size``
        points at a time (default ``config.chunk_size``, else :data:`DEFAULT_CHUNK_SIZE`): the peak
        memory does not grow with ``N_c``."""
        check_points(self, xc=xc, yc=yc)
        chunk = chunk_size or self._chunk_size()
        if not is_int_scalar(chunk) or chunk <= 0:
            raise ValueError(f"CMANP: chunk_size must be a positive int, got {chunk_size!r}")
        chunk = int(chunk)
        if xc.shape[1] == 0:
            raise ValueError(f"CMANP: the context must have at least one point, got xc {tuple(xc.shape)}")
        states = list(self._first_chunk(xc[:, :chunk], yc[:, :chunk]).blocks)
        for start in range(chunk, xc.shape[1], chunk):
            self._absorb(states, xc[:, start:start + chunk], yc[:, start:start + chunk])
        return CMANPState(tuple(states))

    def update(self, state: CMANPState, x_new: Tensor, y_new: Tensor) -> CMANPState:
        """``state`` with the points ``(x_new, y_new)`` added; cost O(new points), whatever ``N_c``."""
        check_points(self, x_new=x_new, y_new=y_new)
        return self._change_in_chunks(state, x_new, y_new)

    def remove(self, state: CMANPState, x_old: Tensor, y_old: Tensor, *,
               min_remaining: float = DEFAULT_MIN_REMAINING) -> CMANPState:
        """``state`` without the points ``(x_old, y_old)``, which must have been added before; cost
        O(removed points). ``ValueError`` where less than ``min_remaining`` of a latent's softmax mass
        would remain (:func:`attn_ext.remove_from_state`: too little left to downdate exactly)."""
        check_points(self, x_old=x_old, y_old=y_old)
        return self._change_in_chunks(state, x_old, y_old,
                                      lambda block, s, emb: block.remove(s, emb, min_remaining=min_remaining))

    def _change_in_chunks(self, state: CMANPState, x: Tensor, y: Tensor, change=None) -> CMANPState:
        """``state`` with the points ``(x, y)`` taken chunk by chunk, as :meth:`_absorb` takes them."""
        self._check_state(state, x.shape[0])
        chunk, states = self._chunk_size(), list(state.blocks)
        for start in range(0, x.shape[1], chunk):
            self._absorb(states, x[:, start:start + chunk], y[:, start:start + chunk], change)
        return CMANPState(tuple(states))

    def _chunk_size(self) -> int:
        return self.config.chunk_size or DEFAULT_CHUNK_SIZE

    def _first_chunk(self, x: Tensor, y: Tensor) -> CMANPState:
        # A method of its own so that the chunk's embedding is freed before the next chunk is embedded.
        emb = self.embed_pairs(x, y)
        return CMANPState(tuple(block.init_state(emb) for block in self.blocks))

    def _absorb(self, states: List[CMABState], x: Tensor, y: Tensor, change=None) -> None:
        """Update ``states`` in place with the points ``(x, y)`` (``change``: how a block's state takes
        them, default adding them): each block's old state is dropped as soon as its new one exists,
        so at most one block holds two states at a time (old and new states of all blocks together
        would make the peak depend on whether the context needed more than one chunk)."""
        emb = self.embed_pairs(x, y)
        for i, block in enumerate(self.blocks):
            states[i] = block.update(states[i], emb) if change is None else change(block, states[i], emb)

    def _check_state(self, state: CMANPState, batch: int) -> None:
        if not isinstance(state, CMANPState) or len(state.blocks) != len(self.blocks):
            raise TypeError(f"{type(self).__name__}: state must be a CMANPState of {len(self.blocks)} blocks "
                            "from condition()")
        got = state.blocks[0].attention.out.shape[0]
        if got != batch:
            raise ValueError(f"{type(self).__name__}: state has batch {got}, the new points {batch}")

    def latent_sets(self, state: CMANPState) -> List[Tensor]:
        """``[L_1, …, L_K]``, each ``[B, num_latents, d_model]``, from the block states."""
        latent, out = self.latents, []
        for block, s in zip(self.blocks, state.blocks):
            latent = block.output(s, latent)
            out.append(latent)
        return out

    def decode(self, state: CMANPState, xt: Tensor) -> Tensor:
        """Target features ``[B, N_t, d_model]`` after the query phase."""
        check_points(self, xt=xt)
        self._check_state(state, xt.shape[0])
        return self.decoder(self.embed_targets(xt), self.latent_sets(state))

    def query(self, state: CMANPState, xt: Tensor) -> Normal:
        """Predictive ``Normal`` at ``xt [B, N_t, dim_x]`` given the context summarised by ``state``."""
        return self.head(self.decode(state, xt))

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        check_points(self, xc=xc, yc=yc, xt=xt)
        return self.query(self.condition(xc, yc), xt)

    def predict_packed(self, xc: Tensor, yc: Tensor, xt: Tensor, cu_seqlens_c: Tensor, cu_seqlens_t: Tensor) -> Normal:
        """Predictive ``Normal`` over the packed targets ``[T_t, dim_y]`` of tasks packed end to end (the layout of
        :class:`~attn_ext.data.PackedNPBatch`): each CMAB attends over each task's own context
        (:meth:`attn_ext.nn.CMAB.packed`, exact, no state formed), the targets over their task's latents; per
        task, what :meth:`predict` gives it alone. Every task needs a context point, as :meth:`condition` does."""
        empty = (cu_seqlens_c.diff() <= 0).nonzero()
        if empty.numel():
            raise ValueError(f"{type(self).__name__}: every task of a packed batch needs a context point; task "
                             f"{int(empty[0])} has none")
        context = self.embed_pairs(xc, yc)
        latent, cu_latents = packed_latents(self.latents, cu_seqlens_c)
        latents = []
        for block in self.blocks:
            latent = block.packed(latent, cu_latents, context, cu_seqlens_c)
            latents.append(latent)
        return self.head(self.decoder.packed(self.embed_targets(xt), cu_seqlens_t, latents, cu_latents))
