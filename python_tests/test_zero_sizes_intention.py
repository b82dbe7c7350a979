"""Sizes of 0 in every dimension of the Intention family, the tree ops, the batched solvers and translation-
equivariant attention, forward and backward, on every backend (the harness: _zero_sizes.py; attention ops:
test_zero_sizes.py).

Over no key Intention's ridge system is ``αI`` with nothing to fit, so the output is 0; empty batches,
heads, queries or value columns give empty results. A zero head dim ``D``, a tree over no point or
with no head (its policy averages the heads), and Nyström landmarks out of no key are refused naming
the op. TE attention takes every zero: no head dim (the logits see only the differences), no input dim, no
hidden unit (constant logits b2), no head.
"""
from __future__ import annotations

import pytest
import torch

import attn_ext as ae
from _zero_sizes import (F64, REFUSE_D, Case, attention, check, key_allowed, padding, params, randn, ridge_queries,
                         ridge_weights, spd)

SIZES = dict(B=2, H=2, M=3, N=5, D=4, Dv=3)
ALPHA = 0.5


def _qkv_mask(s, dtype, g):
    B, H = s["B"], s["H"]
    return (randn(g, dtype, B, H, s["M"], s["D"]), randn(g, dtype, B, H, s["N"], s["D"]),
            randn(g, dtype, B, H, s["N"], s["Dv"]), padding(g, B, s["N"]))


def _rbf_ridge(q, k, v, mask, alpha):
    """Exact kernelised Intention: ``k(Q, K) (k(K, K) + αI)⁻¹ V`` over the valid keys (RBF, ℓ = 1)."""
    def rbf(x, y):
        return torch.exp(-0.5 * torch.cdist(x, y).pow(2))

    pad = mask[:, None, :]
    eye = torch.eye(k.shape[2], dtype=k.dtype)
    gram = torch.where(pad[..., :, None] | pad[..., None, :], eye * (1 + alpha), rbf(k, k) + alpha * eye)
    weights = torch.linalg.solve(gram, torch.where(pad[..., None], torch.zeros_like(v), v))
    return rbf(q, k).masked_fill(pad[:, :, None, :], 0.0) @ weights


def _state_family(q, k, v, mask):
    state = ae.intention_state(k, v, key_padding_mask=mask)
    twice = ae.update_intention_state(state, k, v, key_padding_mask=mask)
    state = ae.merge_intention_states(ae.remove_from_intention_state(twice, k, v, key_padding_mask=mask), state)
    return (ae.intention_from_state(q, state, alpha=ALPHA), ae.intention_map_from_state(state, alpha=ALPHA),
            ae.pinv_intention_from_state(q, state, alpha=ALPHA))


def _state_family_reference(q, k, v, mask):
    weights = ridge_weights(k, v, ALPHA / 2, mask)  # the statistics counted twice: (2G + αI)⁻¹ 2C
    return q @ weights, weights, q @ weights


def _tree_problem(s, dtype, g):
    B, H, M, D, Dv = s["B"], s["H"], s["M"], s["D"], s["Dv"]
    tree = ae.build_tree(torch.rand(B, 6, 1, generator=g, dtype=F64).to(dtype))
    return (randn(g, dtype, B, H, M, D), randn(g, dtype, B, H, tree.num_nodes, D),
            randn(g, dtype, B, H, tree.num_nodes, Dv), tree)


def _tree_results(result):
    return result.out, result.log_prob, result.entropy


def _tree_reference(q, node_k, node_v, tree):
    # The tree's math at Dv = 0 is that of its values padded by a column (out has none; the policy's
    # log_prob and entropy do not read values), each checked against fp64 PyTorch in tests/tree.
    padded = torch.cat([node_v, node_v.new_zeros(node_v.shape[:-1] + (1,))], -1)
    out, log_prob, entropy = _tree_results(ae.tree_cross_attention(q, node_k, padded, tree, backend="cpp"))
    return out[..., :node_v.shape[-1]], log_prob, entropy


