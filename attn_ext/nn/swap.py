"""``swap_attention``: every ``torch.nn.MultiheadAttention`` of a model replaced by :class:`MultiheadAttention`.

The replacement takes over the original's parameter objects and ``out_proj`` module themselves (not
copies), so weights, ``requires_grad``, device, dtype, tied parameters and an optimizer built before
the swap all stay valid; the training mode and every option are carried over.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from torch import nn

from attn_ext.nn.multihead_attention import MultiheadAttention
from attn_ext.nn.rebuild import rebuilt_as, why_not_swappable


@dataclass
class SwapReport:
    """What :func:`swap_attention` did: ``replaced`` names the replaced modules (every name of a
    module registered under several), ``left`` pairs each ``torch.nn.MultiheadAttention`` it kept
    with the reason, and ``not_scriptable`` names the modules that ``torch.jit.script`` can no longer
    compile: the replaced ones and every module holding one (``""`` is the model itself), since
    :class:`MultiheadAttention` refuses TorchScript."""

    replaced: List[str] = field(default_factory=list)
    left: List[Tuple[str, str]] = field(default_factory=list)
    not_scriptable: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} torch.nn.MultiheadAttention module(s): {', '.join(self.replaced)}"]
        lines += [f"left {name}: {reason}" for name, reason in self.left]
        if self.not_scriptable:
            lines.append(f"not scriptable any more: the model and {len(self.not_scriptable) - 1} of its modules, "
                         "listed in report.not_scriptable (torch.jit.script refuses attn_ext.nn.MultiheadAttention; "
                         "torch.compile works)")
        return "\n".join(lines)


def swap_attention(model: nn.Module, *, chunk_size: Optional[int] = None,
                   backend: Optional[str] = None) -> SwapReport:
    """Replace, in place, every ``torch.nn.MultiheadAttention`` inside ``model`` by an
    :class:`attn_ext.nn.MultiheadAttention` that computes the same thing on the fused kernels.

    Works at any depth, including the ``self_attn`` / ``multihead_attn`` of
    ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer``. A module
    registered in several places is replaced by one module in all of them. Left in place, with the
    reason in the report: subclasses of ``torch.nn.MultiheadAttention`` (their forward may differ),
    modules with hooks or parametrizations, and ``model`` itself when it is one (use
    :meth:`MultiheadAttention.from_torch` for a single module).

    ``nn.TransformerEncoderLayer`` keeps its inference fast path: in evaluation mode without
    gradients it runs PyTorch's fused layer from the same weights without calling ``self_attn``,
    before and after the swap alike.

    Returns a :class:`SwapReport`.

    Examples
    --------
    >>> import torch, attn_ext as ae
    >>> model = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
    ...                              dim_feedforward=64, dropout=0.0)
    >>> src, tgt = torch.randn(7, 2, 32), torch.randn(5, 2, 32)
    >>> tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    >>> expected = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
    >>> report = ae.nn.swap_attention(model)
    >>> report.replaced
    ['encoder.layers.0.self_attn', 'decoder.layers.0.self_attn', 'decoder.layers.0.multihead_attn']
    >>> out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
    >>> bool(torch.allclose(out, expected, atol=1e-5))
    True
    """
    report = SwapReport()
    if isinstance(model, nn.MultiheadAttention):
        report.left.append(("", "is the model itself (it cannot be replaced in place); use "
                                "attn_ext.nn.MultiheadAttention.from_torch(model)"))
    new: Dict[int, nn.Module] = {}  # id of the original -> its replacement, so that sharing stays sharing
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.MultiheadAttention):
                continue
            if id(child) not in new:
                reason = why_not_swappable(child)
                if reason is not None:
                    report.left.append((f"{parent_name}.{child_name}" if parent_name else child_name, reason))
                    continue
                # Already checked above: rebuilt directly (MultiheadAttention.from_torch would check again).
                new[id(child)] = rebuilt_as(MultiheadAttention, child, "attn_ext.nn.swap_attention",
                                            chunk_size=chunk_size, backend=backend)
            parent._modules[child_name] = new[id(child)]
    replacements = {id(m) for m in new.values()}
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    report.replaced = [name for name, m in model.named_modules(remove_duplicate=False) if id(m) in replacements]
    # torch.jit.script compiles a module with all its submodules: every holder of a replaced module fails.
    holders = set(report.replaced) | {prefix for name in report.replaced for prefix in _prefixes(name)}
    report.not_scriptable = list(dict.fromkeys(name for name in names if name in holders))
    return report


def _prefixes(name: str) -> List[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b"]``: the names of the modules holding ``name``."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts))]

