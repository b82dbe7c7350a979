"""The Not-Diagonal models (TNP-ND, LBANP-ND) and CMANP-AND's Cholesky covariance: shapes, positive
definite covariances, joint log-likelihoods against float64 formulas, clear errors, and training."""
import doctest
import math

import pytest
import torch

from attn_ext.data import GPSampler
from attn_ext.models import CMANPAND, build_model, cmanp_and, lbanp_nd, not_diagonal, tnp_nd
from attn_ext.models.not_diagonal import MIN_DIAG, NotDiagonalHead, cholesky_from_projections

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)
ND_MODELS = ["tnp_nd", "lbanp_nd"]
F64 = dict(atol=1e-10, rtol=1e-9)


def _points(batch, num_context, num_target, dim_x, dim_y, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, num_context, dim_x, generator=g, dtype=dtype),
            torch.randn(batch, num_context, dim_y, generator=g, dtype=dtype),
            torch.randn(batch, num_target, dim_x, generator=g, dtype=dtype),
            torch.randn(batch, num_target, dim_y, generator=g, dtype=dtype))


def _gaussian_log_density(y, loc, cov):
    """``log N(y | loc, cov)`` by the textbook formula in float64 (solve and log-determinant, no Cholesky)."""
    r = (y - loc).unsqueeze(-1)
    quad = (r.transpose(-1, -2) @ torch.linalg.solve(cov, r)).squeeze(-1).squeeze(-1)
    return -0.5 * (quad + torch.linalg.slogdet(cov).logabsdet + loc.shape[-1] * math.log(2 * math.pi))


def _assert_positive_definite(scale_tril):
    L = scale_tril.double()
    assert torch.equal(L, L.tril()), "the factor must be lower triangular"
    assert (L.diagonal(dim1=-2, dim2=-1) >= MIN_DIAG * (1 - 1e-6)).all()
    cov = L @ L.transpose(-1, -2)
    torch.linalg.cholesky(cov)  # raises unless positive definite
    assert (torch.linalg.eigvalsh(cov) > 0).all()


@pytest.mark.parametrize("name", ND_MODELS)
@pytest.mark.parametrize("dim_x, dim_y, num_target", [(1, 1, 7), (2, 1, 5), (1, 2, 4), (2, 2, 1), (1, 1, 1)])
def test_joint_shapes_and_positive_definite_covariance(name, dim_x, dim_y, num_target):
    torch.manual_seed(0)
    model = build_model(name, dim_x=dim_x, dim_y=dim_y, **SMALL).eval()
    xc, yc, xt, yt = _points(3, 6, num_target, dim_x, dim_y)
    joint = model.predict(xc, yc, xt)
    n = num_target * dim_y
    assert isinstance(joint, torch.distributions.MultivariateNormal)
    assert joint.loc.shape == (3, n) and joint.scale_tril.shape == (3, n, n)
    _assert_positive_definite(joint.scale_tril)
    marginals = model.marginals(xc, yc, xt)
    assert marginals.mean.shape == marginals.scale.shape == yt.shape
    # The marginal scale is the square root of the joint covariance's diagonal, target-major as yt.flatten(1).
    cov = joint.covariance_matrix
    assert torch.allclose(marginals.scale.flatten(1) ** 2, cov.diagonal(dim1=-2, dim2=-1), rtol=1e-5)
    assert torch.equal(marginals.mean.flatten(1), joint.loc)
    sample = model.sample(xc, yc, xt, generator=torch.Generator().manual_seed(1))
    assert sample.shape == yt.shape and torch.isfinite(sample).all()


