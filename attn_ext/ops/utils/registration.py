"""Defining the Python backends' ops and registering every (forward, backward) op pair.

The Python backends are defined with ``torch.library.define`` / ``impl`` rather than
``torch.library.custom_op`` because the library must own each op's ``Autograd`` kernel: custom_op fixes
it to one without forward mode, double backward or ``torch.func`` support (see
:mod:`attn_ext.ops.utils.autograd`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from attn_ext.ops.utils.autograd import (LIBRARY, Derivatives, below_autograd_call, register_derivatives,
                                         register_not_differentiable)
from attn_ext.ops.utils.schemas import arguments_and_returns


#: A Python backend's op ``<op>_reference`` or ``<op>_triton`` has the schema of the compiled op ``<op>``.
PYTHON_BACKEND_SUFFIXES = ("_reference", "_triton")


def define_op(qualname: str) -> Callable[[Callable], Callable]:
    """Decorator: defines op ``qualname`` (``attn_ext::<op>_<backend>``) with the schema of the compiled op
    ``<op>`` (written once, in C++: :mod:`attn_ext.ops.utils.schemas`), implemented by the function, and
    records the op's name on it (``fn.op_name``), so a dispatch table can hold the function itself."""
    name = qualname.split("::")[1]
    compiled = next((name[: -len(suffix)] for suffix in PYTHON_BACKEND_SUFFIXES if name.endswith(suffix)), None)
    if compiled is None:
        raise ValueError(f"attn_ext: {qualname} is not named <op>_reference or <op>_triton after a compiled op")

    def decorate(fn: Callable) -> Callable:
        LIBRARY.define(name + arguments_and_returns(compiled))
        LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        fn.op_name = name
        return fn

    return decorate


def register_op_pair(forward_name: str, backward_name: str, fake_forward: Callable, fake_backward: Callable,
                     derivatives: Callable[[Callable], Derivatives], public: str,
                     backward_layout: Optional[str] = None) -> None:
    """Fakes for both ops; the forward's autograd ``derivatives(backward op)``; a backward op that refuses
    to be differentiated (its derivatives are the forward's composite's). ``derivatives`` gets the backward
    op called below the Autograd keys: the first-order rule runs only where no graph of it is wanted.
    ``backward_layout``: the backward op's arguments as :attr:`Derivatives.fused_backward` names them, when
    the first-order rule is just that call (then it also runs as a C++ autograd node)."""
    torch.library.register_fake(forward_name)(fake_forward)
    torch.library.register_fake(backward_name)(fake_backward)
    backward_op = below_autograd_call(backward_name.split("::")[1])
    spec = derivatives(backward_op)
    if backward_layout is not None:
        spec = replace(spec, fused_backward=(backward_name.split("::")[1], backward_layout))
    register_derivatives(forward_name, spec, public)
    register_not_differentiable(backward_name, f"it is the first-order backward kernel of {public}; derivatives of "
                                f"any order come from differentiating {public} itself")
