"""Every reference NP model: shapes, finite loss and gradients, clear errors on bad input."""
import doctest

import pytest
import torch

import attn_ext.models as models_pkg
from attn_ext.data import GPSampler
from attn_ext.models import MODELS, build_model
import attn_ext.data as data_pkg
from attn_ext.data import gp
from attn_ext.models import base, cmanp, cmanp_and, intention_np, lbanp, linear_attention, linear_tnp, retreever, tnpd

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)


def _batch(seed=0, size=3):
    return GPSampler().sample(size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_finite_and_backward(name):
    torch.manual_seed(0)
    model = build_model(name, **SMALL)
    batch = _batch()
    loss = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(g is None or torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["lbanp", "cmanp", "cmanp_and"])
def test_latents_start_at_unit_scale(name):
    # The official models draw their latents from N(0, 1); at std 0.02 they collapse to a low rank.
    torch.manual_seed(0)
    model = build_model(name)
    latents = {n: p for n, p in model.named_parameters() if n.split(".")[-1] == "latents"}
    assert latents and len(latents) == (1 if name == "lbanp" else 1 + model.config.num_layers)
    for n, p in latents.items():
        assert 0.9 < p.std().item() < 1.1, f"{n}: std {p.std().item():.3f}"
        assert torch.linalg.matrix_rank(p.detach()).item() == min(p.shape), n


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predict_and_log_likelihood_shapes(name):
    model = build_model(name, **SMALL).eval()
    batch = _batch(1, size=2)
    pred = model.predict(batch.xc, batch.yc, batch.xt)
    if isinstance(pred, torch.distributions.MultivariateNormal):  # Not-Diagonal: a joint over all targets
        assert pred.loc.shape == (2, batch.yt[0].numel())
        pred = model.marginals(batch.xc, batch.yc, batch.xt)
    assert isinstance(pred, torch.distributions.Normal)
    assert pred.mean.shape == batch.yt.shape and (pred.scale > 0).all()
    ll = model.log_likelihood(batch)
    assert ll.shape == (2,) and torch.isfinite(ll).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bad_shapes_raise_value_error_naming_them(name):
    model = build_model(name, **SMALL)
    xc, yc, xt = torch.randn(2, 5, 1), torch.randn(2, 5, 1), torch.randn(2, 3, 1)
    with pytest.raises(ValueError, match=r"\(2, 5\)"):
        model.predict(xc[..., 0], yc, xt)
    with pytest.raises(ValueError, match=r"\[B, N, 1\]"):
        model.predict(xc, torch.randn(2, 5, 2), xt)
    with pytest.raises(ValueError, match="same number of points"):
        model.predict(xc, yc[:, :4], xt)
    with pytest.raises(ValueError, match="batch sizes differ"):
        model.predict(xc, yc, xt[:1])


# a state, a tree or pseudo-token locations of no point
NEEDS_CONTEXT = {"cmanp": "CMANP", "cmanp_and": "CMANP", "retreever": "ReTreever", "pt_tetnp": "PTTETNP"}
NEEDS_TARGETS = {"tnp_nd": "TNPND", "lbanp_nd": "LBANPND", "cmanp_and": "CMANPAND"}  # a joint over no target


@pytest.mark.parametrize("name", sorted(MODELS))
def test_empty_context_or_targets_answer_or_raise_naming_the_model(name):
    # No context: the model's prediction from nothing (finite, one per target), or a ValueError that names the
    # model, never NaN or an op's error from deep inside. No targets: an empty prediction, or the same.
    model = build_model(name, **SMALL).eval()
    x, y = torch.randn(2, 5, 1), torch.randn(2, 5, 1)
    for xc, yc, xt, needs in ((x[:, :0], y[:, :0], x, NEEDS_CONTEXT), (x, y, x[:, :0], NEEDS_TARGETS)):
        if name in needs:
            with pytest.raises(ValueError, match=rf"^{needs[name]}: .*at least one"):
                model.predict(xc, yc, xt)
            continue
        with torch.no_grad():
            pred = model.predict(xc, yc, xt)
            if isinstance(pred, torch.distributions.MultivariateNormal):   # Not-Diagonal: read its marginals
                assert torch.isfinite(pred.scale_tril).all()
                pred = model.marginals(xc, yc, xt)
        assert pred.mean.shape == (2, xt.shape[1], 1) and torch.isfinite(pred.mean).all()
        assert torch.isfinite(pred.stddev).all() and (pred.stddev > 0).all()


@pytest.mark.parametrize("name, blocks_per_layer", [("lbanp", 3), ("cmanp", 5), ("cmanp_and", 5)])
def test_perceiver_blocks_train_and_embed_targets_from_x_only(name, blocks_per_layer):
    from attn_ext.nn import PerceiverBlock, PreNormBlock

    torch.manual_seed(0)
    model = build_model(name, block="perceiver", **SMALL)
    blocks = [m for m in model.modules() if isinstance(m, (PerceiverBlock, PreNormBlock))]
    assert len(blocks) == blocks_per_layer * SMALL["num_layers"]
    assert all(isinstance(b, PerceiverBlock) for b in blocks)
    assert model.options()["block"] == "perceiver"
    assert model.query_embedder[0].in_features == 1  # x only, as the official code
    batch = _batch()
    loss = model(batch)
    loss.backward()
    assert torch.isfinite(loss) and model.query_embedder[0].weight.grad.abs().sum() > 0
    default = build_model(name, **SMALL)
    assert default.options()["block"] == "prenorm" and default.query_embedder is None
    assert not any(isinstance(m, PerceiverBlock) for m in default.modules())
    with pytest.raises(ValueError, match="unknown block 'post'; choose one of prenorm, perceiver, official"):
        build_model(name, block="post", **SMALL)


@pytest.mark.parametrize("name", ["lbanp", "cmanp", "cmanp_and"])
def test_official_blocks_start_every_layer_from_the_same_weights(name):
    # The official code's _get_clones: each stack's layers are deep copies of one at initialisation
    # (CMABs with their own latents L_B), separate parameters that then train apart.
    from attn_ext.nn import OfficialPerceiverBlock

    torch.manual_seed(0)
    model = build_model(name, block="official", **SMALL)
    assert model.options()["block"] == "official" and model.query_embedder[0].in_features == 1
    stacks = [model.decoder.blocks] + ([model.cross, model.self_attention] if name == "lbanp" else [model.blocks])
    for stack in stacks:
        first, *rest = [dict(layer.named_parameters()) for layer in stack]
        assert rest
        for other in rest:
            assert first.keys() == other.keys()
            for key, value in first.items():
                assert torch.equal(value, other[key]) and value.data_ptr() != other[key].data_ptr(), key
    assert sum(isinstance(m, OfficialPerceiverBlock) for m in model.modules()) > 0
    loss = model(_batch())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    last = stacks[0]
    assert not torch.equal(last[0].ff[0].weight, last[-1].ff[0].weight)  # trained apart
    independent = build_model(name, block="perceiver", **SMALL)
    blocks = independent.decoder.blocks
    assert not torch.equal(blocks[0].ff[0].weight, blocks[1].ff[0].weight)


def test_defaults_follow_spec():
    cfg = build_model("tnpd").config
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.ff_dim, cfg.emb_depth, cfg.num_latents) == (64, 6, 4, 128, 4, 128)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("tnp-a")


def test_no_model_uses_torch_multihead_attention():
    models = {name: build_model(name, **SMALL) for name in MODELS}
    models["retreever, transformer aggregator"] = build_model("retreever", aggregator="transformer", **SMALL)
    for name in ("lbanp", "cmanp", "cmanp_and"):
        models[f"{name}, perceiver blocks"] = build_model(name, block="perceiver", **SMALL)
        models[f"{name}, official blocks"] = build_model(name, block="official", **SMALL)
    for name, model in models.items():
        assert not any(isinstance(m, (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer))
                       for m in model.modules()), name


@pytest.mark.parametrize("module", [models_pkg, base, cmanp, cmanp_and, intention_np, lbanp, linear_attention,
                                    linear_tnp, retreever, tnpd, data_pkg, gp])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
