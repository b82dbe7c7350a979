"""Data for Neural Processes: the GP meta-regression sampler of docs/spec.md §6.

The evaluation set, the image and wheel-bandit readers of the paper benchmarks live in the
repository's ``bench/np/data/`` (run from a clone), not in the installed package.

>>> import torch
>>> from attn_ext.data import GPSampler
>>> batch = GPSampler("rbf").sample(4, generator=torch.Generator().manual_seed(0))
>>> batch.xc.shape[0], batch.xc.shape[-1], batch.yt.shape[-1]
(4, 1, 1)
"""
from attn_ext.data.gp import KERNELS, LENGTH_RANGES, GPSampler, NPBatch, kernel_matrix

__all__ = ["GPSampler", "KERNELS", "LENGTH_RANGES", "NPBatch", "kernel_matrix"]
