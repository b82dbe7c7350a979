"""Reference Neural Process models on attn_ext's attention (docs/spec.md §2, §5).

``MODELS`` maps the CLI names to the classes; :func:`build_model` makes one from a name and an
:class:`NPConfig`.

>>> import torch
>>> from attn_ext.models import build_model, MODELS
>>> sorted(MODELS)
['cmanp', 'cmanp_and', 'intention_np', 'lbanp', 'linear_tnp', 'retreever', 'tnpd']
>>> model = build_model("lbanp", num_layers=1, num_latents=4)
>>> model.predict(torch.randn(1, 5, 1), torch.randn(1, 5, 1), torch.randn(1, 3, 1)).mean.shape
torch.Size([1, 3, 1])
"""
from __future__ import annotations

from attn_ext.models.base import NeuralProcess, NPConfig
from attn_ext.models.cmanp import CMANP, CMANPState
from attn_ext.models.cmanp_and import CMANPAND
from attn_ext.models.intention_np import IntentionNP
from attn_ext.models.lbanp import LBANP
from attn_ext.models.linear_tnp import LinearTNP
from attn_ext.models.retreever import ReTreever
from attn_ext.models.tnpd import TNPD

MODELS = {
    "tnpd": TNPD,
    "lbanp": LBANP,
    "cmanp": CMANP,
    "cmanp_and": CMANPAND,
    "retreever": ReTreever,
    "intention_np": IntentionNP,
    "linear_tnp": LinearTNP,
}


def build_model(name: str, config: NPConfig | None = None, **overrides) -> NeuralProcess:
    """The model called ``name`` (a key of :data:`MODELS`, ``-`` accepted for ``_``)."""
    key = name.lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[key](config, **overrides)


__all__ = ["CMANP", "CMANPAND", "CMANPState", "IntentionNP", "LBANP", "LinearTNP", "MODELS", "NPConfig",
           "NeuralProcess", "ReTreever", "TNPD", "build_model"]
