"""The composite of ``te_attention_fwd``: its ``(out, lse)`` recomputed with differentiable PyTorch ops (the dense
formula of :mod:`.naive`), for derivatives beyond the fused backward (second order, forward mode, ``torch.func``).
It forms the ``[B, M, N, hidden]`` hidden layer, as a PyTorch model of TE attention does: only graphs that ask for
such derivatives pay for it."""
from __future__ import annotations

from typing import Sequence, Tuple

from torch import Tensor

from attn_ext.ops.te_attention.naive import ACTIVATION_NAMES, dense


def te_attention(inputs: Sequence, outputs: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, activation, _ = inputs
    return dense(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, ACTIVATION_NAMES[activation])
