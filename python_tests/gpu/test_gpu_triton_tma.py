"""The Triton forward and backward through TMA descriptors (``ATTN_EXT_TRITON_TMA=1``, Hopper only) on CUDA tensors
against the fp64 ground truth with FlashAttention's rule,
causal and not, tails (L, S not multiples of the tiles), L != S, GQA, fp16 and bf16, and the forward's persistent
grid config by config. Each case first asserts
that the call qualifies for the TMA kernels (forward and backward), so a refusal cannot pass as a test of them. Skipped, with the
reason, without a CUDA device, on another backend's machine or on a GPU that is not compute capability 9.x.
"""
import pytest
import torch

import attn_ext as ae
from _gpu import SANITIZE, backends
from _sdpa_check import assert_sdpa_within_rule, sdpa_problem

CASES = [  # B, Hq, Hkv, L, S, D, Dv
    (1, 4, 4, 256, 256, 64, 64),
    (2, 4, 2, 200, 333, 128, 128),  # tails in both, GQA
    (1, 2, 2, 1, 300, 96, 96),  # one query, D padded to a 128-wide descriptor block
]


def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    return None if major == 9 else f"compute capability {major}.x: the TMA forward is Hopper's (9.x)"


@pytest.mark.skipif(SANITIZE, reason="not in the sanitizer's selection (the general kernels are)")
@pytest.mark.skipif(_hopper_reason() is not None, reason=f"TMA forward not tested: {_hopper_reason()}")
@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_tma_forward_backward_flash_rule(monkeypatch, backend, case, dtype, causal):
    from attn_ext.ops.attention.triton_bwd_tma import tma_backward_unavailable_reason
    from attn_ext.ops.attention.triton_fwd_tma import tma_forward_unavailable_reason

    monkeypatch.setenv("ATTN_EXT_TRITON_TMA", "1")
    q, k, v, _, _ = sdpa_problem(*case, "causal", dtype)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    assert tma_forward_unavailable_reason(*leaves) is None
    out, lse = ae.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=case[1] != case[2],
                                               return_lse=True, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert tma_backward_unavailable_reason(grad_out.cuda(), *leaves) is None
    grads = torch.autograd.grad(out, leaves, grad_out.cuda())
    no_padding = torch.zeros(case[0], case[4], dtype=torch.bool)
    assert_sdpa_within_rule((out, lse, grads), (q, k, v), None, no_padding, causal, grad_out)


@pytest.mark.skipif(SANITIZE, reason="not in the sanitizer's selection (the general kernels are)")
@pytest.mark.skipif(_hopper_reason() is not None, reason=f"TMA forward not tested: {_hopper_reason()}")
@pytest.mark.parametrize("backend", backends("scaled_dot_product_attention", ("triton",)))
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_tma_persistent_grid_each_config(monkeypatch, backend, case):
    """Each persistent config the pruning keeps on this card for a causal call (``make gpu-check`` pins one config
    per call, never a persistent one), run alone with a grid of fewer programs than tiles."""
    import triton

    from attn_ext.ops.attention import triton_fwd_tma

    monkeypatch.setenv("ATTN_EXT_TRITON_TMA", "1")
    q, k, v, _, _ = sdpa_problem(*case, "causal", torch.bfloat16)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(*case[:2], case[3], case[6], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    named = {"Q": leaves[0], "BLOCK_N_MAX": 128, "M_BUCKET": 1 << (case[3] - 1).bit_length(), "N_BUCKET": 4096}
    configs = [c for c in triton_fwd_tma._prune(triton_fwd_tma._configs(), named, BLOCK_D=case[5], BLOCK_DV=case[6],
                                                IS_CAUSAL=True) if c.kwargs["PROGRAMS_PER_SM"]]
    if not configs:
        pytest.skip(f"the pruning keeps no persistent config at D = {case[5]} on this card and Triton "
                    f"{triton.__version__} (its spill table)")
    for config in configs:
        monkeypatch.setattr(triton_fwd_tma, "_fwd_tma_kernel_tuned",
                            lambda c=config: triton.autotune(configs=[c], key=[])(triton_fwd_tma._fwd_tma_kernel))
        out, lse = ae.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=case[1] != case[2],
                                                   return_lse=True, backend=backend)
        grads = torch.autograd.grad(out, leaves, grad_out.cuda())  # the backward takes the persistent grid's lse
        no_padding = torch.zeros(case[0], case[4], dtype=torch.bool)
        assert_sdpa_within_rule((out, lse, grads), (q, k, v), None, no_padding, True, grad_out)
