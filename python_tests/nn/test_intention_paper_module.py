"""ae.nn.Intention in the paper's form (Definition 3.1, eq. 3), its ridge α, and InformerLayer(norm_first=...).

Every expected value is an independent float64 formula written here from the module's parameters
(explicit matmuls, ``torch.linalg.solve`` per batch entry and head over the valid keys only).
"""
import doctest
import math

import pytest
import torch

import attn_ext as ae
import attn_ext.nn.informer
import attn_ext.nn.intention_parts

F64 = torch.float64


# -- float64 formulas ------------------------------------------------------------------------------

def linear_stack(layers, x):
    """An nn.Linear (or a Sequential of Linear/ReLU) by hand."""
    for layer in (layers if isinstance(layers, torch.nn.Sequential) else [layers]):
        x = x @ layer.weight.T + layer.bias if isinstance(layer, torch.nn.Linear) else x.clamp_min(0)
    return x


def e_w_of_head(layer, h, w):
    """The head's e_w on every row of its map ``w [D, D]``."""
    mlp = layer.e_w_on_map
    for i, (weight, bias) in enumerate(zip(mlp.weights, mlp.biases)):
        w = w @ weight[h] + bias[h]
        if i < len(mlp.weights) - 1:
            w = w.clamp_min(0)
    return w


def context_features(ek, ev):
    """The documented features of one head's valid embedded keys/values ``[n, D]``."""
    n = ek.shape[0]
    log_n = torch.tensor([math.log1p(n)], dtype=F64)
    return torch.cat([(ek * ek).sum(0) / max(n, 1), (ek * ev).sum(0) / max(n, 1), log_n])


def expected_output(layer, query, key, value, mask=None, sigma=False):
    """eq. 3 per batch entry and head, ``E_Q · e_w[(E_KᵀE_K + αI)⁻¹ E_KᵀE_V]``, heads concatenated."""
    B, M, _ = query.shape
    H, D = layer.num_heads, layer.head_dim
    eq, ek, ev = linear_stack(layer.e_q, query), linear_stack(layer.e_k, key), linear_stack(layer.e_v, value)
    rows = []
    for b in range(B):
        valid = torch.ones(key.shape[1], dtype=torch.bool) if mask is None else ~mask[b]
        heads = []
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            q, k, v = eq[b, :, sl], ek[b, valid, sl], ev[b, valid, sl]
            raw = layer.raw_alpha[h]
            if layer.context_ridge is not None:
                raw = raw + linear_stack(layer.context_ridge.net, context_features(k, v))[0]
            alpha = torch.nn.functional.softplus(raw)
            sigma_ = torch.linalg.solve(k.T @ k + alpha * torch.eye(D, dtype=F64), torch.eye(D, dtype=F64))
            if sigma:
                heads.append(torch.softmax(layer.query_scale * q @ sigma_ @ k.T, -1) @ v)
                continue
            w = layer.query_scale * sigma_ @ k.T @ v
            heads.append(q @ (w if layer.e_w_on_map is None else e_w_of_head(layer, h, w)))
        rows.append(torch.cat(heads, -1))
    out = torch.stack(rows)
    if layer.form == "linear":
        return linear_stack(layer.e_w, out)
    return out if layer.out_proj is None else linear_stack(layer.out_proj, out)


def randomise_context_ridge(layer, seed=0):
    """The context network starts at zero output; give it weights so that the tests see it act."""
    if layer.context_ridge is not None:
        g = torch.Generator().manual_seed(seed)
        last = layer.context_ridge.net[-1]
        with torch.no_grad():
            last.weight.copy_(0.3 * torch.randn(last.weight.shape, generator=g, dtype=last.weight.dtype))
            last.bias.fill_(0.1)


def data(B=2, M=3, N=11, dim=8, kdim=None, vdim=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, M, dim, generator=g, dtype=F64), torch.randn(B, N, kdim or dim, generator=g, dtype=F64),
            torch.randn(B, N, vdim or dim, generator=g, dtype=F64))


