"""Tree construction of Tree Cross Attention (docs/spec.md §3 "Build"): sort, pad, group, balanced b-ary tree.

Node id layout
--------------
All nodes of a tree live on **one node axis** of size ``tree.num_nodes``, in level order, so that
``node_k``/``node_v`` are plain ``[B, H, num_nodes, D]`` tensors and a selected id can point at an
internal node, a group node or a single token alike. With ``b = branching``, ``k = height`` and
``P = group_size``:

* ``0`` is the root; level ``l`` (``0 ≤ l ≤ k``) holds the ``b^l`` ids ``[o_l, o_l + b^l)`` with
  ``o_l = (b^l − 1)/(b − 1)`` (``tree.level_offset(l)``, ``tree.level_offsets[l]``).
* The children of a node ``n`` above the groups are ``b·n + 1 + j`` for ``j < b`` (the usual heap
  layout), its parent ``(n − 1) // b``.
* Level ``k`` holds the ``b^k`` *group* nodes; group ``g`` (id ``o_k + g``) has as children the ``P``
  leaf slots ``g·P … g·P + P − 1``.
* Leaf slot ``s`` has id ``G + s``, where ``G = o_{k+1} = tree.leaf_offset`` is the number of
  internal and group nodes; so ``num_nodes = G + P·b^k``.
* For ``k = 0`` (``N ≤ b``, or ``N = 1``) the root is the only group and its ``P = N`` leaves are
  everything a query reads.

Example, ``b = 2``, ``N = 5``: ``k = 2``, ``P = 2``; root 0, level 1 ids 1–2, groups 3–6, leaf slots
ids 7–14 (group 3 owns ids 7, 8; group 6 owns 13, 14).

Leaf slot ``s`` holds token ``tree.leaf_token[:, s]`` of the caller's order (``-1`` for the
``P·b^k − N`` padding slots); ``tree.token_leaf`` is the inverse map. A node is padding
(``tree.node_padding_mask``, True = padding, as ``key_padding_mask`` in docs/spec.md §0) iff all its children
are; a leaf is padding iff it is a padding slot or a masked token. The structure (``k``, ``P``, ids)
depends on ``N`` only — the padded token count of the batch — so it is shared by the batch entries;
masked tokens are sorted to the end and only change the masks.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.utils.validation import is_int_scalar

# Sort keys with an exact order-preserving 32-bit code, and the room left for the token index.
_PACKABLE_KEYS = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int16, torch.int8, torch.uint8,
                  torch.bool)
_INDEX_BITS = 30


def tree_height_and_group_size(n: int, branching: int) -> Tuple[int, int]:
    """``(k, P)`` of docs/spec.md §3: ``k = floor(log(n − 1) / log b)``, ``P = ceil(n / b^k)``; ``(0, 1)`` for n = 1.

    Computed in integers: the float formula misrounds at exact powers (``log(243)/log(3) < 5``).
    """
    branching = _check_branching(branching)
    if not is_int_scalar(n) or n < 1:
        raise ValueError(f"attn_ext: the number of tokens must be a positive int, got {n!r}")
    n = int(n)
    k = 0
    while branching ** (k + 1) <= n - 1:
        k += 1
    return k, -(-n // branching**k)


def tree_num_selected(n: int, branching: int = 2) -> int:
    """Size of the selected set ``|S| = k(b − 1) + P`` of a tree over ``n`` tokens (docs/spec.md §3).

    Examples
    --------
    >>> from attn_ext.ops.tree import tree_num_selected
    >>> [tree_num_selected(n, 2) for n in (128, 256, 512)]
    [8, 9, 10]
    """
    k, p = tree_height_and_group_size(n, branching)
    return k * (branching - 1) + p


def _check_branching(branching: int) -> int:
    """``branching`` as a Python int (NumPy integers accepted, as for every int argument); >= 2."""
    if not is_int_scalar(branching) or branching < 2:
        raise ValueError(f"attn_ext: branching must be an int >= 2, got {branching!r}")
    return int(branching)


class Tree(NamedTuple):
    """A balanced b-ary tree over the tokens of each batch entry (see the module docstring for ids).

    Attributes
    ----------
    leaf_token : Tensor
        Long ``[B, L]``, ``L = P·b^k``: the caller's token index at each leaf slot, ``-1`` for padding slots.
    token_leaf : Tensor
        Long ``[B, N]``: the leaf slot of each token (inverse of ``leaf_token``).
    node_padding_mask : Tensor
        Bool ``[B, num_nodes]``, True = padding (no valid token below); masks everywhere.
    level_offsets : Tensor
        Long ``[k + 2]``: first id of levels ``0 … k`` and of the leaves; ``level_offsets[-1] = G``.
    axis : Tensor
        Long ``[B]``: the coordinate each entry was sorted along (``-1`` when a sort key was given).
    branching, height, group_size, num_tokens : int
        ``b``, ``k``, ``P`` and ``N``.
    """

    leaf_token: Tensor
    token_leaf: Tensor
    node_padding_mask: Tensor
    level_offsets: Tensor
    axis: Tensor
    branching: int
    height: int
    group_size: int
    num_tokens: int

    @property
    def num_groups(self) -> int:
        return self.branching**self.height

    @property
    def num_leaves(self) -> int:
        return self.group_size * self.num_groups

    @property
    def leaf_offset(self) -> int:
        """Id of leaf slot 0, i.e. the number of internal and group nodes ``G``."""
        return (self.branching ** (self.height + 1) - 1) // (self.branching - 1)

    @property
    def num_nodes(self) -> int:
        return self.leaf_offset + self.num_leaves

    @property
    def num_selected(self) -> int:
        return self.height * (self.branching - 1) + self.group_size

    @property
    def batch_size(self) -> int:
        return self.leaf_token.shape[0]

    @property
    def device(self) -> torch.device:
        return self.node_padding_mask.device

    def level_offset(self, level: int) -> int:
        """First id of ``level`` (``0 … height``; ``height + 1`` gives the leaf offset), as a Python int."""
        return (self.branching**level - 1) // (self.branching - 1)

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "Tree":
        """The same tree with its tensors on ``device`` (the ints are kept)."""
        moved = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in ("leaf_token", "token_leaf", "node_padding_mask", "level_offsets", "axis")
        }
        return self._replace(**moved)


def token_leaf_of(leaf_token: Tensor, num_tokens: int) -> Tensor:
    """Inverse map ``[B, num_tokens]`` of ``leaf_token [B, L]`` (``-1`` at padding slots), as ``Tree.token_leaf``."""
    B, L = leaf_token.shape
    slots = torch.arange(L, device=leaf_token.device).expand(B, L)
    # The padding slots all land in an extra column, dropped afterwards.
    inverse = leaf_token.new_full((B, num_tokens + 1), -1)
    inverse.scatter_(1, torch.where(leaf_token >= 0, leaf_token, num_tokens), slots)
    return inverse[:, :num_tokens]


def build_tree(
    points: Tensor,
    *,
    branching: int = 2,
    key_padding_mask: Optional[Tensor] = None,
    axis: Optional[int] = None,
) -> Tree:
    """Organise the N tokens of each batch entry into a balanced b-ary tree (docs/spec.md §3 "Build").

    Tokens are sorted along one coordinate (the paper's split of 1-D data by x, of images along one
    pixel axis), padded to ``P·b^k`` leaves, grouped in runs of ``P`` consecutive leaves, and a
    balanced b-ary tree is put over the ``b^k`` groups. Fully vectorised: two stable sorts and
    reshapes, a loop over the ``k`` levels only; O(N log N).

    Parameters
    ----------
    points : Tensor
        ``[B, N, C]`` coordinates, or ``[B, N]`` a sort key used as is. Any real dtype.
    branching : int
        ``b >= 2``.
    key_padding_mask : Tensor, optional
        Bool ``[B, N]``, True = padding. Masked tokens are sorted after the valid ones and are
        masked in the tree. Every batch entry needs at least one valid token.
    axis : int, optional
        Coordinate of ``[B, N, C]`` points to sort along; default: per batch entry, the coordinate of
        largest spread (max − min over the valid tokens). Must be None for a ``[B, N]`` key.

    Returns
    -------
    Tree

    Raises
    ------
    ValueError
        ``branching < 2``, wrong ranks or shapes, ``N = 0``, a bad ``axis``, a batch entry
        without valid tokens, or a NaN/±inf coordinate of a valid token (the tree's shape would depend
        on how NaN sorts; masked tokens may hold anything). ``TypeError`` for a non-tensor input or a
        non-bool mask.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.ops.tree import build_tree
    >>> tree = build_tree(torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7]]), branching=2)
    >>> tree.height, tree.group_size, tree.num_nodes   # 4 groups of 2 leaves: 7 tree nodes + 8 leaves
    (2, 2, 15)
    >>> tree.leaf_token.tolist()                       # token indices sorted by key, then padding
    [[1, 3, 0, 4, 2, -1, -1, -1]]
    >>> tree.node_padding_mask.tolist()
    [[False, False, False, False, False, False, True, False, False, False, False, False, True, True, True]]
    """
    branching = _check_branching(branching)
    key, chosen_axis = _sort_key(points, key_padding_mask, axis)
    B, N = key.shape
    k, P = tree_height_and_group_size(N, branching)
    device = key.device
    pad = key_padding_mask if key_padding_mask is not None else torch.zeros(B, N, dtype=torch.bool, device=device)

    order = _token_order(key, key_padding_mask)

    L = P * branching**k
    leaf_token = torch.cat([order, order.new_full((B, L - N), -1)], dim=1)
    token_leaf = torch.empty_like(order).scatter_(1, order, torch.arange(N, device=device).expand(B, N))
    leaf_pad = torch.cat([pad.gather(1, order), pad.new_ones(B, L - N)], dim=1)

    # Masks bottom-up: groups from their P leaves, then each level from its b children.
    levels = [leaf_pad.view(B, branching**k, P).all(dim=-1)]
    for level in range(k - 1, -1, -1):
        levels.append(levels[-1].view(B, branching**level, branching).all(dim=-1))
    node_padding_mask = torch.cat([*reversed(levels), leaf_pad], dim=1)

    offsets = torch.tensor([(branching**lv - 1) // (branching - 1) for lv in range(k + 2)], device=device)
    return Tree(leaf_token, token_leaf, node_padding_mask, offsets, chosen_axis, branching, k, P, N)


def _numpy():
    """numpy if installed (not a requirement of attn_ext: without it the sort is torch's, slower)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _token_order(key: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Token indices ``[B, N]`` sorted by (is padding, key), ties in index order: valid tokens first."""
    B, N = key.shape
    key = key.detach()  # positions may carry grad; the order is discrete
    if key.dtype in _PACKABLE_KEYS and N <= 2**_INDEX_BITS:
        # Distinct int64s (padding bit, 32-bit key code, index) sort like the lexicographic stable
        # sort, in one unstable sort; on CPU numpy's (SIMD quicksort) is ~10x faster than torch's.
        packed = (_key_code(key) << _INDEX_BITS) | torch.arange(N, device=key.device)
        if key_padding_mask is not None:
            packed |= key_padding_mask.long() << (32 + _INDEX_BITS)
        numpy = _numpy()
        if packed.device.type == "cpu" and numpy is not None:
            packed = torch.from_numpy(numpy.sort(packed.numpy(), axis=1))
        else:
            packed = torch.sort(packed, dim=1).values
        return packed & (2**_INDEX_BITS - 1)
    order = torch.sort(key, dim=1, stable=True).indices
    if key_padding_mask is None:
        return order
    # Two stable sorts = the lexicographic sort, without overwriting the key with a sentinel that a
    # legitimately infinite key could equal.
    return order.gather(1, torch.sort(key_padding_mask.gather(1, order).to(torch.uint8), dim=1, stable=True).indices)


def _key_code(key: Tensor) -> Tensor:
    """int64 in ``[0, 2^32)`` ordered as ``torch.sort`` orders ``key``: −0 ties +0, every NaN ties and comes last."""
    if not key.is_floating_point():
        return key.long() + 2**31
    x = key.float() + 0.0  # -0.0 + 0.0 = +0.0
    x = torch.where(torch.isnan(x), torch.nan, x)  # one positive NaN, above +inf
    bits = x.view(torch.int32).long()
    # IEEE sign-magnitude to two's-complement order: negatives reversed below the positives.
    return torch.where(bits < 0, ~bits, bits + 2**31)


def _check_finite(points: Tensor, key_padding_mask: Optional[Tensor]) -> None:
    """Every coordinate of every valid token must be finite: NaN would choose the sort axis (it wins
    the spreads' argmax) and its place in the order, so one NaN would reshape the whole tree."""
    if not points.is_floating_point() or points.device.type == "meta":
        return
    bad = ~torch.isfinite(points.detach())
    if bad.dim() == 3:
        bad = bad.any(dim=2)
    if key_padding_mask is not None:
        bad = bad & ~key_padding_mask
    entries = bad.any(dim=1)
    if bool(entries.any()):
        raise ValueError(
            f"attn_ext.build_tree: batch entries {entries.nonzero().flatten().tolist()} have a NaN or infinite "
            "coordinate at a valid token; coordinates must be finite (mask such tokens with key_padding_mask)"
        )


def _sort_key(points: Tensor, key_padding_mask: Optional[Tensor], axis: Optional[int]) -> Tuple[Tensor, Tensor]:
    """Validated ``([B, N] sort key, [B] axis)``."""
    if not isinstance(points, Tensor):
        raise TypeError(f"attn_ext.build_tree: points must be a torch.Tensor, got {type(points).__name__}")
    if points.dim() not in (2, 3):
        raise ValueError(
            f"attn_ext.build_tree: points must be [B, N, C] coordinates or a [B, N] sort key, got {tuple(points.shape)}"
        )
    if points.is_complex():
        raise TypeError(f"attn_ext.build_tree: points must be real, got {points.dtype}")
    B, N = points.shape[:2]
    if N == 0:
        raise ValueError(f"attn_ext.build_tree: cannot build a tree over N = 0 tokens (points {tuple(points.shape)})")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"attn_ext.build_tree: key_padding_mask must be a bool tensor (True = padding), got {got}")
        if tuple(key_padding_mask.shape) != (B, N):
            raise ValueError(
                f"attn_ext.build_tree: key_padding_mask must be [B, N] = {[B, N]} for points {tuple(points.shape)}, "
                f"got {list(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != points.device:
            raise RuntimeError(
                f"attn_ext.build_tree: key_padding_mask is on {key_padding_mask.device} but points on {points.device}"
            )
        if points.device.type != "meta":
            empty = key_padding_mask.all(dim=1).nonzero().flatten().tolist()
            if empty:
                raise ValueError(
                    f"attn_ext.build_tree: batch entries {empty} have no valid token (key_padding_mask all True); "
                    "a tree needs at least one"
                )
    _check_finite(points, key_padding_mask)
    if points.dim() == 2:
        if axis is not None:
            raise ValueError(f"attn_ext.build_tree: axis must be None for a [B, N] sort key, got axis={axis!r}")
        return points, torch.full((B,), -1, dtype=torch.long, device=points.device)
    C = points.shape[2]
    if axis is not None:
        if not is_int_scalar(axis) or not -C <= axis < C:
            raise ValueError(
                f"attn_ext.build_tree: axis must be an int in [-{C}, {C}) for points {tuple(points.shape)}, "
                f"got {axis!r}"
            )
        axis = int(axis)
        return points[:, :, axis], torch.full((B,), axis % C, dtype=torch.long, device=points.device)
    if C == 0:
        raise ValueError(f"attn_ext.build_tree: points {tuple(points.shape)} have no coordinate to sort along")
    if C == 1:  # nothing to choose: skip the spread's passes over the points
        return points[:, :, 0], torch.zeros(B, dtype=torch.long, device=points.device)
    valid = torch.ones(B, N, 1, dtype=torch.bool, device=points.device)
    if key_padding_mask is not None:
        valid = ~key_padding_mask[:, :, None]
    # Spread over valid tokens only: padding rows are often zeros and would fake a spread.
    x = points if points.is_floating_point() else points.double()
    hi = torch.where(valid, x, x.new_tensor(-torch.inf)).amax(dim=1)
    lo = torch.where(valid, x, x.new_tensor(torch.inf)).amin(dim=1)
    chosen = (hi - lo).argmax(dim=1)
    return points.gather(2, chosen[:, None, None].expand(B, N, 1)).squeeze(2), chosen
