"""Reference Neural Process models on attn_ext's attention (docs/spec.md §2, §5).

``MODELS`` maps the CLI names to the classes; :func:`build_model` makes one from a name and an
:class:`NPConfig`.

>>> import torch
>>> from attn_ext.models import build_model, MODELS
>>> sorted(MODELS)
['cmanp', 'cmanp_and', 'convnp', 'hypermix_np', 'intention_np', 'ist', 'lbanp', 'lbanp_nd', 'linear_tnp', 'perceiver_io', 'pt_tetnp', 'retreever', 'tetnp', 'tnp_nd', 'tnpd', 'transformer_ca']
>>> model = build_model("lbanp", num_layers=1, num_latents=4)
>>> model.predict(torch.randn(1, 5, 1), torch.randn(1, 5, 1), torch.randn(1, 3, 1)).mean.shape
torch.Size([1, 3, 1])
"""
from __future__ import annotations

from attn_ext.models.base import NeuralProcess, NPConfig
from attn_ext.models.cmanp import CMANP, CMANPState
from attn_ext.models.cmanp_and import CMANPAND
from attn_ext.models.convnp import ConvNP
from attn_ext.models.hypermix_np import HyperMixNP
from attn_ext.models.intention_np import IntentionNP
from attn_ext.models.ist import IST
from attn_ext.models.lbanp import LBANP
from attn_ext.models.lbanp_nd import LBANPND
from attn_ext.models.linear_tnp import LinearTNP
from attn_ext.models.perceiver_io import PerceiverIONP
from attn_ext.models.retreever import ReTreever
from attn_ext.models.pt_tetnp import PTTETNP
from attn_ext.models.tetnp import TETNP
from attn_ext.models.tnp_nd import TNPND
from attn_ext.models.tnpd import TNPD
from attn_ext.models.transformer_ca import TransformerCA

MODELS = {
    "tnpd": TNPD,
    "lbanp": LBANP,
    "cmanp": CMANP,
    "cmanp_and": CMANPAND,
    "retreever": ReTreever,
    "intention_np": IntentionNP,
    "linear_tnp": LinearTNP,
    "tnp_nd": TNPND,
    "lbanp_nd": LBANPND,
    "hypermix_np": HyperMixNP,
    "ist": IST,
    "convnp": ConvNP,
    "tetnp": TETNP,
    "pt_tetnp": PTTETNP,
    "perceiver_io": PerceiverIONP,
    "transformer_ca": TransformerCA,
}


def build_model(name: str, config: NPConfig | None = None, **overrides) -> NeuralProcess:
    """The model called ``name`` (a key of :data:`MODELS`, ``-`` accepted for ``_``)."""
    key = name.lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[key](config, **overrides)


__all__ = ["CMANP", "CMANPAND", "CMANPState", "ConvNP", "HyperMixNP", "IST", "IntentionNP", "LBANP", "LBANPND",
           "LinearTNP", "MODELS", "NPConfig", "NeuralProcess", "PTTETNP", "PerceiverIONP", "ReTreever", "TETNP",
           "TNPD", "TNPND", "TransformerCA", "build_model"]
