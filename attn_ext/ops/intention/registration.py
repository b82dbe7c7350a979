"""Custom ops of the Intention family: the Python backends' ops, fake kernels, autograd, and the backends
each public op declares (the dispatch table of :mod:`attn_ext.ops.utils.dispatch`).

Public function → op → backend → kernel function (a forward op ``<op>_fwd…`` has its backward
``<op>_bwd…``, registered as its autograd)::

    public function         op (torch.ops.attn_ext.)    backend    kernel functions
    ----------------------  --------------------------  ---------  ----------------------------------------------
    intention (ridge.py)    intention_fwd               cpp        attn_ext::cpu::intention_{fwd,bwd}_cpu
                                                                   (csrc/cpu/intention.cpp)
                            intention_fwd               cuda       attn_ext::cuda::intention_{fwd,bwd}_cuda
                                                                   (csrc/cuda/bindings/intention.cpp)
                            intention_fwd_triton        triton     triton_ridge.intention_fwd_triton,
                                                                   triton_ridge.intention_bwd_triton
                            — (PyTorch code)            reference  naive.intention_primal
    sigma_intention         sigma_intention_fwd         cpp        attn_ext::cpu::sigma_intention_fwd_cpu
      (ridge.py)                                                   (csrc/cpu/sigma_intention.cpp); backward:
                                                                   cross_attention_bwd, then intention_bwd
                            intention_fwd               cuda       Q̃ = attn_ext::cuda::intention_fwd_cuda without
                                                                   values, then attn_ext.cross_attention
                            cross_attention_fwd_triton  triton     Q̃ = naive.transformed_queries, then
                                                                   attn_ext.cross_attention
                            — (PyTorch code)            reference  the same on the reference backend
    batched_cholesky,       batched_cholesky,           cpp        attn_ext::cpu::batched_cholesky{,_solve}_cpu
    batched_cholesky_solve  batched_cholesky_solve                 (csrc/cpu/batched_cholesky.cpp)
      (cholesky.py)                                     cuda       attn_ext::cuda::batched_cholesky{,_solve}_cuda
                                                                   (csrc/cuda/bindings/intention.cpp)
    batched_spd_solve       batched_spd_solve           cpp        attn_ext::cpu::batched_spd_solve_cpu
      (cholesky.py)                                                (csrc/cpu/batched_cholesky.cpp)
                                                        cuda       _cuda_composition below: batched_cholesky,
                                                                   then batched_cholesky_solve

The dual form (``intention``'s ``form``, and the heads ``sigma_intention`` solves in the dual) is PyTorch
code on every backend (:mod:`.dual`). The compiled ops (cpp for CPU tensors, cuda for CUDA tensors) are
defined and implemented in C++ (``csrc/op_list.h``); the Triton backend's ops below take the same schemas
(:func:`~attn_ext.ops.utils.schemas.op_schema`).

**Intention** (docs/spec.md §0, §4). ``intention_fwd`` returns ``(out, factor, weights)``: the output, the
Cholesky factor ``L`` of ``KᵀK + αI`` and ``W = (KᵀK + αI)⁻¹KᵀV``, both kept for ``intention_bwd``, which
needs one more solve with ``L`` and no inverse. ``factor`` and ``weights`` are intermediates the public
functions never return: the fused backward ignores gradients reaching them, so such gradients (and higher
derivatives) go through :mod:`.composite`.

The Triton kernel module is imported inside the Triton backend functions: Triton is an optional
dependency, and it reads ``TRITON_INTERPRET`` when a kernel is decorated, so it loads on the first
Triton call (:mod:`attn_ext.ops.utils.triton`).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from attn_ext.ops.intention import composite
from attn_ext.ops.intention.cholesky_checks import check_matrix_and_rhs, check_square
from attn_ext.ops.utils.autograd import Derivatives, register_derivatives, register_not_differentiable
from attn_ext.ops.utils.dispatch import Implementation, declare
from attn_ext.ops.utils.dtypes import accumulation_dtype
from attn_ext.ops.utils.extension import extension_error
from attn_ext.ops.utils.registration import define_op, register_op_pair


# ---- intention_fwd: the ridge regression's prediction, with the factor and weights for the backward


@define_op("attn_ext::intention_fwd_triton")
def intention_fwd_triton_op(q, k, v, key_padding_mask, alpha, scale):
    from attn_ext.ops.intention import triton_ridge  # optional dependency (Triton)

    return triton_ridge.intention_fwd_triton(q, k, v, key_padding_mask, alpha, scale)


@define_op("attn_ext::intention_bwd_triton")
def intention_bwd_triton_op(grad_out, q, k, v, key_padding_mask, factor, weights, scale):
    from attn_ext.ops.intention import triton_ridge  # optional dependency (Triton)

    return triton_ridge.intention_bwd_triton(grad_out, q, k, v, key_padding_mask, factor, weights, scale)


def _fake_forward(q, k, v, key_padding_mask, alpha, scale):
    B, H, M, D = q.shape
    Dv = D if v is None else v.shape[-1]  # no values: C = I, the transformed queries
    acc = accumulation_dtype(q.dtype)
    return q.new_empty((B, H, M, Dv)), q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, Dv), dtype=acc)


def _fake_backward(grad_out, q, k, v, key_padding_mask, factor, weights, scale):
    B, H = q.shape[:2]
    grad_v = q.new_empty((0,)) if v is None else v.new_empty(v.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), grad_v, q.new_empty((B, H), dtype=accumulation_dtype(q.dtype))


def _no_gradient_reached_intermediates(grads) -> bool:
    return all(g is None for g in grads[1:])


def _derivatives(backward_op) -> Derivatives:
    def backward(inputs, outputs, grads):
        q, k, v, key_padding_mask, alpha, scale = inputs
        _, factor, weights = outputs
        grad_q, grad_k, grad_v, grad_alpha = backward_op(grads[0], q, k, v, key_padding_mask, factor, weights, scale)
        return grad_q, grad_k, None if v is None else grad_v, None, grad_alpha.to(alpha.dtype), None

    return Derivatives(backward, composite.intention, differentiable_inputs=(0, 1, 2, 4),
                       differentiable_outputs=(0, 1, 2), exact_first_order=_no_gradient_reached_intermediates)


register_op_pair("attn_ext::intention_fwd_triton", "attn_ext::intention_bwd_triton", _fake_forward, _fake_backward,
                 _derivatives, "attn_ext.intention")
if extension_error() is None:
    register_op_pair("attn_ext::intention_fwd", "attn_ext::intention_bwd", _fake_forward, _fake_backward,
                     _derivatives, "attn_ext.intention")


# ---- sigma_intention_fwd: σIntention fused on the CPU (csrc/cpu/sigma_intention.cpp). It returns what
# intention_fwd(v=None) and cross_attention_fwd(q_tilde, k, v, scale=1) would: its backward is theirs,
# composed (no op of its own).
def _fake_sigma_forward(q, k, v, key_padding_mask, alpha, scale, chunk_size):
    B, H, M, D = q.shape
    acc = accumulation_dtype(q.dtype)
    return (q.new_empty((B, H, M, v.shape[-1])), q.new_empty((B, H, M), dtype=acc), q.new_empty((B, H, M, D)),
            q.new_empty((B, H, D, D), dtype=acc), q.new_empty((B, H, D, D), dtype=acc))


def _sigma_backward(inputs, outputs, grads):
    q, k, v, key_padding_mask, alpha, scale, chunk_size = inputs
    out, lse, q_tilde, factor, weights = outputs
    grad_out, grad_lse, grad_q_tilde = grads[:3]
    grad_qt, grad_k, grad_v = torch.ops.attn_ext.cross_attention_bwd(grad_out, grad_lse, q_tilde, k, v, key_padding_mask,
                                                                      out, lse, 1.0, chunk_size)
    grad_qt = grad_qt + grad_q_tilde  # q_tilde is an intermediate the public function never returns, but exact
    grad_q, grad_k_gram, _, grad_alpha = torch.ops.attn_ext.intention_bwd(grad_qt, q, k, None, key_padding_mask, factor,
                                                                         weights, scale)
    return grad_q, grad_k + grad_k_gram, grad_v, None, grad_alpha.to(alpha.dtype), None, None


def _sigma_exact(grads) -> bool:
    return grads[3] is None and grads[4] is None


if extension_error() is None:
    torch.library.register_fake("attn_ext::sigma_intention_fwd")(_fake_sigma_forward)
    register_derivatives("attn_ext::sigma_intention_fwd",
                         Derivatives(_sigma_backward, composite.sigma_intention, differentiable_inputs=(0, 1, 2, 4),
                                     differentiable_outputs=(0, 1, 2, 3, 4), exact_first_order=_sigma_exact),
                         "attn_ext.sigma_intention")


# ---- batched_cholesky, batched_cholesky_solve, batched_spd_solve (docs/spec.md §4): fakes, and an autograd
# formula for the factor and the solve that raises (without any formula torch would only warn and let
# gradients silently stop at these ops).

def _fake_cholesky(A: Tensor) -> Tuple[Tensor, Tensor]:
    check_square("batched_cholesky", "A", A)
    return A.new_empty(A.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _fake_cholesky_solve(L: Tensor, B: Tensor) -> Tensor:
    check_matrix_and_rhs("batched_cholesky_solve", "L", L, B)
    return B.new_empty(B.shape)


if extension_error() is None:
    torch.library.register_fake("attn_ext::batched_cholesky")(_fake_cholesky)
    torch.library.register_fake("attn_ext::batched_cholesky_solve")(_fake_cholesky_solve)
    for _op in ("batched_cholesky", "batched_cholesky_solve"):
        register_not_differentiable(
            f"attn_ext::{_op}", "by design (the Intention op's backward reuses the factor by hand); use "
            "torch.linalg.cholesky / torch.cholesky_solve where gradients are needed, or attn_ext.batched_spd_solve")


def _fake_spd_solve(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    check_matrix_and_rhs("batched_spd_solve", "A", A, B)
    return B.new_empty(B.shape), A.new_empty(A.shape[:-2], dtype=torch.int32)


def _spd_solve_backward(inputs, outputs, grads):
    A, _ = inputs
    X, _ = outputs
    grad_b = torch.ops.attn_ext.batched_spd_solve(A, grads[0].contiguous())[0]
    g = -(grad_b @ X.mT)
    grad_a = (g + g.mT).tril() - torch.diag_embed(g.diagonal(dim1=-2, dim2=-1))
    return grad_a, grad_b


def _cuda_composition(A: Tensor, B: Tensor) -> Tuple[Tensor, Tensor]:
    """CUDA: the batched Cholesky then solve kernels (no fused CUDA kernel yet), NaN where A is not SPD."""
    L, info = torch.ops.attn_ext.batched_cholesky(A)
    X = torch.ops.attn_ext.batched_cholesky_solve(L, B)
    return X.masked_fill((info != 0)[..., None, None], float("nan")), info


if extension_error() is None:
    if torch._C._dispatch_has_kernel_for_dispatch_key("attn_ext::batched_cholesky", "CUDA"):
        torch.library.impl("attn_ext::batched_spd_solve", "CUDA")(_cuda_composition)
    torch.library.register_fake("attn_ext::batched_spd_solve")(_fake_spd_solve)
    register_derivatives("attn_ext::batched_spd_solve",
                         Derivatives(_spd_solve_backward, composite.spd_solve, differentiable_inputs=(0, 1),
                                     differentiable_outputs=(0,)), "attn_ext.batched_spd_solve")


def _within_triton_tiles(q, context):
    from attn_ext.ops.intention.triton_ridge import MAX_HEAD_DIM, MAX_VALUE_DIM  # optional dependency (Triton)

    if q.shape[-1] > MAX_HEAD_DIM or context.get("value_dim", 0) > MAX_VALUE_DIM:
        return (f"the Triton kernels hold the [D, D] factor in registers: D <= {MAX_HEAD_DIM} and "
                f"Dv <= {MAX_VALUE_DIM}, got D = {q.shape[-1]}, Dv = {context.get('value_dim')}")
    return None


# ---- the backends of each public op (the front ends dispatch through these names)

# The dual form (N < D) is PyTorch code whatever the backend (see ``form`` of attn_ext.intention).
INTENTION = declare(
    "intention",
    cpp=Implementation("intention_fwd"),
    cuda=Implementation("intention_fwd"),
    triton=Implementation(intention_fwd_triton_op, (_within_triton_tiles,)),
    reference=Implementation())
# σIntention: fused on the CPU; CUDA makes Q̃ with the Intention kernel without values (C = I), Triton and
# the reference with the reference code, then each runs its cross attention. The Triton backend names the
# attention family's op by its name: this family may import only the package attn_ext.ops.attention (its
# public functions), not its registration module, where the function behind that op is defined (the
# import rule of bench/tests/import_graph.py).
SIGMA_INTENTION = declare(
    "sigma_intention",
    cpp=Implementation("sigma_intention_fwd"),
    cuda=Implementation("intention_fwd"),
    triton=Implementation("cross_attention_fwd_triton"),
    reference=Implementation())
# Compiled kernels only: no Python backend (torch.linalg.cholesky_ex is the PyTorch equivalent).
BATCHED_CHOLESKY = declare("batched_cholesky", cpp=Implementation("batched_cholesky"),
                           cuda=Implementation("batched_cholesky"))
BATCHED_CHOLESKY_SOLVE = declare("batched_cholesky_solve", cpp=Implementation("batched_cholesky_solve"),
                                 cuda=Implementation("batched_cholesky_solve"))
BATCHED_SPD_SOLVE = declare("batched_spd_solve", cpp=Implementation("batched_spd_solve"),
                            cuda=Implementation("batched_spd_solve"))
