"""Packed batches of NP tasks (``attn_ext.data.PackedNPBatch``): ``GPSampler.sample_packed`` draws what
``sample`` draws one task at a time, ``pack_tasks`` and ``task`` invert each other, and the packed paths of TNP-D,
LBANP, CMANP (every block kind), TransformerCA and Perceiver IO give each task what the padded path gives it alone
(fp64), loss and gradients included; the models that predict one task at a time (TETNP, PT-TETNP, ConvNP,
HyperMixNP, IST, ReTreever, IntentionNP, LinearTNP) and the joint-covariance models' loss and metric too (their
``predict_packed`` refuses, naming the joint covariance); a CMANP task without context and malformed batches raise
errors that say so."""
from __future__ import annotations

import pytest
import torch

from attn_ext.data import GPSampler, NPBatch, PackedNPBatch, pack_tasks
from attn_ext.models import (CMANP, CMANPAND, IST, LBANP, LBANPND, PTTETNP, TETNP, TNPD, TNPND, ConvNP, HyperMixNP,
                              IntentionNP, LinearTNP, PerceiverIONP, ReTreever, TransformerCA)


def _batch(size=5, seed=0):
    return GPSampler().sample_packed(size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sample_packed_draws_each_task_as_sample_of_one_would():
    sampler, gen = GPSampler(), torch.Generator().manual_seed(3)
    packed = sampler.sample_packed(4, generator=gen)
    gen = torch.Generator().manual_seed(3)
    for b in range(4):
        num_ctx, num_tar = sampler.sample_counts(gen)
        task = sampler.sample(1, gen, num_context=num_ctx, num_target=num_tar)
        for got, want in zip(packed.task(b), task):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(set(packed.num_context.tolist())) > 1, "the tasks draw their own counts"


def test_pack_tasks_and_task_invert_each_other():
    tasks = [GPSampler().sample(2, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    packed = pack_tasks(tasks)
    assert packed.batch_size == 6 and packed.cu_seqlens_c.dtype == torch.int32
    for i in range(6):
        for got, want in zip(packed.task(i), NPBatch(*(t[i % 2:i % 2 + 1] for t in tasks[i // 2]))):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no tasks"):
        pack_tasks([])


def _packed_equals_each_task_alone(model, batch):
    ll = model.log_likelihood(batch)
    per_task = torch.cat([model.log_likelihood(batch.task(b)) for b in range(batch.batch_size)])
    torch.testing.assert_close(ll, per_task, rtol=1e-12, atol=1e-12)
    loss = model(batch)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    loss_ref = torch.stack([model(batch.task(b)) for b in range(batch.batch_size)]).mean()
    grads_ref = torch.autograd.grad(loss_ref, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(model.named_parameters(), grads, grads_ref):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("cls", [LBANP, CMANP])
@pytest.mark.parametrize("block", ["prenorm", "perceiver", "official"])
def test_latent_models_packed_equal_each_task_alone(cls, block):
    torch.manual_seed(0)
    model = cls(num_layers=2, d_model=16, num_latents=6, block=block).double()
    batch = _batch(4)
    assert len(set(batch.num_context.tolist())) > 1 and len(set(batch.num_target.tolist())) > 1
    _packed_equals_each_task_alone(model, batch)


@pytest.mark.parametrize("cls", [TransformerCA, PerceiverIONP])
def test_encoder_models_packed_equal_each_task_alone(cls):
    torch.manual_seed(0)
    _packed_equals_each_task_alone(cls(num_layers=2, d_model=16, num_latents=5).double(), _batch(4))


SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)


@pytest.mark.parametrize("cls", [TETNP, PTTETNP, ConvNP, HyperMixNP, IST, IntentionNP, LinearTNP, ReTreever],
                         ids=lambda c: c.__name__)
def test_per_task_models_packed_equal_each_task_alone(cls):
    torch.manual_seed(0)
    model = cls(**SMALL).double()
    if cls is ReTreever:
        model.eval()  # the greedy tree search: the loss draws nothing, so packed and per-task calls meet alike
    _packed_equals_each_task_alone(model, _batch(3))


def test_tnpd_packed_equals_each_task_alone():
    torch.manual_seed(0)
    model = TNPD(num_layers=2, d_model=32).double()
    batch = _batch()
    ll = model.log_likelihood(batch)
    per_task = torch.cat([model.log_likelihood(batch.task(b)) for b in range(batch.batch_size)])
    torch.testing.assert_close(ll, per_task, rtol=1e-12, atol=1e-12)

    loss = model(batch)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    loss_ref = torch.stack([model(batch.task(b)) for b in range(batch.batch_size)]).mean()
    grads_ref = torch.autograd.grad(loss_ref, list(model.parameters()))
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", [TNPND, LBANPND, CMANPAND], ids=lambda c: c.__name__)
def test_joint_models_take_a_packed_batch_one_task_at_a_time(cls):
    torch.manual_seed(0)
    model = cls(num_layers=1, d_model=16, num_latents=4).double()
    batch = _batch(3)
    _packed_equals_each_task_alone(model, batch)
    with pytest.raises(NotImplementedError, match="joint covariance over each task's targets"):
        model.predict_packed(batch.xc, batch.yc, batch.xt, batch.cu_seqlens_c, batch.cu_seqlens_t)


def test_refusals():
    batch = _batch(3)
    no_context = pack_tasks([batch.task(0), NPBatch(batch.xc[:0][None], batch.yc[:0][None], batch.xt[:2][None],
                                                    batch.yt[:2][None])])
    with pytest.raises(ValueError, match="task 1 has none"):
        CMANP(num_layers=1, d_model=16, num_latents=4).double()(no_context)
    model = TNPD(num_layers=1, d_model=16).double()
    no_target = PackedNPBatch(batch.xc, batch.yc, batch.xt[:0], batch.yt[:0], batch.cu_seqlens_c,
                              torch.zeros_like(batch.cu_seqlens_t))
    with pytest.raises(ValueError, match="every task of a packed batch needs a target"):
        model(no_target)
    with pytest.raises(ValueError, match=r"xc must be \[T, 1\]"):
        model(batch._replace(xc=batch.xc[None]))
    with pytest.raises(ValueError, match="context offsets end at"):
        model(batch._replace(xc=batch.xc[:-1], yc=batch.yc[:-1]))
