"""The five "-former" outlier detectors of the Intention paper's Table 3 (appendix §8), at a small width.

A model reads a set ``x [B, S, dim]`` of embeddings (input dropout, a linear map to the hidden
width), applies ``layers`` pre-norm residual blocks of set mixing and a feed-forward MLP, and scores
every item with a linear head; the softmax over the set's scores is the predicted outlier position
(cross-entropy against the true one). The blocks differ only in how the set is mixed, per head, after
the paper's shared ``E_X = relu(e_X(X))`` and per-head linear ``e_Q``, ``e_K``, ``e_V``:

* ``transformer`` — softmax attention ``softmax(QKᵀ/√d) V`` (:func:`attn_ext.cross_attention`);
* ``lin_transformer`` — linear attention ``Q Kᵀ V / S`` (plain PyTorch: no op of ours computes
  it; the ``1/S`` only fixes the scale, the set size is constant);
* ``informer`` — self-Intention in the paper's form
  ``Q Kᵀ[(1−a) K Kᵀ + a I]⁻¹ V = Q ((1−a) KᵀK + a I)⁻¹ KᵀV`` with ``a = sigmoid(θ)`` per head,
  computed by :func:`attn_ext.intention` with ridge ``a/(1−a)`` on queries scaled by ``1/(1−a)``;
* ``sigma_informer`` — the same inside a softmax, :func:`attn_ext.sigma_intention`;
* ``np_former`` — the paper's NP block: the set mean of ``[K; V]`` through an MLP, concatenated to
  every query and mapped by a linear layer.
"""
from __future__ import annotations

import torch
from torch import nn

import attn_ext as ae

#: Model names in the order of the paper's Table 3, with its names.
FORMERS = {"np_former": "NP-Former", "lin_transformer": "Lin-Transformer", "informer": "Informer",
           "transformer": "Transformer", "sigma_informer": "σ-Informer"}


def build_former(name: str, dim: int, *, layers: int = 1, heads: int = 4, head_dim: int = 16,
                 dropout: float = 0.2):
    """A fresh outlier detector of :data:`FORMERS` (the paper: 4 heads of 256, input dropout 20 %).

    Parameters
    ----------
    name : str
        Key of :data:`FORMERS`.
    dim : int
        Embedding size of the items.
    layers, heads, head_dim : int
        Blocks, heads per block and per-head width (hidden width ``heads · head_dim``).
    dropout : float
        Input dropout (the paper's 20 %, against overfitting).
    """
    if name not in FORMERS:
        raise ValueError(f"build_former: unknown model {name!r}; choose from {list(FORMERS)}")
    if min(layers, heads, head_dim, dim) < 1:
        raise ValueError(f"build_former: layers, heads, head_dim, dim must be >= 1, got {layers}, {heads}, "
                         f"{head_dim}, {dim}")
    width = heads * head_dim

    class Mixer(nn.Module):
        """One block's set mixing: E_X = relu(e_X(x)), per-head Q, K, V, the model's rule, an output map."""

        def __init__(self):
            super().__init__()
            self.e_x = nn.Linear(width, width)
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width if name != "np_former" else 2 * width, width)
            self.theta = nn.Parameter(torch.zeros(heads))                  # a = sigmoid(θ) = 0.5 at start
            if name == "np_former":
                self.e_c = nn.Sequential(nn.Linear(2 * width, width), nn.ReLU(), nn.Linear(width, width))

        def forward(self, x):
            q, k, v = self.qkv(torch.relu(self.e_x(x))).chunk(3, -1)
            if name == "np_former":
                context = self.e_c(torch.cat([k, v], -1).mean(1, keepdim=True)).expand_as(q)
                return self.out(torch.cat([q, context], -1))
            q, k, v = (t.unflatten(-1, (heads, head_dim)).transpose(1, 2) for t in (q, k, v))   # [B, H, S, d]
            if name == "transformer":
                mixed = ae.cross_attention(q, k, v, scale=head_dim ** -0.5)
            elif name == "lin_transformer":
                mixed = q @ (k.mT @ v) / k.shape[2]
            else:
                a = torch.sigmoid(self.theta)
                # Q((1-a)KᵀK + aI)⁻¹KᵀV = (Q/(1-a)) (KᵀK + a/(1-a) I)⁻¹ KᵀV: the op's ridge form.
                q = q / (1 - a).view(1, heads, 1, 1)
                op = ae.intention if name == "informer" else ae.sigma_intention
                mixed = op(q, k, v, alpha=a / (1 - a))
            return self.out(mixed.transpose(1, 2).flatten(-2))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.mix = Mixer()
            self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))

        def forward(self, x):
            x = x + self.mix(self.norm1(x))
            return x + self.ff(self.norm2(x))

    class OutlierDetector(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 1))

        def forward(self, x):
            """Outlier logits ``[B, S]`` of a set ``x [B, S, dim]``."""
            if x.dim() != 3 or x.shape[-1] != dim or x.shape[1] < 2:
                raise ValueError(f"{FORMERS[name]} detector: expected x [B, S >= 2, {dim}], got {tuple(x.shape)}")
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)[..., 0]

    return OutlierDetector()


def farthest_from_rest(x):
    """Untrained reference: the item farthest (Euclidean) from the mean of the other items, ``[B]``."""
    s = x.shape[1]
    rest = (x.sum(1, keepdim=True) - x) / (s - 1)
    return (x - rest).norm(dim=-1).argmax(-1)
