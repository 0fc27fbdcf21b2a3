"""The reference every rule is checked against: torch.func on each sample's own loss."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def squared_error(out: Tensor, target: Tensor) -> Tensor:
    """A per-sample loss that works for any output shape: ``f_i = sum (out_i - t_i)^2``."""
    return (out - target).pow(2).sum()


def reference_grad_sample(
    model: nn.Module,
    x: Tensor,
    target: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor] = squared_error,
    batch_dim: int = 0,
) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: ``d f_i / d p`` for every trainable parameter, via vmap(grad)."""
    model = _without_buffer_updates(model)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def f(params: dict[str, Tensor], xi: Tensor, ti: Tensor) -> Tensor:
        out = functional_call(model, (params, frozen, buffers), (xi.unsqueeze(batch_dim),))
        return loss(out, ti.unsqueeze(batch_dim))

    try:
        return vmap(grad(f), in_dims=(None, batch_dim, batch_dim))(params, x, target)
    except RuntimeError as err:  # a kernel without a batching rule for these shapes (conv1d on length 1)
        if "must be contiguous" not in str(err):
            raise
    grads = [grad(f)(params, x.select(batch_dim, i), target.select(batch_dim, i)) for i in range(x.shape[batch_dim])]
    return {k: torch.stack([g[k] for g in grads]) for k in params}


def _without_buffer_updates(model: nn.Module) -> nn.Module:
    """A copy whose training-mode instance norms do not update running statistics (vmap cannot
    write into unbatched buffers); their outputs use each sample's own statistics either way."""
    if not any(isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training:
            m.track_running_stats, m.running_mean, m.running_var = False, None, None
    return model


def run_pergrad(psm, x: Tensor, target: Tensor, loss_reduction: str = "mean", batch_dim: int = 0) -> Tensor:
    """One forward/backward through the wrapper with the batch loss matching ``loss_reduction``."""
    total = (psm(x) - target).pow(2).sum()
    loss_value = total / x.shape[batch_dim] if loss_reduction == "mean" else total
    loss_value.backward()
    return loss_value


def assert_close(actual: Tensor, expected: Tensor, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")