@pytest.mark.parametrize("name", ND_MODELS)
def test_loss_and_gradients_are_finite_and_reach_the_covariance_head(name):
    torch.manual_seed(0)
    model = build_model(name, **SMALL)
    batch = GPSampler().sample(4, generator=torch.Generator().manual_seed(0))
    loss = model(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for part in (model.head.mean_net, model.head.std_encoder, model.head.projector, model.embedder):
        grads = [p.grad for p in part.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ND_MODELS)
@pytest.mark.parametrize("dim_y, num_target", [(1, 6), (2, 3), (2, 1)])
def test_log_likelihood_is_the_joint_density_per_target_in_float64(name, dim_y, num_target):
    torch.manual_seed(0)
    model = build_model(name, dim_y=dim_y, **SMALL).double().eval()
    xc, yc, xt, yt = _points(3, 5, num_target, 1, dim_y, dtype=torch.float64)
    batch = GPSampler().sample(1)._replace(xc=xc, yc=yc, xt=xt, yt=yt)
    joint = model.predict(xc, yc, xt)
    cov = joint.scale_tril @ joint.scale_tril.transpose(-1, -2)
    expected = _gaussian_log_density(yt.flatten(1), joint.loc, cov) / num_target
    assert torch.allclose(model.log_likelihood(batch), expected, **F64)
    assert torch.allclose(model(batch), -expected.mean(), **F64)
    # Joint, not a product of marginals: the two differ once the covariance has off-diagonal entries.
    if num_target * dim_y > 1:
        marginal = model.marginals(xc, yc, xt).log_prob(yt).sum((-1, -2)) / num_target
        assert not torch.allclose(marginal, expected, atol=1e-6)


def test_cholesky_construction_matches_its_formula_and_stays_definite_at_zero():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    L = cholesky_from_projections(z)
    for i in range(5):
        for j in range(5):
            want = (z[:, i] * z[:, j]).sum(-1) if j < i else (MIN_DIAG + z[:, i].pow(2).sum(-1) if j == i else 0)
            assert torch.allclose(L[:, i, j], torch.as_tensor(want, dtype=torch.float64).expand(2), **F64)
    # z = 0 (where the official tril(Z Zᵀ) would be singular) still gives a valid factor.
    assert torch.equal(cholesky_from_projections(torch.zeros(1, 4, 3)), MIN_DIAG * torch.eye(4).unsqueeze(0))


def test_head_reads_z_per_target_and_y_dimension_in_yt_flatten_order():
    torch.manual_seed(0)
    head = NotDiagonalHead(d_model=16, ff_dim=32, num_heads=2, dim_y=2, prj_dim=3).double()
    h = torch.randn(2, 4, 16, dtype=torch.float64)
    z = head.projections(h)
    assert z.shape == (2, 8, 3)
    # Output (t, d) sits at row t·dim_y + d and its z is the d-th slice of target t's projector output.
    per_target = head.projector(head.std_norm(head.std_encoder[1](head.std_encoder[0](h))))
    assert torch.allclose(z[:, 2 * 3 + 1], per_target[:, 3, 3:6], **F64)
    joint = head(h)
    assert torch.allclose(joint.loc.view(2, 4, 2), head.mean_net(h), **F64)
    assert torch.allclose(joint.scale_tril, cholesky_from_projections(z), **F64)


@pytest.mark.parametrize("name", ND_MODELS)
def test_bad_input_raises_value_error_naming_it(name):
    model = build_model(name, dim_y=2, **SMALL)
    xc, yc, xt, yt = _points(2, 5, 3, 1, 2)
    with pytest.raises(ValueError, match=r"yc must be \[B, N, 2\], got \(2, 5, 1\)"):
        model.predict(xc, yc[..., :1], xt)
    with pytest.raises(ValueError, match=r"xt must be \[B, N, 1\], got \(2, 3\)"):
        model.predict(xc, yc, xt[..., 0])
    with pytest.raises(ValueError, match=r"at least one target, got xt \(2, 0, 1\)"):
        model.predict(xc, yc, xt[:, :0])
    batch = GPSampler().sample(1)._replace(xc=xc, yc=yc, xt=xt, yt=yt[:, :2])
    with pytest.raises(ValueError, match=r"xt \(2, 3, 1\) and yt \(2, 2, 2\)"):
        model(batch)
    with pytest.raises(ValueError, match=r"xt \(2, 3, 1\) and yt \(2, 2, 2\)"):
        model.log_likelihood(batch)
    cls = type(model).__name__
    for option, value in (("prj_dim", 0), ("prj_depth", 2.0), ("num_std_layers", -1)):
        with pytest.raises(ValueError, match=f"{cls}: {option} must be an int"):
            build_model(name, **SMALL, **{option: value})


@pytest.mark.parametrize("name", ND_MODELS)
def test_options_rebuild_the_same_model(name):
    model = build_model(name, **SMALL, num_std_layers=1, prj_dim=7, prj_depth=2)
    options = model.options()
    assert {k: options[k] for k in ("num_std_layers", "prj_dim", "prj_depth")} == dict(
        num_std_layers=1, prj_dim=7, prj_depth=2)
    rebuilt = build_model(name, **model.config.to_dict(), **options)
    rebuilt.load_state_dict(model.state_dict())  # strict: the same parameters
    assert len(rebuilt.head.std_encoder) == 1 and rebuilt.head.projector[-1].out_features == 7
    assert build_model(name).options() == {**({"block": "prenorm"} if name == "lbanp_nd" else {}),
                                           "num_std_layers": 2, "prj_dim": 20, "prj_depth": 4}


def _train(model, steps=200, seed=0):
    """Mean loss of the first and of the last 20 of ``steps`` Adam steps (lr 1e-3) on GP batches of 8."""
    torch.manual_seed(seed)
    sampler, g = GPSampler(), torch.Generator().manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(sampler.sample(8, generator=g))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    return sum(losses[:20]) / 20, sum(losses[-20:]) / 20


@torch.no_grad()
def _held_out_loss(model):
    g = torch.Generator().manual_seed(1234)
    return sum(model(GPSampler().sample(8, generator=g)).item() for _ in range(10)) / 10


@pytest.mark.parametrize("name, options", [("tnp_nd", {}), ("lbanp_nd", {}), ("cmanp_and", {"covariance": "cholesky"})])
def test_two_hundred_steps_decrease_the_loss(name, options):
    # Seeded, so deterministic. The first and last 20 steps see different batches (an untrained
    # TNP-ND's loss differs by 0.2 between them), so the drop is also checked on fixed held-out batches.
    torch.manual_seed(0)
    model = build_model(name, **SMALL, **options)
    before = _held_out_loss(model)
    first, last = _train(model)
    after = _held_out_loss(model)
    assert last < first - 0.15, (first, last)
    assert after < before - 0.5, (before, after)


# -- CMANP-AND with a Cholesky covariance per block ----------------------------------------------

def test_cmanp_and_covariance_option_defaults_to_low_rank_and_is_reported():
    assert CMANPAND(**SMALL).options() == {"block": "prenorm", "covariance": "lowrank"}
    assert isinstance(CMANPAND(**SMALL).head, cmanp_and._LowRankHead)
    chol = CMANPAND(**SMALL, covariance="cholesky", block="perceiver")
    assert chol.options() == {"block": "perceiver", "covariance": "cholesky"}
    assert isinstance(chol.head, NotDiagonalHead)
    with pytest.raises(ValueError, match="CMANPAND: unknown covariance 'full'; choose one of lowrank, cholesky"):
        CMANPAND(**SMALL, covariance="full")


def test_cmanp_and_cholesky_block_log_likelihood_equals_float64_formula():
    torch.manual_seed(0)
    model = CMANPAND(**SMALL, covariance="cholesky", block_size=3).double().eval()
    xc, yc, xt, yt = _points(2, 8, 7, 1, 1, dtype=torch.float64)
    batch = GPSampler().sample(1)._replace(xc=xc, yc=yc, xt=xt, yt=yt)
    # By hand: each block's joint density given the context and the true earlier blocks, conditioned from scratch.
    total = torch.zeros(2, dtype=torch.float64)
    for start, end in ((0, 3), (3, 6), (6, 7)):
        state = model.condition(torch.cat([xc, xt[:, :start]], 1), torch.cat([yc, yt[:, :start]], 1))
        joint = model.joint(state, xt[:, start:end])
        assert joint.scale_tril.shape == (2, end - start, end - start)
        _assert_positive_definite(joint.scale_tril)
        cov = joint.scale_tril @ joint.scale_tril.transpose(-1, -2)
        total = total + _gaussian_log_density(yt[:, start:end].flatten(1), joint.loc, cov)
    assert torch.allclose(model.log_likelihood(batch), total / 7, atol=1e-8, rtol=1e-8)
    # Training's loss is the joint over all targets at once.
    joint = model.joint(model.condition(xc, yc), xt)
    cov = joint.scale_tril @ joint.scale_tril.transpose(-1, -2)
    assert torch.allclose(model(batch), -(_gaussian_log_density(yt.flatten(1), joint.loc, cov) / 7).mean(), **F64)


def test_cmanp_and_cholesky_samples_and_marginals():
    torch.manual_seed(0)
    model = CMANPAND(**SMALL, covariance="cholesky", dim_y=2).eval()
    xc, yc, xt, _ = _points(2, 6, 5, 1, 2)
    s1 = model.sample(xc, yc, xt, block_size=2, generator=torch.Generator().manual_seed(3))
    s2 = model.sample(xc, yc, xt, block_size=2, generator=torch.Generator().manual_seed(3))
    assert s1.shape == (2, 5, 2) and torch.equal(s1, s2) and torch.isfinite(s1).all()
    state = model.condition(xc, yc)
    joint, marg = model.joint(state, xt), model.query(state, xt)
    assert torch.allclose(marg.scale.flatten(1) ** 2, joint.covariance_matrix.diagonal(dim1=-2, dim2=-1), rtol=1e-5)
    with pytest.raises(ValueError, match=r"at least one target, got xt \(2, 0, 1\)"):
        model.sample(xc, yc, xt[:, :0])


@pytest.mark.parametrize("module", [not_diagonal, tnp_nd, lbanp_nd, cmanp_and])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
