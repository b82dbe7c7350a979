"""The fixed-seed GP evaluation set, generated once on the CPU and cached to disk (docs/spec.md §6)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Union

import torch

from attn_ext.data import GPSampler, NPBatch

#: The full protocol: 3000 batches of 16 from a fixed seed.
FULL_NUM_BATCHES, BATCH_SIZE, EVAL_SEED = 3000, 16, 0


def default_cache_dir() -> Path:
    """``$ATTN_EXT_DATA`` if set, else ``~/.cache/attn_ext``."""
    return Path(os.environ.get("ATTN_EXT_DATA", Path.home() / ".cache" / "attn_ext"))


def evaluation_set(kernel: str = "rbf", num_batches: int = FULL_NUM_BATCHES, *, batch_size: int = BATCH_SIZE,
                   seed: int = EVAL_SEED, length_range: str = "code",
                   cache_dir: Optional[Union[str, Path]] = None) -> List[NPBatch]:
    """``num_batches`` batches of ``batch_size`` GP tasks drawn from ``seed``, cached as a ``.pt`` file.

    The batches are a prefix of one seeded stream, so a quick run's set is the start of the full one.

    Examples
    --------
    >>> import tempfile
    >>> from bench.np.data.eval_set import evaluation_set
    >>> with tempfile.TemporaryDirectory() as d:
    ...     first = evaluation_set("rbf", 2, cache_dir=d)
    ...     again = evaluation_set("rbf", 2, cache_dir=d)       # read back from the cache
    >>> len(first), bool((first[1].yt == again[1].yt).all())
    (2, True)
    """
    if num_batches <= 0:
        raise ValueError(f"num_batches must be positive, got {num_batches}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"gp_eval_{kernel}_{length_range}_seed{seed}_b{batch_size}_n{num_batches}.pt"
    if path.exists():
        return [NPBatch(*b) for b in torch.load(path)]
    sampler = GPSampler(kernel, length_range=length_range)
    generator = torch.Generator().manual_seed(seed)
    batches = [sampler.sample(batch_size, generator=generator) for _ in range(num_batches)]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save([tuple(b) for b in batches], tmp)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return batches
