"""PyTorch's own SDPA test cases against ``ae.scaled_dot_product_attention``.

The samples are those torch ships in ``torch.testing._internal.common_methods_invocations.op_db``:
``nn.functional.scaled_dot_product_attention``'s, and those of the aten kernels behind it, translated
into SDPA calls: ``_efficient_attention_forward`` (upper-left / lower-right causal masks with L != S, a
float bias, a jagged batch) and ``_flash_attention_forward`` (whose ``is_causal`` is lower-right). Both
aten OpInfos list no CPU dtype, so torch runs them on CUDA only; their semantics are checked here through
SDPA, whose math path runs everywhere.

Each sample runs on CPU in float32, float64, float16 and bfloat16 on the cpp and reference backends (two
samples also on Triton, under the interpreter), and is
checked by the FlashAttention rule (python_tests/_helpers.py): our error <= 2x (gradients 3x) that of
torch's own SDPA in the same precision, both against float64 (extended precision for float64 inputs),
plus a rounding floor (_opinfo_reference.rounding_floors: what one rounding of each score, scores up to ~300
in make_tensor's samples, and of the backward's two cancelling dot products changes, to first order).
What docs/sdpa.md documents as different is asserted where a sample meets it:
- batch dims that torch broadcasts raise, naming the op; the explicitly expanded call is compared;
- dropout (p > 0) uses attn_ext's own counter-based stream: the keep mask is read back exactly (a value of
  the identity gives the dropped weights), then out and gradients are compared with the formula under
  that mask; the keep rate, reproducibility under ``torch.manual_seed`` and the difference from torch's
  own stream are asserted;
- a query row with no key taking part gives 0 and a zero dq (as torch >= 2.5 does).
A float mask that requires grad gets its gradient compared too. ``test_causal_variants`` is PyTorch's
test of ``torch.nn.attention.bias.CausalBias`` (test_transformers.py) at smaller sizes, plus
lower-right with L > S, which torch's test skips.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant, causal_lower_right, causal_upper_left
from torch.testing._internal.common_methods_invocations import op_db

import attn_ext as ae
from _helpers import assert_within_flash_rule, require_backend
from _opinfo_reference import (dense_longdouble, dense_torch, empty_rows, flash_rule_floor_ulps, rounding_floors,
                               scale_of)

OP = "attn_ext.scaled_dot_product_attention"
F64 = torch.float64
DTYPES = (torch.float32, F64, torch.float16, torch.bfloat16)
BACKENDS = ("cpp", "reference")
SOURCES = {
    "sdpa": "nn.functional.scaled_dot_product_attention",
    "efficient": "torch.ops.aten._efficient_attention_forward",
    "flash": "torch.ops.aten._flash_attention_forward",
}
GRAD_NAMES = ("dq", "dk", "dv", "dmask")


@dataclass(frozen=True)
class Call:
    """One SDPA call in torch's own signature."""
    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Optional[Tensor] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Optional[float] = None

    def kwargs(self) -> dict:
        return dict(attn_mask=self.attn_mask, dropout_p=self.dropout_p, is_causal=self.is_causal, scale=self.scale)

    @property
    def float_mask(self) -> bool:
        m = self.attn_mask
        return isinstance(m, Tensor) and not isinstance(m, CausalBias) and m.is_floating_point()


def _from_sdpa(sample) -> Call:
    kw = dict(sample.kwargs)
    assert len(sample.args) == 2 and set(kw) <= {"attn_mask", "dropout_p", "is_causal", "scale"}, kw
    return Call(sample.input, *sample.args, **kw)


def _jagged_mask(cu_q: Tensor, cu_k: Tensor, L: int, S: int) -> Tensor:
    """Queries cu_q[i]:cu_q[i+1] attend keys cu_k[i]:cu_k[i+1] (the varlen layout): a block-diagonal mask."""
    seg_q = torch.bucketize(torch.arange(L), cu_q[1:].long(), right=True)
    seg_k = torch.bucketize(torch.arange(S), cu_k[1:].long(), right=True)
    seg_k[torch.arange(S) >= int(cu_k[-1])] = -1  # keys past the last sequence belong to none
    return seg_q[:, None] == seg_k[None, :]


def _from_efficient(sample) -> Call:
    kw = sample.kwargs
    q, k, v = (t.transpose(1, 2) for t in (sample.input, *sample.args))  # [B, L, H, E] -> [B, H, L, E]
    L, S = q.shape[-2], k.shape[-2]
    mask = kw["bias"]
    if kw["cu_seqlens_q"] is not None:
        mask = _jagged_mask(kw["cu_seqlens_q"], kw["cu_seqlens_k"], L, S)
    if kw["custom_mask_type"]:  # 1 = CausalVariant.UPPER_LEFT, 2 = LOWER_RIGHT (torch/nn/attention/bias.py)
        mask = CausalBias(CausalVariant(kw["custom_mask_type"]), L, S)
    return Call(q, k, v, mask, kw["dropout_p"], False, kw["scale"])


