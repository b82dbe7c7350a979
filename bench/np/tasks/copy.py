"""Copy task of Tree Cross Attention (Feng et al., §4.1): retrieve one token out of the context.

A sequence of length ``N = 2^k`` is ``[BOS] palindrome of N − 2 digits [EOS]``. The first half is the
context; each position ``t`` of the second half is a query whose answer is the token at context
position ``N − 1 − t`` (the palindrome's mirror; position ``N − 1`` is ``[EOS]``). Digits are uniform,
so a model must actually retrieve: without retrieval the accuracy is about 10 %.

The model is deliberately tiny and has no encoder across tokens (the task needs none): a context
token is ``embed(token) + MLP(features(position))``, a query ``MLP'(features(position))``; one
:class:`attn_ext.nn.TreeCrossAttention` (tree sorted by position) and a classifier over the 12
symbols. ``tca`` (CLI name ``retreever``) trains with ``L = L_TCA + L_CA + L_RL`` (λ = 1, α = 0.01 as
in the paper, reward = 0/1 accuracy of the sampled TCA prediction minus its batch mean, docs/spec.md §3) and
is evaluated greedily on ``tree_num_selected(N/2, b)`` tokens; ``ca`` is the same model trained and
evaluated with full cross attention over the context.

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
from torch import Tensor, nn

from attn_ext import tree_num_selected
from attn_ext.nn import TreeCrossAttention, tca_loss

BOS, EOS, VOCAB = 10, 11, 12
KINDS = ("tca", "ca")


@dataclass
class CopyConfig:
    """Settings of one copy-task run (the defaults are the ones measured in bench/results/copy_task.md).

    Attributes
    ----------
    seq_len : int
        ``N = 2^k >= 8``; the context is the first ``N/2`` tokens.
    kind : {"tca", "ca"}
        Tree cross attention with the TCA objective, or full cross attention.
    steps, batch, dim, heads, branching, lr, seed, alpha, baseline, log_every, eval_size, stop_at
        Training budget and sizes; ``alpha`` is the entropy weight, ``baseline`` subtracts the batch-mean
        reward, training stops once the evaluation accuracy reaches ``stop_at``.
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

    def __post_init__(self) -> None:
        if self.seq_len < 8 or self.seq_len & (self.seq_len - 1):
            raise ValueError(f"copy task: seq_len must be a power of two >= 8, got {self.seq_len}")
        if self.kind not in KINDS:
            raise ValueError(f"copy task: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if min(self.steps, self.batch, self.log_every, self.eval_size) <= 0:
            raise ValueError("copy task: steps, batch, log_every and eval_size must be positive")


def copy_batch(batch: int, seq_len: int, generator: torch.Generator):
    """``(context tokens [B, N/2], query positions [N/2], targets [B, N/2])`` of random palindromes."""
    half = torch.randint(0, 10, (batch, (seq_len - 2) // 2), generator=generator)
    seq = torch.cat([torch.full((batch, 1), BOS), half, half.flip(1), torch.full((batch, 1), EOS)], dim=1)
    c = seq_len // 2
    return seq[:, :c], torch.arange(c, seq_len), seq[:, c:]


def position_features(pos: Tensor, seq_len: int, num_freq: int = 6) -> Tensor:
    """``[.., 2 + 2·num_freq]``: p, p² and Fourier features of ``p = pos / seq_len``.

    p and p² let a mean over a subtree (a node embedding) still say where the subtree lies, which
    the policy needs to choose the child that contains the wanted position; the Fourier features
    let the final attention single out one position among neighbours.
    """
    p = pos.float().unsqueeze(-1) / seq_len
    freq = math.pi * 2.0 ** torch.arange(num_freq, dtype=torch.float32)
    return torch.cat([p, p * p, torch.sin(p * freq), torch.cos(p * freq)], dim=-1)


def _mlp(d_in: int, dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, dim), nn.ReLU(), nn.Linear(dim, dim))


class CopyModel(nn.Module):
    """Embeddings, one TreeCrossAttention and a classifier; see the module docstring."""

    def __init__(self, seq_len: int, dim: int, heads: int, branching: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        n_feat = position_features(torch.zeros(1), seq_len).shape[-1]
        self.token = nn.Embedding(VOCAB, dim)
        self.context_pos, self.query_pos = _mlp(n_feat, dim), _mlp(n_feat, dim)
        self.attention = TreeCrossAttention(dim, heads, branching=branching)
        self.classifier = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, VOCAB))

    def encode(self, context: Tensor, query_pos: Tensor):
        """``(tree state of the context, query embeddings [B, N_q, dim])``."""
        B, c = context.shape
        ctx_pos = torch.arange(c)
        ctx = self.token(context) + self.context_pos(position_features(ctx_pos, self.seq_len))
        query = self.query_pos(position_features(query_pos, self.seq_len)).expand(B, -1, -1)
        return self.attention.build(ctx, ctx_pos.float().expand(B, c)), query


def _loss(model: CopyModel, cfg: CopyConfig, gen: torch.Generator):
    """``(loss, training accuracy)`` of one fresh batch."""
    context, query_pos, target = copy_batch(cfg.batch, cfg.seq_len, gen)
    state, query = model.encode(context, query_pos)
    full_logits = model.classifier(model.attention.forward_full(query, state))
    l_ca = F.cross_entropy(full_logits.flatten(0, 1), target.flatten())
    if cfg.kind == "ca":
        return l_ca, (full_logits.argmax(-1) == target).float().mean()
    res = model.attention(query, state, policy="sample", generator=gen)
    logits = model.classifier(res.out)
    l_tca = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    reward = (logits.argmax(-1) == target).float()  # accuracy reward: needs no gradient
    acc = reward.mean()
    if cfg.baseline:
        # With a 0/1 reward a failed descent gets no gradient at all, so a confidently wrong
        # branch is never pushed down; centring the reward makes failures count.
        reward = reward - acc
    return tca_loss(l_tca, l_ca, reward, res.log_prob, res.entropy, alpha=cfg.alpha), acc


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
    model = CopyModel(cfg.seq_len, cfg.dim, cfg.heads, cfg.branching)
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
    c = cfg.seq_len // 2
    read = tree_num_selected(c, cfg.branching) if cfg.kind == "tca" else c
    return dict(asdict(cfg), steps_run=step, train_time=round(train_time, 1), accuracy=accuracy, read=read,
                context=c, fraction_read=read / c)


@torch.no_grad()
def evaluate(model: CopyModel, cfg: CopyConfig, size: int, seed: int) -> float:
    """Accuracy over ``size`` fresh sequences; TCA greedy (eval mode), CA over all context tokens."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    correct = total = 0
    for lo in range(0, size, 512):
        context, query_pos, target = copy_batch(min(512, size - lo), cfg.seq_len, gen)
        state, query = model.encode(context, query_pos)
        out = model.attention.forward_full(query, state) if cfg.kind == "ca" else model.attention(query, state).out
        correct += (model.classifier(out).argmax(-1) == target).sum().item()
        total += target.numel()
    return correct / total


def summary_line(r: dict) -> str:
    """One line: accuracy, steps, time and the fraction of context tokens each query read."""
    return (f"{r['kind']:>3}: accuracy {100 * r['accuracy']:6.2f} %  after {r['steps_run']} steps "
            f"({r['train_time']:.0f} s); tokens read per query {r['read']}/{r['context']} "
            f"= {100 * r['fraction_read']:.2f} %")
