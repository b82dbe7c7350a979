"""``torch.nn.MultiheadAttention``'s inputs in the convention of :func:`attn_ext.scaled_dot_product_attention`.

``torch.nn.MultiheadAttention`` takes bool masks where **True means "may not attend"** and
``scaled_dot_product_attention`` takes bool masks where **True means "takes part"**; a float mask is
additive in both. This module checks the shapes as torch does (raising ``ValueError`` with the shapes
instead of ``AssertionError``), appends the ``add_bias_kv`` / ``add_zero_attn`` keys, and converts
the masks, so that the module itself only routes.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

_WHO = "attn_ext.nn.MultiheadAttention"


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def check_inputs(module, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                 attn_mask: Optional[Tensor], mask_read: bool = True) -> bool:
    """torch's shape rules for ``forward``; returns whether the call is batched (``query`` 3-D).

    ``mask_read=False``: ``attn_mask`` will not be read (torch's causal hint replaces it), so, as in
    torch, only its dtype and number of dims are checked (and, for an unbatched query, a 3-D one's shape).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_WHO}: {name} must be a tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(f"{_WHO}: nested tensors are not supported ({name}); pass a padded tensor with a "
                             "key_padding_mask (for nn.TransformerEncoder: enable_nested_tensor=False)")
    if query.dim() not in (2, 3):
        raise ValueError(f"{_WHO}: query must be unbatched [L, E] or batched 3-D, got {_shape(query)}")
    batched = query.dim() == 3
    seq_first = batched and not module.batch_first
    layout = ("[L, B, {}]" if seq_first else "[B, L, {}]") if batched else "[L, {}]"
    kv_layout = layout.replace("L", "S")
    for name, t, width, form in (("query", query, module.embed_dim, layout), ("key", key, module.kdim, kv_layout),
                                 ("value", value, module.vdim, kv_layout)):
        if t.dim() != query.dim() or t.shape[-1] != width:
            raise ValueError(f"{_WHO}: {name} must be {form.format(width)} (batch_first={module.batch_first}, "
                             f"{'batched' if batched else 'unbatched'} query {_shape(query)}), got {_shape(t)}")
    if not torch.is_autocast_enabled(query.device.type):  # autocast casts both sides itself
        for name, t, weight in zip(("query", "key", "value"), (query, key, value), module._projection_weights()[0]):
            if t.dtype != weight.dtype:
                raise TypeError(f"{_WHO}: {name} is {t.dtype} but its projection weight is {weight.dtype} (torch "
                                f"refuses this too); pass {weight.dtype} inputs or convert the module with "
                                f".to({t.dtype}). Only in_proj_bias may have another float dtype")
    batch = (1 if seq_first else 0) if batched else None
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"{_WHO}: key {_shape(key)} and value {_shape(value)} must agree in every dim but the last")
    if batched and key.shape[batch] != query.shape[batch]:
        raise ValueError(f"{_WHO}: query {_shape(query)} and key {_shape(key)} have different batch sizes")
    B = query.shape[batch] if batched else None
    L = query.shape[0 if batch != 0 else 1]
    S = key.shape[0 if batch != 0 else 1]
    if key_padding_mask is not None:
        expected = (B, S) if batched else (S,)
        _check_mask_dtype("key_padding_mask", key_padding_mask)
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(f"{_WHO}: key_padding_mask must be None or {list(expected)} (True = padding) for "
                             f"query {_shape(query)} and key {_shape(key)}, got {_shape(key_padding_mask)}")
    if attn_mask is not None:
        _check_mask_dtype("attn_mask", attn_mask)
        heads = module.num_heads * (B if batched else 1)
        if not mask_read:
            # torch's _mha_shape_check still looks at a mask it will not read: its number of dims, and
            # the whole shape of an unbatched query's 3-D mask.
            if attn_mask.dim() not in (2, 3):
                raise ValueError(f"{_WHO}: attn_mask must be 2-D or 3-D, got {_shape(attn_mask)}")
            mask_read = not batched and attn_mask.dim() == 3
        if mask_read and tuple(attn_mask.shape) not in ((L, S), (heads, L, S)):
            three = f"[{'B * num_heads' if batched else 'num_heads'} = {heads}, {L}, {S}]"
            raise ValueError(f"{_WHO}: attn_mask must be [L, S] = [{L}, {S}] or {three}, got {_shape(attn_mask)}")
    return batched


def _check_mask_dtype(name: str, mask) -> None:
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{_WHO}: {name} must be a bool tensor (True = may not attend, as in "
                        f"torch.nn.MultiheadAttention) or a float tensor (added to the scores), got {got}")


def _may_carry_derivative(t: Tensor) -> bool:
    if t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None


