"""The representative problems whose launches the Triton AOT check compiles: every Triton launcher of
the package, called with CPU tensors of each dtype and head dim it accepts.

A case is only a call of a launcher (``cross_attention_forward``, ``merge_states_backward``, …): the
kernel arguments, constexprs and tile choices are then exactly those the launcher builds, and the
autotuned launches bring every config that the package's own pruning keeps (see
``triton_aot_capture``). Nothing runs: the launches are recorded, not executed, so the tensors only
need the right dtypes, shapes and strides.

Sizes: M = N = 136 keys and queries, above every tile (128) so that the size buckets prune no config,
and not a multiple of 16, as most real lengths. Head dims 16, 64, 128, 256 (one per padded tile
width) and 40, whose strides are not multiples of 16 (Triton then specialises the kernel without
the 16-element alignment of the others).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import re

import torch

from attn_ext.ops.attention.band import Band

__all__ = ["DTYPES", "HEAD_DIMS", "KERNEL_TARGETS", "SASS_SCOPE", "TMA_DIMS", "TMA_DTYPES", "Case", "all_cases",
           "in_sass_scope", "select"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# In order of priority (see select): 40 after the others, as bf16 after fp16 in DTYPES.
HEAD_DIMS = (16, 64, 128, 256, 40)
#: (D, Dv) of Intention, whose factor tile limits D to 128 (Dv to 256).
INTENTION_DIMS = ((16, 16), (64, 64), (128, 128), (128, 256), (40, 40))
#: Head dims of the causal variant of the attention op (the common decoder ones), to bound the compiles.
ATTENTION_CAUSAL_DIMS = (64, 128)
#: Constexprs of the attention kernels that select the per-pair rules (mask kind, causal order, dropout).
#: The CI scope checks every tile config once without them and compiles each flagged case with one config,
#: its largest (step 2 of select): 1681 compiles would otherwise be ~700. They do add shared memory (with a
#: mask or dropout up to a [BLOCK_M, BLOCK_N] tile more, see triton_tiles._smem_estimate), which the largest
#: config shows where it matters most: fp32 dK/dV at D = 16 with 128x128 tiles was over sm_80's limit.
PAIR_FLAGS = frozenset({"HAS_MASK", "ATTN_MASK", "IS_CAUSAL", "HAS_DROPOUT", "WINDOW", "SOFTCAP", "ALIBI", "VARLEN",
                        "BOTTOM_RIGHT", "SPLIT_K", "PAGED"})
#: The machine-code report's scope (``--scope sass``, ``make sass-report``): the attention kernels (the
#: families' launches: forward, backward, merge) at the head dims and dtypes of issue 43, every kept config.
#: Every code path of the attention kernels, causal with dropout too: the spill table (spill_table.py) is
#: written from this scope, and the autotuner's pruning reads it per code path.
SASS_SCOPE = {"families": ("cross_attention", "attention", "attention_tma", "merge"), "dtypes": ("fp16", "bf16"),
              "head_dims": (64, 128)}
#: The Hopper TMA forward (opt-in, fp16/bf16 only): its dtypes and head dims, causal and not, on sm_90 only.
TMA_DTYPES, TMA_DIMS = ("fp16", "bf16"), (64, 128)
#: The kernels compiled for some targets only (their dispatch takes them nowhere else): {kernel: targets}. A run
#: over other targets does not miss them.
KERNEL_TARGETS = {"_fwd_tma_kernel": ("sm_90",), "_bwd_dkdv_tma_kernel": ("sm_90",), "_bwd_dq_tma_kernel": ("sm_90",)}
B, H, M, N = 1, 2, 136, 136
TREE = dict(branching=4, height=2, group_size=16)  # 21 inner nodes, 16 groups of 16 leaves
TREE_HEADS = 4
#: Translation-equivariant attention at TE-TNP's sizes: (heads, input dims, hidden units); head dims TE_DIMS.
TE_SIZES, TE_DIMS = (4, 2, 64), (16, 64)


@dataclass(frozen=True)
class Case:
    family: str
    dtype: str
    dims: str
    call: Callable[[], object]


def _randn(*shape, dtype):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def _key_mask(n: int) -> torch.Tensor:
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[:, -3:] = True  # the masked launch is the superset variant (it reads the mask)
    return mask


# Each case imports its launchers when it runs, not with this module: their modules need Triton (optional; this
# module imports without it) and decorate their kernels when first imported, reading TRITON_INTERPRET, which
# triton_aot.main clears first.
def _cross_attention(dtype, d: int) -> None:
    from attn_ext.ops.attention.triton_bwd import cross_attention_backward
    from attn_ext.ops.attention.triton_fwd import cross_attention_forward

    q, k, v = _randn(B, H, M, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype)
    mask, scale, chunk = _key_mask(N), d ** -0.5, 128  # 128: the largest key tile the hint allows
    cross_attention_forward(q, k, v, mask, scale, chunk)
    # Outputs of a forward that did not run: finite, unsaturated stand-ins (lse 0), so that the
    # backward takes its Triton path.
    out, lse = torch.zeros_like(q), torch.zeros(B, H, M)
    cross_attention_backward(torch.ones_like(out), torch.ones(B, H, M), q, k, v, mask, out, lse, scale, chunk)


def _attention(dtype, d: int, causal: bool, dropout_p: float = 0.1) -> None:
    """The general attention op with grouped key/value heads (2 query heads per key/value head) and
    dropout: either an additive float mask (broadcast over heads, stride 0) with key padding, or the
    causal rule alone (the two ways the public API combines them); and causal without dropout
    (``dropout_p`` 0), the decoder's case and the GPU benchmark's."""
    from attn_ext.ops.attention.triton_bwd import attention_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward

    hq = 2 * H
    q, k, v = _randn(B, hq, M, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype)
    mask = None if causal else _randn(B, 1, M, N, dtype=dtype).expand(B, hq, M, N)
    padding = None if causal else _key_mask(N)
    args = (mask, padding, d ** -0.5, causal, dropout_p, torch.tensor([1234]), 128)
    attention_forward(q, k, v, *args)
    out, lse = torch.zeros_like(q), torch.zeros(B, hq, M)
    attention_backward(torch.ones_like(out), torch.ones(B, hq, M), q, k, v, mask, padding, out, lse, *args[2:])


def _attention_scored(dtype, d: int) -> None:
    """The general attention op with a window, the soft cap and ALiBi at once (the spill table's ``scored``
    variant, the path of the decoders that use them: Mistral's window, Gemma 2's window and cap, ALiBi with the
    causal rule), off the top-left diagonal, with key padding and grouped heads. A launch that adds a mask or
    dropout is weighed by this variant's stack and theirs (``triton_spills.launch_variants``)."""
    from attn_ext.ops.attention.triton_bwd import attention_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward

    hq = 2 * H
    q, k, v = _randn(B, hq, M, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype)
    mask, padding = None, _key_mask(N)
    args = (mask, padding, d ** -0.5, True, 0.0, None, 128)
    band = dict(window_left=64, window_right=-1, diagonal=N - M + 3, softcap=30.0,
                alibi_slopes=torch.full((B, hq), 0.25))
    attention_forward(q, k, v, *args, **band)
    out, lse = torch.zeros_like(q), torch.zeros(B, hq, M)
    attention_backward(torch.ones_like(out), torch.ones(B, hq, M), q, k, v, mask, padding, out, lse, *args[2:],
                       **band)


