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


def test_1d_cache_name_and_stream_are_as_they_were(tmp_path):
    from attn_ext.data import GPSampler

    batches = evaluation_set("rbf", 2, cache_dir=tmp_path)
    # Caches written before d-dimensional inputs existed are found again under this name.
    assert [p.name for p in tmp_path.iterdir()] == ["gp_eval_rbf_code_seed0_b16_n2.pt"]
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        assert all(torch.equal(u, v) for u, v in zip(batch, GPSampler("rbf").sample(16, generator=gen)))


def test_2d_gp_and_sawtooth_sets_have_names_of_their_own(tmp_path):
    from bench.np.data.eval_set import sawtooth_evaluation_set

    one_d = evaluation_set("rbf", 2, cache_dir=tmp_path)
    two_d = evaluation_set("rbf", 2, dim_x=2, num_context=64, num_target=128, cache_dir=tmp_path)
    two_d_random = evaluation_set("rbf", 2, dim_x=2, cache_dir=tmp_path)
    saw = sawtooth_evaluation_set(2, cache_dir=tmp_path)
    saw_3d = sawtooth_evaluation_set(3, dim_x=3, num_context=10, num_target=20, noise_std=0.0, cache_dir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gp_dim2_eval_rbf_code_nc64_nt128_seed0_b16_n2.pt",
                     "gp_dim2_eval_rbf_code_ncrand_ntrand_seed0_b16_n2.pt",
                     "gp_eval_rbf_code_seed0_b16_n2.pt",
                     "sawtooth_dim2_eval_freq3-5_noise0.025_nc64_nt128_seed0_b16_n2.pt",
                     "sawtooth_dim3_eval_freq3-5_noise0_nc10_nt20_seed0_b16_n3.pt"]
    assert one_d[0].xc.shape[-1] == 1 and two_d_random[0].xc.shape[-1] == 2
    assert two_d[1].xc.shape == (16, 64, 2) and two_d[1].yt.shape == (16, 128, 1)
    assert saw[1].xt.shape == (16, 128, 2) and saw_3d[2].xc.shape == (16, 10, 3)
    assert saw_3d[0].yt.min() >= 0 and saw_3d[0].yt.max() < 1  # noise-free: the sawtooth's range
    # Read back from the cache, and a longer set starts with the shorter one.
    again = sawtooth_evaluation_set(2, cache_dir=tmp_path)
    longer = sawtooth_evaluation_set(3, cache_dir=tmp_path)
    assert all(torch.equal(u, v) for b, c in ((saw[1], again[1]), (saw[1], longer[1])) for u, v in zip(b, c))
