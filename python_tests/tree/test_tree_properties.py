"""Property tests of the tree family (build_tree, tree_aggregate, tree_cross_attention) over random shapes.

The fixed-case tests check a few trees; these check what docs/tree.md and docs/spec.md §3 promise at
every shape: B <= 2, 1 <= N <= 40, branching 2..4, 1-D keys or 1..3 coordinates (ties included),
random padding (all but one token included), odd feature dims. Every expected value is computed here
in float64 from the documented node layout (``_trees.children_of``), never by attn_ext's reference
module, and both CPU backends (the fused C++ kernels and the PyTorch reference) are held to it.
Padding is poisoned with NaN/inf throughout: the docs say padding is never read.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae

from _trees import children_of, leaves_below, parent_of

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
NAN = math.nan
# The CPU backends of tree_aggregate and tree_cross_attention (the C++ kernels only where attn_ext._C is built).
BACKENDS = [name for name in ("cpp", "reference") if ae.available_backends(torch.zeros(1))[name] is None]
odd_dims = st.sampled_from([1, 3, 5, 7])


@st.composite
def contexts(draw, min_tokens=1, max_tokens=40, distinct_keys=False, one_valid=False):
    """``(points, mask, branching, axis)``: ``points`` a ``[B, N]`` key or ``[B, N, C]`` coordinates (float64,
    float32, or small integers for ties unless ``distinct_keys``); ``mask`` None or any padding that leaves
    each entry a valid token (``one_valid``: exactly one), masked coordinates poisoned."""
    B, N, b = draw(st.integers(1, 2)), draw(st.integers(min_tokens, max_tokens)), draw(st.integers(2, 4))
    C = draw(st.integers(0, 3))  # 0: a [B, N] sort key
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    shape = (B, N) if C == 0 else (B, N, C)
    kind = "float64" if distinct_keys else draw(st.sampled_from(["float64", "float32", "integers"]))
    points = (torch.randint(-2, 3, shape, generator=g) if kind == "integers"
              else torch.randn(shape, generator=g, dtype=getattr(torch, kind)))
    mask = None
    if one_valid or draw(st.booleans()):
        density = 1.0 if one_valid else draw(st.floats(0.0, 1.0))
        mask = torch.rand(B, N, generator=g) < density
        mask[torch.arange(B), torch.randint(N, (B,), generator=g)] = False  # the docs require a valid token per entry
        points[mask] = 10**6 if kind == "integers" else NAN  # "masked tokens may hold anything"
    axis = draw(st.none() | st.integers(-C, C - 1)) if C else None
    return points, mask, b, axis


def build(points, mask, b, axis=None):
    return ae.build_tree(points, branching=b, key_padding_mask=mask, axis=axis)


def token_mask(mask, B, N):
    return torch.zeros(B, N, dtype=torch.bool) if mask is None else mask


def valid_leaves(tree, mask, e):
    """Leaf ids of entry ``e`` holding a valid token, from ``leaf_token`` and the caller's mask."""
    G = tree.leaf_offset
    return {G + s for s, t in enumerate(tree.leaf_token[e].tolist()) if t >= 0 and not bool(mask[e, t])}


# --- build_tree ---------------------------------------------------------------------------------------


