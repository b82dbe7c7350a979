"""Intention and σIntention (docs/spec.md §4): attention as ridge regression, ``Q (KᵀK + αI)⁻¹ KᵀV``.

:mod:`.ridge` (``intention``, ``sigma_intention``), :mod:`.state` (streaming statistics ``KᵀK``, ``KᵀV``),
:mod:`.cholesky` (the batched small-SPD Cholesky under it); the readable PyTorch reference is
:mod:`.naive`; :mod:`.registration` binds every backend as a custom op. Op-level variants built on them
(docs/intention_variants.md): the map ``w(K, V)`` (:mod:`.ridge_map`), the pseudo-inverse (:mod:`.pinv`),
the convex regulariser (:mod:`.convex_regulariser`), kernelised Intention (:mod:`.kernelised`,
:mod:`.kernel_features`) and the paper's output scale (:mod:`.scaling`).
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
from attn_ext.ops.intention.convex_regulariser import convex_intention
from attn_ext.ops.intention.kernelised import kernelised_intention
from attn_ext.ops.intention.pinv import pinv_intention, pinv_intention_from_state
from attn_ext.ops.intention.ridge_map import intention_map, intention_map_from_state
from attn_ext.ops.intention.scaling import intention_variance_scale

__all__ = [
    "IntentionState",
    "batched_cholesky",
    "batched_cholesky_solve",
    "batched_spd_solve",
    "convex_intention",
    "intention",
    "intention_from_state",
    "intention_map",
    "intention_map_from_state",
    "intention_state",
    "intention_variance_scale",
    "kernelised_intention",
    "merge_intention_states",
    "pinv_intention",
    "pinv_intention_from_state",
    "remove_from_intention_state",
    "sigma_intention",
    "update_intention_state",
]
