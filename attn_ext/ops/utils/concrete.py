"""The values behind the data-dependent checks that raise errors, in eager mode, under ``torch.func``
and under ``torch.compile``.

Under ``vmap`` (and ``grad``) a tensor is a wrapper whose ``bool()`` PyTorch refuses ("data-dependent
control flow"). A check such as "is this system singular?" must still raise, so it reads the wrapped
values instead (:func:`concrete`): every vmapped dimension moved to the front, the op's own dimensions
last.

While ``torch.compile`` traces (:func:`tracing`) no value can be read on the host at all: a
``bool()`` of a tensor would break the graph, and ``fullgraph=True`` refuses that. There a check
becomes :func:`check_on_device`, an assert op in the graph (``torch._assert_async``) that raises
``RuntimeError`` with the op's message when the compiled graph runs on values that fail it. Its
message is fixed when the graph is traced, so it names the op and the rule but not the failing
(batch, head); on CUDA it is a device-side assert (reported at the next synchronisation, after which
the CUDA context is unusable, as for PyTorch's own asynchronous checks). A choice that depends on
values (which form solves a head) is computed in the graph for every head instead of being made on
the host.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._C import _functorch


def tracing() -> bool:
    """True while ``torch.compile`` (dynamo, or an export) traces: tensors have no values to read."""
    return torch.compiler.is_compiling()


def concrete(t: Tensor) -> Tensor:
    """``t``'s values without any ``torch.func`` wrapper; vmapped dimensions lead, outermost first.

    Not for use while :func:`tracing` (there are no values then): use :func:`check_on_device`.
    """
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            t = _functorch.get_unwrapped(t).movedim(_functorch.maybe_get_bdim(t), 0)
        else:
            t = _functorch.get_unwrapped(t)
    return t


def check_on_device(ok: Tensor, message: str) -> None:
    """Inside a compiled graph: raise ``RuntimeError(message)`` when the graph runs unless ``ok`` is all True.

    ``message`` should name the op (``attn_ext.intention: ...``); an empty ``ok`` passes.
    """
    torch._assert_async(ok.all(), message)
