"""The few-shot sine regressors of the Intention paper (appendix §4.1), at a width of our choosing.

Every model maps a context ``(xc [B, N, 1], yc [B, N, 1])`` and queries ``xt [B, M, 1]`` to
predictions ``[B, M, 1]`` and is trained with the MSE of those predictions (the paper's loss). The
paper's layer sizes are in each docstring; ``width`` replaces them (the paper's 1000–2000 wide layers
do not fit a CPU budget of minutes).

Imports of torch and attn_ext happen in :func:`build_sine_model`, so that importing this module for
``--help`` stays instant.
"""
from __future__ import annotations

from bench.intention.few_shot_regressors import build_few_shot_regressor, check_context_shapes, check_regressor_options

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
    def check(xc, yc, xt, cls):
        check_context_shapes(xc, yc, xt, cls, positions=1)
        return xc, xt

    check_regressor_options("build_sine_model", name, width, heads=heads,
                            positive={"alpha_init": alpha_init, "sigma_scale_init": sigma_scale_init},
                            non_negative={"maml_steps": maml_steps})
    return build_few_shot_regressor(name, width, dim=1, prepare=check, heads=heads, maml_steps=maml_steps,
                                    maml_lr=maml_lr, alpha_init=alpha_init, sigma_scale_init=sigma_scale_init)
