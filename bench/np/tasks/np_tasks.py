"""Meta-learning tasks of the NP models as one interface: what ``python -m bench train``/``eval`` need.

An :class:`NPTask` names a task, holds the settings that rebuild it (stored in a checkpoint, so a
resumed run or an evaluation gets the same task) and draws training batches. The GP (1-D or
d-dimensional), Sawtooth, image completion and wheel tasks are defined here; the training loop
(:mod:`bench.np.train`) knows none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from attn_ext.data import GPSampler, NPBatch, SawtoothSampler
from attn_ext.data.gp import check_counts
from attn_ext.data.sawtooth import NOISE_STD
from bench.np.data.images import DATASETS, ImageCompletionSampler, load_images
from bench.np.data.wheel import NUM_ARMS, WheelSampler

TASK_NAMES = ("gp", "sawtooth", "images", "wheel")
#: The efficient-NP chapter's 2-D setting (its Table 0.5.1): inputs in 2-D, 64 context and 128 target points.
CHAPTER_2D = {"dim_x": 2, "num_context": 64, "num_target": 128}


@dataclass
class NPTask:
    """A task of the NP models.

    Attributes
    ----------
    name : {"gp", "sawtooth", "images", "wheel"}
    settings : dict
        JSON-able settings that rebuild the task with :func:`make_task` (e.g. kernel, dataset).
    dim_x, dim_y : int
        Input and output dimensions; set on the model's :class:`attn_ext.models.NPConfig`.
    sample : callable
        ``sample(batch_size, generator) -> NPBatch``, a batch of fresh training tasks.
    sampler : object, optional
        The task's sampler, for callers that draw tasks of chosen data (image evaluation, figures).
    """

    name: str
    settings: dict
    dim_x: int
    dim_y: int
    sample: Callable[[int, Optional[torch.Generator]], NPBatch]
    sampler: Any = None


def gp_task(kernel: str = "rbf", length_range: str = "code", dim_x: int = 1, num_context: Optional[int] = None,
            num_target: Optional[int] = None) -> NPTask:
    """GP meta-regression with :class:`attn_ext.data.GPSampler`: ``dim_x``-D x, 1-D y; random counts
    unless ``num_context``/``num_target`` fix them (``gp_task(**CHAPTER_2D)``: the chapter's 2-D GP).

    The settings name ``dim_x`` and the counts only where they differ from the defaults, so that the
    settings of a 1-D run are those that runs stored before these options existed (resuming compares them).
    """
    sampler = GPSampler(kernel, length_range=length_range, dim_x=dim_x)
    extra = {"dim_x": dim_x} if dim_x != 1 else {}
    extra.update({k: v for k, v in (("num_context", num_context), ("num_target", num_target)) if v is not None})
    return NPTask("gp", {"kernel": kernel, "length_range": length_range, **extra}, dim_x, 1,
                  _sampling(sampler, num_context, num_target), sampler)


def sawtooth_task(dim_x: int = CHAPTER_2D["dim_x"], num_context: Optional[int] = CHAPTER_2D["num_context"],
                  num_target: Optional[int] = CHAPTER_2D["num_target"], noise_std: Optional[float] = None) -> NPTask:
    """Sawtooth regression with :class:`attn_ext.data.SawtoothSampler`; the defaults are the chapter's
    2-D setting (``num_context=None``/``num_target=None``: the GP sampler's random counts)."""
    noise_std = NOISE_STD if noise_std is None else noise_std
    sampler = SawtoothSampler(dim_x=dim_x, noise_std=noise_std)
    # Every setting is stored, the noise included: a later change of default cannot change a run.
    settings = {"dim_x": dim_x, "num_context": num_context, "num_target": num_target, "noise_std": noise_std}
    return NPTask("sawtooth", settings, dim_x, 1, _sampling(sampler, num_context, num_target), sampler)


def _sampling(sampler, num_context: Optional[int], num_target: Optional[int]):
    check_counts(type(sampler).__name__, num_context, num_target)  # at once, not at the first step
    return lambda batch_size, generator: sampler.sample(batch_size, generator=generator, num_context=num_context,
                                                        num_target=num_target)


def image_task(dataset: str, data_dir: Optional[Path] = None, split: Optional[str] = None) -> NPTask:
    """Image completion on ``dataset`` (a key of :data:`bench.np.data.images.DATASETS`); ``split``
    defaults to the dataset's training split. The images are loaded once, here."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown image dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    split = split or DATASETS[dataset].train_split
    sampler = ImageCompletionSampler(load_images(dataset, split, data_dir))
    settings = {"dataset": dataset, "data_dir": None if data_dir is None else str(data_dir)}
    return NPTask("images", settings, 2, sampler.channels, lambda b, g: sampler.sample(b, generator=g), sampler)


def wheel_task(num_context: int = 512, num_target: int = 50, context_rewards: str = "all") -> NPTask:
    """Wheel-bandit pre-training (CMANP App. C.2): x the 2-D context, y the 5 arms' rewards."""
    sampler = WheelSampler(num_context, num_target, context_rewards)
    settings = {"num_context": num_context, "num_target": num_target, "context_rewards": context_rewards}
    return NPTask("wheel", settings, 2, NUM_ARMS, sampler.sample, sampler)


def make_task(name: str, settings: dict, **changes) -> NPTask:
    """The task ``name`` from its stored ``settings`` (``changes`` override them, e.g. ``data_dir``)."""
    settings = {**settings, **{k: v for k, v in changes.items() if v is not None}}
    if name == "gp":
        return gp_task(settings.get("kernel", "rbf"), settings.get("length_range", "code"), settings.get("dim_x", 1),
                       settings.get("num_context"), settings.get("num_target"))
    if name == "sawtooth":
        return sawtooth_task(settings["dim_x"], settings["num_context"], settings["num_target"],
                             settings["noise_std"])
    if name == "images":
        data_dir = settings.get("data_dir")
        return image_task(settings["dataset"], None if data_dir is None else Path(data_dir), settings.get("split"))
    if name == "wheel":
        return wheel_task(settings.get("num_context", 512), settings.get("num_target", 50),
                          settings.get("context_rewards", "all"))
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
