"""``MultiheadAttention``: ``torch.nn.MultiheadAttention`` on the fused kernels, with an incremental path.

Same constructor, defaults, parameter names, shapes and initialisation as ``torch.nn.MultiheadAttention``
(so ``load_state_dict`` works both ways) and the same ``forward`` semantics. The attention runs on
:func:`attn_ext.scaled_dot_product_attention` (masks, causal, dropout) or, without any of those, on
:func:`attn_ext.attention_state` — neither forms the ``[L, S]`` score matrix. Only ``need_weights=True``
forms it, because the weights *are* that matrix.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from attn_ext.nn import mha_inputs
from attn_ext.nn.mha_incremental import IncrementalPath
from attn_ext.nn.mha_packed import PackedPath
from attn_ext.nn.rebuild import rebuilt_as, why_not_swappable
from attn_ext.ops.attention import scaled_dot_product_attention


class MultiheadAttention(IncrementalPath, PackedPath, nn.Module):
    """A drop-in for ``torch.nn.MultiheadAttention`` computed by attn_ext's fused, exact kernels.

    Identical constructor arguments (order and defaults), parameters (``in_proj_weight`` or
    ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``) and
    initialisation, so a checkpoint of one loads into the other; ``forward(query, key, value,
    key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
    is_causal=False)`` takes what torch's takes — batched (``batch_first`` or not) or unbatched
    inputs, self or cross attention, ``kdim``/``vdim``, bool (True = may **not** attend) or float
    (additive) ``attn_mask`` ``[L, S]`` or ``[B * num_heads, L, S]`` and ``key_padding_mask``
    ``[B, S]``, ``add_bias_kv``, ``add_zero_attn``, attention dropout in training mode, an
    ``in_proj_bias`` of another float dtype (added in the query's dtype, as torch) — and gives torch's
    outputs and gradients (equal in fp64).

    How each call runs:

    * ``need_weights=False`` (what ``nn.TransformerEncoderLayer`` and ``DecoderLayer`` pass): on
      :func:`attn_ext.scaled_dot_product_attention`, which never forms the ``[L, S]`` matrix; a
      ``[L, S]`` mask is read in place, dropout uses the op's counter-based generator (reproducible
      under ``torch.manual_seed``, not torch's random stream);
    * ``is_causal=True``, torch's rule: with no ``key_padding_mask`` and ``need_weights=False`` the
      hint replaces ``attn_mask`` (not read, of any shape; upper-left causal over the keys and the
      extra ones; key chunks above the diagonal are skipped); otherwise the mask is read, not the hint;
    * ``need_weights=True`` (torch's default): computed the plain way, as PyTorch's own slow path
      does (score matrix, softmax, ``torch.nn.functional.dropout``, weights ``[B, L, S]`` averaged
      over heads or ``[B, num_heads, L, S]``), so pass ``need_weights=False`` whenever the weights
      are not used;
    * a float ``attn_mask`` that requires grad also takes the plain way (the fused op gives no mask
      gradient).

    Differences from ``torch.nn.MultiheadAttention``:

    * a query with no attended key (all masked) gives a zero attention vector, i.e. ``out_proj.bias``,
      zero weights and zero gradients, where torch gives NaN with ``need_weights=True`` and on its
      inference fast path (its ``need_weights=False`` path, SDPA, gives the same zeros);
    * torch's inference fast path (eval, no gradient, batch-first self attention, bool masks) reads
      ``attn_mask`` under ``is_causal`` too; this module answers as torch's other path does;
    * shape errors raise ``ValueError`` (torch: ``AssertionError``), mask dtype errors and inputs of
      another dtype than their projection weight ``TypeError``;
    * an ``in_proj_bias`` of another dtype runs in every layout (torch: batch-first batched calls only);
    * ``torch.jit.script`` refuses it by name (its forward dispatches in Python): use ``torch.compile``;
    * nested tensors are not accepted (torch's inference fast path takes them);
    * ``nn.TransformerEncoderLayer``'s inference fast path (evaluation mode, no gradient) reads
      this module's weights and runs PyTorch's own fused layer instead of calling it — as it does
      for ``torch.nn.MultiheadAttention`` (:meth:`merge_masks` is there for it).

    The incremental path keeps the per-head attention state *before* ``out_proj``:
    :meth:`state`, :meth:`update`, :meth:`remove`, :meth:`stream` and :meth:`query`, with
    ``forward(q, k, v)[0] == query(state(q, k, v))`` for a bool ``key_padding_mask`` and no
    ``attn_mask``; it takes batched inputs and refuses dropout in training, ``add_bias_kv`` and
    ``add_zero_attn``.

    Parameters
    ----------
    embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        As in ``torch.nn.MultiheadAttention``.
    chunk_size : int, optional
        Keyword only: keys per chunk of the fused kernels.
    backend : str, optional
        Keyword only: kernel backend (``"cpp"``, ``"triton"``, ``"reference"``; default automatic).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> torch_mha = torch.nn.MultiheadAttention(32, 4)
    >>> mha = ae.nn.MultiheadAttention(32, 4)
    >>> _ = mha.load_state_dict(torch_mha.state_dict())
    >>> x = torch.randn(10, 2, 32)                                   # [L, B, E]: batch_first=False
    >>> causal = torch.nn.Transformer.generate_square_subsequent_mask(10)
    >>> out, _ = mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    >>> expected, _ = torch_mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    >>> bool(torch.allclose(out, expected, atol=1e-5))
    True
    >>> out, weights = mha(x, x, x, attn_mask=causal)                # need_weights=True: weights [B, L, S]
    >>> weights.shape, bool(torch.allclose(out, expected, atol=1e-5))
    (torch.Size([2, 10, 10]), True)
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        chunk_size: Optional[int] = None,
        backend: Optional[str] = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive, got embed_dim={embed_dim}, num_heads={num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        # The attribute names are torch's: code that inspects an nn.MultiheadAttention reads them.
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.chunk_size = chunk_size
        self.backend = backend

        # Created in torch's order, so that the same seed gives the same parameters as torch's module.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, chunk_size: Optional[int] = None,
                   backend: Optional[str] = None) -> "MultiheadAttention":
        """The drop-in for one ``torch.nn.MultiheadAttention``, holding that module's own parameters and
        ``out_proj`` (shared, not copied) and its training mode; see :func:`attn_ext.nn.swap_attention`."""
        reason = why_not_swappable(module)
        if reason is not None:
            raise ValueError(f"attn_ext.nn.swap_attention: cannot replace this module: it {reason}")
        return rebuilt_as(cls, module, "attn_ext.nn.swap_attention", chunk_size=chunk_size, backend=backend)

    # torch's TransformerEncoderLayer calls it on its inference fast path; it only reads num_heads.
    merge_masks = nn.MultiheadAttention.merge_masks

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module it compiles, first: refusing here names this module.
        raise RuntimeError(
            f"attn_ext.nn.{type(self).__name__}: TorchScript (torch.jit.script) is not supported: its forward "
            "validates its inputs and chooses among attn_ext's kernel backends in Python, which TorchScript cannot "
            "compile. Use torch.compile instead, or keep torch.nn.MultiheadAttention (do not swap_attention) in a "
            "model that must be scripted")

    # ------------------------------------------------------------------------------------------
    # torch.nn.MultiheadAttention interface
    # ------------------------------------------------------------------------------------------

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Attention of ``query`` over ``key, value``: ``(out, weights)`` as ``torch.nn.MultiheadAttention``.

        ``query [B, L, E]``, ``key [B, S, kdim]``, ``value [B, S, vdim]`` (``[L, B, ·]`` if not
        ``batch_first``) or unbatched ``[L, E]``, ``[S, kdim]``, ``[S, vdim]``; ``key_padding_mask``
        ``[B, S]`` (``[S]``), bool (True = padding) or float (added); ``attn_mask`` ``[L, S]`` or
        ``[B * num_heads, L, S]`` (``[num_heads, L, S]``), bool (True = may not attend) or float;
        ``is_causal`` is a hint that ``attn_mask`` is the causal mask (which must be given, as in
        torch). ``weights`` is None unless ``need_weights``: then ``[B, L, S]`` averaged over heads
        (``average_attn_weights``) or ``[B, num_heads, L, S]`` (S counting the extra keys).
        """
        # torch's rule (F.multi_head_attention_forward): the hint replaces attn_mask (not read, of any
        # shape) without key_padding_mask and need_weights; otherwise the mask is read, not the hint.
        causal_hint = bool(is_causal) and key_padding_mask is None and not need_weights
        batched = mha_inputs.check_inputs(self, query, key, value, key_padding_mask, attn_mask,
                                          mask_read=not causal_hint)
        if is_causal and attn_mask is None:
            raise RuntimeError("attn_ext.nn.MultiheadAttention: is_causal=True is a hint that attn_mask is the causal "
                               "mask and needs attn_mask (as in torch); build it with "
                               "torch.nn.Transformer.generate_square_subsequent_mask(L)")
        if causal_hint:
            attn_mask = None
        key_padding_mask = mha_inputs.as_bool_padding(key_padding_mask)
        dropout_p = self.dropout if self.training else 0.0
        padding_is_bool = key_padding_mask is None or key_padding_mask.dtype == torch.bool
        mask_needs_grad = torch.is_grad_enabled() and any(
            m is not None and m.requires_grad for m in (attn_mask, key_padding_mask))
        plain = need_weights or dropout_p >= 1.0 or mask_needs_grad
        if (not plain and not causal_hint and attn_mask is None and padding_is_bool and dropout_p == 0.0
                and mha_inputs.extra_keys(self) == 0):
            # The state path: what the incremental methods compute (and where they can be observed).
            if not batched:
                query, key, value, key_padding_mask = self._batch_of_one(query, key, value, key_padding_mask)
            out = self.query(self.state(query, key, value, key_padding_mask))
            return (out if batched else out.squeeze(0 if self.batch_first else 1)), None

        seq_first = batched and not self.batch_first
        if not batched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif seq_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        p = mha_inputs.prepare(self, query, key, value, key_padding_mask, attn_mask, causal_hint)
        weights = None
        if plain:
            out, weights = mha_inputs.plain_attention(p, dropout_p)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not need_weights:
                weights = None
            elif not batched:
                weights = weights.squeeze(0)
        else:
            out = scaled_dot_product_attention(
                p.q, p.k, p.v, attn_mask=p.attn_mask, dropout_p=dropout_p, is_causal=p.is_causal,
                key_padding_mask=p.key_padding_mask, chunk_size=self.chunk_size, backend=self.backend)
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        out = out.squeeze(0) if not batched else (out.transpose(0, 1) if seq_first else out)
        return out, weights

    def _batch_of_one(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor]):
        """Unbatched ``[L, E]``, ``[S, kdim]``, ``[S, vdim]``, mask ``[S]`` as a batch of one in the module layout."""
        batch_dim = 0 if self.batch_first else 1
        mask = key_padding_mask.unsqueeze(0) if isinstance(key_padding_mask, Tensor) else key_padding_mask
        return query.unsqueeze(batch_dim), key.unsqueeze(batch_dim), value.unsqueeze(batch_dim), mask

    # ------------------------------------------------------------------------------------------
    # Projections between the module layout [B, L, E] and the kernel layout [B, H, L, E/H]
    # ------------------------------------------------------------------------------------------

    def _projection_weights(self) -> Tuple[Tuple[Tensor, Tensor, Tensor], Tuple[Optional[Tensor], ...]]:
        if self._qkv_same_embed_dim:
            weights = tuple(self.in_proj_weight.chunk(3))
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None, None, None) if self.in_proj_bias is None else tuple(self.in_proj_bias.chunk(3))
        return weights, biases

    def _to_batch_first(self, x: Tensor, name: str, width: int) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != width:
            seq = "L" if name == "query" else "S"
            layout = f"[B, {seq}, {width}]" if self.batch_first else f"[{seq}, B, {width}]"
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"attn_ext.nn: {name} must be {layout} (batch_first={self.batch_first}); got {shape}")
        return x if self.batch_first else x.transpose(0, 1)

    def _split_heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _heads_q(self, query: Tensor) -> Tensor:
        """Projected queries ``[B, H, L, E/H]`` of ``query`` in the module layout."""
        (w_q, _, _), (b_q, _, _) = self._projection_weights()
        return self._split_heads(mha_inputs.project(self._to_batch_first(query, "query", self.embed_dim), w_q, b_q))

    def _heads_kv(self, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor]:
        """Projected keys and values ``[B, H, S, E/H]`` of ``key, value`` in the module layout."""
        (_, w_k, w_v), (_, b_k, b_v) = self._projection_weights()
        key = self._to_batch_first(key, "key", self.kdim)
        value = self._to_batch_first(value, "value", self.vdim)
        if key.shape[:2] != value.shape[:2]:
            raise ValueError(f"attn_ext.nn: key {tuple(key.shape)} and value {tuple(value.shape)} must have the same "
                             "batch and sequence sizes (batch_first layout)")
        return (self._split_heads(mha_inputs.project(key, w_k, b_k)),
                self._split_heads(mha_inputs.project(value, w_v, b_v)))

    def _merge_heads(self, out: Tensor) -> Tensor:
        merged = self.out_proj(out.transpose(1, 2).flatten(2))
        return merged if self.batch_first else merged.transpose(0, 1)
