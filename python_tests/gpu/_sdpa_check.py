"""What the GPU tests of ``ae.scaled_dot_product_attention`` share: a problem (masks, GQA, key padding) and its
check against the fp64 ground truth with FlashAttention's rule, calibrated by the worse of PyTorch's
same-precision computation on the CPU and on the GPU. Used by test_gpu_sdpa.py (the op's cases, pinned tiles)
and test_gpu_triton_configs.py (every tile config on the causal and masked code paths)."""
import math
import pathlib
import sys

import torch

from _helpers import assert_within_flash_rule, worse_of

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))  # the op's dense reference
from _sdpa_ref import dense_attention  # noqa: E402


def sdpa_problem(B, Hq, Hkv, L, S, D, Dv, kind, dtype, seed=0):
    """``(q, k, v, attn_mask, key_padding_mask)`` on the CPU: a ``"bool"`` or ``"float"`` (additive, some -inf)
    mask, or none for ``"causal"``; the last batch entry's second half of the keys padded."""
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


def _dense(q, k, v, attn_mask, padding, is_causal, keep=None, p=0.0):
    return dense_attention(q, k, v, attn_mask=attn_mask, key_padding_mask=padding, is_causal=is_causal, keep=keep,
                           dropout_p=p)


def assert_sdpa_within_rule(ours, leaves, mask, padding, causal, grad_out, keep=None, p=0.0):
    """``ours = (out, lse, (dq, dk, dv))`` on the GPU against the fp64 dense reference of the CPU ``leaves``
    (with dropout: the ``keep`` mask the op drew and its probability ``p``)."""
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
