"""The ``sdpa`` benchmark's third part: a Transformer encoder's training step before and after
``ae.nn.swap_attention``.

Model: ``torch.nn.TransformerEncoder`` of :data:`LAYERS` ``TransformerEncoderLayer(d_model=D_MODEL,
nhead=NHEAD, dim_feedforward=FFN, dropout=DROPOUT, batch_first=True)``, fp32, CPU, no mask (plain
self-attention). One step: forward on ``x [batch, L, D_MODEL]`` (batch :data:`BATCH`, :data:`QUICK_BATCH`
on the quick grid), mean squared error to a fixed target,
backward, ``torch.optim.AdamW.step()``, ``zero_grad``. **torch** is the model as built; **swapped** is a
deep copy (the same weights) after ``ae.nn.swap_attention(copy, backend=...)``, with its own optimizer.
Before timing, both models' outputs and parameter gradients on the same batch are compared
(:func:`check_swapped`). No goal: the report gives swapped / torch.

Dropout is 0 so that the check can compare the two models exactly (with attention dropout, the two
would drop different pairs); the attention share of the step grows with L, hence two lengths.
"""

from __future__ import annotations

import copy
import gc
from typing import Callable

import torch

import attn_ext.nn
from bench.harness import BenchOptions
from bench.harness.report import format_ms, markdown_table, progress, timing_dict
from bench.harness.timing import time_interleaved

D_MODEL, NHEAD, LAYERS, FFN = 256, 8, 4, 1024
DROPOUT = 0.0
#: Batch of the full grid; the quick grid halves it so that ``make bench`` stays short.
BATCH, QUICK_BATCH, TINY_BATCH = 8, 4, 2
FULL_LS: tuple[int, ...] = (256, 1024)
QUICK_LS: tuple[int, ...] = (256,)
TINY_LS: tuple[int, ...] = (32,)
LR = 1e-4
IMPLS: tuple[str, ...] = ("torch", "swapped")
#: Max relative difference of the swapped model's output and gradients to torch's above which the report warns.
CHECK_ATOL = 1e-4
MIN_TIMED_S, QUICK_MIN_TIMED_S = 3.0, 1.0


def make_model(seed: int = 0) -> torch.nn.Module:
    """The encoder described in the module docstring, in training mode, weights drawn from ``seed``."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=FFN, dropout=DROPOUT, batch_first=True)
    # enable_nested_tensor only matters for padded inputs in inference; off, it does not warn.
    return torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).train()


def make_batch(length: int, batch: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ``x`` and regression target, both ``[batch, length, D_MODEL]``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, length, D_MODEL, generator=gen) for _ in range(2))


def models(backend: str) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """``(torch_model, swapped_model, swap report text)``: the swapped one a deep copy of the first."""
    reference = make_model()
    swapped = copy.deepcopy(reference)
    report = attn_ext.nn.swap_attention(swapped, backend=backend)
    return reference, swapped, str(report)


def loss_of(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), target)


def training_step(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> Callable[[], object]:
    """A zero-argument training step of ``model`` with its own AdamW optimizer."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        loss = loss_of(model, x, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def check_swapped(reference: torch.nn.Module, swapped: torch.nn.Module, x: torch.Tensor,
                  target: torch.Tensor) -> float:
    """Max difference of the two models' outputs and parameter gradients on one batch (measure passes fp64
    copies), each relative to
    the reference tensor's largest entry (before any
    optimizer step, so the weights are still equal); the gradients are cleared again."""
    outs, grads = [], []
    for model in (reference, swapped):
        out = model(x)
        torch.nn.functional.mse_loss(out, target).backward()
        outs.append(out.detach())
        # By name: the swap keeps torch's parameter names, not necessarily their registration order.
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    if set(grads[0]) != set(grads[1]):
        return float("inf")  # a parameter lost or added by the swap: reported as a mismatch
    pairs = [(outs[0], outs[1])] + [(grads[0][n], grads[1][n]) for n in grads[0]]
    # Relative to each tensor's largest entry: gradients summed over batch·L tokens grow with L.
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in pairs)


