"""The fixed-seed evaluation sets of the GP and Sawtooth tasks, generated once on the CPU and cached to
disk (docs/spec.md §6, docs/data.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch

from attn_ext.data import GPSampler, NPBatch, SawtoothSampler

#: The full protocol: 3000 batches of 16 from a fixed seed.
FULL_NUM_BATCHES, BATCH_SIZE, EVAL_SEED = 3000, 16, 0


def default_cache_dir() -> Path:
    """``$ATTN_EXT_DATA`` if set, else ``~/.cache/attn_ext``."""
    return Path(os.environ.get("ATTN_EXT_DATA", Path.home() / ".cache" / "attn_ext"))


def _counts_tag(num_context: Optional[int], num_target: Optional[int]) -> str:
    return f"nc{num_context or 'rand'}_nt{num_target or 'rand'}"


def gp_cache_name(kernel: str, length_range: str, seed: int, batch_size: int, num_batches: int, *, dim_x: int = 1,
                  num_context: Optional[int] = None, num_target: Optional[int] = None) -> str:
    """The cache file of a GP evaluation set. The 1-D set with random counts keeps the name it always had
    (caches written before d-dimensional inputs stay valid); any other names its task, ``dim_x`` and counts."""
    stream = f"seed{seed}_b{batch_size}_n{num_batches}.pt"
    if dim_x == 1 and num_context is None and num_target is None:
        return f"gp_eval_{kernel}_{length_range}_{stream}"
    return f"gp_dim{dim_x}_eval_{kernel}_{length_range}_{_counts_tag(num_context, num_target)}_{stream}"


def sawtooth_cache_name(dim_x: int, noise_std: float, seed: int, batch_size: int, num_batches: int, *,
                        num_context: Optional[int] = None, num_target: Optional[int] = None,
                        freq_range=SawtoothSampler().freq_range) -> str:
    """The cache file of a Sawtooth evaluation set: every setting that changes its numbers is in the name."""
    low, high = freq_range
    return (f"sawtooth_dim{dim_x}_eval_freq{low:g}-{high:g}_noise{noise_std:g}_"
            f"{_counts_tag(num_context, num_target)}_seed{seed}_b{batch_size}_n{num_batches}.pt")


def _cached(path: Path, draw: Callable[[torch.Generator], NPBatch], num_batches: int, seed: int) -> List[NPBatch]:
    if num_batches <= 0:
        raise ValueError(f"num_batches must be positive, got {num_batches}")
    if path.exists():
        return [NPBatch(*b) for b in torch.load(path)]
    generator = torch.Generator().manual_seed(seed)
    batches = [draw(generator) for _ in range(num_batches)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save([tuple(b) for b in batches], tmp)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return batches


def _cache_dir(cache_dir: Optional[Union[str, Path]]) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def evaluation_set(kernel: str = "rbf", num_batches: int = FULL_NUM_BATCHES, *, batch_size: int = BATCH_SIZE,
                   seed: int = EVAL_SEED, length_range: str = "code", dim_x: int = 1,
                   num_context: Optional[int] = None, num_target: Optional[int] = None,
                   cache_dir: Optional[Union[str, Path]] = None) -> List[NPBatch]:
    """``num_batches`` batches of ``batch_size`` GP tasks drawn from ``seed``, cached as a ``.pt`` file;
    ``dim_x``, ``num_context`` and ``num_target`` as :func:`bench.np.tasks.np_tasks.gp_task` takes them.

    The batches are a prefix of one seeded stream, so a quick run's set is the start of the full one.

    Examples
    --------
    >>> import tempfile
    >>> from bench.np.data.eval_set import evaluation_set
    >>> with tempfile.TemporaryDirectory() as d:
    ...     first = evaluation_set("rbf", 2, cache_dir=d)
    ...     again = evaluation_set("rbf", 2, cache_dir=d)       # read back from the cache
    ...     flat = evaluation_set("rbf", 1, dim_x=2, num_context=64, num_target=128, cache_dir=d)
    >>> len(first), bool((first[1].yt == again[1].yt).all()), tuple(flat[0].xt.shape)
    (2, True, (16, 128, 2))
    """
    sampler = GPSampler(kernel, length_range=length_range, dim_x=dim_x)
    name = gp_cache_name(kernel, length_range, seed, batch_size, num_batches, dim_x=dim_x, num_context=num_context,
                         num_target=num_target)
    return _cached(_cache_dir(cache_dir) / name, lambda g: sampler.sample(
        batch_size, generator=g, num_context=num_context, num_target=num_target), num_batches, seed)


def sawtooth_evaluation_set(num_batches: int = FULL_NUM_BATCHES, *, dim_x: int = 2, num_context: Optional[int] = 64,
                            num_target: Optional[int] = 128, noise_std: Optional[float] = None,
                            batch_size: int = BATCH_SIZE, seed: int = EVAL_SEED,
                            cache_dir: Optional[Union[str, Path]] = None) -> List[NPBatch]:
    """The Sawtooth counterpart of :func:`evaluation_set` (default: the chapter's 2-D setting, the
    sampler's default noise), cached under a name of its own.

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     batches = sawtooth_evaluation_set(2, cache_dir=d)
    >>> len(batches), tuple(batches[0].xc.shape), tuple(batches[0].yt.shape)
    (2, (16, 64, 2), (16, 128, 1))
    """
    sampler = SawtoothSampler(dim_x=dim_x) if noise_std is None else SawtoothSampler(dim_x=dim_x, noise_std=noise_std)
    name = sawtooth_cache_name(dim_x, sampler.noise_std, seed, batch_size, num_batches, num_context=num_context,
                               num_target=num_target, freq_range=sampler.freq_range)
    return _cached(_cache_dir(cache_dir) / name, lambda g: sampler.sample(
        batch_size, generator=g, num_context=num_context, num_target=num_target), num_batches, seed)
