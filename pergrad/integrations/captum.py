"""TracIn scores as captum's ``TracInCP`` computes them, from pergrad's per-sample gradients.

TracIn (Pruthi et al., 2020) scores a training sample ``z`` against a test sample ``z'`` by
``sum_c lr_c <grad f_z(theta_c), grad f_z'(theta_c)>`` over checkpoints ``theta_c``, ``f`` the loss of one
sample. captum's ``TracInCP`` (default mode) asks autograd for each sample's gradient one sample at a
time (``torch.autograd.grad`` on the weights), which a model still wrapped refuses from its second
backward on (``DetachedWeightError``: pergrad runs such weights detached and computes their gradients
itself). These functions take captum's arguments (checkpoint paths, a load function returning the
learning rate, a per-sample ``loss_fn``, batches whose last element is the labels) and give its scores
from ``p.grad_sample``: one forward and backward per batch through the wrapper, at every layer pergrad
has a rule for, with the wrapper left attached.

Nothing here imports captum; the scores equal ``TracInCP(...).influence((*inputs, labels))`` and
``.self_influence(...)`` (``tests/test_captum.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pergrad.integrations.errors import CaptumError
from pergrad.module import PerSampleModule

LossFn = Callable[[Tensor, Tensor], Tensor]
LoadFn = Callable[[nn.Module, str], float]


def sample_grads(
    psm: PerSampleModule, batch: Sequence[Any], loss_fn: LossFn, parameters: Sequence[nn.Parameter] | None = None
) -> list[Tensor]:
    """``[B, *p.shape]`` for each parameter (the model's trainable ones, in order, by default): the
    gradient of sample ``i``'s own loss ``loss_fn(psm(*batch[:-1]), batch[-1])[i]``, the Jacobian captum
    computes. ``loss_fn`` returns one loss per sample (``reduction="none"``). Each parameter's ``.grad``
    and ``grad_sample`` are left as they were; a parameter the loss does not reach gets zeros."""
    params = [p for p in psm.module.parameters() if p.requires_grad] if parameters is None else list(parameters)
    *inputs, labels = batch
    kept = {p: (p.grad, p.__dict__.get("grad_sample")) for p in params}
    scale = psm.loss_scale
    try:
        psm.loss_scale = None  # this loss is as loss_fn gives it, whatever the training divides its own by
        for p in params:
            p.grad = None
        losses = loss_fn(psm(*inputs), labels)
        if losses.dim() != 1 or losses.shape[0] != labels.shape[0]:
            raise CaptumError(
                f"loss_fn returned a loss of shape {tuple(losses.shape)} for a batch of {labels.shape[0]} "
                "samples: it must return one loss per sample (e.g. nn.CrossEntropyLoss(reduction='none')), "
                "as captum's TracInCP asks."
            )
        (losses.sum() if psm.loss_reduction == "sum" else losses.mean()).backward()
        grads = [p.__dict__.get("grad_sample") for p in params]
        if any(g is not None for g in grads) or len(labels) == 0:
            return [
                torch.zeros(len(labels), *p.shape, dtype=p.dtype) if g is None else g for p, g in zip(params, grads)
            ]
        raise CaptumError(
            "the backward left no grad_sample on any of the parameters: the PerSampleModule was made with "
            "keep_grad_sample=False, or the loss reaches none of them. Score with a wrapper made with "
            "keep_grad_sample=True (the default)."
        )
    finally:
        psm.loss_scale = scale
        for p, (grad, sample) in kept.items():
            p.grad = grad
            if sample is None:
                p.__dict__.pop("grad_sample", None)
            else:
                p.grad_sample = sample  # type: ignore[attr-defined]


def _flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in grads], dim=1)


def tracin_influence(
    psm: PerSampleModule,
    train: Iterable[Sequence[Any]],
    test: Sequence[Any],
    checkpoints: Sequence[str],
    checkpoints_load_func: LoadFn,
    loss_fn: LossFn,
    test_loss_fn: LossFn | None = None,
    parameters: Sequence[nn.Parameter] | None = None,
) -> Tensor:
    """``[n_test, n_train]``: ``sum_c lr_c <g_test(c), g_train(c)>``, ``lr_c`` what
    ``checkpoints_load_func(psm.module, checkpoint)`` returns after loading checkpoint ``c`` (captum's
    ``TracInCP(model, train, checkpoints, checkpoints_load_func, loss_fn=loss_fn).influence(test)``).
    ``train``: batches ``(*inputs, labels)`` in order (a DataLoader); ``test``: one such batch."""
    total: Tensor | None = None
    for checkpoint in checkpoints:
        rate = checkpoints_load_func(psm.module, checkpoint)
        queries = _flat(sample_grads(psm, test, loss_fn if test_loss_fn is None else test_loss_fn, parameters))
        scores = torch.cat([queries @ _flat(sample_grads(psm, b, loss_fn, parameters)).T for b in train], dim=1)
        total = rate * scores if total is None else total + rate * scores
    if total is None:
        raise CaptumError("tracin_influence needs at least one checkpoint")
    return total


def tracin_self_influence(
    psm: PerSampleModule,
    train: Iterable[Sequence[Any]],
    checkpoints: Sequence[str],
    checkpoints_load_func: LoadFn,
    loss_fn: LossFn,
    parameters: Sequence[nn.Parameter] | None = None,
) -> Tensor:
    """``[n_train]``: ``sum_c lr_c ||g_z(c)||^2`` for every training sample (captum's
    ``TracInCP(...).self_influence(train)``)."""
    total: Tensor | None = None
    for checkpoint in checkpoints:
        rate = checkpoints_load_func(psm.module, checkpoint)
        norms = torch.cat([_flat(sample_grads(psm, b, loss_fn, parameters)).square().sum(1) for b in train])
        total = rate * norms if total is None else total + rate * norms
    if total is None:
        raise CaptumError("tracin_self_influence needs at least one checkpoint")
    return total
