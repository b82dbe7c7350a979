"""What the CUDA attention kernels' machine code must contain (issue 43), and what fails today.

The requirements and known gaps of the kernels of csrc/cuda/attention_*.cu and merge_states.cu, in the
data types of :mod:`sass_criteria` (whose :func:`~sass_criteria.check` judges them, like a strict xfail:
a requirement failing outside the gaps is a regression, a gap that holds everywhere it matches must be
removed). Kernel names and configs are those of :func:`cuda_sass_parse.kernel_and_config`
(``attention_fwd_wmma``, ``bf16 D=64 w4 masks``); targets ``sm_80``, ``sm_90`` (the build's) and
``sm_90a`` (compiled by the report). Every kernel of the report's sources is judged: one that no
requirement names is UNCHECKED, which fails, so a new kernel must be encoded here.
"""
from __future__ import annotations

from sass_criteria import KnownGap, Requirement

__all__ = ["KNOWN_GAPS", "REQUIREMENTS"]

# The tensor-core kernels (fp16/bf16): forward and backward rebuilt FlashAttention-2's way (mma.sync,
# ldmatrix, cp.async, accumulators in registers: attention_fwd_mma, attention_bwd_mma, from sm_80 on), and
# the WMMA kernels, kept for sm_70/75, for rows not on 16-byte boundaries and (backward) head dim 256.
_TENSOR_CORE = r"attention_fwd_mma|attention_bwd_mma|attention_fwd_wmma|attention_bwd_wmma"
# fp32 kernels (exact fp32 dots: no m16n8k16 path without changing the results), the backward's Delta
# pre-pass (a row sum of dO * O) and the state merge: no matmul to put on tensor cores, so only the
# local-memory criteria.
_OTHER = r"attention_fwd|attention_bwd_dkdv|attention_bwd_dq|attention_bwd_delta|merge_states_fwd"
# The tensor-core criteria: every target from sm_80 on (cp.async and bf16 MMA begin there; sm_90a is the
# report's own Hopper compile). The local-memory criteria: every target, also a CUDA_ARCHS=75 build's.
_SM80_PLUS = r"sm_(8\d|9\d|1\d\d)[af]?"
_ANY = r"sm_\d+[af]?"
_16BIT = r"^(fp16|bf16) "


def _no_local_memory(kernels: str, targets: str, config: str = "") -> tuple[Requirement, ...]:
    return (Requirement(kernels, targets, "LDL", "==", 0, "no local loads (spills read back)", config),
            Requirement(kernels, targets, "STL", "==", 0, "no local stores (spills)", config),
            Requirement(kernels, targets, "stack", "==", 0, "no stack frame (local memory per thread)", config))


REQUIREMENTS: tuple[Requirement, ...] = (
    # FlashAttention-2's instruction mix, issue 43 item 3, on every head dim the kernels are built for.
    Requirement(_TENSOR_CORE, _SM80_PLUS, "HMMA.16816", ">", 0, "m16n8k16 tensor-core MMA (mma.sync)", _16BIT),
    Requirement(_TENSOR_CORE, _SM80_PLUS, "LDSM", ">", 0, "ldmatrix: MMA fragments from shared memory", _16BIT),
    Requirement(_TENSOR_CORE, _SM80_PLUS, "LDGSTS", ">", 0, "cp.async: global to shared memory, pipelined", _16BIT),
    Requirement(_TENSOR_CORE, _SM80_PLUS, "LDGSTS.128", ">", 0, "cp.async of 16 bytes (not 2-byte loads)", _16BIT),
    *_no_local_memory(_TENSOR_CORE, _ANY),
    # The stretch of item 3: a wgmma + TMA forward where the arch-specific Hopper target is compiled.
    Requirement(r"attention_fwd_mma", r"sm_90a", "HGMMA", ">", 0, "Hopper warpgroup MMA (wgmma)", _16BIT),
    Requirement(r"attention_fwd_mma", r"sm_90a", "UTMALDG", ">", 0, "K/V loaded by TMA", _16BIT),
    *_no_local_memory(_OTHER, _ANY),
)

