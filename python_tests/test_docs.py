"""The examples users copy must run: docstrings of the public API and the README's code block."""
import doctest
import importlib
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_docstring_examples_run():
    # import_module, because the package attribute `attn_ext.cross_attention` is the function.
    for module in map(importlib.import_module, ("attn_ext", "attn_ext.cross_attention", "attn_ext.state",
                                                "attn_ext.nn.multihead_cross_attention", "attn_ext.nn.cmab", "attn_ext.nn.prenorm_block", "attn_ext.nn.perceiver_block",
                                                "attn_ext.nn.tree_cross_attention", "attn_ext.nn.tree_aggregator", "attn_ext.nn.tca_loss", "attn_ext.nn.latents",
                                                "attn_ext.tree.build", "attn_ext.tree.aggregate",
                                                "attn_ext.tree.retrieval", "attn_ext.ridge.functional",
                                                "attn_ext.ridge.state", "attn_ext.nn.intention",
                                                "attn_ext.ridge.cholesky")):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0, f"{module.__name__} has no examples"
        assert result.failed == 0, f"{module.__name__}: {result.failed} of {result.attempted} examples failed"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