@given(contexts())
def test_leaves_hold_each_token_once_valid_tokens_first_in_key_order(case):
    points, mask, b, axis = case
    tree = build(points, mask, b, axis)
    B, N = points.shape[:2]
    mask = token_mask(mask, B, N)
    k = max([j for j in range(N) if b**j <= N - 1], default=0)  # docs/spec.md §3, by search
    P = -(-N // b**k)
    G = sum(b**j for j in range(k + 1))
    assert (tree.height, tree.group_size, tree.num_tokens, tree.branching) == (k, P, N, b)
    assert (tree.leaf_offset, tree.num_leaves, tree.num_nodes) == (G, P * b**k, G + P * b**k)
    assert tree.num_selected == ae.tree_num_selected(N, b) == k * (b - 1) + P
    assert tree.level_offsets.tolist() == [sum(b**j for j in range(lv)) for lv in range(k + 2)]
    for e in range(B):
        slots = tree.leaf_token[e].tolist()
        assert sorted(t for t in slots if t >= 0) == list(range(N)), "every token in exactly one slot"
        assert slots[N:] == [-1] * (P * b**k - N), "padding slots after the tokens"
        assert [tree.token_leaf[e, t].item() for t in range(N)] == [slots.index(t) for t in range(N)]
        valid = [t for t in range(N) if not mask[e, t]]
        assert sorted(slots[: len(valid)]) == valid, "valid tokens first, masked ones after them"
        if points.dim() == 2:
            assert tree.axis[e] == -1
            key = points[e]
        else:
            coords = points[e, valid].to(F64)
            spread = coords.amax(0) - coords.amin(0)
            chosen = int(tree.axis[e])
            if axis is not None:
                assert chosen == axis % points.shape[2]
            else:  # the largest spread; float32 spreads may round a near-tie either way
                assert spread[chosen] >= spread.max() * (1 - 1e-6), (spread.tolist(), chosen)
            key = points[e, :, chosen]
        keys = key[slots[: len(valid)]].to(F64)
        assert bool((keys[1:] >= keys[:-1]).all()), "valid tokens sorted along the key"


@given(contexts())
def test_node_padding_marks_exactly_the_nodes_without_valid_tokens(case):
    points, mask, b, axis = case
    tree = build(points, mask, b, axis)
    mask = token_mask(mask, *points.shape[:2])
    below = leaves_below(tree)
    for e in range(points.shape[0]):
        valid = valid_leaves(tree, mask, e)
        assert len(valid) == int((~mask[e]).sum()), "each valid token in its own leaf, padding in none"
        want = [not any(leaf in valid for leaf in below[n]) for n in range(tree.num_nodes)]
        assert tree.node_padding_mask[e].tolist() == want
        assert not want[0]


# --- tree_aggregate --------------------------------------------------------------------------------------


def mean_of_valid_children(tree, values, mask):
    """``[B, num_nodes, E]`` float64 by recursion over the layout: a valid leaf's token value, else the mean of
    the valid children (a node without one is 0). This is a mean of means, not the mean of the tokens below:
    a node whose children hold different numbers of valid tokens weights them unequally (docs/tree.md)."""
    B, _, E = values.shape
    out = torch.zeros(B, tree.num_nodes, E, dtype=F64)
    below = leaves_below(tree)
    for e in range(B):
        valid = valid_leaves(tree, mask, e)
        for node in reversed(range(tree.num_nodes)):  # children before their parent
            live = [c for c in children_of(tree, node) if any(leaf in valid for leaf in below[c])]
            if node in valid:
                out[e, node] = values[e, tree.leaf_token[e, node - tree.leaf_offset]].to(F64)
            elif live:
                out[e, node] = out[e, live].mean(0)
    return out


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
@given(case=contexts(), E=odd_dims, seed=st.integers(0, 2**16))
def test_mean_aggregate_is_the_mean_of_the_valid_children(backend, dtype, case, E, seed):
    points, mask, b, axis = case
    tree = build(points, mask, b, axis)
    B, N = points.shape[:2]
    mask = token_mask(mask, B, N)
    values = torch.randn(B, N, E, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    values[mask] = NAN  # masked tokens are never read
    got = ae.tree_aggregate(tree, values, backend=backend)
    assert got.dtype == dtype and got.shape == (B, tree.num_nodes, E)
    want = mean_of_valid_children(tree, values, mask)
    tol = TOL if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.to(F64), want, **tol)
    # Where every leaf below a node holds a valid token, the mean of means is the tokens' plain mean.
    below = leaves_below(tree)
    for e in range(B):
        valid = valid_leaves(tree, mask, e)
        for node, leaves in below.items():
            if all(leaf in valid for leaf in leaves):
                tokens = tree.leaf_token[e, [leaf - tree.leaf_offset for leaf in leaves]]
                torch.testing.assert_close(got[e, node].to(F64), values[e, tokens].to(F64).mean(0), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=contexts(distinct_keys=True), E=odd_dims, seed=st.integers(0, 2**16))
def test_aggregate_is_blind_to_the_callers_token_order(backend, case, E, seed):
    points, mask, b, axis = case
    B, N = points.shape[:2]
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, N, E, generator=g, dtype=F64)
    perm = torch.randperm(N, generator=g)
    tree = build(points, mask, b, axis)
    shuffled = build(points[:, perm], None if mask is None else mask[:, perm], b, axis)
    assert torch.equal(shuffled.node_padding_mask, tree.node_padding_mask)
    assert torch.equal(shuffled.axis, tree.axis)
    # Valid slots hold the same tokens under their new indices (masked ones may tie on a poisoned key).
    valid = ~tree.node_padding_mask[:, tree.leaf_offset:]
    assert torch.equal(perm[shuffled.leaf_token.clamp(min=0)][valid], tree.leaf_token[valid])
    torch.testing.assert_close(ae.tree_aggregate(shuffled, values[:, perm], backend=backend),
                               ae.tree_aggregate(tree, values, backend=backend), rtol=0, atol=0)