def _from_flash(sample) -> Call:
    kw = sample.kwargs
    q, k, v = (t.transpose(1, 2) for t in (sample.input, *sample.args))
    # This kernel's is_causal is lower-right aligned (torch/nn/attention/bias.py routes causal_lower_right to it).
    mask = causal_lower_right(q.shape[-2], k.shape[-2]) if kw["is_causal"] else None
    return Call(q, k, v, mask, kw["dropout_p"], False, kw["scale"])


TRANSLATE = {"sdpa": _from_sdpa, "efficient": _from_efficient, "flash": _from_flash}


@functools.lru_cache(maxsize=None)
def samples(source: str, dtype: torch.dtype) -> tuple:
    """The OpInfo's CPU samples (requires_grad=True) as calls, drawn under a fixed seed."""
    info = next(o for o in op_db if o.name == SOURCES[source])
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return tuple(TRANSLATE[source](s) for s in info.sample_inputs("cpu", dtype, requires_grad=True))


SAMPLE_IDS = [(source, i) for source in SOURCES for i in range(len(samples(source, torch.float32)))]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The samples are a few hundred numbers: intra-op threads only add their barriers, which cost seconds per
    file on a busy 2-core machine (measured with other jobs on both cores: 441 tests in 9.5 s on one thread,
    50-150 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense_bias(call: Call) -> Tensor:
    """The call's masking as one float64 additive bias (-inf where a pair does not take part)."""
    L, S, m = call.q.shape[-2], call.k.shape[-2], call.attn_mask
    if call.float_mask:
        return m.detach().double()
    if isinstance(m, CausalBias):
        allowed = torch.ones(L, S, dtype=torch.bool).tril(0 if m.variant == CausalVariant.UPPER_LEFT else S - L)
    elif m is not None:
        allowed = m
    else:
        allowed = torch.ones(L, S, dtype=torch.bool).tril() if call.is_causal else torch.ones(L, S, dtype=torch.bool)
    return torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, -math.inf)


def _leaves(call: Call, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (call.q, call.k, call.v)]
    mask = call.attn_mask
    if call.float_mask:
        mask = mask.detach().to(dtype).requires_grad_(mask.requires_grad)
        if mask.requires_grad:
            leaves.append(mask)
    return leaves, {**call.kwargs(), "attn_mask": mask}


def ours(call: Call, backend: str, grad_out: Optional[Tensor] = None, seed: int = 0):
    """Our out and the gradients of q, k, v (and of a float mask that requires grad)."""
    leaves, kwargs = _leaves(call, call.q.dtype)
    torch.manual_seed(seed)
    with contextlib.nullcontext() if grad_out is not None else torch.no_grad():
        out = ae.scaled_dot_product_attention(*leaves[:3], **kwargs, backend=backend)
    return out.detach(), None if grad_out is None else torch.autograd.grad(out, leaves, grad_out)


def torch_sdpa(call: Call, dtype, grad_out):
    """torch's own SDPA on the call in ``dtype``: out and gradients, as :func:`ours`."""
    leaves, kwargs = _leaves(call, dtype)
    out = F.scaled_dot_product_attention(*leaves[:3], **kwargs)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out.to(dtype))


def _upstream(call: Call) -> Tensor:
    shape = call.q.shape[:-1] + call.v.shape[-1:]
    return torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(call.q.dtype)


def _formula_args(call: Call, grad_out, keep=None):
    mask_shape = tuple(call.attn_mask.shape) if call.float_mask and call.attn_mask.requires_grad else None
    return (call.q, call.k, call.v, dense_bias(call), scale_of(call.q, call.scale), grad_out, keep,
            call.dropout_p if keep is not None else 0.0, mask_shape)


def check_rule(label: str, call: Call, got, got_grads, truth, truth_grads, pt, pt_grads, floors) -> None:
    """Shapes and dtypes, the documented empty rows, then out and every gradient by the FlashAttention rule."""
    dtype = call.q.dtype
    assert got.dtype == dtype and got.shape == truth.shape, f"{label}: out {got.dtype} {tuple(got.shape)}"
    empty = empty_rows(dense_bias(call), got.shape)
    assert bool((got[empty] == 0).all()), f"{label}: rows with no key taking part are not 0"
    assert bool((got_grads[0][empty] == 0).all()), f"{label}: dq of rows with no key taking part is not 0"
    assert_within_flash_rule(got, truth, pt, name=f"{label} out",
                             floor_ulps=flash_rule_floor_ulps(floors[0], truth, dtype))
    assert len(got_grads) == len(truth_grads) == len(pt_grads)
    for name, mine, ref, same, floor in zip(GRAD_NAMES, got_grads, truth_grads, pt_grads, floors[1:]):
        assert mine.dtype == dtype, f"{label} {name}: {mine.dtype}"
        assert_within_flash_rule(mine, ref, same, grad=True, name=f"{label} {name}",
                                 floor_ulps=flash_rule_floor_ulps(floor, ref, dtype))


