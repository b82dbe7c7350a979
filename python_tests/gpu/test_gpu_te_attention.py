"""Translation-equivariant attention (``ae.te_attention``, forward and the nine gradients) on CUDA tensors,
``backend="triton"`` (it has no CUDA kernel), against the C++ kernels on the CPU in fp32, at TE-TNP's sizes with
padding and tiles cut by the sizes, and fp16/bf16 inputs against the same fp32 result. Skipped without a CUDA
device."""
import pytest
import torch

import attn_ext as ae
from _gpu import backends, grid
from python_tests.te_attention._te_problems import make_mask, make_problem


@pytest.mark.parametrize("backend", backends("te_attention", names=("triton",)))
@pytest.mark.parametrize("shape", grid([(2, 4, 37, 300, 16, 16, 2, 64), (1, 3, 5, 17, 8, 4, 1, 20)],
                                       [(1, 3, 5, 17, 8, 4, 1, 20)]), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_te_attention_matches_cpu(backend, shape, dtype):
    B, N = shape[0], shape[3]
    problem = make_problem(*shape, dtype=dtype, seed=3)
    mask = make_mask(B, N, "padding")
    leaves = {device: [t.detach().to(device).float() if device == "cpu" else t.detach().to(device)
                       for t in problem] for device in ("cpu", "cuda")}
    results = {}
    for device, name in (("cpu", "cpp"), ("cuda", backend)):
        tensors = [t.requires_grad_() for t in leaves[device]]
        out, lse = ae.te_attention(*tensors, key_padding_mask=mask.to(device), return_lse=True, backend=name)
        g = torch.Generator().manual_seed(4)
        grad_out = torch.randn(out.shape, generator=g).to(device=device, dtype=out.dtype)
        grads = torch.autograd.grad((out * grad_out).sum() + lse.sum(), tensors)
        results[device] = [x.detach().float().cpu() for x in (out, lse, *grads)]
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for name, ours, theirs in zip("out lse q k v xq xk w1 b1 w2 b2".split(), results["cuda"], results["cpu"]):
        scale = 1 + theirs.abs().max()
        torch.testing.assert_close(ours / scale, theirs / scale, rtol=0, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