# --- tree_cross_attention -------------------------------------------------------------------------------


@st.composite
def attention_problems(draw, **context_kw):
    """``(tree, q, node_k, node_v, scale)``: random float64 node keys/values with NaN/inf at padding nodes."""
    points, mask, b, axis = draw(contexts(**context_kw))
    tree = build(points, mask, b, axis)
    B, H, M, D, Dv = points.shape[0], draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(odd_dims), draw(odd_dims)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(B, H, M, D, generator=g, dtype=F64)
    node_k = torch.randn(B, H, tree.num_nodes, D, generator=g, dtype=F64)
    node_v = torch.randn(B, H, tree.num_nodes, Dv, generator=g, dtype=F64)
    pad = tree.node_padding_mask[:, None].expand(B, H, -1)
    node_k[pad], node_v[pad] = NAN, math.inf  # "nodes with node_padding_mask True are never read"
    return tree, q, node_k, node_v, draw(st.none() | st.floats(0.1, 3.0))


def policy(tree, node, pad, q, k, scale):
    """π over the children of ``node`` for one query: head mean of the softmax over the valid children."""
    kids = children_of(tree, node)
    valid = [c for c in kids if not pad[c]]
    scores = torch.einsum("hd,hcd->hc", q, k[:, valid]) * scale
    pi = dict.fromkeys(kids, 0.0)
    for c, p in zip(valid, torch.softmax(scores, dim=-1).mean(0).tolist()):
        pi[c] = p
    return pi


def attend(ids, pad, q, k, v, scale):
    """Per-head softmax attention of one query over the valid nodes among ``ids`` (0 if there are none)."""
    valid = [n for n in ids if not pad[n]]
    if not valid:
        return torch.zeros(q.shape[0], v.shape[-1], dtype=F64)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", q, k[:, valid]) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", weights, v[:, valid])


def read_path(tree, sel, pad):
    """The root-to-group path that ``sel`` encodes, asserting it is a well-formed selected set: the ``b − 1``
    rejected siblings per level root first (in child order), then the ``P`` leaves of the group reached."""
    b, k, P = tree.branching, tree.height, tree.group_size
    parent = parent_of(tree)
    assert len(sel) == len(set(sel)) == k * (b - 1) + P and all(0 <= n < tree.num_nodes for n in sel)
    group = parent[sel[-P]] if k else 0  # for k = 0 the root is the only group
    assert sel[-P:] == children_of(tree, group)
    path = [group]
    while path[-1] != 0:
        path.append(parent[path[-1]])
    path.reverse()
    assert len(path) == k + 1
    for t in range(k):
        assert sel[t * (b - 1):(t + 1) * (b - 1)] == [c for c in children_of(tree, path[t]) if c != path[t + 1]]
    assert not any(pad[n] for n in path), "the descent never enters a padding node (π = 0 there)"
    return path


def statistics(tree, path, pad, q, k, scale):
    """``(Σ log π(a_t), Σ H(π_t))`` along ``path``."""
    log_prob = entropy = 0.0
    for node, chosen in zip(path, path[1:]):
        pi = policy(tree, node, pad, q, k, scale)
        log_prob += math.log(pi[chosen])
        entropy -= sum(p * math.log(p) for p in pi.values() if p > 0)
    return log_prob, entropy


