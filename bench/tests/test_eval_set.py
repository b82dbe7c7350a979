"""The fixed-seed GP evaluation set (bench.np.data.eval_set): cached, and a quick set is a prefix of the full one.

Moved with its code from python_tests/test_gp_sampler.py and test_models_shapes.py (the doctest)."""
import doctest

import torch

from bench.np.data import eval_set
from bench.np.data.eval_set import evaluation_set


def test_evaluation_set_is_cached_and_a_prefix(tmp_path):
    small = evaluation_set("matern52", 2, cache_dir=tmp_path)
    larger = evaluation_set("matern52", 3, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    assert all(torch.equal(u, v) for u, v in zip(small[1], larger[1]))
    assert small[0].xc.shape[0] == 16


def test_docstring_examples():
    assert doctest.testmod(eval_set, optionflags=doctest.ELLIPSIS).failed == 0
