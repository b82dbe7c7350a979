"""Tree Cross Attention's baselines as NPs (Perceiver IO, Transformer + Cross Attention) and ReTreever's
tree-design / loss-weight options."""
import math

import pytest
import torch

from attn_ext import tree_num_selected
from attn_ext.data import GPSampler
from attn_ext.models import PerceiverIONP, ReTreever, TransformerCA, build_model
from attn_ext.models.perceiver_io import equal_token_budget

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)
BASELINES = ["perceiver_io", "transformer_ca"]


def _batch(dim_x=1, size=3, seed=0):
    return GPSampler(dim_x=dim_x).sample(size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim_x", [1, 2])
@pytest.mark.parametrize("name", BASELINES)
def test_shapes_and_finite_loss(name, dim_x):
    torch.manual_seed(0)
    model = build_model(name, **SMALL, dim_x=dim_x)
    batch = _batch(dim_x)
    loss = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    pred = model.eval().predict(batch.xc, batch.yc, batch.xt)
    assert pred.mean.shape == batch.yt.shape == pred.scale.shape and (pred.scale > 0).all()
    # forward is the mean NLL per target: compare with the float64 formula from the prediction.
    mean, scale = pred.mean.double(), pred.scale.double()
    nll = (0.5 * ((batch.yt.double() - mean) / scale) ** 2 + scale.log() + 0.5 * math.log(2 * math.pi))
    torch.testing.assert_close(model(batch).double(), nll.sum(-1).mean(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", BASELINES)
def test_a_target_does_not_depend_on_the_other_targets(name):
    torch.manual_seed(0)
    model = build_model(name, **SMALL).eval()
    batch = _batch(size=2)
    full = model.predict(batch.xc, batch.yc, batch.xt)
    # Predict the first three targets alone and with the others reversed and perturbed.
    alone = model.predict(batch.xc, batch.yc, batch.xt[:, :3])
    torch.testing.assert_close(alone.mean, full.mean[:, :3], rtol=1e-5, atol=1e-5)
    other = torch.cat([batch.xt[:, :3], batch.xt[:, 3:].flip(1) + 0.37], dim=1)
    torch.testing.assert_close(model.predict(batch.xc, batch.yc, other).scale[:, :3], full.scale[:, :3],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", BASELINES)
def test_the_prediction_depends_on_the_context(name):
    torch.manual_seed(0)
    model = build_model(name, **SMALL).eval()
    batch = _batch(size=2)
    a = model.predict(batch.xc, batch.yc, batch.xt).mean
    b = model.predict(batch.xc, batch.yc + 1.0, batch.xt).mean
    assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("name", BASELINES)
def test_200_steps_decrease_the_loss(name):
    torch.manual_seed(0)
    model = build_model(name, **SMALL)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler, gen = GPSampler(), torch.Generator().manual_seed(0)
    held_out = [sampler.sample(16, generator=torch.Generator().manual_seed(100 + i)) for i in range(4)]

    def score():
        with torch.no_grad():
            return sum(model(b).item() for b in held_out) / len(held_out)

    before = score()
    for _ in range(200):
        loss = model(sampler.sample(16, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = score()
    assert after < before - 0.1, (before, after)


def test_perceiver_budget_is_its_latents():
    assert PerceiverIONP().tokens_per_target == 7 == equal_token_budget(46) == tree_num_selected(46, 2)
    model = PerceiverIONP(**{**SMALL, "num_latents": 5})
    assert model.tokens_per_target == 5 and model.latents.shape == (5, 16)
    assert model.encode(*_batch()[:2]).shape[1] == 5
    with pytest.raises(ValueError, match="PerceiverIONP: num_latents"):
        PerceiverIONP(num_latents=0)


@pytest.mark.parametrize("name", BASELINES)
def test_bad_shapes_raise_naming_the_class(name):
    model = build_model(name, **SMALL)
    batch = _batch()
    with pytest.raises(ValueError, match=type(model).__name__ + r": xt must be \[B, N, 1\]"):
        model.predict(batch.xc, batch.yc, batch.xt.squeeze(-1))
    with pytest.raises(ValueError, match=type(model).__name__):
        model.predict(batch.xc, batch.yc[:, :-1], batch.xt)


def test_transformer_ca_reads_every_context_token():
    torch.manual_seed(0)
    model = TransformerCA(**SMALL).eval()
    batch = _batch(size=1)
    base = model.predict(batch.xc, batch.yc, batch.xt).mean
    yc = batch.yc.clone()
    yc[:, -1] += 3.0  # the last context point alone changes every target's prediction
    assert ((model.predict(batch.xc, yc, batch.xt).mean - base).abs() > 0).all()


# ---- ReTreever's ablation options ------------------------------------------------------------------


def test_retreever_tree_designs_change_the_leaf_order():
    torch.manual_seed(0)
    batch = _batch(dim_x=2, size=2)
    orders = {}
    for design in ("kd", "random", "kd-x0", "kd-x1", "kd-rp"):
        torch.manual_seed(0)
        model = ReTreever(**SMALL, dim_x=2, tree_design=design)
        orders[design] = model.build(batch.xc, batch.yc).tree.leaf_token
    expected_x0 = batch.xc[..., 0].argsort(dim=1, stable=True)
    expected_x1 = batch.xc[..., 1].argsort(dim=1, stable=True)
    n = batch.xc.shape[1]
    assert torch.equal(orders["kd-x0"][:, :n], expected_x0) and torch.equal(orders["kd-x1"][:, :n], expected_x1)
    assert not torch.equal(orders["random"], orders["kd-x0"]) and not torch.equal(orders["random"], orders["kd-x1"])
    assert not torch.equal(orders["kd-x0"], orders["kd-x1"])


def test_retreever_defaults_are_unchanged_by_the_options():
    torch.manual_seed(0)
    default = ReTreever(**SMALL)
    torch.manual_seed(0)
    ablated = ReTreever(**SMALL, tree_design="kd-rp", lambda_rl=0.1)
    assert default.options() == {"aggregator": "transformer", "backprop_through_tree": False}
    assert ablated.options() == {**default.options(), "tree_design": "kd-rp", "lambda_rl": 0.1}
    assert "projection" not in default.state_dict() and ablated.projection.shape == (1,)
    ablated_state = ablated.state_dict()
    assert set(ablated_state) - set(default.state_dict()) == {"projection"}
    for k, a in default.state_dict().items():
        assert torch.equal(a, ablated_state[k]), k  # same weights: the projection is drawn after every layer


def test_retreever_lambda_rl_weights_the_rl_term():
    batch = _batch()
    losses = {}
    for lam in (0.0, 1.0, 10.0):
        torch.manual_seed(0)
        model = ReTreever(**SMALL, lambda_rl=lam)
        torch.manual_seed(1)  # same sampled descent
        losses[lam] = model(batch).item()
    rl = losses[1.0] - losses[0.0]
    assert rl != 0 and losses[10.0] == pytest.approx(losses[0.0] + 10 * rl, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tree_design="sorted"), "tree_design must be one of"),
    (dict(tree_design="kd-x1"), "tree_design 'kd-x1' needs dim_x >= 2"),
    (dict(lambda_rl=-1.0), "lambda_rl must be a finite number"),
    (dict(lambda_ca=float("nan")), "lambda_ca must be a finite number"),
])
def test_retreever_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match="ReTreever: " + match):
        ReTreever(**SMALL, **kwargs)
