"""``ae.te_attention``: translation-equivariant attention (TE-TNP, Ashman et al. 2024), fused: the public op.

The fused kernels (``attn_ext::te_attention_fwd`` / ``_bwd`` in C++ for CPU tensors, their Triton twins for CUDA
tensors) run the logits' MLP tile by tile of (query, key) pairs with an online softmax per head; the readable
reference is :mod:`.naive`.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

from torch import Tensor

from attn_ext.ops.te_attention.checks import WHO, check_te_attention_args
from attn_ext.ops.te_attention.naive import ACTIVATION_NAMES, default_scale
from attn_ext.ops.te_attention.registration import TE_ATTENTION
from attn_ext.ops.utils import dispatch


def te_attention(q: Tensor, k: Tensor, v: Tensor, xq: Tensor, xk: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
                 b2: Tensor, *, key_padding_mask: Optional[Tensor] = None, scale: Optional[float] = None,
                 activation: str = "relu", return_lse: bool = False, chunk_size: int = 0,
                 backend: Optional[str] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention whose logits are a learned function of every head's dot product and of the inputs' difference.

    Per batch entry, query ``i``, key ``j`` and head ``h``::

        s_ij = scale · (q_i,h · k_j,h for each head h)          (H numbers)
        logit_ij,h = ρ(s_ij, xq_i − xk_j)_h,   ρ = Linear(H + dx → hidden) → activation → Linear(hidden → H)
        out_i,h = Σ_j softmax_j(logit_i·,h) v_j,h

    The logits see the inputs only through ``xq_i − xk_j`` (formed before any product), so shifting ``xq`` and
    ``xk`` by one vector changes nothing but the rounding of that difference. The kernels compute the MLP per tile
    of (query, key) pairs and never hold an ``[M, N]`` tensor: memory ``O((M + N)·(H·D + dx) + hidden²)`` forward
    and backward, where a PyTorch model forms ``[B, M, N, hidden]``.

    Parameters
    ----------
    q, k, v : Tensor
        ``[B, H, M, D]``, ``[B, H, N, D]``, ``[B, H, N, Dv]``.
    xq, xk : Tensor
        ``[B, M, dx]``, ``[B, N, dx]``: the queries' and keys' inputs (locations).
    w1, b1, w2, b2 : Tensor
        ρ's weights, as ``nn.Linear`` holds them: ``w1 [hidden, H + dx]`` (columns: the H scores, then the dx
        differences), ``b1 [hidden]``, ``w2 [H, hidden]``, ``b2 [H]``.
    key_padding_mask : Tensor, optional
        ``[B, N]`` bool, True = padding: never read (NaN there reaches nothing). A query without any key gets
        ``out = 0`` and ``lse = −inf``.
    scale : float, optional
        Score scale, default ``1/sqrt(D)`` (1 for ``D = 0``).
    activation : {"relu", "gelu", "silu", "tanh"}
        ρ's activation (``gelu``: the erf form, as ``torch.nn.functional.gelu``).
    return_lse : bool
        Also return ``lse [B, H, M]``, the log-sum-exp of each row's logits (fp32; fp64 for fp64 inputs).
    chunk_size : int
        Keys per tile (0: the kernel's choice); results do not depend on it beyond rounding.
    backend : {"cpp", "triton", "reference", "auto"}, optional
        As for :func:`attn_ext.cross_attention`: CPU tensors run the C++ kernels, CUDA tensors the Triton ones; the
        reference (chunked PyTorch, any device) is the last resort. All nine tensors get gradients of every order (the first from the fused
        backward, higher ones and forward mode through the dense formula).

    Examples
    --------
    >>> import torch
    >>> import attn_ext as ae
    >>> B, H, M, N, D, dx, hidden = 2, 4, 10, 500, 16, 2, 64
    >>> q, k, v = torch.randn(B, H, M, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    >>> xq, xk = torch.randn(B, M, dx), torch.randn(B, N, dx)
    >>> rho_in, rho_out = torch.nn.Linear(H + dx, hidden), torch.nn.Linear(hidden, H)
    >>> out = ae.te_attention(q, k, v, xq, xk, rho_in.weight, rho_in.bias, rho_out.weight, rho_out.bias)
    >>> shifted = ae.te_attention(q, k, v, xq + 3.0, xk + 3.0, rho_in.weight, rho_in.bias, rho_out.weight,
    ...                           rho_out.bias)
    >>> out.shape, bool((out - shifted).abs().max() < 1e-4)
    (torch.Size([2, 4, 10, 16]), True)
    """
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"{WHO}: unknown activation {activation!r}; choose one of {', '.join(ACTIVATION_NAMES)}")
    code = ACTIVATION_NAMES.index(activation)
    if scale is None and isinstance(q, Tensor) and q.dim() == 4:
        scale = default_scale(q.shape[-1])
    check_te_attention_args(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, scale, code, chunk_size)
    name = dispatch.select_backend(TE_ATTENTION, backend, q)
    out, lse = dispatch.entry(TE_ATTENTION, name)(q, k, v, xq, xk, w1, b1, w2, b2, key_padding_mask, float(scale),
                                                  code, int(chunk_size))
    return (out, lse) if return_lse else out
