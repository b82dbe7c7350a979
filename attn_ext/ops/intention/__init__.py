"""Intention and σIntention (SPEC §4): ridge-regression attention ``Q (KᵀK + αI)⁻¹ KᵀV``.

The folder is named ``ridge`` because ``attn_ext.intention`` is the function."""
from attn_ext.ridge import ops  # noqa: F401  (registers the custom ops, fake kernels and autograd)
from attn_ext.ridge.cholesky import batched_cholesky, batched_cholesky_solve
from attn_ext.ridge.functional import intention, sigma_intention
from attn_ext.ridge.spd_solve import batched_spd_solve
from attn_ext.ridge.state import (
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
