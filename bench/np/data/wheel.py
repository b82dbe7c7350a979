"""The wheel bandit of Riquelme et al. (2018), as used by TNP/LBANP/CMANP (CMANP App. C.2).

Contexts ``X`` are uniform in the unit disc; there are 5 arms. Every arm pays ``N(1.0, 0.05²)``
except arm 0, which pays ``N(1.2, 0.05²)``; when ``‖X‖ ≥ δ`` the arm of X's quadrant (1: +x+y,
2: −x+y, 3: −x−y, 4: +x−y) pays ``N(50, 0.01²)`` instead. The optimal arm is that quadrant's arm
outside the radius δ and arm 0 inside. The noise levels are the official code's (the CMANP text
writes 0.01² for all of them).

Pre-training (the official ``reward="all"`` setting) shows the model every arm's reward: x is the
context, y the 5 rewards, δ ~ U(0, 1) per problem, 512 context and 50 target points. With
``context_rewards="pulled"`` (not the papers' protocol) each context point instead shows what a
deployed agent sees, the reward of one random arm and N(0, 1) noise at the others, while the targets
keep all 5 rewards: training then matches the histories met at deployment.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from attn_ext.data import NPBatch

NUM_ARMS, SMALL_MEANS, SMALL_STD, LARGE_MEAN, LARGE_STD = 5, (1.2, 1.0, 1.0, 1.0, 1.0), 0.05, 50.0, 0.01
DELTAS = (0.7, 0.9, 0.95, 0.99, 0.995)
#: What the pre-training context shows: every arm's reward (the papers'), or one pulled arm's.
CONTEXT_REWARDS = ("all", "pulled")


class WheelData(NamedTuple):
    """``num_points`` draws of one wheel problem: contexts ``x [N, 2]``, the rewards every arm would
    pay ``rewards [N, 5]``, the optimal arm ``[N]`` and its reward ``[N]``."""

    x: Tensor
    rewards: Tensor
    opt_action: Tensor
    opt_reward: Tensor


def sample_wheel(num_points: int, delta: float, generator: Optional[torch.Generator] = None) -> WheelData:
    """One wheel problem of radius ``delta`` in [0, 1].

    Examples
    --------
    >>> import torch
    >>> from bench.np.data.wheel import sample_wheel
    >>> d = sample_wheel(1000, 0.9, torch.Generator().manual_seed(0))
    >>> outer = d.x.norm(dim=1) >= 0.9
    >>> bool((d.x.norm(dim=1) <= 1).all()), bool((d.rewards[outer].argmax(1) == d.opt_action[outer]).all())
    (True, True)
    """
    if not 0.0 <= float(delta) <= 1.0 or num_points <= 0:
        raise ValueError(f"wheel: delta must be in [0, 1] and num_points positive, got {delta}, {num_points}")
    # Rejection sampling of the disc: draw a few more squares than needed, keep the ones inside.
    x = torch.empty(0, 2)
    while x.shape[0] < num_points:
        cand = torch.rand(2 * num_points, 2, generator=generator) * 2 - 1
        x = torch.cat([x, cand[cand.norm(dim=1) <= 1]])
    x = x[:num_points]
    rewards = torch.tensor(SMALL_MEANS) + SMALL_STD * torch.randn(num_points, NUM_ARMS, generator=generator)
    quadrant = torch.where(x[:, 1] > 0, torch.where(x[:, 0] > 0, 1, 2), torch.where(x[:, 0] <= 0, 3, 4))
    outer = x.norm(dim=1) >= delta
    large = LARGE_MEAN + LARGE_STD * torch.randn(num_points, generator=generator)
    rows = torch.arange(num_points)
    rewards[rows[outer], quadrant[outer]] = large[outer]
    opt_action = torch.where(outer, quadrant, 0)
    return WheelData(x, rewards, opt_action, rewards[rows, opt_action])


class WheelSampler:
    """Pre-training batches: ``batch_size`` problems with ``δ ~ U(0, 1)``, all arms' rewards as y.

    Examples
    --------
    >>> import torch
    >>> from bench.np.data.wheel import WheelSampler
    >>> b = WheelSampler(num_context=16, num_target=4).sample(2, torch.Generator().manual_seed(0))
    >>> tuple(b.xc.shape), tuple(b.yt.shape)
    ((2, 16, 2), (2, 4, 5))
    """

    def __init__(self, num_context: int = 512, num_target: int = 50, context_rewards: str = "all") -> None:
        if num_context <= 0 or num_target <= 0:
            raise ValueError(f"wheel: num_context and num_target must be positive, got {num_context}, {num_target}")
        if context_rewards not in CONTEXT_REWARDS:
            raise ValueError(f"wheel: context_rewards must be one of {', '.join(CONTEXT_REWARDS)}, got {context_rewards!r}")
        self.num_context, self.num_target, self.context_rewards = num_context, num_target, context_rewards

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> NPBatch:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        n = self.num_context + self.num_target
        deltas = torch.rand(batch_size, generator=generator)
        problems = [sample_wheel(n, float(d), generator) for d in deltas]
        x = torch.stack([p.x for p in problems])
        y = torch.stack([p.rewards for p in problems])
        c = self.num_context
        yc = y[:, :c]
        if self.context_rewards == "pulled":
            yc = masked_rewards(yc, torch.randint(0, NUM_ARMS, yc.shape[:2], generator=generator), generator)
        return NPBatch(x[:, :c], yc, x[:, c:], y[:, c:])


def masked_rewards(rewards: Tensor, arm: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """What an agent records after pulling ``arm [...]``: ``rewards [..., 5]`` at that arm, N(0, 1) noise
    at the others (the official TNP code's history convention)."""
    out = torch.randn(rewards.shape, generator=generator)
    return out.scatter(-1, arm.unsqueeze(-1), rewards.gather(-1, arm.unsqueeze(-1)))
