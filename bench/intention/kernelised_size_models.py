"""The two few-shot classifiers of the kernelised-size task: Intention as an LS-SVM, plain or kernelised.

As in the Intention paper's few-shot appendix (its eq. 16), keys and queries share an encoder
``e_enc`` and a one-layer embedding ``e_H`` of width ``latent`` (the "model size" of its Figure 14),
the values are the one-hot labels, and the prediction is the least-squares fit
``P̂ = E_Q (E_KᵀE_K + αI)⁻¹ E_Kᵀ Y`` trained with an MSE loss. The kernelised version maps both
embeddings through the Gaussian-kernel features ``φ(X) = k(X, K) k(K, K)^{-1/2}`` first, which is
kernel ridge regression on the embeddings (:func:`attn_ext.kernelised_intention`). Our encoder is a
small MLP on the synthetic features (the paper: a ResNet-12 or the Matching Nets CNN on images).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import attn_ext as ae

#: Classifier names, as the report shows them.
MODELS = ("intention", "kernelised")


class FewShotIntention(nn.Module):
    """LS-SVM few-shot classifier on Intention (``kernel=False``) or kernelised Intention (``kernel=True``).

    Parameters
    ----------
    obs_dim : int
        Width of the observed features.
    latent : int
        Width of the embedding ``e_H`` (the size the task varies).
    ways : int
        Classes per episode (the width of the one-hot values).
    kernel : bool
        Gaussian-kernel features on the embeddings (exact over the context, or Nyström with ``landmarks``).
    hidden : int
        Width of the shared encoder MLP.
    landmarks : int, optional
        Nyström landmarks of the kernelised model (None: exact, every context point).
    jitter : float
        Added to ``k(K, K)``'s diagonal: the exact form needs it when two embedded context points nearly coincide.
    """

    def __init__(self, obs_dim: int, latent: int, ways: int, *, kernel: bool, hidden: int = 64,
                 landmarks: Optional[int] = None, jitter: float = 1e-4) -> None:
        super().__init__()
        self.ways, self.kernel, self.landmarks, self.jitter = ways, kernel, landmarks, jitter
        self.encoder = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.embed = nn.Linear(hidden, latent)
        # α = softplus(raw) > 0 starts at 1; ℓ = exp(raw) starts at sqrt(latent), the typical distance
        # of two embeddings with unit-variance coordinates, so that the kernel starts neither flat nor spiky.
        self.raw_alpha = nn.Parameter(torch.tensor(math.log(math.e - 1.0)))
        self.log_lengthscale = nn.Parameter(torch.tensor(0.5 * math.log(latent)), requires_grad=kernel)

    def forward(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Tensor:
        """Class scores ``[B, N_t, ways]`` of the targets given the labelled context (labels ``[B, N_c]``)."""
        ek = self.embed(self.encoder(xc)).unsqueeze(1)  # [B, 1, N_c, latent]: one head
        eq = self.embed(self.encoder(xt)).unsqueeze(1)
        values = F.one_hot(yc, self.ways).to(ek.dtype).unsqueeze(1)
        alpha = F.softplus(self.raw_alpha).reshape(1, 1)
        if self.kernel:
            out = ae.kernelised_intention(eq, ek, values, alpha=alpha, kernel="rbf",
                                          lengthscale=self.log_lengthscale.exp().reshape(1, 1),
                                          num_landmarks=self.landmarks, jitter=self.jitter)
        else:
            out = ae.intention(eq, ek, values, alpha=alpha)
        return out.squeeze(1)

    def loss(self, episodes) -> Tensor:
        """MSE to the one-hot target labels (the paper trains Intention with an MSE loss)."""
        scores = self(episodes.xc, episodes.yc, episodes.xt)
        return F.mse_loss(scores, F.one_hot(episodes.yt, self.ways).to(scores.dtype))

    @torch.no_grad()
    def accuracy(self, episodes) -> Tensor:
        """Per-episode accuracy ``[B]`` of the arg-max class."""
        return (self(episodes.xc, episodes.yc, episodes.xt).argmax(-1) == episodes.yt).float().mean(-1)


def build_classifier(name: str, obs_dim: int, latent: int, ways: int, **options) -> FewShotIntention:
    if name not in MODELS:
        raise ValueError(f"build_classifier: unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return FewShotIntention(obs_dim, latent, ways, kernel=(name == "kernelised"), **options)


def train_classifier(model: FewShotIntention, sampler, *, steps: int, batch: int, lr: float,
                     generator: torch.Generator, log_every: int = 0, log=None) -> dict:
    """Adam on the MSE loss; returns the mean loss of the first and last tenth of the steps."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = model.loss(sampler.sample(batch, generator=generator))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log and log_every and (step + 1) % log_every == 0:
            log(f"  step {step + 1}/{steps}: loss {sum(losses[-log_every:]) / log_every:.4f}")
    tenth = max(1, steps // 10)
    return {"first_loss": sum(losses[:tenth]) / tenth, "last_loss": sum(losses[-tenth:]) / tenth}


def evaluate(model: FewShotIntention, episodes_list) -> dict:
    """Mean accuracy over fixed evaluation episodes and its 95% interval half-width (as the paper's ±)."""
    acc = torch.cat([model.accuracy(ep) for ep in episodes_list])
    half = 1.96 * acc.std().item() / math.sqrt(acc.numel()) if acc.numel() > 1 else float("nan")
    return {"accuracy": acc.mean().item(), "ci95": half, "episodes": acc.numel()}
