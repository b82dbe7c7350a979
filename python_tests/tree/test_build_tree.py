"""Tree construction and aggregation of Tree Cross Attention (attn_ext.ops.tree, docs/spec.md §3 "Build"/"Aggregate")."""
import doctest
import importlib
import math

import pytest
import torch

from attn_ext.ops.tree import build_tree, tree_aggregate, tree_height_and_group_size, tree_num_selected
from _trees import children_of


def make_tree(B, N, b, masked=False, C=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(B, N, C, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = torch.rand(B, N, generator=g) < 0.4
        mask[:, 0] = False  # each entry keeps a valid token
    return build_tree(points, branching=b, key_padding_mask=mask), points, mask


@pytest.mark.parametrize("n,b,expected", [(128, 2, 8), (256, 2, 9), (512, 2, 10), (1, 2, 1), (2, 2, 2), (3, 2, 3),
                                          (256, 4, 13), (244, 3, 12), (243, 3, 11), (1000, 16, 34)])
def test_num_selected_matches_the_spec_formula(n, b, expected):
    assert tree_num_selected(n, b) == expected


def test_height_is_the_floor_of_the_log_for_every_small_n():
    for b in (2, 3, 4, 7):
        for n in range(2, 600):
            k, P = tree_height_and_group_size(n, b)
            assert b**k <= n - 1 < b ** (k + 1), (n, b, k)  # k = floor(log(n-1)/log b), exactly
            assert P == math.ceil(n / b**k) and (P - 1) * b**k < n <= P * b**k


@pytest.mark.parametrize("bad", [1, 0, -2, 2.0, True, "2"])
def test_branching_below_two_is_rejected(bad):
    with pytest.raises(ValueError, match="branching must be an int >= 2"):
        tree_num_selected(16, bad)
    with pytest.raises(ValueError, match="branching must be an int >= 2"):
        build_tree(torch.randn(1, 16), branching=bad)


@pytest.mark.parametrize("B,N,b,masked", [(2, 1, 2, False), (2, 2, 2, False), (3, 13, 2, True), (2, 64, 2, False),
                                          (2, 30, 3, True), (1, 100, 4, True), (2, 17, 16, False)])
def test_layout_masks_and_permutation(B, N, b, masked):
    tree, points, mask = make_tree(B, N, b, masked)
    k, P = tree_height_and_group_size(N, b)
    L = P * b**k
    assert (tree.height, tree.group_size, tree.num_leaves) == (k, P, L)
    assert tree.num_nodes == (b ** (k + 1) - 1) // (b - 1) + L
    assert tree.level_offsets.tolist() == [(b**lv - 1) // (b - 1) for lv in range(k + 2)]
    pad = mask if mask is not None else torch.zeros(B, N, dtype=torch.bool)
    for e in range(B):
        tokens = tree.leaf_token[e].tolist()
        assert sorted(t for t in tokens if t >= 0) == list(range(N)) and tokens[N:] == [-1] * (L - N)
        assert all(tree.leaf_token[e, tree.token_leaf[e, t]] == t for t in range(N))
        axis = int(tree.axis[e])
        valid = [t for t in tokens if t >= 0 and not pad[e, t]]
        assert tokens[: len(valid)] == valid, "valid tokens come first, masked tokens after them"
        keys = points[e, valid, axis]
        assert bool((keys[1:] >= keys[:-1]).all()), "valid tokens sorted along the axis"
        # Masks from the definition: a leaf is padding iff padding slot or masked; a node iff all children are.
        node_pad = tree.node_padding_mask[e].tolist()
        for node in reversed(range(tree.num_nodes)):
            kids = children_of(tree, node)
            if kids:
                assert node_pad[node] == all(node_pad[c] for c in kids), node
            else:
                t = tokens[node - tree.leaf_offset]
                assert node_pad[node] == (t < 0 or bool(pad[e, t])), node
        assert not node_pad[0]


def test_axis_of_largest_spread_and_explicit_axis():
    points = torch.zeros(2, 6, 3)
    points[0, :, 1] = torch.tensor([5.0, 3, 1, 0, 2, 4])        # entry 0 spreads along axis 1
    points[1, :, 2] = torch.tensor([0.0, 1, 2, 3, 4, 5]) * 10   # entry 1 along axis 2
    points[1, :, 0] = torch.tensor([5.0, 4, 3, 2, 1, 0])
    tree = build_tree(points)
    assert tree.axis.tolist() == [1, 2]
    assert tree.leaf_token[0, :6].tolist() == [3, 2, 4, 1, 5, 0]
    assert tree.leaf_token[1, :6].tolist() == [0, 1, 2, 3, 4, 5]
    tree0 = build_tree(points, axis=0)
    assert tree0.axis.tolist() == [0, 0] and tree0.leaf_token[1, :6].tolist() == [5, 4, 3, 2, 1, 0]
    # A masked outlier does not decide the axis.
    points[0, 5, 0] = 1e6
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 5] = True
    assert build_tree(points, key_padding_mask=mask).axis.tolist() == [1, 2]


def test_sort_key_given_directly_and_integer_keys():
    tree = build_tree(torch.tensor([[3, 1, 2, 0]]))
    assert tree.leaf_token.tolist() == [[3, 1, 2, 0]] and tree.axis.tolist() == [-1]


@pytest.mark.parametrize(
    "kwargs,points,error,match",
    [
        ({}, torch.randn(2, 0, 3), ValueError, "N = 0 tokens"),
        ({}, torch.randn(5), ValueError, r"\[B, N, C\] coordinates or a \[B, N\] sort key"),
        ({"key_padding_mask": torch.zeros(2, 4, dtype=torch.bool)}, torch.randn(2, 5, 1), ValueError,
         r"key_padding_mask must be \[B, N\] = \[2, 5\]"),
        ({"key_padding_mask": torch.zeros(2, 5)}, torch.randn(2, 5, 1), TypeError, "must be a bool tensor"),
        ({"key_padding_mask": torch.tensor([[False] * 5, [True] * 5])}, torch.randn(2, 5, 1), ValueError,
         r"batch entries \[1\] have no valid token"),
        ({"axis": 3}, torch.randn(2, 5, 3), ValueError, r"axis must be an int in \[-3, 3\)"),
        ({"axis": 0}, torch.randn(2, 5), ValueError, "axis must be None for a"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, points, error, match):
    with pytest.raises(error, match=match):
        build_tree(points, **kwargs)
    with pytest.raises(TypeError, match="points must be a torch.Tensor"):
        build_tree([[1.0, 2.0]])


def test_tree_moves_between_devices():
    tree, _, _ = make_tree(2, 20, 2, masked=True)
    same = tree.to("cpu")
    assert same.num_nodes == tree.num_nodes and torch.equal(same.node_padding_mask, tree.node_padding_mask)
    meta = tree.to(torch.device("meta"))
    assert meta.device.type == "meta" and meta.leaf_token.shape == tree.leaf_token.shape
    assert (meta.branching, meta.height, meta.group_size, meta.num_tokens) == (2, tree.height, tree.group_size, 20)


def brute_force_aggregate(tree, values, reduce_list):
    """Node values by recursion over the documented layout, one node at a time."""
    B, _, E = values.shape
    out = torch.zeros(B, tree.num_nodes, E, dtype=values.dtype)
    pad = tree.node_padding_mask
    for e in range(B):
        def value(node):
            kids = children_of(tree, node)
            if not kids:
                t = int(tree.leaf_token[e, node - tree.leaf_offset])
                return values[e, t] if not bool(pad[e, node]) else torch.zeros(E, dtype=values.dtype)
            valid = [value(c) for c in kids if not bool(pad[e, c])]
            return reduce_list(valid) if valid else torch.zeros(E, dtype=values.dtype)

        for node in range(tree.num_nodes):
            out[e, node] = value(node)
    return out


@pytest.mark.parametrize("N,b,masked", [(1, 2, False), (13, 2, True), (16, 2, False), (30, 3, True), (40, 4, True)])
def test_mean_aggregate_equals_brute_force_masked_mean(N, b, masked):
    tree, _, _ = make_tree(2, N, b, masked)
    values = torch.randn(2, N, 3, dtype=torch.float64)
    expected = brute_force_aggregate(tree, values, lambda xs: torch.stack(xs).mean(0))
    torch.testing.assert_close(tree_aggregate(tree, values), expected, rtol=1e-12, atol=1e-12)


def test_callable_reduce_gets_children_and_padding_mask():
    tree, _, _ = make_tree(2, 30, 3, masked=True)
    values = torch.randn(2, 30, 4, dtype=torch.float64)

    def masked_max(children, padding_mask):
        assert children.shape[:-1] == padding_mask.shape and children.shape[-2] in (3, tree.group_size)
        return children.masked_fill(padding_mask[..., None], -1e9).amax(dim=-2)

    expected = brute_force_aggregate(tree, values, lambda xs: torch.stack(xs).amax(0))
    torch.testing.assert_close(tree_aggregate(tree, values, reduce=masked_max), expected, rtol=0, atol=0)


def test_aggregate_bad_inputs():
    tree, _, _ = make_tree(2, 10, 2)
    with pytest.raises(ValueError, match=r"leaf_values must be \[B, N, E\] with \[B, N\] = \[2, 10\]"):
        tree_aggregate(tree, torch.randn(2, 11, 3))
    with pytest.raises(ValueError, match="unknown reduce 'max'"):
        tree_aggregate(tree, torch.randn(2, 10, 3), reduce="max")
    with pytest.raises(ValueError, match="reduce must return"):
        tree_aggregate(tree, torch.randn(2, 10, 3), reduce=lambda c, m: c.sum(-1))


def test_aggregate_is_differentiable():
    tree, _, _ = make_tree(1, 9, 2, masked=True)
    values = torch.randn(1, 9, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: tree_aggregate(tree, v), (values,))


def test_docstring_examples_run():
    for name in ("attn_ext.ops.tree", "attn_ext.ops.tree.build", "attn_ext.ops.tree.aggregate",
                 "attn_ext.ops.tree.retrieval"):
        result = doctest.testmod(importlib.import_module(name), raise_on_error=False)
        assert result.attempted > 0 and result.failed == 0, (name, result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.int8, torch.uint8, torch.int64, torch.bool])
@pytest.mark.parametrize("masked", [False, True])
def test_leaf_order_is_the_stable_sort_by_padding_then_key(dtype, masked):
    # build_tree packs (padding, key, index) into one int64 sort for 32-bit keys: it must order
    # exactly as torch's stable sort, including ties, -0 == +0 and, among masked tokens (the only
    # ones allowed a non-finite key), infinities and NaNs last.
    g = torch.Generator().manual_seed(3)
    B, N = 3, 400
    special = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, math.inf, -math.inf, 1e-45, -3e38, 1.0])
    key = torch.randn(B, N, generator=g).round(decimals=1)
    pick = torch.rand(B, N, generator=g) < 0.3
    key[pick] = special[torch.randint(len(special), (int(pick.sum()),), generator=g)]
    mask = torch.rand(B, N, generator=g) < 0.3 if masked else None
    if masked:
        mask[:, 0] = False
    valid = ~mask if masked else torch.ones(B, N, dtype=torch.bool)
    if dtype == torch.bool:
        key = key > 0
    elif not dtype.is_floating_point:
        key = (key.nan_to_num(0, 100, -100) * 10).clamp(0 if dtype == torch.uint8 else -100, 100)
    key = key.to(dtype)  # after the cast: -3e38 overflows float16 to -inf
    if dtype.is_floating_point:
        key = torch.where(valid & ~key.isfinite(), torch.tensor(0.5, dtype=dtype), key)
    pad = mask if masked else torch.zeros(B, N, dtype=torch.bool)
    order = torch.sort(key, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(pad.gather(1, order).to(torch.uint8), dim=1, stable=True).indices)
    assert torch.equal(build_tree(key, key_padding_mask=mask).leaf_token[:, :N], order)


def test_numpy_scalars_are_accepted_like_python_numbers_and_bools_are_not():
    import numpy as np

    from attn_ext.ops.tree import tree_cross_attention, tree_num_selected

    points = torch.rand(2, 9, 2, generator=torch.Generator().manual_seed(0))
    ours, plain = build_tree(points, branching=np.int64(3), axis=np.int64(1)), build_tree(points, branching=3, axis=1)
    assert type(ours.branching) is int and torch.equal(ours.leaf_token, plain.leaf_token)
    assert tree_num_selected(np.int64(100), np.int64(2)) == tree_num_selected(100, 2)
    q, nk, nv = torch.randn(2, 2, 3, 4), torch.randn(2, 2, plain.num_nodes, 4), torch.randn(2, 2, plain.num_nodes, 3)
    torch.testing.assert_close(tree_cross_attention(q, nk, nv, plain, scale=np.float32(0.5)).out,
                               tree_cross_attention(q, nk, nv, plain, scale=0.5).out)
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="branching must be an int >= 2"):
            build_tree(points, branching=bad)