def textbook(call: Call, args):
    """PyTorch's own same-precision computation of a call whose keep mask torch's kernels cannot draw: the
    formula by autograd, accumulating as ours does (docs/spec.md §0: fp32 for half inputs, as torch's CPU
    kernel; run in half it would measure half-precision softmax and matmuls, 10-100x less accurate, and the
    rule would lose its teeth), rounded to the dtype."""
    dtype = call.q.dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    out, grads = dense_torch(*(t.detach().to(acc) for t in args[:3]), *args[3:])
    return out.to(dtype), [g.to(dtype) for g in grads]


def check_values(call: Call, backend: str, label: str) -> None:
    """p = 0: against torch's own SDPA in the same precision. Without the rounding floor the output alone
    fails the 2x rule on up to 12 % of fresh draws of these samples (reference backend in float32 and
    float64, cpp in float64) while its mean error equals torch's (ratio 1.00 ± 0.05): on a few rows with
    scores up to ~300, the order in which a kernel rounds the scores decides the max error."""
    g = _upstream(call)
    got, got_grads = ours(call, backend, g)
    args = _formula_args(call, g)
    if call.q.dtype == F64:
        truth, truth_grads = dense_longdouble(*args)
        torch_truth = torch_sdpa(call, F64, g)[0]  # the dense bias must say what torch's SDPA computes
        torch.testing.assert_close(torch_truth, truth, rtol=1e-10, atol=1e-12)
    else:
        truth, truth_grads = torch_sdpa(call, F64, g)
    pt, pt_grads = torch_sdpa(call, call.q.dtype, g)
    check_rule(label, call, got, got_grads, truth, truth_grads, pt, pt_grads, rounding_floors(*args))


def _check_keep_rate(weights: Tensor, probs64: Tensor, p: float, who: str) -> None:
    """Among the pairs whose weight is far from underflow, the kept fraction is 1 - p within 5 sigma."""
    decidable = probs64 > 1e-3
    n = int(decidable.sum())
    rate = float((weights[decidable] != 0).double().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) <= 5 * sigma, f"{who}: kept {rate:.3f} of {n} pairs, expected {1 - p} ± {5 * sigma:.3f}"


def check_dropout(call: Call, backend: str, label: str) -> None:
    """p > 0: the keep mask read back through an identity value, then out and gradients under that mask."""
    p, seed, S = call.dropout_p, 11, call.k.shape[-2]
    eye = torch.eye(S, dtype=call.q.dtype).expand(call.k.shape[:-1] + (S,)).contiguous()
    weights, _ = ours(replace(call, v=eye), backend, seed=seed)  # = softmax ∘ keep / (1 - p), pair by pair
    keep = weights != 0
    probs64 = dense_longdouble(*_formula_args(replace(call, v=eye), torch.zeros(weights.shape))[:6])[0]
    _check_keep_rate(weights, probs64, p, f"{label} attn_ext")
    g = _upstream(call)
    got, got_grads = ours(call, backend, g, seed=seed)
    args = _formula_args(call, g, keep)
    truth, truth_grads = dense_longdouble(*args)
    pt, pt_grads = textbook(call, args)
    check_rule(f"{label} (dropout)", call, got, got_grads, truth, truth_grads, pt, pt_grads, rounding_floors(*args))
    # Reproducible under torch.manual_seed, fresh for another seed.
    again, again_grads = ours(call, backend, g, seed=seed)
    assert torch.equal(again, got) and all(torch.equal(a, b) for a, b in zip(again_grads, got_grads)), label
    assert not torch.equal(ours(call, backend, seed=seed + 1)[0], got), f"{label}: dropout ignores the seed"
    # torch draws from its own stream (documented): same shape and dtype, equally distributed, other values.
    _, kwargs = _leaves(call, call.q.dtype)
    with torch.no_grad():
        torch.manual_seed(seed)
        theirs = F.scaled_dot_product_attention(call.q, call.k, call.v, **kwargs)
        torch.manual_seed(seed)
        theirs_weights = F.scaled_dot_product_attention(call.q, call.k, eye, **kwargs)
    assert theirs.shape == got.shape and theirs.dtype == got.dtype
    assert not torch.equal(theirs, got), f"{label}: the same values as torch's dropout stream"
    _check_keep_rate(theirs_weights, probs64, p, f"{label} torch")


