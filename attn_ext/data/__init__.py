"""Data for Neural Process benchmarks: the GP meta-regression sampler and its evaluation set (SPEC §6).

>>> import torch
>>> from attn_ext.data import GPSampler
>>> batch = GPSampler("rbf").sample(4, generator=torch.Generator().manual_seed(0))
>>> batch.xc.shape[0], batch.xc.shape[-1], batch.yt.shape[-1]
(4, 1, 1)
"""
from attn_ext.data.eval_set import evaluation_set
from attn_ext.data.gp import KERNELS, LENGTH_RANGES, GPSampler, NPBatch

__all__ = ["GPSampler", "KERNELS", "LENGTH_RANGES", "NPBatch", "evaluation_set"]
