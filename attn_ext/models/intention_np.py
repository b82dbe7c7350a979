"""IntentionNP: TNP-D with Intention (ridge-regression attention, docs/spec.md §4) in place of softmax attention."""
from __future__ import annotations

from typing import Optional

from attn_ext.models.base import NPConfig
from attn_ext.models.tnpd import TNPD

#: ``intention_form`` -> attention kind of :data:`attn_ext.models.layers.ATTENTIONS`.
INTENTION_FORMS = {"linear": "intention", "paper": "intention_paper"}


class IntentionNP(TNPD):
    """TNP-D whose layers use :class:`attn_ext.nn.Intention`: every token reads the context through
    the per-head statistics ``K̂ᵀK̂`` and ``K̂ᵀV̂`` (learned ridge ``α`` per head), so the context
    enters in memory independent of its size beyond its own embeddings.

    Parameters
    ----------
    config, **overrides
        Sizes (:class:`~attn_ext.models.NPConfig`).
    intention_form : {"linear", "paper"}
        ``"linear"`` (default, what earlier checkpoints hold): ``Intention(form="linear")``, single
        linear embeddings of the queries, keys and values. ``"paper"``: ``Intention(form="paper")``,
        the Intention paper's Definition 3.1 with two-layer MLP embeddings and an MLP applied to the
        fitted map.

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import IntentionNP
    >>> model = IntentionNP(num_layers=2)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> model.predict(xc, yc, xt).mean.shape
    torch.Size([2, 7, 1])
    >>> IntentionNP(num_layers=2, intention_form="paper").options()
    {'intention_form': 'paper'}
    """

    attention = "intention"

    def __init__(self, config: Optional[NPConfig] = None, *, intention_form: str = "linear", **overrides) -> None:
        if intention_form not in INTENTION_FORMS:
            raise ValueError(f"IntentionNP: unknown intention_form {intention_form!r}; "
                             f"choose one of {', '.join(INTENTION_FORMS)}")
        # TNPD.__init__ builds its encoder from ``self.attention``, so the instance attribute must be set
        # before it runs (a plain string: nn.Module allows it before its own __init__).
        self.attention = INTENTION_FORMS[intention_form]
        self.intention_form = intention_form
        super().__init__(config, **overrides)

    def options(self) -> dict:
        """``intention_form`` (what ``python -m bench train gp --intention-form`` sets in the harness)."""
        return {"intention_form": self.intention_form}