def _attention_varlen(dtype, d: int, scored: bool) -> None:
    """A packed batch (``varlen_attention``'s one launch per kernel): three sequences of 40, 0 and 96 queries over
    50, 9 and 77 keys, grouped heads; the causal rule per sequence (top-left), or the bottom-right window with the
    soft cap and ALiBi."""
    from attn_ext.ops.attention.triton_bwd import attention_backward
    from attn_ext.ops.attention.triton_fwd import attention_forward

    hq = 2 * H
    cu_q, cu_k = torch.tensor([0, 40, 40, M], dtype=torch.int32), torch.tensor([0, 50, 59, N], dtype=torch.int32)
    q, k, v = _randn(1, hq, M, d, dtype=dtype), _randn(1, H, N, d, dtype=dtype), _randn(1, H, N, d, dtype=dtype)
    band = dict(window_left=64, window_right=-1, diagonal=0, softcap=30.0,
                alibi_slopes=torch.full((3, hq), 0.25)) if scored else {}
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, bottom_right=scored)
    args = (None, None, d ** -0.5, True, 0.0, None, 128)
    attention_forward(q, k, v, *args, **band, **packed)
    out, lse = torch.zeros_like(q), torch.zeros(1, hq, M)
    attention_backward(torch.ones_like(out), torch.ones(1, hq, M), q, k, v, None, None, out, lse, *args[2:], **band,
                       **packed)


