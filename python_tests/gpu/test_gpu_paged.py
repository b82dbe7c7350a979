"""``ae.paged_attention`` on the Triton kernels on a CUDA device: the cache read through the block table in place
(never gathered), a decoding step over a long cache split over keys; against each entry's contiguous keys in fp64
with FlashAttention's rule (calibrated by PyTorch's same-precision computation on the GPU), bf16, grouped heads, an
empty entry; skipped, with the reason, without a CUDA device. The interpreter tests the same path on the CPU
(python_tests/attention/test_paged_triton.py).
"""
import pathlib
import sys

import pytest
import torch

import attn_ext as ae
from _gpu import backends
from _helpers import assert_within_flash_rule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from test_paged_attention import cache  # noqa: E402
from test_sdpa_score_mods import dense  # noqa: E402
from test_sdpa_window import band_mask  # noqa: E402


@pytest.mark.parametrize("backend", backends("paged_attention", ("triton",)))
@pytest.mark.parametrize("M", [1, 4])
def test_paged_cache_within_the_flash_rule(backend, M):
    lengths, H, D = [5000, 130, 0], 8, 128
    k_cache, v_cache, table, seqlens, contiguous = cache(lengths, block_size=16, Hkv=2, D=D, Dv=D)
    q = torch.randn(len(lengths), H, M, D, dtype=torch.float64)
    dtype = torch.bfloat16
    out = ae.paged_attention(q.to("cuda", dtype), k_cache.to("cuda", dtype), v_cache.to("cuda", dtype),
                             table.cuda(), seqlens.cuda(), is_causal=True, backend=backend)
    assert (out[2] == 0).all()  # the entry without keys
    for b, (keys, values) in enumerate(contiguous[:2]):
        rounded = [t.to(dtype) for t in (q[b:b + 1], keys[None], values[None])]
        k_rep, v_rep = (t.repeat_interleave(H // 2, 1) for t in rounded[1:])
        mask = band_mask(M, lengths[b], True, None, "bottom_right")
        ref = dense(rounded[0].double(), k_rep.double(), v_rep.double(), None, None, mask, "bottom_right")
        same = dense(*(t.cuda() for t in (rounded[0], k_rep, v_rep)), None, None, mask.cuda(), "bottom_right")
        assert_within_flash_rule(out[b:b + 1].cpu(), ref, same.cpu(), name=f"out of entry {b}")