def greedy_selection(tree, pad, q, k, scale):
    """Algorithm 1 with argmax (ties to the first child): the rejected children, then the chosen group's leaves."""
    node, sel = 0, []
    for _ in range(tree.height):
        pi = policy(tree, node, pad, q, k, scale)
        chosen = max(pi, key=pi.get)  # max keeps the first of equal values
        sel += [c for c in pi if c != chosen]
        node = chosen
    return sel + children_of(tree, node)


def check_result(res, tree, q, node_k, node_v, scale, want_selected=None):
    """``res`` against attention over its own (well-formed) selection, and the path's log π and entropy."""
    B, _, M, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    assert not res.out.isnan().any() and not res.log_prob.isnan().any() and not res.entropy.isnan().any()
    for e in range(B):
        pad = tree.node_padding_mask[e].tolist()
        for m in range(M):
            sel = res.selected[e, m].tolist()
            qm, ke, ve = q[e, :, m], node_k[e], node_v[e]
            if want_selected is not None:
                assert sel == want_selected(tree, pad, qm, ke, scale), (e, m)
            path = read_path(tree, sel, pad)
            torch.testing.assert_close(res.out[e, :, m], attend(sel, pad, qm, ke, ve, scale), **TOL)
            log_prob, entropy = statistics(tree, path, pad, qm, ke, scale)
            torch.testing.assert_close(res.log_prob[e, m].item(), log_prob, **TOL)
            torch.testing.assert_close(res.entropy[e, m].item(), entropy, **TOL)


def run_both(q, node_k, node_v, tree, scale, policy_name, seed=0):
    """``{backend: result}`` on the CPU backends, the sampled ones from the same generator state."""
    return {name: ae.tree_cross_attention(q, node_k, node_v, tree, policy=policy_name, scale=scale, backend=name,
                                          generator=torch.Generator().manual_seed(seed)) for name in BACKENDS}


def assert_backends_agree(results):
    first, *others = results.values()
    for res in others:
        assert torch.equal(res.selected, first.selected)
        for got, want in zip(res[:1] + res[2:], first[:1] + first[2:]):
            torch.testing.assert_close(got, want, **TOL)


@given(attention_problems())
def test_greedy_attends_over_the_argmax_path(problem):
    tree, q, node_k, node_v, scale = problem
    results = run_both(q, node_k, node_v, tree, scale, "greedy")
    for res in results.values():
        check_result(res, tree, q, node_k, node_v, scale, want_selected=greedy_selection)
    assert_backends_agree(results)


@given(problem=attention_problems(), seed=st.integers(0, 2**16))
def test_sampled_selection_is_a_root_to_leaf_path_set_read_alike_by_both_backends(problem, seed):
    tree, q, node_k, node_v, scale = problem
    results = run_both(q, node_k, node_v, tree, scale, "sample", seed)
    for res in results.values():
        check_result(res, tree, q, node_k, node_v, scale)
    assert_backends_agree(results)


@given(attention_problems())
def test_full_policy_attends_over_every_valid_token(problem):
    tree, q, node_k, node_v, scale = problem
    B, _, M, D = q.shape
    scale_or_default = 1 / math.sqrt(D) if scale is None else scale
    leaves = list(range(tree.leaf_offset, tree.num_nodes))
    for res in run_both(q, node_k, node_v, tree, scale, "full").values():
        assert res.selected.tolist() == [[leaves] * M] * B
        assert not res.log_prob.any() and not res.entropy.any()
        for e in range(B):
            pad = tree.node_padding_mask[e].tolist()
            for m in range(M):
                want = attend(leaves, pad, q[e, :, m], node_k[e], node_v[e], scale_or_default)
                torch.testing.assert_close(res.out[e, :, m], want, **TOL)


