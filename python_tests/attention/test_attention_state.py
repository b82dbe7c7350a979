"""The state API's contract beyond the algebra: backends, ops, errors, masks and constant memory."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch

from _helpers import ALL_BACKENDS, assert_within_flash_rule, naive_attention, peak_allocated_bytes, require_backend


def _qkv(n=40, B=2, H=2, M=3, D=8, Dv=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, M, D, generator=g, dtype=dtype), torch.randn(B, H, n, D, generator=g, dtype=dtype),
            torch.randn(B, H, n, Dv, generator=g, dtype=dtype))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_and_merge_on_every_backend(backend, dtype):
    q, k, v = _qkv(n=70, dtype=dtype)
    require_backend(backend, q)
    mask = torch.zeros(2, 70, dtype=torch.bool)
    mask[1, 20:] = True  # batch 1 keeps keys only in the first chunk
    state = ae.attention_state(q, k[:, :, :20], v[:, :, :20], key_padding_mask=mask[:, :20], backend=backend)
    state = ae.update_state(state, q, k[:, :, 20:45], v[:, :, 20:45], key_padding_mask=mask[:, 20:45], backend=backend)
    tail = ae.attention_state(q, k[:, :, 45:], v[:, :, 45:], key_padding_mask=mask[:, 45:], backend=backend)
    state = ae.merge_states([state, tail], backend=backend)
    ref_out, ref_lse = naive_attention(q.double(), k.double(), v.double(), mask)
    pt_out, pt_lse = naive_attention(q, k, v, mask)
    assert_within_flash_rule(state.out, ref_out, pt_out, name=f"{backend} out")
    assert_within_flash_rule(state.lse, ref_lse, pt_lse, name=f"{backend} lse")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_op_passes_opcheck(backend):
    q, k, v = _qkv()
    require_backend(backend, q)
    a = ae.attention_state(q, k[:, :, :10], v[:, :, :10])
    b = ae.attention_state(q, k[:, :, 10:], v[:, :, 10:])
    empty = ae.empty_state(q, v.shape[-1])
    op = dispatch.kernel("merge_states", backend)
    for x, y in ((a, b), (a, empty), (empty, empty)):
        args = tuple(t.clone().requires_grad_() for t in (x.out, x.lse, y.out, y.lse))
        torch.library.opcheck(op, args)


def test_merging_two_empty_states_is_empty_without_nan():
    q, _, _ = _qkv()
    out_a, lse_a = (t.clone().requires_grad_() for t in ae.empty_state(q, 4))
    merged = ae.merge_states(ae.AttentionState(out_a, lse_a), ae.empty_state(q, 4))
    assert torch.equal(merged.out, torch.zeros_like(merged.out)) and bool(torch.isneginf(merged.lse).all())
    merged.out.sum().backward()
    assert torch.equal(out_a.grad, torch.zeros_like(out_a)) and not bool(torch.isnan(lse_a.grad).any())


def test_stream_attention_accepts_masks_and_matches_cross_attention():
    q, k, v = _qkv(n=100)
    mask = torch.rand(2, 100, generator=torch.Generator().manual_seed(3)) < 0.4
    chunks = [(k[:, :, i:i + 30], v[:, :, i:i + 30], mask[:, i:i + 30]) for i in range(0, 100, 30)]
    state = ae.stream_attention(q, iter(chunks))
    out, lse = ae.cross_attention(q, k, v, key_padding_mask=mask, return_lse=True)
    torch.testing.assert_close(state.out, out, atol=2e-6, rtol=0)
    torch.testing.assert_close(state.lse, lse, atol=2e-6, rtol=0)


def test_remove_refuses_when_too_little_mass_would_remain():
    q, k, v = _qkv(n=40)
    # Scores 0 for the 30 kept keys and ln(2997) for the 10 removed ones: they hold 99.9 % of the mass.
    q = torch.ones_like(q)
    k[:, :, :30] = 0
    k[:, :, 30:] = math.log(2997.0) / math.sqrt(8)
    state = ae.attention_state(q, k, v)
    with pytest.raises(ValueError, match=r"^attn_ext\.remove_from_state: would leave .* of the softmax mass in "
                                         r"\d+ row\(s\) "
                                         r"\(min_remaining=0.01\)"):
        ae.remove_from_state(state, q, k[:, :, 30:], v[:, :, 30:])
    # With a lower threshold the caller accepts the amplified rounding error and gets a result.
    relaxed = ae.remove_from_state(state, q, k[:, :, 30:], v[:, :, 30:], min_remaining=1e-4)
    kept = ae.attention_state(q, k[:, :, :30], v[:, :, :30])
    torch.testing.assert_close(relaxed.out, kept.out, atol=1e-3, rtol=0)  # 1000x amplified fp32 rounding


def test_remove_everything_is_refused_and_removing_padding_changes_nothing():
    q, k, v = _qkv(n=10)
    state = ae.attention_state(q, k, v)
    with pytest.raises(ValueError, match="would leave 0 of the softmax mass"):
        ae.remove_from_state(state, q, k, v)
    all_padding = torch.ones(2, 10, dtype=torch.bool)
    same = ae.remove_from_state(state, q, k, v, key_padding_mask=all_padding)
    assert torch.equal(same.out, state.out) and torch.equal(same.lse, state.lse)


@pytest.mark.parametrize(
    "call, exception, pattern",
    [
        (lambda q, s: ae.merge_states([]), ValueError, "merge_states: needs two states or a non-empty sequence"),
        (lambda q, s: ae.merge_states(s, ae.empty_state(q, 7)), ValueError,
         r"merge_states: cannot merge states with out \(2, 2, 3, 5\)"),
        (lambda q, s: ae.merge_states(s, (s.out, s.lse.double())), TypeError,
         r"merge_states: state 1.lse must be torch.float32"),
        (lambda q, s: ae.merge_states(s, (s.out, s.lse[..., :1])), ValueError,
         r"merge_states: state 1 .*lse must be out.shape\[:-1\]"),
        (lambda q, s: ae.stream_attention(q, iter([])), ValueError, "stream_attention: got no chunks"),
        (lambda q, s: ae.stream_attention(q, [(s.out,)]), TypeError, r"stream_attention: chunk 0 must be \(k, v\)"),
        (lambda q, s: ae.stream_attention(q, [(q[:, :1], q)]), ValueError, "stream_attention: batch and head sizes"),
        (lambda q, s: ae.remove_from_state(s, q, q, q, min_remaining=0.0), ValueError,
         r"remove_from_state: min_remaining must be in \(0, 1\]"),
        (lambda q, s: ae.remove_from_state(s, q, q, q[..., :2, :]), ValueError,
         "remove_from_state: k .* and v .* must have the same number of keys"),
        (lambda q, s: ae.update_state(s, q, q[:, :1], q), ValueError, "update_state: batch and head sizes"),
        (lambda q, s: ae.update_state(s.out, q, q, q), TypeError, r"update_state: state must be an AttentionState"),
        (lambda q, s: ae.update_state(s, q, q, q, chunk_size=0), ValueError,
         "update_state: chunk_size must be a positive int"),
        (lambda q, s: ae.attention_state(q, q, q, scale=math.nan), ValueError,
         "attention_state: scale must be a finite float"),
        (lambda q, s: ae.attention_state(q, q[..., :3], q, attn_mask=torch.ones(3, 3, dtype=torch.bool)), ValueError,
         "attention_state: query .* and key .* must have the same positive embedding dim"),
        (lambda q, s: ae.empty_state(q[0], 5), ValueError, r"empty_state: q must be \[B, H, M, D\]"),
    ],
    ids=["empty-list", "shape-mismatch", "lse-dtype", "lse-shape", "no-chunks", "bad-chunk", "stream-shapes",
         "min-remaining", "remove-shapes", "update-shapes", "update-not-a-state", "update-chunk-size",
         "state-scale", "state-attn-mask-shapes", "empty-state-rank"],
)
def test_state_api_errors(call, exception, pattern):
    """Every error starts with the name of the public op that was called (``attn_ext.update_state: ...``), not
    with a helper's or the op it runs on."""
    q, k, v = _qkv()
    state = ae.attention_state(q, k, v)
    with pytest.raises(exception, match=r"^attn_ext\." + pattern):
        call(q, state)


