"""attn_ext.nn.TreeCrossAttention and attn_ext.nn.tca_loss (docs/spec.md §3)."""

import pytest
import torch
import torch.nn.functional as F

from attn_ext.nn.tca_loss import TCALoss, tca_loss
from attn_ext.nn.tree_cross_attention import TreeCrossAttention, TreeState
from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention, tree_num_selected

DIM, HEADS = 16, 4


def _inputs(B=2, N=37, M=5, masked=True, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(B, N, DIM, generator=g, dtype=dtype)
    coords = torch.rand(B, N, 2, generator=g, dtype=dtype)
    query = torch.randn(B, M, DIM, generator=g, dtype=dtype)
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.3
        mask[:, 0] = False
    return context, coords, query, mask


def _module(aggregator="mean", branching=2, seed=0):
    torch.manual_seed(seed)
    module = TreeCrossAttention(DIM, HEADS, branching=branching, aggregator=aggregator).double()
    with torch.no_grad():  # non-zero biases, so that a forgotten bias would show
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return module


def _heads(x):
    return x.unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2)


@pytest.mark.parametrize("branching", [2, 3])
@pytest.mark.parametrize("coords_rank", [2, 3])
def test_shapes(branching, coords_rank):
    module = _module(branching=branching).eval()
    context, coords, query, mask = _inputs()
    coords = coords[..., 0] if coords_rank == 2 else coords
    state = module.build(context, coords, key_padding_mask=mask)
    assert isinstance(state, TreeState)
    S = tree_num_selected(37, branching)
    assert state.node_k.shape == state.node_v.shape == (2, HEADS, state.tree.num_nodes, DIM // HEADS)
    res = module(query, state)
    assert res.out.shape == (2, 5, DIM)
    assert res.log_prob.shape == res.entropy.shape == (2, 5)
    assert res.selected.shape == (2, 5, S)
    assert module.forward_full(query, state).shape == (2, 5, DIM)


def test_eval_greedy_equals_hand_built_pipeline():
    module = _module().eval()
    context, coords, query, mask = _inputs()
    res = module(query, module.build(context, coords, key_padding_mask=mask))

    tree = build_tree(coords, branching=2, key_padding_mask=mask)
    nodes = tree_aggregate(tree, context)
    expected = tree_cross_attention(
        _heads(module.q_proj(query)), _heads(module.k_proj(nodes)), _heads(module.v_proj(nodes)), tree, policy="greedy"
    )
    torch.testing.assert_close(res.out, module.out_proj(expected.out.transpose(1, 2).flatten(2)))
    torch.testing.assert_close(res.log_prob, expected.log_prob)
    torch.testing.assert_close(res.entropy, expected.entropy)
    assert torch.equal(res.selected, expected.selected)


def test_policy_defaults_follow_the_mode_and_sampling_is_reproducible():
    module = _module()
    context, coords, query, mask = _inputs(N=200, M=40)
    state = module.build(context, coords, key_padding_mask=mask)
    greedy = module(query, state, policy="greedy").selected
    draws = [module(query, state, generator=torch.Generator().manual_seed(s)).selected for s in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], greedy)  # training mode samples: 40 random descents of depth 7
    assert torch.equal(module.eval()(query, state).selected, greedy)


def test_forward_full_equals_full_cross_attention_over_the_context():
    module = _module().eval()
    context, coords, query, mask = _inputs()
    out = module.forward_full(query, module.build(context, coords, key_padding_mask=mask))
    # Same projections, plain SDPA over the context in the caller's order: the tree only permutes it.
    attn = F.scaled_dot_product_attention(
        _heads(module.q_proj(query)), _heads(module.k_proj(context)), _heads(module.v_proj(context)),
        attn_mask=~mask[:, None, None, :],
    )
    torch.testing.assert_close(out, module.out_proj(attn.transpose(1, 2).flatten(2)))