# -- eq. 3 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,embed_depth,map_depth,out_proj,context_alpha,scale", [
    (1, 2, 2, False, False, 1.0),
    (2, 1, 1, False, False, 1.0),
    (2, 3, 2, True, True, 1.7),
    (4, 2, 0, True, False, 1.0),
    (2, 2, 3, False, True, 2.0),
])
@pytest.mark.parametrize("masked", [False, True])
def test_paper_form_equals_float64_formula_of_eq3(heads, embed_depth, map_depth, out_proj, context_alpha, scale,
                                                  masked):
    torch.manual_seed(0)
    layer = ae.nn.Intention(8, heads, alpha_init=0.6, kdim=5, vdim=3, query_scale=scale, form="paper",
                            embed_depth=embed_depth, map_depth=map_depth, embed_hidden_dim=12, out_proj=out_proj,
                            alpha_from_context=context_alpha).double()
    randomise_context_ridge(layer)
    query, key, value = data(kdim=5, vdim=3)
    mask = torch.tensor([[False] * 8 + [True] * 3, [True, False] * 5 + [False]]) if masked else None
    torch.testing.assert_close(layer(query, key, value, mask), expected_output(layer, query, key, value, mask),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("context_alpha", [False, True])
def test_linear_form_equals_float64_formula(context_alpha):
    torch.manual_seed(1)
    layer = ae.nn.Intention(8, 2, alpha_init=0.4, alpha_from_context=context_alpha).double()
    randomise_context_ridge(layer)
    query, key, value = data(seed=1)
    mask = torch.tensor([[False] * 9 + [True] * 2, [False] * 11])
    torch.testing.assert_close(layer(query, key, value, mask), expected_output(layer, query, key, value, mask),
                               rtol=1e-10, atol=1e-10)


def test_paper_sigma_intention_equals_float64_formula():
    torch.manual_seed(2)
    layer = ae.nn.Intention(8, 2, sigma=True, form="paper", map_depth=0, out_proj=True).double()
    query, key, value = data(seed=2)
    mask = torch.tensor([[False] * 9 + [True] * 2, [False] * 11])
    torch.testing.assert_close(layer(query, key, value, mask),
                               expected_output(layer, query, key, value, mask, sigma=True), rtol=1e-10, atol=1e-10)


# -- α → ∞ -------------------------------------------------------------------------------------------

FORMS = [dict(), dict(form="paper"), dict(form="paper", out_proj=True, alpha_from_context=True),
         dict(alpha_from_context=True)]


@pytest.mark.parametrize("kwargs", FORMS)
def test_large_alpha_sends_the_map_to_zero_and_the_output_to_e_w_of_zero(kwargs):
    """Unscaled queries: ``w = (G + αI)⁻¹C = O(|C|/α) → 0``, so ``h → E_Q·e_w(0)`` per head: every row of
    ``e_w(0)`` is the same vector ``c_h``, so ``h_h = (E_Q,h 1) c_hᵀ``; the linear form tends to e_w's bias."""
    torch.manual_seed(3)
    layer = ae.nn.Intention(8, 2, alpha_init=1e9, learn_alpha=False, **kwargs).double()
    randomise_context_ridge(layer)
    query, key, value = data(seed=3)
    out = layer(query, key, value)
    limit = zero_map_output(layer, query)
    assert (out - limit).abs().max() > 0  # not trivially equal: the limit is approached, not hit
    torch.testing.assert_close(out, limit, rtol=0, atol=1e-6)


def layer_and_data(kwargs, seed):
    """A float64 ``Intention(8, 2, **kwargs)`` seeded with ``seed`` (context ridge randomised) and its inputs."""
    torch.manual_seed(seed)
    layer = ae.nn.Intention(8, 2, **kwargs).double()
    randomise_context_ridge(layer)
    return (layer, *data(seed=seed))


def zero_map_output(layer, query):
    """The layer's output when its fitted map ``w`` is 0: ``E_Q·e_w(0)`` per head (the linear form: e_w's bias)."""
    if layer.form == "linear":
        return layer.e_w.bias.expand(*query.shape[:2], -1)
    eq = linear_stack(layer.e_q, query).view(2, 3, 2, 4)
    c = torch.stack([e_w_of_head(layer, h, torch.zeros(1, 4, dtype=F64))[0] for h in range(2)])  # [H, D]
    limit = (eq.sum(-1, keepdim=True) * c).reshape(2, 3, 8)
    return limit if layer.out_proj is None else linear_stack(layer.out_proj, limit)


@pytest.mark.parametrize("kwargs", FORMS)
def test_no_context_is_the_zero_map_and_equals_a_fully_padded_one(kwargs):
    # No keys: a regression on nothing, w = 0 exactly (the kernels once returned Q/α there for N = 0).
    layer, query, key, value = layer_and_data(kwargs, seed=4)
    empty = layer(query, key[:, :0], value[:, :0])
    torch.testing.assert_close(empty, zero_map_output(layer, query), rtol=0, atol=1e-12)
    padded = layer(query, key, value, torch.ones(2, key.shape[1], dtype=torch.bool))
    torch.testing.assert_close(padded, empty, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs", FORMS)
def test_large_alpha_with_queries_scaled_by_alpha_tends_to_linear_attention_of_the_embeddings(kwargs):
    """``α (G + αI)⁻¹ C → C = E_KᵀE_V`` (the paper's limit to linear attention), so with ``query_scale = α``
    the module tends to ``E_Q · e_w(E_KᵀE_V)`` (the linear form: ``e_w(E_Q E_KᵀE_V)``)."""
    torch.manual_seed(4)
    a = 1e9
    layer = ae.nn.Intention(8, 2, alpha_init=a, learn_alpha=False, query_scale=a, **kwargs).double()
    randomise_context_ridge(layer)
    query, key, value = data(seed=4)
    alpha = layer.context_alpha(key, value)  # [B, H] or [H]; a + O(1) with the context network
    out = layer(query, key, value)
    eq, ek, ev = (linear_stack(e, x).view(2, -1, 2, 4).transpose(1, 2)
                  for e, x in ((layer.e_q, query), (layer.e_k, key), (layer.e_v, value)))
    ratio = (a / alpha).reshape(-1, 2, 1, 1) if alpha.dim() == 2 else (a / alpha).view(1, 2, 1, 1)
    c = ratio * ek.transpose(-1, -2) @ ev  # [B, H, D, D]; exactly E_KᵀE_V when α = a
    if layer.form == "linear":
        limit = linear_stack(layer.e_w, (eq @ c).transpose(1, 2).reshape(2, 3, 8))
    else:
        mapped = torch.stack([torch.stack([e_w_of_head(layer, h, c[b, h]) for h in range(2)]) for b in range(2)])
        limit = (eq @ mapped).transpose(1, 2).reshape(2, 3, 8)
        limit = limit if layer.out_proj is None else linear_stack(layer.out_proj, limit)
    assert (out - limit).abs().max() > 0
    torch.testing.assert_close(out, limit, rtol=1e-6, atol=1e-6)


# -- α learned and from the context --------------------------------------------------------------

@pytest.mark.parametrize("form", ["linear", "paper"])
def test_learned_and_context_alpha_are_positive_order_free_and_get_gradients(form):
    torch.manual_seed(5)
    layer = ae.nn.Intention(8, 2, form=form, alpha_from_context=True).double()
    randomise_context_ridge(layer)
    with torch.no_grad():
        layer.context_ridge.net[-1].bias.fill_(-60.0)  # pushes softplus far down: still > 0
    query, key, value = data(seed=5)
    alpha = layer.context_alpha(key, value)
    assert alpha.shape == (2, 2) and bool((alpha > 0).all()) and bool(torch.isfinite(alpha).all())
    assert bool((layer.alpha > 0).all())
    perm = torch.randperm(key.shape[1])
    torch.testing.assert_close(layer.context_alpha(key[:, perm], value[:, perm]), alpha, rtol=1e-12, atol=0)
    torch.testing.assert_close(layer(query, key[:, perm], value[:, perm]), layer(query, key, value),
                               rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        layer.context_ridge.net[-1].bias.fill_(0.0)
    layer(query, key, value).square().sum().backward()
    assert layer.raw_alpha.grad is not None and bool(layer.raw_alpha.grad.abs().sum() > 0)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in layer.context_ridge.parameters())
    assert bool(layer.context_ridge.net[0].weight.grad.abs().sum() > 0)


@pytest.mark.parametrize("kwargs", FORMS)
def test_padding_equals_dropping_the_padded_keys_even_if_they_hold_nan(kwargs):
    layer, query, key, value = layer_and_data(kwargs, seed=6)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, 7:], mask[1, :3] = True, True
    key, value = key.clone(), value.clone()
    key[mask], value[mask] = float("nan"), float("inf")
    out = layer(query, key, value, mask)
    for b in range(2):
        keep = ~mask[b]
        torch.testing.assert_close(out[b:b + 1], layer(query[b:b + 1], key[b:b + 1, keep], value[b:b + 1, keep]),
                                   rtol=1e-10, atol=1e-10)
        if layer.context_ridge is not None:
            torch.testing.assert_close(layer.context_alpha(key, value, mask)[b:b + 1],
                                       layer.context_alpha(key[b:b + 1, keep], value[b:b + 1, keep]))


@pytest.mark.parametrize("kwargs", FORMS[1:])
def test_statistics_path_equals_forward_for_the_new_forms(kwargs):
    torch.manual_seed(7)
    layer = ae.nn.Intention(8, 2, **kwargs).double()
    randomise_context_ridge(layer)
    query, key, value = data(N=40, seed=7)
    state = layer.update(layer.condition(key[:, :15], value[:, :15]), key[:, 15:], value[:, 15:])
    torch.testing.assert_close(layer.query(query, state), layer(query, key, value), rtol=1e-10, atol=1e-10)
    state = layer.remove(state, key[:, 30:], value[:, 30:])
    torch.testing.assert_close(layer.query(query, state), layer(query, key[:, :30], value[:, :30]),
                               rtol=1e-9, atol=1e-9)


def test_gradcheck_paper_form_float64_tiny():
    torch.manual_seed(8)
    layer = ae.nn.Intention(4, 2, form="paper", out_proj=True, alpha_from_context=True, query_scale=1.3).double()
    randomise_context_ridge(layer)
    query, key, value = data(B=1, M=2, N=5, dim=4, seed=8)
    mask = torch.tensor([[False, False, True, False, False]])
    names = ["raw_alpha", "e_w_on_map.weights.0", "context_ridge.net.2.weight", "e_k.0.weight"]
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters() if n in names}
    assert sorted(params) == sorted(names)

    def fn(q, k, v, *ps):
        return torch.func.functional_call(layer, dict(zip(params, ps)), (q, k, v, mask))

    inputs = [t.clone().requires_grad_() for t in (query, key, value)] + list(params.values())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


