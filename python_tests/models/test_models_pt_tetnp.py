"""PT-TETNP (``attn_ext.models.PTTETNP``): translation equivariance in fp64 with the pseudo tokens' locations moving
(their steps set away from 0) for 1-D and 2-D inputs, context order and each target's independence of the other
targets, attention only between the pseudo tokens and the context or the targets (linear in N_c), the loss's
gradients reaching every parameter, and the errors for an empty context and bad sizes."""
from __future__ import annotations

import pytest
import torch

from attn_ext.models import PTTETNP, build_model
from attn_ext.nn.te_attention import TEMultiheadAttention

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=5)
F64 = torch.float64


def _model(dim_x=1, moving=True, seed=0):
    torch.manual_seed(seed)
    model = PTTETNP(dim_x=dim_x, **SMALL).double()
    if moving:
        with torch.no_grad():
            model.location_steps.fill_(0.7)
    return model


def _task(dim_x=1, n_c=9, n_t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, n_c, dim_x, generator=g, dtype=F64), torch.randn(2, n_c, 1, generator=g, dtype=F64),
            torch.randn(2, n_t, dim_x, generator=g, dtype=F64))


@pytest.mark.parametrize("dim_x", [1, 2])
def test_translation_equivariant_with_moving_pseudo_tokens(dim_x):
    model, (xc, yc, xt) = _model(dim_x), _task(dim_x)
    shift = torch.linspace(-40.0, 25.0, dim_x, dtype=F64)
    a, b = model.predict(xc, yc, xt), model.predict(xc + shift, yc, xt + shift)
    torch.testing.assert_close(a.mean, b.mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(a.scale, b.scale, rtol=1e-9, atol=1e-9)
    # A model that ignored the inputs would pass the check above: it must depend on them.
    assert not torch.allclose(a.mean, model.predict(xc, yc, xt * 2.0).mean)


def test_prediction_on_the_fused_op_equals_the_reference_backend(monkeypatch):
    """Every attention runs ae.te_attention (the location update's weighted inputs as extra value columns): the
    C++ kernels and the chunked reference (several chunks of 64 keys at N_c = 130) give the same prediction."""
    model, (xc, yc, xt) = _model(), _task(n_c=130)
    fused = model.predict(xc, yc, xt)
    monkeypatch.setenv("ATTN_EXT_BACKEND", "reference")
    reference = model.predict(xc, yc, xt)
    torch.testing.assert_close(fused.mean, reference.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused.scale, reference.scale, rtol=1e-10, atol=1e-10)


def test_context_order_and_target_independence():
    model, (xc, yc, xt) = _model(), _task()
    perm = torch.randperm(xc.shape[1], generator=torch.Generator().manual_seed(3))
    full = model.predict(xc, yc, xt)
    torch.testing.assert_close(full.mean, model.predict(xc[:, perm], yc[:, perm], xt).mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full.mean[:, 2:4], model.predict(xc, yc, xt[:, 2:4]).mean, rtol=1e-12, atol=1e-12)


def test_every_attention_has_the_pseudo_tokens_on_one_side(monkeypatch):
    """Linear in N_c: no attention pairs the context with itself or with the targets."""
    model, (xc, yc, xt) = _model(), _task(n_c=23, n_t=11)
    pairs, real = [], TEMultiheadAttention.forward

    def record(self, zq, zk, xq, xk, zv=None, **options):
        pairs.append((zq.shape[1], zk.shape[1]))
        return real(self, zq, zk, xq, xk, zv, **options)

    monkeypatch.setattr(TEMultiheadAttention, "forward", record)
    model.predict(xc, yc, xt)
    assert pairs and all(SMALL["num_latents"] in pair for pair in pairs), pairs
    assert {(5, 23), (11, 5), (23, 5)} <= set(pairs)


def test_loss_reaches_every_parameter():
    model, (xc, yc, xt) = _model(), _task()
    yt = torch.randn(2, xt.shape[1], 1, dtype=F64)
    from attn_ext.data import NPBatch
    loss = model(NPBatch(xc, yc, xt, yt))
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    missing = [name for (name, _), g in zip(model.named_parameters(), grads) if g is None or not torch.any(g != 0)]
    assert missing == []


def test_errors_and_the_registry():
    model, (xc, yc, xt) = _model(moving=False), _task()
    with pytest.raises(ValueError, match="PTTETNP: the context must have at least one point"):
        model.predict(xc[:, :0], yc[:, :0], xt)
    with pytest.raises(ValueError, match="num_heads=3 must divide d_model=16"):
        PTTETNP(**{**SMALL, "num_heads": 3})
    with pytest.raises(ValueError, match="num_layers and num_latents must be >= 1"):
        PTTETNP(**{**SMALL, "num_latents": 0})
    with pytest.raises(TypeError, match="no \\[x, y\\] embedding"):
        model.embed_pairs(xc, yc)
    assert type(build_model("pt-tetnp", **SMALL)) is PTTETNP
    assert PTTETNP(kernel_hidden=7, **SMALL).options() == {"kernel_hidden": 7}
