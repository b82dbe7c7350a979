"""Deploying a pre-trained NP on the wheel bandit (CMANP App. C.2): UCB arm choice, the context grown
one observation per step, cumulative regret and the cost of each step.

At step t the agent sees the context ``x_t``, predicts the 5 arms' rewards from its history and pulls
``argmax(mean + std)`` (a random arm at t = 0, with no history), then adds ``(x_t, y_t)`` to its
history, where ``y_t`` holds the observed reward at the pulled arm and N(0, 1) noise at the others
(the official TNP code's convention). Two ways to keep the history:

* **incremental** (models with ``condition``/``update``/``query``, i.e. CMANP): the observation is
  absorbed into a constant-size state with ``update``, O(1) per step whatever t is;
* **recompute** (TNP-D, LBANP, …): the raw history is kept and ``predict`` re-encodes all of it at
  every step, O(t²) for TNP-D.

Regret is ``r*_t − r_t`` (the optimal arm's reward minus the pulled one's); the table reports the
cumulative regret as a percentage of the uniform policy's, whose regret is taken in expectation
(``r*_t − mean_a r_t(a)``) on the same problem.
"""
from __future__ import annotations

import time
from typing import Dict, List

import torch
from torch import Tensor

from bench.np.data.wheel import NUM_ARMS, WheelData, masked_rewards, sample_wheel


class IncrementalAgent:
    """History as a model state: ``condition`` on the first observation, ``update`` with each next."""

    mode = "incremental"

    def __init__(self, model) -> None:
        self.model, self.state = model, None

    @property
    def empty(self) -> bool:
        return self.state is None

    def predict(self, x: Tensor):
        return self.model.query(self.state, x)

    def observe(self, x: Tensor, y: Tensor) -> None:
        self.state = self.model.condition(x, y) if self.state is None else self.model.update(self.state, x, y)


class RecomputeAgent:
    """History as raw points, re-encoded by ``predict`` at every step."""

    mode = "recompute"

    def __init__(self, model) -> None:
        self.model, self.xs, self.ys = model, [], []

    @property
    def empty(self) -> bool:
        return not self.xs

    def predict(self, x: Tensor):
        # The concatenation is part of the cost the recomputing agent pays each step.
        return self.model.marginals(torch.cat(self.xs, 1), torch.cat(self.ys, 1), x)

    def observe(self, x: Tensor, y: Tensor) -> None:
        self.xs.append(x)
        self.ys.append(y)


def make_agent(model, mode: str = "auto"):
    """``incremental`` if the model has ``condition``/``update``/``query`` (``auto``), else ``recompute``."""
    incremental = all(hasattr(model, m) for m in ("condition", "update", "query"))
    if mode == "auto":
        mode = "incremental" if incremental else "recompute"
    if mode == "incremental" and not incremental:
        raise ValueError(f"{type(model).__name__} has no condition/update/query: use mode='recompute'")
    if mode not in ("incremental", "recompute"):
        raise ValueError(f"mode must be auto, incremental or recompute, got {mode!r}")
    return IncrementalAgent(model) if mode == "incremental" else RecomputeAgent(model)


@torch.no_grad()
def deploy(model, data: WheelData, seed: int = 0, mode: str = "auto") -> Dict[str, Tensor]:
    """Run one bandit episode over the contexts of ``data``; per-step tensors ``[T]``.

    Returns ``regret``, ``uniform_regret`` (expected), ``action``, ``decide_seconds`` (prediction and
    arm choice), ``update_seconds`` (absorbing the observation) and ``step_seconds`` (their sum).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import CMANP
    >>> from bench.np.data.wheel import sample_wheel
    >>> from bench.np.tasks.bandit import deploy
    >>> model = CMANP(dim_x=2, dim_y=5, num_layers=1, d_model=16, num_latents=4)
    >>> out = deploy(model, sample_wheel(5, 0.9, torch.Generator().manual_seed(0)))
    >>> out["regret"].shape, bool((out["regret"] >= -1).all())
    (torch.Size([5]), True)
    """
    model.eval()
    agent = make_agent(model, mode)
    gen = torch.Generator().manual_seed(seed)
    steps = data.x.shape[0]
    actions = torch.empty(steps, dtype=torch.long)
    decide, update = torch.empty(steps, dtype=torch.float64), torch.empty(steps, dtype=torch.float64)
    for t in range(steps):
        x = data.x[t].view(1, 1, 2)
        t0 = time.perf_counter()
        if agent.empty:
            arm = int(torch.randint(0, NUM_ARMS, (1,), generator=gen))
        else:
            pred = agent.predict(x)
            arm = int((pred.mean + pred.stddev).view(-1).argmax())
        t1 = time.perf_counter()
        y = masked_rewards(data.rewards[t].view(1, 1, NUM_ARMS), torch.tensor([[arm]]), gen)
        t2 = time.perf_counter()
        agent.observe(x, y)
        t3 = time.perf_counter()
        actions[t], decide[t], update[t] = arm, t1 - t0, t3 - t2
    rows = torch.arange(steps)
    return {"regret": data.opt_reward - data.rewards[rows, actions], "action": actions,
            "uniform_regret": data.opt_reward - data.rewards.mean(1), "decide_seconds": decide,
            "update_seconds": update, "step_seconds": decide + update, "mode": agent.mode}


