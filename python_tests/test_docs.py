"""The examples users copy must run (docstrings of the public API, the README's and the user docs' code
blocks), and every reference to the spec must resolve to a section of docs/spec.md."""
import doctest
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_docstring_examples_run():
    # import_module, because the package attribute `attn_ext.ops.attention.cross_attention` is the function.
    for module in map(importlib.import_module, (
            "attn_ext", "attn_ext.ops.attention.chunked", "attn_ext.ops.attention.state",
            "attn_ext.ops.attention.scaled_dot_product", "attn_ext.ops.attention.varlen",
            "attn_ext.ops.attention.paged", "attn_ext.ops.attention.sliding_window_state",
            "attn_ext.ops.tree", "attn_ext.ops.tree.build", "attn_ext.ops.tree.aggregate", "attn_ext.ops.tree.retrieval",
            "attn_ext.ops.intention.ridge", "attn_ext.ops.intention.state", "attn_ext.ops.intention.cholesky",
            "attn_ext.nn.multihead_cross_attention", "attn_ext.nn.cmab", "attn_ext.nn.prenorm_block",
            "attn_ext.nn.perceiver_block", "attn_ext.nn.tree_cross_attention", "attn_ext.nn.tree_aggregator",
            "attn_ext.nn.tca_loss", "attn_ext.nn.latents", "attn_ext.nn.intention", "attn_ext.nn.informer",
            "attn_ext.nn.hypermixer", "attn_ext.ops.intention.ridge_map", "attn_ext.ops.intention.pinv",
            "attn_ext.ops.intention.convex_regulariser", "attn_ext.ops.intention.kernelised", "attn_ext.data.batch")):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0, f"{module.__name__} has no examples"
        assert result.failed == 0, f"{module.__name__}: {result.failed} of {result.attempted} examples failed"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_user_docs_examples_run():
    assert DOCS, "docs/ has no pages"
    ran = 0
    for page in DOCS:
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            exec(compile(code, str(page), "exec"), {})
            ran += 1
    assert ran >= 5, f"only {ran} python examples in docs/"


def _sources():
    for pattern in ("attn_ext/**/*.py", "csrc/**/*.h", "csrc/**/*.cpp", "csrc/**/*.cu", "csrc/**/*.cuh", "*.md",
                    "docs/*.md", "bench/**/*.py", "bench/**/*.md"):
        yield from ROOT.glob(pattern)


def test_every_spec_reference_resolves_to_a_section_of_docs_spec():
    sections = set(re.findall(r"^## §(\d+) ", (ROOT / "docs" / "spec.md").read_text(), flags=re.M))
    assert sections == {str(i) for i in range(7)}, sections
    cited = {}
    for path in _sources():
        text = path.read_text(errors="replace")
        assert "SPEC §" not in text and "SPEC section" not in text, f"{path} cites SPEC, which users cannot see"
        for number in re.findall(r"docs/spec\.md §(\d+)", text):
            cited.setdefault(number, path)
    assert cited, "nothing cites docs/spec.md"
    missing = {n: str(p) for n, p in cited.items() if n not in sections}
    assert not missing, f"references to sections docs/spec.md does not have: {missing}"
