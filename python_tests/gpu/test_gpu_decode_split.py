"""Decoding on the Triton kernels on a CUDA device: a few new tokens over a long cache take the forward split over
keys (:mod:`attn_ext.ops.attention.triton_split_keys`, chosen by shape: asserted), and the merged result is within
FlashAttention's rule of the dense fp64 attention (calibrated by PyTorch's same-precision computation on the GPU),
plain and with the new tokens aligned at the end of the cache under the causal rule, grouped heads, bf16;
skipped, with the reason, without a CUDA device. The interpreter tests the split on the CPU with forced parts
(python_tests/attention/test_triton_split_keys.py).
"""
import pathlib
import sys

import pytest
import torch

import attn_ext as ae
from _gpu import backends
from _helpers import assert_within_flash_rule
from attn_ext.ops.attention import triton_split_keys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from test_sdpa_score_mods import dense  # noqa: E402
from test_sdpa_window import band_mask  # noqa: E402


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)  # one dtype: the split's code does not depend on it
@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_decoding_splits_its_keys_and_stays_within_the_flash_rule(backend, dtype, M, is_causal, monkeypatch):
    from attn_ext.ops.attention import triton_fwd

    merged = []  # the parts of each merge the forward makes
    merge = triton_fwd.merge_parts
    monkeypatch.setattr(triton_fwd, "merge_parts", lambda parts, *rest: (merged.append(parts.shape[0]),
                                                                          merge(parts, *rest))[1])
    B, Hq, Hkv, S, D = 1, 8, 2, 65_536, 128
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(B, Hq, M, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
           torch.randn(B, Hkv, S, D, generator=g)]
    q, k, v = (t.to("cuda", dtype) for t in cpu)
    alignment = "bottom_right" if is_causal else "top_left"
    parts = triton_split_keys.automatic_parts(B * Hq, M, S, torch.cuda.get_device_properties(0).multi_processor_count)
    out = ae.scaled_dot_product_attention(q, k, v, is_causal=is_causal, alignment=alignment, enable_gqa=True,
                                          backend=backend)
    assert parts > 1 and len(merged) == 1 and merged[0] > 1, "a decoding call on a GPU splits its keys, merged once"
    mask = band_mask(M, S, is_causal, None, alignment)
    rep = Hq // Hkv
    k_rep, v_rep = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ref = dense(q.cpu().double(), k_rep.cpu().double(), v_rep.cpu().double(), None, None, mask, alignment)
    same = dense(q, k_rep, v_rep, None, None, mask.cuda(), alignment)
    assert_within_flash_rule(out.cpu(), ref, same.cpu(), name="out")
