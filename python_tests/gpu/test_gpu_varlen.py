"""``ae.varlen_attention`` on the Triton and CUDA kernels on a CUDA device (one launch per kernel over the packed
batch; the interpreter tests the Triton kernels on the CPU in python_tests/attention/test_varlen_triton.py, the host
emulation the CUDA ones in csrc/tests/cuda_packed_emulation_case.h): an NP-like batch (64 sequences of
3 to 196 rows, grouped heads), fp16 and bf16, D = 64 and 128, forward and backward against each sequence's dense fp64
attention with FlashAttention's rule (calibrated by PyTorch's same-precision computation on the GPU); skipped, with
the reason, without a CUDA device.
"""
import pathlib
import sys

import pytest
import torch

import attn_ext as ae
from _gpu import backends
from _helpers import assert_within_flash_rule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from test_varlen_attention import per_sequence  # noqa: E402


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton", "cuda")))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("is_causal, alignment", [(False, "top_left"), (True, "bottom_right")])
def test_np_like_batch_within_the_flash_rule(backend, dtype, D, is_causal, alignment):
    g = torch.Generator().manual_seed(0)
    lengths_q = torch.randint(3, 197, (64,), generator=g)
    lengths_k = torch.randint(3, 197, (64,), generator=g)
    cu = lambda ls: torch.tensor([0] + ls.cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    H, Hkv = 8, 2
    cpu = [torch.randn(int(cu_q[-1]), H, D, generator=g), torch.randn(int(cu_k[-1]), Hkv, D, generator=g),
           torch.randn(int(cu_k[-1]), Hkv, D, generator=g)]
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in cpu)
    out = ae.varlen_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), is_causal=is_causal, alignment=alignment,
                              backend=backend)
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    same = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = per_sequence(*leaves64, cu_q, cu_k, is_causal, None, alignment)
    pt = per_sequence(*same, cu_q, cu_k, is_causal, None, alignment)
    assert_within_flash_rule(out.detach().cpu(), ref.detach(), pt.detach().cpu(), name="out")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = torch.autograd.grad(out, (q, k, v), grad.cuda())
    refs = torch.autograd.grad(ref, leaves64, grad.double())
    pts = torch.autograd.grad(pt, same, grad.cuda())
    for a, r, p, name in zip(ours, refs, pts, "qkv"):
        assert_within_flash_rule(a.cpu(), r, p.cpu(), grad=True, name=f"d{name}")
