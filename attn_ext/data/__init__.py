"""Data for Neural Processes: the GP meta-regression sampler of docs/spec.md §6 (1-D or d-dimensional
inputs) and the Sawtooth sampler of the efficient-NP chapter's 2-D experiments (docs/data.md).

The evaluation sets, the image and wheel-bandit readers of the paper benchmarks live in the
repository's ``bench/np/data/`` (run from a clone), not in the installed package.

>>> import torch
>>> from attn_ext.data import GPSampler, SawtoothSampler
>>> batch = GPSampler("rbf").sample(4, generator=torch.Generator().manual_seed(0))
>>> batch.xc.shape[0], batch.xc.shape[-1], batch.yt.shape[-1]
(4, 1, 1)
>>> SawtoothSampler(dim_x=2).sample(4, generator=torch.Generator().manual_seed(0)).xc.shape[-1]
2
"""
from attn_ext.data.batch import NPBatch, PackedNPBatch, pack_tasks
from attn_ext.data.gp import KERNELS, LENGTH_RANGES, GPSampler, kernel_matrix
from attn_ext.data.sawtooth import SawtoothFunctions, SawtoothSampler

__all__ = ["GPSampler", "KERNELS", "LENGTH_RANGES", "NPBatch", "PackedNPBatch", "SawtoothFunctions", "SawtoothSampler",
           "kernel_matrix", "pack_tasks"]
