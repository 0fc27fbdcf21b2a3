"""Replacing layers pergrad refuses by ones it supports: ``fix_batchnorm`` (as Opacus's ``ModuleValidator.fix``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pergrad.errors import module_label

#: the batch norms ``fix_batchnorm`` replaces: exact types (a subclass may compute something else)
BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _default_groups(bn: nn.modules.batchnorm._BatchNorm) -> int:
    """One group for ``BatchNorm1d`` (on ``[N, C]`` inputs a group of one channel would hold one value);
    otherwise the largest divisor of the channels that is at most 32 (Opacus's ``min(32, channels)``,
    made to divide)."""
    channels = int(bn.num_features)
    if isinstance(bn, nn.BatchNorm1d):
        return 1
    return max(g for g in range(1, min(32, channels) + 1) if channels % g == 0)


def _group_norm(
    name: str, bn: nn.modules.batchnorm._BatchNorm, groups: int | Callable[[int], int] | None
) -> nn.GroupNorm:
    channels = bn.num_features
    count = _default_groups(bn) if groups is None else groups(channels) if callable(groups) else groups
    if not (isinstance(count, int) and count > 0 and channels % count == 0):
        raise ValueError(
            f"fix_batchnorm: {module_label(name)} ({type(bn).__name__}) has {channels} channels, which {count!r} groups "
            f"do not divide; pass groups= a divisor of every BatchNorm's channels, or a function of the channels "
            f"(the default here gives {_default_groups(bn)})"
        )
    like = next((t for t in (*bn.parameters(), *bn.buffers()) if t.is_floating_point()), None)
    dtype, device = (like.dtype, like.device) if like is not None else (torch.get_default_dtype(), None)
    gn = nn.GroupNorm(count, channels, eps=bn.eps, affine=bn.affine, device=device, dtype=dtype)
    if bn.affine:  # the same per-channel scale and shift, trainable as they were
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def fix_batchnorm(model: nn.Module, groups: int | Callable[[int], int] | None = None) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) of ``model`` by an ``nn.GroupNorm``
    of the same channels, ``eps`` and affine setting, in place; returns ``model`` (the new ``GroupNorm``
    when ``model`` is itself a batch norm). Call it before building the optimizer: the new layers'
    parameters are new tensors.

    A batch norm in training mode normalises with the statistics of the whole batch, so per-sample
    gradients are undefined through it (pergrad refuses it in the forward); a group norm normalises each
    sample on its own. The affine weight and bias are copied (the same per-channel scale and shift);
    the running statistics are dropped (a group norm has none), so a pretrained model's outputs change:
    fine-tune it after the swap.

    Args:
        model: the model (or a batch norm).
        groups: the number of groups of every ``GroupNorm``: an int dividing every batch norm's channels,
            a function of the channels, or None: 1 for a ``BatchNorm1d`` (its ``[N, C]`` inputs have one
            value per channel, and a group needs several), else the largest divisor of the channels up to 32
            (Opacus uses ``min(32, channels)`` for every one, which fails where 32 does not divide them).

    Raises:
        ValueError: ``groups`` does not divide a batch norm's channels (naming it), or a lazy batch norm
            has no channels yet (run a forward first).
    """
    modules = list(model.named_modules(remove_duplicate=False))
    for name, m in modules:
        if isinstance(m, nn.modules.batchnorm._LazyNormBase) and m.has_uninitialized_params():
            raise ValueError(
                f"fix_batchnorm: {module_label(name)} ({type(m).__name__}) is lazy: its channels are known after its "
                "first forward; run one (under torch.no_grad()) first"
            )
    # every GroupNorm is made before the model changes (all or nothing); one per batch norm, wherever it sits
    made: dict[int, nn.GroupNorm] = {}
    for name, m in modules:
        if type(m) in BATCH_NORMS and id(m) not in made:
            made[id(m)] = _group_norm(name, m, groups)
    if id(model) in made:
        return made[id(model)]
    for name, m in modules:
        if id(m) in made:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, made[id(m)])
    return model
