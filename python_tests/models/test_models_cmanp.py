"""CMANP's constant-memory API: update then query equals conditioning on the union, chunking is exact;
CMANP-AND's block-autoregressive likelihood and sampler."""
import pytest
import torch

from attn_ext.data import GPSampler
from attn_ext.models import CMANP, CMANPAND

SMALL = dict(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)
TOL = dict(atol=1e-10, rtol=1e-9)


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    xc = torch.rand(3, 40, 1, generator=g, dtype=torch.float64) * 4 - 2
    return xc, torch.sin(3 * xc), torch.rand(3, 9, 1, generator=g, dtype=torch.float64) * 4 - 2


@pytest.fixture(params=["prenorm", "perceiver", "official"])
def model(request):
    torch.manual_seed(0)
    return CMANP(**SMALL, block=request.param).double().eval()


def test_update_then_query_equals_condition_on_union(model, data):
    xc, yc, xt = data
    full = model.query(model.condition(xc, yc), xt)
    state = model.condition(xc[:, :25], yc[:, :25])
    state = model.update(state, xc[:, 25:31], yc[:, 25:31])
    state = model.update(state, xc[:, 31:], yc[:, 31:])
    part = model.query(state, xt)
    assert torch.allclose(part.mean, full.mean, **TOL) and torch.allclose(part.scale, full.scale, **TOL)


@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
def test_chunked_conditioning_equals_one_shot(model, data, chunk):
    xc, yc, xt = data
    one = model.query(model.condition(xc, yc), xt).mean
    assert torch.allclose(model.query(model.condition(xc, yc, chunk_size=chunk), xt).mean, one, **TOL)


def test_remove_then_query_equals_conditioning_without_those_points(model, data):
    xc, yc, xt = data
    removed = model.remove(model.condition(xc, yc), xc[:, 25:], yc[:, 25:])
    kept = model.query(model.condition(xc[:, :25], yc[:, :25]), xt)
    got = model.query(removed, xt)
    assert torch.allclose(got.mean, kept.mean, atol=1e-8, rtol=1e-7)
    assert torch.allclose(got.scale, kept.scale, atol=1e-8, rtol=1e-7)
    with pytest.raises(ValueError, match="batch"):
        model.remove(model.condition(xc, yc), xc[:2, 25:], yc[:2, 25:])


@pytest.mark.parametrize("model_class", [CMANP, CMANPAND])
def test_default_conditioning_memory_is_flat_in_the_context_size(model_class):
    from _helpers import peak_allocated_bytes

    torch.manual_seed(0)
    model = model_class(num_layers=2).eval()  # the default chunk size: nothing set
    g = torch.Generator().manual_seed(0)
    peaks = {}
    for n in (1_000, 100_000):
        xc, yc = torch.randn(1, n, 1, generator=g), torch.randn(1, n, 1, generator=g)
        with torch.no_grad():
            peaks[n] = peak_allocated_bytes(lambda: model.condition(xc, yc))
    # All at once, N_c = 1e5 held 100x the embeddings of N_c = 1e3; in chunks the peak is one chunk's.
    assert peaks[100_000] <= 1.5 * peaks[1_000], peaks


def test_state_size_independent_of_context(model, data):
    xc, yc, _ = data
    small, large = model.condition(xc[:, :5], yc[:, :5]), model.condition(xc, yc, chunk_size=8)
    assert [b.attention.out.shape for b in small.blocks] == [b.attention.out.shape for b in large.blocks]


def test_fp32_update_matches(data):
    torch.manual_seed(1)
    model = CMANP(**SMALL).eval()
    xc, yc, xt = (t.float() for t in data)
    full = model.predict(xc, yc, xt).mean
    state = model.update(model.condition(xc[:, :10], yc[:, :10], chunk_size=4), xc[:, 10:], yc[:, 10:])
    assert torch.allclose(model.query(state, xt).mean, full, atol=1e-5, rtol=1e-4)


def test_bad_state_and_chunk(model, data):
    xc, yc, xt = data
    with pytest.raises(ValueError, match="chunk_size"):
        model.condition(xc, yc, chunk_size=-1)
    state = model.condition(xc, yc)
    with pytest.raises(ValueError, match="batch"):
        model.update(state, xc[:1], yc[:1])
    with pytest.raises(TypeError, match="CMANPState"):
        model.query((1, 2), xt)


def test_and_loglik_with_one_block_is_the_joint():
    torch.manual_seed(0)
    model = CMANPAND(**SMALL, block_size=3).double().eval()
    b = GPSampler().sample(2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    nt = b.xt.shape[1]
    joint = model.joint(model.condition(b.xc, b.yc), b.xt).log_prob(b.yt.flatten(1)) / nt
    assert torch.allclose(model.log_likelihood(b, block_size=nt), joint, **TOL)
    # Blocks condition on the true earlier targets: the same as feeding them by hand.
    state = model.update(model.condition(b.xc, b.yc), b.xt[:, :3], b.yt[:, :3])
    by_hand = model.joint(model.condition(b.xc, b.yc), b.xt[:, :3]).log_prob(b.yt[:, :3].flatten(1))
    rest = [(s, min(s + 3, nt)) for s in range(3, nt, 3)]
    for s, e in rest:
        by_hand = by_hand + model.joint(state, b.xt[:, s:e]).log_prob(b.yt[:, s:e].flatten(1))
        state = model.update(state, b.xt[:, s:e], b.yt[:, s:e])
    assert torch.allclose(model.log_likelihood(b), by_hand / nt, **TOL)


def test_and_sampler_is_seeded():
    torch.manual_seed(0)
    model = CMANPAND(**SMALL).eval()
    b = GPSampler().sample(2, generator=torch.Generator().manual_seed(2))
    s1 = model.sample(b.xc, b.yc, b.xt, block_size=2, generator=torch.Generator().manual_seed(5))
    s2 = model.sample(b.xc, b.yc, b.xt, block_size=2, generator=torch.Generator().manual_seed(5))
    assert s1.shape == b.yt.shape and torch.equal(s1, s2) and torch.isfinite(s1).all()
    with pytest.raises(ValueError, match="block_size"):
        model.sample(b.xc, b.yc, b.xt, block_size=0)
