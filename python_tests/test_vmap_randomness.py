"""``torch.func.vmap`` with each ``randomness`` over every public op and module, as PyTorch does it.

* ``"error"`` (vmap's default): an op that draws random numbers raises vmap's own error, as
  ``torch.nn.functional.scaled_dot_product_attention`` does; an op that draws none runs;
* ``"same"``: every vmapped element gets the draw a single call makes, so element ``v`` equals the
  single call on element ``v`` after the same ``torch.manual_seed``;
* ``"different"``: element ``v`` gets its own draw — the ``v``-th of the ``[V, ...]`` draw vmap makes —
  so elements with equal inputs differ, and element ``v`` equals a single call handed that draw.

Dropout of ``scaled_dot_product_attention`` is checked on every backend, forward and under
``torch.func.grad`` (both orders of the transforms), and through ``nn.MultiheadAttention``.
"""
from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

import attn_ext as ae
import attn_ext.ops.attention.scaled_dot_product as sdpa_front
import attn_ext.ops.tree.retrieval as tree_front
from _helpers import ALL_BACKENDS, require_backend

F64 = torch.float64
V = 3  # vmapped elements
RANDOMNESS = ("error", "same", "different")
SEED_RANGE = (0, 2**63 - 1)  # what draw_seed draws from
ERROR_MODE = "called random operation while in randomness error mode"


def _dtype(backend):
    return torch.float32 if backend == "triton" else F64


def _stack_calls(f, *batched):
    return torch.stack([f(*(x[i] for x in batched)) for i in range(V)])


