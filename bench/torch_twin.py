"""Torch twins of the reference NP models, for the ``np_step`` benchmark: the same model, the same weights,
with every attn_ext multi-head attention replaced by ``torch.nn.MultiheadAttention``.

:func:`torch_twin` deep-copies a model and swaps each :class:`attn_ext.nn.MultiheadAttention` (and its
subclass :class:`attn_ext.nn.MultiheadCrossAttention`, which the models use) for torch's module holding
the copy's parameter objects, so the twin computes the same function on PyTorch's own attention
(``F.multi_head_attention_forward``, SDPA inside). It is the reverse of :func:`attn_ext.nn.swap_attention`.

CMANP conditions through the attention *state* of its CMABs (``MultiheadAttention.state`` / ``query``),
which torch's module does not have, so a twin of CMANP itself cannot run. :class:`CMANPBlockStack`
computes CMANP's loss through the plain ``forward`` of its blocks instead (each CMAB as its four
pre-norm blocks, ``CMAB.forward`` written out, then the latent decoder): the same loss (checked by the
tests), on calls a twin can make.
"""

from __future__ import annotations

import copy
from typing import Optional, Tuple

from torch import Tensor, nn

from attn_ext.nn import MultiheadAttention, MultiheadCrossAttention
from attn_ext.nn.rebuild import rebuilt_as


class TorchMultiheadCrossAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` with :class:`attn_ext.nn.MultiheadCrossAttention`'s default
    ``need_weights=False``: the models call it as ``attention(q, k, v)[0]``, and with torch's default
    (True) the twin would form and average the ``[B, L, S]`` weights on every call, work ours never does."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                               is_causal)


def torch_attention(module: MultiheadAttention) -> nn.MultiheadAttention:
    """torch's module computing what ``module`` computes, holding ``module``'s own parameters and
    ``out_proj`` (shared, not copied), in its training mode."""
    cls = TorchMultiheadCrossAttention if isinstance(module, MultiheadCrossAttention) else nn.MultiheadAttention
    return rebuilt_as(cls, module, "torch twin")


def torch_twin(model: nn.Module) -> Tuple[nn.Module, list[str]]:
    """``(twin, replaced)``: a deep copy of ``model`` with every attn_ext multi-head attention replaced by
    :func:`torch_attention`, and the names of the replaced modules (empty: the model has none, e.g. the
    Intention and linear-attention models, and the twin is the model itself again)."""
    twin = copy.deepcopy(model)
    new: dict[int, nn.Module] = {}  # a module registered twice stays one module
    for _, parent in list(twin.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, MultiheadAttention):
                parent._modules[child_name] = new.setdefault(id(child), torch_attention(child))
    ids = {id(m) for m in new.values()}
    return twin, [name for name, m in twin.named_modules(remove_duplicate=False) if id(m) in ids]


class CMANPBlockStack(nn.Module):
    """CMANP's training loss through the ``forward`` of its blocks (see the module docstring).

    Per CMAB: ``L_B' = SA(CA(L_B, D))``, then ``L_i = SA(CA(L_{i−1}, L_B'))``, exactly as
    :meth:`attn_ext.nn.CMAB.output` finishes it from the state; then the latent decoder and the Gaussian
    head. The parameters are the wrapped ``model``'s (``model.`` prefixed).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def latent_sets(self, context: Tensor) -> list[Tensor]:
        latent, out = self.model.latents.expand(context.shape[0], -1, -1), []
        for cmab in self.model.blocks:
            compressed = cmab.latent_self(cmab.compress(cmab.latents.expand(context.shape[0], -1, -1), context))
            latent = cmab.output_self(cmab.cross(latent, compressed))
            out.append(latent)
        return out

    def forward(self, batch) -> Tensor:
        """Mean negative log-likelihood per target, as ``CMANP.forward(batch)``."""
        m = self.model
        latents = self.latent_sets(m.embed_pairs(batch.xc, batch.yc))
        return -m.head(m.decoder(m.embed_targets(batch.xt), latents)).log_prob(batch.yt).sum(-1).mean()
