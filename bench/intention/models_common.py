"""Model building blocks shared by the Intention experiments' model modules: MLPs, second-order MAML."""
from __future__ import annotations

from torch import nn
from torch.func import functional_call, grad, vmap


def mlp(sizes, relu_last: bool = False):
    """Linear layers of ``sizes`` (input first) with ReLU between them (and after the last if ``relu_last``).

    Examples
    --------
    >>> mlp([2, 8, 1])
    Sequential(
      (0): Linear(in_features=2, out_features=8, bias=True)
      (1): ReLU()
      (2): Linear(in_features=8, out_features=1, bias=True)
    )
    """
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or relu_last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def maml_adapt_and_apply(net, inner_loss, xc, yc, xq, *, steps: int, lr: float):
    """Second-order MAML: ``net`` adapted to each task's context, then applied to that task's queries.

    For every task of the batch (vectorised with ``torch.func.vmap``), ``steps`` gradient steps at
    rate ``lr`` on ``inner_loss(net(xc), yc)`` start from ``net``'s own parameters; the inner
    gradients keep their graph, so the outer loss differentiates through the adaptation.

    Parameters
    ----------
    net : torch.nn.Module
        The network adapted (read through ``functional_call``; its parameters are not changed).
    inner_loss : callable
        ``inner_loss(prediction, target) -> scalar`` on one task's context.
    xc, yc, xq : Tensor
        Context inputs and targets ``[B, N, ...]`` and queries ``[B, M, ...]``.

    Returns
    -------
    Tensor
        ``net``'s output on ``xq`` after each task's adaptation, ``[B, M, ...]``.

    Examples
    --------
    >>> import torch
    >>> net = mlp([1, 4, 1])
    >>> mse = lambda pred, y: ((pred - y) ** 2).mean()
    >>> x = torch.randn(3, 5, 1)
    >>> tuple(maml_adapt_and_apply(net, mse, x, x, torch.randn(3, 7, 1), steps=2, lr=0.1).shape)
    (3, 7, 1)
    """
    def context_loss(params, x, y):
        return inner_loss(functional_call(net, params, (x,)), y)

    def adapt_and_apply(params, x, y, q):
        for _ in range(steps):
            g = grad(context_loss)(params, x, y)
            params = {k: p - lr * g[k] for k, p in params.items()}
        return functional_call(net, params, (q,))

    return vmap(adapt_and_apply, in_dims=(None, 0, 0, 0))(dict(net.named_parameters()), xc, yc, xq)