def _seeds(randomness, seed):
    """The dropout seeds vmap hands element 0..V-1 after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    if randomness == "same":
        return torch.randint(*SEED_RANGE, (1,), dtype=torch.int64).expand(V, 1)
    return torch.randint(*SEED_RANGE, (V, 1), dtype=torch.int64)


def _with_seed(monkeypatch, seed, call):
    """``call()`` with the dropout seed of its one SDPA call set to ``seed``."""
    monkeypatch.setattr(sdpa_front, "draw_seed", lambda: seed.clone())
    try:
        return call()
    finally:
        monkeypatch.undo()


def _error_same_different(f, x, seed):
    """vmap of ``f`` in the three modes: "error" raises as torch's random ops do, "same" is the single call of
    element 0 for every element (all elements are equal inputs here), "different" is returned for the caller's
    per-element checks after asserting that its elements differ."""
    with pytest.raises(RuntimeError, match=ERROR_MODE):
        vmap(f)(x)
    torch.manual_seed(seed)
    same = vmap(f, randomness="same")(x)
    torch.manual_seed(seed)
    single = f(x[0])
    assert all(torch.equal(same[i], single) for i in range(V))
    torch.manual_seed(seed)
    different = vmap(f, randomness="different")(x)
    assert not all(torch.equal(different[0], different[i]) for i in range(1, V))
    return different


def _qkv(backend, *, same_elements=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 2, 4, 8), (2, 1, 6, 8), (2, 1, 6, 4))  # B, H (grouped heads), L or S, E
    qkv = [torch.randn((1 if same_elements else V,) + s, generator=g, dtype=F64).to(_dtype(backend)) for s in shapes]
    return [t.expand(V, *t.shape[1:]).contiguous() for t in qkv]


# ------------------------------------------------------------------------------------------------
# Dropout of scaled_dot_product_attention
# ------------------------------------------------------------------------------------------------


def _sdpa(backend, **kwargs):
    def f(q, k, v):
        return ae.scaled_dot_product_attention(q, k, v, dropout_p=0.4, enable_gqa=True, backend=backend,
                                               chunk_size=4, **kwargs)

    return f


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sdpa_dropout_raises_vmaps_error_in_error_mode_as_torch_does(backend):
    q, k, v = _qkv(backend)
    require_backend(backend, q)
    torch_sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.4,
                                                                                  enable_gqa=True)
    with pytest.raises(RuntimeError, match=ERROR_MODE):
        vmap(torch_sdpa)(q, k, v)
    with pytest.raises(RuntimeError, match=ERROR_MODE):
        vmap(_sdpa(backend))(q, k, v)
    # Without dropout nothing is drawn: the error mode runs it.
    no_dropout = lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    torch.testing.assert_close(vmap(no_dropout)(q, k, v), _stack_calls(no_dropout, q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("randomness", ["same", "different"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sdpa_dropout_under_vmap_is_the_loop_of_single_calls_with_each_elements_seed(backend, randomness, causal,
                                                                                     monkeypatch):
    q, k, v = _qkv(backend)
    require_backend(backend, q)
    f = _sdpa(backend, is_causal=causal)
    torch.manual_seed(5)
    got = vmap(f, randomness=randomness)(q, k, v)
    seeds = _seeds(randomness, 5)
    for i in range(V):
        expected = _with_seed(monkeypatch, seeds[i], lambda: f(q[i], k[i], v[i]))
        torch.testing.assert_close(got[i], expected, rtol=0, atol=0)
    # "same" is literally the single call's draw: the same manual_seed reproduces element i.
    if randomness == "same":
        torch.manual_seed(5)
        torch.testing.assert_close(got[1], f(q[1], k[1], v[1]), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sdpa_dropout_masks_are_shared_by_same_and_independent_under_different(backend):
    q, k, v = _qkv(backend, same_elements=True)
    require_backend(backend, q)
    ones = torch.ones_like(v)  # out = Σ kept weights / (1 − p): a picture of each row's keep mask
    same = vmap(_sdpa(backend), randomness="same")(q, k, ones)
    different = vmap(_sdpa(backend), randomness="different")(q, k, ones)
    assert all(torch.equal(same[0], same[i]) for i in range(V))
    assert not any(torch.equal(different[0], different[i]) for i in range(1, V))
    undropped = ae.scaled_dot_product_attention(q[0], k[0], ones[0], enable_gqa=True, backend=backend)
    assert not torch.equal(same[0], undropped)  # dropout did act


@pytest.mark.parametrize("randomness", ["same", "different"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sdpa_dropout_gradients_under_vmap_of_grad_and_grad_of_vmap(backend, randomness, monkeypatch):
    q, k, v = _qkv(backend, seed=1)
    require_backend(backend, q)
    f = _sdpa(backend, is_causal=True)
    weights = torch.randn(q.shape[1:-1] + (v.shape[-1],), dtype=q.dtype)
    loss = lambda q, k, v: (f(q, k, v) * weights).sum()
    torch.manual_seed(9)
    per_element = vmap(grad(loss, argnums=(0, 1, 2)), randomness=randomness)(q, k, v)
    torch.manual_seed(9)
    of_batch = grad(lambda q, k, v: vmap(loss, randomness=randomness)(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    seeds = _seeds(randomness, 9)
    for i in range(V):
        leaves = [t[i].clone().requires_grad_() for t in (q, k, v)]
        expected = torch.autograd.grad(_with_seed(monkeypatch, seeds[i], lambda: loss(*leaves)), leaves)
        for a, b, c in zip(per_element, of_batch, expected):
            torch.testing.assert_close(a[i], c)
            torch.testing.assert_close(b[i], c)
    assert not torch.equal(per_element[2][0], per_element[2][1]) or randomness == "same"


def test_nested_vmap_gives_every_element_of_both_levels_its_own_mask(monkeypatch):
    q, k, v = _qkv("reference", same_elements=True)
    q, k, v = (t[:, None].expand(V, 2, *t.shape[1:]) for t in (q, k, v))
    f = _sdpa("reference")
    torch.manual_seed(2)
    got = vmap(vmap(f, randomness="different"), randomness="different")(q, k, v)
    outputs = [got[i, j] for i in range(V) for j in range(2)]
    assert len({o.numpy().tobytes() for o in outputs}) == len(outputs)
    torch.manual_seed(2)
    seeds = torch.randint(*SEED_RANGE, (V, 2, 1), dtype=torch.int64)
    torch.testing.assert_close(got[2, 1], _with_seed(monkeypatch, seeds[2, 1], lambda: f(q[2, 1], k[2, 1], v[2, 1])),
                               rtol=0, atol=0)


def test_the_raw_op_takes_a_batched_seed_per_element():
    q, k, v = (t.to(F64) for t in _qkv("reference"))
    seeds = torch.tensor([[11], [12], [11]], dtype=torch.int64)
    op = torch.ops.attn_ext.attention_fwd_reference

    def call(q, k, v, seed):
        return op(q, k, v, None, None, 0.5, False, 0.5, seed, 4)[0]

    got = vmap(call, in_dims=(0, 0, 0, 0))(q, k, v, seeds)
    for i in range(V):
        torch.testing.assert_close(got[i], call(q[i], k[i], v[i], seeds[i]), rtol=0, atol=0)
    # Unbatched seed: one mask for all (not the folded batch's masks of entries V·B ...).
    got = vmap(call, in_dims=(0, 0, 0, None))(q, k, v, seeds[0])
    for i in range(V):
        torch.testing.assert_close(got[i], call(q[i], k[i], v[i], seeds[0]), rtol=0, atol=0)
    # No element at all: empty results, not an error about the seed.
    assert vmap(call, in_dims=(0, 0, 0, 0))(q[:0], k[:0], v[:0], seeds[:0]).shape == (0,) + q.shape[1:-1] + v.shape[-1:]


# ------------------------------------------------------------------------------------------------
# Modules with dropout
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ae.nn.MultiheadAttention, ae.nn.MultiheadCrossAttention])
def test_multihead_attention_dropout_under_each_randomness(cls, monkeypatch):
    # (torch 2.13's own nn.MultiheadAttention breaks "same" here: its third element gets another mask.)
    torch.manual_seed(0)
    module = cls(8, 2, dropout=0.5, batch_first=True, dtype=F64).train()
    params = dict(module.named_parameters())
    x = torch.randn(1, 2, 5, 8, dtype=F64).expand(V, -1, -1, -1)

    def f(x):
        return functional_call(module, params, (x, x, x), {"need_weights": False})[0]

    different = _error_same_different(f, x, 4)
    assert not any(torch.equal(different[0], different[i]) for i in range(1, V))
    seeds = _seeds("different", 4)
    for i in range(V):
        torch.testing.assert_close(different[i], _with_seed(monkeypatch, seeds[i], lambda: f(x[i])), rtol=0, atol=0)
    module.eval()  # no dropout: nothing drawn, the error mode runs
    torch.testing.assert_close(vmap(f)(x), _stack_calls(f, x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# The other ops that draw random numbers, and every op that draws none
# ------------------------------------------------------------------------------------------------


def _tree_problem():
    g = torch.Generator().manual_seed(3)
    tree = ae.build_tree(torch.rand(1, 12, 1, generator=g, dtype=F64))
    q = torch.randn(1, 1, 2, 3, 4, generator=g, dtype=F64).expand(V, -1, -1, -1, -1)
    node_k = torch.randn(1, 2, tree.num_nodes, 4, generator=g, dtype=F64)
    return tree, q, node_k


def test_tree_sampling_policy_under_each_randomness(monkeypatch):
    tree, q, node_k = _tree_problem()

    def f(q):
        return ae.tree_cross_attention(q, node_k, node_k, tree, policy="sample").selected

    different = _error_same_different(f, q, 6)
    torch.manual_seed(6)
    uniforms = torch.rand((V, 1, 3, tree.height), dtype=F64)
    for i in range(V):
        monkeypatch.setattr(tree_front, "_draw_uniforms", lambda *args: uniforms[i])
        assert torch.equal(different[i], f(q[i]))
        monkeypatch.undo()


def test_kernelised_intention_landmarks_under_each_randomness():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 2, 3, 4, generator=g, dtype=F64).expand(V, -1, -1, -1, -1)
    k = torch.randn(1, 2, 16, 4, generator=g, dtype=F64)

    def with_generator(seed):
        return lambda q: ae.kernelised_intention(q, k, k, num_landmarks=5,
                                                 generator=torch.Generator().manual_seed(seed))

    with pytest.raises(RuntimeError, match=ERROR_MODE):
        vmap(with_generator(1))(q)
    same = vmap(with_generator(1), randomness="same")(q)
    assert all(torch.equal(same[i], with_generator(1)(q[0])) for i in range(V))
    different = vmap(with_generator(1), randomness="different")(q)
    assert not all(torch.equal(different[0], different[i]) for i in range(1, V))
    # Without a generator the landmarks are fixed (evenly spaced keys): nothing is drawn.
    fixed = lambda q: ae.kernelised_intention(q, k, k, num_landmarks=5)
    torch.testing.assert_close(vmap(fixed)(q), _stack_calls(fixed, q), rtol=0, atol=0)


def _deterministic_ops():
    """(name, f(q, k, v) -> Tensor or tuple) of every public op that draws no random number."""
    g = torch.Generator().manual_seed(8)
    tree = ae.build_tree(torch.rand(2, 6, 1, generator=g, dtype=F64))
    node = torch.randn(2, 2, tree.num_nodes, 4, generator=g, dtype=F64)
    mask = torch.tensor([[False] * 5 + [True], [False] * 6])

    def spd(k):
        gram = k[0] @ k[0].transpose(-1, -2)
        return gram + torch.eye(gram.shape[-1], dtype=F64)

    return [
        ("cross_attention", lambda q, k, v: ae.cross_attention(q, k, v, key_padding_mask=mask, return_lse=True)),
        ("scaled_dot_product_attention", lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("attention_state", lambda q, k, v: tuple(ae.attention_state(q, k, v, key_padding_mask=mask))),
        ("merge_states", lambda q, k, v: tuple(ae.merge_states(ae.attention_state(q, k[:, :, :3], v[:, :, :3]),
                                                               ae.attention_state(q, k[:, :, 3:], v[:, :, 3:])))),
        ("update_state", lambda q, k, v: tuple(ae.update_state(ae.empty_state(q, v.shape[-1]), q, k, v))),
        ("intention", lambda q, k, v: ae.intention(q, k, v, alpha=0.5, key_padding_mask=mask)),
        ("sigma_intention", lambda q, k, v: ae.sigma_intention(q, k, v, alpha=0.5)),
        ("convex_intention", lambda q, k, v: ae.convex_intention(q, k, v, theta=1.0)),
        ("pinv_intention", lambda q, k, v: ae.pinv_intention(q, k, v, alpha=0.5)),
        ("intention_map", lambda q, k, v: ae.intention_map(k, v, alpha=0.5)),
        ("kernelised_intention", lambda q, k, v: ae.kernelised_intention(q, k, v, alpha=0.5)),
        ("tree_cross_attention", lambda q, k, v: ae.tree_cross_attention(q, node + q.sum(), node, tree)[0]),
        ("tree_aggregate", lambda q, k, v: ae.tree_aggregate(tree, k[:, 0])),
        ("batched_cholesky", lambda q, k, v: ae.batched_cholesky(spd(k))[0]),
        ("batched_spd_solve", lambda q, k, v: ae.batched_spd_solve(spd(k), v[0])),
    ]


@pytest.mark.parametrize("randomness", RANDOMNESS)
def test_every_op_that_draws_nothing_runs_in_each_randomness_mode_and_equals_the_loop(randomness):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(V, 2, 2, n, d, generator=g, dtype=F64) for n, d in ((3, 4), (6, 4), (6, 3)))
    for name, f in _deterministic_ops():
        got = vmap(f, randomness=randomness)(q, k, v)
        loop = [f(q[i], k[i], v[i]) for i in range(V)]
        for i, expected in enumerate(loop):
            for a, b in zip(got if isinstance(got, tuple) else (got,),
                            expected if isinstance(expected, tuple) else (expected,)):
                torch.testing.assert_close(a[i], b, msg=f"{name}, element {i}")
