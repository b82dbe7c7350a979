"""The four models of the Intention paper's policy-distillation task: Intention, attention, NP and MLP.

Each maps the observations ``obs [B, N, 3]`` (probe position and squared distance to the hidden
target, see :mod:`bench.intention.policy_distillation_data`) to a predicted target ``[B, 2]``. The
paper's appendix sets ``K = V = Q = O`` for every model; the architectures (widths are arguments so
the benchmark can shrink them; the paper's in brackets):

- ``intention``: keys ``E_K = O``; values ``E_V = e_V(O)``, a two-layer ReLU MLP [512, 512]; no
  query (the paper's ``E_Q = 0``): the module's output is the fitted map itself,
  ``w = (E_KᵀE_K + αI)⁻¹ E_KᵀE_V`` (``attn_ext.intention_map``, learned α > 0), a ``3 × width``
  matrix, flattened into ``e_P`` [128, 2]. (The paper writes ``E_K = [K, V, Q]``; with
  ``K = V = Q`` that is three copies of ``O``, which only makes ``E_KᵀE_K`` singular, so ``O`` is
  used once.) Why it suits the task: ``‖p_i‖² − d_i`` is linear in the probe, so a least-squares
  fit over the observations holds the target.
- ``attention``: 5-head softmax attention (``attn_ext.nn.MultiheadCrossAttention``) with keys and
  queries ``O`` and values ``e_V(O)`` [128, 128]; the 5 outputs flattened into ``e_P`` [2048, 2].
  Width 130, as 5 heads need a multiple of 5.
- ``np``: ``e_H(O)`` [512, 512] per observation, averaged, then ``e_P`` [512, 512, 128, 2].
- ``mlp``: ``e_P`` [512, 512, 512, 2] on the flattened observations (needs the same ``N`` every call).
"""
from __future__ import annotations

import torch
from torch import nn

import attn_ext as ae
from bench.intention.models_common import mlp as _mlp

MODEL_NAMES = ("intention", "attention", "np", "mlp")
#: The appendix's hidden widths and Adam learning rates.
PAPER_WIDTHS = {"intention": 512, "attention": 128, "np": 512, "mlp": 512}
PAPER_LR = {"intention": 3e-5, "attention": 3e-5, "np": 3e-4, "mlp": 3e-4}


def _check(name, obs, n_obs=None):
    if obs.dim() != 3 or obs.shape[-1] != 3 or (n_obs is not None and obs.shape[1] != n_obs):
        need = f"[B, {n_obs}, 3]" if n_obs is not None else "[B, N, 3]"
        raise ValueError(f"{name}: need obs {need}; got {tuple(obs.shape)}")


def build(name: str, width: int, *, heads: int = 5, n_obs: int = 5, alpha_init: float = 1e-2,
          head_width: int | None = None):
    """The model ``name`` (one of :data:`MODEL_NAMES`) with hidden width ``width``.

    ``head_width`` is the hidden layer of ``e_P`` for Intention (paper 128) and attention (paper
    2048); by default the paper's, scaled with ``width`` relative to the paper's width.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"policy_distillation_models.build: unknown model {name!r}; choose one of "
                         f"{', '.join(MODEL_NAMES)}")
    if width < 1:
        raise ValueError(f"policy_distillation_models.build: width must be >= 1; got {width}")

    def scaled(paper_head):
        return head_width or max(2, paper_head * width // PAPER_WIDTHS[name])

    class IntentionTarget(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_v = _mlp([3, width, width])
            # softplus(raw) = alpha_init: the ridge stays positive whatever the optimiser does.
            self.raw_alpha = nn.Parameter(torch.tensor(float(alpha_init)).expm1().log())
            self.e_p = _mlp([3 * width, scaled(128), 2])

        def forward(self, obs):
            _check("IntentionTarget", obs)
            alpha = nn.functional.softplus(self.raw_alpha).reshape(1)
            w = ae.intention_map(obs[:, None], self.e_v(obs)[:, None], alpha=alpha)     # [B, 1, 3, width]
            return self.e_p(w.flatten(1))

    class AttentionTarget(nn.Module):
        def __init__(self):
            super().__init__()
            if width % heads:
                raise ValueError(f"AttentionTarget: width {width} is not a multiple of heads {heads}")
            self.e_v = _mlp([3, width, width])
            # The attention's query input must be embed_dim wide: a linear lift of O (keys use kdim=3).
            self.q_in = nn.Linear(3, width)
            self.attention = ae.nn.MultiheadCrossAttention(width, heads, kdim=3)
            self.e_p = _mlp([n_obs * width, scaled(2048), 2])

        def forward(self, obs):
            _check("AttentionTarget", obs, n_obs)
            out, _ = self.attention(self.q_in(obs), obs, self.e_v(obs))
            return self.e_p(out.flatten(1))

    class NPTarget(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_h = _mlp([3, width, width])
            self.e_p = _mlp([width, width, width, scaled(128), 2])

        def forward(self, obs):
            _check("NPTarget", obs)
            return self.e_p(self.e_h(obs).mean(1))

    class MLPTarget(nn.Module):
        def __init__(self):
            super().__init__()
            self.e_p = _mlp([3 * n_obs, width, width, width, 2])

        def forward(self, obs):
            _check("MLPTarget", obs, n_obs)
            return self.e_p(obs.flatten(1))

    classes = {"intention": IntentionTarget, "attention": AttentionTarget, "np": NPTarget, "mlp": MLPTarget}
    return classes[name]()
