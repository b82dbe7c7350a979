"""A NaN or infinity in one task of a batch stays in that task, for every reference model (docs/models.md).

For every model of ``attn_ext.models.MODELS`` (and the options that change its prediction path), one
value of one batch entry of ``xc``, ``yc``, ``xt`` (and ``yt`` for the metric) is made NaN or ±inf: the
other entries of ``marginals``, ``log_likelihood`` and (joint models) ``sample`` must equal the clean
run exactly and the poisoned entry must be non-finite where the value reaches, or the model raises a
``ValueError`` naming itself where the docs say it must (ConvNP lays one grid over every task's inputs).
"""
import doctest
import math

import pytest
import torch
from torch.distributions import LowRankMultivariateNormal

from attn_ext.data import NPBatch
from attn_ext.models import MODELS, build_model, lowrank_normal
from attn_ext.models.lowrank_normal import TaskwiseLowRankNormal

SMALL = dict(d_model=16, num_layers=1, num_heads=2, ff_dim=16, emb_depth=2, num_latents=4)

# Every model at its defaults, and the options that take another prediction path.
VARIANTS = [(name, {}) for name in sorted(MODELS)] + [
    ("cmanp_and", dict(covariance="cholesky")), ("lbanp", dict(block="perceiver")), ("lbanp", dict(block="official")),
    ("cmanp", dict(block="perceiver")), ("retreever", dict(tree_design="kd-rp")),
    ("retreever", dict(aggregator="mean")), ("intention_np", dict(intention_form="paper")),
]
IDS = [name + "".join(f"-{v}" for v in options.values()) for name, options in VARIANTS]

# (model, input) pairs where the docs say the model refuses a non-finite value by name.
REFUSES = {("convnp", "xc"), ("convnp", "xt")}

B, POISONED, CLEAN = 3, 1, [0, 2]


def _model(name, options):
    torch.manual_seed(0)
    return build_model(name, **SMALL, **options).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    return NPBatch(*(torch.randn(B, n, 1, generator=gen) for n in (6, 6, 4, 4)))


def _poisoned(batch, where, value):
    tensors = {k: getattr(batch, k).clone() for k in ("xc", "yc", "xt", "yt")}
    tensors[where][POISONED, 2, 0] = value
    return NPBatch(**tensors)


def _check(clean, poisoned, what):
    assert torch.equal(poisoned[CLEAN], clean[CLEAN]), f"{what}: the clean tasks changed"
    assert not torch.isfinite(poisoned[POISONED]).all(), f"{what}: the poisoned task is finite"


def _outputs(model, batch, with_metric):
    marginals = model.marginals(batch.xc, batch.yc, batch.xt)
    out = {"mean": marginals.mean, "stddev": marginals.stddev}
    if with_metric:
        out["log_likelihood"] = model.log_likelihood(batch)
    if hasattr(model, "sample"):
        out["sample"] = model.sample(batch.xc, batch.yc, batch.xt, generator=torch.Generator().manual_seed(2))
    return out


@pytest.mark.parametrize("name, options", VARIANTS, ids=IDS)
@torch.no_grad()
def test_non_finite_value_stays_in_its_task(name, options):
    model, batch = _model(name, options), _batch()
    clean = _outputs(model, batch, with_metric=True)
    for where in ("xc", "yc", "xt", "yt"):
        for value in (math.nan, math.inf, -math.inf):
            bad, what = _poisoned(batch, where, value), f"{value} in task {POISONED}'s {where}"
            if (name, where) in REFUSES:
                with pytest.raises(ValueError, match=type(model).__name__ + ".*finite"):
                    _outputs(model, bad, with_metric=False)
            elif where == "yt":  # only the metric reads yt
                _check(clean["log_likelihood"], model.log_likelihood(bad), f"{what}: log_likelihood")
            else:
                for key, out in _outputs(model, bad, with_metric=True).items():
                    _check(clean[key], out, f"{what}: {key}")


def test_taskwise_low_rank_normal_is_torch_on_finite_tasks():
    # Bit for bit torch's LowRankMultivariateNormal where every task is finite: same capacitance factor,
    # hence the same density, entropy, marginals and draws.
    gen = torch.Generator().manual_seed(0)
    loc, factor = torch.randn(4, 6, generator=gen), torch.randn(4, 6, 3, generator=gen)
    diag = torch.rand(4, 6, generator=gen) + 0.1
    ours, torchs = TaskwiseLowRankNormal(loc, factor, diag, "CMANPAND"), LowRankMultivariateNormal(loc, factor, diag)
    y = torch.randn(4, 6, generator=gen)
    reads = {"log_prob": lambda d: d.log_prob(y), "entropy": lambda d: d.entropy(),
             "variance": lambda d: d.variance, "rsample": lambda d: d.rsample()}
    for what, read in reads.items():
        torch.manual_seed(3)
        a = read(ours)
        torch.manual_seed(3)
        assert torch.equal(a, read(torchs)), what
    expanded = ours.expand((2, 4))
    assert isinstance(expanded, TaskwiseLowRankNormal)
    assert torch.equal(expanded.log_prob(y), torchs.expand((2, 4)).log_prob(y))


def test_taskwise_low_rank_normal_names_the_model_for_a_degenerate_finite_covariance():
    # A diagonal variance of 0 (exp underflow) with a finite factor: no Cholesky factor exists; torch's
    # class raises _LinAlgError for the whole batch, ours a ValueError naming the model and the entry.
    factor, diag = torch.randn(3, 4, 2), torch.ones(3, 4)
    diag[2, 1] = 0.0
    with pytest.raises(ValueError, match=r"CMANPAND: .*batch entries \[2\]"):
        TaskwiseLowRankNormal(torch.zeros(3, 4), factor, diag, "CMANPAND")


def test_docstring_example():
    assert doctest.testmod(lowrank_normal).failed == 0
