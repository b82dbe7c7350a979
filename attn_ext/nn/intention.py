"""The Intention module (Garnelo & Czarnecki, docs/spec.md §4): the ridge map from keys to values, read at the queries.

Two forms: ``"linear"`` (the default, unchanged: single linear embeddings, ``e_w`` a linear layer on
the merged output) and ``"paper"`` (the paper's Definition 3.1: MLP embeddings and ``e_w`` applied to
the fitted map). The Informer layer and stack are in :mod:`attn_ext.nn.informer`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attn_ext.ops.intention as intention_ops
from attn_ext.nn.intention_parts import ContextRidge, HeadwiseMLP, mlp
from attn_ext.ops.intention import IntentionState

FORMS = ("linear", "paper")
_PAPER_ONLY = ("embed_depth", "map_depth", "embed_hidden_dim", "out_proj")


def _inverse_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class Intention(nn.Module):
    """Multi-head (σ)Intention with learned embeddings and a positive ridge ``α``.

    ``form="linear"`` (default): ``e_w[Q̂ (K̂ᵀK̂ + αI)⁻¹ K̂ᵀV̂]`` per head, ``Q̂ = e_Q(query)`` etc.
    single linear layers and ``e_w`` a linear layer on the concatenated heads. ``form="paper"``: the paper's
    Definition 3.1 (eq. 3), ``h = E_Q · e_w[(E_KᵀE_K + αI)⁻¹ E_KᵀE_V]`` per head with MLP embeddings
    ``E_Q = e_Q(query)`` etc. and ``e_w`` an MLP (own weights per head) applied to every row of the
    fitted map ``w [D, Dv]``, i.e. in value space; the heads are then concatenated (and, with
    ``out_proj``, mixed by one more linear layer, as in the paper's Informer appendix).

    The keys and values enter only through the per-head statistics ``K̂ᵀK̂`` and ``K̂ᵀV̂``, so the
    module conditions on a context in memory independent of its size and supports exact updates,
    merges and removals (:meth:`condition`, :meth:`update`, :meth:`remove`, :meth:`query`).

    Parameters
    ----------
    dim : int
        Model width (queries and output); split into ``num_heads`` heads.
    num_heads : int
        Default 1 (the paper's definition is one head).
    alpha_init : float
        Initial ridge ``α > 0`` (the same for every head).
    learn_alpha : bool
        Learn one ``α`` per head, parameterised as ``softplus(raw)`` so that it stays positive;
        otherwise ``α`` is a fixed buffer.
    sigma : bool
        σIntention: ``softmax(Q̂ (K̂ᵀK̂ + αI)⁻¹ K̂ᵀ) V̂`` (then :meth:`condition` and friends are not
        available: the softmax needs the keys). It forms no map, so with ``form="paper"`` it needs
        ``map_depth=0``.
    kdim, vdim : int, optional
        Widths of the keys and values (default ``dim``).
    query_scale : float
        Multiplies the queries (default 1; the paper's App. 9 suggests ``sqrt(head_dim)`` in deep
        stacks). In the paper form it multiplies the map before ``e_w`` (``e_w(scale·w)``): the same
        thing when ``e_w`` is the identity, and where it normalises what ``e_w`` sees otherwise.
    backend : str, optional
        Kernel backend, as for :func:`attn_ext.intention`.
    form : {"linear", "paper"}
        See above. The default stays ``"linear"`` because existing models (``IntentionNP``) and
        their checkpoints are built on it.
    embed_depth : int, optional
        ``form="paper"`` only: linear layers of each of ``e_Q``, ``e_K``, ``e_V`` (ReLU between;
        default 2, the paper's experiments' two-layer MLPs).
    map_depth : int, optional
        ``form="paper"`` only: linear layers of ``e_w`` (ReLU between, hidden width ``head_dim``;
        default 2; ``0`` leaves the map as it is, which σIntention requires).
    embed_hidden_dim : int, optional
        ``form="paper"`` only: hidden width of the embedding MLPs (default ``dim``).
    out_proj : bool, optional
        ``form="paper"`` only: one more linear layer after the heads are concatenated (default False).
    alpha_from_context : bool
        Compute ``α [B, H]`` from the embedded keys and values by a small network on top of the
        per-head base ``softplus(raw)`` (:class:`~attn_ext.nn.intention_parts.ContextRidge`):
        positive, independent of the keys' order, padding keys left out.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> layer = ae.nn.Intention(32, 4)
    >>> x, ctx = torch.randn(2, 5, 32), torch.randn(2, 100, 32)
    >>> out = layer(x, ctx, ctx)
    >>> state = layer.update(layer.condition(ctx[:, :60], ctx[:, :60]), ctx[:, 60:], ctx[:, 60:])
    >>> bool(torch.allclose(layer.query(x, state), out, atol=1e-4))
    True
    >>> paper = ae.nn.Intention(32, 4, form="paper", alpha_from_context=True)
    >>> paper(x, ctx, ctx).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, num_heads: int = 1, alpha_init: float = 1.0, learn_alpha: bool = True,
                 sigma: bool = False, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 query_scale: float = 1.0, backend: Optional[str] = None, *, form: str = "linear",
                 embed_depth: Optional[int] = None, map_depth: Optional[int] = None,
                 embed_hidden_dim: Optional[int] = None, out_proj: Optional[bool] = None,
                 alpha_from_context: bool = False) -> None:
        super().__init__()
        if dim <= 0 or num_heads <= 0 or dim % num_heads:
            raise ValueError(f"dim={dim} must be a positive multiple of num_heads={num_heads}")
        if not (math.isfinite(alpha_init) and alpha_init > 0):
            raise ValueError(f"alpha_init must be a finite float > 0, got {alpha_init!r}")
        if form not in FORMS:
            raise ValueError(f"Intention: unknown form {form!r}; choose one of {', '.join(FORMS)}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.kdim, self.vdim = kdim or dim, vdim or dim
        self.sigma, self.query_scale, self.backend, self.form = sigma, float(query_scale), backend, form
        given = {"embed_depth": embed_depth, "map_depth": map_depth, "embed_hidden_dim": embed_hidden_dim,
                 "out_proj": out_proj}
        self.e_w_on_map: Optional[HeadwiseMLP] = None
        self.out_proj: Optional[nn.Linear] = None
        if form == "linear":
            named = [name for name in _PAPER_ONLY if given[name] is not None]
            if named:
                raise ValueError(f"Intention(form='linear') has single linear embeddings and e_w on the output; "
                                 f"{', '.join(named)} belong to form='paper'")
            # The construction order is today's: seeded models and their checkpoints stay the same.
            self.e_q = nn.Linear(dim, dim)
            self.e_k = nn.Linear(self.kdim, dim)
            self.e_v = nn.Linear(self.vdim, dim)
            self.e_w = nn.Linear(dim, dim)
        else:
            self._build_paper_form(embed_depth, map_depth, embed_hidden_dim, out_proj)
        raw = torch.full((num_heads,), _inverse_softplus(float(alpha_init)))
        if learn_alpha:
            self.raw_alpha = nn.Parameter(raw)
        else:
            self.register_buffer("raw_alpha", raw)
        self.context_ridge = ContextRidge(self.head_dim, self.head_dim) if alpha_from_context else None

    def _build_paper_form(self, embed_depth, map_depth, embed_hidden_dim, out_proj) -> None:
        embed_depth = 2 if embed_depth is None else int(embed_depth)
        map_depth = 2 if map_depth is None else int(map_depth)
        hidden = embed_hidden_dim or self.dim
        if embed_depth < 1 or map_depth < 0 or hidden <= 0:
            raise ValueError(f"Intention(form='paper'): need embed_depth >= 1, map_depth >= 0 and "
                             f"embed_hidden_dim > 0, got {embed_depth}, {map_depth}, {hidden}")
        if self.sigma and map_depth:
            raise ValueError("Intention(form='paper', sigma=True): σIntention forms no map for e_w to act on; "
                             "pass map_depth=0 (and out_proj=True for a learned output layer)")
        self.e_q = mlp(self.dim, hidden, self.dim, embed_depth)
        self.e_k = mlp(self.kdim, hidden, self.dim, embed_depth)
        self.e_v = mlp(self.vdim, hidden, self.dim, embed_depth)
        if map_depth:
            self.e_w_on_map = HeadwiseMLP(self.num_heads, self.head_dim, self.head_dim, self.head_dim, map_depth)
        if out_proj:
            self.out_proj = nn.Linear(self.dim, self.dim)

    @property
    def alpha(self) -> Tensor:
        """``[num_heads]`` ridge per head (positive); with ``alpha_from_context`` the base the network adds to."""
        return F.softplus(self.raw_alpha)

    def context_alpha(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """The ridge ``α`` this module uses for a context: ``[B, num_heads]`` (``[num_heads]`` unless
        ``alpha_from_context``)."""
        self._check_keys("context_alpha", key, value, key_padding_mask)
        return self._ridge_for_keys(self._heads(self.e_k(key)), self._heads(self.e_v(value)), key_padding_mask)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """``[B, M, dim]`` from ``query [B, M, dim]``, ``key [B, N, kdim]``, ``value [B, N, vdim]``."""
        self._check_query("forward", query, key.shape[0] if isinstance(key, Tensor) else None)
        self._check_keys("forward", key, value, key_padding_mask)
        q, k, v = self._heads(self.e_q(query)), self._heads(self.e_k(key)), self._heads(self.e_v(value))
        alpha = self._ridge_for_keys(k, v, key_padding_mask).to(q.dtype)
        if self.e_w_on_map is not None:  # the paper form: fit the map, transform it, read it at the queries
            eye = torch.eye(self.head_dim, dtype=k.dtype, device=k.device).expand(*k.shape[:2], -1, -1)
            # The fused ridge op at identity queries returns the map itself, scale·(K̂ᵀK̂ + αI)⁻¹K̂ᵀV̂,
            # with its Gram/Cholesky kernel and backward (no explicit inverse formed in PyTorch).
            w = intention_ops.intention(eye, k, v, alpha=alpha, key_padding_mask=key_padding_mask,
                                        scale=self.query_scale, backend=self.backend)
            return self._read_map(q, w)
        fn = intention_ops.sigma_intention if self.sigma else intention_ops.intention
        out = fn(q, k, v, alpha=alpha, key_padding_mask=key_padding_mask, scale=self.query_scale,
                 backend=self.backend)
        return self._merge(out)

    def condition(self, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """Per-head statistics of a context (or of a first chunk of it)."""
        self._no_sigma("condition")
        self._check_keys("condition", key, value, key_padding_mask)
        return intention_ops.intention_state(self._heads(self.e_k(key)), self._heads(self.e_v(value)),
                                             key_padding_mask=key_padding_mask)

    def update(self, state: IntentionState, key: Tensor, value: Tensor,
               key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """``state`` with new context points added: cost independent of the points seen before."""
        return intention_ops.merge_intention_states(state, self.condition(key, value, key_padding_mask))

    def remove(self, state: IntentionState, key: Tensor, value: Tensor,
               key_padding_mask: Optional[Tensor] = None) -> IntentionState:
        """``state`` with context points that were added before taken out again."""
        self._no_sigma("remove")
        self._check_keys("remove", key, value, key_padding_mask)
        return intention_ops.remove_from_intention_state(state, self._heads(self.e_k(key)),
                                                         self._heads(self.e_v(value)),
                                                         key_padding_mask=key_padding_mask)

    def query(self, query: Tensor, state: IntentionState) -> Tensor:
        """The module's output for ``query`` against the context summarised by ``state``."""
        self._no_sigma("query")
        self._check_query("query", query, state.gram.shape[0])
        q = self._heads(self.e_q(query))
        alpha = self._ridge_for_state(state).to(state.gram.dtype)
        if self.e_w_on_map is not None:
            eye = torch.eye(self.head_dim, dtype=q.dtype, device=q.device).expand(*state.gram.shape[:2], -1, -1)
            w = intention_ops.intention_from_state(eye, state, alpha=alpha, scale=self.query_scale)
            return self._read_map(q, w)
        out = intention_ops.intention_from_state(q, state, alpha=alpha, scale=self.query_scale)
        return self._merge(out)

    # -- pieces ------------------------------------------------------------------------------------

    def _heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def _concat(self, x: Tensor) -> Tensor:
        B, H, L, Dh = x.shape
        return x.transpose(1, 2).reshape(B, L, H * Dh)

    def _merge(self, x: Tensor) -> Tensor:
        """Heads of an Intention output concatenated, then the output layer of the form."""
        if self.form == "linear":
            return self.e_w(self._concat(x))
        out = self._concat(x)
        return out if self.out_proj is None else self.out_proj(out)

    def _read_map(self, q: Tensor, w: Tensor) -> Tensor:
        """``E_Q · e_w(w)`` per head (``w [B, H, D, D]``), heads merged."""
        return self._merge(q @ self.e_w_on_map(w))

    def _ridge_for_keys(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        if self.context_ridge is None:
            return self.alpha
        return self.context_ridge(self.raw_alpha, *ContextRidge.sums_over_keys(k, v, key_padding_mask))

    def _ridge_for_state(self, state: IntentionState) -> Tensor:
        if self.context_ridge is None:
            return self.alpha
        # diag(KᵀK) = Σ k², diag(KᵀV) = Σ k·v: the same features as the forward pass computes
        return self.context_ridge(self.raw_alpha, state.gram.diagonal(dim1=-2, dim2=-1),
                                  state.kv.diagonal(dim1=-2, dim2=-1), state.count)

    def _no_sigma(self, what: str) -> None:
        if self.sigma:
            raise RuntimeError(f"Intention(sigma=True).{what}: σIntention needs the keys themselves, not statistics")

    def _check_query(self, what: str, query, batch: Optional[int]) -> None:
        if not isinstance(query, Tensor) or query.dim() != 3 or query.shape[-1] != self.dim or (
                batch is not None and query.shape[0] != batch):
            raise ValueError(f"Intention.{what}: query must be [B, M, {self.dim}] with the keys' B={batch}, "
                             f"got {tuple(getattr(query, 'shape', ()))}")

    def _check_keys(self, what: str, key, value, key_padding_mask) -> None:
        shapes = f"key {tuple(getattr(key, 'shape', ()))}, value {tuple(getattr(value, 'shape', ()))}"
        if not (isinstance(key, Tensor) and isinstance(value, Tensor) and key.dim() == 3 and value.dim() == 3
                and key.shape[-1] == self.kdim and value.shape[-1] == self.vdim and key.shape[:2] == value.shape[:2]):
            raise ValueError(f"Intention.{what}: need key [B, N, {self.kdim}] and value [B, N, {self.vdim}] "
                             f"with the same B and N, got {shapes}")
        if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                             or tuple(key_padding_mask.shape) != tuple(key.shape[:2])):
            raise ValueError(f"Intention.{what}: key_padding_mask must be bool [B, N] = {list(key.shape[:2])}, "
                             f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)} ({shapes})")
