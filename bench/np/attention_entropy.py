"""How sharply each attention layer of a trained NP model attends: a diagnostic for the GP plateau.

A model on the prior-level plateau (log-likelihood about −0.57 on RBF tasks, issue 7) predicts from
global statistics of the context. Its attention layers show it: the targets' attention over the latents
stays uniform (normalised entropy 1.00, the same weight on every key) even after training, so the
targets cannot read what sits near their x. This module records, for every
:class:`attn_ext.nn.MultiheadCrossAttention` a forward pass goes through, the entropy of the softmax
over keys divided by ``log(number of keys)`` (1 = uniform, 0 = one key) and the spread of the logits.

``python -m bench.np.attention_entropy RUN_DIR [--batches N]`` prints the table for the
checkpoint in ``RUN_DIR`` (from ``python -m bench train gp``) on fresh RBF tasks.
"""
from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from attn_ext.nn import MultiheadCrossAttention
from bench.harness.report import markdown_table
from bench.np.checkpoint import load_checkpoint
from bench.np.tasks.np_tasks import gp_task


@dataclass
class AttentionSharpness:
    """Accumulated over the calls of one attention module: mean normalised entropy and logit std."""

    entropy: List[float] = field(default_factory=list)
    logit_std: List[float] = field(default_factory=list)

    def add(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]) -> None:
        logits = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # [B, H, L, S]
        if key_padding_mask is not None:
            logits = logits.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
            keys = (~key_padding_mask).sum(-1).clamp_min(1).float()[:, None, None]
        else:
            keys = torch.full(logits.shape[:1], float(logits.shape[-1]))[:, None, None]
        weights = torch.softmax(logits, dim=-1)
        entropy = -(weights * torch.log(weights.clamp_min(1e-30))).sum(-1)
        # One key carries no choice: count it as sharp (0) rather than dividing by log(1) = 0.
        normalised = torch.where(keys > 1, entropy / torch.log(keys.clamp_min(2)), torch.zeros_like(entropy))
        finite = torch.where(torch.isfinite(logits), logits, torch.nan)
        spread = (finite - finite.nanmean(-1, keepdim=True)).pow(2).nanmean(-1).sqrt()
        self.entropy.append(normalised.mean().item())
        self.logit_std.append(spread.nanmean().item())

    @property
    def calls(self) -> int:
        return len(self.entropy)

    @property
    def mean_entropy(self) -> float:
        return sum(self.entropy) / len(self.entropy)

    @property
    def mean_logit_std(self) -> float:
        return sum(self.logit_std) / len(self.logit_std)


def heads(module: MultiheadCrossAttention, x: Tensor, which: int) -> Tensor:
    """The query (``which`` 0) or key (1) projection of ``x`` as ``[B, H, L, E/H]``, from the module's public
    parameters (laid out as ``torch.nn.MultiheadAttention``'s)."""
    weight = (module.in_proj_weight.chunk(3)[which] if module.in_proj_weight is not None
              else (module.q_proj_weight, module.k_proj_weight)[which])
    bias = None if module.in_proj_bias is None else module.in_proj_bias.chunk(3)[which]
    x = x if module.batch_first else x.transpose(0, 1)
    return nn.functional.linear(x, weight, bias).unflatten(-1, (module.num_heads, module.head_dim)).transpose(1, 2)


@contextmanager
def record_attention(model: nn.Module) -> Iterator[Dict[str, AttentionSharpness]]:
    """Within the block, every ``MultiheadCrossAttention.state`` call of ``model`` (every forward
    goes through it) adds its sharpness under the module's name; the model computes as before.
    The incremental calls (``update``, ``stream``: a CMANP conditioning in chunks) are not recorded."""
    records: Dict[str, AttentionSharpness] = {}
    patched = []
    for name, module in model.named_modules():
        if not isinstance(module, MultiheadCrossAttention):
            continue
        original = module.state

        def state(query, key, value, key_padding_mask=None, _module=module, _name=name, _original=original):
            with torch.no_grad():
                records.setdefault(_name, AttentionSharpness()).add(
                    heads(_module, query, 0), heads(_module, key, 1), key_padding_mask)
            return _original(query, key, value, key_padding_mask)

        module.state = state
        patched.append(module)
    try:
        yield records
    finally:
        for module in patched:
            del module.state  # back to the class's method


def sharpness_table(model: nn.Module, batches: Sequence) -> List[list]:
    """Rows ``[module, calls, normalised entropy, logit std]`` of ``model.predict`` on ``batches``."""
    model.eval()
    with record_attention(model) as records, torch.no_grad():
        for batch in batches:
            model.predict(batch.xc, batch.yc, batch.xt)
    return [[name, r.calls, round(r.mean_entropy, 3), round(r.mean_logit_std, 3)] for name, r in records.items()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.np.attention_entropy", description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="run directory of `python -m bench train gp`")
    parser.add_argument("--batches", type=int, default=8, help="RBF batches of 16 tasks (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model, meta = load_checkpoint(args.run)
    if meta.get("task", "gp") != "gp":
        parser.error(f"{args.run} is a {meta['task']} run; this diagnostic samples GP tasks")
    task = gp_task(**meta.get("task_settings", {}))
    generator = torch.Generator().manual_seed(args.seed)
    rows = sharpness_table(model, [task.sample(16, generator) for _ in range(args.batches)])
    print(f"{meta['model']} at step {meta['step']} ({args.run}): normalised entropy 1 = uniform attention")
    print(markdown_table(["attention", "calls", "entropy / log(keys)", "logit std"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