def _attention_decode_split(dtype, d: int) -> None:
    """A decoding step split over keys (``SPLIT_K``, :mod:`attn_ext.ops.attention.triton_split_keys`; three parts
    forced, as a GPU chooses for few heads over a long cache): two new tokens aligned at the end of 600 keys
    with the causal rule among them, grouped heads, key padding. Forward only (the backward does not split)."""
    from attn_ext.ops.attention.triton_fwd import launch_forward
    from attn_ext.ops.attention.triton_score_mod import kernel_scores

    hq, m, n = 2 * H, 2, 600
    q, k, v = _randn(B, hq, m, d, dtype=dtype), _randn(B, H, n, d, dtype=dtype), _randn(B, H, n, d, dtype=dtype)
    band = Band.of(True, -1, -1, n - m)
    scores = kernel_scores(band, True, 0.0, None, n - m, q, k)
    launch_forward(q, k, v, _key_mask(n), d ** -0.5, 128, scores=scores, key_parts=3)


def _attention_paged(dtype, d: int) -> None:
    """Decoding from a paged cache (``PAGED``, :mod:`attn_ext.ops.attention.triton_paged`): two entries of 300 and
    41 cached keys in blocks of 16, two new tokens each under the causal rule, grouped heads; split over keys (three
    parts forced) and not."""
    from attn_ext.ops.attention.triton_paged import paged_forward

    hq, blocks = 2 * H, 24
    q = _randn(2, hq, 2, d, dtype=dtype)
    k_cache, v_cache = _randn(blocks, 16, H, d, dtype=dtype), _randn(blocks, 16, H, d, dtype=dtype)
    table = torch.arange(2 * 19, dtype=torch.int32).remainder(blocks).reshape(2, 19)
    for parts in (None, 3):
        paged_forward(q, k_cache, v_cache, table, [300, 41], d ** -0.5, True, -1, -1, 0.0, None, 128,
                      key_parts=parts)


def _attention_tma(dtype, d: int, causal: bool, n: int = N) -> None:
    """The Hopper forward and backward through TMA descriptors (grouped heads, no mask), called directly: their
    dispatch takes them only on a compute capability 9 device, so they are compiled for sm_90 alone. ``n`` = 136
    keys tests each key block against N; a multiple of 128 (every key tile) compiles the forward's loop without
    that test."""
    from triton.runtime import driver

    from attn_ext.ops.attention.triton_bwd_tma import launch_backward_tma
    from attn_ext.ops.attention.triton_fwd_tma import launch_forward_tma

    if f"sm_{driver.active.get_current_target().arch}" not in KERNEL_TARGETS["_fwd_tma_kernel"]:
        return
    q, k, v = _randn(B, 2 * H, M, d, dtype=dtype), _randn(B, H, n, d, dtype=dtype), _randn(B, H, n, d, dtype=dtype)
    launch_forward_tma(q, k, v, d ** -0.5, 128, causal)
    lse, delta = torch.zeros(B, 2 * H, M), torch.zeros(B, 2 * H, M)
    launch_backward_tma(torch.ones_like(q), q, k, v, lse, delta, d ** -0.5, 128, causal)


def _merge(dtype, dv: int) -> None:
    from attn_ext.ops.attention.triton_merge import merge_states_backward, merge_states_forward

    out_a, out_b = _randn(B, H, M, dv, dtype=dtype), _randn(B, H, M, dv, dtype=dtype)
    lse_a, lse_b = torch.zeros(B, H, M), torch.zeros(B, H, M)
    merge_states_forward(out_a, lse_a, out_b, lse_b)
    merge_states_backward(torch.ones_like(out_a), torch.ones(B, H, M), out_a, lse_a, out_b, lse_b,
                          torch.zeros_like(out_a), torch.zeros(B, H, M))


