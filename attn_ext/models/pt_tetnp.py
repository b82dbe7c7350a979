"""PT-TETNP (Ashman et al. 2024's pseudo-token TE-TNP; the efficient-NP chapter's "PT-TETNP"): IST's structure on
translation-equivariant attention, with pseudo tokens that carry their own locations."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributions import Normal

from attn_ext.models.base import GaussianHead, NeuralProcess, NPConfig, check_points, mlp
from attn_ext.models.tetnp import embed_from_y
from attn_ext.nn.latents import learned_latents
from attn_ext.nn.layer_norm import LayerNorm
from attn_ext.nn.te_attention import TEMultiheadAttention


class TECrossBlock(nn.Module):
    """``A = A + TEAttn(LN(A), LN(B); x_A, x_B); A + FF(LN'(A))``: tokens ``A`` at inputs ``x_A`` read tokens ``B``
    at ``x_B`` (the pre-norm cross-attention block of IST, on :class:`~attn_ext.nn.te_attention.TEMultiheadAttention`).
    ``return_mean_inputs``: also ``Σ_j w_ij x_B,j`` with the head-averaged attention weights, ``[B, N_A, dim_x]``."""

    def __init__(self, dim: int, num_heads: int, ff_dim: int, dim_x: int, kernel_hidden: Optional[int]) -> None:
        super().__init__()
        self.norm_q, self.norm_kv, self.norm_ff = LayerNorm(dim), LayerNorm(dim), LayerNorm(dim)
        self.attention = TEMultiheadAttention(dim, num_heads, dim_x, kernel_hidden)
        self.ff = nn.Sequential(nn.Linear(dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, dim))

    def forward(self, a: Tensor, b: Tensor, xa: Tensor, xb: Tensor, return_mean_inputs: bool = False):
        attended = self.attention(self.norm_q(a), self.norm_kv(b), xa, xb, return_mean_inputs=return_mean_inputs)
        out, mean_inputs = attended if return_mean_inputs else (attended, None)
        a = a + out
        a = a + self.ff(self.norm_ff(a))
        return (a, mean_inputs) if return_mean_inputs else a


class PTTETNP(NeuralProcess):
    """Pseudo-token translation-equivariant TNP: ``num_latents`` pseudo tokens with features and locations
    summarise the context through translation-equivariant attention, linear in ``N_c``.

    Layer ``ℓ = 1..L``, with ``MAB(A, B)`` a :class:`TECrossBlock` (``A`` at its inputs reads ``B`` at theirs):

    - ``P_ℓ = MAB(P_{ℓ−1}, C_{ℓ−1})`` at locations ``(u_{ℓ−1}, x_c)`` — the pseudo tokens read the context;
    - ``u_ℓ = u_{ℓ−1} + γ_ℓ · Σ_j w_j (x_{c,j} − u_{ℓ−1})``, ``w`` that attention's head-averaged weights,
      ``γ_ℓ`` a learned scalar (0 at initialisation): each pseudo token moves towards the context it reads;
    - ``T_ℓ = MAB(T_{ℓ−1}, P_ℓ)`` at ``(x_t, u_ℓ)`` — the targets read the pseudo tokens;
    - ``C_ℓ = MAB(C_{ℓ−1}, P_ℓ)`` at ``(x_c, u_ℓ)`` — the context reads them (skipped in the last layer).

    Tokens are embedded from ``y`` alone as in :class:`~attn_ext.models.TETNP` (``MLP([y_c, 0])`` per context point,
    ``MLP([0, 1])`` per target); the pseudo tokens start from a learned ``[num_latents, d_model]`` array and at the
    locations ``u_0 = mean(x_c) + δ`` with learned offsets ``δ [num_latents, dim_x]``. Inputs enter only through
    differences (the attention's ``x_i − x_j``, the locations' ``x_{c,j} − u``, and ``u_0`` is a shift of the
    context's mean), so shifting every input of a task by one vector leaves its predictions unchanged, and every
    attention is between the pseudo tokens and the context or the targets: time and memory
    ``O((N_c + N_t) · num_latents)`` per layer (each attention's MLP holds ``[B, ·, num_latents, kernel_hidden]``).
    A task needs one context point (the locations start at its mean).

    Parameters
    ----------
    config, **overrides
        Sizes (:class:`~attn_ext.models.NPConfig`; ``num_latents`` pseudo tokens).
    kernel_hidden : int, optional
        Hidden width of each attention's logit MLP (default ``d_model``).

    Examples
    --------
    >>> import torch
    >>> from attn_ext.models import PTTETNP
    >>> model = PTTETNP(d_model=16, num_layers=2, num_heads=2, ff_dim=32, emb_depth=2, num_latents=8)
    >>> xc, yc, xt = torch.randn(2, 10, 1), torch.randn(2, 10, 1), torch.randn(2, 7, 1)
    >>> pred = model.predict(xc, yc, xt)
    >>> pred.mean.shape, torch.allclose(pred.mean, model.predict(xc + 3.0, yc, xt + 3.0).mean, atol=1e-5)
    (torch.Size([2, 7, 1]), True)
    """

    def __init__(self, config: Optional[NPConfig] = None, *, kernel_hidden: Optional[int] = None,
                 **overrides) -> None:
        super().__init__(config, **overrides)
        c = self.config
        if c.num_heads < 1 or c.d_model % c.num_heads:
            raise ValueError(f"PTTETNP: num_heads={c.num_heads} must divide d_model={c.d_model}")
        if c.num_layers < 1 or c.num_latents < 1:
            raise ValueError(f"PTTETNP: num_layers and num_latents must be >= 1, got {c.num_layers}, "
                             f"{c.num_latents}")
        self.kernel_hidden = c.d_model if kernel_hidden is None else int(kernel_hidden)
        self.embedder = None  # absolute inputs never reach the features (TETNP's token embedding instead)
        self.token_embedder = mlp(c.dim_y + 1, c.d_model, c.d_model, c.emb_depth)
        self.pseudo_tokens = learned_latents(c.num_latents, c.d_model)
        self.pseudo_offsets = nn.Parameter(0.1 * torch.randn(c.num_latents, c.dim_x))
        self.location_steps = nn.Parameter(torch.zeros(c.num_layers))

        def block() -> TECrossBlock:
            return TECrossBlock(c.d_model, c.num_heads, c.ff_dim, c.dim_x, self.kernel_hidden)

        self.context_to_pseudo = nn.ModuleList(block() for _ in range(c.num_layers))
        self.pseudo_to_target = nn.ModuleList(block() for _ in range(c.num_layers))
        self.pseudo_to_context = nn.ModuleList(block() for _ in range(c.num_layers - 1))
        self.norm = LayerNorm(c.d_model)
        self.head = GaussianHead(c.d_model, c.ff_dim, c.dim_y)

    def options(self) -> dict:
        """``kernel_hidden``, the width of the logit MLPs."""
        return {"kernel_hidden": self.kernel_hidden}

    def embed_pairs(self, x: Tensor, y: Optional[Tensor]) -> Tensor:
        raise TypeError("PTTETNP has no [x, y] embedding: its tokens are embedded from y alone")

    def predict(self, xc: Tensor, yc: Tensor, xt: Tensor) -> Normal:
        """Predictive ``Normal`` over ``yt``, mean and scale ``[B, N_t, dim_y]``."""
        check_points(self, xc=xc, yc=yc, xt=xt)
        if xc.shape[1] == 0:
            raise ValueError(f"PTTETNP: the context must have at least one point (the pseudo tokens start at its "
                             f"mean), got xc {tuple(xc.shape)}")
        batch, num_context = xc.shape[0], xc.shape[1]
        tokens = embed_from_y(self.token_embedder, yc, xt.shape[1])
        context, targets = tokens[:, :num_context], tokens[:, num_context:]
        pseudo = self.pseudo_tokens.to(yc.dtype).expand(batch, -1, -1)
        where = xc.mean(1, keepdim=True) + self.pseudo_offsets.to(xc.dtype)            # [B, L, dim_x]
        for i, (read_context, read_pseudo) in enumerate(zip(self.context_to_pseudo, self.pseudo_to_target)):
            pseudo, read_inputs = read_context(pseudo, context, where, xc, return_mean_inputs=True)
            # Each pseudo token moves towards the context points it read: Σ_j w_j (x_j − u), the weights summing to 1.
            where = where + self.location_steps[i] * (read_inputs - where)
            targets = read_pseudo(targets, pseudo, xt, where)
            if i < len(self.pseudo_to_context):
                context = self.pseudo_to_context[i](context, pseudo, xc, where)
        return self.head(self.norm(targets))
