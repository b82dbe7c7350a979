"""attn_ext.nn.Intention, InformerLayer and Informer."""
import pytest
import torch

import attn_ext as ae


def test_forward_equals_functional_per_head():
    torch.manual_seed(0)
    layer = ae.nn.Intention(12, 3, alpha_init=0.7).double()
    x, ctx = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 30, 12, dtype=torch.float64)
    mask = torch.rand(2, 30) < 0.3
    heads = lambda t: t.view(2, -1, 3, 4).transpose(1, 2)  # noqa: E731
    per_head = ae.intention(heads(layer.e_q(x)), heads(layer.e_k(ctx)), heads(layer.e_v(ctx)), alpha=layer.alpha,
                            key_padding_mask=mask)
    expected = layer.e_w(per_head.transpose(1, 2).reshape(2, 4, 12))
    torch.testing.assert_close(layer(x, ctx, ctx, mask), expected)
    torch.testing.assert_close(layer.alpha, torch.full((3,), 0.7, dtype=torch.float64))


def test_incremental_path_equals_forward():
    torch.manual_seed(1)
    layer = ae.nn.Intention(16, 4)
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 90, 16)
    full = layer(x, ctx, ctx)
    state = layer.condition(ctx[:, :40], ctx[:, :40])
    state = layer.update(state, ctx[:, 40:], ctx[:, 40:])
    torch.testing.assert_close(layer.query(x, state), full, rtol=1e-4, atol=1e-4)
    removed = layer.remove(state, ctx[:, 70:], ctx[:, 70:])
    torch.testing.assert_close(layer.query(x, removed), layer(x, ctx[:, :70], ctx[:, :70]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("sigma", [False, True])
def test_alpha_is_learned_and_gradients_flow(sigma):
    torch.manual_seed(2)
    layer = ae.nn.Intention(8, 2, sigma=sigma)
    x = torch.randn(3, 10, 8)
    layer(x, x, x).square().sum().backward()
    assert layer.raw_alpha.grad is not None and torch.isfinite(layer.raw_alpha.grad).all()
    assert all(p.grad is not None for p in layer.parameters())
    fixed = ae.nn.Intention(8, 2, learn_alpha=False)
    assert "raw_alpha" not in dict(fixed.named_parameters()) and "raw_alpha" in dict(fixed.named_buffers())


def test_sigma_has_no_statistics_path_and_bad_arguments_raise():
    layer = ae.nn.Intention(8, 2, sigma=True)
    with pytest.raises(RuntimeError, match="σIntention needs the keys"):
        layer.condition(torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ae.nn.Intention(10, 3)
    with pytest.raises(ValueError, match="alpha_init must be a finite float > 0"):
        ae.nn.Intention(8, 2, alpha_init=0.0)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        ae.nn.Informer(0, 8, 2)


@pytest.fixture
def one_thread():
    # Tiny matrices: OpenMP wake-ups cost more than the work, badly so on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_informer_learns_a_linear_map_in_context(one_thread):
    """Each sequence has its own linear map y = x·w; the Informer must read it from the context."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), ae.nn.Informer(1, 16, 2), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def batch():
        x = torch.randn(16, 40, 1)
        w = torch.randn(16, 1, 1)
        y = x * w
        ctx_y = torch.cat([y[:, :30], torch.zeros(16, 10, 1)], 1)  # the last 10 targets are hidden
        return torch.cat([x, ctx_y], -1), y[:, 30:]

    def loss():
        inp, target = batch()
        return (model(inp)[:, 30:] - target).square().mean()

    first = sum(loss().item() for _ in range(5)) / 5
    for _ in range(80):
        opt.zero_grad()
        value = loss()
        value.backward()
        opt.step()
    with torch.no_grad():
        last = sum(loss().item() for _ in range(5)) / 5
    assert last < 0.5 * first, (first, last)