def _streamed_peak_bytes(q, n_chunks, chunk_keys, stream):
    def chunks():
        g = torch.Generator().manual_seed(0)
        for _ in range(n_chunks):  # made on the fly: the whole key set never exists
            yield (torch.randn(1, 2, chunk_keys, 32, generator=g), torch.randn(1, 2, chunk_keys, 32, generator=g))

    return peak_allocated_bytes(lambda: stream(q, chunks()))


def _stream_by_materialising(q, chunks):
    ks, vs = zip(*chunks)
    return ae.attention_state(q, torch.cat(ks, 2), torch.cat(vs, 2))


def test_streaming_peak_memory_does_not_grow_with_the_number_of_chunks():
    q = torch.randn(1, 2, 16, 32)
    chunk_keys = 1024
    chunk_bytes = 2 * (1 * 2 * chunk_keys * 32 * 4)  # one chunk's k and v
    few = _streamed_peak_bytes(q, 2, chunk_keys, ae.stream_attention)
    many = _streamed_peak_bytes(q, 128, chunk_keys, ae.stream_attention)  # 64x the context
    assert many <= few + chunk_bytes, f"peak grew from {few} B to {many} B (one chunk is {chunk_bytes} B)"
    # Only the current chunk is alive (plus states of a few KB): the previous one is gone before the
    # iterator draws the next.
    assert many <= chunk_bytes + 64 * 1024, f"peak {many} B holds more than one chunk ({chunk_bytes} B)"
    # The measurement can fail: materialising the same stream before attending breaks the bound.
    materialised = _streamed_peak_bytes(q, 128, chunk_keys, _stream_by_materialising)
    assert materialised > few + 32 * chunk_bytes, f"probe blind: materialised peak {materialised} B vs {few} B"