def check_broadcast_refusal(call: Call, backend: str) -> Call:
    """torch broadcasts the batch dims of q, k, v; attn_ext raises (documented). Returns the expanded call."""
    q, k = call.q, call.k
    if q.shape[:-2] == k.shape[:-2]:
        return call
    with pytest.raises(ValueError, match=rf"^{OP}: .*(same number|batch dims)"):
        ae.scaled_dot_product_attention(q, k, call.v, **call.kwargs(), backend=backend)
    return replace(call, q=q.expand(k.shape[:-2] + q.shape[-2:]))


def test_torch_ships_the_opinfos_with_cpu_samples():
    assert set(DTYPES) <= set(next(o for o in op_db if o.name == SOURCES["sdpa"]).supported_dtypes("cpu"))
    for source in SOURCES:
        assert len(samples(source, torch.float32)) > 0, source
    # Each kind of sample this file translates is there (a torch upgrade that drops one is noticed).
    calls = [c for source in SOURCES for c in samples(source, torch.float32)]
    assert any(c.dropout_p > 0 for c in calls) and any(c.dropout_p == 0 for c in calls)
    assert any(c.is_causal for c in calls) and any(c.scale is not None for c in calls)
    assert any(c.q.shape[:-2] != c.k.shape[:-2] for c in calls)
    assert any(c.float_mask and c.attn_mask.requires_grad for c in calls)
    assert any(isinstance(c.attn_mask, CausalBias) and c.attn_mask.variant == v for c in calls for v in CausalVariant)
    assert any(isinstance(c.attn_mask, Tensor) and c.attn_mask.dtype == torch.bool for c in calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("source,index", SAMPLE_IDS, ids=[f"{s}{i}" for s, i in SAMPLE_IDS])
def test_opinfo_sample(source, index, dtype, backend):
    call = samples(source, dtype)[index]
    require_backend(backend, call.q)
    call = check_broadcast_refusal(call, backend)
    label = f"{source}[{index}] {dtype} {backend}"
    (check_dropout if call.dropout_p > 0 else check_values)(call, backend, label)


@pytest.mark.parametrize("source,index", [("efficient", 2), ("sdpa", 24)], ids=["efficient2", "sdpa24"])
def test_opinfo_sample_triton(source, index):
    """Triton under the interpreter takes seconds a call: two samples in float32, a lower-right CausalBias
    with L < S and a float mask that requires grad."""
    assert samples(source, torch.float32)[index].attn_mask is not None
    test_opinfo_sample(source, index, torch.float32, "triton")


# PyTorch's test_causal_variants shapes (B, H, L, S, E), (16, 16, 128, 128, 16), (16, 16, 128, 256, 32),
# (16, 16, 256, 128, 32), scaled down with L : S kept, and its (1, 1, 23, 56, 15) as it is.
CAUSAL_SHAPES = [(2, 2, 16, 16, 16), (2, 2, 16, 32, 32), (2, 2, 32, 16, 32), (1, 1, 23, 56, 15)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("float32", "float16"))
@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", list(CausalVariant), ids=lambda v: v.name.lower())
def test_causal_variants(variant, shape, dtype, backend):
    B, H, L, S, E = shape
    gen = torch.Generator().manual_seed(L * S + E)
    q, k, v = (torch.rand(B, H, n, E, generator=gen).to(dtype) for n in (L, S, S))  # torch.rand, as torch's test
    require_backend(backend, q)
    lower = variant == CausalVariant.LOWER_RIGHT
    with pytest.warns(UserWarning, match="NaN") if lower and L > S else contextlib.nullcontext():
        bias = (causal_lower_right if lower else causal_upper_left)(L, S)  # attn_ext gives 0 in those rows
    call = Call(q, k, v, bias)
    label = f"{variant.name} {shape} {dtype} {backend}"
    check_values(call, backend, label)
    if lower and L > S:
        assert bool((ours(call, backend)[0][..., : L - S, :] == 0).all()), f"{label}: rows above every key not 0"
    # The same as its explicit form: is_causal=True for upper-left, the bottom-right aligned bool mask otherwise.
    explicit = replace(call, attn_mask=torch.ones(L, S, dtype=torch.bool).tril(S - L)) if lower else \
        replace(call, attn_mask=None, is_causal=True)
    got, want = ours(call, backend)[0], ours(explicit, backend)[0]
    tol = 4 * torch.finfo(dtype).eps * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=lambda m: f"{label}: not its explicit form\n{m}")
    with pytest.raises(ValueError, match=rf"^{OP}: "):  # as torch: a CausalBias does not combine with is_causal
        ae.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True, backend=backend)
