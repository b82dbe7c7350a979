"""Copy task of Tree Cross Attention (Feng et al., §4.1): retrieve one token out of the context.

A sequence of length ``N = 2^k`` is ``[BOS] palindrome of N − 2 digits [EOS]``. The first half is the
context; each position ``t`` of the second half is a query whose answer is the token at context
position ``N − 1 − t`` (the palindrome's mirror; position ``N − 1`` is ``[EOS]``). Digits are uniform,
so a model must actually retrieve: without retrieval the accuracy is about 10 %.

The models (:mod:`bench.np.tasks.copy_models`) are deliberately tiny and have no encoder across
tokens (the task needs none): a context token is ``embed(token) + MLP(features(position))``, a query
``MLP'(features(position))``, and a classifier over the 12 symbols reads what the query retrieved.

``tca`` (CLI name ``retreever``) retrieves with one :class:`attn_ext.nn.TreeCrossAttention` (tree
sorted by position unless ``tree_design`` says otherwise) and trains with
``L = L_TCA + λ_CA·L_CA + λ_RL·L_RL`` (λ = 1, α = 0.01 as in the paper; reward = 0/1 accuracy of the
sampled TCA prediction, or its negative cross entropy, minus the batch mean); it is evaluated greedily
on ``tree_num_selected(N/2, b)`` tokens. ``ca`` is the same model trained and evaluated with full
cross attention over the context. ``perceiver`` is Perceiver IO at an equal token budget: as many
learned latents as TCA reads tokens (settable), the queries read only the latents.

The fraction of tokens read is the paper's "% tokens": ``N = 128 → 7/64 = 10.9 %``,
``256 → 8/128 = 6.25 %``, ``512 → 9/256 = 3.5 %`` (b = 2).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from attn_ext import tree_num_selected
from attn_ext.nn import tca_loss
from bench.np.tasks.copy_models import (BOS, EOS, TREE_DESIGNS, VOCAB, CopyModel, PerceiverCopyModel,  # noqa: F401
                                        position_features)

KINDS = ("tca", "ca", "perceiver")
#: RL rewards of ``tca`` (Tree Cross Attention, Table 5): 0/1 accuracy or the negative cross entropy.
REWARDS = ("accuracy", "neg-ce")


@dataclass
class CopyConfig:
    """Settings of one copy-task run (the defaults are the ones measured in bench/results/copy_task.md).

    Attributes
    ----------
    seq_len : int
        ``N = 2^k >= 8``; the context is the first ``N/2`` tokens.
    kind : {"tca", "ca", "perceiver"}
        Tree cross attention with the TCA objective, full cross attention, or Perceiver IO.
    steps, batch, dim, heads, branching, lr, seed, alpha, baseline, log_every, eval_size, stop_at
        Training budget and sizes; ``alpha`` is the entropy weight, ``baseline`` subtracts the batch-mean
        reward, training stops once the evaluation accuracy reaches ``stop_at``.
    tree_design : str
        ``tca`` only: leaf order, one of :data:`bench.np.tasks.copy_models.TREE_DESIGNS` (default ``position``).
    reward : {"accuracy", "neg-ce"}
        ``tca`` only: the REINFORCE reward (default the paper's accuracy).
    lambda_rl, lambda_ca : float
        ``tca`` only: weights of the RL and the full-cross-attention terms (paper: 1, 1).
    latents : int, optional
        ``perceiver`` only: number of latents = tokens each query reads (default: TCA's budget,
        ``tree_num_selected(N/2, branching)``).
    perceiver_layers : int
        ``perceiver`` only: iterative attention blocks (cross attention + latent self attention).
    """

    seq_len: int = 64
    kind: str = "tca"
    steps: int = 2200
    batch: int = 64
    dim: int = 64
    heads: int = 4
    branching: int = 2
    lr: float = 1e-3
    seed: int = 0
    alpha: float = 0.01
    baseline: bool = True
    log_every: int = 100
    eval_size: int = 3200
    stop_at: float = 1.0
    tree_design: str = "position"
    reward: str = "accuracy"
    lambda_rl: float = 1.0
    lambda_ca: float = 1.0
    latents: Optional[int] = None
    perceiver_layers: int = 1

    def __post_init__(self) -> None:
        if self.seq_len < 8 or self.seq_len & (self.seq_len - 1):
            raise ValueError(f"copy task: seq_len must be a power of two >= 8, got {self.seq_len}")
        if self.kind not in KINDS:
            raise ValueError(f"copy task: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if min(self.steps, self.batch, self.log_every, self.eval_size, self.perceiver_layers) <= 0:
            raise ValueError("copy task: steps, batch, log_every, eval_size and perceiver_layers must be positive")
        if self.tree_design not in TREE_DESIGNS:
            raise ValueError(f"copy task: tree_design must be one of {', '.join(TREE_DESIGNS)}, "
                             f"got {self.tree_design!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"copy task: reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        for name in ("lambda_rl", "lambda_ca", "alpha"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"copy task: {name} must be a finite number >= 0, got {value!r}")
        if self.latents is not None and (not isinstance(self.latents, int) or self.latents < 1):
            raise ValueError(f"copy task: latents must be a positive int, got {self.latents!r}")
        # Options of one kind given to another would be silently ignored: refuse them instead.
        tca_only = dict(tree_design="position", reward="accuracy", lambda_rl=1.0, lambda_ca=1.0)
        changed = [k for k, v in tca_only.items() if getattr(self, k) != v]
        if self.kind != "tca" and changed:
            raise ValueError(f"copy task: {', '.join(changed)} only apply to kind 'tca', not {self.kind!r}")
        if self.kind != "perceiver" and (self.latents is not None or self.perceiver_layers != 1):
            raise ValueError(f"copy task: latents and perceiver_layers only apply to kind 'perceiver', "
                             f"not {self.kind!r}")

    def tokens_read(self) -> int:
        """Context tokens (tree nodes, latents) each query reads at evaluation."""
        c = self.seq_len // 2
        if self.kind == "tca":
            return tree_num_selected(c, self.branching)
        if self.kind == "perceiver":
            return self.latents if self.latents is not None else tree_num_selected(c, self.branching)
        return c


def copy_batch(batch: int, seq_len: int, generator: torch.Generator):
    """``(context tokens [B, N/2], query positions [N/2], targets [B, N/2])`` of random palindromes."""
    half = torch.randint(0, 10, (batch, (seq_len - 2) // 2), generator=generator)
    seq = torch.cat([torch.full((batch, 1), BOS), half, half.flip(1), torch.full((batch, 1), EOS)], dim=1)
    c = seq_len // 2
    return seq[:, :c], torch.arange(c, seq_len), seq[:, c:]


def build_model(cfg: CopyConfig):
    """The model of ``cfg.kind``."""
    if cfg.kind == "perceiver":
        return PerceiverCopyModel(cfg.seq_len, cfg.dim, cfg.heads, cfg.tokens_read(), cfg.perceiver_layers)
    return CopyModel(cfg.seq_len, cfg.dim, cfg.heads, cfg.branching, cfg.tree_design)


def rl_reward(logits, target, kind: str):
    """``[B, M]`` per-query reward of the sampled TCA predictions (no gradient)."""
    logits = logits.detach()
    if kind == "accuracy":
        return (logits.argmax(-1) == target).float()
    return -F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


def _loss(model, cfg: CopyConfig, gen: torch.Generator):
    """``(loss, training accuracy)`` of one fresh batch."""
    context, query_pos, target = copy_batch(cfg.batch, cfg.seq_len, gen)
    if cfg.kind == "perceiver":
        logits = model(context, query_pos)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()), (logits.argmax(-1) == target).float().mean()
    state, query = model.encode(context, query_pos, gen)
    full_logits = model.classifier(model.attention.forward_full(query, state))
    l_ca = F.cross_entropy(full_logits.flatten(0, 1), target.flatten())
    if cfg.kind == "ca":
        return l_ca, (full_logits.argmax(-1) == target).float().mean()
    res = model.attention(query, state, policy="sample", generator=gen)
    logits = model.classifier(res.out)
    l_tca = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    acc = (logits.argmax(-1) == target).float().mean()
    reward = rl_reward(logits, target, cfg.reward)
    if cfg.baseline:
        # With a 0/1 reward a failed descent gets no gradient at all, so a confidently wrong
        # branch is never pushed down; centring the reward makes failures count.
        reward = reward - reward.mean()
    return tca_loss(l_tca, l_ca, reward, res.log_prob, res.entropy, lambda_ca=cfg.lambda_ca,
                    lambda_rl=cfg.lambda_rl, alpha=cfg.alpha), acc


def train(cfg: CopyConfig, log: Optional[Callable[[str], None]] = None) -> dict:
    """Train one model on fresh batches; returns accuracy, steps, time and tokens read per query.

    Examples
    --------
    >>> from bench.np.tasks.copy import CopyConfig, train
    >>> r = train(CopyConfig(seq_len=8, steps=2, eval_size=8, log_every=10), log=lambda m: None)
    >>> r["read"], r["context"]
    (3, 4)
    """
    log = log or (lambda msg: print(msg, flush=True))
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        model.train()
        loss, acc = _loss(model, cfg, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps:
            val = evaluate(model, cfg, 512, seed=10_000 + step)
            log(f"[{cfg.kind}] step {step:5d}  loss {loss.item():.4f}  train acc {acc.item():.3f}  "
                f"eval acc {val:.4f}  {time.perf_counter() - start:6.1f}s")
            if val >= cfg.stop_at:
                break
    train_time = time.perf_counter() - start
    accuracy = evaluate(model, cfg, cfg.eval_size, seed=12345)
    c, read = cfg.seq_len // 2, cfg.tokens_read()
    return dict(asdict(cfg), steps_run=step, train_time=round(train_time, 1), accuracy=accuracy, read=read,
                context=c, fraction_read=read / c)


@torch.no_grad()
def evaluate(model, cfg: CopyConfig, size: int, seed: int) -> float:
    """Accuracy over ``size`` fresh sequences; TCA greedy (eval mode), CA over all context tokens,
    Perceiver IO over its latents."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    correct = total = 0
    for lo in range(0, size, 512):
        context, query_pos, target = copy_batch(min(512, size - lo), cfg.seq_len, gen)
        if cfg.kind == "perceiver":
            logits = model(context, query_pos)
        else:
            state, query = model.encode(context, query_pos, gen)
            out = model.attention.forward_full(query, state) if cfg.kind == "ca" else model.attention(query, state).out
            logits = model.classifier(out)
        correct += (logits.argmax(-1) == target).sum().item()
        total += target.numel()
    return correct / total


def summary_line(r: dict) -> str:
    """One line: accuracy, steps, time and the fraction of context tokens each query read."""
    ablation = ""
    if r["kind"] == "tca" and (r.get("tree_design", "position"), r.get("reward", "accuracy"),
                               r.get("lambda_rl", 1.0), r.get("lambda_ca", 1.0)) != ("position", "accuracy", 1.0, 1.0):
        ablation = (f" [tree {r['tree_design']}, reward {r['reward']}, λ_RL {r['lambda_rl']:g}, "
                    f"λ_CA {r['lambda_ca']:g}]")
    return (f"{r['kind']:>3}: accuracy {100 * r['accuracy']:6.2f} %  after {r['steps_run']} steps "
            f"({r['train_time']:.0f} s); tokens read per query {r['read']}/{r['context']} "
            f"= {100 * r['fraction_read']:.2f} %{ablation}")