def problem(delta: float, steps: int, seed: int) -> WheelData:
    """The wheel problem of ``(delta, seed)``: the same for every model compared."""
    return sample_wheel(steps, delta, torch.Generator().manual_seed(10_007 * seed + int(round(delta * 1000))))


def quadrant_arms(x: Tensor) -> Tensor:
    """The arm of each context's quadrant ``[N]`` (the arm that pays 50 when ``‖x‖ ≥ δ``)."""
    return torch.where(x[:, 1] > 0, torch.where(x[:, 0] > 0, 1, 2), torch.where(x[:, 0] <= 0, 3, 4))


def history_blind_regret_pct(delta: float, steps: int, seeds: int) -> List[float]:
    """Per seed, the regret (% of uniform) of the policy that always pulls the quadrant arm.

    It uses no history and no model: it is the best policy for a prior δ ~ U(0, 1) (at radius r the
    quadrant arm is worth 50·r in expectation, arm 0 only 1.2), and it gives away only arm 0's 0.2
    inside the radius, so at small δ it is hard to beat. A model whose regret is not below this
    row's has not learned to infer δ from its history.
    """
    out = []
    for seed in range(seeds):
        data = problem(delta, steps, seed)
        pulled = data.rewards[torch.arange(steps), quadrant_arms(data.x)]
        out.append(100.0 * (data.opt_reward - pulled).sum().item() / (data.opt_reward - data.rewards.mean(1)).sum().item())
    return out


def run_bandits(models: Dict[str, object], deltas: List[float], steps: int, seeds: int,
                mode: str = "auto", log=None) -> Dict[str, dict]:
    """Every model on every ``(δ, seed)`` problem; per model: normalised regrets and timing curves.

    Returns ``{name: {"mode", "regret_pct": {δ: [per seed]}, "cum_regret": {δ: [T] mean over seeds},
    "uniform_cum_regret": {δ: [T]}, "step_seconds": [T] mean over δ and seeds, "update_seconds",
    "decide_seconds"}}``.
    """
    if steps <= 0 or seeds <= 0 or not deltas:
        raise ValueError(f"bandit: steps and seeds must be positive and deltas non-empty, got {steps}, {seeds}, {deltas}")
    log = log or (lambda msg: None)
    out: Dict[str, dict] = {}
    for name, model in models.items():
        res = {"regret_pct": {}, "cum_regret": {}, "uniform_cum_regret": {}}
        timing = {k: torch.zeros(steps, dtype=torch.float64) for k in ("step_seconds", "update_seconds", "decide_seconds")}
        for delta in deltas:
            pct, cum, ucum = [], torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
            for seed in range(seeds):
                start = time.perf_counter()
                ep = deploy(model, problem(delta, steps, seed), seed=seed, mode=mode)
                pct.append(100.0 * ep["regret"].sum().item() / ep["uniform_regret"].sum().item())
                cum += ep["regret"].double().cumsum(0) / seeds
                ucum += ep["uniform_regret"].double().cumsum(0) / seeds
                for k in timing:
                    timing[k] += ep[k] / (seeds * len(deltas))
                res["mode"] = ep["mode"]
                log(f"[{name}] δ={delta} seed {seed}: regret {pct[-1]:.2f} % of uniform "
                    f"({time.perf_counter() - start:.1f} s, {ep['mode']})")
            res["regret_pct"][delta], res["cum_regret"][delta], res["uniform_cum_regret"][delta] = pct, cum, ucum
        res.update(timing)
        out[name] = res
    return out


def mean_std(values: List[float]) -> tuple:
    """``(mean, std)`` (population std, 0 for one value)."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std(unbiased=False).item() if len(values) > 1 else 0.0)


def binned(values: Tensor, bins: int) -> tuple:
    """``(centre steps, mean over each of ~bins consecutive chunks)``: a readable per-step curve."""
    size = max(1, values.shape[0] // bins)
    n = (values.shape[0] // size) * size
    means = values[:n].view(-1, size).mean(1)
    centres = torch.arange(means.shape[0]) * size + size / 2
    return centres, means


#: CMANP Table 7 (mean over 50 seeds, % of the uniform policy's cumulative regret).
PAPER = {
    "tnpd": {0.7: 1.18, 0.9: 1.70, 0.95: 2.55, 0.99: 3.57, 0.995: 4.68},
    "lbanp": {0.7: 1.11, 0.9: 1.75, 0.95: 1.65, 0.99: 6.13, 0.995: 8.76},
    "cmanp": {0.7: 0.93, 0.9: 1.56, 0.95: 1.87, 0.99: 9.04, 0.995: 13.02},
}
