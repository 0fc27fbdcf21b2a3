"""Loss scaling: the factor each backward's loss was multiplied by, read on the device.

Two sources multiply: a ``torch.amp.GradScaler``'s scale (``grad_scaler=``; a NaN or Inf is then an
overflow that must reach ``.grad``), and the user's own factor (``loss_scale=``: gradient
accumulation that divides each micro-batch's loss by k, as Lightning's ``accumulate_grad_batches``
and HF ``Trainer`` do, is ``loss_scale=1/k``).

With ``scaler.scale(loss).backward()`` every gradient autograd delivers is ``S`` times the gradient
of the loss itself. pergrad divides each layer's output gradient by ``S`` as it arrives, so the
per-sample gradients, their norms and the statistics are those of the samples' own losses (the
same with and without mixed precision, and what a clipping bound refers to), and multiplies what
it writes into ``.grad`` by ``S`` again, so ``.grad`` stays in the scaler's units and
``scaler.unscale_`` / ``scaler.step`` work unchanged. The scale is read as a tensor: no host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeAlias

import torch
from torch import Tensor

LossScale = Callable[[], "Tensor | None"]
# what PerSampleModule(loss_scale=...) takes: the factor itself, or a callable returning it at each backward
LossScaleLike: TypeAlias = float | Tensor | Callable[[], float | Tensor | None] | None
# what PerSampleModule(grad_scaler=...) takes
GradScalerLike: TypeAlias = torch.amp.GradScaler | LossScaleLike

_WHAT = (
    "grad_scaler must be a torch.amp.GradScaler, the loss scale itself (a positive number or a one-element "
    "floating-point tensor, read at each backward), or a callable returning one (or None for an unscaled loss)"
)

_FACTOR = (
    "loss_scale must be the factor the loss is multiplied by before its backward (a positive number or a "
    "one-element floating-point tensor, read at each backward), or a callable returning it (or None for 1)"
)


def _as_scale(value: object, what: str) -> Tensor | None:
    """``value`` as a 0-dim tensor (a number as float64 on the CPU: it mixes with tensors on any device)."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(
                f"{what}: the loss scale must be a one-element floating-point tensor, "
                f"got shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{what}: the loss scale must be a finite number > 0, got {value!r}")
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"{_WHAT}; {what} gave {type(value).__name__}")


def loss_scale_reader(grad_scaler: GradScalerLike) -> LossScale | None:
    """A function returning the loss scale of the backward running now (None: the loss is not scaled).

    - a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` too): its scale tensor; None while
      it is disabled (``enabled=False``: ``scale()`` leaves the loss alone) or before its first
      ``scale()`` call;
    - a number or a one-element tensor: that scale (a tensor is read at each backward, so in-place
      updates count);
    - a callable: called at each backward, returning a number, a tensor or None.
    """
    if grad_scaler is None:
        return None
    if isinstance(grad_scaler, torch.amp.GradScaler):
        scaler = grad_scaler

        def from_scaler() -> Tensor | None:
            if not scaler.is_enabled():
                return None
            found = scaler._get_scale_async()  # the scale tensor itself, None before the first scale()
            return None if found is None else found.detach().reshape(())

        return from_scaler
    return factor_reader(grad_scaler, "grad_scaler")


def factor_reader(value: LossScaleLike, what: str = "loss_scale") -> LossScale | None:
    """A function returning the factor ``value`` says the loss is multiplied by (None: 1): a number or a
    one-element tensor (a tensor is read at each backward, so in-place updates count), or a callable
    called at each backward, returning a number, a tensor or None."""
    if value is None:
        return None
    if isinstance(value, (Tensor, int, float)) and not isinstance(value, bool):
        fixed = _as_scale(value, what)
        return lambda: fixed
    if callable(value):
        fn = value
        return lambda: _as_scale(fn(), f"the {what} callable")
    expected = _WHAT if what == "grad_scaler" else _FACTOR
    raise TypeError(f"{expected}; got {type(value).__name__}")


def on_device(scale: Tensor, like: Tensor) -> Tensor:
    """``scale`` where it can be used with ``like`` (a 0-dim CPU tensor mixes with any device)."""
    if scale.device == like.device or scale.device.type == "cpu":
        return scale
    return scale.to(like.device, non_blocking=like.device.type != "cpu")  # into host memory: wait for it