# Known gaps: what fails today (measured with nvcc 13.0, bench/out/cuda_sass.md), one per kernel, dtype and
# criterion so that each closes on its own (the check fails once a gap holds wherever it matches: remove it
# then). The WMMA kernels keep their operands and accumulators in shared memory and load global memory
# element by element (2-byte LDG.E.U16) into it; nvcc turns their fp16 wmma::load_matrix_sync into
# ldmatrix, but the bf16 one into generic 32-bit loads (LD.E: wmma.load without .shared in the PTX).
_ITEM3 = "issue 43 item 3 (CUDA rebuilt the FlashAttention-2 way)"
_STRETCH = "issue 43 item 3, stretch (a wgmma + TMA forward for sm_90a)"
KNOWN_GAPS: tuple[KnownGap, ...] = (
    # No cp.async: every global load goes through registers, 2 bytes at a time.
    KnownGap(r"attention_fwd_wmma", _SM80_PLUS, "LDGSTS > 0", r"^fp16 ", _ITEM3),
    KnownGap(r"attention_fwd_wmma", _SM80_PLUS, "LDGSTS > 0", r"^bf16 ", _ITEM3),
    KnownGap(r"attention_bwd_wmma", _SM80_PLUS, "LDGSTS > 0", r"^fp16 ", _ITEM3),
    KnownGap(r"attention_bwd_wmma", _SM80_PLUS, "LDGSTS > 0", r"^bf16 ", _ITEM3),
    # ... hence no 16-byte copies either (no LDG.128 in any attention kernel).
    KnownGap(r"attention_fwd_wmma", _SM80_PLUS, "LDGSTS.128 > 0", r"^fp16 ", _ITEM3),
    KnownGap(r"attention_fwd_wmma", _SM80_PLUS, "LDGSTS.128 > 0", r"^bf16 ", _ITEM3),
    KnownGap(r"attention_bwd_wmma", _SM80_PLUS, "LDGSTS.128 > 0", r"^fp16 ", _ITEM3),
    KnownGap(r"attention_bwd_wmma", _SM80_PLUS, "LDGSTS.128 > 0", r"^bf16 ", _ITEM3),
    # ldmatrix in fp16 only: the bf16 fragments are loaded by generic loads (see above).
    KnownGap(r"attention_fwd_wmma", _SM80_PLUS, "LDSM > 0", r"^bf16 ", _ITEM3),
    KnownGap(r"attention_bwd_wmma", _SM80_PLUS, "LDSM > 0", r"^bf16 ", _ITEM3),
    # The mma forward at D = 128 with pair masks: its masked tiles' exact P·V path pushes the kernel one
    # register past 255, and ptxas spills 8 bytes (measured with nvcc 13.0 on sm_80, sm_90 and sm_90a; the
    # same kernel without pair masks, and every other head dim, has no local memory).
    *(KnownGap(r"attention_fwd_mma", _ANY, criterion, r"^(fp16|bf16) D=128 masks$", _ITEM3)
      for criterion in ("LDL == 0", "STL == 0", "stack == 0")),
    # The forward's mma.sync is HMMA on Hopper too (FlashAttention-2's instruction mix); no wgmma, no TMA.
    KnownGap(r"attention_fwd_mma", r"sm_90a", "HGMMA > 0", r"^fp16 ", _STRETCH),
    KnownGap(r"attention_fwd_mma", r"sm_90a", "HGMMA > 0", r"^bf16 ", _STRETCH),
    KnownGap(r"attention_fwd_mma", r"sm_90a", "UTMALDG > 0", r"^fp16 ", _STRETCH),
    KnownGap(r"attention_fwd_mma", r"sm_90a", "UTMALDG > 0", r"^bf16 ", _STRETCH),
)
