"""The reference of translation-equivariant attention: the dense formula and the chunked algorithm.

Per batch entry, query ``i``, key ``j`` and head ``h``:

    s_ij = scale · (q_ih · k_jh)  for every head (a vector of H),    d_ij = xq_i − xk_j  (dx numbers),
    logit_ijh = (W2 · act(W1 · [s_ij, d_ij] + b1) + b2)_h,
    out_ih = Σ_j softmax_j(logit_i·h) v_jh,    lse_ih = log Σ_j exp(logit_ijh).

``q [B, H, M, D]``, ``k [B, H, N, D]``, ``v [B, H, N, Dv]``, ``xq [B, M, dx]``, ``xk [B, N, dx]``, ``w1 [hidden,
H + dx]``, ``b1 [hidden]``, ``w2 [H, hidden]``, ``b2 [H]``; ``key_padding_mask [B, N]`` bool, True = padding. A row
without any key (all padded, or N = 0) gives ``out = 0`` and ``lse = −inf``. The logits depend on the inputs only
through ``xq_i − xk_j``: shifting both by one vector changes nothing but rounding.

:func:`dense` forms the ``[B, M, N, hidden]`` hidden layer (the plain PyTorch model's memory). :func:`chunked_forward`
streams the keys in chunks with an online softmax, and :func:`chunked_backward` recomputes each chunk's logits from
the saved ``(out, lse)`` and pulls the score gradient ``dS = P ∘ (dP − Δ + dlse)`` back by hand through the MLP of
that chunk alone: both hold ``O(B·M·chunk·hidden)`` at a time, never ``O(M·N)``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ACTIVATIONS", "ACTIVATION_NAMES", "activation_derivative", "chunked_backward", "chunked_forward",
           "default_scale", "dense", "logits", "pair_features"]

#: The MLP's activation by name.
ACTIVATIONS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
               "tanh": torch.tanh}
#: The activations in the order of the ops' ``activation`` code (csrc/include/attn_ext/te_activation.h).
ACTIVATION_NAMES = ("relu", "gelu", "silu", "tanh")


def default_scale(head_dim: int) -> float:
    """``1/sqrt(D)``, and 1 for ``D = 0`` (no dot product: the logits see only the differences)."""
    return head_dim ** -0.5 if head_dim > 0 else 1.0


def pair_features(q: Tensor, k: Tensor, xq: Tensor, xk: Tensor, scale: float) -> Tensor:
    """``[B, M, N, H + dx]``: ρ's inputs for every (query, key) pair, every head's scaled dot product, then
    ``xq_i − xk_j`` (the difference formed before any product)."""
    dots = torch.einsum("bhmd,bhnd->bmnh", q, k) * scale                  # [B, M, N, H]
    return torch.cat([dots, xq[:, :, None, :] - xk[:, None, :, :]], -1)


def logits(q: Tensor, k: Tensor, xq: Tensor, xk: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, scale: float,
           activation: str = "relu") -> Tensor:
    """``[B, H, M, N]``: the MLP's logits of every (query, key) pair of ``q`` and ``k`` (any N: a chunk's keys)."""
    hidden = ACTIVATIONS[activation](pair_features(q, k, xq, xk, scale) @ w1.transpose(0, 1) + b1)
    return (hidden @ w2.transpose(0, 1) + b2).permute(0, 3, 1, 2)          # [B, H, M, N]


def _masked(scores: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Padded keys' logits selected as −inf (never added: a NaN logit of a padded key must not leak)."""
    if key_padding_mask is None:
        return scores
    return scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))


def _without_padded(k: Tensor, v: Tensor, xk: Tensor, key_padding_mask: Optional[Tensor]):
    """``k``, ``v``, ``xk`` with the padded keys' rows zero: whatever they hold (NaN) reaches neither the products
    nor, through 0 · NaN, the MLP's weight gradients; differentiable (zero gradient there)."""
    if key_padding_mask is None:
        return k, v, xk
    rows = key_padding_mask[:, None, :, None]
    return k.masked_fill(rows, 0), v.masked_fill(rows, 0), xk.masked_fill(key_padding_mask[..., None], 0)


def dense(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask=None, scale: Optional[float] = None,
          activation: str = "relu") -> Tuple[Tensor, Tensor]:
    """``(out [B, H, M, Dv], lse [B, H, M])`` from the whole ``[B, H, M, N]`` logits (differentiable)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    k, v, xk = _without_padded(k, v, xk, key_padding_mask)
    s = _masked(logits(q, k, xq, xk, w1, b1, w2, b2, scale, activation), key_padding_mask)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)[..., None]
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse[..., None]), lse[..., None]))
    return torch.where(empty, torch.zeros((), dtype=v.dtype), p @ v), lse


def _chunks(n: int, chunk_size: int) -> Sequence[Tuple[int, int]]:
    return [(n0, min(n0 + chunk_size, n)) for n0 in range(0, n, chunk_size)]


def chunked_forward(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask=None, scale: Optional[float] = None,
                    activation: str = "relu", chunk_size: int = 64) -> Tuple[Tensor, Tensor]:
    """:func:`dense`'s ``(out, lse)`` with the keys streamed ``chunk_size`` at a time (online softmax), without
    forming more than one chunk's logits and hidden layer. Not differentiable: :func:`chunked_backward` is its rule."""
    if chunk_size < 1:
        raise ValueError(f"te_attention: chunk_size must be positive, got {chunk_size}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    B, H, M, _ = q.shape
    acc = q.new_zeros(B, H, M, v.shape[-1])
    run_max = q.new_full((B, H, M), float("-inf"))
    run_sum = q.new_zeros(B, H, M)
    with torch.no_grad():
        for n0, n1 in _chunks(k.shape[2], chunk_size):
            mask = None if key_padding_mask is None else key_padding_mask[:, n0:n1]
            k_c, v_c, xk_c = _without_padded(k[:, :, n0:n1], v[:, :, n0:n1], xk[:, n0:n1], mask)
            s = _masked(logits(q, k_c, xq, xk_c, w1, b1, w2, b2, scale, activation), mask)
            new_max = torch.maximum(run_max, s.amax(-1))
            # A row whose keys so far are all masked keeps a −inf maximum: shift by 0 there (exp(−inf) = 0).
            shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
            factor = torch.exp(run_max - shift)
            p = torch.exp(s - shift[..., None])
            run_sum = run_sum * factor + p.sum(-1)
            acc = acc * factor[..., None] + p @ v_c
            run_max = new_max
    empty = run_sum == 0
    lse = torch.where(empty, torch.full_like(run_sum, float("-inf")), run_max + torch.log(run_sum))
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1, run_sum)[..., None])
    return out, lse