def as_bool_padding(key_padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """A float ``key_padding_mask`` holding only 0 and -inf as the equivalent bool mask (True = padding).

    ``nn.TransformerEncoder`` and ``nn.TransformerEncoderLayer`` turn a bool padding mask into such a
    float one before calling their attention; kept float, it would rule out the causal hint and the
    op's per-key padding (a float one has to be added to the scores as a mask). Finding out reads the
    mask (a device sync on GPU), so it is skipped under ``torch.compile``, where it would break the
    graph, and for a mask that carries a derivative (requires grad, a forward-mode tangent, or a
    ``torch.func`` wrapper): the bool mask would drop it, since the scores depend on the 0 entries too.
    The result is the same either way.
    """
    if (key_padding_mask is None or key_padding_mask.dtype == torch.bool or _may_carry_derivative(key_padding_mask)
            or torch.compiler.is_compiling()):
        return key_padding_mask
    padding = key_padding_mask == float("-inf")
    return padding if bool(((key_padding_mask == 0) | padding).all()) else key_padding_mask


class Prepared(NamedTuple):
    """Projected heads and masks in the functional op's convention.

    ``attn_mask``: None, bool broadcastable to ``[B, H, L, S]`` with True = takes part, or float
    additive in the query's dtype. ``key_padding_mask``: None or bool ``[B, S]``, True = padding.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Optional[Tensor]
    key_padding_mask: Optional[Tensor]
    is_causal: bool


def extra_keys(module) -> int:
    """How many keys ``add_bias_kv`` and ``add_zero_attn`` append."""
    return int(module.bias_k is not None) + int(bool(module.add_zero_attn))


def project(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x Wᵀ + b`` in ``x``'s dtype for a ``bias`` of any float dtype, as torch's module computes it.

    ``F.linear`` refuses a bias of another dtype than ``x`` and ``W``; torch's MultiheadAttention adds
    such an ``in_proj_bias`` in place (``(x Wᵀ).add_(b)``: the sum in the wider dtype, rounded once to
    ``x``'s) wherever its input is not contiguous, and that is what is computed here for every layout
    (out of place, so that torch.func transforms apply).
    """
    if bias is None or bias.dtype == x.dtype:
        return F.linear(x, weight, bias)
    y = F.linear(x, weight)
    wide = torch.promote_types(y.dtype, bias.dtype)
    return (y.to(wide) + bias.to(wide)).to(y.dtype)


def prepare(module, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
            attn_mask: Optional[Tensor], causal_hint: bool) -> Prepared:
    """Batch-first 3-D inputs (``[B, L, E]``, ``[B, S, kdim]``, ``[B, S, vdim]``, masks as torch takes
    them with B explicit) -> per-head tensors ``[B, H, ·, E/H]`` and converted masks.

    ``causal_hint``: the call is causal by torch's hint (``attn_mask`` is then None, unread): queries
    attend the keys up to their own position, upper-left aligned over the keys including the extra ones
    of ``add_bias_kv`` / ``add_zero_attn``, as torch's scaled_dot_product_attention(is_causal=True).
    """
    B, L, _ = query.shape
    (w_q, w_k, w_v), (b_q, b_k, b_v) = module._projection_weights()
    q, k, v = project(query, w_q, b_q), project(key, w_k, b_k), project(value, w_v, b_v)
    extra = extra_keys(module)
    if module.bias_k is not None:
        k = torch.cat([k, module.bias_k.expand(B, 1, -1)], 1)
        v = torch.cat([v, module.bias_v.expand(B, 1, -1)], 1)
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(B, 1, k.shape[-1])], 1)
        v = torch.cat([v, v.new_zeros(B, 1, v.shape[-1])], 1)
    dtype = q.dtype
    if attn_mask is not None:
        if attn_mask.dim() == 3:  # [B * H, L, S] -> [B, H, L, S]
            attn_mask = attn_mask.view(B, module.num_heads, *attn_mask.shape[-2:])
        # torch's True = may not attend becomes the op's True = takes part; the extra keys are always attended.
        attn_mask = F.pad(attn_mask.logical_not(), (0, extra), value=True) if attn_mask.dtype == torch.bool \
            else F.pad(attn_mask.to(dtype), (0, extra))
    if key_padding_mask is not None:
        key_padding_mask = F.pad(key_padding_mask if key_padding_mask.dtype == torch.bool
                                 else key_padding_mask.to(dtype), (0, extra))
        if key_padding_mask.dtype != torch.bool:  # additive per key: a [B, 1, 1, S] broadcast mask
            additive = key_padding_mask[:, None, None, :]
            if attn_mask is None:
                attn_mask = additive
            elif attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros((), dtype=dtype, device=q.device).masked_fill(~attn_mask, float("-inf")) \
                    + additive
            else:
                attn_mask = attn_mask + additive
            key_padding_mask = None
    return Prepared(module._split_heads(q), module._split_heads(k), module._split_heads(v),
                    attn_mask, key_padding_mask, causal_hint)


def plain_attention(p: Prepared, dropout_p: float):
    """``(out [B, H, L, E/H], weights [B, H, L, S])`` the plain way, as torch's own slow path: the
    score matrix, softmax, ``torch.nn.functional.dropout`` on it, then the values. A row with no
    attended key gets zero weights (torch: NaN) and, unlike torch, no NaN gradient."""
    q, k = p.q, p.k
    scores = (q * (1.0 / q.shape[-1]) ** 0.5) @ k.transpose(-2, -1)
    if p.attn_mask is not None:
        scores = scores + p.attn_mask if p.attn_mask.dtype != torch.bool \
            else scores.masked_fill(~p.attn_mask, float("-inf"))
    if p.key_padding_mask is not None:
        scores = scores.masked_fill(p.key_padding_mask[:, None, None, :], float("-inf"))
    if p.is_causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    # Zeroing the scores of empty rows before the softmax keeps NaN out of the backward too.
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p)
    return weights @ p.v, weights
