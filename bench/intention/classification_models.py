"""The 5-shot classifiers of the Intention paper's Tables 1 and 2 (appendix §5), on feature vectors.

Every model maps a context ``(xc [B, N, dim], yc [B, N] labels in 0..ways-1)`` and queries
``xq [B, M, dim]`` to class scores ``[B, M, ways]`` (argmax = prediction) and owns its training
loss (:meth:`loss`). All share the same encoder, an MLP standing in for the paper's convolutional
encoders (our inputs are feature vectors, not pixels), followed by the paper's one-layer embedding
``e_H``:

* ``intention`` — the LS-SVM reading of Intention: ridge regression of the ±1 one-vs-rest targets
  ``2·onehot − 1`` on the embedded context (with a bias column), evaluated at the queries with
  :func:`attn_ext.intention`; trained with the MSE to the queries' ±1 targets (the paper's loss).
* ``intention_kernel`` — the same with a Gaussian kernel, :func:`attn_ext.kernelised_intention`
  (learned length scale; the paper's small latent size 32).
* ``intention_qda`` — the paper's "QDA" variant: ``Σ`` is the pooled within-class scatter and the
  targets are the class-balanced relabelling, so class ``k`` scores ``(q − x̄)ᵀ Σ⁻¹ (x̄_k − x̄)``;
  plain PyTorch (no op of ours solves with a within-class scatter); trained with cross-entropy on a
  learned temperature times the scores (their scale is not that of ±1 targets).
* ``sigma_intention`` — σIntention with one-hot values: ``softmax(Q (KᵀK + αI)⁻¹ Kᵀ) Y`` is a
  distribution over classes; trained with its negative log-likelihood.
* ``attention`` — the paper's attention classifier: multi-head softmax attention
  (:func:`attn_ext.cross_attention`) from embedded queries to embedded context with embedded
  one-hot values, then an MLP to the logits; cross-entropy.
* ``np`` — the paper's NP: the per-class means of the embedded context, concatenated with the
  embedded query, through an MLP to the logits; cross-entropy.
* ``maml`` — MAML (Finn et al.), the paper's Table 1 reference: the encoder, ``e_H`` and a linear
  head adapted to each context by 5 second-order gradient steps at rate 0.01; cross-entropy.
* ``prototypical`` — nearest class mean in the embedding (Snell et al.), a cheap reference the paper
  does not list; cross-entropy on negative squared distances.
"""
from __future__ import annotations

import torch
from torch import nn

import attn_ext as ae
from bench.intention.models_common import maml_adapt_and_apply, mlp

#: Model names in report order, with the paper's names.
CLASSIFIERS = {"attention": "Attention", "np": "NP", "maml": "MAML", "prototypical": "Prototypical (not in the paper)",
               "intention": "Intention (LS-SVM)", "intention_qda": "Intention - QDA",
               "intention_kernel": "Intention - kernel", "sigma_intention": "σIntention (not in the paper)"}


