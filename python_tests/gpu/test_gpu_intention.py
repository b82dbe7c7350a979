"""Intention and σIntention (forward and backward) on CUDA tensors, ``backend="cuda"`` and
``backend="triton"``, against the C++ kernels on the CPU; the batched Cholesky factorisation, its solve and
``batched_spd_solve`` (``cuda`` only: no Triton kernel) against ``torch.linalg`` on the GPU. Skipped
without a CUDA device."""
import pytest
import torch

import attn_ext as ae
from _gpu import backends, cuda, grid


@pytest.mark.parametrize("backend", backends("intention"))
@pytest.mark.parametrize("D", grid([8, 40, 64, 128], [8, 40]))
@pytest.mark.parametrize("masked", [False, True])
def test_intention_matches_cpu(backend, D, masked):
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(2, 3, n, D, generator=g) for n in (11, 257, 257))
    mask = (torch.rand(2, 257, generator=g) < 0.3) if masked else None
    expected = ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask, backend="cpp")
    got = ae.intention(*cuda(q, k, v), alpha=0.5, key_padding_mask=None if mask is None else mask.cuda(),
                       backend=backend)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", backends("intention"))
@pytest.mark.parametrize("masked", [False, True])
def test_intention_backward_matches_cpu(backend, masked):
    g = torch.Generator().manual_seed(1)
    # Under compute-sanitizer 40 keys: racecheck took 4 s per backend at 130 (the kernels, their tiles and the
    # integer specialisations Triton compiles for are the same at both sizes, so the tests stage's compiles serve).
    keys = grid(130, 40)
    q, k, v = (torch.randn(2, 3, n, 40, generator=g) for n in (11, keys, keys))
    mask = (torch.rand(2, keys, generator=g) < 0.3) if masked else None
    alpha = torch.tensor([0.5, 1.0, 2.0])
    grads = {}
    for name, device in (("cpp", "cpu"), (backend, "cuda")):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (q, k, v, alpha)]
        m = None if mask is None else mask.to(device)
        out = ae.intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=name)
        sig = ae.sigma_intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=name)
        grads[device] = [x.cpu() for x in torch.autograd.grad(out.sum() + sig.square().sum(), leaves)]
    for label, ours, theirs in zip(("dq", "dk", "dv", "dalpha"), grads["cuda"], grads["cpu"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4, msg=lambda m, n=label: f"{backend} {n}: {m}")


@pytest.mark.parametrize("backend", backends("batched_cholesky", names=("cuda",)))
@pytest.mark.parametrize("n", grid([7, 40, 64, 128], [7, 40]))
def test_batched_cholesky_matches_torch(backend, n):
    g = torch.Generator().manual_seed(n)
    z = torch.randn(64, n, n, generator=g, dtype=torch.float64)
    a = (z @ z.mT / n + torch.eye(n, dtype=torch.float64)).float().cuda()
    b = torch.randn(64, n, 5, generator=g).cuda()
    L, info = torch.ops.attn_ext.batched_cholesky(a)
    assert int(info.abs().sum()) == 0
    torch.testing.assert_close(L, torch.linalg.cholesky(a), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.ops.attn_ext.batched_cholesky_solve(L, b), torch.cholesky_solve(b, L),
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backend", backends("batched_spd_solve", names=("cuda",)))
def test_spd_solve_on_cuda(backend):
    z = torch.randn(16, 40, 40, dtype=torch.float64)
    a = (z @ z.mT / 40 + torch.eye(40, dtype=torch.float64)).float().cuda()
    b = torch.randn(16, 40, 3).cuda()
    torch.testing.assert_close(ae.batched_spd_solve(a, b), torch.linalg.solve(a, b), rtol=1e-3, atol=1e-4)
