"""The examples users copy must run: docstrings of the public API and the README's code block."""
import doctest
import importlib
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_docstring_examples_run():
    # import_module, because the package attribute `attn_ext.ops.cross_attention.cross_attention` is the function.
    for module in map(importlib.import_module, (
            "attn_ext", "attn_ext.ops.cross_attention.chunked", "attn_ext.ops.cross_attention.state",
            "attn_ext.ops.tree", "attn_ext.ops.tree.build", "attn_ext.ops.tree.aggregate", "attn_ext.ops.tree.retrieval",
            "attn_ext.ops.intention.ridge", "attn_ext.ops.intention.state", "attn_ext.ops.intention.cholesky",
            "attn_ext.nn.multihead_cross_attention", "attn_ext.nn.cmab", "attn_ext.nn.prenorm_block",
            "attn_ext.nn.perceiver_block", "attn_ext.nn.tree_cross_attention", "attn_ext.nn.tree_aggregator",
            "attn_ext.nn.tca_loss", "attn_ext.nn.latents", "attn_ext.nn.intention")):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0, f"{module.__name__} has no examples"
        assert result.failed == 0, f"{module.__name__}: {result.failed} of {result.attempted} examples failed"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
