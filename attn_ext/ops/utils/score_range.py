"""The check that an attention forward never returns a silently wrong row because a scaled score, or the
accumulation of values, left the range of the accumulation dtype (docs/sdpa.md, "Scores out of range").

``scale = 1e38`` with float32 inputs, or ``q·k`` beyond 3.4e38, has a finite float64 answer that float32
cannot compute: a score of +inf makes the row NaN (or its lse +inf), a row whose allowed scores all
overflow to −inf looks like a row with no key (0, lse −inf), and an lse beyond the range is +inf. Each
is also what the NaN rule gives for non-finite inputs or a row with no allowed key, so only rows whose
results are not finite are examined further: such a row whose inputs are finite (its query, and the
keys, values and additive mask entries of its allowed pairs) and that has an allowed key raises.

The common call pays one pass over ``lse`` and ``out`` (no pass over the keys). This is the check of the
Python backends (reference, Triton); the C++ kernels make the same one (csrc/cpu/score_range.h). On CUDA
it is not made: reading a flag on the host would synchronise every call (docs/sdpa.md).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._C import _functorch
from torch._subclasses.fake_tensor import FakeTensor


def _allowed_and_bias(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], band, shape) -> tuple:
    """``(allowed [B, Hq, L, S] bool, bias or None)`` of the pair rules of docs/sdpa.md."""
    B, Hq, L, S = shape
    allowed = torch.ones(shape, dtype=torch.bool)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask.expand(shape)
            allowed = allowed & (bias != -float("inf"))
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if band is not None and band.active:
        allowed = allowed & band.allowed(L, 0, S, allowed.device)
    return allowed, bias


def _finite_max(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``max |x|`` over the entries of ``x``, non-finite entries counted as 0."""
    x = x.to(dtype)
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=dtype)).abs().amax() if x.numel() else \
        torch.zeros((), dtype=dtype)


def _cannot_overflow(q: Tensor, k: Tensor, v: Tensor, acc: torch.dtype, scale: float,
                     attn_mask: Optional[Tensor]) -> bool:
    """Whether no row with finite inputs can leave the range, by Cauchy–Schwarz: every score (and partial sum
    of one) is at most ``|scale| · max‖q_i‖ · max‖k_j‖ + max|mask|`` and every output at most ``max|v|``.

    One pass over q, k, v (and the mask) instead of examining the rows pair by pair: the non-finite rows of
    a usual call are rows with no key (padding) or the NaN rule's, and this settles them without forming a
    ``[B, H, L, S]`` rule. Non-finite entries count as 0 here: a row that reads one is the NaN rule's."""
    def norms(x):
        x = x.to(acc)
        return torch.linalg.vector_norm(torch.where(torch.isfinite(x), x, torch.zeros((), dtype=acc)), dim=-1)

    if q.numel() == 0 or k.numel() == 0:
        return True
    bound = abs(scale) * norms(q).amax() * norms(k).amax()
    if attn_mask is not None and attn_mask.is_floating_point():
        bound = bound + _finite_max(attn_mask, acc)
    limit = torch.finfo(acc).max / 4  # the lse adds log S; the sum of weights stays within 1
    return bool(bound < limit) and bool(_finite_max(v, acc) < limit)


def check_scores_in_range(op: str, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                          attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                          band=None) -> None:
    """Raises ``ValueError`` naming ``attn_ext.<op>`` for the first overflowed row of a forward's
    ``(out [B, Hq, L, Dv], lse [B, Hq, L])`` of ``q [B, Hq, L, D]``, ``k``, ``v [B, Hkv, S, ·]``; ``band``: the
    call's :class:`~attn_ext.ops.attention.band.Band` (causal rule, sliding window), None for none."""
    if lse.device.type != "cpu" or lse.numel() == 0 or isinstance(lse, FakeTensor) or \
            _functorch.is_functorch_wrapped_tensor(lse):
        return  # no values on the host without a synchronisation, or none at all (tracing)
    ok = torch.isfinite(lse) & torch.isfinite(out).all(dim=-1)
    if bool(ok.all()) or _cannot_overflow(q, k, v, lse.dtype, scale, attn_mask):
        return
    B, Hq, L = lse.shape
    S, Hkv = k.shape[2], k.shape[1]
    rows = (~ok).nonzero(as_tuple=True)
    allowed, bias = _allowed_and_bias(attn_mask, key_padding_mask, band, (B, Hq, L, S))
    kv_finite = (torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1)).repeat_interleave(Hq // Hkv, dim=1)
    pair_finite = kv_finite[:, :, None, :] if bias is None else kv_finite[:, :, None, :] & torch.isfinite(bias)
    pairs = allowed.expand(B, Hq, L, S)[rows]
    has_key = pairs.any(dim=-1)
    inputs_finite = torch.isfinite(q).all(dim=-1)[rows] & ~(pairs & ~pair_finite.expand(B, Hq, L, S)[rows]).any(dim=-1)
    overflow = (has_key & inputs_finite).nonzero()
    if overflow.numel() == 0:
        return  # rows with no key (0, −inf), or non-finite inputs (the NaN rule)
    first = int(overflow[0, 0])
    b, h, m = (int(r[first]) for r in rows)
    value = float(lse[b, h, m])
    symptom = ("NaN" if value != value else "an lse of +inf" if value > 0 else
               "0 with lse = -inf, as for a row with no key") if not torch.isfinite(lse[b, h, m]) else \
        "an output of inf or NaN"
    raise ValueError(
        f"attn_ext.{op}: the scores or values of query row [batch, head, query] = [{b}, {h}, {m}] leave the range of "
        f"{str(lse.dtype).replace('torch.', '')} (|scale · q·k|, the row's lse or its weighted sum of values beyond "
        f"{torch.finfo(lse.dtype).max:.4g}; scale = {scale}) although its inputs are finite: the result would be "
        f"{symptom}. Pass a smaller scale, smaller inputs, or float64 inputs")
