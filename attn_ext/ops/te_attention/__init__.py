"""Translation-equivariant attention (TE-TNP, Ashman et al. 2024; issue 45): logits ``ρ(q_i·k_j per head,
x_i − x_j)`` with ``ρ`` a two-layer MLP, softmax over the keys, values summed.

:func:`te_attention` (:mod:`.attention`) is the fused op: C++ kernels on the CPU and Triton kernels on CUDA that run
the MLP per tile of (query, key) pairs with an online softmax and recompute it in the backward, in memory independent
of ``M·N``; the readable reference (:mod:`.naive`) holds the dense formula and the chunked algorithm the kernels
follow.
"""
from attn_ext.ops.te_attention.attention import te_attention

__all__ = ["te_attention"]
