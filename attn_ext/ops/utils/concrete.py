"""The values behind ``torch.func`` wrappers, for the data-dependent checks that raise errors.

Under ``vmap`` (and ``grad``) a tensor is a wrapper whose ``bool()`` PyTorch refuses ("data-dependent
control flow"). A check such as "is this system singular?" must still raise, so it reads the wrapped
values instead: every vmapped dimension moved to the front, the op's own dimensions last.
"""
from __future__ import annotations

from torch import Tensor
from torch._C import _functorch


def concrete(t: Tensor) -> Tensor:
    """``t``'s values without any ``torch.func`` wrapper; vmapped dimensions lead, outermost first."""
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            t = _functorch.get_unwrapped(t).movedim(_functorch.maybe_get_bdim(t), 0)
        else:
            t = _functorch.get_unwrapped(t)
    return t