# -- InformerLayer(norm_first) -----------------------------------------------------------------------

def layer_norm(norm, x):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("kwargs", [dict(), dict(form="paper")])
def test_informer_layer_equals_float64_formula(norm_first, kwargs):
    torch.manual_seed(9)
    layer = ae.nn.InformerLayer(8, 2, hidden_dim=12, norm_first=norm_first, **kwargs).double()
    with torch.no_grad():  # LayerNorm starts as (1, 0): make its affine part matter
        for norm in (layer.norm_attention, layer.norm_mlp):
            norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 9, 8, dtype=F64)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 6:] = True
    att = lambda h: expected_output(layer.intention, h, h, h, mask)  # noqa: E731
    if norm_first:
        y = x + att(layer_norm(layer.norm_attention, x))
        y = y + linear_stack(layer.mlp, layer_norm(layer.norm_mlp, y))
    else:  # torch.nn.TransformerEncoderLayer(norm_first=False) and the paper's appendix
        y = layer_norm(layer.norm_attention, x + att(x))
        y = layer_norm(layer.norm_mlp, y + linear_stack(layer.mlp, y))
    torch.testing.assert_close(layer(x, mask), y, rtol=1e-10, atol=1e-10)


def test_informer_stack_final_norm_follows_norm_first():
    torch.manual_seed(10)
    x = torch.randn(2, 6, 8, dtype=F64)
    post = ae.nn.Informer(2, 8, 2, norm_first=False).double()
    assert post.norm is None and not post.layers[0].norm_first
    torch.testing.assert_close(post(x), post.layers[1](post.layers[0](x)))
    pre = ae.nn.Informer(2, 8, 2).double()
    assert pre.layers[0].norm_first and pre.norm is not None
    torch.testing.assert_close(pre(x), pre.norm(pre.layers[1](pre.layers[0](x))))
    assert ae.nn.Informer(1, 8, 2, norm_first=False, final_norm=True).norm is not None