# --- degenerate inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["greedy", "sample", "full"])
@given(attention_problems(max_tokens=1))
def test_one_token_is_its_own_root_group_and_answer(policy_name, problem):
    tree, q, node_k, node_v, scale = problem
    B, _, M, _ = q.shape
    assert (tree.height, tree.group_size, tree.num_nodes, tree.leaf_token.tolist()) == (0, 1, 2, [[0]] * B)
    values = torch.randn(B, 1, 3, dtype=F64)
    for backend in BACKENDS:
        torch.testing.assert_close(ae.tree_aggregate(tree, values, backend=backend), values.expand(B, 2, 3),
                                   rtol=0, atol=0)
    for res in run_both(q, node_k, node_v, tree, scale, policy_name).values():
        assert res.selected.tolist() == [[[1]] * M] * B
        torch.testing.assert_close(res.out, node_v[:, :, 1:2].expand_as(res.out), **TOL)
        assert not res.log_prob.any() and not res.entropy.any()


@pytest.mark.parametrize("policy_name", ["greedy", "sample", "full"])
@given(attention_problems(one_valid=True))
def test_all_but_one_token_padded_reads_that_token(policy_name, problem):
    tree, q, node_k, node_v, scale = problem
    B = q.shape[0]
    leaf = tree.leaf_offset + (~tree.node_padding_mask[:, tree.leaf_offset:]).int().argmax(1)  # [B]
    assert (~tree.node_padding_mask[:, tree.leaf_offset:]).sum(1).tolist() == [1] * B
    values = torch.randn(B, tree.num_tokens, 3, dtype=F64)
    token = tree.leaf_token[torch.arange(B), leaf - tree.leaf_offset]
    for backend in BACKENDS:
        nodes = ae.tree_aggregate(tree, values, backend=backend)
        want = torch.where(tree.node_padding_mask[..., None], 0.0, values[torch.arange(B), token][:, None])
        torch.testing.assert_close(nodes, want, rtol=0, atol=0)
    for res in run_both(q, node_k, node_v, tree, scale, policy_name).values():
        if policy_name != "full":
            assert res.selected[..., -tree.group_size:].eq(leaf[:, None, None]).any(-1).all(), "the path reaches it"
        want = node_v[torch.arange(B), :, leaf][:, :, None].expand_as(res.out)
        torch.testing.assert_close(res.out, want, **TOL)
        assert not res.log_prob.any() and not res.entropy.any(), "π = 1 at every level"


@given(contexts())
def test_build_tree_refuses_a_fully_padded_entry_naming_it(case):
    points, mask, b, _ = case
    B, N = points.shape[:2]
    mask = token_mask(mask, B, N).clone()
    mask[B - 1] = True
    with pytest.raises(ValueError, match=rf"batch entries \[{B - 1}\] have no valid token"):
        ae.build_tree(points, branching=b, key_padding_mask=mask)


@pytest.mark.parametrize("policy_name", ["greedy", "sample", "full"])
@given(attention_problems())
def test_fully_padded_entry_of_a_hand_made_mask_reads_zero(policy_name, problem):
    """build_tree refuses such an entry, but a Tree is a named tuple: a malformed mask is documented to read
    as padding everywhere (aggregate 0, "a query whose selected nodes are all padding gets out = 0")."""
    tree, q, node_k, node_v, scale = problem
    B = q.shape[0]
    pad = tree.node_padding_mask.clone()
    pad[B - 1] = True
    padded = tree._replace(node_padding_mask=pad)
    values = torch.randn(B, tree.num_tokens, 3, dtype=F64)
    for backend in BACKENDS:
        nodes = ae.tree_aggregate(padded, values, backend=backend)
        assert not nodes[B - 1].any()
        torch.testing.assert_close(nodes[:-1], ae.tree_aggregate(tree, values, backend=backend)[:-1], rtol=0, atol=0)
    node_k[B - 1], node_v[B - 1] = NAN, NAN
    clean = run_both(q, node_k, node_v, tree, scale, policy_name, seed=1)
    for name, res in run_both(q, node_k, node_v, padded, scale, policy_name, seed=1).items():
        assert not res.out[B - 1].any() and not res.out.isnan().any(), name
        assert not res.log_prob.isnan().any() and not res.entropy.isnan().any(), name
        assert bool(((res.selected >= 0) & (res.selected < tree.num_nodes)).all()), name
        torch.testing.assert_close(res.out[:-1], clean[name].out[:-1], rtol=0, atol=0)
