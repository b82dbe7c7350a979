"""The Triton and CUDA kernels' sliding window, offset causal rule, soft cap and ALiBi on a CUDA device (the
interpreter tests the Triton ones on the CPU in python_tests/attention/test_sdpa_triton_band_scores.py, the host
emulation the CUDA ones' source in csrc/tests/cuda_*_emulation_test.cpp): forward and backward of fp16 and
bf16 calls at D = 64 and 128 against the dense fp64 definition with FlashAttention's rule (calibrated by PyTorch's
same-precision computation on the GPU), with the autotuned tiles; skipped, with the reason, without a CUDA device.
"""
import pathlib
import sys

import pytest
import torch

import attn_ext as ae
from _gpu import backends
from _helpers import assert_within_flash_rule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from test_sdpa_score_mods import dense, slopes_for  # noqa: E402
from test_sdpa_window import band_mask  # noqa: E402

CASES = {  # softcap, alibi, is_causal, window, alignment
    "mistral window": (None, False, True, (256, 0), "bottom_right"),
    "gemma2": (30.0, False, True, (128, 0), "top_left"),
    "alibi causal": (None, True, True, None, "top_left"),
    "two-sided": (None, False, False, (100, 60), "top_left"),
}


# The CUDA kernels in bf16 only: their fp16 and bf16 instantiations share the per-pair code, and the tests stage of
# make gpu-check has a fixed time (docs/gpu_check.md).
# Ids end with the backend: the tests stage orders the tests by it (python_tests/gpu/_order.py).
BACKEND_DTYPES = [pytest.param(*backend.values, dtype, marks=backend.marks, id=f"{str(dtype)[6:]}-{backend.id}")
                  for backend in backends("scaled_dot_product_attention", ("triton", "cuda"))
                  for dtype in (torch.float16, torch.bfloat16) if backend.id == "triton" or dtype == torch.bfloat16]


@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_band_and_score_mods_within_the_flash_rule(backend, case, D, dtype):
    softcap, alibi, is_causal, window, alignment = CASES[case]
    B, Hq, Hkv, L, S = 2, 4, 2, 700, 900
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(B, Hq, L, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
           torch.randn(B, Hkv, S, D, generator=g)]
    slopes = slopes_for(B, Hq) if alibi else None
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in cpu)
    out = ae.scaled_dot_product_attention(q, k, v, softcap=softcap, alibi_slopes=None if slopes is None else
                                          slopes.cuda(), is_causal=is_causal, window_size=window,
                                          alignment=alignment, enable_gqa=True, backend=backend)
    mask = band_mask(L, S, is_causal, window, alignment)
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = dense(*leaves64, softcap, slopes, mask, alignment)
    pt = dense(*same, softcap, slopes, mask.cuda(), alignment)
    assert_within_flash_rule(out.detach().cpu(), ref.detach(), pt.detach().cpu(), name="out")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = torch.autograd.grad(out, (q, k, v), grad.cuda())
    refs = torch.autograd.grad(ref, leaves64, grad.double())
    pts = torch.autograd.grad(pt, same, grad.cuda())
    for a, r, p, name in zip(ours, refs, pts, "qkv"):
        assert_within_flash_rule(a.cpu(), r, p.cpu(), grad=True, name=f"d{name}")
