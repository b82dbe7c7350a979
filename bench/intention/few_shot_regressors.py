"""The Intention paper's five few-shot regressors (appendix §4.1), shared by the sine and image tasks.

Every model maps a context ``(xc [B, N, dx], yc [B, N, 1])`` and queries ``xt [B, M, dx]`` to
predictions ``[B, M, 1]``. :func:`build_few_shot_regressor` builds them on input features of width
``dim``: ``prepare(xc, yc, xt, cls)`` validates the shapes (raising ``ValueError`` naming ``cls``)
and returns the features of the context and query positions (the raw positions for the sine task,
Fourier features of pixel positions for the image task). The paper's layer sizes are in each class's
docstring; ``width`` replaces them to fit a CPU budget.
"""
from __future__ import annotations

import torch
from torch import nn

import attn_ext as ae
from bench.intention.models_common import maml_adapt_and_apply, mlp

#: The regressors' keys, in the order of the reports.
REGRESSOR_NAMES = ("intention", "sigma_intention", "attention", "np", "maml")


def check_regressor_options(caller: str, name: str, width: int, *, heads: int, positive: dict,
                            non_negative: dict) -> None:
    """The checks a builder of these regressors runs first, raising ``ValueError`` that names ``caller``.

    ``name`` must be in :data:`REGRESSOR_NAMES`, every value of ``positive`` > 0 and of
    ``non_negative`` >= 0 (option name -> value; all of them are listed in the message), and the
    attention model's ``width`` divisible by its ``heads``.

    Examples
    --------
    >>> check_regressor_options("build", "np", 8, heads=4, positive={"alpha_init": 0}, non_negative={})
    Traceback (most recent call last):
    ...
    ValueError: build: need alpha_init > 0, got 0
    """
    if name not in REGRESSOR_NAMES:
        raise ValueError(f"{caller}: unknown model {name!r}; expected one of {sorted(REGRESSOR_NAMES)}")
    rules = ([(f"{k} > 0", v, v <= 0) for k, v in positive.items()]
             + [(f"{k} >= 0", v, v < 0) for k, v in non_negative.items()])
    if any(bad for _, _, bad in rules):
        raise ValueError(f"{caller}: need {', '.join(rule for rule, _, _ in rules)}, got "
                         f"{', '.join(str(value) for _, value, _ in rules)}")
    if name == "attention" and width % heads:
        raise ValueError(f"{caller}: width {width} is not divisible by heads {heads}")


def check_context_shapes(xc, yc, xt, cls: str, positions: int) -> None:
    """Raise ``ValueError`` naming the model ``cls`` unless ``xc [B, N, positions]``, ``yc [B, N, 1]`` and
    ``xt [B, M, positions]`` (what a ``prepare`` of :func:`build_few_shot_regressor` checks first)."""
    if (xc.dim() != 3 or xc.shape[-1] != positions or yc.shape != (*xc.shape[:2], 1) or xt.dim() != 3
            or xt.shape[-1] != positions or xt.shape[0] != xc.shape[0]):
        context = "xc, yc [B, N, 1]" if positions == 1 else f"xc [B, N, {positions}], yc [B, N, 1]"
        raise ValueError(f"{cls}: expected {context} and xt [B, M, {positions}], got {tuple(xc.shape)}, "
                         f"{tuple(yc.shape)}, {tuple(xt.shape)}")


def build_few_shot_regressor(name: str, width: int, *, dim: int, prepare, heads: int, maml_steps: int,
                             maml_lr: float, alpha_init: float, sigma_scale_init: float):
    """A fresh regressor ``name`` (a key of :data:`REGRESSOR_NAMES`; arguments already checked by the caller,
    with :func:`check_regressor_options`).

    Examples
    --------
    >>> import torch
    >>> prepare = lambda xc, yc, xt, cls: (xc, xt)
    >>> model = build_few_shot_regressor("np", 8, dim=1, prepare=prepare, heads=2, maml_steps=1, maml_lr=0.1,
    ...                                  alpha_init=1.0, sigma_scale_init=10.0)
    >>> tuple(model(torch.randn(2, 5, 1), torch.randn(2, 5, 1), torch.randn(2, 7, 1)).shape)
    (2, 7, 1)
    """
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
            self.embed = mlp([dim, width, width, width, width], relu_last=True)
            # softplus(raw) = alpha_init: α stays positive whatever the optimiser does
            self.raw_alpha = nn.Parameter(torch.tensor(float(alpha_init)).expm1().log())
            # σIntention's scores Q(KᵀK + αI)⁻¹Kᵀ barely change when the shared embedding is rescaled (exactly
            # not at all for α = 0), so without a score scale of its own the softmax could never sharpen
            self.log_query_scale = nn.Parameter(torch.tensor(float(sigma_scale_init)).log()) if sigma else None

        def forward(self, xc, yc, xt):
            ec, et = prepare(xc, yc, xt, type(self).__name__)
            q, k = self.embed(et).unsqueeze(1), self.embed(ec).unsqueeze(1)  # [B, 1, ·, width]: one head
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
            self.embed_key = mlp([dim, width, width, width])
            self.embed_value = mlp([1, width, width, width])
            self.attention = ae.nn.MultiheadCrossAttention(width, heads)
            self.decoder = mlp([width, width, width, 1])

        def forward(self, xc, yc, xt):
            ec, et = prepare(xc, yc, xt, type(self).__name__)
            h, _ = self.attention(self.embed_key(et), self.embed_key(ec), self.embed_value(yc))
            return self.decoder(h)

    class NeuralProcessRegressor(nn.Module):
        """Deterministic (conditional) NP: mean of encoded context pairs, decoded with the query.

        The paper: encoder [2000, 2000, 16], decoder [2000, 2000, 2000, 1], ReLU, Adam 1e-4.
        """

        def __init__(self):
            super().__init__()
            self.encoder = mlp([dim + 1, width, width, 16])
            self.decoder = mlp([16 + dim, width, width, width, 1])

        def forward(self, xc, yc, xt):
            ec, et = prepare(xc, yc, xt, type(self).__name__)
            r = self.encoder(torch.cat([ec, yc], -1)).mean(1, keepdim=True).expand(-1, xt.shape[1], -1)
            return self.decoder(torch.cat([r, et], -1))

    class MAMLRegressor(nn.Module):
        """MAML: an MLP adapted to each context by a few gradient steps, then read at the queries.

        The paper: MLP [128, 128, 128, 128, 1], ReLU, 3 inner steps at rate 0.1 on the context MSE,
        Adam 3e-3 outside. The inner steps keep their graph (second-order MAML), vectorised over the
        tasks of a batch with ``torch.func``.
        """

        def __init__(self):
            super().__init__()
            self.net = mlp([dim, width, width, width, width, 1])

        def forward(self, xc, yc, xt):
            ec, et = prepare(xc, yc, xt, type(self).__name__)
            return maml_adapt_and_apply(self.net, lambda pred, y: ((pred - y) ** 2).mean(), ec, yc, et,
                                        steps=maml_steps, lr=maml_lr)

    builders = {"intention": lambda: IntentionRegressor(False), "sigma_intention": lambda: IntentionRegressor(True),
                "attention": AttentionRegressor, "np": NeuralProcessRegressor, "maml": MAMLRegressor}
    return builders[name]()
