"""The import graph of attn_ext/ and bench/ (every import statement, module level or inside a function):
no circles, no arrow that climbs a layer or reaches into a sibling op family's internals, and imports of
our own modules at module top except the Triton kernel modules (docs/architecture.md "Layers")."""
from __future__ import annotations

import textwrap

import pytest

from _import_graph import Edge, circles, climbing_arrows, edges_of, import_graph, late_imports


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_is_the_repository(graph):
    # A parser that finds nothing would pass every rule below.
    assert {"attn_ext.ops.attention.registration", "attn_ext.nn.swap", "bench.__main__"} <= set(graph)
    assert any(e.target == "attn_ext.ops.utils.dispatch" for e in graph["attn_ext.ops.attention.registration"])
    assert sum(map(len, graph.values())) > 1000


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_climbing_arrows(graph):
    found = climbing_arrows(graph)
    assert not found, "arrows that climb:\n" + "\n".join(found)


def test_our_imports_are_at_module_top(graph):
    found = late_imports(graph)
    assert not found, "imports inside functions (move them to the module's top):\n" + "\n".join(found)


def test_the_rules_catch_what_they_forbid(tmp_path):
    # The checker itself, on a made-up graph: a two-module circle, a climb from ops to nn, a reach into a
    # sibling family's internals, and an in-function import of a non-Triton module.
    graph = {
        "attn_ext.ops.tree.a": [Edge("attn_ext.ops.tree.a", "attn_ext.ops.tree.b", 1, False),
                                Edge("attn_ext.ops.tree.a", "attn_ext.ops.attention.naive", 2, False)],
        "attn_ext.ops.tree.b": [Edge("attn_ext.ops.tree.b", "attn_ext.ops.tree.a", 1, True),
                                Edge("attn_ext.ops.tree.b", "attn_ext.nn.swap", 2, False)],
        "attn_ext.ops.attention.naive": [],
        "attn_ext.ops.attention.registration": [
            Edge("attn_ext.ops.attention.registration", "attn_ext.ops.attention.triton_fwd", 9, True)],
        "attn_ext.ops.attention.triton_fwd": [],
        "attn_ext.nn.swap": [],
    }
    assert circles(graph) == [["attn_ext.ops.tree.a", "attn_ext.ops.tree.b"]]
    arrows = climbing_arrows(graph)
    assert len(arrows) == 2
    assert any("attn_ext.nn.swap" in a for a in arrows) and any("sibling family" in a for a in arrows)
    assert late_imports(graph) == ["attn_ext.ops.tree.b:1 imports attn_ext.ops.tree.a inside a function"]


def test_every_form_of_import_is_an_edge(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(textwrap.dedent("""
        import attn_ext.ops.utils.dispatch
        from attn_ext.ops.attention import naive
        from attn_ext.ops.attention.state import AttentionState
        from . import pairs

        def late():
            from .dropout import keep_mask
    """))
    known = {name: None for name in ("attn_ext.ops.utils.dispatch", "attn_ext.ops.attention", "attn_ext.ops.attention.m",
                                     "attn_ext.ops.attention.naive", "attn_ext.ops.attention.state",
                                     "attn_ext.ops.attention.pairs", "attn_ext.ops.attention.dropout")}
    edges = list(edges_of("attn_ext.ops.attention.m", source, known))
    assert [(e.target, e.in_function) for e in edges] == [
        ("attn_ext.ops.utils.dispatch", False), ("attn_ext.ops.attention.naive", False),
        ("attn_ext.ops.attention.state", False), ("attn_ext.ops.attention.pairs", False),
        ("attn_ext.ops.attention.dropout", True)]
