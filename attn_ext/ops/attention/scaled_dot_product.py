"""``attn_ext.scaled_dot_product_attention``: ``torch.nn.functional.scaled_dot_product_attention``'s signature
and semantics on the fused kernels (docs/sdpa.md)."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from attn_ext.ops.attention.chunked import DEFAULT_CHUNK_SIZE
from attn_ext.ops.attention.dropout import draw_seed
from attn_ext.ops.attention.band import check_band_args
from attn_ext.ops.attention.bias_grad import attention_with_bias_gradient, takes_bias_gradient
from attn_ext.ops.attention.registration import SCALED_DOT_PRODUCT_ATTENTION
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.validation import SUPPORTED_DTYPES, check_chunk_size, check_scale, is_real_scalar

_OP = "attn_ext.scaled_dot_product_attention"


def _shape(t: Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not (query.dim() == key.dim() == value.dim() and query.dim() >= 2):
        raise ValueError(f"{_OP}: query, key, value must have the same number (>= 2) of dims (..., L, E), (..., S, E), "
                         f"(..., S, Ev); got {_shape(query)}, {_shape(key)}, {_shape(value)}")
    lead = query.dim() - 3
    if query.dim() >= 3 and not (query.shape[:lead] == key.shape[:lead] == value.shape[:lead]):
        raise ValueError(f"{_OP}: the batch dims of query {_shape(query)}, key {_shape(key)} and value {_shape(value)} "
                         "must be equal (they are not broadcast)")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"{_OP}: key {_shape(key)} and value {_shape(value)} must agree in every dim but the last")
    if query.shape[-1] != key.shape[-1] or query.shape[-1] == 0:
        raise ValueError(f"{_OP}: query {_shape(query)} and key {_shape(key)} must have the same positive embedding "
                         "dim E")
    if query.dim() >= 3:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        if heads != kv_heads and not (enable_gqa and kv_heads > 0 and heads % kv_heads == 0):
            hint = "set enable_gqa=True" if not enable_gqa else "the query heads must be a multiple of them"
            raise ValueError(f"{_OP}: query has {heads} heads and key/value {kv_heads} ({hint})")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"{_OP}: query, key, value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{_OP}: dtype {query.dtype} is not supported; use float16, bfloat16, float32 or float64")
    if not (query.device == key.device == value.device):
        raise RuntimeError(f"{_OP}: query, key, value must be on one device; got {query.device}, {key.device}, "
                           f"{value.device}")


def _check_mask(attn_mask: Tensor, query: Tensor, keys: int) -> None:
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{_OP}: attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        raise TypeError(f"{_OP}: attn_mask must be bool (True = take part) or the query's dtype {query.dtype} "
                        f"(added to the scores); got {attn_mask.dtype}")
    target = _shape(query)[:-1] + (keys,)
    try:
        fits = torch.broadcast_shapes(_shape(attn_mask), target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{_OP}: attn_mask {_shape(attn_mask)} does not broadcast to (..., L, S) = {target}")
    if attn_mask.device != query.device:
        raise RuntimeError(f"{_OP}: attn_mask is on {attn_mask.device} but query is on {query.device}")


def _from_causal_bias(attn_mask: Tensor, is_causal: bool, alignment: str, queries: int, keys: int) -> str:
    """The alignment of ``attn_mask=torch.nn.attention.bias.CausalBias``, which stands for the causal rule.

    A ``CausalBias`` is a tensor subclass that stands for a causal rule and holds no mask values: read as an
    ordinary tensor it would add garbage to the scores. Upper-left is ``is_causal=True``; lower-right (query
    ``i`` sees keys ``j <= i + S - L``, queries aligned to the end of the keys) is ``is_causal=True`` with
    ``alignment="bottom_right"``."""
    if is_causal:
        raise ValueError(f"{_OP}: attn_mask is a CausalBias, which already is the causal rule; do not also set "
                         "is_causal=True (as in PyTorch)")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (queries, keys):
        raise ValueError(f"{_OP}: attn_mask is a CausalBias for (L, S) = ({attn_mask.seq_len_q}, "
                         f"{attn_mask.seq_len_kv}) but the call has (L, S) = ({queries}, {keys})")
    if attn_mask.variant == CausalVariant.UPPER_LEFT:
        if alignment == "bottom_right":
            raise ValueError(f"{_OP}: attn_mask is an upper-left CausalBias but alignment='bottom_right'")
        return "top_left"
    if attn_mask.variant == CausalVariant.LOWER_RIGHT:
        return "bottom_right"
    raise ValueError(f"{_OP}: attn_mask is a CausalBias of variant {attn_mask.variant!r}, which it does not know")


_ALIGNMENTS = ("top_left", "bottom_right")


def window_sides(window_size, alignment: str, is_causal: bool) -> Tuple[int, int]:
    """``(left, right)`` of ``window_size`` (``(-1, -1)`` for None), checked against ``alignment`` and the causal rule."""
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"{_OP}: alignment must be 'top_left' or 'bottom_right', got {alignment!r}")
    if window_size is None:
        return -1, -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{_OP}: window_size must be a pair (left, right) of ints, got {window_size!r}") from None
    for side in (left, right):
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"{_OP}: window_size must be a pair (left, right) of ints, got {window_size!r}")
    if left < -1 or right < -1:
        raise ValueError(f"{_OP}: window_size = {window_size!r}: each side is a number of keys >= 0, or -1 for no "
                         "limit on that side")
    if is_causal and right > 0:
        raise ValueError(f"{_OP}: is_causal=True lets no query see keys after its diagonal, but window_size = "
                         f"{window_size!r} asks for {right}; pass (left, 0) or (left, -1)")
    return int(left), int(right)


def softcap_value(softcap) -> float:
    """``softcap`` as a float, 0.0 for none."""
    if softcap is None:
        return 0.0
    if not is_real_scalar(softcap) or not (math.isfinite(float(softcap)) and float(softcap) >= 0.0):
        raise ValueError(f"{_OP}: softcap must be a finite float > 0 (or None / 0 for none), got {softcap!r}")
    return float(softcap)


def alibi_slopes_for(slopes, query: Tensor) -> Tensor:
    """``alibi_slopes`` checked and broadcast to the query's ``(..., Hq)``."""
    if not isinstance(slopes, Tensor):
        raise TypeError(f"{_OP}: alibi_slopes must be a float32 tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"{_OP}: alibi_slopes must be float32 (as FlashAttention's), got {slopes.dtype}")
    heads = _shape(query)[:-2]
    if query.dim() < 3 or _shape(slopes) not in ((heads[-1],), heads):
        raise ValueError(f"{_OP}: alibi_slopes must be (Hq,) or (..., Hq) = {heads} for query {_shape(query)}, "
                         f"got {_shape(slopes)}")
    if slopes.device != query.device:
        raise RuntimeError(f"{_OP}: alibi_slopes is on {slopes.device} but query is on {query.device}")
    if not bool(torch.isfinite(slopes).all()):
        raise ValueError(f"{_OP}: alibi_slopes must be finite")
    return slopes.expand(heads).contiguous()


def _check_padding(key_padding_mask: Tensor, query: Tensor, keys: int) -> None:
    expected = _shape(query)[:-3] + (keys,)
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError(f"{_OP}: key_padding_mask must be a bool tensor (True = padding)")
    if _shape(key_padding_mask) != expected:
        raise ValueError(f"{_OP}: key_padding_mask must be (..., S) = {expected}, got {_shape(key_padding_mask)}")
    if key_padding_mask.device != query.device:
        raise RuntimeError(f"{_OP}: key_padding_mask is on {key_padding_mask.device} but query is on {query.device}")


def _as_4d(t: Tensor) -> Tensor:
    """``(..., H, n, d)`` as ``[B, H, n, d]`` (a view whenever the batch dims allow one)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    batch = math.prod(_shape(t)[:-3])
    return t.reshape((batch,) + _shape(t)[-3:])


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: Optional[Tensor] = None,
    return_lse: bool = False,
    chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
    alignment: str = "top_left",
    window_size: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``torch.nn.functional.scaled_dot_product_attention`` on attn_ext's fused kernels.

    Same arguments, shapes and result as PyTorch's: ``softmax(scale · q kᵀ + mask) v`` with attention
    dropout, but the ``[L, S]`` score matrix is never formed: keys are streamed in chunks with a running
    log-sum-exp, the mask is read tile by tile through its strides (a broadcast mask stays a view), causal
    calls skip the key chunks above the diagonal, and grouped key/value heads are read in place.

    Parameters
    ----------
    query, key, value : Tensor
        ``(..., Hq, L, E)``, ``(..., H, S, E)``, ``(..., H, S, Ev)`` (also ``(L, E)``-style 2-D); the
        batch dims ``...`` must be equal (nothing is broadcast). float16, bfloat16, float32 (float64 on
        the cpp and reference backends).
    attn_mask : Tensor, optional
        Broadcastable to ``(..., Hq, L, S)``. Bool: **True means the pair takes part** (SDPA's convention,
        the opposite of ``key_padding_mask`` and of ``torch.nn.MultiheadAttention``'s bool masks). Float
        (the query's dtype): added to the scaled scores; ``-inf`` excludes the pair. Differentiable in
        both modes (a learned bias): in reverse mode its gradient is summed key chunk by key chunk into the
        mask's own shape (:mod:`attn_ext.ops.attention.bias_grad`: no ``[B, H, L, S]`` buffer for a mask
        shared by the batch); higher orders, forward mode and ``torch.func`` differentiate the dense
        composition. A ``torch.nn.attention.bias.CausalBias``
        (``causal_upper_left(L, S)``, ``causal_lower_right(L, S)``) is understood as the causal rule it
        stands for: upper-left is ``is_causal=True``, lower-right is ``is_causal=True`` with
        ``alignment="bottom_right"``.
    dropout_p : float
        Attention dropout probability in ``[0, 1)``, applied whenever it is > 0 (as PyTorch's function,
        which has no training flag). The keep mask comes from a counter-based generator seeded from
        torch's default generator: reproducible under ``torch.manual_seed``, regenerated in the
        backward (never stored), and the same on every backend.
    is_causal : bool
        Query ``i`` attends keys ``j <= i`` (top-left aligned, as PyTorch's). Cannot be combined with
        ``attn_mask`` (as in PyTorch).
    scale : float, optional
        Score scale, default ``1 / sqrt(E)``.
    enable_gqa : bool
        Allow ``H < Hq`` with ``Hq % H == 0``: query head ``h`` reads key/value head ``h // (Hq // H)``,
        without copying them.
    key_padding_mask : Tensor, optional
        attn_ext extension: bool ``(..., S)``, **True marks padding**. May be combined with ``attn_mask``
        or ``is_causal`` without materialising their combination.
    return_lse : bool
        Also return the log-sum-exp of each row's (masked, undropped) scores ``(..., Hq, L)`` in fp32
        (fp64 for fp64 inputs): a state that :func:`attn_ext.merge_states` can merge.
    chunk_size : int, optional
        Keys per chunk (default 512); never changes the result beyond rounding.
    backend : {"cpp", "cuda", "triton", "reference", "auto"}, optional
        As for :func:`attn_ext.cross_attention`.
    alignment : {"top_left", "bottom_right"}
        Where query ``i`` sits among the keys, for ``is_causal`` and ``window_size``: its diagonal key is
        ``i' = i`` (top-left, PyTorch's ``is_causal``) or ``i' = i + S − L`` (the queries are the last ``L``
        positions of the ``S`` keys: decoding with a cache, ``CausalBias`` lower-right). A query whose
        diagonal falls before key 0 sees no key (``0``, ``lse = -inf``).
    window_size : (int, int), optional
        ``(left, right)``: key ``j`` takes part for query ``i`` only if ``i' − left ≤ j ≤ i' + right`` (a
        sliding window); ``-1`` leaves that side unbounded. ``is_causal=True`` sets ``right = 0`` (pass 0 or
        -1 there). Combines with masks, padding, grouped heads and dropout. Every backend's kernels skip the
        key chunks outside the band (cost ∝ ``L · (left + right)``).
    softcap : float, optional
        ``c > 0``: the scaled scores become ``c · tanh(scale · q·k / c)`` before the mask and ALiBi are added
        (Gemma 2, Grok); None or 0: none. Differentiable (the backward applies ``1 − tanh²``).
    alibi_slopes : Tensor, optional
        float32 ``(Hq,)`` or ``(..., Hq)`` (the query's batch dims): ALiBi adds ``−slope_h · |i' − j|`` to the
        scores of query head ``h`` (``i'`` the query's diagonal key, see ``alignment``). Not differentiated.
        softcap and ALiBi run on the cpp, reference and Triton kernels (the automatic choice takes them; the
        CUDA kernels say they have neither).

    Returns
    -------
    Tensor or (Tensor, Tensor)
        ``(..., Hq, L, Ev)`` in the input dtype, and the lse if ``return_lse``.

    Notes
    -----
    A query row for which no key takes part (all masked) gives ``0`` and ``lse = -inf``, with zero
    gradients, as PyTorch's SDPA does (torch >= 2.5). A masked pair is never read: NaN or inf in a key or
    value that is masked for a row does not reach that row (PyTorch lets it through as ``0 · NaN``).

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = torch.randn(2, 8, 100, 32), torch.randn(2, 2, 100, 32), torch.randn(2, 2, 100, 32)
    >>> out = ae.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                      return_lse, chunk_size, backend, alignment, window_size, softcap, alibi_slopes)


def attention_by_position(
    query: Tensor, key: Tensor, value: Tensor, *, diagonal: int, attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None, is_causal: bool = False, window_size: Optional[Tuple[int, int]] = None,
    scale: Optional[float] = None, chunk_size: Optional[int] = None, backend: Optional[str] = None,
) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`scaled_dot_product_attention` with query ``i``'s diagonal key at ``i + diagonal``
    for any offset (the public function's two alignments are ``0`` and ``S − L``): the causal rule and
    ``window_size`` of a set of keys that is a part of a longer sequence, as the attention states take them."""
    if isinstance(diagonal, bool) or not isinstance(diagonal, int):
        raise TypeError(f"{_OP}: the diagonal offset must be an int, got {diagonal!r}")
    return _attention(query, key, value, attn_mask, 0.0, is_causal, scale, False, key_padding_mask, True, chunk_size,
                      backend, "top_left", window_size, None, None, diagonal=diagonal)


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, return_lse,
               chunk_size, backend, alignment, window_size, softcap, alibi_slopes, diagonal=None):
    """:func:`scaled_dot_product_attention`'s checks and call; ``diagonal`` (None: from ``alignment``) as for
    :func:`attention_by_position`."""
    check_qkv(query, key, value, enable_gqa)
    keys, queries = key.shape[-2], query.shape[-2]
    if isinstance(attn_mask, CausalBias):
        alignment = _from_causal_bias(attn_mask, is_causal, alignment, queries, keys)
        attn_mask, is_causal = None, True
    if attn_mask is not None:
        if is_causal:
            raise ValueError(f"{_OP}: attn_mask cannot be combined with is_causal=True (as in PyTorch); "
                             "fold the causal rule into the mask")
        _check_mask(attn_mask, query, keys)
    if key_padding_mask is not None:
        _check_padding(key_padding_mask, query, keys)
    if not (is_real_scalar(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"{_OP}: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP}: is_causal must be a bool, got {type(is_causal).__name__}")
    window_left, window_right = window_sides(window_size, alignment, is_causal)
    if diagonal is None:
        diagonal = keys - queries if alignment == "bottom_right" else 0
    check_band_args(window_left, window_right, diagonal)
    softcap = softcap_value(softcap)
    slopes = None if alibi_slopes is None else alibi_slopes_for(alibi_slopes, query)
    scale = check_scale(scale, "scaled_dot_product_attention")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    chunk_size = check_chunk_size(chunk_size, "scaled_dot_product_attention") or DEFAULT_CHUNK_SIZE
    dropout_p = float(dropout_p)

    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    B, Hq, L, _ = q.shape
    name = dispatch.select_backend(SCALED_DOT_PRODUCT_ATTENTION, backend, q, dropout_p=dropout_p)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(_shape(query)[:-1] + (keys,)).reshape(B, Hq, L, keys)
    padding = None if key_padding_mask is None else key_padding_mask.reshape(B, keys)
    seed = draw_seed() if dropout_p > 0.0 else None
    entry = dispatch.entry(SCALED_DOT_PRODUCT_ATTENTION, name)
    slopes = None if slopes is None else slopes.reshape(B, Hq)
    if takes_bias_gradient(attn_mask, q, k, v):  # a learned bias: its gradient chunk by chunk, in its own shape
        out, lse = attention_with_bias_gradient(name, entry, q, k, v, attn_mask, _shape(query)[:-1], padding, scale,
                                                is_causal, dropout_p, seed, chunk_size, window_left, window_right,
                                                diagonal, softcap, slopes)
    else:
        out, lse = entry(q, k, v, mask, padding, scale, is_causal, dropout_p, seed, chunk_size, window_left,
                         window_right, diagonal, softcap, slopes)
    out = out.reshape(_shape(query)[:-1] + (value.shape[-1],))
    return (out, lse.reshape(_shape(query)[:-1])) if return_lse else out