def _aggregate_problem(s, dtype, g):
    tree = ae.build_tree(torch.rand(s["B"], 6, 1, generator=g, dtype=F64))
    return randn(g, dtype, s["B"], 6, s["C"]), tree


def _aggregate_reference(values, tree):
    # Channels are independent: C = 0 is the C = 1 result without its column (tests/tree check that one).
    padded = torch.cat([values, values.new_ones(values.shape[:-1] + (1,))], -1)
    return ae.tree_aggregate(tree, padded)[..., :values.shape[-1]]


TE_SIZES = dict(B=2, H=2, M=3, N=5, D=4, Dv=3, dx=2, hidden=5)


def _te_problem(s, dtype, g):
    B, H, M, N, dx, hidden = s["B"], s["H"], s["M"], s["N"], s["dx"], s["hidden"]
    return (randn(g, dtype, B, H, M, s["D"]), randn(g, dtype, B, H, N, s["D"]), randn(g, dtype, B, H, N, s["Dv"]),
            randn(g, dtype, B, M, dx), randn(g, dtype, B, N, dx), randn(g, dtype, hidden, H + dx),
            randn(g, dtype, hidden), randn(g, dtype, H, hidden), randn(g, dtype, H), padding(g, B, N))


def _te_reference(*problem):
    from attn_ext.ops.te_attention import naive

    return naive.dense(*problem[:9], key_padding_mask=problem[9], scale=0.5)


def _solve_problem(s, dtype, g):
    return spd(g, dtype, s["B"], s["n"]), randn(g, dtype, s["B"], s["n"], s["r"])


