"""The four models of the Intention paper's point-cloud remapping task: Intention, attention, NP and MLP.

Each maps observed points ``k [B, N, 2]``, their images ``v [B, N, 2]`` and queries ``q [B, M, 2]``
to predictions ``[B, M, 2]``, with the architectures of the paper's appendix section on the task
(widths are arguments, so the benchmark can shrink them):

- ``intention``: ``E_K, E_V, E_Q`` two-layer ReLU MLPs ([w, w], paper w = 128), the ridge map
  ``E_Q (E_KᵀE_K + αI)⁻¹ E_KᵀE_V`` (``attn_ext.intention``, a learned α > 0 because 5 keys never
  span 128 dimensions), then ``e_P`` [w, w, 2].
- ``attention``: the same with [w, w] embeddings (paper w = 256) and 5-head softmax attention
  (``attn_ext.nn.MultiheadCrossAttention``); ``w`` must be a multiple of the heads (256 is not a
  multiple of 5: the benchmark uses 260).
- ``np``: a conditional neural process: ``e_H([k_i, v_i])`` [w, w], averaged, then
  ``e_P([mean, q_j])`` [w, w, 2]. (The appendix writes ``e_H([K, V, Q])`` and ``e_P(mean)``; the
  query has to reach the decoder for the NP to answer several queries, so it goes there.)
- ``mlp``: ``e_P`` on the flattened ``[K, V, Q]`` with layers [w, w, w, 2M] (paper: M = 5, so 10
  outputs); it needs the same ``N`` and ``M`` at every call.
"""
from __future__ import annotations

import torch
from torch import nn

import attn_ext as ae
from bench.intention.models_common import mlp as _mlp

MODEL_NAMES = ("intention", "attention", "np", "mlp")


def _check(name, k, v, q):
    if k.dim() != 3 or v.shape != k.shape or q.dim() != 3 or q.shape[0] != k.shape[0] \
            or k.shape[-1] != 2 or q.shape[-1] != 2:
        raise ValueError(f"{name}: need k, v [B, N, 2] and q [B, M, 2]; got {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(q.shape)}")


def build(name: str, width: int, *, heads: int = 5, n_obs: int = 5, n_query: int = 5, alpha_init: float = 1.0):
    """The model ``name`` (one of :data:`MODEL_NAMES`) with hidden width ``width``."""
    class IntentionRemap(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_k, self.e_v, self.e_q = _mlp([2, width, width]), _mlp([2, width, width]), _mlp([2, width, width])
            # softplus(raw) = alpha_init: the ridge stays positive whatever the optimiser does.
            self.raw_alpha = nn.Parameter(torch.tensor(float(alpha_init)).expm1().log())
            self.e_p = _mlp([width, width, width, 2])

        def forward(self, k, v, q):
            _check("IntentionRemap", k, v, q)
            alpha = nn.functional.softplus(self.raw_alpha).reshape(1)
            out = ae.intention(self.e_q(q)[:, None], self.e_k(k)[:, None], self.e_v(v)[:, None], alpha=alpha)
            return self.e_p(out[:, 0])

    class AttentionRemap(nn.Module):
        def __init__(self):
            super().__init__()
            if width % heads:
                raise ValueError(f"AttentionRemap: width {width} is not a multiple of heads {heads}")
            self.e_k, self.e_v, self.e_q = _mlp([2, width, width]), _mlp([2, width, width]), _mlp([2, width, width])
            self.attention = ae.nn.MultiheadCrossAttention(width, heads)
            self.e_p = _mlp([width, width, width, 2])

        def forward(self, k, v, q):
            _check("AttentionRemap", k, v, q)
            out, _ = self.attention(self.e_q(q), self.e_k(k), self.e_v(v))
            return self.e_p(out)

    class NPRemap(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_h = _mlp([4, width, width])
            self.e_p = _mlp([width + 2, width, width, 2])

        def forward(self, k, v, q):
            _check("NPRemap", k, v, q)
            r = self.e_h(torch.cat([k, v], -1)).mean(1, keepdim=True)
            return self.e_p(torch.cat([r.expand(-1, q.shape[1], -1), q], -1))

    class MLPRemap(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_p = _mlp([2 * (2 * n_obs + n_query), width, width, width, 2 * n_query])

        def forward(self, k, v, q):
            _check("MLPRemap", k, v, q)
            if k.shape[1] != n_obs or q.shape[1] != n_query:
                raise ValueError(f"MLPRemap: built for N={n_obs}, M={n_query}; got k {tuple(k.shape)}, "
                                 f"q {tuple(q.shape)}")
            flat = torch.cat([k.flatten(1), v.flatten(1), q.flatten(1)], -1)
            return self.e_p(flat).view(q.shape)

    classes = {"intention": IntentionRemap, "attention": AttentionRemap, "np": NPRemap, "mlp": MLPRemap}
    if name not in classes:
        raise ValueError(f"point_cloud_models.build: unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return classes[name]()
