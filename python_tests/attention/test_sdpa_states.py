"""Attention states with a per-pair mask per chunk: updating, merging, streaming and removing masked
chunks gives the state of one masked attention over all keys (causal streaming included)."""
import torch

import attn_ext as ae

F64 = torch.float64


def _problem(seed=0, L=12, S=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, L, 8, generator=g, dtype=F64)
    k = torch.randn(2, 3, S, 8, generator=g, dtype=F64)
    v = torch.randn(2, 3, S, 5, generator=g, dtype=F64)
    mask = torch.rand(2, 1, L, S, generator=g) > 0.4
    return q, k, v, mask


def test_update_and_merge_with_masks_equal_one_call():
    q, k, v, mask = _problem()
    whole_out, whole_lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    state = ae.empty_state(q, 5)
    for n0 in range(0, 40, 15):
        state = ae.update_state(state, q, k[:, :, n0:n0 + 15], v[:, :, n0:n0 + 15], attn_mask=mask[..., n0:n0 + 15])
    torch.testing.assert_close(state.out, whole_out)
    torch.testing.assert_close(state.lse, whole_lse)
    parts = [ae.attention_state(q, k[:, :, n0:n0 + 10], v[:, :, n0:n0 + 10], attn_mask=mask[..., n0:n0 + 10])
             for n0 in range(0, 40, 10)]
    merged = ae.merge_states(parts)
    torch.testing.assert_close(merged.out, whole_out)


def test_streaming_causal_chunks_with_float_masks_and_padding():
    q, k, v, _ = _problem(seed=1, L=40, S=40)
    causal = torch.zeros(40, 40, dtype=F64).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, 30:] = True
    chunks = ((k[:, :, n0:n0 + 16], v[:, :, n0:n0 + 16], padding[:, n0:n0 + 16], causal[:, n0:n0 + 16])
              for n0 in range(0, 40, 16))
    state = ae.stream_attention(q, chunks)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal + torch.zeros(2, 1, 1, 40, dtype=F64).masked_fill(padding[:, None, None], float("-inf")))
    torch.testing.assert_close(state.out, expected)


def test_remove_masked_chunk():
    q, k, v, mask = _problem(seed=2)
    mask[..., 0] = True  # every row keeps one key of the first part
    full = ae.attention_state(q, k, v, attn_mask=mask)
    kept = ae.attention_state(q, k[:, :, :25], v[:, :, :25], attn_mask=mask[..., :25])
    removed = ae.remove_from_state(full, q, k[:, :, 25:], v[:, :, 25:], attn_mask=mask[..., 25:], min_remaining=1e-6)
    torch.testing.assert_close(removed.out, kept.out)
    torch.testing.assert_close(removed.lse, kept.lse)
