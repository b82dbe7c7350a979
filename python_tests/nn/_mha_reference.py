"""References of python_tests/nn/test_torch_module_info.py for ``torch.nn.MultiheadAttention``'s forward
and backward (batch-first batched inputs, no dropout):

- :func:`mha_longdouble`: the ground truth, in x87 extended precision (numpy longdouble, eps 1.1e-19),
  rounded to float64;
- :func:`mha_rounding_floors`: the rounding every implementation of the attention commits (each score
  rounded once, the backward's two dot products rounded once), to first order, carried through the
  projections: the floor of the rule, as python_tests/attention/_opinfo_reference.py's ``rounding_floors`` is
  for SDPA (scores of size |s| move the probabilities by about |s|·eps).

The masking comes as one float64 additive bias ``[B, H, L, S']`` over the keys and the extra ones of
``add_bias_kv`` / ``add_zero_attn`` (-inf where a pair does not take part); a query row with no pair
taking part gives a zero attention vector and zero gradients (attn_ext's documented convention).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

LD = np.longdouble


def _ld(t: Optional[Tensor]):
    return None if t is None else t.detach().double().numpy().astype(LD)


def _t(a) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).astype(np.float64))


def additive_bias(module: torch.nn.MultiheadAttention, B: int, L: int, S: int, attn_mask: Optional[Tensor],
                  key_padding_mask: Optional[Tensor]) -> Tensor:
    """torch's masks (bool True = may not attend, or float added; ``attn_mask [L, S]`` or ``[B·H, L, S]``,
    ``key_padding_mask [B, S]``) as one float64 bias ``[B, H, L, S + extra keys]`` (extra keys: 0)."""
    H = module.num_heads
    bias = torch.zeros(B, H, L, S, dtype=torch.float64)
    for mask, shape in ((attn_mask, (B, H, L, S) if attn_mask is not None and attn_mask.dim() == 3 else (L, S)),
                        (key_padding_mask, (B, 1, 1, S))):
        if mask is not None:
            mask = mask.reshape(shape)
            bias = bias.masked_fill(mask, -np.inf) if mask.dtype == torch.bool else bias + mask.detach().double()
    extra = int(module.bias_k is not None) + int(module.add_zero_attn)
    return torch.nn.functional.pad(bias, (0, extra))


def mha_longdouble(module: torch.nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor, bias: Tensor,
                   grad_out: Tensor, grad_weights: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tuple, Dict[str, Tensor]]:
    """Out ``[B, L, E]``, per-head weights ``[B, H, L, S']``, the gradients of (query, key, value) and of
    every parameter (by ``module.named_parameters()`` name) for the upstream ``grad_out`` and per-head
    ``grad_weights`` (None: no weights term)."""
    p = {name: _ld(t) for name, t in module.named_parameters()}
    E, H = module.embed_dim, module.num_heads
    d = E // H
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = np.split(p["in_proj_weight"], 3)
    else:
        w_q, w_k, w_v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    b_q, b_k, b_v = np.split(p["in_proj_bias"], 3) if "in_proj_bias" in p else (LD(0),) * 3
    w_o, b_o = p["out_proj.weight"], p.get("out_proj.bias", LD(0))
    xq, xk, xv = _ld(query), _ld(key), _ld(value)
    B, L, _ = xq.shape
    S = xk.shape[1]
    q, k, v = xq @ w_q.T + b_q, xk @ w_k.T + b_k, xv @ w_v.T + b_v
    if module.bias_k is not None:
        k = np.concatenate([k, np.broadcast_to(p["bias_k"], (B, 1, E))], 1)
        v = np.concatenate([v, np.broadcast_to(p["bias_v"], (B, 1, E))], 1)
    if module.add_zero_attn:
        k = np.concatenate([k, np.zeros((B, 1, E), dtype=LD)], 1)
        v = np.concatenate([v, np.zeros((B, 1, E), dtype=LD)], 1)

    def heads(x):
        return x.reshape(B, x.shape[1], H, d).transpose(0, 2, 1, 3)

    def merge(x):
        return x.transpose(0, 2, 1, 3).reshape(B, x.shape[2], E)

    qh, kh, vh = heads(q), heads(k), heads(v)
    scale = LD(1) / np.sqrt(LD(d))
    scores = qh @ kh.transpose(0, 1, 3, 2) * scale + _ld(bias)
    allowed = ~np.isneginf(scores)
    row_max = np.where(allowed, scores, LD(-np.inf)).max(-1, keepdims=True)
    empty = np.isneginf(row_max)
    e = np.where(allowed, np.exp(scores - np.where(empty, LD(0), row_max)), LD(0))
    probs = e / np.where(empty, LD(1), e.sum(-1, keepdims=True))
    merged = merge(probs @ vh)
    out = merged @ w_o.T + b_o

    g = _ld(grad_out)
    grads = {"out_proj.weight": g.reshape(-1, E).T @ merged.reshape(-1, E)}
    if "out_proj.bias" in p:
        grads["out_proj.bias"] = g.sum((0, 1))
    d_oh = heads(g @ w_o)
    d_probs = d_oh @ vh.transpose(0, 1, 3, 2) + (0 if grad_weights is None else _ld(grad_weights))
    d_vh = probs.transpose(0, 1, 3, 2) @ d_oh
    d_s = probs * (d_probs - (probs * d_probs).sum(-1, keepdims=True))
    dq, dk, dv = merge(d_s @ kh * scale), merge(d_s.transpose(0, 1, 3, 2) @ qh * scale), merge(d_vh)
    if module.bias_k is not None:
        grads["bias_k"], grads["bias_v"] = dk[:, S].sum(0)[None, None], dv[:, S].sum(0)[None, None]
    dk, dv = dk[:, :S], dv[:, :S]
    dw = [dy.reshape(-1, E).T @ x.reshape(-1, x.shape[-1]) for dy, x in ((dq, xq), (dk, xk), (dv, xv))]
    if module._qkv_same_embed_dim:
        grads["in_proj_weight"] = np.concatenate(dw)
    else:
        grads["q_proj_weight"], grads["k_proj_weight"], grads["v_proj_weight"] = dw
    if "in_proj_bias" in p:
        grads["in_proj_bias"] = np.concatenate([dq.sum((0, 1)), dk.sum((0, 1)), dv.sum((0, 1))])
    inputs = (dq @ w_q, dk @ w_k, dv @ w_v)
    assert set(grads) == set(p), (sorted(grads), sorted(p))
    return _t(out), _t(probs), tuple(_t(a) for a in inputs), {name: _t(a) for name, a in grads.items()}


def _probs(scores: Tensor) -> Tensor:
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)


def mha_rounding_floors(module: torch.nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                        bias: Tensor, grad_out: Tensor, unit_roundoff: float) -> Dict[str, float]:
    """Largest first-order effect of the attention's unavoidable roundings (``unit_roundoff`` u: each score
    ``s`` moved by ``u |s|``, ``dO·v_j`` and ``dO·out_i`` by ``u`` times their absolute sums) on ``out`` and on
    the gradients of the inputs and parameters (names as :func:`mha_longdouble`'s), in float64.

    Per element, as ``rounding_floors`` of python_tests/attention/_opinfo_reference.py: ``δP_ij <= P_ij (τ_ij +
    Σ_k P_ik τ_ik)`` with ``τ = u |s|``, then out, ``dS = P (dP − Δ)``, dq, dk, dv of the core; the module's
    linear maps carry them with absolute weights (the projections' own roundings are torch's too)."""
    E, H = module.embed_dim, module.num_heads
    d = E // H
    with torch.no_grad():
        p = {name: t.detach().double() for name, t in module.named_parameters()}
        w_q, w_k, w_v = (p["in_proj_weight"].chunk(3) if module._qkv_same_embed_dim
                         else (p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]))
        b_q, b_k, b_v = p["in_proj_bias"].chunk(3) if "in_proj_bias" in p else (None,) * 3
        xq, xk, xv, g = (t.detach().double() for t in (query, key, value, grad_out))
        B, S = xq.shape[0], xk.shape[1]
        q, k, v = F.linear(xq, w_q, b_q), F.linear(xk, w_k, b_k), F.linear(xv, w_v, b_v)
        if module.bias_k is not None:
            k, v = torch.cat([k, p["bias_k"].expand(B, 1, E)], 1), torch.cat([v, p["bias_v"].expand(B, 1, E)], 1)
        if module.add_zero_attn:
            k, v = torch.cat([k, k.new_zeros(B, 1, E)], 1), torch.cat([v, v.new_zeros(B, 1, E)], 1)

        def heads(x):
            return x.unflatten(-1, (H, d)).transpose(1, 2)

        def merge(x):
            return x.transpose(1, 2).flatten(2)

        qh, kh, vh, scale = heads(q), heads(k), heads(v), 1.0 / math.sqrt(d)
        scores = qh @ kh.transpose(-1, -2) * scale + bias
        probs = _probs(scores)
        tau = unit_roundoff * torch.where(torch.isneginf(scores), 0.0, scores).abs()
        out = probs @ vh
        spread = (vh[..., None, :, :] - out[..., :, None, :]).abs()  # [B, H, L, S', d]
        floor_out = merge((probs[..., None] * tau[..., None] * spread).sum(-2))
        d_o = heads(g @ p["out_proj.weight"])
        d_prob = probs * (tau + (probs * tau).sum(-1, keepdim=True))
        floor_dv = merge(d_prob.transpose(-1, -2) @ d_o.abs())
        dot = unit_roundoff * (d_o.abs() @ vh.abs().transpose(-1, -2) + (d_o * out).abs().sum(-1, keepdim=True))
        floor_ds = d_prob * (d_o @ vh.transpose(-1, -2) - (d_o * out).sum(-1, keepdim=True)).abs() + probs * dot
        floor_dq = merge(scale * floor_ds @ kh.abs())
        floor_dk = merge(scale * floor_ds.transpose(-1, -2) @ qh.abs())
        floors = {"out": floor_out @ p["out_proj.weight"].abs().T,
                  "out_proj.weight": g.abs().flatten(0, 1).T @ floor_out.flatten(0, 1)}
        if "out_proj.bias" in p:
            floors["out_proj.bias"] = torch.zeros(E, dtype=torch.float64)
        if module.bias_k is not None:
            floors["bias_k"], floors["bias_v"] = floor_dk[:, S].sum(0), floor_dv[:, S].sum(0)
        per_input = ((floor_dq, xq, w_q), (floor_dk[:, :S], xk, w_k), (floor_dv[:, :S], xv, w_v))
        for name, (f, x, w) in zip(("query", "key", "value"), per_input):
            floors[name] = f @ w.abs()
        dw = [f.flatten(0, 1).T @ x.abs().flatten(0, 1) for f, x, _ in per_input]
        if module._qkv_same_embed_dim:
            floors["in_proj_weight"] = torch.cat(dw)
        else:
            floors["q_proj_weight"], floors["k_proj_weight"], floors["v_proj_weight"] = dw
        if "in_proj_bias" in p:
            floors["in_proj_bias"] = torch.cat([f.sum((0, 1)) for f, _, _ in per_input])
    return {name: float(f.max()) if f.numel() else 0.0 for name, f in floors.items()}
