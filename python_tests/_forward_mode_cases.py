"""Every differentiable public op and module of attn_ext as a function of its differentiable tensors.

Each case is ``name -> build(dtype) -> (fn, inputs)``: ``fn(*inputs)`` returns one tensor (the op's
differentiable outputs flattened and concatenated), ``inputs`` are the tensors it is differentiated
with respect to: every differentiable input, float masks, ``alpha`` and ``theta`` included. The
derivative properties of test_forward_mode_properties.py run over all of them, so a new public op
belongs here.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import torch
from torch import Tensor

import attn_ext as ae

Case = Callable[[torch.dtype], Tuple[Callable[..., Tensor], Sequence[Tensor]]]
CASES: Dict[str, Case] = {}
#: The cases whose ops run on the Triton backend (under the interpreter here; float32 there).
TRITON_CASES = ("cross_attention", "sdpa_float_mask", "sdpa_causal_gqa", "merge_states", "attention_states",
                "intention_alpha")


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


def _randn(g, dtype, *shape) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=dtype)


def _flat(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _qkv(dtype, seed=0, B=1, H=2, M=2, N=4, D=3, Dv=2):
    g = torch.Generator().manual_seed(seed)
    return _randn(g, dtype, B, H, M, D), _randn(g, dtype, B, H, N, D), _randn(g, dtype, B, H, N, Dv)


PADDING = torch.tensor([[False, False, True, False]])


@case
def cross_attention(dtype):
    def fn(q, k, v):
        out, lse = ae.cross_attention(q, k, v, key_padding_mask=PADDING, chunk_size=2, return_lse=True)
        return _flat(out, lse)
    return fn, _qkv(dtype)


@case
def sdpa_float_mask(dtype):
    q, k, v = _qkv(dtype, 1)
    mask = _randn(torch.Generator().manual_seed(2), dtype, 1, 2, 2, 4)
    mask[0, 0, 1, 2] = -float("inf")  # an excluded pair: derivative 0 there, as torch's

    def fn(q, k, v, mask):
        out, lse = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
        return _flat(out, lse)
    return fn, (q, k, v, mask)


@case
def sdpa_causal_gqa(dtype):
    q, _, _ = _qkv(dtype, 3, H=4, M=4)
    _, k, v = _qkv(dtype, 4, H=2)
    return (lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), (q, k, v)


@case
def merge_states(dtype):
    g = torch.Generator().manual_seed(5)
    oa, ob = _randn(g, dtype, 1, 2, 3, 2), _randn(g, dtype, 1, 2, 3, 2)
    la, lb = _randn(g, dtype, 1, 2, 3), _randn(g, dtype, 1, 2, 3)

    def fn(oa, la, ob, lb):
        st = ae.merge_states(ae.AttentionState(oa, la), ae.AttentionState(ob, lb))
        return _flat(st.out, st.lse)
    return fn, (oa, la, ob, lb)


@case
def attention_states(dtype):
    """attention_state, update_state (with a float attn_mask), remove_from_state, stream_attention."""
    q, k, v = _qkv(dtype, 6, N=6)
    bias = _randn(torch.Generator().manual_seed(7), dtype, 1, 1, 2, 2)

    def fn(q, k, v, bias):
        st = ae.attention_state(q, k[:, :, :2], v[:, :, :2])
        st = ae.update_state(st, q, k[:, :, 2:4], v[:, :, 2:4], attn_mask=bias)
        st = ae.update_state(st, q, k[:, :, 4:], v[:, :, 4:])
        st = ae.remove_from_state(st, q, k[:, :, 4:], v[:, :, 4:])
        streamed = ae.stream_attention(q, [(k[:, :, :3], v[:, :, :3]), (k[:, :, 3:], v[:, :, 3:])])
        return _flat(st.out, st.lse, streamed.out, streamed.lse)
    return fn, (q, k, v, bias)


@case
def tree_cross_attention(dtype):
    """tree_aggregate and tree_cross_attention (out, log_prob, entropy) along the selected path."""
    g = torch.Generator().manual_seed(8)
    tree = ae.build_tree(torch.rand(1, 5, generator=g, dtype=torch.float64), branching=2)
    leaves = _randn(g, dtype, 1, 5, 2 * 3)
    q = _randn(g, dtype, 1, 2, 2, 3)

    def fn(q, leaves):
        node = ae.tree_aggregate(tree, leaves).unflatten(-1, (2, 3)).transpose(1, 2)
        res = ae.tree_cross_attention(q, node, node, tree, policy="greedy")
        return _flat(res.out, res.log_prob, res.entropy)
    return fn, (q, leaves)


def _with_tensor_scalar(op, keyword, value, dtype, seed, shape=None, **fixed):
    """``op(q, k, v, keyword=scalar, **fixed)`` differentiated with respect to q, k, v and the tensor scalar."""
    q, k, v = _qkv(dtype, seed, **(shape or dict(N=5)))
    scalar = torch.tensor(value, dtype=dtype)
    return (lambda q, k, v, scalar: op(q, k, v, **{keyword: scalar}, **fixed)), (q, k, v, scalar)


@case
def intention_alpha(dtype):
    return _with_tensor_scalar(ae.intention, "alpha", 0.7, dtype, 9, dict(N=5, D=3),
                               key_padding_mask=PADDING.new_zeros(1, 5))


@case
def intention_dual_form(dtype):
    return _with_tensor_scalar(ae.intention, "alpha", 0.3, dtype, 10, dict(N=2, D=4))  # fewer keys than D: N x N


@case
def sigma_intention(dtype):
    return _with_tensor_scalar(ae.sigma_intention, "alpha", 1.3, dtype, 11)


@case
def intention_map_and_states(dtype):
    _, k, v = _qkv(dtype, 12, N=5)
    q = _qkv(dtype, 13)[0]
    alpha = torch.tensor(0.9, dtype=dtype)

    def fn(q, k, v, alpha):
        st = ae.intention_state(k[:, :, :3], v[:, :, :3])
        st = ae.update_intention_state(st, k[:, :, 3:], v[:, :, 3:])
        return _flat(ae.intention_map(k, v, alpha=alpha), ae.intention_from_state(q, st, alpha=alpha),
                     ae.intention_map_from_state(st, alpha=alpha))
    return fn, (q, k, v, alpha)


@case
def convex_intention(dtype):
    return _with_tensor_scalar(ae.convex_intention, "theta", 0.4, dtype, 14)


@case
def pinv_intention(dtype):
    q, k, v = _qkv(dtype, 15, N=5)
    return (lambda q, k, v: ae.pinv_intention(q, k, v)), (q, k, v)


@case
def kernelised_intention(dtype):
    q, k, v = _qkv(dtype, 16, N=5)
    alpha, lengthscale = torch.tensor(0.8, dtype=dtype), torch.tensor(1.5, dtype=dtype)
    return (lambda q, k, v, a, ls: ae.kernelised_intention(q, k, v, alpha=a, lengthscale=ls)), (q, k, v, alpha,
                                                                                                 lengthscale)


@case
def batched_spd_solve(dtype):
    g = torch.Generator().manual_seed(17)
    x = _randn(g, dtype, 2, 3, 3)
    A = x @ x.transpose(-1, -2) + torch.eye(3, dtype=dtype)
    return (lambda A, B: ae.batched_spd_solve(A, B)), (A, _randn(g, dtype, 2, 3, 2))


def _module(cls, dtype, seed, *args, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs).to(dtype).eval()


@case
def nn_multihead_attention(dtype):
    """Float attn_mask and float key_padding_mask (one holding only 0 and -inf) as differentiable inputs."""
    mha = _module(ae.nn.MultiheadAttention, dtype, 18, 4, 2, batch_first=True)
    g = torch.Generator().manual_seed(19)
    x, mem = _randn(g, dtype, 2, 3, 4), _randn(g, dtype, 2, 4, 4)
    attn_mask = _randn(g, dtype, 3, 4)
    padding = torch.zeros(2, 4, dtype=dtype)
    padding[1, 3] = -float("inf")

    def fn(x, mem, attn_mask, padding):
        out, _ = mha(x, mem, mem, attn_mask=attn_mask, need_weights=False)
        out2, _ = mha(x, mem, mem, key_padding_mask=padding, need_weights=False)
        return _flat(out, out2)
    return fn, (x, mem, attn_mask, padding)


@case
def nn_modules(dtype):
    """CMAB, Intention (both forms), TreeCrossAttention, HyperMixer, PerceiverBlock on their input tensors."""
    cmab = _module(ae.nn.CMAB, dtype, 20, 4, 2, 2, 8)
    intention = _module(ae.nn.Intention, dtype, 21, 4, 2)
    paper = _module(ae.nn.Intention, dtype, 22, 4, 2, form="paper")
    mixer = _module(ae.nn.HyperMixer, dtype, 23, 4, 3)
    perceiver = _module(ae.nn.PerceiverBlock, dtype, 24, 4, 2, 8, True)
    g = torch.Generator().manual_seed(25)
    latents, ctx = _randn(g, dtype, 1, 2, 4), _randn(g, dtype, 1, 5, 4)

    def fn(latents, ctx):
        return _flat(cmab(latents, ctx), intention(latents, ctx, ctx), paper(latents, ctx, ctx),
                     mixer(latents, ctx, ctx), perceiver(latents, ctx))
    return fn, (latents, ctx)


@case
def nn_tree_cross_attention(dtype):
    tca = _module(ae.nn.TreeCrossAttention, dtype, 26, 4, 2)
    g = torch.Generator().manual_seed(27)
    coords, ctx, query = torch.rand(1, 5, generator=g, dtype=dtype), _randn(g, dtype, 1, 5, 4), _randn(g, dtype, 1, 2, 4)

    def fn(query, ctx):
        res = tca(query, tca.build(ctx, coords), policy="greedy")
        return _flat(res.out, res.log_prob, res.entropy)
    return fn, (query, ctx)
