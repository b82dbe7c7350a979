"""Learned latent arrays of the Perceiver-style models (LBANP, CMANP and the CMAB)."""
from __future__ import annotations

import torch
from torch import nn


def learned_latents(num_latents: int, dim: int) -> nn.Parameter:
    """A ``[num_latents, dim]`` parameter drawn from N(0, 1), as Perceiver and the official LBANP/CMANP do.

    The latents enter a pre-norm block's residual stream unnormalised. At a small scale (std 0.02,
    the usual for token embeddings) the first attention's output, nearly the same for every latent
    at initialisation, swamps them: the latents become near-copies and Adam's shared updates keep
    them low-rank. Trained from std 0.02 on the GP task for about 50k steps, the 128 latents of
    LBANP had an effective rank of 5.6 and CMANP's 4.1, against 49.5 for an N(0, 1) draw; from
    N(0, 1), LBANP's training NLL (same seed, same batches) was −0.28 at step 4500 against +0.06.

    Parameters
    ----------
    num_latents, dim : int
        Number of latents and their width.

    Examples
    --------
    >>> from attn_ext.nn import learned_latents
    >>> learned_latents(128, 64).shape
    torch.Size([128, 64])
    """
    return nn.Parameter(torch.randn(num_latents, dim))