def activation_derivative(activation: str, pre: Tensor) -> Tensor:
    """``act'(pre)`` of the MLP's activation (relu: 1 above 0, else 0, as torch's relu backward)."""
    if activation == "relu":
        return (pre > 0).to(pre.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(pre * 0.5 ** 0.5))
        return cdf + pre * torch.exp(-0.5 * pre * pre) * (2 * torch.pi) ** -0.5
    if activation == "silu":
        sig = torch.sigmoid(pre)
        return sig * (1 + pre * (1 - sig))
    return 1 - torch.tanh(pre) ** 2


def chunked_backward(grad_out, grad_lse, q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, out, lse,
                     scale: Optional[float] = None, activation: str = "relu",
                     chunk_size: int = 64) -> Tuple[Tensor, ...]:
    """The gradients of the nine inputs ``(q, k, v, xq, xk, w1, b1, w2, b2)`` from the forward's ``(out, lse)``:
    per key chunk, ``P = exp(logits − lse)``, ``dV = Pᵀ·dO``, ``dS = P ∘ (dO·Vᵀ − Δ + dlse)`` with
    ``Δ = rowsum(dO ∘ out)``, and ``dS`` pulled back by hand through that chunk's MLP (its pre-activations
    recomputed): the steps the kernels take, without autograd (this runs inside an op's backward)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    delta = (grad_out * out).sum(-1) - grad_lse                               # [B, H, M]
    empty = torch.isneginf(lse)
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)[..., None]
    H = q.shape[1]
    grad_q, grad_xq = torch.zeros_like(q), torch.zeros_like(xq)
    grad_w1, grad_b1, grad_w2, grad_b2 = (torch.zeros_like(t) for t in (w1, b1, w2, b2))
    grad_k, grad_v, grad_xk = torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(xk)
    for n0, n1 in _chunks(k.shape[2], chunk_size):
        mask = None if key_padding_mask is None else key_padding_mask[:, n0:n1]
        k_c, v_c, xk_c = _without_padded(k[:, :, n0:n1], v[:, :, n0:n1], xk[:, n0:n1], mask)
        features = pair_features(q, k_c, xq, xk_c, scale)                        # [B, M, n, H + dx]
        pre = features @ w1.transpose(0, 1) + b1
        hidden = ACTIVATIONS[activation](pre)
        s = (hidden @ w2.transpose(0, 1) + b2).permute(0, 3, 1, 2)                 # [B, H, M, n]
        p = torch.exp(_masked(s, mask) - safe_lse)
        p = torch.where(empty[..., None], torch.zeros_like(p), p)            # rows without keys: no probability
        grad_v[:, :, n0:n1] = p.transpose(-1, -2) @ grad_out
        ds = p * (grad_out @ v_c.transpose(-1, -2) - delta[..., None])
        # Padded keys and empty rows: P = 0, and 0 · (dP − Δ) is NaN when dP or Δ is not finite.
        ds = torch.where(p == 0, torch.zeros_like(ds), ds).permute(0, 2, 3, 1)   # [B, M, n, H]
        grad_w2 += ds.flatten(0, 2).transpose(0, 1) @ hidden.flatten(0, 2)
        grad_b2 += ds.sum((0, 1, 2))
        grad_pre = (ds @ w2) * activation_derivative(activation, pre)
        grad_w1 += grad_pre.flatten(0, 2).transpose(0, 1) @ features.flatten(0, 2)
        grad_b1 += grad_pre.sum((0, 1, 2))
        grad_features = grad_pre @ w1
        grad_dots, grad_diff = grad_features[..., :H] * scale, grad_features[..., H:]
        grad_q += torch.einsum("bmnh,bhnd->bhmd", grad_dots, k_c)
        grad_k[:, :, n0:n1] = torch.einsum("bmnh,bhmd->bhnd", grad_dots, q)
        grad_xq += grad_diff.sum(2)
        grad_xk[:, n0:n1] = -grad_diff.sum(1)
    if key_padding_mask is not None:  # a padded key's rows were never read
        rows = key_padding_mask[:, None, :, None]
        grad_k, grad_v = grad_k.masked_fill(rows, 0), grad_v.masked_fill(rows, 0)
        grad_xk = grad_xk.masked_fill(key_padding_mask[..., None], 0)
    return grad_q, grad_k, grad_v, grad_xq, grad_xk, grad_w1, grad_b1, grad_w2, grad_b2