def build_classifier(name: str, dim: int, *, ways: int = 5, hidden: int = 64, latent: int = 128,
                     kernel_latent: int = 32, heads: int = 4, maml_steps: int = 5, maml_lr: float = 0.01):
    """A fresh classifier of :data:`CLASSIFIERS` (torch is imported here, not at module import).

    Parameters
    ----------
    name : str
        Key of :data:`CLASSIFIERS`.
    dim : int
        Input feature size.
    ways : int
        Classes per episode.
    hidden : int
        Width and output size of the shared encoder MLP.
    latent : int
        Size of the embedding ``e_H`` (the paper: 8192 for Intention, 512 for Attention, 2048 for the NP).
    kernel_latent : int
        ``e_H`` size of ``intention_kernel`` (the paper's 32).
    heads : int
        Attention heads (the paper: 5); ``latent`` must be divisible by it.
    maml_steps, maml_lr : int, float
        MAML's inner gradient steps and rate (Finn et al. on MiniImageNet: 5 steps at 0.01).
    """
    if name not in CLASSIFIERS:
        raise ValueError(f"build_classifier: unknown model {name!r}; choose from {list(CLASSIFIERS)}")

    def softplus_inverse(y: float) -> float:
        return float(torch.log(torch.expm1(torch.tensor(y))))

    class Classifier(nn.Module):
        """Shared encoder + ``e_H``; subclasses score queries from the embedded context."""

        ce_loss = True

        def __init__(self, embed: int):
            super().__init__()
            self.encoder = mlp([dim, hidden, hidden])
            self.embed = nn.Sequential(nn.ReLU(), nn.Linear(hidden, embed))   # the paper's one-layer e_H

        def check(self, xc, yc, xq):
            if xc.dim() != 3 or xq.dim() != 3 or xc.shape[-1] != dim or xq.shape[-1] != dim or \
                    yc.shape != xc.shape[:2] or xq.shape[0] != xc.shape[0]:
                raise ValueError(f"{type(self).__name__}: expected xc [B, N, {dim}], yc [B, N], xq [B, M, {dim}]; "
                                 f"got {tuple(xc.shape)}, {tuple(yc.shape)}, {tuple(xq.shape)}")

        def forward(self, xc, yc, xq):
            self.check(xc, yc, xq)
            onehot = nn.functional.one_hot(yc, ways).to(xc.dtype)
            return self.scores(self.embed(self.encoder(xc)), onehot, self.embed(self.encoder(xq)))

        def loss(self, xc, yc, xq, yq):
            scores = self(xc, yc, xq)
            if self.ce_loss:
                return nn.functional.cross_entropy(scores.reshape(-1, ways), yq.reshape(-1))
            return (scores - (2 * nn.functional.one_hot(yq, ways).to(scores.dtype) - 1)).pow(2).mean()

    def with_bias(e):
        # A constant column lets the ridge fit an intercept; at 10 its effective penalty is α/100,
        # close to the LS-SVM's unregularised bias.
        return torch.cat([e, torch.full_like(e[..., :1], 10.0)], -1)

    class LSSVM(Classifier):
        ce_loss = False

        def __init__(self):
            super().__init__(latent)
            self.raw_alpha = nn.Parameter(torch.tensor(softplus_inverse(1.0)))

        def scores(self, ec, onehot, eq):
            alpha = nn.functional.softplus(self.raw_alpha)
            return ae.intention(with_bias(eq)[:, None], with_bias(ec)[:, None], (2 * onehot - 1)[:, None],
                                alpha=alpha)[:, 0]

    class KernelLSSVM(Classifier):
        ce_loss = False

        def __init__(self):
            super().__init__(kernel_latent)
            self.raw_alpha = nn.Parameter(torch.tensor(softplus_inverse(0.1)))
            self.log_lengthscale = nn.Parameter(torch.tensor(float(kernel_latent) ** 0.5).log())

        def scores(self, ec, onehot, eq):
            # Kernel ridge on ±1 targets; the bias is absorbed by the Gaussian kernel's constant-like modes.
            # The jitter keeps k(K, K) factorisable when two context embeddings (nearly) coincide, as
            # they do early in training with a narrow e_H; it is 1e-4 of the kernel's unit diagonal.
            return ae.kernelised_intention(eq[:, None], ec[:, None], (2 * onehot - 1)[:, None],
                                           alpha=nn.functional.softplus(self.raw_alpha), kernel="rbf",
                                           lengthscale=self.log_lengthscale.exp(), jitter=1e-4)[:, 0]

    class QDA(Classifier):
        def __init__(self):
            super().__init__(latent)
            self.raw_ridge = nn.Parameter(torch.tensor(softplus_inverse(1.0)))
            self.log_temperature = nn.Parameter(torch.tensor(0.0))

        def scores(self, ec, onehot, eq):
            counts = onehot.sum(1)                                         # [B, ways]
            means = (onehot.mT @ ec) / counts[..., None]                   # [B, ways, E]
            centred = ec - onehot @ means                                  # within-class deviations
            eye = torch.eye(ec.shape[-1], dtype=ec.dtype)
            scatter = centred.mT @ centred + nn.functional.softplus(self.raw_ridge) * eye
            grand = ec.mean(1, keepdim=True)
            directions = torch.linalg.solve(scatter, (means - grand).mT)   # Σ⁻¹ (x̄_k − x̄): [B, E, ways]
            return self.log_temperature.exp() * ((eq - grand) @ directions)

    class SigmaIntention(Classifier):
        def __init__(self):
            super().__init__(latent)
            self.raw_alpha = nn.Parameter(torch.tensor(softplus_inverse(1.0)))
            # σIntention's scores start near 0 (a flat softmax); a learned scale lets them sharpen quickly.
            self.log_scale = nn.Parameter(torch.tensor(10.0).log())

        def scores(self, ec, onehot, eq):
            probs = ae.sigma_intention(self.log_scale.exp() * with_bias(eq)[:, None], with_bias(ec)[:, None],
                                       onehot[:, None], alpha=nn.functional.softplus(self.raw_alpha))[:, 0]
            return probs.clamp_min(1e-6).log()                             # log-probabilities as logits

    class Attention(Classifier):
        def __init__(self):
            super().__init__(latent)
            if latent % heads:
                raise ValueError(f"Attention classifier: latent {latent} not divisible by heads {heads}")
            self.values = mlp([ways, latent, latent])                      # e_V on the one-hot labels
            self.out = mlp([latent, latent, ways])                         # e_P

        def scores(self, ec, onehot, eq):
            split = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, H, n, latent/H]
            mixed = ae.cross_attention(split(eq), split(ec), split(self.values(onehot)))
            return self.out(mixed.transpose(1, 2).flatten(-2))

    class NP(Classifier):
        def __init__(self):
            super().__init__(latent)
            self.out = mlp([latent * (ways + 1), 2 * latent, ways])

        def scores(self, ec, onehot, eq):
            means = (onehot.mT @ ec) / onehot.sum(1)[..., None]            # [B, ways, E]
            summary = means.flatten(1)[:, None].expand(-1, eq.shape[1], -1)
            return self.out(torch.cat([summary, eq], -1))

    class Prototypical(Classifier):
        def __init__(self):
            super().__init__(latent)

        def scores(self, ec, onehot, eq):
            means = (onehot.mT @ ec) / onehot.sum(1)[..., None]
            return -(eq[:, :, None] - means[:, None]).pow(2).sum(-1)

    class MAML(Classifier):
        """The whole network (encoder, e_H, a linear head) adapted to each episode by gradient steps.

        Finn et al.'s MiniImageNet setting, which the paper's Table 1 row quotes: ``maml_steps``
        inner steps at rate ``maml_lr`` on the context cross-entropy, second order (the inner
        gradients keep their graph), vectorised over the episodes with ``torch.func``; the outer
        loss is the queries' cross-entropy after adaptation.
        """

        def __init__(self):
            super().__init__(latent)
            self.head = nn.Linear(latent, ways)
            # One module over the same submodules, for functional_call (parameters() deduplicates).
            self.net = nn.Sequential(self.encoder, self.embed, self.head)

        def forward(self, xc, yc, xq):
            self.check(xc, yc, xq)
            return maml_adapt_and_apply(self.net, nn.functional.cross_entropy, xc, yc, xq, steps=maml_steps,
                                        lr=maml_lr)

    return {"intention": LSSVM, "maml": MAML, "intention_kernel": KernelLSSVM, "intention_qda": QDA,
            "sigma_intention": SigmaIntention, "attention": Attention, "np": NP, "prototypical": Prototypical}[name]()


def raw_feature_scores(name: str, xc, yc, xq, ways: int = 5):
    """Untrained references on the raw features: ``"nearest_mean"`` or the ``"ls_svm"`` of Intention (α = 1)."""
    onehot = torch.nn.functional.one_hot(yc, ways).to(xc.dtype)
    if name == "nearest_mean":
        means = (onehot.mT @ xc) / onehot.sum(1)[..., None]
        return -torch.cdist(xq, means)
    if name == "ls_svm":
        bias = lambda t: torch.cat([t, torch.full_like(t[..., :1], 10.0)], -1)[:, None]
        return ae.intention(bias(xq), bias(xc), (2 * onehot - 1)[:, None], alpha=1.0)[:, 0]
    raise ValueError(f"raw_feature_scores: unknown reference {name!r}")
