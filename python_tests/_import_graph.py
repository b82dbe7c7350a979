"""The import graph of the repository's Python packages (``attn_ext`` and ``bench``), from their source.

Every ``import`` and ``from ... import`` statement counts, at module level or inside a function, under
``if TYPE_CHECKING`` or not: an edge is drawn from the importing module to the module it names (for
``from package import name``, to ``package.name`` when that is a module, else to ``package``).

Two rules are checked on it (docs/architecture.md "Layers"):

* **no circles**: no strongly connected component of more than one module;
* **no climbing arrows**: a module never imports one of a higher layer (:data:`LAYERS`), and an op family
  never imports a sibling family's internals (only its package, i.e. its public API);
* **imports at module top**: an import of one of our modules inside a function is a Triton kernel module
  (``triton_*``: Triton is optional, and it reads ``TRITON_INTERPRET`` when a kernel is decorated), or
  made by a test.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("attn_ext", "bench")

#: Layers, lowest first: a module may import from its own layer and the ones below. The first prefix a
#: module starts with gives its layer; ``attn_ext`` (the package itself) is the public surface.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("attn_ext._C", "attn_ext.ops.utils"),
    ("attn_ext.ops.attention", "attn_ext.ops.tree", "attn_ext.ops.intention"),
    ("attn_ext.ops",),
    ("attn_ext.data", "attn_ext.nn"),
    ("attn_ext.models",),
    ("attn_ext.distributed", "attn_ext"),
    ("bench",),
)
FAMILIES = ("attn_ext.ops.attention", "attn_ext.ops.tree", "attn_ext.ops.intention")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Optional[Path]]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "out" in path.relative_to(REPO / package).parts[:1]:
                continue
            found[module_name(path)] = path
    # The compiled extension: a module of the lowest layer with no Python source (it imports nothing of ours).
    found["attn_ext._C"] = None
    return found


def _resolve_relative(source: str, is_package: bool, level: int, module: Optional[str]) -> str:
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _enclosing_functions(tree: ast.AST) -> Set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for child in ast.walk(node):
                if child is not node:
                    inside.add(id(child))
    return inside


def edges_of(name: str, path: Path, known: Dict[str, Path]) -> Iterator[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    inside = _enclosing_functions(tree)
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(name, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                targets.append(full if full in known else base)
        for target in targets:
            # `import a.b.c` names the deepest module of ours it reaches.
            while target and target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                yield Edge(name, target, node.lineno, id(node) in inside)


def import_graph() -> Dict[str, List[Edge]]:
    known = modules()
    return {name: list(edges_of(name, path, known)) if path is not None else [] for name, path in known.items()}


def circles(graph: Dict[str, List[Edge]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        # Iterative depth-first search: the graph is deep enough to pass Python's recursion limit.
        work = [(node, iter(graph.get(node, ())))]
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            advanced = False
            for edge in children:
                child = edge.target
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                    advanced = True
                    break
                if child in on_stack:
                    low[current] = min(low[current], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[current])
            if low[current] == index[current]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int:
    """The rank in :data:`LAYERS` of the longest prefix ``module`` starts with (``attn_ext.ops`` and
    ``attn_ext`` match every submodule too: the most specific prefix wins)."""
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"{module} is in no layer of LAYERS")
    return max(matches)[1]


def family(module: str) -> Optional[str]:
    return next((f for f in FAMILIES if module == f or module.startswith(f + ".")), None)


def climbing_arrows(graph: Dict[str, List[Edge]]) -> List[str]:
    """Each edge that goes to a higher layer, or into a sibling op family's internals, as a sentence."""
    found = []
    for edges in graph.values():
        for edge in edges:
            source_layer, target_layer = layer(edge.source), layer(edge.target)
            if target_layer > source_layer:
                found.append(f"{edge.source}:{edge.line} imports {edge.target} (layer {target_layer} > {source_layer})")
                continue
            source_family, target_family = family(edge.source), family(edge.target)
            if source_family and target_family and source_family != target_family and edge.target != target_family:
                found.append(f"{edge.source}:{edge.line} imports {edge.target}, an internal of the sibling family "
                              f"{target_family} (import {target_family} itself, or move the shared piece to ops.utils)")
    return found


def late_imports(graph: Dict[str, List[Edge]]) -> List[str]:
    """Each import of our modules inside a function whose target is not a Triton kernel module. Test modules
    (``bench.tests``) are exempt: a test may import what it exercises when it runs, e.g. after setting the
    environment it needs."""
    return [f"{e.source}:{e.line} imports {e.target} inside a function" for edges in graph.values() for e in edges
            if e.in_function and not e.target.rsplit(".", 1)[-1].startswith("triton_")
            and not e.source.startswith("bench.tests.")]


if __name__ == "__main__":
    graph = import_graph()
    for component in circles(graph):
        print("circle:", " <-> ".join(component))
    for arrow in climbing_arrows(graph):
        print("climbs:", arrow)
    for late in late_imports(graph):
        print("late:", late)
    print(f"{sum(map(len, graph.values()))} edges")
