"""The checkpoint of a training run (``checkpoint.pt`` in its run directory, written by
:func:`bench.np.train.train`): writing it atomically, and reading it back as a model with the options it
was trained with. Read by training (to resume), evaluation, the bandit, the figures and the reports."""
from __future__ import annotations

from pathlib import Path

import torch

from attn_ext.models import build_model

CHECKPOINT = "checkpoint.pt"
#: The options of checkpoints written before they were stored: the defaults of that time.
LEGACY_OPTIONS = {"retreever": {"aggregator": "mean", "backprop_through_tree": True},
                  **{name: {"block": "prenorm"} for name in ("lbanp", "cmanp")},
                  "cmanp_and": {"block": "prenorm", "covariance": "lowrank"},
                  "intention_np": {"intention_form": "linear"}}


def stored_options(ckpt: dict) -> dict:
    """The model options a checkpoint (or an evaluation result written from one) was trained with; an
    option it does not store had, when it was written, the value in :data:`LEGACY_OPTIONS`."""
    return {**LEGACY_OPTIONS.get(ckpt["model"], {}), **ckpt.get("model_options", {})}


def save_checkpoint(path: Path, payload: dict) -> None:
    """``torch.save(payload)`` to ``path`` through a temporary file, so that an interrupted write leaves the
    previous checkpoint whole."""
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(run_dir: Path):
    """``(model, checkpoint dict)`` of a run directory (or a checkpoint file)."""
    path = run_dir if run_dir.is_file() else run_dir / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    ckpt = torch.load(path, weights_only=False)
    model = build_model(ckpt["model"], **ckpt["config"], **stored_options(ckpt))
    model.load_state_dict(ckpt["model_state"])
    return model, ckpt
