"""``ae.scaled_dot_product_attention`` on CUDA tensors, ``backend="cuda"`` and ``backend="triton"``: masks
(bool and additive, broadcast views), causal with L != S, GQA, key padding, and (Triton) dropout, forward
and backward, against the fp64 ground truth with FlashAttention's rule; the worse of PyTorch's
same-precision computation on the CPU and on the GPU calibrates the error. Skipped, with the reason,
without a CUDA device (``pytest -rs``).
"""
import math
import pathlib
import sys

import pytest
import torch

import attn_ext as ae
from _gpu import DTYPES, backends, grid
from _helpers import assert_within_flash_rule, worse_of

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))  # the op's dense reference
from _sdpa_ref import dense_attention  # noqa: E402


def _dense(q, k, v, attn_mask, padding, is_causal, keep=None, p=0.0):
    return dense_attention(q, k, v, attn_mask=attn_mask, key_padding_mask=padding, is_causal=is_causal, keep=keep,
                           dropout_p=p)


CASES = [  # B, Hq, Hkv, L, S, D, Dv, mask kind
    (2, 4, 4, 130, 257, 64, 64, "bool"),
    (1, 8, 2, 200, 200, 128, 128, "causal"),
    (2, 4, 1, 77, 33, 40, 24, "float"),
    (1, 2, 2, 1, 300, 96, 96, "bool"),  # one query (causal would leave it one key: dq = 0 exactly)
]


def _case(B, Hq, Hkv, L, S, D, Dv, kind, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    mask = {"bool": torch.rand(B, 1, L, S, generator=g) > 0.3,
            "float": torch.randn(1, Hq, L, S, generator=g).masked_fill(torch.rand(1, Hq, L, S, generator=g) < 0.2,
                                                                        -math.inf).to(dtype),
            "causal": None}[kind]
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[-1, S // 2:] = True
    return q, k, v, mask, padding


def _within_rule(ours, leaves, mask, padding, causal, grad_out, keep=None, p=0.0):
    out, lse, grads = ours
    m64 = None if mask is None or mask.dtype == torch.bool else mask.double()
    m64 = mask if m64 is None else m64
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = _dense(*l64, m64, padding, causal, keep, p)
    ref_grads = torch.autograd.grad(ref, l64, grad_out.double())
    same = []
    for device in ("cpu", "cuda"):
        lt = [t.detach().to(device).requires_grad_() for t in leaves]
        o, s_lse = _dense(*lt, None if mask is None else mask.to(device), padding.to(device), causal,
                          None if keep is None else keep.to(device), p)
        same.append((o.detach().cpu(), s_lse.detach().cpu(),
                     [g.cpu() for g in torch.autograd.grad(o, lt, grad_out.to(device))]))
    (o_cpu, lse_cpu, g_cpu), (o_gpu, lse_gpu, g_gpu) = same
    assert_within_flash_rule(out.detach().cpu(), ref.detach(), worse_of(o_cpu, o_gpu, ref.detach()), name="out")
    assert_within_flash_rule(lse.detach().cpu(), ref_lse.detach(), worse_of(lse_cpu, lse_gpu, ref_lse.detach()),
                             name="lse")
    for name, g, r, a, b in zip("qkv", grads, ref_grads, g_cpu, g_gpu):
        assert_within_flash_rule(g.cpu(), r, worse_of(a, b, r), grad=True, name=f"d{name}")


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention"))
@pytest.mark.parametrize("dtype", grid(DTYPES, (torch.float32,)), ids=str)
@pytest.mark.parametrize("case", grid(CASES, CASES[:2]), ids=str)
def test_forward_backward_flash_rule(backend, dtype, case):
    q, k, v, mask, padding = _case(*case, dtype)
    causal = case[-1] == "causal"
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out, lse = ae.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.cuda(),
                                               is_causal=causal, enable_gqa=case[1] != case[2],
                                               key_padding_mask=padding.cuda(), return_lse=True, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = torch.autograd.grad(out, leaves, grad_out.cuda())
    _within_rule((out, lse, grads), (q, k, v), mask, padding, causal, grad_out)


@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
def test_dropout_keep_mask_equals_the_reference_generator(backend):
    from attn_ext.ops.attention.dropout import keep_mask

    B, H, L, S = 2, 3, 64, 80
    q = torch.zeros(B, H, L, 16, device="cuda")  # equal scores: out = kept value rows / (S (1 - p))
    k = torch.zeros(B, H, S, 16, device="cuda")
    v = torch.eye(S, device="cuda").expand(B, H, S, S)
    torch.manual_seed(5)
    out = ae.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64))
    assert torch.equal((out.cpu() != 0), keep_mask(seed, 0.3, (B, H, L, S)))
