"""One helper for every (forward, backward) custom-op pair: fake kernels plus the forward's autograd."""
from __future__ import annotations

from typing import Callable

import torch


def register_op_pair(forward_name: str, backward_name: str, fake_forward: Callable, fake_backward: Callable,
                     make_backward: Callable[[Callable], Callable], setup_context: Callable) -> None:
    """Registers fakes for both ops and, as the forward's autograd, ``make_backward(backward op)``."""
    torch.library.register_fake(forward_name)(fake_forward)
    torch.library.register_fake(backward_name)(fake_backward)
    backward_op = getattr(torch.ops.attn_ext, backward_name.split("::")[1])
    torch.library.register_autograd(forward_name, make_backward(backward_op), setup_context=setup_context)
