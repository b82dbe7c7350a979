"""Rebuilding a ``torch.nn.MultiheadAttention`` as another multi-head attention class around the same
parameter objects: whether it can be done faithfully (:func:`why_not_swappable`) and doing it
(:func:`rebuilt_as`). :meth:`attn_ext.nn.MultiheadAttention.from_torch` and
:func:`attn_ext.nn.swap_attention` build on it.
"""
from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.utils import parametrize

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def why_not_swappable(module: nn.Module) -> Optional[str]:
    """Why ``module`` (a ``torch.nn.MultiheadAttention``) cannot be replaced faithfully, or None."""
    if type(module) is not nn.MultiheadAttention:
        return (f"{type(module).__module__}.{type(module).__qualname__} subclasses torch.nn.MultiheadAttention; "
                "its forward may differ from torch's, so it is not replaced")
    hooks = [name.strip("_") for name in _HOOKS if getattr(module, name, None)]
    if hooks:
        return f"has {', '.join(hooks)} registered on it, which the replacement would not run"
    if parametrize.is_parametrized(module):
        return "has parametrized parameters (torch.nn.utils.parametrize)"
    if set(module._modules) != {"out_proj"} or not isinstance(module.out_proj, nn.Linear):
        return f"has submodules {sorted(module._modules)} where torch's has only out_proj (a Linear)"
    return None


def rebuilt_as(cls: type, module: nn.Module, who: str, **options) -> nn.Module:
    """A ``cls`` (torch's or attn_ext's multi-head attention) with ``module``'s configuration, holding its
    parameters and ``out_proj`` (shared, not copied), in its training mode; ``options`` go to ``cls``."""
    # Built on the meta device (no memory, no initialisation work), then given the original's tensors.
    new = cls(module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
              add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn, kdim=module.kdim,
              vdim=module.vdim, batch_first=module.batch_first, device="meta", **options)
    if set(new._parameters) != set(module._parameters):
        raise ValueError(f"{who}: parameters {sorted(module._parameters)} differ from the expected "
                         f"{sorted(new._parameters)}")
    for name in new._parameters:
        new._parameters[name] = module._parameters[name]
    new._modules["out_proj"] = module.out_proj
    return new.train(module.training)