CASES = [
    Case("intention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.intention(q, k, v, alpha=ALPHA, key_padding_mask=m, backend=b),
         lambda q, k, v, m: q @ ridge_weights(k, v, ALPHA, m), ("cpp", "triton"), (0, 1, 2), {"D": REFUSE_D}),
    Case("intention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.intention(q, k, v, alpha=ALPHA, key_padding_mask=m, form="dual", backend=b),
         lambda q, k, v, m: q @ ridge_weights(k, v, ALPHA, m), ("cpp",), (0, 1, 2), {"D": REFUSE_D},
         label="intention_dual"),
    Case("sigma_intention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.sigma_intention(q, k, v, alpha=ALPHA, key_padding_mask=m, backend=b),
         lambda q, k, v, m: attention(ridge_queries(q, k, ALPHA, m, 1.0), k, v, key_allowed(m), scale=1.0)[0],
         ("cpp", "triton"), (0, 1, 2), {"D": REFUSE_D}),
    Case("convex_intention", SIZES, _qkv_mask,  # θ = 0: Σ = ½(KᵀK + I)
         lambda b, q, k, v, m: ae.convex_intention(q, k, v, theta=0.0, key_padding_mask=m, backend=b),
         lambda q, k, v, m: 2 * q @ ridge_weights(k, v, 1.0, m), ("cpp", "triton"), (0, 1, 2), {"D": REFUSE_D}),
    Case("pinv_intention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.pinv_intention(q, k, v, alpha=ALPHA, key_padding_mask=m),
         lambda q, k, v, m: q @ ridge_weights(k, v, ALPHA, m), grad_inputs=(0, 1, 2), refuses={"D": REFUSE_D}),
    Case("kernelised_intention", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.kernelised_intention(q, k, v, alpha=ALPHA, key_padding_mask=m, backend=b),
         lambda q, k, v, m: _rbf_ridge(q, k, v, m, ALPHA), ("cpp", "triton"), (0, 1, 2), {"D": REFUSE_D}),
    Case("kernelised_intention", SIZES, _qkv_mask,  # 2 landmarks of at most 2 valid keys: all of them, exact
         lambda b, q, k, v, m: ae.kernelised_intention(q, k[:, :, :2], v[:, :, :2], alpha=ALPHA, num_landmarks=2,
                                                       key_padding_mask=m[:, :2], backend=b),
         lambda q, k, v, m: _rbf_ridge(q, k[:, :, :2], v[:, :, :2], m[:, :2], ALPHA), ("cpp",), (0, 1, 2),
         {"D": REFUSE_D, "N": r"num_landmarks must be None \(exact\) or an int in \[1, N = 0\]"}, label="nystrom"),
    Case("intention_map", SIZES, _qkv_mask,
         lambda b, q, k, v, m: ae.intention_map(k, v, alpha=ALPHA, key_padding_mask=m, backend=b),
         lambda q, k, v, m: ridge_weights(k, v, ALPHA, m), ("cpp", "triton"), (1, 2), {"D": REFUSE_D}),
    Case("intention_state", SIZES, _qkv_mask, lambda b, *args: _state_family(*args), _state_family_reference,
         grad_inputs=(0, 1, 2), refuses={"D": REFUSE_D}),
    Case("tree_cross_attention", dict(B=2, H=2, M=3, D=4, Dv=3), _tree_problem,
         lambda b, q, nk, nv, tree: _tree_results(ae.tree_cross_attention(q, nk, nv, tree, backend=b)),
         _tree_reference, ("cpp", "triton"), (0, 1, 2),
         {"D": REFUSE_D, "H": "heads H must be positive"}),
    Case("tree_aggregate", dict(B=2, C=3), _aggregate_problem,
         lambda b, values, tree: ae.tree_aggregate(tree, values, backend=b), _aggregate_reference, ("cpp",), (0,)),
    Case("build_tree", dict(B=2, N=6, d=2), lambda s, dtype, g: (torch.rand(s["B"], s["N"], s["d"], generator=g),),
         lambda b, points: ae.build_tree(points).node_padding_mask.to(F64),
         lambda points: torch.zeros(0, ae.build_tree(torch.rand((1,) + points.shape[1:])).num_nodes, dtype=F64),
         refuses={"N": r"cannot build a tree over N = 0 tokens", "d": "no coordinate"}),
    Case("te_attention", TE_SIZES, _te_problem,
         lambda b, *p: ae.te_attention(*p[:9], key_padding_mask=p[9], scale=0.5, return_lse=True, backend=b),
         _te_reference, ("cpp", "reference"), tuple(range(9))),
    Case("batched_cholesky", dict(B=2, n=3), lambda s, dtype, g: (spd(g, dtype, s["B"], s["n"]),),
         lambda b, a: ae.batched_cholesky(a)[0], lambda a: torch.linalg.cholesky(a)),
    Case("batched_cholesky_solve", dict(B=2, n=3, r=2), _solve_problem,
         lambda b, a, x: ae.batched_cholesky_solve(torch.linalg.cholesky(a), x),
         lambda a, x: torch.cholesky_solve(x, torch.linalg.cholesky(a))),
    Case("batched_spd_solve", dict(B=2, n=3, r=2), _solve_problem, lambda b, a, x: ae.batched_spd_solve(a, x),
         lambda a, x: torch.linalg.solve(a, x), grad_inputs=(0, 1)),
]


@pytest.mark.parametrize("case, dim, backend", params(CASES))
def test_op_with_a_zero_dimension(case, dim, backend):
    check(case, dim, backend)


def test_every_public_op_has_a_zero_size_case():
    import test_zero_sizes

    covered = {c.op for c in CASES + test_zero_sizes.CASES}
    covered |= {"intention_from_state", "intention_map_from_state", "pinv_intention_from_state",  # _state_family
                "update_intention_state", "merge_intention_states", "remove_from_intention_state"}
    not_ops = {"available_backends", "intention_variance_scale", "tree_num_selected"}  # size arithmetic, no tensor op
    public = {n for n in ae.__all__ if callable(getattr(ae, n, None)) and n[0].islower() and n not in ("nn", "ops")}
    assert public - not_ops - covered == set()
