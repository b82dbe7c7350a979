"""The ReTreever training objective ``L = L_TCA + λ_CA·L_CA + λ_RL·L_RL`` (TCA §3.5; docs/spec.md §3)."""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class TCALoss(NamedTuple):
    """Components of :func:`tca_loss` (all scalars); ``total = tca + lambda_ca·ca + lambda_rl·rl``."""

    total: Tensor
    tca: Tensor
    ca: Tensor
    rl: Tensor


def tca_loss(
    task_loss_tca: Tensor,
    task_loss_ca: Tensor,
    reward: Tensor,
    log_prob: Tensor,
    entropy: Tensor,
    *,
    lambda_ca: float = 1.0,
    lambda_rl: float = 1.0,
    alpha: float = 0.01,
    return_components: bool = False,
):
    """``L = L_TCA + λ_CA·L_CA + λ_RL·L_RL`` with ``L_RL = −mean(R·log π) − α·mean(H)``.

    ``L_RL`` is REINFORCE (undiscounted, the reward given once at the end of the descent, so every
    level's ``log π`` gets the same ``R``; :class:`TreeCrossAttentionOutput` already sums them) with an
    entropy bonus. The reward is detached here: it need not be differentiable (e.g. 0/1 accuracy),
    and gradients of a reward computed from the TCA output must not leak through the policy term.
    Subtract a baseline from it beforehand if wanted.

    Parameters
    ----------
    task_loss_tca : Tensor
        Scalar task loss of the tree-cross-attention output (``L_TCA``).
    task_loss_ca : Tensor
        Scalar task loss of the full cross attention over the leaves (``L_CA``, from
        :meth:`TreeCrossAttention.forward_full`); pass a zero tensor with ``lambda_ca=0`` to drop it.
    reward : Tensor
        ``[B, M]`` per-query reward ``R`` (or anything broadcastable to ``log_prob``); detached.
    log_prob : Tensor
        ``[B, M]`` ``Σ_t log π(a_t | s_t)`` of the sampled descents.
    entropy : Tensor
        ``[B, M]`` ``Σ_t H(π(· | s_t))``.
    lambda_ca, lambda_rl, alpha : float
        Weights (the paper's defaults: 1, 1, 0.01).
    return_components : bool
        Return a :class:`TCALoss` instead of the scalar total.

    Returns
    -------
    Tensor or TCALoss

    Examples
    --------
    >>> import torch
    >>> from attn_ext.nn.tca_loss import tca_loss   # also ae.nn.tca_loss
    >>> log_prob = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    >>> reward, entropy = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.7, 0.7]])
    >>> parts = tca_loss(torch.tensor(2.0), torch.tensor(1.0), reward, log_prob, entropy,
    ...                     return_components=True)
    >>> round(parts.rl.item(), 4), round(parts.total.item(), 4)   # rl = -(1·log 0.5 + 0)/2 - 0.01·0.7
    (0.3396, 3.3396)
    """
    if not isinstance(log_prob, Tensor) or not isinstance(entropy, Tensor) or not isinstance(reward, Tensor):
        raise TypeError("attn_ext.nn.tca_loss: reward, log_prob and entropy must be tensors")
    if entropy.shape != log_prob.shape:
        raise ValueError(
            f"attn_ext.nn.tca_loss: entropy {tuple(entropy.shape)} and log_prob {tuple(log_prob.shape)} must have "
            "the same shape ([B, M])"
        )
    try:
        reward = reward.detach().broadcast_to(log_prob.shape)
    except RuntimeError:
        raise ValueError(
            f"attn_ext.nn.tca_loss: reward {tuple(reward.shape)} must broadcast to log_prob {tuple(log_prob.shape)}"
        ) from None
    for name, value in (("task_loss_tca", task_loss_tca), ("task_loss_ca", task_loss_ca)):
        if not isinstance(value, Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"attn_ext.nn.tca_loss: {name} must be a scalar tensor, got {got}")
    rl = -(reward.to(log_prob.dtype) * log_prob).mean() - alpha * entropy.mean()
    total = task_loss_tca.reshape(()) + lambda_ca * task_loss_ca.reshape(()) + lambda_rl * rl
    if return_components:
        return TCALoss(total, task_loss_tca.reshape(()), task_loss_ca.reshape(()), rl)
    return total
