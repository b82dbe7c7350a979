"""PyTorch's own ModuleInfo samples of ``torch.nn.MultiheadAttention`` against ``ae.nn.MultiheadAttention``.

The samples are those torch ships in ``torch.testing._internal.common_modules.module_db``: its
``module_inputs_func`` gives 64 (constructor, forward) pairs — ``bias``, ``add_bias_kv``,
``add_zero_attn``, ``batch_first``, a bool ``key_padding_mask`` and a 3-D bool ``attn_mask``, unbatched
inputs with ``reference_fn`` = the same call on a batch of one. Each builds torch's module and ours with
the same arguments and the same state dict (biases drawn, as they start at 0), in float32 and float64, and
runs the sample as given (``need_weights=True``: the weights are formed) and with ``need_weights=False``
(the fused kernels). Out, weights and the gradients of the inputs and of every parameter follow the
FlashAttention rule (python_tests/_helpers.py): our error <= 2x (gradients 3x) torch's own same-precision
error, both against an extended-precision ground truth (``_mha_reference.mha_longdouble``, itself
checked against torch in float64), plus a rounding floor: one ulp, and what the roundings every
implementation commits in the attention (each score once, the backward's dot products once) change
(``_mha_reference.mha_rounding_floors``; these samples have scores up to ~20, head dim 1). The sample's
``reference_fn`` (the batch-of-one call) must hold for our module too, exactly.

docs/nn.md's difference that these samples can meet, asserted exactly on each sample's configuration
with a query row masked entirely: torch's ``need_weights=True`` path gives NaN in that row (out, weights,
and gradients), ours gives a zero attention vector (``out_proj.bias``), zero weights and finite
gradients — what torch's own ``need_weights=False`` path gives, and the ground truth.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.testing._internal.common_modules import module_db

import attn_ext as ae
from _helpers import assert_within_flash_rule
from _mha_reference import additive_bias, mha_longdouble, mha_rounding_floors

F64 = torch.float64
DTYPES = (torch.float32, F64)


@functools.lru_cache(maxsize=None)
def samples(dtype: torch.dtype) -> tuple:
    info = next(m for m in module_db if m.module_cls is torch.nn.MultiheadAttention)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return tuple(info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True))


def _modules(sample, dtype, seed):
    """torch's module (weights from ``seed``, biases drawn: they start at 0), ours and a float64 copy of it,
    all with the same state dict."""
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        reference = torch.nn.MultiheadAttention(*args, **kwargs, dtype=dtype)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, dtype=F64))
    ours = ae.nn.MultiheadAttention(*args, **kwargs, dtype=dtype)
    ours.load_state_dict(reference.state_dict())
    exact = torch.nn.MultiheadAttention(*args, **kwargs, dtype=F64)
    exact.load_state_dict(reference.state_dict())
    return reference, ours, exact


def _upstream(sample, dtype):
    """Fixed random upstream gradients of out ``[L, E]`` and of the averaged weights ``[L, S']``."""
    L, S = sample.forward_input.args[0].shape[0], sample.forward_input.args[1].shape[0]
    kwargs = sample.constructor_input.kwargs
    extra = int(kwargs["add_bias_kv"]) + int(kwargs["add_zero_attn"])
    gen = torch.Generator().manual_seed(5)
    return tuple(torch.randn(shape, generator=gen, dtype=F64).to(dtype) for shape in ((L, 3), (L, S + extra)))


def _call(module, inputs, masks, need_weights, upstream):
    """Out, weights and the gradients of the inputs and of every parameter (by name) for the upstream."""
    leaves = [x.detach().to(module.out_proj.weight.dtype).requires_grad_() for x in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on bool masks
        out, weights = module(*leaves, **masks, need_weights=need_weights)
    total = (out * upstream[0].to(out.dtype)).sum()
    if need_weights:
        total = total + (weights * upstream[1].to(weights.dtype)).sum()
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(total, leaves + list(params.values()))
    return out.detach(), None if weights is None else weights.detach(), dict(
        zip(["query", "key", "value", *params], grads))


def _truth(exact, inputs, masks, need_weights, upstream, dtype):
    """The ground truth of :func:`_call` for these unbatched inputs (a batch of one), in extended precision,
    and the rounding floor of each of its tensors in ``dtype`` (:func:`mha_rounding_floors`)."""
    q, k, v = (x.detach().double()[None] for x in inputs)
    pad = masks.get("key_padding_mask")
    bias = additive_bias(exact, 1, q.shape[1], k.shape[1], masks.get("attn_mask"), None if pad is None else pad[None])
    H = exact.num_heads
    grad_weights = upstream[1].double()[None, None].expand(1, H, -1, -1) / H if need_weights else None
    grad_out = upstream[0].double()[None]
    out, probs, input_grads, param_grads = mha_longdouble(exact, q, k, v, bias, grad_out, grad_weights)
    grads = dict(zip(("query", "key", "value"), (g[0] for g in input_grads)), **param_grads)
    floors = mha_rounding_floors(exact, q, k, v, bias, grad_out, torch.finfo(dtype).eps / 2)
    return out[0], probs[0].mean(0), grads, floors


def _check(label, got, truth, same_precision, rows=slice(None)):
    """Out, weights and every gradient by the FlashAttention rule, its floor raised by the rounding floor."""
    floors = truth[3]
    for name, mine, ref, pt, grad in (("out", got[0], truth[0], same_precision[0], False),
                                      ("weights", got[1], truth[1], same_precision[1], False),
                                      *((n, got[2][n], truth[2][n], same_precision[2][n], True) for n in got[2])):
        if mine is None:
            continue
        if not grad:
            mine, ref, pt = mine[rows], ref[rows], pt[rows]
        assert mine.dtype == pt.dtype, f"{label} {name}: {mine.dtype}"
        ulp = torch.finfo(mine.dtype).eps * max(1.0, float(ref.abs().max()))
        assert_within_flash_rule(mine, ref, pt, grad=grad, name=f"{label} {'d' if grad else ''}{name}",
                                 floor_ulps=1.0 + floors.get(name, 0.0) / ulp)


def test_torch_ships_the_module_info_with_its_samples():
    samples_ = samples(torch.float32)
    assert len(samples_) == 64 and all(s.reference_fn is not None for s in samples_)
    kinds = {(*(s.constructor_input.kwargs[k] for k in ("add_bias_kv", "add_zero_attn", "bias", "batch_first")),
              *(s.forward_input.kwargs[k] is not None for k in ("key_padding_mask", "attn_mask"))) for s in samples_}
    assert len(kinds) == 64  # every combination of the six options


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("index", range(64))
def test_module_info_sample(index, dtype):
    sample = samples(dtype)[index]
    reference, ours, exact = _modules(sample, dtype, seed=index)
    inputs, masks = sample.forward_input.args, sample.forward_input.kwargs
    upstream = _upstream(sample, dtype)
    for need_weights in (True, False):
        label = f"sample {index} {dtype} need_weights={need_weights}"
        truth = _truth(exact, inputs, masks, need_weights, upstream, dtype)
        # The ground truth says what torch computes: torch in float64 agrees with it to float64 rounding.
        torch64 = _call(exact, inputs, masks, need_weights, upstream)
        for name, a, b in (("out", torch64[0], truth[0]), *((n, torch64[2][n], truth[2][n]) for n in truth[2])):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{label} {name}: ground truth\n{m}")
        _check(label, _call(ours, inputs, masks, need_weights, upstream), truth,
               _call(reference, inputs, masks, need_weights, upstream))
    # torch's reference_fn (what its TestModule.test_forward compares with): a batch of one, squeezed.
    with torch.no_grad():
        out, weights = ours(*inputs, **masks)
        expected = sample.reference_fn(ours, *inputs, **masks, batch_first=ours.batch_first)
    assert torch.equal(out, expected[0]) and torch.equal(weights, expected[1])


@pytest.mark.parametrize("index", range(0, 64, 2))  # the batch-first half: batch_first is moot when unbatched
def test_a_row_with_no_key_is_the_documented_difference(index):
    dtype = torch.float32
    sample = samples(dtype)[index]
    reference, ours, exact = _modules(sample, dtype, seed=index)
    inputs, masks = sample.forward_input.args, dict(sample.forward_input.kwargs)
    L, S = inputs[0].shape[0], inputs[1].shape[0]
    banned = torch.zeros(ours.num_heads, L, S, dtype=torch.bool) if masks["attn_mask"] is None \
        else masks["attn_mask"].clone()
    banned[:, 0] = True  # query 0 may attend no given key: without an extra key its row is empty
    masks["attn_mask"] = banned
    empty = ours.bias_k is None and not ours.add_zero_attn
    upstream = _upstream(sample, dtype)
    label = f"sample {index} with row 0 masked"
    # need_weights=True: torch's slow path gives NaN in the empty row and in the gradients; we give
    # out_proj.bias (a zero attention vector), zero weights and finite gradients.
    got = _call(ours, inputs, masks, True, upstream)
    theirs = _call(reference, inputs, masks, True, upstream)
    if empty:
        assert bool(theirs[0][0].isnan().all()) and bool(theirs[1][0].isnan().all()), label
        assert all(bool(g.isnan().any()) for name, g in theirs[2].items() if name != "out_proj.bias"), label
        bias = ours.out_proj.bias.detach() if ours.out_proj.bias is not None else torch.zeros(3, dtype=dtype)
        assert torch.equal(got[0][0], bias) and bool((got[1][0] == 0).all()), label
    assert all(bool(g.isfinite().all()) for g in got[2].values()), label
    truth = _truth(exact, inputs, masks, True, upstream, dtype)
    rest = slice(1, None) if empty else slice(None)
    _check(f"{label}, need_weights=True", (got[0], got[1], {}), truth, theirs, rows=rest)
    # need_weights=False: torch's own SDPA path gives the same zero row; everything by the rule.
    truth = _truth(exact, inputs, masks, False, upstream, dtype)
    _check(f"{label}, need_weights=False", _call(ours, inputs, masks, False, upstream), truth,
           _call(reference, inputs, masks, False, upstream))