# -- today's defaults ------------------------------------------------------------------------------

def deterministic_fill(module):
    """Every parameter/buffer set from a formula, so the outputs below are independent of the RNG."""
    new = {}
    for i, (name, t) in enumerate(module.state_dict().items()):
        idx = torch.arange(t.numel(), dtype=F64)
        new[name] = (0.4 * torch.sin(0.7 * idx + 1.3 * i + 0.2)).view(t.shape).to(t.dtype)
    module.load_state_dict(new)  # strict: the parameter names are today's too


def wave(*shape, phase=0.0):
    return torch.cos(0.37 * torch.arange(math.prod(shape), dtype=F64) + phase).view(*shape)


# Recorded with the module as it was before the paper form was added.
BEFORE = {
    "Intention": ([-0.4670727704779058, 0.59995530054274, 0.7073110088256267, 0.8662272192642586], -1.3127731079572518),
    "InformerLayer": ([1.282396429521766, -0.548539088519197, 1.086424553091301, 1.2298952651725927],
                      -23.973346699567607),
    "Informer": ([0.47207375802597684, -0.46557090282826463, -0.7297840447920205, -0.7956114954715588],
                 -7.477423547374176),
}
SEEDED_PARAMETER_SUMS = [1.082649707794, -1.756029964658, 0.304821271449, 1.301437903196, -0.332413200289,
                         -0.858981727157, -0.454938372597, -1.527027353877, -0.809111729264]


