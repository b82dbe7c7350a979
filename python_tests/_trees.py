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
