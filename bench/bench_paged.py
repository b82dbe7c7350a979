"""``python -m bench run paged``: decoding over a paged key/value cache against the same cache laid out contiguously,
on the CPU.

``ae.paged_attention(q, k_cache, v_cache, block_table, cache_seqlens)`` (blocks in a random order) against
``ae.scaled_dot_product_attention(q, k, v, alignment="bottom_right")`` on each entry's keys in one contiguous
tensor: B = 4 entries of L = 32768 keys, H = 8 heads, D = 128, one new query each, fp32, no gradient (decoding),
timed in this process with the samples interleaved, for blocks of 16 keys (vLLM's default) and of 256
(FlashAttention's). Decoding (at most 16 new tokens) takes all heads of an entry in one work unit, in turns on
chunks of whole blocks (at least 64 keys) gathered into the chunk's buffer while those blocks are in the cache.

Goal (issue 44): equal results and paged / contiguous ≤ :data:`MAX_RATIO`. Writes ``paged.{md,json}``.
"""

from __future__ import annotations

import torch

import attn_ext as ae
from bench.harness import BenchOptions
from bench.harness.goals import confirm
from bench.harness.machine import machine_info, machine_markdown
from bench.harness.report import format_ms, markdown_table, progress, publish_run, timing_dict
from bench.harness.timing import median_ms, time_interleaved

NAME = "paged"
B, H, M, D, L = 4, 8, 1, 128, 32768
BLOCK_SIZES = (16, 256)
MAX_RATIO = 1.2


def problem(block_size: int, seed: int = 0):
    """``(q, k_cache, v_cache, block_table, cache_seqlens, k, v)``: the paged cache and its contiguous copy."""
    gen = torch.Generator().manual_seed(seed)
    blocks = B * L // block_size
    k_cache = torch.randn(blocks, block_size, H, D, generator=gen)
    v_cache = torch.randn(blocks, block_size, H, D, generator=gen)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(B, L // block_size)
    k = k_cache[table.long()].reshape(B, L, H, D).transpose(1, 2).contiguous()
    v = v_cache[table.long()].reshape(B, L, H, D).transpose(1, 2).contiguous()
    return (torch.randn(B, H, M, D, generator=gen), k_cache, v_cache, table, torch.full((B,), L, dtype=torch.int32),
            k, v)


def measure(block_size: int, backend: str, repeats: int) -> dict:
    q, k_cache, v_cache, table, lengths, k, v = problem(block_size)
    paged = lambda: ae.paged_attention(q, k_cache, v_cache, table, lengths, backend=backend)  # noqa: E731
    contiguous = lambda: ae.scaled_dot_product_attention(q, k, v, alignment="bottom_right", backend=backend)  # noqa: E731
    diff = float((paged() - contiguous()).abs().max())
    timings = time_interleaved({"paged": paged, "contiguous": contiguous}, repeats=repeats, warmup=1)
    a, b = median_ms(timings["paged"]), median_ms(timings["contiguous"])
    return {"block_size": block_size, "paged": timing_dict(timings["paged"]),
            "contiguous": timing_dict(timings["contiguous"]), "ratio": None if a is None or b is None else a / b,
            "max_diff": diff}


def _rows(result: dict, full: bool) -> list:
    rows = []
    for r in result["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        cells = [r["block_size"], ratio, r["verdict"]]
        if full:
            cells[1:1] = [format_ms(r["paged"]["median_ms"]), format_ms(r["contiguous"]["median_ms"])]
            cells.insert(-1, f"{r['max_diff']:.1e}")
        rows.append(cells)
    return rows


def _tables(result: dict) -> str:
    return (f"Decoding over a paged cache (blocks in a random order) vs the same cache contiguous, B = {B}, L = {L}, "
            f"H = {H}, D = {D}, one query per entry, fp32, backend `{result['backend']}`; {result['machine_text']}\n\n"
            + markdown_table(["block size", "paged ms", "contiguous ms", "paged / contiguous", "max abs diff",
                              f"goal ≤ {MAX_RATIO:g}"], _rows(result, True)))


def _summary(result: dict) -> tuple:
    table = markdown_table(["block size", "paged / contiguous", f"goal ≤ {MAX_RATIO:g}"], _rows(result, False))
    return table, (f"`ae.paged_attention` over B = {B} entries of {L:,} cached keys (H = {H}, D = {D}, fp32, one new "
                   f"query, `{result['backend']}`, 2 threads) / the same attention over the cache laid out "
                   "contiguously.")


def run(options: BenchOptions) -> int:
    machine = machine_info()
    progress(f"{NAME} benchmark: block sizes {BLOCK_SIZES}, backend={options.backend}; {machine_markdown(machine)}")
    rows, warnings = [], []
    for block_size in BLOCK_SIZES:
        progress(f"  block size {block_size} ...")
        row = measure(block_size, options.backend, options.repeats)
        row["verdict"] = confirm(row["ratio"], MAX_RATIO, False,
                                 lambda bs=block_size: measure(bs, options.backend, options.repeats)["ratio"],
                                 f"paged / contiguous (block {block_size})", log=progress)["verdict"]
        if not row["max_diff"] <= 1e-5:
            warnings.append(f"block size {block_size}: paged differs from contiguous by {row['max_diff']:.3g}")
        rows.append(row)
    result = {"rows": rows, "backend": options.backend, "machine": machine,
              "machine_text": machine_markdown(machine), "warnings": warnings}
    return publish_run(NAME, result, _tables, _summary, options)
