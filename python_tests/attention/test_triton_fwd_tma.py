"""The Hopper TMA forward (``attn_ext/ops/attention/triton_fwd_tma.py``, opt-in by ``ATTN_EXT_TRITON_TMA=1``) in
the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest.py before any kernel module is imported): its
results against the dense fp64 formula with FlashAttention's accuracy rule, the general forward's conventions
at the edges (empty rows, NaN, non-finite value rows above the diagonal), the reason it gives for each call it
refuses, and that the forward's dispatch really runs it when enabled and not otherwise.

The interpreter computes fp16/bf16 products in fp32 (``UPCAST``, as for the general kernel), so these tests
prove the indexing, the descriptors' zero-filled tails, the loop split and the epilogue, not the GPU's rounding;
the descriptors' machine code is checked ahead of time (``bench/gpu/triton_aot.py``, docs/machine_code.md).
"""
from __future__ import annotations

import contextvars
import math

import pytest
import torch

from _helpers import assert_within_flash_rule
from attn_ext.ops.utils.triton import triton_unavailable_reason

pytestmark = pytest.mark.skipif(triton_unavailable_reason("cpu") is not None,
                                reason=f"Triton interpreter unavailable: {triton_unavailable_reason('cpu')}")

if triton_unavailable_reason("cpu") is None:
    from test_sdpa_triton import dense

    from attn_ext.ops.attention import triton_fwd, triton_fwd_tma

# id: (B, Hq, Hkv, M, N, D, Dv, causal, dtype): tails in M and N (the interpreter's tiles: 32 query rows,
# chunk_size keys), M < N and M > N under the causal rule, grouped heads, a head dim padded to the tile (40 -> 64)
# and N a multiple of 128 (the loop without the per-key test).
CASES = {
    "plain-tails-fp16": (2, 2, 2, 45, 57, 16, 16, False, torch.float16),
    "gqa-D40-bf16": (1, 4, 2, 33, 70, 40, 24, False, torch.bfloat16),
    "gqa-whole-key-blocks-fp16": (1, 4, 1, 20, 128, 32, 16, False, torch.float16),
    "causal-M<N-gqa-bf16": (1, 4, 2, 37, 90, 32, 16, True, torch.bfloat16),
    "causal-M>N-fp16": (2, 2, 2, 75, 40, 16, 24, True, torch.float16),
    "causal-M=N-bf16": (1, 2, 1, 100, 100, 16, 16, True, torch.bfloat16),
}


@pytest.fixture
def tma_on(monkeypatch):
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")