def measure(options: BenchOptions, lengths: tuple[int, ...], batch: int) -> dict:
    """Time the training step of both models at each length, after checking that they agree."""
    config = {"d_model": D_MODEL, "nhead": NHEAD, "layers": LAYERS, "dim_feedforward": FFN, "dropout": DROPOUT,
              "batch": batch, "Ls": list(lengths), "optimizer": f"AdamW(lr={LR:g})", "loss": "mse", "mask": None}
    result = {"config": config, "rows": [], "warnings": []}
    for length in lengths:
        # Fresh models per length: the timed steps train each model, and their weights drift apart by
        # rounding, so a later length's check would compare different models.
        reference, swapped, result["swap_report"] = models(options.backend)
        x, target = make_batch(length, batch)
        # In fp64 on fp64 copies, one sequence: in fp32 a ReLU pre-activation within rounding of 0 may flip
        # and move a feed-forward weight's gradient by a percent, which says nothing about the attention.
        diff = check_swapped(copy.deepcopy(reference).double(), copy.deepcopy(swapped).double(), x[:1].double(),
                             target[:1].double())
        if not diff <= CHECK_ATOL:
            result["warnings"].append(f"the swapped Transformer differs from torch's by {diff:.3g} relative (> {CHECK_ATOL:g}) "
                                      f"at L={length:,} (outputs or gradients)")
        progress(f"  L={length:,}: torch, swapped interleaved (check: max rel diff {diff:.2g}) ...", end="")
        calls = {"torch": training_step(reference, x, target), "swapped": training_step(swapped, x, target)}
        timed = time_interleaved(calls, repeats=options.repeats,
                                 min_timed_s=QUICK_MIN_TIMED_S if options.quick else MIN_TIMED_S)
        row = {"L": length, "check_max_rel_diff": diff, "impls": {i: timing_dict(timed[i]) for i in IMPLS}}
        result["rows"].append(row)
        progress(" " + ", ".join(f"{i} failed: {t['error']}" if t.get("error") else f"{i} {format_ms(t['median_ms'])} ms"
                                 for i, t in row["impls"].items()))
        del calls, timed
        gc.collect()
    return result


def step_ratio(row: dict) -> float | None:
    """Swapped step time over torch's; None when either failed."""
    a, b = row["impls"]["swapped"]["median_ms"], row["impls"]["torch"]["median_ms"]
    return a / b if a and b else None


def describe(train: dict) -> str:
    """One sentence naming the model and the step."""
    c = train["config"]
    return (f"`torch.nn.TransformerEncoder`, {c['layers']} layers of `TransformerEncoderLayer(d_model={c['d_model']}, "
            f"nhead={c['nhead']}, dim_feedforward={c['dim_feedforward']}, dropout={c['dropout']:g}, batch_first=True)`, "
            f"fp32, batch {c['batch']}, no mask; one training step = forward, MSE loss, backward, {c['optimizer']} "
            "step; **swapped** = a deep copy (same weights) after `ae.nn.swap_attention`")


def table(train: dict) -> str:
    """The part's Markdown: the sentence, then a row per L."""
    rows = [[f"{r['L']:,}", format_ms(r["impls"]["torch"]["median_ms"]), format_ms(r["impls"]["swapped"]["median_ms"]),
             None if (x := step_ratio(r)) is None else f"{x:.2f}x", f"{r['check_max_rel_diff']:.2g}"]
            for r in train["rows"]]
    return "\n".join([
        describe(train) + ". Samples of the two interleaved; no goal (the ratio is reported). "
        f"Swap: {train['swap_report'].splitlines()[0]}.",
        "",
        markdown_table(["L", "torch step ms", "swapped step ms", "swapped / torch", "check max rel diff"], rows),
    ])


def summary_sentence(train: dict) -> str:
    """The README's sentence on this part."""
    ratios = ", ".join(f"{x:.2f}x at L={r['L']:,}" for r in train["rows"] if (x := step_ratio(r)) is not None)
    c = train["config"]
    return (f"Training step of a {c['layers']}-layer Transformer encoder (d_model {c['d_model']}, {c['nhead']} heads, "
            f"batch {c['batch']}) after `ae.nn.swap_attention` / before: {ratios or 'n/a'}.")
