"""Meta-learning tasks of the NP models as one interface: what ``python -m bench train``/``eval`` need.

An :class:`NPTask` names a task, holds the settings that rebuild it (stored in a checkpoint, so a
resumed run or an evaluation gets the same task) and draws training batches. The GP and image
completion tasks are defined here; the training loop (:mod:`bench.np.train`) knows neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from attn_ext.data import NPBatch

TASK_NAMES = ("gp", "images", "wheel")


@dataclass
class NPTask:
    """A task of the NP models.

    Attributes
    ----------
    name : {"gp", "images", "wheel"}
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


def gp_task(kernel: str = "rbf", length_range: str = "code") -> NPTask:
    """GP meta-regression with :class:`attn_ext.data.GPSampler` (1-D x and y)."""
    from attn_ext.data import GPSampler

    sampler = GPSampler(kernel, length_range=length_range)
    return NPTask("gp", {"kernel": kernel, "length_range": length_range}, 1, 1,
                  lambda batch_size, generator: sampler.sample(batch_size, generator=generator))


def image_task(dataset: str, data_dir: Optional[Path] = None, split: Optional[str] = None) -> NPTask:
    """Image completion on ``dataset`` (a key of :data:`bench.np.data.images.DATASETS`); ``split``
    defaults to the dataset's training split. The images are loaded once, here."""
    from bench.np.data.images import DATASETS, ImageCompletionSampler, load_images

    if dataset not in DATASETS:
        raise ValueError(f"unknown image dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    split = split or DATASETS[dataset].train_split
    sampler = ImageCompletionSampler(load_images(dataset, split, data_dir))
    settings = {"dataset": dataset, "data_dir": None if data_dir is None else str(data_dir)}
    return NPTask("images", settings, 2, sampler.channels, lambda b, g: sampler.sample(b, generator=g), sampler)


def wheel_task(num_context: int = 512, num_target: int = 50, context_rewards: str = "all") -> NPTask:
    """Wheel-bandit pre-training (CMANP App. C.2): x the 2-D context, y the 5 arms' rewards."""
    from bench.np.data.wheel import NUM_ARMS, WheelSampler

    sampler = WheelSampler(num_context, num_target, context_rewards)
    settings = {"num_context": num_context, "num_target": num_target, "context_rewards": context_rewards}
    return NPTask("wheel", settings, 2, NUM_ARMS, sampler.sample, sampler)


def make_task(name: str, settings: dict, **changes) -> NPTask:
    """The task ``name`` from its stored ``settings`` (``changes`` override them, e.g. ``data_dir``)."""
    settings = {**settings, **{k: v for k, v in changes.items() if v is not None}}
    if name == "gp":
        return gp_task(settings.get("kernel", "rbf"), settings.get("length_range", "code"))
    if name == "images":
        data_dir = settings.get("data_dir")
        return image_task(settings["dataset"], None if data_dir is None else Path(data_dir), settings.get("split"))
    if name == "wheel":
        return wheel_task(settings.get("num_context", 512), settings.get("num_target", 50),
                          settings.get("context_rewards", "all"))
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
