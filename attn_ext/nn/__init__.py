"""Drop-in attention modules on the fused kernels: ``MultiheadCrossAttention``, ``CMAB``,
``TreeCrossAttention`` (with ``tca_loss``), ``PreNormBlock`` (and the official LBANP code's
``PerceiverBlock``) and ``Intention`` (with ``InformerLayer``, ``Informer``).

>>> import torch, attn_ext as ae
>>> mha = ae.nn.MultiheadCrossAttention(16, 2)
>>> mha(torch.randn(1, 3, 16), torch.randn(1, 50, 16), torch.randn(1, 50, 16))[0].shape
torch.Size([1, 3, 16])
"""
from attn_ext.nn.cmab import CMAB, CMABState
from attn_ext.nn.intention import Informer, InformerLayer, Intention
from attn_ext.nn.latents import learned_latents
from attn_ext.nn.multihead_cross_attention import MultiheadCrossAttention
from attn_ext.nn.perceiver_block import OfficialPerceiverBlock, PerceiverBlock
from attn_ext.nn.prenorm_block import PreNormBlock
from attn_ext.nn.tca_loss import TCALoss, tca_loss
from attn_ext.nn.tree_cross_attention import TreeCrossAttention, TreeCrossAttentionOutput, TreeState

__all__ = [
    "CMAB",
    "CMABState",
    "Informer",
    "InformerLayer",
    "Intention",
    "MultiheadCrossAttention",
    "OfficialPerceiverBlock",
    "PerceiverBlock",
    "PreNormBlock",
    "TCALoss",
    "TreeCrossAttention",
    "TreeCrossAttentionOutput",
    "TreeState",
    "learned_latents",
    "tca_loss",
]
