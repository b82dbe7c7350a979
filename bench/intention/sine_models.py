"""The few-shot sine regressors of the Intention paper (appendix §4.1), at a width of our choosing.

Every model maps a context ``(xc [B, N, 1], yc [B, N, 1])`` and queries ``xt [B, M, 1]`` to
predictions ``[B, M, 1]`` and is trained with the MSE of those predictions (the paper's loss). The
paper's layer sizes are in each docstring; ``width`` replaces them (the paper's 1000–2000 wide layers
do not fit a CPU budget of minutes).

Imports of torch and attn_ext happen in :func:`build_sine_model`, so that importing this module for
``--help`` stays instant.
"""
from __future__ import annotations

#: Model names in the order of the report, with the paper's name.
SINE_MODELS = {"intention": "Intention", "sigma_intention": "σIntention", "attention": "Attention",
               "np": "Neural Process", "maml": "MAML"}


def build_sine_model(name: str, width: int = 128, *, heads: int = 4, maml_steps: int = 3, maml_lr: float = 0.1,
                     alpha_init: float = 1.0, sigma_scale_init: float = 10.0):
    """A fresh model of :data:`SINE_MODELS`.

    Parameters
    ----------
    name : str
        Key of :data:`SINE_MODELS`.
    width : int
        Hidden width of every MLP (the paper: 1000 for Intention, 128 for Attention and MAML, 2000 for
        the NP).
    heads : int
        Attention heads (the paper: 5; ``width`` must be divisible by it).
    maml_steps, maml_lr : int, float
        MAML's inner gradient steps and rate (the paper: 3 and 0.1; MAML's own sine setup: 0.01).
    alpha_init : float
        Starting ridge α of the Intention models (learned, positive).
    sigma_scale_init : float
        Starting score scale of σIntention (learned, positive; at 1 its softmax starts nearly flat and
        sharpens too slowly for a short budget).

    Returns
    -------
    torch.nn.Module
        ``model(xc, yc, xt) -> [B, M, 1]``.

    Examples
    --------
    >>> import torch
    >>> xc, yc, xt = torch.randn(2, 5, 1), torch.randn(2, 5, 1), torch.randn(2, 7, 1)
    >>> [tuple(build_sine_model(n, 16)(xc, yc, xt).shape) for n in SINE_MODELS]
    [(2, 7, 1), (2, 7, 1), (2, 7, 1), (2, 7, 1), (2, 7, 1)]
    """
    import torch
    from torch import nn

    import attn_ext as ae

    def mlp(sizes, relu_last=False):
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2 or relu_last:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    def check(xc, yc, xt, cls):
        if (xc.dim() != 3 or xc.shape[-1] != 1 or yc.shape != xc.shape or xt.dim() != 3 or xt.shape[-1] != 1
                or xt.shape[0] != xc.shape[0]):
            raise ValueError(f"{cls}: expected xc, yc [B, N, 1] and xt [B, M, 1], got {tuple(xc.shape)}, "
                             f"{tuple(yc.shape)}, {tuple(xt.shape)}")

    class IntentionRegressor(nn.Module):
        """``Intention(e(xt), e(xc), yc)``: ridge regression of the context values on learned features.

        The paper: one MLP ``e_K`` of layers [1000, 1000, 1000, 1000] with ReLU shared by keys and
        queries, Adam 3e-4. Its appendix also embeds the values with ``e_K`` but lists no decoder back
        to one output; we regress the raw values (``Dv = 1``), which is what makes the untrained model
        a random-feature ridge regression, the behaviour the paper's untrained curves show. ReLU also
        follows the last layer, so the features are those of a random ReLU network. σIntention also
        learns a score scale (a query multiplier, starting at ``sigma_scale_init``), see ``__init__``.
        """

        def __init__(self, sigma: bool):
            super().__init__()
            self.sigma = sigma
            self.embed = mlp([1, width, width, width, width], relu_last=True)
            # softplus(raw) = alpha_init: α stays positive whatever the optimiser does
            self.raw_alpha = nn.Parameter(torch.tensor(float(alpha_init)).expm1().log())
            # σIntention's scores Q(KᵀK + αI)⁻¹Kᵀ barely change when the shared embedding is rescaled (exactly
            # not at all for α = 0), so without a score scale of its own the softmax could never sharpen
            self.log_query_scale = nn.Parameter(torch.tensor(float(sigma_scale_init)).log()) if sigma else None

        def forward(self, xc, yc, xt):
            check(xc, yc, xt, type(self).__name__)
            q, k = self.embed(xt).unsqueeze(1), self.embed(xc).unsqueeze(1)  # [B, 1, ·, width]: one head
            alpha = nn.functional.softplus(self.raw_alpha).reshape(1)
            if self.sigma:
                q = q * self.log_query_scale.exp()
                return ae.sigma_intention(q, k, yc.unsqueeze(1), alpha=alpha).squeeze(1)
            return ae.intention(q, k, yc.unsqueeze(1), alpha=alpha).squeeze(1)

    class AttentionRegressor(nn.Module):
        """Multi-head cross attention of embedded queries over embedded context, then a decoder.

        The paper: ``e_K`` [128, 128, 128] shared by keys and queries, ``e_V`` [128, 128, 128], 5 heads,
        decoder [128, 128, 1], ReLU, Adam 1e-4.
        """

        def __init__(self):
            super().__init__()
            self.embed_key = mlp([1, width, width, width])
            self.embed_value = mlp([1, width, width, width])
            self.attention = ae.nn.MultiheadCrossAttention(width, heads)
            self.decoder = mlp([width, width, width, 1])

        def forward(self, xc, yc, xt):
            check(xc, yc, xt, type(self).__name__)
            h, _ = self.attention(self.embed_key(xt), self.embed_key(xc), self.embed_value(yc))
            return self.decoder(h)

    class NeuralProcessRegressor(nn.Module):
        """Deterministic (conditional) NP: mean of encoded context pairs, decoded with the query.

        The paper: encoder [2000, 2000, 16], decoder [2000, 2000, 2000, 1], ReLU, Adam 1e-4.
        """

        def __init__(self):
            super().__init__()
            self.encoder = mlp([2, width, width, 16])
            self.decoder = mlp([16 + 1, width, width, width, 1])

        def forward(self, xc, yc, xt):
            check(xc, yc, xt, type(self).__name__)
            r = self.encoder(torch.cat([xc, yc], -1)).mean(1, keepdim=True).expand(-1, xt.shape[1], -1)
            return self.decoder(torch.cat([r, xt], -1))

    class MAMLRegressor(nn.Module):
        """MAML: an MLP adapted to each context by a few gradient steps, then read at the queries.

        The paper: MLP [128, 128, 128, 128, 1], ReLU, 3 inner steps at rate 0.1 on the context MSE,
        Adam 3e-3 outside. The inner steps keep their graph (second-order MAML), vectorised over the
        tasks of a batch with ``torch.func``.
        """

        def __init__(self):
            super().__init__()
            self.net = mlp([1, width, width, width, width, 1])

        def forward(self, xc, yc, xt):
            check(xc, yc, xt, type(self).__name__)
            from torch.func import functional_call, grad, vmap

            def inner_loss(params, x, y):
                return ((functional_call(self.net, params, (x,)) - y) ** 2).mean()

            def adapt_and_predict(params, x, y, xq):
                for _ in range(maml_steps):
                    g = grad(inner_loss)(params, x, y)
                    params = {k: p - maml_lr * g[k] for k, p in params.items()}
                return functional_call(self.net, params, (xq,))

            return vmap(adapt_and_predict, in_dims=(None, 0, 0, 0))(dict(self.net.named_parameters()), xc, yc, xt)

    builders = {"intention": lambda: IntentionRegressor(False), "sigma_intention": lambda: IntentionRegressor(True),
                "attention": AttentionRegressor, "np": NeuralProcessRegressor, "maml": MAMLRegressor}
    if name not in builders:
        raise ValueError(f"build_sine_model: unknown model {name!r}; expected one of {sorted(builders)}")
    if alpha_init <= 0 or sigma_scale_init <= 0 or maml_steps < 0:
        raise ValueError(f"build_sine_model: need alpha_init > 0, sigma_scale_init > 0, maml_steps >= 0, got "
                         f"{alpha_init}, {sigma_scale_init}, {maml_steps}")
    if name == "attention" and width % heads:
        raise ValueError(f"build_sine_model: width {width} is not divisible by heads {heads}")
    return builders[name]()
