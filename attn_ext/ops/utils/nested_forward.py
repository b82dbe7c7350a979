"""Forward over forward: where ``torch.func``'s nesting makes a custom autograd rule silently wrong.

With two ``torch.func.jvp`` levels open (``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``), PyTorch
differentiates an ``autograd.Function``'s ``jvp`` rule as if the tensors it saved were constants
(pytorch/pytorch#197867), and the fused ``layer_norm`` drops a term of its own (pytorch/pytorch#196700).
The ops then run their composite instead (:func:`composite_entry`), and ``attn_ext.nn.LayerNorm`` its
elementary formula: both are plain PyTorch, which every transform differentiates to any order.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters


def forward_over_forward() -> bool:
    """Whether two or more ``torch.func`` forward-mode (``jvp``) levels are open: ``jacfwd(jacfwd(f))``,
    ``jvp`` of ``jvp``, ``hessian`` built from ``jacfwd`` twice, and any nesting holding two.

    There an ``autograd.Function``'s ``jvp`` rule is wrong (torch 2.4 to 2.13 at least): the outer level
    sees the rule's saved tensors as constants, so ``jacfwd(jacfwd(Function))`` misses every term that
    differentiates them (``jacfwd(jacfwd(sin))`` through a Function gives 0, not ``-sin``). One ``jvp``
    level beside any number of ``grad`` / ``vjp`` levels is right, and so is ``forward_ad``, which cannot
    nest at all."""
    jvp_levels = 0
    for interpreter in retrieve_all_functorch_interpreters():
        if interpreter.key() == TransformType.Jvp:
            jvp_levels += 1
    return jvp_levels >= 2


def composite_entry(spec, function: type) -> Callable:
    """An op as its composite, for :func:`forward_over_forward`: plain PyTorch that every transform
    differentiates to any order. ``spec`` is the op's :class:`~attn_ext.ops.utils.autograd.Derivatives`,
    ``function`` its ``autograd.Function``, which still computes the outputs that are not differentiable
    (a tree's selected nodes, which the composite reads); the differentiable ones are the composite's."""

    def call(*args):
        outputs = function.apply(*args)
        single = isinstance(outputs, Tensor)
        outputs = [outputs] if single else list(outputs)
        for i, value in zip(spec.differentiable_outputs, spec.composite(list(args), outputs)):
            outputs[i] = value
        return outputs[0] if single else tuple(outputs)

    return call
