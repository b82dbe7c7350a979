"""The autograd of every attn_ext forward op: all orders, both modes, and ``torch.func``.

Each forward op gets one ``torch.autograd.Function`` built from a :class:`Derivatives`:

* **first order** (``.backward()``, ``torch.autograd.grad``): the op's fused backward kernel, fed with the
  saved inputs and outputs — the fast path training takes. The public functions' plain reverse-mode
  calls of the ops that declare :attr:`Derivatives.fused_backward` record the same rule as a C++ node
  instead (``csrc/python_autograd.cpp``), which hands higher orders to the composite below;
* **higher order** (``create_graph=True``: gradient penalties, MAML-style meta-learning; also reverse
  mode under ``torch.func`` transforms and forward-over-reverse): the vector-Jacobian product of the op's
  *composite*, a differentiable PyTorch composition of the same math, taken with ``torch.func.vjp`` so
  that its result is itself differentiable to any order. It holds the score matrix, as PyTorch's own
  math path of SDPA does; only graphs that ask for second derivatives pay for it;
* **forward mode** (``torch.autograd.forward_ad``, ``torch.func.jvp``): the op's ``jvp`` rule where it
  has one, else the Jacobian-vector product of the composite;
* **forward over forward** (two ``torch.func.jvp`` levels: ``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``):
  the composite itself, with no ``autograd.Function`` in between. PyTorch differentiates a Function's
  ``jvp`` rule by an enclosing ``jvp`` level as if the rule's saved tensors were constants, so its
  second-order tangents come out silently wrong (0 for ``sin``): see
  :func:`attn_ext.ops.utils.nested_forward.forward_over_forward`;
* **vmap**: the op's batching rule folds the vmapped dimension into the batch dimension
  (:mod:`attn_ext.ops.utils.vmap`); the Function's derivatives are vmapped by PyTorch's generated rule.

The raw ``torch.ops.attn_ext`` op carries this Function at its ``Autograd`` dispatch key, so direct
callers get first and second order and ``forward_ad`` as well. ``torch.func`` transforms can only enter
an ``autograd.Function`` above the dispatcher: the public functions do that (:func:`functorch_entry`),
and a raw op reached under ``torch.func.grad`` / ``jvp`` raises an error that names it. Backward kernels
are not differentiable themselves (their derivatives are the composite's): differentiating one raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from attn_ext.ops.utils.nested_forward import composite_entry, forward_over_forward
from attn_ext.ops.utils.vmap import register_batch_folding_vmap

try:
    from attn_ext import _C
except ImportError:  # no compiled extension: the Python backends still work (utils/extension.py says why)
    _C = None

LIBRARY = torch.library.Library("attn_ext", "FRAGMENT")
# The functorch-aware Function of each forward op, by the op's short name, for functorch_entry.
_FUNCTIONS: Dict[str, type] = {}
# The Derivatives of each forward op, by short name: functorch_entry's composite under forward over forward.
_SPECS: Dict[str, "Derivatives"] = {}
# The extension's index of the C++ autograd of a forward op (Derivatives.fused_backward), by short name.
_CPP_AUTOGRAD: Dict[str, int] = {}
# Calls the kernels below the Autograd dispatch key, skipping the Python autograd kernel registered there.
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


@dataclass(frozen=True)
class Derivatives:
    """How to differentiate one forward op.

    ``backward(inputs, outputs, grads)`` is the first-order rule (the fused backward kernel): ``inputs``
    are the op's arguments, ``outputs`` its results, ``grads`` one gradient per differentiable output
    (zeros where none flowed); it returns one gradient (or None) per input.
    ``composite(inputs, outputs)`` recomputes the differentiable outputs (those at
    ``differentiable_outputs``) from the inputs with differentiable PyTorch ops, never attn_ext ops
    (``outputs`` only lends it non-differentiable results such as a tree's selected nodes).
    ``jvp(inputs, outputs, tangents)``, optional, returns their tangents given one tangent (or None) per
    input, cheaper than the composite's.
    ``exact_first_order(grads)`` says whether ``backward`` is exact for these gradients, None where none
    reached an output (some kernels ignore gradients reaching intermediate outputs; then the composite is
    used).
    """

    backward: Callable[[Sequence, Sequence[Tensor], Sequence[Tensor]], Sequence[Optional[Tensor]]]
    composite: Callable[[Sequence, Sequence[Tensor]], Tuple[Tensor, ...]]
    differentiable_inputs: Tuple[int, ...]
    differentiable_outputs: Tuple[int, ...]
    jvp: Optional[Callable[[Sequence, Sequence[Tensor], Sequence[Optional[Tensor]]], Tuple[Tensor, ...]]] = None
    exact_first_order: Callable[[Sequence[Tensor]], bool] = field(default=lambda grads: True)
    #: ``(backward op, layout)`` when ``backward`` is that op applied to the arguments ``layout`` names
    #: ("g<j>": gradient of output j, "i<j>": input j, "o<j>": output j), giving one gradient per
    #: differentiable input, exact for any gradients: then ordinary reverse-mode calls of the public
    #: functions get the same rule as a C++ autograd node (csrc/python_autograd.cpp), much cheaper.
    fused_backward: Optional[Tuple[str, str]] = None
    #: Inputs whose derivatives only the composite gives (the fused kernels have none: an additive
    #: ``attn_mask``, whose gradient is the ``[L, S]`` score gradient). A call that differentiates one of
    #: them, in either mode, runs the composite; the others keep the fused backward.
    composite_inputs: Tuple[int, ...] = ()

    @property
    def all_differentiable_inputs(self) -> Tuple[int, ...]:
        return self.differentiable_inputs + self.composite_inputs


def _has_tangent(tensors) -> bool:
    if forward_ad._current_level < 0:  # no dual level open: the common case costs one comparison
        return False
    return any(isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def needs_graph(tensors) -> bool:
    """Whether derivatives of what is being computed from ``tensors`` will be asked for."""
    return ((torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors))
            or _has_tangent(tensors) or torch._C._are_functorch_transforms_active())


def _float_zeros_like(t: Tensor) -> Tensor:
    return torch.zeros_like(t, memory_format=torch.contiguous_format)


def _make_function(name: str, op, spec: Derivatives) -> type:
    below = below_autograd_call(name)

    def forward(*args):
        if torch._C._are_functorch_transforms_active():  # the transforms' layers sit at the Autograd key
            return op(*args)
        return below(*args)  # grad mode is off in here: the Autograd kernel would only redispatch

    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        tensors = [x if isinstance(x, Tensor) else None for x in inputs] + list(outputs)
        ctx.save_for_backward(*tensors)
        # jvp runs only for inputs with tangents, which need a dual level or a torch.func transform; saving
        # for it otherwise costs a third of a small call's autograd overhead.
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            ctx.save_for_forward(*tensors)
        ctx.constants = tuple(None if isinstance(x, Tensor) else x for x in inputs)
        ctx.set_materialize_grads(False)  # None marks an output no gradient reached (see exact_first_order)
        non_differentiable = [o for i, o in enumerate(outputs) if i not in spec.differentiable_outputs]
        if non_differentiable:
            ctx.mark_non_differentiable(*non_differentiable)

    def restore(ctx):
        saved = ctx.saved_tensors
        n_in = len(ctx.constants)
        inputs = [c if t is None else t for t, c in zip(saved[:n_in], ctx.constants)]
        return inputs, list(saved[n_in:])

    def backward(ctx, *grads):
        inputs, outputs = restore(ctx)
        exact = spec.exact_first_order([grads[i] for i in spec.differentiable_outputs]) and \
            not any(ctx.needs_input_grad[i] for i in spec.composite_inputs)
        grads = [(_float_zeros_like(outputs[i]) if grads[i] is None else grads[i]) for i in spec.differentiable_outputs]
        if needs_graph([*inputs, *outputs, *grads]) or not exact:
            return composite_vjp(spec, inputs, outputs, grads, ctx.needs_input_grad)
        with _BELOW_AUTOGRAD():  # no graph of the backward is wanted: its refusing Autograd kernel can be skipped
            return tuple(spec.backward(inputs, outputs, grads))

    def jvp(ctx, *tangents):
        inputs, outputs = restore(ctx)
        # A jvp rule may call attn_ext ops, which torch.func transforms cannot enter from here.
        composite_only = any(isinstance(tangents[i], Tensor) for i in spec.composite_inputs)
        if spec.jvp is not None and not composite_only and not torch._C._are_functorch_transforms_active():
            diff = spec.jvp(inputs, outputs, tangents)
        else:
            diff = composite_jvp(spec, inputs, outputs, tangents)
        result = [None] * len(outputs)
        for i, t in zip(spec.differentiable_outputs, diff):
            result[i] = t
        return tuple(result) if len(result) > 1 else result[0]

    return type(f"{name}_autograd", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "jvp": staticmethod(jvp), "generate_vmap_rule": True,
    })


def _composite_of(spec: Derivatives, inputs, outputs, wrt):
    """The composite as a function of the inputs at positions ``wrt`` only (the others held fixed)."""
    def composite(*diff):
        args = list(inputs)
        for i, d in zip(wrt, diff):
            args[i] = d
        return tuple(spec.composite(args, outputs))

    return composite


def composite_vjp(spec: Derivatives, inputs, outputs, grads, needs_input_grad) -> Tuple[Optional[Tensor], ...]:
    """Input gradients from the composite: differentiable again, to any order."""
    wrt = [i for i in spec.all_differentiable_inputs
           if isinstance(inputs[i], Tensor) and needs_input_grad[i] and inputs[i].is_floating_point()]
    if not wrt:
        return (None,) * len(inputs)
    _, vjp_fn = torch.func.vjp(_composite_of(spec, inputs, outputs, wrt), *(inputs[i] for i in wrt))
    grads_wrt = vjp_fn(tuple(grads))
    result: list = [None] * len(inputs)
    for i, g in zip(wrt, grads_wrt):
        result[i] = g
    return tuple(result)


def composite_jvp(spec: Derivatives, inputs, outputs, tangents) -> Tuple[Tensor, ...]:
    """Output tangents from the composite, for the ops without a ``jvp`` rule of their own.

    ``J t`` is taken as the vector-Jacobian product of the linear map ``u -> Jᵀu`` with ``t``: two reverse
    passes, because ``torch.func.jvp`` cannot open its dual level inside ``torch.autograd.forward_ad``'s.
    """
    wrt = [i for i in spec.all_differentiable_inputs if isinstance(tangents[i], Tensor)]
    composite = _composite_of(spec, inputs, outputs, wrt)
    if not wrt:
        return tuple(torch.zeros_like(o) for o in composite())
    primal_out, vjp_fn = torch.func.vjp(composite, *(inputs[i] for i in wrt))
    cotangents = tuple(torch.zeros_like(o) for o in primal_out)
    _, transpose_vjp = torch.func.vjp(vjp_fn, cotangents)
    return transpose_vjp(tuple(tangents[i] for i in wrt))[0]


def _transform_name() -> Optional[str]:
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return None
    key = interpreter.key()
    names = {torch._C._functorch.TransformType.Grad: "torch.func.grad / vjp",
             torch._C._functorch.TransformType.Jvp: "torch.func.jvp"}
    return names.get(key)


def register_derivatives(qualname: str, spec: Derivatives, public: str) -> None:
    """Gives forward op ``qualname`` the autograd of :class:`Derivatives` (see the module docstring)."""
    name = qualname.split("::")[1]
    op = getattr(torch.ops.attn_ext, name).default
    function = _make_function(name, op, spec)
    _FUNCTIONS[name] = function
    _SPECS[name] = spec
    # Without functorch the C-level apply is what Function.apply calls, minus its per-call signature binding.
    apply = super(torch.autograd.Function, function).apply

    def autograd_kernel(keyset, *args):
        if torch._C._are_functorch_transforms_active():
            transform = _transform_name()
            if transform is not None and needs_graph(args):
                raise RuntimeError(
                    f"attn_ext: {transform} cannot enter torch.ops.attn_ext.{name} from below the dispatcher; "
                    f"call the public function {public}, whose derivatives torch.func transforms compose")
        if (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)) or _has_tangent(args):
            return apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    register_batch_folding_vmap(qualname)
    if spec.fused_backward is not None:
        _register_cpp_autograd(name, spec)


def _register_cpp_autograd(name: str, spec: Derivatives) -> None:
    backward_name, layout = spec.fused_backward
    forward_index, backward_index = _op_index(name), _op_index(backward_name)
    if forward_index is None or backward_index is None or not hasattr(_C, "register_autograd"):
        return

    def higher_order(inputs, outputs, grads):
        # The C++ node's backward when its own derivatives are wanted: the composite's, as Function.backward.
        grads = [(_float_zeros_like(outputs[i]) if grads[i] is None else grads[i]) for i in spec.differentiable_outputs]
        needs_input_grad = [isinstance(x, Tensor) and x.requires_grad for x in inputs]
        return composite_vjp(spec, inputs, outputs, grads, needs_input_grad)

    _CPP_AUTOGRAD[name] = _C.register_autograd(forward_index, backward_index, layout, spec.differentiable_inputs,
                                               spec.differentiable_outputs, higher_order)


def register_not_differentiable(qualname: str, reason: str) -> None:
    """An ``Autograd`` kernel that refuses derivatives of op ``qualname`` (instead of torch's warning and zeros)."""
    name = qualname.split("::")[1]
    op = getattr(torch.ops.attn_ext, name).default

    def autograd_kernel(keyset, *args):
        if (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)) or _has_tangent(args):
            raise RuntimeError(f"attn_ext::{name} is not differentiable: {reason}")
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    register_batch_folding_vmap(qualname)


def fast_entry(name: str):
    """The entry point of forward op ``torch.ops.attn_ext.<name>`` for the public functions: the op called
    below the Autograd key when no derivative is wanted; in reverse mode its C++ autograd node (see
    :attr:`Derivatives.fused_backward`) where it has one, else its Function applied directly; the op itself
    (its Autograd kernel) under forward mode; :func:`functorch_entry`'s choice under ``torch.func``
    transforms and ``torch.compile``.
    The same results as calling the op, without the dispatcher's round trip through the Python autograd
    kernel (the fixed cost of every small call)."""
    entry = _ENTRIES.get(name)
    if entry is None:
        entry = _ENTRIES[name] = _make_entry(name)
    return entry


_ENTRIES: Dict[str, Callable] = {}


def below_autograd_call(name: str) -> Callable:
    """``torch.ops.attn_ext.<name>`` called below the Autograd keys: through the extension's ``call_op``
    (the dispatcher entered from C++, without torch.ops' generic argument matching: the larger part of a
    small call's fixed cost) when it converts the arguments, else through torch.ops."""
    overload = getattr(torch.ops.attn_ext, name).default
    index = _op_index(name)

    def call(*args):
        if index is not None:
            result = _C.call_op(index, True, *args)
            if result is not NotImplemented:
                return result
        with _BELOW_AUTOGRAD():
            return overload(*args)

    return call


_OP_INDEXES: Dict[str, Optional[int]] = {}


def _op_index(name: str) -> Optional[int]:
    """The extension's index of op ``name`` for ``call_op``, None where it has none (no compiled extension,
    an older build, an op whose arguments call_op does not convert). Asked once per op."""
    if name not in _OP_INDEXES:
        index = None
        if _C is not None and hasattr(_C, "op_index"):
            try:
                index = _C.op_index(f"attn_ext::{name}")
            except RuntimeError:
                pass
        _OP_INDEXES[name] = index
    return _OP_INDEXES[name]


def _make_entry(name: str) -> Callable:
    packet = getattr(torch.ops.attn_ext, name)
    overload = packet.default
    function = _FUNCTIONS.get(name)
    apply = None if function is None else super(torch.autograd.Function, function).apply
    below = below_autograd_call(name)
    cpp_autograd = _CPP_AUTOGRAD.get(name)

    def entry(*args):
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return functorch_entry(packet)(*args)
        if _has_tangent(args):
            return overload(*args)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if cpp_autograd is not None:
                result = _C.call_op_autograd(cpp_autograd, *args)
                if result is not NotImplemented:
                    return result
            # apply: what the op's Autograd kernel would do; an op without derivatives raises there.
            return overload(*args) if apply is None else apply(*args)
        return below(*args)

    return entry


def functorch_entry(op):
    """``op`` itself, or under ``torch.func`` transforms its Function's ``apply`` (see the module docstring),
    or under forward over forward (:func:`forward_over_forward`) its composite."""
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return op
    name = op._qualified_op_name.split("::")[1]
    function = _FUNCTIONS.get(name)
    if function is None:
        return op
    if forward_over_forward():
        return composite_entry(_SPECS[name], function)
    return function.apply
