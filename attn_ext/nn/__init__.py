"""Drop-in attention modules on the fused kernels: ``MultiheadAttention`` (``torch.nn.MultiheadAttention``;
``MultiheadCrossAttention`` is its earlier name, with batch-first defaults), ``swap_attention`` (every
``torch.nn.MultiheadAttention`` of a model replaced), ``CMAB``,
``TreeCrossAttention`` (with ``tca_loss``), ``PreNormBlock`` (and the official LBANP code's
``PerceiverBlock``), ``Intention`` (with ``InformerLayer``, ``Informer``) and ``HyperMixer`` (HyperMixer's
token mixing, linear in the number of tokens).

>>> import torch, attn_ext as ae
>>> mha = ae.nn.MultiheadAttention(16, 2)
>>> mha(torch.randn(3, 1, 16), torch.randn(50, 1, 16), torch.randn(50, 1, 16), need_weights=False)[0].shape
torch.Size([3, 1, 16])
"""
from attn_ext.nn.cmab import CMAB, CMABState
from attn_ext.nn.hypermixer import HyperMixer
from attn_ext.nn.informer import Informer, InformerLayer
from attn_ext.nn.intention import Intention
from attn_ext.nn.latents import learned_latents
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.nn.multihead_attention import MultiheadAttention
from attn_ext.nn.multihead_cross_attention import MultiheadCrossAttention
from attn_ext.nn.perceiver_block import OfficialPerceiverBlock, PerceiverBlock
from attn_ext.nn.prenorm_block import PreNormBlock
from attn_ext.nn.swap import SwapReport, swap_attention
from attn_ext.nn.tca_loss import TCALoss, tca_loss
from attn_ext.nn.tree_cross_attention import TreeCrossAttention, TreeCrossAttentionOutput, TreeState

__all__ = [
    "CMAB",
    "CMABState",
    "HyperMixer",
    "Informer",
    "InformerLayer",
    "LayerNorm",
    "Intention",
    "MultiheadAttention",
    "MultiheadCrossAttention",
    "OfficialPerceiverBlock",
    "PerceiverBlock",
    "PreNormBlock",
    "SwapReport",
    "TCALoss",
    "TreeCrossAttention",
    "TreeCrossAttentionOutput",
    "TreeState",
    "learned_latents",
    "swap_attention",
    "tca_loss",
]
