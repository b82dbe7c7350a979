"""The NaN/inf rule of the cross-attention family as an independent fp64 computation, the poisoned
inputs the NaN tests share, and the exact-NaN-mask assertion (docs/cross_attention.md, "NaN, inf and
empty rows").

``rule_attention`` is softmax attention written the way IEEE arithmetic evaluates it (max-shifted,
NaN-propagating max), with two deliberate departures from SDPA's math path: padded keys are never
read (``torch.where``, not a −inf bias added to a NaN score or 0 multiplying a NaN value), and a row
none of whose keys carries weight (all padded, or every score −inf) is the empty state ``(0, −inf)``
with zero gradient. It is differentiable, so fp64 autograd of it is the gradient the rule prescribes.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from _helpers import assert_within_flash_rule

B, H, M, N, D, DV = 3, 2, 6, 20, 8, 8
CHUNK = 8  # chunks [0, 8), [8, 16), [16, 20): both padded keys of entry 1 sit inside partly padded chunks
SCALE = 1.0 / math.sqrt(D)
NAN, INF = math.nan, math.inf

# name -> what is poisoned; every case also puts a NaN query row into fully padded batch entry 0.
CASES = ("clean", "q_nan", "k_nan", "v_nan", "padded_nan", "q_inf", "k_inf", "neg_inf_scores", "huge")


def base_inputs(dtype=torch.float32, seed: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v and the mask: entry 0 fully padded, entry 1 keys 5 and 13 padded, entry 2 unpadded."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=gen).to(dtype) for n, d in ((M, D), (N, D), (N, DV)))
    mask = torch.zeros(B, N, dtype=torch.bool)
    mask[0] = True
    mask[1, [5, 13]] = True
    return q, k, v, mask


def poisoned(case: str, dtype=torch.float32, seed: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inputs of ``case``; the poison sits in batch entry 1, head 1 unless said otherwise."""
    q, k, v, mask = base_inputs(dtype, seed)
    q[0, 0, 2] = NAN  # a NaN query whose keys are all padded: its row stays empty
    if case == "q_nan":
        q[1, 1, 3, 0] = NAN
    elif case == "k_nan":  # a valid key: every row of (1, 1)
        k[1, 1, 9, 2] = NAN
    elif case == "v_nan":  # out column 1 of every row of (1, 1); lse untouched
        v[1, 1, 9, 1] = NAN
    elif case == "padded_nan":  # padded keys, both heads: never read
        k[1, :, 5] = NAN
        v[1, :, 5] = 3e38  # finite, but dO·v overflows: 0 · inf would be NaN
        v[1, :, 13] = NAN
        k[1, :, 13, 0] = INF
    elif case == "q_inf":  # scores ±inf across the keys: +inf − +inf in row 3
        q[1, 1, 3, 0] = INF
    elif case == "k_inf":  # +inf score (NaN row) where q[..., 0] > 0, −inf (weight 0) where < 0
        k[1, 1, 9, 0] = INF
    elif case == "neg_inf_scores":  # every valid score of row 3 is −inf: no key has weight
        q[1, 1, 3, 0] = -INF
        k[1, 1, :, 0] = k[1, 1, :, 0].abs() + 0.5
    elif case == "huge":  # finite inputs whose fp32 score overflows to −inf: that key weighs 0
        q[1, 1, :, 0] = 0.0
        q[1, 1, 3, 0] = 1e20
        k[1, 1, :, 0] = 0.0
        k[1, 1, 9, 0] = -1e20
    elif case != "clean":
        raise ValueError(case)
    return q, k, v, mask


def rule_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float = SCALE):
    """``(out, lse)`` by the rule, in the inputs' dtype; differentiable (see the module docstring)."""
    n = k.shape[2]
    valid = torch.ones(q.shape[0], n, dtype=torch.bool) if mask is None else ~mask
    zero = torch.zeros((), dtype=q.dtype)
    k = torch.where(valid[:, None, :, None], k, zero)
    v = torch.where(valid[:, None, :, None], v, zero)
    s = torch.where(valid[:, None, None, :], torch.matmul(q, k.transpose(-1, -2)) * scale, -math.inf)
    if n == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_full(q.shape[:-1], -math.inf)
    m = s.amax(dim=-1, keepdim=True).detach()  # amax propagates NaN; lse's gradient does not need it
    empty = m == -math.inf
    p = torch.exp(s - torch.where(empty, zero, m))
    total = p.sum(dim=-1, keepdim=True)
    safe = torch.where(empty, torch.ones((), dtype=q.dtype), total)
    out = torch.where(empty, zero, torch.matmul(p, v) / safe)
    lse = torch.where(empty, -math.inf, torch.where(empty, zero, m) + torch.log(safe)).squeeze(-1)
    return out, lse


def rule_grads(q, k, v, mask, grad_out, grad_lse, dtype=torch.float64, scale: float = SCALE):
    """Gradients of q, k, v of ``<out, grad_out> + <lse, grad_lse>`` through :func:`rule_attention`."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = rule_attention(*leaves, mask, scale)
    return torch.autograd.grad((out, lse), leaves, (grad_out.to(dtype), grad_lse.to(dtype)))


def sdpa_math(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float = SCALE) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on its math path (what the rule is held to)."""
    attn_mask = None if mask is None else ~mask[:, None, None, :]
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def assert_nan_rule(ours: Tensor, ref64: Tensor, same_precision: Optional[Tensor], name: str,
                    grad: bool = False, floor_ulps: float = 1.0) -> None:
    """NaN exactly where ``ref64`` has NaN; elsewhere the FlashAttention rule (or, without a
    same-precision computation, agreement to 1e-9 relative), infinite entries matched exactly."""
    ours = ours.detach()
    nan_ours, nan_ref = torch.isnan(ours), torch.isnan(ref64)
    assert torch.equal(nan_ours, nan_ref), (
        f"{name}: NaN at {nan_ours.nonzero().tolist()[:12]} (of {int(nan_ours.sum())}), expected at "
        f"{nan_ref.nonzero().tolist()[:12]} (of {int(nan_ref.sum())})")
    keep = ~nan_ref
    if same_precision is None:
        torch.testing.assert_close(ours[keep].double(), ref64[keep].double(), rtol=1e-9, atol=1e-12, msg=name)
        return
    assert not bool(torch.isnan(same_precision[keep]).any()), f"{name}: the calibration itself has NaN"
    assert_within_flash_rule(ours[keep], ref64[keep], same_precision[keep], grad=grad, name=name,
                             floor_ulps=floor_ulps)