def _tree(dtype, d: int, sample: bool) -> None:
    from attn_ext.ops.tree.triton_bwd import tree_cross_attention_bwd_triton
    from attn_ext.ops.tree.triton_fwd import tree_cross_attention_fwd_triton

    b, k, p = TREE["branching"], TREE["height"], TREE["group_size"]
    nodes = (b ** (k + 1) - 1) // (b - 1) + p * b ** k
    s = k * (b - 1) + p
    q = _randn(B, TREE_HEADS, M, d, dtype=dtype)
    node_k, node_v = (_randn(B, TREE_HEADS, nodes, d, dtype=dtype) for _ in range(2))
    mask = torch.zeros(B, nodes, dtype=torch.bool)
    uniforms = torch.rand(B, M, k) if sample else None
    tree_cross_attention_fwd_triton(q, node_k, node_v, mask, b, k, p, d ** -0.5, uniforms)
    if sample:
        return  # the backward does not depend on the policy
    selected = torch.zeros(B, M, s, dtype=torch.int64)
    tree_cross_attention_bwd_triton(torch.ones_like(q), torch.ones(B, TREE_HEADS, M), torch.ones(B, M),
                                    torch.ones(B, M), q, node_k, node_v, mask, selected,
                                    torch.zeros(B, TREE_HEADS, M), b, k, p, d ** -0.5)


def _intention(dtype, d: int, dv: int) -> None:
    from attn_ext.ops.intention.triton_ridge import intention_bwd_triton, intention_fwd_triton

    q, k, v = _randn(B, H, M, d, dtype=dtype), _randn(B, H, N, d, dtype=dtype), _randn(B, H, N, dv, dtype=dtype)
    mask = _key_mask(N)
    intention_fwd_triton(q, k, v, mask, torch.ones(B, H), 1.0)
    factor, weights = torch.eye(d).expand(B, H, d, d).contiguous(), torch.zeros(B, H, d, dv)
    intention_bwd_triton(torch.ones(B, H, M, dv, dtype=dtype), q, k, v, mask, factor, weights, 1.0)


def _te_attention(dtype, d: int) -> None:
    from attn_ext.ops.te_attention.triton_bwd import te_attention_bwd_triton
    from attn_ext.ops.te_attention.triton_fwd import te_attention_fwd_triton

    heads, dx, hidden = TE_SIZES
    q, k, v = (_randn(B, heads, n, d, dtype=dtype) for n in (M, N, N))
    xq, xk = _randn(B, M, dx, dtype=dtype), _randn(B, N, dx, dtype=dtype)
    w1, b1 = _randn(hidden, heads + dx, dtype=dtype), _randn(hidden, dtype=dtype)
    w2, b2 = _randn(heads, hidden, dtype=dtype), _randn(heads, dtype=dtype)
    mask = _key_mask(N)
    te_attention_fwd_triton(q, k, v, xq, xk, w1, b1, w2, b2, mask, d ** -0.5, 0, 0)
    te_attention_bwd_triton(torch.ones(B, heads, M, d, dtype=dtype), torch.zeros(B, heads, M), q, k, v, xq, xk, w1, b1,
                            w2, b2, mask, torch.zeros(B, heads, M, d, dtype=dtype), torch.zeros(B, heads, M),
                            d ** -0.5, 0, 0)


