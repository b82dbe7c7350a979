"""Translation-equivariant attention (TE-TNP, Ashman et al. 2024; issue 45): logits ``ρ(q_i·k_j per head,
x_i − x_j)`` with ``ρ`` a two-layer MLP, softmax over the keys, values summed.

So far the readable reference (:mod:`.naive`): the dense formula and the chunked algorithm the fused op will run
(keys in chunks with an online softmax; the backward recomputes each chunk's MLP from the saved log-sum-exp), in
memory independent of ``M·N``. The op ``ae.te_attention`` with its cpp and Triton kernels is still to come.
"""