def test_tca_loss_formula_and_gradients():
    g = torch.Generator().manual_seed(0)
    reward = torch.rand(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    log_prob = torch.log(torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    entropy = torch.rand(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    l_tca = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    l_ca = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    parts = tca_loss(l_tca, l_ca, reward, log_prob, entropy, lambda_ca=0.3, lambda_rl=2.0, alpha=0.1,
                     return_components=True)
    assert isinstance(parts, TCALoss)
    rl = -(reward * log_prob).mean() - 0.1 * entropy.mean()
    torch.testing.assert_close(parts.rl, rl)
    torch.testing.assert_close(parts.total, l_tca + 0.3 * l_ca + 2.0 * rl)
    total = tca_loss(l_tca, l_ca, reward, log_prob, entropy, lambda_ca=0.3, lambda_rl=2.0, alpha=0.1)
    torch.testing.assert_close(total, parts.total)

    total.backward()
    assert reward.grad is None  # detached inside
    torch.testing.assert_close(log_prob.grad, -2.0 * reward.detach() / 12)
    torch.testing.assert_close(entropy.grad, torch.full_like(entropy, -2.0 * 0.1 / 12))
    torch.testing.assert_close(l_ca.grad, torch.tensor(0.3, dtype=torch.float64))
    # A per-query reward may be given as [B, 1] (broadcast); defaults are λ = 1, α = 0.01.
    default = tca_loss(l_tca, l_ca, reward[:, :1], log_prob, entropy)
    expected = l_tca + l_ca - (reward[:, :1] * log_prob).mean() - 0.01 * entropy.mean()
    torch.testing.assert_close(default, expected)


@pytest.mark.parametrize("aggregator", ["mean", "transformer"])
def test_training_step_reaches_every_parameter(aggregator):
    module = _module(aggregator).train()
    context, coords, query, mask = _inputs(dtype=torch.float64)
    context.requires_grad_()
    state = module.build(context, coords, key_padding_mask=mask)
    res = module(query, state, generator=torch.Generator().manual_seed(0))
    target = torch.randn_like(res.out)
    l_tca = (res.out - target).pow(2).mean()
    l_ca = (module.forward_full(query, state) - target).pow(2).mean()
    reward = -(res.out - target).pow(2).mean(-1)
    loss = tca_loss(l_tca, l_ca, reward, res.log_prob, res.entropy)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert torch.isfinite(context.grad).all() and context.grad[~mask].abs().sum() > 0


def test_transformer_aggregator_ignores_padding_and_gradients_flow_through_it():
    module = _module("transformer").eval()
    context, coords, query, mask = _inputs()
    state = module.build(context, coords, key_padding_mask=mask)
    # Changing masked tokens must change nothing: the layer masks them and the mean skips them.
    changed = context.clone()
    changed[mask] = 1e3
    torch.testing.assert_close(module.build(changed, coords, key_padding_mask=mask).nodes, state.nodes)
    # The aggregator really transforms the children (not just a mean).
    assert not torch.allclose(state.nodes, tree_aggregate(state.tree, context))
    internal = state.nodes[:, : state.tree.leaf_offset]
    layer_params = list(module.aggregate.parameters())
    grads = torch.autograd.grad(internal.sum(), layer_params)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("aggregator", ["mean", "transformer"])
def test_without_backprop_through_tree_only_the_leaves_reach_the_context(aggregator):
    context, coords, query, mask = _inputs()
    through = _module(aggregator).eval()
    detached = _module(aggregator).eval()
    detached.backprop_through_tree = False
    context.requires_grad_()
    state = detached.build(context, coords, key_padding_mask=mask)
    # Same values: detaching changes gradients only.
    torch.testing.assert_close(state.nodes, through.build(context, coords, key_padding_mask=mask).nodes)
    G = state.tree.leaf_offset
    internal, leaves = state.nodes[:, :G], state.nodes[:, G:]
    internal_params = list(detached.aggregate.parameters()) if aggregator == "transformer" else []
    grads = torch.autograd.grad(internal.sum(), [context, *internal_params], allow_unused=True, retain_graph=True)
    assert grads[0] is None or grads[0].abs().sum() == 0
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1:])  # the aggregator still learns
    (leaf_grad,) = torch.autograd.grad(leaves.sum(), context)
    assert leaf_grad[~mask].abs().sum() > 0
    # With backprop through the tree the internal nodes do reach the context.
    (through_grad,) = torch.autograd.grad(through.build(context, coords, key_padding_mask=mask).nodes[:, :G].sum(),
                                          context)
    assert through_grad[~mask].abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(branching=1), "branching must be an int >= 2, got 1"),
        (dict(aggregator="max"), "unknown aggregator 'max'; choose one of mean, transformer"),
        (dict(dim=18), "dim=18 must be divisible by num_heads=4"),
        (dict(num_heads=0), "num_heads must be a positive int, got 0"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    args = {"dim": DIM, "num_heads": HEADS, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TreeCrossAttention(**args)


def test_bad_call_arguments():
    module = _module()
    context, coords, query, mask = _inputs()
    with pytest.raises(ValueError, match=r"context must be \[B, L, 16\], got \(2, 37, 8\)"):
        module.build(context[..., :8], coords)
    with pytest.raises(ValueError, match=r"coords must be \[B, N, C\] or \[B, N\] with \[B, N\] = \[2, 37\]"):
        module.build(context, coords[:, :10])
    state = module.build(context, coords, key_padding_mask=mask)
    with pytest.raises(ValueError, match=r"query must be \[B, L, 16\]"):
        module(query[0], state)
    with pytest.raises(TypeError, match="tree_state must come from build"):
        module(query, (state.tree, state.node_k))
    with pytest.raises(ValueError, match="unknown policy 'best'"):
        module(query, state, policy="best")
    log_prob = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"entropy \(2, 4\) and log_prob \(2, 5\) must have the same shape"):
        tca_loss(torch.tensor(0.0), torch.tensor(0.0), log_prob, log_prob, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"reward \(3,\) must broadcast to log_prob \(2, 5\)"):
        tca_loss(torch.tensor(0.0), torch.tensor(0.0), torch.zeros(3), log_prob, log_prob)
    with pytest.raises(ValueError, match=r"task_loss_ca must be a scalar tensor, got \(2, 5\)"):
        tca_loss(torch.tensor(0.0), log_prob, log_prob, log_prob, log_prob)
