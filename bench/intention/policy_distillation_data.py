"""Data and environment of the policy-distillation task: 2-D point navigation to a hidden target.

The Intention paper's §5.3 rephrases the 2-D navigation benchmark of MAML (Finn et al., 2017) as
supervised target prediction: a task draws a target ``t ~ N(0, I₂)`` and ``N = 5`` probe positions
``p_i ~ N(0, ¼ I₂)``; each observation is ``o_i = (x_i, y_i, ‖p_i − t‖²)``, and the network must
predict ``t`` from the five ``o_i``. These are exactly the paper's appendix distributions.

The observations are noise-free, so three non-collinear probes fix the target:
``‖p_i‖² − d_i = 2 p_i·t − ‖t‖²`` is linear in ``(p_i, 1)``, and its least-squares solution
(:func:`least_squares_target`) is the exact answer, the floor of every model's error.

To turn a predicted target into a policy and score it as the RL benchmark would, this module also
writes out the navigation environment in torch (no physics engine is needed: the benchmark's agent
is a point): the agent starts at the origin, each action is a displacement clipped to
``[−0.1, 0.1]`` per coordinate, the reward of a step is ``−‖position − t‖`` and an episode lasts
``horizon`` steps. The expert is the greedy controller that knows ``t`` and steps towards it at the
largest allowed step; the distilled policy is the same controller aimed at the model's prediction.

Torch is imported inside the functions (the harness imports task modules to build ``--help``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

TARGET_STD = 1.0          # t ~ N(0, 1) per coordinate (the paper's appendix)
PROBE_STD = 0.5           # p_i ~ N(0, 1/4) per coordinate (variance 1/4)
MAX_STEP = 0.1            # the navigation benchmark's action bound per coordinate


class NavigationBatch(NamedTuple):
    """A batch of target-prediction tasks."""

    obs: "object"         # [B, N, 3]: (x_i, y_i, squared distance to the target)
    target: "object"      # [B, 2]


def sample_navigation_tasks(batch: int, *, n_obs: int = 5, generator=None, dtype=None) -> NavigationBatch:
    """``batch`` tasks of ``n_obs`` observations each, drawn as described in the module notes.

    Examples
    --------
    >>> import torch
    >>> b = sample_navigation_tasks(2, generator=torch.Generator().manual_seed(0))
    >>> tuple(b.obs.shape), tuple(b.target.shape)
    ((2, 5, 3), (2, 2))
    """
    if batch < 1 or n_obs < 1:
        raise ValueError(f"sample_navigation_tasks: need batch >= 1 and n_obs >= 1; got {batch}, {n_obs}")
    dtype = dtype or torch.float32
    # Drawn in float64 so that the float32 and float64 streams of one seed hold the same tasks.
    target = TARGET_STD * torch.randn(batch, 2, generator=generator, dtype=torch.float64)
    probes = PROBE_STD * torch.randn(batch, n_obs, 2, generator=generator, dtype=torch.float64)
    dist2 = (probes - target[:, None]).pow(2).sum(-1, keepdim=True)
    return NavigationBatch(torch.cat([probes, dist2], -1).to(dtype), target.to(dtype))


def least_squares_target(obs):
    """The target that explains the observations ``obs [B, N, 3]`` best (exact for noise-free data, N ≥ 3).

    Solves ``‖p_i‖² − d_i = 2 p_i·t − c`` for ``(t, c)`` by least squares (``c`` stands for ``‖t‖²``;
    leaving it free keeps the problem linear).
    """
    if obs.dim() != 3 or obs.shape[-1] != 3 or obs.shape[1] < 3:
        raise ValueError(f"least_squares_target: need obs [B, N >= 3, 3]; got {tuple(obs.shape)}")
    p, d = obs[..., :2], obs[..., 2]
    design = torch.cat([2 * p, -torch.ones_like(d)[..., None]], -1)            # [B, N, 3]
    rhs = (p.pow(2).sum(-1) - d)[..., None]                                   # [B, N, 1]
    return torch.linalg.lstsq(design, rhs).solution[:, :2, 0]


def greedy_action(position, goal):
    """The controller: step straight at ``goal``, each coordinate clipped to ``±MAX_STEP``."""
    return (goal - position).clamp(-MAX_STEP, MAX_STEP)


def rollout(goal, target, horizon: int = 100):
    """Run the greedy controller aimed at ``goal [B, 2]`` in the environment whose target is ``target``.

    Returns ``(returns [B], final_distance [B])``: the sum over the ``horizon`` steps of the reward
    ``−‖position − target‖`` (after each step) and the distance left at the end.

    Examples
    --------
    >>> import torch
    >>> t = torch.tensor([[0.3, 0.0]])
    >>> ret, final = rollout(t, t, horizon=4)          # steps 0.1, 0.1, 0.1, then stays
    >>> [round(x, 6) for x in (ret.item(), final.item())]
    [-0.3, 0.0]
    """
    if goal.dim() != 2 or goal.shape[-1] != 2 or goal.shape != target.shape or horizon < 1:
        raise ValueError(f"rollout: need goal and target [B, 2] and horizon >= 1; got {tuple(goal.shape)}, "
                         f"{tuple(target.shape)}, {horizon}")
    position = torch.zeros_like(target)
    total = torch.zeros_like(target[:, 0])
    for _ in range(horizon):
        position = position + greedy_action(position, goal)
        total = total - (position - target).norm(dim=-1)
    return total, (position - target).norm(dim=-1)
