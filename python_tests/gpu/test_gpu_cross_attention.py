"""Cross attention forward and backward on CUDA tensors, ``backend="cuda"`` and ``backend="triton"``,
against the fp64 ground truth with FlashAttention's accuracy rule (out, lse; 3x for gradients).

The cases of the CPU suite: odd head dims, Dv != D, N = 1, fully padded batch entries, padding by
lengths, non-contiguous inputs (transposed views, or rows sliced from wider ones), fp32/fp16/bf16. The ``cuda`` kernels run fp16/bf16 on tensor
cores (WMMA) and fp32 on CUDA cores; the Triton kernels are autotuned per shape on first use. Skipped,
with the reason, without a CUDA device (``pytest -rs``).
"""
import pytest
import torch

import attn_ext as ae
from _gpu import DTYPES, backends, cuda, grid, pytorch_grads_same_precision, pytorch_same_precision
from _helpers import assert_within_flash_rule, backward_case, forward_case, fully_padded_entries

SHAPES = [  # (B, H, M, N, D, Dv)
    (2, 3, 1, 239, 40, 40),
    (1, 2, 113, 203, 59, 59),
    (2, 2, 17, 1, 96, 64),
    (1, 1, 64, 300, 128, 128),
    (1, 2, 33, 77, 256, 256),
]
#: The forward under compute-sanitizer: every head-dim tiling of the CUDA forward (D = 40, 59 on 64-wide tiles, 59
#: not a multiple of 8: the WMMA kernel; D = 128; D = 256 with its 64-row blocks), each small enough for racecheck.
SANITIZE_FORWARD_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4]]


# The backend varies fastest (top decorator), so both backends share one cached ground truth per case.
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", grid(DTYPES, (torch.float32, torch.float16)), ids=str)
@pytest.mark.parametrize("shape", grid(SHAPES, SANITIZE_FORWARD_SHAPES), ids=str)
@pytest.mark.parametrize("mask_kind", grid(["none", "all_padded", "lengths"], ["all_padded"]))
@pytest.mark.parametrize("layout", grid(["contiguous", "strided"], ["contiguous"]))
def test_forward_flash_rule(backend, dtype, shape, mask_kind, layout):
    if layout == "strided":  # views of [B, L, H, D] tensors; with one head those are contiguous: sliced rows
        layout = "transposed" if shape[1] > 1 else "padded_rows"
    q, k, v, mask, scale, refs = forward_case(*shape, dtype, layout=layout, mask_kind=mask_kind)
    (out64, lse64), cpu_pt = refs
    out_pt, lse_pt = pytorch_same_precision(q, k, v, mask, scale, cpu_pt, (out64, lse64))
    qc, kc, vc, mc = cuda(q, k, v, mask)
    out, lse = ae.cross_attention(qc, kc, vc, key_padding_mask=mc, scale=scale, return_lse=True, backend=backend)
    assert out.device.type == "cuda" and out.dtype == dtype and lse.dtype == torch.float32
    assert_within_flash_rule(out.cpu(), out64, out_pt, name=f"{backend} out")
    assert_within_flash_rule(lse.cpu(), lse64, lse_pt, name=f"{backend} lse")
    for b in fully_padded_entries(mask):
        assert bool((out[b] == 0).all()) and bool(torch.isneginf(lse[b]).all()), f"{backend}: padded entry {b}"


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("dtype", grid(DTYPES, (torch.float32, torch.float16)), ids=str)
@pytest.mark.parametrize("shape", grid(SHAPES[:4], SHAPES[:2]), ids=str)
@pytest.mark.parametrize("mask_kind", grid(["none", "all_padded"], ["all_padded"]))
def test_backward_flash_rule(backend, dtype, shape, mask_kind):
    q, k, v, mask, scale, grad_out, grad_lse, ref, cpu_pt = backward_case(*shape, dtype, mask_kind=mask_kind)
    pt = pytorch_grads_same_precision(q, k, v, mask, scale, grad_out, grad_lse, cpu_pt, ref)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    mc = None if mask is None else mask.cuda()
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mc, scale=scale, return_lse=True, backend=backend)
    grads = torch.autograd.grad((out, lse), leaves, cuda(grad_out, grad_lse))
    for label, g, leaf, g64, gpt in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, pt):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"{backend} {label}: {g.dtype} {tuple(g.shape)}"
        assert_within_flash_rule(g.cpu(), g64, gpt, grad=True, name=f"{backend} {label}")
    if mask is not None:
        dq, dk, dv = (g.cpu() for g in grads)
        for b in fully_padded_entries(mask):
            assert bool((dq[b] == 0).all()), f"{backend}: dq of fully padded batch entry {b} is not 0"
        padded = mask[:, None, :, None].expand(-1, k.shape[1], -1, 1)
        assert bool((dk.masked_select(padded) == 0).all()), f"{backend}: dk of padded keys is not 0"
        assert bool((dv.masked_select(padded) == 0).all()), f"{backend}: dv of padded keys is not 0"
