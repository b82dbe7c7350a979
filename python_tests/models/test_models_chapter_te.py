"""ConvNP and TETNP, the chapter's translation-equivariant baselines: shapes, translation equivariance,
target independence, the TE attention and set convolutions against float64 formulas, training."""
import doctest
import math
import time

import pytest
import torch

from attn_ext.data import GPSampler
from attn_ext.models import ConvNP, TETNP, build_model, convnp, set_conv, tetnp
from attn_ext.models.set_conv import grid_to_points, points_to_grid
from attn_ext.nn import te_attention
from attn_ext.nn.te_attention import TEMultiheadAttention

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)
# A coarse grid keeps the 2-D ConvNP cheap on CPU; the maths does not depend on the density.
OPTIONS = {"convnp": dict(points_per_unit=16), "tetnp": {}}


def _model(name, dim_x, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return build_model(name, dim_x=dim_x, **SMALL, **OPTIONS[name]).to(dtype)


def _points(dim_x, n_c=9, n_t=6, batch=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: (4 * torch.rand(*s, generator=g, dtype=dtype) - 2)  # noqa: E731 - x ~ U[-2, 2)
    return rand(batch, n_c, dim_x), torch.randn(batch, n_c, 1, generator=g, dtype=dtype), rand(batch, n_t, dim_x)


@pytest.mark.parametrize("name", ["convnp", "tetnp"])
@pytest.mark.parametrize("dim_x", [1, 2])
def test_shapes_loss_and_gradients(name, dim_x):
    model = _model(name, dim_x)
    xc, yc, xt = _points(dim_x)
    yt = torch.randn(3, 6, 1)
    pred = model.predict(xc, yc, xt)
    assert isinstance(pred, torch.distributions.Normal)
    assert pred.mean.shape == pred.scale.shape == (3, 6, 1) and (pred.scale > 0).all()
    batch = type(GPSampler().sample(1))(xc, yc, xt, yt)
    assert model.log_likelihood(batch).shape == (3,)
    loss = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    named = dict(model.named_parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in named.values())
    # The parts that carry the inputs must learn: the set-conv length scales, the logit MLP.
    carriers = ["log_length_encoder", "log_length_decoder"] if name == "convnp" else ["layers.0.attention.kernel.0.weight"]
    assert all(named[k].grad.abs().sum() > 0 for k in carriers)


@pytest.mark.parametrize("name", ["convnp", "tetnp"])
@pytest.mark.parametrize("dim_x", [1, 2])
def test_translation_equivariance_float64(name, dim_x):
    # Any shift: ConvNP lays each task's grid from its own smallest input, so the grid moves with the
    # data and only the rounding of x − grid (~1e-15 relative) differs; no grid-multiple shifts needed.
    model = _model(name, dim_x, torch.float64).eval()
    xc, yc, xt = _points(dim_x, dtype=torch.float64)
    shift = 20 * torch.rand(dim_x, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 10
    with torch.no_grad():
        base, moved = model.predict(xc, yc, xt), model.predict(xc + shift, yc, xt + shift)
        # A control that must differ: moving the targets alone changes the predictions.
        control = model.predict(xc, yc, xt + 0.3)
    torch.testing.assert_close(moved.mean, base.mean, rtol=0, atol=1e-9)
    torch.testing.assert_close(moved.scale, base.scale, rtol=0, atol=1e-9)
    assert (control.mean - base.mean).abs().max() > 1e-4


@pytest.mark.parametrize("dim_x", [1, 2])
def test_tetnp_targets_are_independent(dim_x):
    model = _model("tetnp", dim_x, torch.float64).eval()
    xc, yc, xt = _points(dim_x, dtype=torch.float64)
    perturbed = xt.clone()
    perturbed[:, 0] += 0.7
    with torch.no_grad():
        base, other = model.predict(xc, yc, xt).mean, model.predict(xc, yc, perturbed).mean
    torch.testing.assert_close(other[:, 1:], base[:, 1:], rtol=0, atol=1e-12)
    assert (other[:, 0] - base[:, 0]).abs().max() > 1e-4
    # And a target's prediction does not depend on how many other targets are asked for.
    with torch.no_grad():
        alone = model.predict(xc, yc, xt[:, 2:3]).mean
    torch.testing.assert_close(alone, base[:, 2:3], rtol=0, atol=1e-12)


def _te_attention_direct(attn, zq, zk, xq, xk):
    """Float64 loops over batches, queries, keys and heads of ``ρ(s_ij, x_i − x_j)`` and ``Σ_j softmax · v_j``."""
    p = {k: v.double() for k, v in attn.state_dict().items()}
    h, d = attn.num_heads, attn.head_dim
    relu = lambda t: torch.clamp(t, min=0)  # noqa: E731
    out = torch.zeros(zq.shape[0], zq.shape[1], attn.dim, dtype=torch.float64)
    for b in range(zq.shape[0]):
        q, k, v = zq[b] @ p["to_q.weight"].T, zk[b] @ p["to_k.weight"].T, zk[b] @ p["to_v.weight"].T
        for i in range(zq.shape[1]):
            logits = torch.zeros(zk.shape[1], h, dtype=torch.float64)
            for j in range(zk.shape[1]):
                dots = torch.stack([q[i, c * d:(c + 1) * d] @ k[j, c * d:(c + 1) * d] / math.sqrt(d) for c in range(h)])
                hidden = relu(p["kernel.0.weight"] @ torch.cat([dots, xq[b, i] - xk[b, j]]) + p["kernel.0.bias"])
                logits[j] = p["kernel.2.weight"] @ hidden + p["kernel.2.bias"]
            w = torch.exp(logits - logits.max(0).values) / torch.exp(logits - logits.max(0).values).sum(0)
            heads = torch.cat([(w[:, c:c + 1] * v[:, c * d:(c + 1) * d]).sum(0) for c in range(h)])
            out[b, i] = p["to_out.weight"] @ heads + p["to_out.bias"]
    return out


@pytest.mark.parametrize("dim_x", [1, 2])
def test_te_attention_matches_float64_formula(dim_x):
    torch.manual_seed(0)
    attn = TEMultiheadAttention(dim=8, num_heads=2, dim_x=dim_x, kernel_hidden=5)
    g = torch.Generator().manual_seed(2)
    zq, zk = torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    xq, xk = torch.randn(2, 4, dim_x, generator=g), torch.randn(2, 6, dim_x, generator=g)
    expected = _te_attention_direct(attn, *(t.double() for t in (zq, zk, xq, xk)))
    torch.testing.assert_close(attn(zq, zk, xq, xk).double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(attn.double()(*(t.double() for t in (zq, zk, xq, xk))), expected, rtol=0, atol=1e-12)


def test_set_convolutions_match_dense_float64_formula():
    g = torch.Generator().manual_seed(3)
    f64 = torch.float64
    x, v = torch.rand(2, 7, 2, generator=g, dtype=f64), torch.randn(2, 7, 3, generator=g, dtype=f64)
    axes = [torch.linspace(-0.2, 1.2, 11, dtype=f64).repeat(2, 1) + 0.05 * b for b in range(2)]
    length = torch.tensor(0.3, dtype=f64)
    grid = torch.stack([torch.stack(torch.meshgrid(axes[0][b], axes[1][b], indexing="ij"), -1) for b in range(2)])
    sq = ((x[:, :, None, None, :] - grid[:, None]) ** 2).sum(-1)                          # [B, N, G1, G2]
    dense_w = torch.exp(-sq / (2 * length ** 2))
    expected_grid = torch.einsum("bnij,bnc->bcij", dense_w, v)
    torch.testing.assert_close(points_to_grid(x, v, axes, length), expected_grid, rtol=0, atol=1e-12)
    h = torch.randn(2, 4, 11, 11, generator=g, dtype=f64)
    torch.testing.assert_close(grid_to_points(h, axes, x, length), torch.einsum("bnij,bcij->bnc", dense_w, h),
                               rtol=0, atol=1e-12)
    one_d = points_to_grid(x[..., :1], v, axes[:1], length)
    w1 = torch.exp(-((x[..., :1] - axes[0][:, None, :]) ** 2) / (2 * length ** 2))         # [B, N, G1]
    torch.testing.assert_close(one_d, torch.einsum("bng,bnc->bcg", w1, v), rtol=0, atol=1e-12)


def test_convnp_grid_follows_each_task_and_covers_the_data():
    model = _model("convnp", 2)
    xc, _, xt = _points(2)
    xc[1] += 5.0
    axes = model.grid_axes(xc, xt)
    step = 1 / model.points_per_unit
    low = torch.cat([xc, xt], 1).amin(1) - model.margin
    for d, axis in enumerate(axes):
        torch.testing.assert_close(axis[:, 0], low[:, d])
        torch.testing.assert_close(axis[:, 1:] - axis[:, :-1], torch.full_like(axis[:, 1:], step))
        high = torch.cat([xc, xt], 1)[..., d].amax(1) + model.margin
        assert (axis[:, -1] >= high - 1e-5).all()


@pytest.mark.parametrize("name", ["convnp", "tetnp"])
def test_loss_decreases_in_200_steps(name):
    torch.set_num_threads(1)
    model = _model(name, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler, g = GPSampler(), torch.Generator().manual_seed(0)
    losses, start = [], time.perf_counter()
    for _ in range(200):
        loss = model(sampler.sample(16, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < first - 0.1, (first, last)
    assert time.perf_counter() - start < 60  # ~25 s budget per model, with headroom for a shared CPU


def test_bad_shapes_and_sizes_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="ConvNP: dim_x must be 1 or 2.*dim_x=3"):
        ConvNP(dim_x=3, **SMALL)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        ConvNP(kernel_size=4, **SMALL)
    with pytest.raises(ValueError, match="TETNP: num_heads=3 must divide d_model=16"):
        TETNP(**{**SMALL, "num_heads": 3})
    for model in (_model("convnp", 2), _model("tetnp", 2)):
        xc, yc, xt = _points(2)
        with pytest.raises(ValueError, match=r"xt must be \[B, N, 2\], got \(3, 6, 1\)"):
            model.predict(xc, yc, xt[..., :1])
        with pytest.raises(ValueError, match="batch sizes differ"):
            model.predict(xc, yc, xt[:2])
    with pytest.raises(ValueError, match=r"grid of \[.*points_per_unit=16.0"):
        _model("convnp", 2).predict(torch.tensor([[[0.0, 0.0]]]), torch.zeros(1, 1, 1), torch.tensor([[[1e4, 1e4]]]))
    with pytest.raises(ValueError, match="must be finite"):
        _model("convnp", 1).predict(torch.tensor([[[math.nan]]]), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    attn = TEMultiheadAttention(8, 2, dim_x=2)
    with pytest.raises(ValueError, match=r"xk \(1, 5, 1\)"):
        attn(torch.randn(1, 3, 8), torch.randn(1, 5, 8), torch.randn(1, 3, 2), torch.randn(1, 5, 1))
    with pytest.raises(ValueError, match=r"zk \(1, 4, 8\).*xk \(1, 5, 2\)"):
        attn(torch.randn(1, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 3, 2), torch.randn(1, 5, 2))
    with pytest.raises(TypeError, match="no \\[x, y\\] embedding"):
        _model("tetnp", 1).embed_pairs(torch.zeros(1, 1, 1), None)


def test_options_rebuild_the_same_model():
    for name, model in (("convnp", ConvNP(kernel_size=7, margin=0.2, **SMALL)), ("tetnp", TETNP(kernel_hidden=5, **SMALL))):
        again = build_model(name, **SMALL, **model.options())
        assert again.options() == model.options()
        assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert ConvNP(**SMALL).options() == {"points_per_unit": 64.0, "margin": 0.1, "kernel_size": 5}
    assert ConvNP(dim_x=2, **SMALL).options()["kernel_size"] == 3


@pytest.mark.parametrize("module", [convnp, set_conv, tetnp, te_attention])
def test_docstring_examples(module):
    assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
