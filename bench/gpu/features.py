"""GPU benchmark: what model authors reach for beyond dense attention (issue 44), each as a ratio against its own
baseline in the same process, with the time predicted before any GPU ran it beside the measured one.

- **window**: ``ae.scaled_dot_product_attention(..., is_causal=True, window_size=(256, 0))`` against the same
  backend's full causal call, B=1, H=8, L=S=16384, D=64, bf16 (the CPU benchmark's problem, in bf16): the key tiles
  outside the band are never visited, so the ratio is about the band's share of the causal pairs. Goal (CPU's):
  <= 0.1. Checked first against PyTorch's SDPA with the band as a mask on the last 256 queries.
- **varlen**: ``ae.varlen_attention`` of an NP-like packed batch (64 sequences, lengths drawn from U[3, 197), H=8,
  D=64, bf16, self-attention) against SDPA on the padded batch with a key padding mask, fwd+bwd. Goal (CPU's):
  <= 0.6. Checked first against SDPA's rows of the real queries.
- **decode**: one new query over a long cache, B=1, H=8, M=1, N=1,000,000, D=128, bf16, forward, against SDPA's
  flash kernel (which splits the keys over the SMs). Goal: <= 1.0.
- **bias**: a learned additive bias ``[H, L, S]`` that requires grad, B=4, H=8, L=S=2048, D=64, bf16, fwd+bwd
  (gradients of q, k, v and the bias) against SDPA (its memory-efficient kernel takes a bias with a gradient).
  Goal (CPU's, against SDPA's math path there): <= 1.0.
- **paged**: ``ae.paged_attention`` of one new token per entry over a paged cache (B=4 entries of 32,768 keys in
  16-key blocks in a random order, H=8, D=128, bf16) against the same backend's call over the cache laid out
  contiguously (``is_causal``, aligned at the end). Goal (CPU's): <= 1.2. Triton only (the CUDA kernels have no
  paged path).

Rows per case: one backend (``triton``, ``cuda``); the ratio is ours / baseline (below 1: ours faster).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import attn_ext as ae
from bench.gpu.checks import require_close
from bench.gpu.timing import TIME_LIMIT_NOTE, Budget, TooSlow, cuda_time
from bench.harness.report import markdown_table

NAME = "features"
BACKENDS = ("triton", "cuda")
KINDS = ("window", "varlen", "decode", "bias", "paged")
#: The backends each kind runs on (the CUDA kernels have no paged path).
KIND_BACKENDS = {kind: BACKENDS for kind in KINDS} | {"paged": ("triton",)}
#: Relative error allowed against PyTorch's bf16 result (gradients: twice).
TOLERANCE = 4e-2
WINDOW = dict(B=1, H=8, L=16384, D=64, left=256, checked_rows=256)
VARLEN = dict(sequences=64, H=8, D=64, low=3, high=197)
DECODE = dict(B=1, H=8, N=1_000_000, D=128)
BIAS = dict(B=4, H=8, L=2048, D=64)
PAGED = dict(B=4, H=8, N=32_768, D=128, block_size=16)
GOALS = {"window": 0.1, "varlen": 0.6, "decode": 1.0, "bias": 1.0, "paged": 1.2}

#: Ours / baseline predicted for an H200 before any run (written on the CPU machine; see docs/gpu_check.md):
#: (low, high) per (kind, backend).
PREDICTED = {
    # Full causal at L = 16k, D = 64 runs about 0.8 ms fwd on either backend's tiles; the window visits 3-6 key
    # tiles of 64 per 128-row query tile (256 + 128 keys against 8,192 on average), each with the per-pair test.
    ("window", "triton"): (0.05, 0.10), ("window", "cuda"): (0.05, 0.12),
    # Sequences of 3-197 keys: SDPA's padded batch does about 3x the pairs, but at these sizes both are bound by
    # launches and host work; ours reads the offsets on the host (two synchronisations per forward, one per
    # backward), Triton's grid is as large as SDPA's. The CUDA kernels take the packed batch in one launch each too
    # (blocks per tile of the longest sequence; those past their sequence return), with their smaller tiles.
    ("varlen", "triton"): (0.8, 1.5), ("varlen", "cuda"): (0.8, 2.0),
    # 4.1 GB of K and V to stream: SDPA splits them over all 132 SMs (~1 ms at ~4.5 TB/s). Triton splits them too
    # (triton_split_keys: 33 parts of ~30k keys per head, 264 programs) with 16-row query tiles that waste 15/16 of
    # each MMA but stay bandwidth-bound, plus the merge of 33 float32 states (a few us): 1.0-1.6x. The CUDA kernels
    # run one program per (query tile, head), 8 programs on 8 SMs, each pulling perhaps 60-100 GB/s: 5-10x.
    ("decode", "triton"): (1.0, 1.6), ("decode", "cuda"): (5.0, 10.0),
    # The forward is fused; the backward with the bias's gradient runs the reference kernels' chunked PyTorch ops
    # (fp32 score chunks of 2^22 elements): about 2x SDPA's fused kernel.
    ("bias", "triton"): (1.5, 3.0), ("bias", "cuda"): (1.5, 3.0),
    # The same split decoding over 4 x 32k keys, its K and V rows gathered per 16-key block (4 KB contiguous
    # pieces, a table read per row) in 64-key tiles against 128-key tiles of contiguous rows.
    ("paged", "triton"): (1.0, 1.4),
}


@dataclass(frozen=True)
class Case:
    kind: str
    backend: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.backend}"


def cases() -> list[Case]:
    return [Case(kind, backend) for kind in KINDS for backend in KIND_BACKENDS[kind]]


def _normal(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def _window_calls(backend: str):
    """``(ours, baseline, check)``: the windowed call, the full causal one, and the check of the first."""
    c = WINDOW
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (_normal(gen, c["B"], c["H"], c["L"], c["D"]) for _ in range(3))

    def ours():
        return ae.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(c["left"], 0), backend=backend)

    def baseline():
        return ae.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    def check(out) -> float:
        rows = torch.arange(c["L"] - c["checked_rows"], c["L"], device="cuda")[:, None]
        keys = torch.arange(c["L"], device="cuda")[None, :]
        band = (keys <= rows) & (keys >= rows - c["left"])
        ref = F.scaled_dot_product_attention(q[:, :, -c["checked_rows"]:], k, v, attn_mask=band)
        return require_close("window vs SDPA with the band as a mask", {"out": (out[:, :, -c["checked_rows"]:], ref)},
                             TOLERANCE)

    return ours, baseline, check


def _varlen_calls(backend: str):
    c = VARLEN
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(c["low"], c["high"], (c["sequences"],), generator=torch.Generator().manual_seed(0))
    cu = torch.zeros(c["sequences"] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total, longest = int(cu[-1]), int(lengths.max())
    packed = [_normal(gen, total, c["H"], c["D"]).requires_grad_() for _ in range(3)]
    grad = _normal(gen, total, c["H"], c["D"])
    cu_gpu = cu.cuda()
    # The padded batch holds the same rows: sequence b's rows at [b, :, :len_b].
    index = torch.cat([torch.arange(int(n)) + b * longest for b, n in enumerate(lengths)]).cuda()
    padding = torch.arange(longest)[None, :] < lengths[:, None]

    def pad(x):
        full = x.new_zeros(c["sequences"] * longest, c["H"], c["D"]).index_copy(0, index, x)
        return full.view(c["sequences"], longest, c["H"], c["D"]).transpose(1, 2)

    padded = [pad(t.detach()).requires_grad_() for t in packed]
    grad_padded = pad(grad)
    key_mask = padding.cuda()[:, None, None, :]

    def ours():
        out = ae.varlen_attention(*packed, cu_gpu, cu_gpu, longest, longest, backend=backend)
        return out, torch.autograd.grad(out, packed, grad)

    def baseline():
        out = F.scaled_dot_product_attention(*padded, attn_mask=key_mask)
        return out, torch.autograd.grad(out, padded, grad_padded)

    def check(result) -> float:
        out, grads = result
        ref_out, ref_grads = baseline()
        take = lambda x: x.transpose(1, 2).reshape(-1, c["H"], c["D"])[index]  # noqa: E731
        pairs = {"out": (out.detach(), take(ref_out.detach()))}
        pairs.update({f"d{n}": (g, take(r)) for n, g, r in zip("qkv", grads, ref_grads)})
        return require_close("varlen vs SDPA on the padded batch", pairs, 2 * TOLERANCE)

    return ours, baseline, check


def _decode_calls(backend: str):
    c = DECODE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = _normal(gen, c["B"], c["H"], 1, c["D"])
    k, v = (_normal(gen, c["B"], c["H"], c["N"], c["D"]) for _ in range(2))

    def ours():
        return ae.scaled_dot_product_attention(q, k, v, backend=backend)

    def baseline():
        return F.scaled_dot_product_attention(q, k, v)

    def check(out) -> float:
        return require_close("decode vs SDPA", {"out": (out, baseline())}, TOLERANCE)

    return ours, baseline, check


def _bias_calls(backend: str):
    c = BIAS
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (_normal(gen, c["B"], c["H"], c["L"], c["D"]).requires_grad_() for _ in range(3))
    bias = (0.5 * _normal(gen, c["H"], c["L"], c["L"])).requires_grad_()
    grad = _normal(gen, c["B"], c["H"], c["L"], c["D"])
    leaves = (q, k, v, bias)

    def ours():
        out = ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
        return out, torch.autograd.grad(out, leaves, grad)

    def baseline():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out, torch.autograd.grad(out, leaves, grad)

    def check(result) -> float:
        (out, grads), (ref_out, ref_grads) = result, baseline()
        pairs = {"out": (out.detach(), ref_out.detach())}
        pairs.update({f"d{n}": (g, r) for n, g, r in zip(("q", "k", "v", "bias"), grads, ref_grads)})
        return require_close("bias vs SDPA", pairs, 2 * TOLERANCE)

    return ours, baseline, check


def _paged_calls(backend: str):
    c = PAGED
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = c["N"] // c["block_size"]
    k_cache, v_cache = (_normal(gen, c["B"] * blocks, c["block_size"], c["H"], c["D"]) for _ in range(2))
    table = torch.randperm(c["B"] * blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = table.reshape(c["B"], blocks).cuda()
    seqlens = torch.full((c["B"],), c["N"], dtype=torch.int32, device="cuda")
    q = _normal(gen, c["B"], c["H"], 1, c["D"])
    # The same keys laid out contiguously, entry by entry: [B, H, N, D].
    contiguous = [cache[table.long()].reshape(c["B"], c["N"], c["H"], c["D"]).transpose(1, 2).contiguous()
                  for cache in (k_cache, v_cache)]

    def ours():
        return ae.paged_attention(q, k_cache, v_cache, table, seqlens, is_causal=True, backend=backend)

    def baseline():
        return ae.scaled_dot_product_attention(q, *contiguous, is_causal=True, alignment="bottom_right",
                                               backend=backend)

    def check(out) -> float:
        return require_close("paged vs the contiguous cache", {"out": (out, baseline())}, TOLERANCE)

    return ours, baseline, check


CALLS = {"window": _window_calls, "varlen": _varlen_calls, "decode": _decode_calls, "bias": _bias_calls,
         "paged": _paged_calls}


def measure(case: Case, budget: Budget, progress: Callable[[str], None]) -> list[dict]:
    row = {"section": NAME, "kind": case.kind, "backend": case.backend}
    reason = ae.available_backends(torch.zeros(1, device="cuda"), "scaled_dot_product_attention")[case.backend]
    if reason or budget.expired():
        return [{**row, "note": f"not measured: {reason}" if reason else TIME_LIMIT_NOTE}]
    ours, baseline, check = CALLS[case.kind](case.backend)
    try:
        row["rel_err"] = check(ours())
        mine, theirs = cuda_time(ours, max_call_s=budget.max_call_s), cuda_time(baseline, max_call_s=budget.max_call_s)
    except TooSlow as exc:
        return [{**row, "note": f"not measured: {exc} (its result was checked)"}]
    except (RuntimeError, NotImplementedError) as exc:
        return [{**row, "note": f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}]
    row.update(ms=mine.median_ms, samples_ms=list(mine.samples_ms), peak_mib=mine.peak_mib,
               baseline_ms=theirs.median_ms, ratio=mine.median_ms / theirs.median_ms)
    progress(f"{case.label}: {mine.median_ms:.3f} ms, baseline {theirs.median_ms:.3f} ms, ratio {row['ratio']:.3f} "
             f"(predicted {PREDICTED[case.kind, case.backend][0]}-{PREDICTED[case.kind, case.backend][1]})")
    return [row]


def triton_work(case: Case) -> None:
    """Every Triton call :func:`measure` makes for ``case`` (for :mod:`bench.gpu.warm`)."""
    if case.backend == "triton":
        ours, baseline, _ = CALLS[case.kind](case.backend)
        ours()
        if case.kind == "window":
            baseline()


BASELINES = {"window": "same backend, full causal", "varlen": "SDPA, padded batch", "decode": "SDPA (flash)",
             "bias": "SDPA with the bias", "paged": "same backend, contiguous cache"}


def markdown(rows: list[dict]) -> str:
    body = []
    for r in rows:
        low, high = PREDICTED[r["kind"], r["backend"]]
        measured = [f"{r['ms']:.3f}", f"{r['baseline_ms']:.3f}", f"{r['ratio']:.3f}"] if "ms" in r else ["", "", ""]
        verdict = "" if "ratio" not in r else ("met" if r["ratio"] <= GOALS[r["kind"]] else "not met")
        body.append([r["kind"], r["backend"], BASELINES[r["kind"]], *measured, f"{low}-{high}",
                     f"<= {GOALS[r['kind']]} {verdict}".strip(), r.get("note", "")])
    lines = [__doc__.split("\n\n", 1)[1].rsplit("\n\nRows per case", 1)[0], "",
             markdown_table(["case", "backend", "baseline", "ours ms", "baseline ms", "ours / baseline", "predicted",
                             "goal", "note"], body, align="lllrrrlll")]
    return "\n".join(lines)