def all_cases() -> list[Case]:
    """Every (launcher family, dtype, head dims) the check covers."""
    cases = []
    for name, dtype in DTYPES.items():
        for d in HEAD_DIMS:
            dims = f"D={d}"
            cases.append(Case("cross_attention", name, dims, lambda dtype=dtype, d=d: _cross_attention(dtype, d)))
            cases.append(Case("attention", name, dims + " mask", lambda dtype=dtype, d=d: _attention(dtype, d, False)))
            if d in ATTENTION_CAUSAL_DIMS:
                cases.append(Case("attention", name, dims + " causal",
                                  lambda dtype=dtype, d=d: _attention(dtype, d, True, 0.0)))
                cases.append(Case("attention", name, dims + " causal dropout",
                                  lambda dtype=dtype, d=d: _attention(dtype, d, True)))
                cases.append(Case("attention", name, dims + " scored",
                                  lambda dtype=dtype, d=d: _attention_scored(dtype, d)))
                for scored in (False, True):
                    cases.append(Case("attention", name, dims + (" varlen scored" if scored else " varlen causal"),
                                      lambda dtype=dtype, d=d, scored=scored: _attention_varlen(dtype, d, scored)))
                cases.append(Case("attention", name, dims + " decode split",
                                  lambda dtype=dtype, d=d: _attention_decode_split(dtype, d)))
                cases.append(Case("attention", name, dims + " paged",
                                  lambda dtype=dtype, d=d: _attention_paged(dtype, d)))
            if name in TMA_DTYPES and d in TMA_DIMS:
                for variant, causal, n in (("", False, N), (" N=256", False, 256), (" causal", True, N)):
                    cases.append(Case("attention_tma", name, dims + variant,
                                      lambda dtype=dtype, d=d, causal=causal, n=n: _attention_tma(dtype, d, causal, n)))
            cases.append(Case("merge", name, f"Dv={d}", lambda dtype=dtype, d=d: _merge(dtype, d)))
            for sample in (False, True):
                cases.append(Case("tree", name, dims + (" sample" if sample else " greedy"),
                                  lambda dtype=dtype, d=d, sample=sample: _tree(dtype, d, sample)))
        for d, dv in INTENTION_DIMS:
            cases.append(Case("intention", name, f"D={d} Dv={dv}",
                              lambda dtype=dtype, d=d, dv=dv: _intention(dtype, d, dv)))
        for d in TE_DIMS:
            cases.append(Case("te_attention", name, f"D={d}", lambda dtype=dtype, d=d: _te_attention(dtype, d)))
    return cases


def in_sass_scope(case: Case) -> bool:
    """Whether ``case`` is one of :data:`SASS_SCOPE`'s (its dims open with ``D=<d>`` or ``Dv=<d>``)."""
    head_dim = re.match(r"Dv?=(\d+)\b", case.dims)
    return (case.family in SASS_SCOPE["families"] and case.dtype in SASS_SCOPE["dtypes"]
            and head_dim is not None and int(head_dim.group(1)) in SASS_SCOPE["head_dims"])


def select(jobs: dict, scope: str, dot_kernels=frozenset()) -> dict:
    """The jobs to compile, in the order given: all of them (``"full"``), those that a case of
    :data:`SASS_SCOPE` launches (``"sass"``: every kept config), or the CI cover (``"ci"``):

    1. every kept config of every kernel and target, for each set of launcher-derived constexprs
       (padded head dims, mask, sampling, ...) and, for ``dot_kernels`` (whose shared memory holds
       ``tl.dot`` operands in the input dtype), each element size (4 bytes: fp32; 2: fp16 and bf16).
       Shared memory depends on nothing else, so this checks every config against the limit; the
       first case in order stands for the others (fp32 for all dtypes of a kernel without
       ``tl.dot``, fp16 for bf16, D = 64 for D = 40);
    2. every case (dtype × dims) of every kernel and target at least once: one config each, so that
       every dtype, the unaligned D = 40 and every per-pair rule (:data:`PAIR_FLAGS`) are compiled too;
       the largest config (``Job.tile_area``), the one most likely to spill, so that the machine-code
       check (``sass_criteria``) sees the per-pair rules' spills in CI too.
    """
    if scope == "full":
        return dict(jobs)
    if scope == "sass":
        return {job: cases for job, cases in jobs.items() if any(map(in_sass_scope, cases))}
    if scope != "ci":
        raise ValueError(f"scope must be 'ci', 'sass' or 'full', got {scope!r}")
    chosen, configs, covered = {}, set(), set()
    for job, cases in jobs.items():
        size = DTYPES[cases[0].dtype].itemsize if job.kernel in dot_kernels else 0
        # options: the fixed ones and the config's, less the per-pair rule flags (see PAIR_FLAGS)
        options = tuple((k, v) for k, v in job.options if k not in PAIR_FLAGS)
        config = (job.kernel, job.target, size, options)
        if config not in configs:
            configs.add(config)
            chosen[job] = cases
            covered.update((job.kernel, job.target, case) for case in cases)
    for job, cases in sorted(jobs.items(), key=lambda item: -item[0].tile_area()):  # stable: the first largest
        if any((job.kernel, job.target, case) not in covered for case in cases):
            chosen[job] = cases
            covered.update((job.kernel, job.target, case) for case in cases)
    return {job: jobs[job] for job in jobs if job in chosen}
