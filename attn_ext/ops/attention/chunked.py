"""``attn_ext.cross_attention``: exact softmax cross attention over keys in chunks (docs/spec.md §1)."""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

from torch import Tensor

from attn_ext.ops.attention.registration import CROSS_ATTENTION
from attn_ext.ops.utils import dispatch
from attn_ext.ops.utils.validation import check_cross_attention_args

DEFAULT_CHUNK_SIZE = 512


def cross_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    chunk_size: Optional[int] = None,
    return_lse: bool = False,
    backend: Optional[str] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact softmax attention of the queries over the keys, computed chunk by chunk.

    Equal to ``softmax(scale · q kᵀ) v`` with padded keys ignored, but no ``[M, N]`` score matrix is
    ever held: forward and backward stream the keys in chunks of ``chunk_size`` with a running
    max / log-sum-exp state, so the memory is O(B·H·M·(Dv + chunk_size)).

    Parameters
    ----------
    q : Tensor
        Queries ``[B, H, M, D]`` (float16, bfloat16, float32; float64 on the cpp and reference backends).
    k : Tensor
        Keys ``[B, H, N, D]``, same dtype and device as ``q``.
    v : Tensor
        Values ``[B, H, N, Dv]``; ``Dv`` may differ from ``D``.
    key_padding_mask : Tensor, optional
        Bool ``[B, N]``, **True marks padding** (ignored keys), as in ``torch.nn.MultiheadAttention``.
        A query row whose keys are all padding gets ``out = 0``, ``lse = -inf`` and zero gradients.
        Padded keys are never read: NaN or inf there has no effect. Otherwise NaN propagates as in
        IEEE softmax, to exactly the rows that depend on it (docs/cross_attention.md, "NaN, inf and
        empty rows").
    scale : float, optional
        Score scale, default ``1 / sqrt(D)``.
    chunk_size : int, optional
        Keys per chunk (default 512); trades memory for speed, never changes the result beyond rounding.
    return_lse : bool
        Also return the log-sum-exp of each row's scores (natural log, fp32 — fp64 for fp64 inputs,
        shape ``[B, H, M]``), which is differentiable and lets states be merged (docs/spec.md §1).
    backend : {"cpp", "cuda", "triton", "reference", "auto"}, optional
        Kernel to use; default: the ``ATTN_EXT_BACKEND`` environment variable, else automatic
        (CPU: ``cpp``; CUDA: ``triton``, then ``cuda``, the hand-written CUDA kernels of CUDA builds,
        tested on a GPU only in part so far). A backend that cannot run raises ``RuntimeError`` listing why.

    Returns
    -------
    Tensor or (Tensor, Tensor)
        ``out [B, H, M, Dv]`` in the input dtype, and ``lse`` if ``return_lse``.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> q, k, v = torch.randn(2, 4, 16, 40), torch.randn(2, 4, 1000, 40), torch.randn(2, 4, 1000, 24)
    >>> out, lse = ae.cross_attention(q, k, v, chunk_size=128, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 4, 16, 24]), torch.Size([2, 4, 16]))
    >>> expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> bool(torch.allclose(out, expected, atol=1e-5))
    True
    """
    out, lse = named_cross_attention("cross_attention", q, k, v, key_padding_mask, scale, chunk_size, backend)
    return (out, lse) if return_lse else out


def named_cross_attention(op: str, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          scale: Optional[float], chunk_size: Optional[int],
                          backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`cross_attention`, its argument errors named after ``op``, the public op that was
    called (``attn_ext.attention_state: ...`` when the state functions run it)."""
    check_cross_attention_args(q, k, v, key_padding_mask, scale, chunk_size, op=op)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else int(chunk_size)  # NumPy integers too
    name = dispatch.select_backend(CROSS_ATTENTION, backend, q)
    return dispatch.entry(CROSS_ATTENTION, name)(q, k, v, key_padding_mask, scale, chunk_size)