def test_default_construction_and_numerics_are_unchanged():
    mask = torch.tensor([[False] * 5 + [True, True], [False] * 7])
    layer = ae.nn.Intention(6, 2).double()
    assert [n for n, _ in layer.named_parameters()] == ["raw_alpha", "e_q.weight", "e_q.bias", "e_k.weight",
                                                        "e_k.bias", "e_v.weight", "e_v.bias", "e_w.weight", "e_w.bias"]
    deterministic_fill(layer)
    out = layer(wave(2, 3, 6), wave(2, 7, 6, phase=1.0), wave(2, 7, 6, phase=2.0), mask)
    cases = [("Intention", out, [0, 5, 17, 35])]
    for name, module in (("InformerLayer", ae.nn.InformerLayer(6, 2)), ("Informer", ae.nn.Informer(2, 6, 2))):
        module = module.double()
        deterministic_fill(module)
        cases.append((name, module(wave(2, 7, 6, phase=0.5), mask), [0, 5, 17, 83]))
    for name, out, idx in cases:
        values, total = BEFORE[name]
        torch.testing.assert_close(out.flatten()[idx].tolist(), values, rtol=1e-12, atol=1e-12, msg=name)
        assert abs(out.sum().item() - total) < 1e-11, name
    torch.manual_seed(0)  # the same random initialisation (same parameters drawn in the same order)
    seeded = ae.nn.Intention(6, 2)
    sums = [round(float(p.detach().double().sum()), 12) for p in seeded.parameters()]
    assert sums == pytest.approx(SEEDED_PARAMETER_SUMS, abs=1e-9)


# -- errors and examples -----------------------------------------------------------------------------

def test_bad_arguments_and_shapes_raise_value_errors_naming_the_module():
    with pytest.raises(ValueError, match="unknown form 'transformer'"):
        ae.nn.Intention(8, 2, form="transformer")
    with pytest.raises(ValueError, match="embed_depth, out_proj belong to form='paper'"):
        ae.nn.Intention(8, 2, embed_depth=2, out_proj=True)
    with pytest.raises(ValueError, match="σIntention forms no map"):
        ae.nn.Intention(8, 2, sigma=True, form="paper")
    with pytest.raises(ValueError, match="embed_depth >= 1, map_depth >= 0"):
        ae.nn.Intention(8, 2, form="paper", embed_depth=0)
    layer = ae.nn.Intention(8, 2, kdim=5, form="paper")
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 7, 5), torch.randn(2, 7, 8)
    with pytest.raises(ValueError, match=r"Intention.forward: need key \[B, N, 5\].*key \(2, 7, 8\)"):
        layer(q, v, v)
    with pytest.raises(ValueError, match=r"Intention.forward: need key.*value \(2, 6, 8\)"):
        layer(q, k, v[:, :6])
    with pytest.raises(ValueError, match=r"forward: query must be \[B, M, 8\] with the keys' B=2, got \(1, 3, 8\)"):
        layer(q[:1], k, v)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \[B, N\] = \[2, 7\], got torch.bool \(2, 6\)"):
        layer(q, k, v, torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        layer(q, k, v, torch.zeros(2, 7))
    state = layer.condition(k, v)
    with pytest.raises(ValueError, match=r"Intention.query: query must be \[B, M, 8\]"):
        layer.query(torch.randn(3, 2, 8), state)
    with pytest.raises(ValueError, match=r"InformerLayer: x must be \[B, L, 8\], got \(2, 3, 4\)"):
        ae.nn.InformerLayer(8, 2, norm_first=False)(torch.randn(2, 3, 4))


def test_examples_of_the_new_modules_run():
    for module in (attn_ext.nn.informer, attn_ext.nn.intention_parts):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__
