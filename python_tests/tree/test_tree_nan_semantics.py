"""The NaN/inf rule of the tree family (docs/tree.md, "NaN and infinity") on every backend.

Each case poisons one input of a clean problem and asserts exactly which (batch, head, query) outputs
turn NaN, and that every other output equals the clean run's. The expected masks come from the clean
run's selected sets and the documented node layout, never from the code under test.
"""
import math

import pytest
import torch

from attn_ext.ops.tree import build_tree, masked_mean, tree_aggregate, tree_cross_attention
from attn_ext.ops.tree.naive import tree_cross_attention_reference

from _helpers import require_backend
from _trees import children_of

BACKENDS = ("cpp", "reference", "triton")
CASES = ("q_row", "inf_q", "descent_key", "leaf_key", "node_value", "padded_nodes", "all_padded_entry")
B, H, M, N, D, DV, BRANCHING = 3, 2, 8, 24, 4, 3, 2
NAN = float("nan")
# The Triton interpreter runs on numpy, which warns on the NaN arithmetic these cases are about.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def setup(seed=0):
    """A tree with padded tokens (so padding leaves and a padding group exist), keys, values, queries."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, N, generator=g) < 0.3
    mask[:, :2] = False
    mask[2, -8:] = True  # a whole padded subtree in batch entry 2
    tree = build_tree(torch.rand(B, N, 1, generator=g), branching=BRANCHING, key_padding_mask=mask)
    nodes = tree_aggregate(tree, torch.randn(B, N, H * (D + DV), generator=g))
    nodes = nodes.view(B, tree.num_nodes, H, D + DV).permute(0, 2, 1, 3)
    node_k, node_v = nodes[..., :D].contiguous(), nodes[..., D:].contiguous()
    q = torch.randn(B, H, M, D, generator=g)
    uniforms = torch.rand(B, M, tree.height, generator=g)
    return tree, q, node_k, node_v, uniforms


def run(backend, q, node_k, node_v, tree, policy, uniforms):
    """``(out, lse or None, selected, log_prob, entropy)``; the reference has no lse output."""
    scale = 1 / math.sqrt(D)
    u = uniforms if policy == "sample" else None
    if backend == "reference":
        res = tree_cross_attention_reference(q, node_k, node_v, tree, policy, scale, u)
        return res.out, None, res.selected, res.log_prob, res.entropy
    args = (q, node_k, node_v, tree.node_padding_mask, tree.branching, tree.height, tree.group_size, scale, u)
    if backend == "cpp":
        return torch.ops.attn_ext.tree_cross_attention_fwd(*args)
    from attn_ext.ops.tree.triton_fwd import tree_cross_attention_fwd_triton
    return tree_cross_attention_fwd_triton(*args)


def leftmost_valid_path(tree, pad):
    """Selected set of a descent that takes the first valid child at every level (a NaN policy's rule)."""
    node, rejected = 0, []
    for _ in range(tree.height):
        children = children_of(tree, node)
        chosen = next(c for c in children if not pad[c])
        rejected += [c for c in children if c != chosen]
        node = chosen
    return rejected + children_of(tree, node)


def poison(case, tree, q, node_k, node_v, clean_sel):
    """Poisoned copies of the inputs and the expected NaN masks ``(out [B,H,M,Dv], lse [B,H,M], query [B,M])``."""
    q, node_k, node_v, pad = q.clone(), node_k.clone(), node_v.clone(), tree.node_padding_mask.clone()
    out = torch.zeros(B, H, M, DV, dtype=torch.bool)
    lse = torch.zeros(B, H, M, dtype=torch.bool)
    query = torch.zeros(B, M, dtype=torch.bool)  # the descent's outputs: every head, log_prob, entropy
    if case in ("q_row", "inf_q"):
        q[1, 1, 2, 0] = NAN if case == "q_row" else math.inf  # inf·k gives ±inf scores: torch.softmax's NaN
        query[1, 2] = True
    elif case == "descent_key":
        # A key at level 2 below the level-1 node query 0 of entry 0 chose: exactly the queries that
        # chose the same level-1 node score it.
        level1 = [c for c in children_of(tree, 0) if c not in clean_sel[0, 0, : BRANCHING - 1].tolist()][0]
        target = next(c for c in children_of(tree, level1) if not pad[0, c])
        node_k[0, 0, target, 1] = NAN
        for m in range(M):
            query[0, m] = level1 not in clean_sel[0, m, : BRANCHING - 1].tolist()
        assert 0 < int(query[0].sum()) < M, "the case needs queries on both sides of the root"
    elif case in ("leaf_key", "node_value"):
        # A valid leaf of query 0's group (entry 2), or its first valid selected node: read by the
        # attention of exactly the queries whose selected set holds it, in one head.
        ids = clean_sel[2, 0, -tree.group_size:] if case == "leaf_key" else clean_sel[2, 0]
        target = next(n for n in ids.tolist() if not pad[2, n])
        reads = (clean_sel[2] == target).any(dim=-1)
        if case == "leaf_key":
            node_k[2, 1, target, 3] = NAN
            out[2, 1, reads] = True
            lse[2, 1, reads] = True
        else:
            node_v[2, 0, target, 2] = NAN  # one value column: only that column of out
            out[2, 0, reads, 2] = True
    elif case == "padded_nodes":
        node_k[pad[:, None, :].expand(B, H, -1)] = NAN
        node_v[pad[:, None, :].expand(B, H, -1)] = math.inf
    else:  # all_padded_entry: a malformed mask, entry 1 fully padded and holding NaN everywhere
        pad[1] = True
        node_k[1], node_v[1] = NAN, NAN
    out |= query[:, None, :, None]
    lse |= query[:, None, :]
    return q, node_k, node_v, tree._replace(node_padding_mask=pad), out, lse, query


@pytest.mark.parametrize("policy", ["greedy", "sample"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_cross_attention_nan_masks(backend, case, policy):
    tree, q, node_k, node_v, uniforms = setup()
    require_backend(backend, q)
    assert tree.height >= 2 and bool(tree.node_padding_mask[2, 1:tree.leaf_offset].any())
    clean = run(backend, q, node_k, node_v, tree, policy, uniforms)
    q2, k2, v2, tree2, want_out, want_lse, want_query = poison(case, tree, q, node_k, node_v, clean[2])
    out, lse, selected, log_prob, entropy = run(backend, q2, k2, v2, tree2, policy, uniforms)
    other = torch.ones(B, dtype=torch.bool)  # entries compared with the clean run
    if case == "all_padded_entry":  # a query whose nodes are all padding reads nothing, NaN or not
        other[1] = False
        assert bool((out[1] == 0).all()) and (lse is None or bool((lse[1] == -math.inf).all()))
        assert bool((log_prob[1] == -math.inf).all()) and bool((entropy[1] == 0).all())

    assert torch.equal(out.isnan(), want_out), case
    keep = ~want_out & other[:, None, None, None]
    assert torch.equal(out[keep], clean[0][keep]), case
    assert torch.equal(log_prob.isnan(), want_query) and torch.equal(entropy.isnan(), want_query), case
    keep = ~want_query & other[:, None]
    assert torch.equal(log_prob[keep], clean[3][keep]) and torch.equal(entropy[keep], clean[4][keep]), case
    # Queries whose descent saw no NaN take the clean path; a NaN step takes the first valid child.
    assert torch.equal(selected[keep], clean[2][keep]), case
    if case in ("q_row", "inf_q"):  # NaN at every level of query (1, 2)
        assert selected[1, 2].tolist() == leftmost_valid_path(tree, tree.node_padding_mask[1].tolist())
    if lse is not None:
        assert torch.equal(lse.isnan(), want_lse), case
        keep = ~want_lse & other[:, None, None]
        assert torch.equal(lse[keep], clean[1][keep]), case


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_gradients_stay_in_their_batch_entry(backend):
    tree, q, node_k, node_v, _ = setup(seed=1)
    require_backend(backend, q)
    inputs = [t.clone().requires_grad_() for t in (q, node_k, node_v)]

    def grads(poisoned):
        xs = [t.detach().clone() for t in inputs]
        if poisoned:
            xs[1][1, 0, 1:3] = NAN  # both root children of entry 1: every query of it is NaN
        xs = [t.requires_grad_() for t in xs]
        res = tree_cross_attention(*xs, tree, backend=backend)
        assert bool(res.out[1].isnan().all()) == poisoned and not bool(res.out[[0, 2]].isnan().any())
        loss = res.out[[0, 2]].sum() + res.log_prob[[0, 2]].sum() + res.entropy[[0, 2]].sum()
        return torch.autograd.grad(loss, xs)

    for clean, poisoned in zip(grads(False), grads(True)):
        torch.testing.assert_close(poisoned[[0, 2]], clean[[0, 2]], rtol=0, atol=0)


def test_build_tree_refuses_non_finite_coordinates():
    points = torch.rand(3, 10, 2)
    points[1, 4, 1] = NAN
    with pytest.raises(ValueError, match=r"build_tree: batch entries \[1\] .*coordinates must be finite"):
        build_tree(points)
    with pytest.raises(ValueError, match=r"build_tree: batch entries \[1\]"):
        build_tree(points, axis=0)  # a NaN anywhere in a valid token's coordinates
    key = torch.rand(3, 10)
    key[0, 3], key[2, 0] = math.inf, -math.inf
    with pytest.raises(ValueError, match=r"build_tree: batch entries \[0, 2\] .*finite"):
        build_tree(key)
    # Masked tokens may hold anything: the tree is that of any finite stand-in.
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[1, 4] = True
    got = build_tree(points, key_padding_mask=mask)
    want = build_tree(points.nan_to_num(0.25), key_padding_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(got[:5], want[:5]))
    assert build_tree(points.to(torch.int32)).height == want.height  # integers are always finite


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_tree_aggregate_nan_reaches_exactly_the_ancestors(backend):
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(B, N, generator=g) < 0.3
    mask[:, 0] = False
    tree = build_tree(torch.rand(B, N, 1, generator=g), branching=3, key_padding_mask=mask)
    values = torch.randn(B, N, 5, generator=g)
    require_backend(backend, values)
    clean = tree_aggregate(tree, values, backend=backend)
    poisoned = values.clone()
    poisoned[1, 0, 2] = NAN  # a valid token
    poisoned[mask] = NAN  # masked tokens are never read
    got = tree_aggregate(tree, poisoned, backend=backend)
    want = torch.zeros_like(got, dtype=torch.bool)
    slot = int(tree.token_leaf[1, 0])
    node = tree.level_offset(tree.height) + slot // tree.group_size
    want[1, tree.leaf_offset + slot, 2] = True
    while True:  # the group and its ancestors up to the root: parent (n - 1) // b
        want[1, node, 2] = True
        if node == 0:
            break
        node = (node - 1) // tree.branching
    assert torch.equal(got.isnan(), want)
    assert torch.equal(got[~want], clean[~want])


def test_masked_mean_ignores_nan_in_padding_children():
    children = torch.tensor([[[1.0, 2.0], [NAN, math.inf], [3.0, 4.0]]])  # [1, 3 children, E = 2]
    pad = torch.tensor([[False, True, False]])
    assert masked_mean(children, pad).tolist() == [[2.0, 3.0]]
    unmasked = masked_mean(children, torch.tensor([[False, False, False]]))
    assert bool(unmasked[0, 0].isnan()) and unmasked[0, 1] == math.inf  # valid children do propagate


@pytest.mark.parametrize("aggregator", ["transformer", "mean"])
def test_retreever_nan_context_value_poisons_only_its_entry(aggregator):
    from attn_ext.data import GPSampler
    from attn_ext.models import ReTreever

    torch.manual_seed(0)
    model = ReTreever(num_layers=1, aggregator=aggregator).eval()
    batch = GPSampler().sample(3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        clean = model.predict(batch.xc, batch.yc, batch.xt)
        yc = batch.yc.clone()
        yc[1, 5, 0] = NAN
        got = model.predict(batch.xc, yc, batch.xt)
        for stat, ref in ((got.mean, clean.mean), (got.stddev, clean.stddev)):
            assert bool(stat[1].isnan().all()), "the poisoned entry's predictions are NaN, not a finite guess"
            assert torch.equal(stat[[0, 2]], ref[[0, 2]]), "the other entries are untouched"
        # A NaN context position: that entry has no tree order (build_tree refuses it), so ReTreever gives
        # it NaN predictions and builds the others' trees as without it (docs/models.md).
        xc = batch.xc.clone()
        xc[2, 3, 0] = NAN
        got = model.predict(xc, batch.yc, batch.xt)
        for stat, ref in ((got.mean, clean.mean), (got.stddev, clean.stddev)):
            assert bool(stat[2].isnan().all()) and torch.equal(stat[:2], ref[:2])