def test_state_of_fully_padded_rows_has_zero_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(n=20))
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0] = True
    state = ae.update_state(ae.empty_state(q, 5), q, k, v, key_padding_mask=mask)
    (state.out.sum() + torch.where(torch.isinf(state.lse), 0.0, state.lse).sum()).backward()
    assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0])) and torch.equal(k.grad[0], torch.zeros_like(k.grad[0]))
    assert not any(bool(torch.isnan(t.grad).any()) for t in (q, k, v))
    assert bool(torch.isneginf(state.lse[0].detach()).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_merge_states_takes_plain_tuples(backend):
    """(out, lse) tuples merge as AttentionStates do (update_state already took them)."""
    q, k, v = _qkv()
    require_backend(backend, q)
    a = ae.attention_state(q, k[:, :, :15], v[:, :, :15], backend=backend)
    b = ae.attention_state(q, k[:, :, 15:], v[:, :, 15:], backend=backend)
    expected = ae.merge_states(a, b, backend=backend)
    for merged in (ae.merge_states(tuple(a), tuple(b), backend=backend),
                   ae.merge_states([tuple(a), tuple(b)], backend=backend),
                   ae.merge_states([tuple(a), b, ae.empty_state(q, 5)], backend=backend)):
        assert isinstance(merged, ae.AttentionState)
        assert torch.equal(merged.out, expected.out) and torch.equal(merged.lse, expected.lse)
    with pytest.raises(TypeError,
                       match=r"^attn_ext\.merge_states: state 1 must be an AttentionState\(out, lse\), got list"):
        ae.merge_states(tuple(a), list(b))
