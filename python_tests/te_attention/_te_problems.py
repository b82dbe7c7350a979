"""Random problems of ``ae.te_attention`` for the tests: the nine tensors (the MLP's weights scaled so that the
logits spread over a few units, as a trained model's), a key padding mask, and the dense formula's results."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from attn_ext.ops.te_attention import naive

def make_problem(B=2, H=2, M=5, N=9, D=4, Dv=3, dx=2, hidden=6, *, dtype=torch.float64, seed=0) -> List[Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, M, D), (B, H, N, D), (B, H, N, Dv), (B, M, dx), (B, N, dx), (hidden, H + dx), (hidden,),
              (H, hidden), (H,))
    scales = (1, 1, 1, 1, 1, (H + dx) ** -0.5, 0.5, max(hidden, 1) ** -0.5 * 2, 0.5)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * c).to(dtype) for s, c in zip(shapes, scales)]


def make_mask(B: int, N: int, kind: str, seed: int = 1) -> Optional[Tensor]:
    """None, random padding, or random padding with batch entry 0 all padded."""
    if kind == "none":
        return None
    mask = torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) < 0.3
    if kind == "one_entry_all_padded":
        mask[0] = True
    return mask


def dense(problem, mask=None, activation="relu", scale=None):
    return naive.dense(*problem, key_padding_mask=mask, scale=scale, activation=activation)


NAMES = ("q", "k", "v", "xq", "xk", "w1", "b1", "w2", "b2")


def flash_rule_grads(out, lse, inputs, grad_out, grad_lse):
    """Gradients of ``<out, grad_out> + <lse, grad_lse>`` (an lse of −inf takes none) for all nine inputs."""
    objective = (out * grad_out.to(out.dtype)).sum() + (torch.nan_to_num(lse, neginf=0.0) * grad_lse.to(lse.dtype)).sum()
    return torch.autograd.grad(objective, inputs, allow_unused=True, materialize_grads=True)


def check_flash_rule(backend: str, low, mask=None, activation="relu", seed=0, label=""):
    """``ae.te_attention`` on ``backend`` over the inputs ``low`` (leaves in a low precision) against the fp64 dense
    formula of the same rounded inputs, with FlashAttention's rule against the dense formula in ``low``'s precision:
    output and lse, then the nine gradients."""
    from python_tests._helpers import assert_within_flash_rule

    import attn_ext as ae

    dtype = low[0].dtype
    exact = [t.detach().double().requires_grad_() for t in low]
    out, lse = ae.te_attention(*low, key_padding_mask=mask, activation=activation, return_lse=True, backend=backend)
    ref_out, ref_lse = dense(exact, mask, activation)
    pt_out, pt_lse = dense(low, mask, activation)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within_flash_rule(out, ref_out.detach(), pt_out.detach(), name=f"out {label} {dtype}")
    assert_within_flash_rule(lse, ref_lse.detach(), pt_lse.detach().float(), name=f"lse {label} {dtype}")
    g = torch.Generator().manual_seed(seed + 1)
    grad_out, grad_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    ours = flash_rule_grads(out, lse, low, grad_out, grad_lse)
    theirs = flash_rule_grads(pt_out, pt_lse, low, grad_out, grad_lse)
    truth = flash_rule_grads(ref_out, ref_lse, exact, grad_out, grad_lse)
    pairs = out.shape[0] * out.shape[2] * low[1].shape[2]
    for name, a, b, c in zip(NAMES, ours, theirs, truth):
        assert a.dtype == dtype, f"grad {name}: {a.dtype}"
        assert_within_flash_rule(a, c, b, grad=True, floor_ulps=weight_floor_ulps(name, pairs),
                                 name=f"grad {name} {label} {dtype}")


def weight_floor_ulps(name: str, pairs: int) -> float:
    """The FlashAttention rule's rounding floor, in ulps, for the gradient ``name``: 1, but for ρ's weights, whose
    gradients are sums over all ``pairs`` (query, key) pairs, ``sqrt(pairs)``: a sum's rounding grows as the square
    root of its length, and PyTorch's own error there is as much a matter of luck (one ulp of a row's lse shifts
    every pair of the row alike)."""
    return max(1.0, pairs ** 0.5) if name in ("w1", "b1", "w2", "b2") else 1.0