@pytest.fixture
def tma_calls(monkeypatch):
    """The TMA launches that ``launch_forward`` makes (each still runs)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return triton_fwd_tma.launch_forward_tma(*args, **kwargs)

    monkeypatch.setattr(triton_fwd, "launch_forward_tma", spy)
    return calls


def _qkv(name, seed=0):
    B, Hq, Hkv, M, N, D, Dv, causal, dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, Hq, M, D, generator=gen), torch.randn(B, Hkv, N, D, generator=gen)
    return q.to(dtype), k.to(dtype), torch.randn(B, Hkv, N, Dv, generator=gen).to(dtype), causal


def _forward(q, k, v, causal, chunk_size=64, kpm=None, mask=None, p=0.0):
    return triton_fwd.attention_forward(q, k, v, mask, kpm, q.shape[-1] ** -0.5, causal, p, torch.tensor([7]),
                                        chunk_size)


def _dense(q, k, v, causal, dtype):
    return dense(q, k, v, None, None, q.shape[-1] ** -0.5, causal, 0.0, None, dtype)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp64_within_the_flash_rule(name, chunk_size, tma_on, tma_calls):
    q, k, v, causal = _qkv(name)
    assert triton_fwd_tma.tma_forward_unavailable_reason(q, k, v) is None
    out, lse = _forward(q, k, v, causal, chunk_size)
    assert len(tma_calls) == 1
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1]) and lse.dtype == torch.float32
    out64, lse64 = _dense(q, k, v, causal, torch.float64)
    out_pt, lse_pt = _dense(q, k, v, causal, q.dtype)
    assert_within_flash_rule(out, out64, out_pt, name=f"{name} out")
    assert_within_flash_rule(lse, lse64, lse_pt, name=f"{name} lse")


@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_query_row_is_nan_and_no_other_row(causal, tma_on, tma_calls):
    q, k, v, _ = _qkv("causal-M=N-bf16")
    q[0, 1, 50, 3] = float("nan")
    out, lse = _forward(q, k, v, causal)
    assert len(tma_calls) == 1
    assert torch.isnan(out[0, 1, 50]).all() and torch.isnan(lse[0, 1, 50])
    finite = torch.ones_like(lse, dtype=torch.bool)
    finite[0, 1, 50] = False
    assert torch.isfinite(out[finite]).all() and torch.isfinite(lse[finite]).all()
    q[0, 1, 50, 3] = 0.0
    out64, lse64 = _dense(q, k, v, causal, torch.float64)
    torch.testing.assert_close(out[finite].double(), out64[finite], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse[finite].double(), lse64[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_a_row_whose_every_score_is_minus_inf_is_empty(causal, tma_on, tma_calls):
    # q[5] = (inf, 0, ...) against keys whose first entry is negative: every score is -inf, no key has weight.
    q, k, v, _ = _qkv("plain-tails-fp16")
    q[:, :, 5] = 0.0
    q[:, :, 5, 0] = float("inf")
    k[..., 0] = -k[..., 0].abs() - 0.5
    out, lse = _forward(q, k, v, causal)
    assert len(tma_calls) == 1
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.equal(lse[:, :, 5], torch.full_like(lse[:, :, 5], -math.inf))
    assert torch.isfinite(out[:, :, 6:]).all() and torch.isfinite(lse[:, :, 6:]).all()


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_an_inf_value_row_above_the_diagonal_stays_there(chunk_size, tma_on, tma_calls):
    # Key 90's value row is inf: only queries 90.. see it; the blocks the diagonal crosses must not read it
    # through a masked pair's zero weight (0 * inf = NaN).
    q, k, v, _ = _qkv("causal-M=N-bf16")
    v[:, :, 90] = float("inf")
    out, lse = _forward(q, k, v, True, chunk_size)
    assert len(tma_calls) == 1
    assert torch.isfinite(out[:, :, :90]).all() and not torch.isfinite(out[:, :, 90:]).any()
    v[:, :, 90] = 0.0  # the dense formula's P @ V would give 0 * inf = NaN for the earlier rows
    out64, _ = _dense(q, k, v, True, torch.float64)
    out_pt, _ = _dense(q, k, v, True, q.dtype)
    assert_within_flash_rule(out[:, :, :90], out64[:, :, :90], out_pt[:, :, :90], name="rows before the inf row")
    assert torch.isfinite(lse).all()


def test_the_general_forward_gives_the_same_results_and_the_backward_takes_them(monkeypatch, tma_calls):
    import attn_ext as ae

    q, k, v, _ = _qkv("causal-M<N-gqa-bf16")
    results = {}
    for enabled in ("0", "1"):
        monkeypatch.setenv(triton_fwd_tma.TMA_ENV, enabled)
        leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
        out, lse = ae.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True, return_lse=True,
                                                   chunk_size=32, backend="triton")
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum() + lse.sum(), leaves)
        results[enabled] = (out, lse, *grads)
    assert len(tma_calls) == 0  # fp32 is refused: the general kernel in both runs
    q16, k16, v16 = (t.to(torch.float16) for t in (q, k, v))
    for enabled in ("0", "1"):
        monkeypatch.setenv(triton_fwd_tma.TMA_ENV, enabled)
        leaves = [t.clone().requires_grad_(True) for t in (q16, k16, v16)]
        out, lse = ae.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True, return_lse=True,
                                                   chunk_size=32, backend="triton")
        grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, out.shape[-1])).sum() + lse.sum(), leaves)
        results[f"fp16 {enabled}"] = (out, lse, *grads)
    assert len(tma_calls) == 1  # only the enabled fp16 call
    for general, tma in zip(results["fp16 0"], results["fp16 1"]):
        torch.testing.assert_close(tma, general, rtol=1e-2, atol=1e-2)


def test_dispatch_takes_the_tma_kernel_only_when_enabled_and_the_call_qualifies(monkeypatch, tma_calls):
    q, k, v, _ = _qkv("plain-tails-fp16")
    monkeypatch.delenv(triton_fwd_tma.TMA_ENV, raising=False)
    general = _forward(q, k, v, False)
    assert tma_calls == []
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")
    tma = _forward(q, k, v, False)
    assert len(tma_calls) == 1
    torch.testing.assert_close(tma, general, rtol=2e-3, atol=2e-3)
    _forward(q, k, v, False, kpm=torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool))
    _forward(q, k, v, False, p=0.1)
    assert len(tma_calls) == 1  # a padding mask, dropout: the general kernel
    # Cross attention shares the dispatch.
    triton_fwd.cross_attention_forward(q, k, v, None, q.shape[-1] ** -0.5, 64)
    assert len(tma_calls) == 2


def test_no_keys_takes_the_general_kernel(tma_on, tma_calls):
    q, k, v, _ = _qkv("plain-tails-fp16")
    k, v = k[:, :, :0], v[:, :, :0]
    assert "empty problem" in triton_fwd_tma.tma_forward_unavailable_reason(q, k, v)
    out, lse = _forward(q, k, v, False)
    assert tma_calls == []
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, -math.inf))


def _misaligned(t):
    # The same values one element past a 16-byte boundary (an offset view of a larger buffer).
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    return flat.copy_(t.reshape(-1)).view(t.shape)


def test_each_refused_condition_has_its_reason(monkeypatch):
    reason = triton_fwd_tma.tma_forward_unavailable_reason
    q, k, v, _ = _qkv("gqa-D40-bf16")
    monkeypatch.delenv(triton_fwd_tma.TMA_ENV, raising=False)
    assert "ATTN_EXT_TRITON_TMA=1" in reason(q, k, v)
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "true")  # exactly 1
    assert "ATTN_EXT_TRITON_TMA=1" in reason(q, k, v)
    monkeypatch.setenv(triton_fwd_tma.TMA_ENV, "1")
    assert reason(q, k, v) is None
    refused = {
        "key padding mask": reason(q, k, v, key_padding_mask=torch.zeros(1, k.shape[2], dtype=torch.bool)),
        "attention mask": reason(q, k, v, attn_mask=torch.ones(1, 4, q.shape[2], k.shape[2], dtype=torch.bool)),
        "dropout": reason(q, k, v, dropout_p=0.1),
        "16-bit types": reason(q.float(), k.float(), v.float()),
        "last dim has stride 2": reason(torch.randn(1, 4, 33, 80).to(q.dtype)[..., ::2], k, v),
        "row stride is 24 bytes": reason(torch.randn(1, 4, 33, 12).to(q.dtype), k[..., :12].contiguous(), v),
        "16-byte boundary": reason(q, _misaligned(k), v),
        "head dim 160 is over 128": reason(*(torch.randn(1, h, 8, 160).to(q.dtype) for h in (4, 2, 2))),
        "output's rows": reason(q, k, v.as_strided((1, 2, 70, 4), (2 * 70 * 8, 70 * 8, 8, 1))),
    }
    for expected, why in refused.items():
        assert why is not None and expected in why, (expected, why)
    monkeypatch.delattr(triton_fwd_tma.tl, "make_tensor_descriptor")
    assert "make_tensor_descriptor" in reason(q, k, v)


def test_the_device_must_be_hopper_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_fwd_tma, "interpreting", lambda: False)
    assert "CUDA device" in triton_fwd_tma._device_reason(torch.device("cpu"))
    for capability, ok in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        monkeypatch.setattr(triton_fwd_tma, "device_capability", lambda index, c=capability: c)
        why = triton_fwd_tma._device_reason(torch.device("cuda", 0))
        assert (why is None) == ok and (ok or f"{capability[0]}.{capability[1]}" in why)


def test_the_allocator_is_set_once_and_a_callers_own_is_kept():
    from triton.runtime import _allocation

    def run():
        _allocation._allocator.set(_allocation.NullAllocator())
        triton_fwd_tma.ensure_allocator()
        ours = _allocation._allocator.get()
        assert ours is triton_fwd_tma._scratch and ours(256, 128, None).numel() == 256

        def callers(size, alignment, stream):
            return torch.empty(size, dtype=torch.int8)

        triton_fwd_tma.triton.set_allocator(callers)
        triton_fwd_tma.ensure_allocator()
        assert _allocation._allocator.get() is callers

    contextvars.copy_context().run(run)  # the process's allocator is left as it was


@pytest.mark.parametrize("pinned", [False, True])
def test_the_autotuner_keeps_no_spilling_tile_under_the_causal_rule(pinned, monkeypatch):
    # What triton.autotune gets on an sm_90 card (the autotuner itself needs a GPU), pruned by the running Triton's
    # AOT spill table (CI's 3.9 and the GPU machine's 3.6 have one): causal calls drop the tiles measured to spill
    # without warp specialisation (4-warp 128-row, 128-key), the persistent grid only under the causal rule;
    # pinned, one config per call, never a persistent one.
    from attn_ext.ops.attention import triton_spills
    from attn_ext.ops.utils import triton as tu

    table = triton_spills.spill_table()
    if ("_fwd_tma_kernel", 90, 2, 128, 128, "causal") not in table:
        pytest.fail(f"Triton {triton_spills.triton.__version__} has no spill table with the TMA forward: run "
                    "bench/gpu/spill_table.py with it")
    if pinned:
        monkeypatch.setenv(tu.PIN_ENV, "1")
    else:
        monkeypatch.delenv(tu.PIN_ENV, raising=False)
    monkeypatch.setattr(triton_fwd_tma, "_shared_memory", lambda q: 232448)  # an H100's, as on the GPU
    monkeypatch.setattr(triton_fwd_tma, "device_arch", lambda: 90)
    configs, prune = tu.tuning_plan(triton_fwd_tma._configs, triton_fwd_tma._prune, triton_fwd_tma._PINNED)
    named = {"Q": torch.empty(1, dtype=torch.bfloat16), "BLOCK_N_MAX": 128, "M_BUCKET": 4096, "N_BUCKET": 4096}

    def kept(causal):
        survivors = prune(configs, named, BLOCK_D=128, BLOCK_DV=128, IS_CAUSAL=causal)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.kwargs["PROGRAMS_PER_SM"])
                for c in survivors]

    if pinned:
        assert kept(False) == [(128, 64, 4, 2, 0)] and kept(True) == [(128, 64, 8, 2, 0)]
        return
    assert kept(False) == [(*t, 0) for t in triton_fwd_tma.TMA_TILES]
    # Under the causal rule: the tiles the table finds spill-free, in either grid (the persistent 128x64 8-warp
    # tiles: Triton 3.9 yes, 3.6 32-40 bytes); the 4-warp 128-row tiles spill in both Tritons.
    causal = kept(True)
    for persistent, variant in ((False, "causal"), (True, "causal_persistent")):
        free = {t for t, stack in table["_fwd_tma_kernel", 90, 2, 128, 128, variant].items() if stack == 0}
        assert {t[:4] for t in causal if bool(t[4]) == persistent} == free, variant
    assert {(64, 64, 4, 2), (128, 64, 8, 2)} <= {t[:4] for t in causal if not t[4]}
    assert not {(128, 64, 4, 2), (128, 64, 4, 3)} & {t[:4] for t in causal}
