"""A wrapped model called from a Lightning module's ``training_step`` whose Trainer divides each
micro-batch's loss by ``k = accumulate_grad_batches``: pergrad must be told (``loss_scale=1/k``), or
it would see ``g_i / k`` (``clip_norm(C)`` clipping each sample at ``kC``). ``PerSample`` of
``pergrad.integrations.lightning`` sets it; a model wrapped by hand is checked here, at every call.

The check plugs into the core's ``INTEGRATION_CHECKS``: it runs only in a process that imported
Lightning, and Lightning is never imported here.
"""

from __future__ import annotations

import math
import sys
from types import FrameType
from typing import TYPE_CHECKING

from torch import nn

from pergrad._core.backward.engine import INTEGRATION_CHECKS, IntegrationCheck
from pergrad._core.loss_scale import factor_reader
from pergrad.integrations.errors import TrainerConfigError

if TYPE_CHECKING:
    from pergrad.module import PerSampleModule


def lightning_divisor(model: nn.Module) -> tuple[int, nn.Module] | None:
    """``(k, module)`` where ``model`` is being called from the ``training_step`` of a Lightning module
    that holds it, whose Trainer divides each micro-batch's loss by ``k = accumulate_grad_batches > 1``
    before its backward (automatic optimization); else None.

    The callers' frames are searched for a ``training_step`` method of a module with an attached ``_trainer`` (duck typing), a few string
    comparisons per frame."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "training_step":
            holder = frame.f_locals.get("self")
            trainer = getattr(holder, "_trainer", None) if isinstance(holder, nn.Module) else None
            k = getattr(trainer, "accumulate_grad_batches", None)
            if isinstance(holder, nn.Module) and isinstance(k, int):
                automatic = getattr(holder, "automatic_optimization", True)
                if k > 1 and automatic is True and any(m is model for m in holder.modules()):
                    return k, holder
                return None
        frame = frame.f_back
    return None


def check_loss_divisor(psm: PerSampleModule) -> None:
    """Refuse a call of ``psm`` from the training step of a Lightning module whose Trainer divides each
    micro-batch's loss by ``k = accumulate_grad_batches`` while ``loss_scale`` does not say ``1/k``."""
    found = lightning_divisor(psm.module)
    if found is None:
        return
    k, holder = found
    read = factor_reader(psm.loss_scale)
    factor = None if read is None else read()
    if factor is not None and math.isclose(float(factor), 1.0 / k, rel_tol=1e-9):
        return
    said = "no loss_scale" if factor is None else f"loss_scale={float(factor):g}"
    raise TrainerConfigError(
        f"the wrapped {type(psm.module).__name__} is called from the training_step of {type(holder).__name__}, "
        f"whose Trainer(accumulate_grad_batches={k}) divides each micro-batch's loss by {k} before its backward, "
        f"but the wrapper has {said}: pergrad would see each sample's gradient divided by {k} (a clip_norm(C) "
        f"would clip it at {k}C, a privacy bound {k} times weaker than set). Pass "
        "loss_scale=lambda: 1 / self.trainer.accumulate_grad_batches to PerSampleModule (or set psm.loss_scale "
        "so), or let pergrad.integrations.lightning.PerSample('<attribute of the network>', transforms={...}) wrap "
        "it: it sets the loss scale and checks the Trainer's other options."
    )


INTEGRATION_CHECKS["lightning"] = IntegrationCheck(
    libraries=("lightning.pytorch", "pytorch_lightning"), forward=check_loss_divisor
)
