"""Intention and σIntention (docs/spec.md §4): attention as ridge regression, ``Q (KᵀK + αI)⁻¹ KᵀV``.

:mod:`.ridge` (``intention``, ``sigma_intention``), :mod:`.state` (streaming statistics ``KᵀK``, ``KᵀV``),
:mod:`.cholesky` (the batched small-SPD Cholesky under it); the readable PyTorch reference is
:mod:`.naive`; :mod:`.registration` binds every backend as a custom op.
"""
from attn_ext.ops.intention import registration  # noqa: F401  (custom ops, fakes, autograd, backends)
from attn_ext.ops.intention.cholesky import batched_cholesky, batched_cholesky_solve, batched_spd_solve
from attn_ext.ops.intention.ridge import intention, sigma_intention
from attn_ext.ops.intention.state import (
    IntentionState,
    intention_from_state,
    intention_state,
    merge_intention_states,
    remove_from_intention_state,
    update_intention_state,
)

__all__ = [
    "IntentionState",
    "batched_cholesky",
    "batched_cholesky_solve",
    "batched_spd_solve",
    "intention",
    "intention_from_state",
    "intention_state",
    "merge_intention_states",
    "remove_from_intention_state",
    "sigma_intention",
    "update_intention_state",
]
