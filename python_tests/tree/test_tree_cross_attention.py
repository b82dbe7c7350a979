"""Retrieval + attention of Tree Cross Attention (attn_ext.tree.tree_cross_attention, docs/spec.md §3)."""
import math

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.tree import build_tree, tree_aggregate, tree_cross_attention, tree_num_selected
from _trees import children_of


def setup(B=2, H=3, M=5, N=20, b=2, D=4, Dv=3, masked=False, seed=0, dtype=torch.float64):
    """A tree over random 1-D points and node keys/values aggregated (mean) from random token keys/values."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[:, -1] = False
    tree = build_tree(torch.rand(B, N, 1, generator=g, dtype=dtype), branching=b, key_padding_mask=mask)
    k = torch.randn(B, H, N, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, N, Dv, generator=g, dtype=dtype)
    q = torch.randn(B, H, M, D, generator=g, dtype=dtype)

    def nodes(x):  # [B, H, N, E] -> [B, H, num_nodes, E] through tree_aggregate's [B, N, H*E] layout
        E = x.shape[-1]
        flat = tree_aggregate(tree, x.permute(0, 2, 1, 3).reshape(B, N, H * E))
        return flat.view(B, tree.num_nodes, H, E).permute(0, 2, 1, 3)

    return tree, q, k, v, nodes(k), nodes(v), mask


def brute_force_descent(tree, q, node_k, node_v, scale):
    """Algorithm 1 of the paper for one query at a time, in plain Python."""
    B, H, M, _ = q.shape
    pad = tree.node_padding_mask
    selected, log_probs, entropies, outs = [], [], [], []
    for e in range(B):
        for m in range(M):
            node, S, log_prob, entropy = 0, [], 0.0, 0.0
            for _ in range(tree.height):
                kids = children_of(tree, node)
                valid = [c for c in kids if not bool(pad[e, c])]
                pi = {c: 0.0 for c in kids}
                for h in range(H):
                    w = torch.softmax(torch.stack([q[e, h, m] @ node_k[e, h, c] * scale for c in valid]), 0)
                    for c, wc in zip(valid, w.tolist()):
                        pi[c] += wc / H
                choice = max(kids, key=lambda c: pi[c])
                log_prob += math.log(pi[choice])
                entropy -= sum(p * math.log(p) for p in pi.values() if p > 0)
                S += [c for c in kids if c != choice]
                node = choice
            S += children_of(tree, node) if tree.height > 0 else list(range(tree.leaf_offset, tree.num_nodes))
            out = torch.zeros(H, node_v.shape[-1], dtype=q.dtype)
            valid = [c for c in S if not bool(pad[e, c])]
            for h in range(H):
                w = torch.softmax(torch.stack([q[e, h, m] @ node_k[e, h, c] * scale for c in valid]), 0)
                out[h] = sum(wc * node_v[e, h, c] for c, wc in zip(valid, w))
            selected.append(S), log_probs.append(log_prob), entropies.append(entropy), outs.append(out)
    S = len(selected[0])
    return (torch.tensor(selected).view(B, M, S), torch.tensor(log_probs, dtype=q.dtype).view(B, M),
            torch.tensor(entropies, dtype=q.dtype).view(B, M), torch.stack(outs).view(B, M, H, -1).transpose(1, 2))


@pytest.mark.parametrize("N,b,masked", [(1, 2, False), (2, 2, False), (20, 2, False), (20, 2, True), (33, 3, True),
                                        (64, 4, False), (50, 4, True)])
def test_greedy_equals_brute_force_descent(N, b, masked):
    tree, q, _, _, node_k, node_v, _ = setup(N=N, b=b, masked=masked, seed=N + b)
    res = tree_cross_attention(q, node_k, node_v, tree, policy="greedy")
    sel, log_prob, entropy, out = brute_force_descent(tree, q, node_k, node_v, 1 / math.sqrt(q.shape[-1]))
    assert torch.equal(res.selected, sel)
    torch.testing.assert_close(res.log_prob, log_prob, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.entropy, entropy, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res.out, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("N,b,masked", [(1, 2, False), (7, 2, False), (128, 2, False), (100, 3, False),
                                        (256, 4, False), (77, 2, True), (90, 5, True)])
def test_selected_set_covers_every_valid_token_exactly_once(N, b, masked, policy):
    tree, q, _, _, node_k, node_v, mask = setup(B=2, M=6, N=N, b=b, masked=masked, seed=N)
    res = tree_cross_attention(q, node_k, node_v, tree, policy=policy, generator=torch.Generator().manual_seed(1))
    assert res.selected.shape[-1] == tree_num_selected(N, b) == tree.num_selected
    pad = tree.node_padding_mask
    for e in range(2):
        for m in range(6):
            S = set(res.selected[e, m].tolist())
            assert len(S) == tree.num_selected, "no node selected twice"
            for t in range(N):
                if mask is not None and bool(mask[e, t]):
                    continue
                node, covering = tree.leaf_offset + int(tree.token_leaf[e, t]), 0
                while True:  # the token itself and each of its ancestors
                    covering += node in S
                    if node == 0:
                        break
                    node = (node - 1) // b if node < tree.leaf_offset else \
                        tree.level_offset(tree.height) + (node - tree.leaf_offset) // tree.group_size
                assert covering == 1, f"token {t} of entry {e} covered {covering} times by {sorted(S)}"
            if policy == "greedy" or not masked:
                continue
            # A sampled path never enters a padding node (π is 0 there).
            assert not bool(pad[e, res.selected[e, m, -tree.group_size:]].all())


@pytest.mark.parametrize("N,b,masked", [(20, 2, False), (37, 3, True), (3, 4, False), (2, 2, True)])
def test_full_policy_and_height_zero_equal_cross_attention_over_valid_tokens(N, b, masked):
    tree, q, k, v, node_k, node_v, mask = setup(N=N, b=b, masked=masked, seed=3)
    expected = ae.cross_attention(q, k, v, key_padding_mask=mask, backend="reference")
    policies = ["full"] + (["greedy", "sample"] if tree.height == 0 else [])
    for policy in policies:
        res = tree_cross_attention(q, node_k, node_v, tree, policy=policy)
        torch.testing.assert_close(res.out, expected, rtol=1e-12, atol=1e-12)
        assert not bool(res.log_prob.any()) and not bool(res.entropy.any())
        assert bool((res.selected >= tree.leaf_offset).all())


def group_probabilities(tree, q, node_k, scale):
    """Brute-force probability of reaching each group of the tree for the single query q[0, :, 0]."""
    H = q.shape[1]
    pad = tree.node_padding_mask[0]
    probs = []
    for g in range(tree.num_groups):
        node, prob = tree.level_offset(tree.height) + g, 1.0
        while node:
            parent = (node - 1) // tree.branching
            valid = [c for c in children_of(tree, parent) if not bool(pad[c])]
            pi = sum(torch.softmax(torch.stack([q[0, h, 0] @ node_k[0, h, c] * scale for c in valid]), 0)
                     for h in range(H)) / H
            prob *= float(pi[valid.index(node)]) if node in valid else 0.0
            node = parent
        probs.append(prob)
    return torch.tensor(probs, dtype=torch.float64)


def test_sampled_paths_follow_the_policy():
    """Chi-square goodness of fit of the sampled groups against Π_t π(a_t|s_t), fixed seed (deterministic)."""
    tree, q, _, _, node_k, node_v, _ = setup(B=1, H=2, M=1, N=16, b=2, D=2, seed=5)  # k = 3, P = 2: 8 full groups
    draws = 8000
    q = (q * 0.6).expand(1, 2, draws, 2)  # one query drawn many times; scaled so no path is negligible
    res = tree_cross_attention(q, node_k, node_v, tree, policy="sample", generator=torch.Generator().manual_seed(0))
    group = (res.selected[0, :, -1] - tree.leaf_offset) // tree.group_size
    expected_prob = group_probabilities(tree, q, node_k, 1 / math.sqrt(2))
    assert abs(float(expected_prob.sum()) - 1) < 1e-12
    # The reported log_prob of each draw is the log-probability of its path.
    torch.testing.assert_close(res.log_prob[0], expected_prob[group].log(), rtol=1e-12, atol=1e-12)
    expected = draws * expected_prob
    assert float(expected.min()) >= 5, f"chi-square needs >= 5 expected draws per cell: {expected.tolist()}"
    observed = torch.bincount(group, minlength=tree.num_groups).double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (  # the 0.999 quantile of chi-square with 7 degrees of freedom
        f"chi-square {chi2:.2f} >= 24.32 (df = 7, p = 0.001): {observed.tolist()} vs {expected.tolist()}"
    )


def test_sampling_is_reproducible_with_a_generator():
    tree, q, _, _, node_k, node_v, _ = setup(M=40, N=64)
    a = tree_cross_attention(q, node_k, node_v, tree, policy="sample", generator=torch.Generator().manual_seed(7))
    b = tree_cross_attention(q, node_k, node_v, tree, policy="sample", generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.selected, b.selected) and torch.equal(a.out, b.out)
    c = tree_cross_attention(q, node_k, node_v, tree, policy="sample", generator=torch.Generator().manual_seed(8))
    assert not torch.equal(a.selected, c.selected)


@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_with_a_fixed_greedy_path(masked):
    tree, q, _, _, node_k, node_v, _ = setup(B=2, H=2, M=2, N=7, b=2, D=2, Dv=2, masked=masked, seed=11)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
    path = tree_cross_attention(*inputs, tree).selected

    def fn(q, node_k, node_v):
        res = tree_cross_attention(q, node_k, node_v, tree)
        assert torch.equal(res.selected, path), "perturbation changed the greedy path"
        return res.out, res.log_prob, res.entropy

    assert torch.autograd.gradcheck(fn, inputs)
    res = tree_cross_attention(*inputs, tree)
    grads = torch.autograd.grad(res.log_prob.sum(), inputs[:2])
    assert all(bool(g.abs().sum() > 0) for g in grads), "log_prob reaches q and node_k (REINFORCE)"


def test_float32_and_padding_give_no_nan():
    tree, q, _, _, node_k, node_v, _ = setup(N=50, b=2, masked=True, dtype=torch.float32)
    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, node_k, node_v))
    for policy in ("greedy", "sample", "full"):
        res = tree_cross_attention(*inputs, tree, policy=policy)
        assert res.out.dtype == torch.float32
        loss = res.out.sum() + res.log_prob.sum() + res.entropy.sum()
        grads = torch.autograd.grad(loss, inputs)
        assert all(bool(torch.isfinite(t).all()) for t in (res.out, res.log_prob, res.entropy, *grads)), policy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    tree, q, _, _, node_k, node_v, _ = setup(N=40, masked=True, seed=2)
    low = tree_cross_attention(q.to(dtype), node_k.to(dtype), node_v.to(dtype), tree, policy="full")
    exact = tree_cross_attention(*(t.to(dtype).double() for t in (q, node_k, node_v)), tree, policy="full")
    assert low.out.dtype == dtype
    torch.testing.assert_close(low.out.double(), exact.out, rtol=0, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("policy", ["greedy", "full"])
def test_runs_on_meta_tensors(policy):
    """Shapes only, data-independent code paths (what a fake kernel / torch.compile trace needs)."""
    tree = build_tree(torch.randn(2, 10, 2, device="meta"), branching=3)
    q = torch.randn(2, 3, 4, 5, device="meta")
    nodes = torch.randn(2, 3, tree.num_nodes, 5, device="meta")
    res = tree_cross_attention(q, nodes, nodes, tree, policy=policy)
    S = tree.num_selected if policy == "greedy" else tree.num_leaves
    assert res.out.shape == (2, 3, 4, 5) and res.selected.shape == (2, 4, S) and res.log_prob.shape == (2, 4)


def test_bad_inputs_raise_clear_errors():
    tree, q, _, _, node_k, node_v, _ = setup(N=20)
    n = tree.num_nodes
    cases = [
        (dict(policy="beam"), ValueError, "unknown policy 'beam'"),
        (dict(node_k=node_k[:, :, :-1]), ValueError, rf"node_k must be \[B, H, num_nodes, D\] = \[2, 3, {n}, 4\]"),
        (dict(q=q[:1]), ValueError, "the tree has 2 batch entries but q"),
        (dict(q=q[..., :3]), ValueError, r"node_k must be \[B, H, num_nodes, D\]"),
        (dict(q=q[0]), ValueError, "must be 4-D"),
        (dict(q=q.float()), TypeError, "must share a floating dtype"),
        (dict(tree=tuple(tree)), TypeError, "tree must be an attn_ext Tree"),
        (dict(tree=tree.to("meta")), RuntimeError, "must be on one device"),
        (dict(scale=math.inf), ValueError, "scale must be a finite float"),
        (dict(generator=0), TypeError, "generator must be a torch.Generator"),
    ]
    for override, error, match in cases:
        args = dict(q=q, node_k=node_k, node_v=node_v, tree=tree)
        args.update(override)
        kwargs = {key: args.pop(key) for key in ("policy", "scale", "generator") if key in args}
        with pytest.raises(error, match=match):
            tree_cross_attention(args["q"], args["node_k"], args["node_v"], args["tree"], **kwargs)
