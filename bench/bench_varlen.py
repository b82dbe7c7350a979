"""``python -m bench run varlen``: a packed batch of sequences of different lengths against PyTorch's SDPA on the
same batch padded to its longest sequence, on the CPU.

An NP-like batch: B = 64 sets, self-attention over each, lengths drawn uniformly from [3, 197) and, for a spread
of 10×, from [20, 200); H = 8 heads of D = 16 (a 128-wide model), fp32, forward+backward.
``ae.varlen_attention(q, k, v, cu, cu)`` on the packed rows against ``F.scaled_dot_product_attention`` on
``[B, H, L_max, D]`` with a key padding mask, timed in this process with the samples interleaved.

Goal (issue 44): varlen / padded SDPA ≤ :data:`MAX_RATIO`, each distribution. On the ``cpp`` backend the packed
batch is one kernel call whose tiles follow the sequences, so the work is that of the real pairs only. Writes
``varlen.{md,json}`` (seconds on 2 cores).
"""

from __future__ import annotations

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "varlen"
B, H, D = 64, 8, 16
SPREADS = {"U[3, 197)": (3, 197), "U[20, 200) (10x spread)": (20, 200)}
MAX_RATIO = 0.6


def batch(low: int, high: int, seed: int = 0):
    """``(lengths, cu, (q, k, v) packed, (q, k, v) padded, key padding mask [B, 1, 1, L_max])``, requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (B,), generator=gen).tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = [torch.randn(sum(lengths), H, D, generator=gen) for _ in range(3)]
    longest = max(lengths)
    padded = [torch.zeros(B, H, longest, D) for _ in range(3)]
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        for dst, src in zip(padded, packed):
            dst[b, :, :n] = src[start:start + n].transpose(0, 1)
    mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return lengths, cu, [t.requires_grad_() for t in packed], [t.requires_grad_() for t in padded], mask


def measure(low: int, high: int, backend: str, repeats: int) -> dict:
    lengths, cu, packed, padded, mask = batch(low, high)
    g_packed = torch.randn(packed[0].shape[:2] + (D,))
    g_padded = torch.randn(padded[0].shape[:3] + (D,))

    def ours():
        out = ae.varlen_attention(*packed, cu, cu, backend=backend)
        return torch.autograd.grad(out, packed, g_packed)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(*padded, attn_mask=mask)
        return torch.autograd.grad(out, padded, g_padded)

    timings = time_interleaved({"varlen": ours, "sdpa_padded": sdpa}, repeats=repeats, warmup=1)
    a, b = median_ms(timings["varlen"]), median_ms(timings["sdpa_padded"])
    return {"lengths": lengths, "varlen": timing_dict(timings["varlen"]), "sdpa_padded": timing_dict(timings["sdpa_padded"]),
            "ratio": None if a is None or b is None else a / b,
            "padding_share": 1 - sum(n * n for n in lengths) / (B * max(lengths) ** 2)}


def _tables(result: dict) -> str:
    rows = [[name, format_ms(r["varlen"]["median_ms"]), format_ms(r["sdpa_padded"]["median_ms"]),
             f"{r['padding_share']:.0%}", "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x",
             "n/a" if r["ratio"] is None else ("met" if r["ratio"] <= MAX_RATIO else "NOT met")]
            for name, r in result["rows"].items()]
    return (f"`ae.varlen_attention` (backend `{result['backend']}`) vs SDPA on the padded batch, B = {B}, H = {H}, "
            f"D = {D}, fp32, forward+backward; {result['machine_text']}\n\n"
            + markdown_table(["lengths", "varlen ms", "padded SDPA ms", "padded pairs wasted", "varlen / SDPA",
                              f"goal ≤ {MAX_RATIO:g}"], rows))


def _summary(result: dict) -> tuple:
    rows = [[name, f"{r['padding_share']:.0%}", "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x",
             "n/a" if r["ratio"] is None else ("met" if r["ratio"] <= MAX_RATIO else "NOT met")]
            for name, r in result["rows"].items()]
    table = markdown_table(["lengths", "padded pairs wasted", "varlen / padded SDPA", f"goal ≤ {MAX_RATIO:g}"], rows)
    return table, (f"`ae.varlen_attention` on a packed NP-like batch (B = {B} sets, self-attention, H = {H}, D = {D}, "
                   f"fp32, forward+backward, `{result['backend']}`, 2 threads) / PyTorch's SDPA on the same batch "
                   "padded to its longest set.")


def run(options: BenchOptions) -> int:
    machine = machine_info()
    progress(f"{NAME} benchmark: B = {B}, H = {H}, D = {D}, backend={options.backend}; {machine_markdown(machine)}")
    rows = {}
    for name, (low, high) in SPREADS.items():
        progress(f"  lengths {name} ...")
        rows[name] = measure(low, high, options.backend, options.repeats)
    result = {"backend": options.backend, "rows": rows, "machine": machine, "machine_text": machine_markdown(machine),
              "warnings": []}
    return publish_run(NAME, result, _tables, _summary, options)
