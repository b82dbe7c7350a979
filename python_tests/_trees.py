"""The node layout of attn_ext's trees, written out independently of the code for the tree tests."""


def children_of(tree, node):
    """Brute-force children ids of ``node`` from the documented layout (written independently of the code)."""
    b, k, P = tree.branching, tree.height, tree.group_size
    first_group = sum(b**lv for lv in range(k))
    G = first_group + b**k
    if node >= G:
        return []
    if node >= first_group:
        g = node - first_group
        return [G + g * P + j for j in range(P)]
    return [b * node + 1 + j for j in range(b)]


def leaves_below(tree):
    """``{node: [leaf ids at or below it]}`` for every node, from :func:`children_of`."""
    below = {}
    for node in reversed(range(tree.num_nodes)):  # children have larger ids than their parent
        kids = children_of(tree, node)
        below[node] = [leaf for c in kids for leaf in below[c]] if kids else [node]
    return below


def parent_of(tree):
    """``{node: its parent}`` for every node but the root, from :func:`children_of`."""
    return {c: n for n in range(tree.num_nodes) for c in children_of(tree, n)}
