"""Opacus's ``DPOptimizer`` stepping a wrapped model's parameters (``make_private(...,
grad_sample_mode="no_op")``): it reads ``p.grad_sample``, clips it itself and overwrites ``.grad``. What
would drop or mix pergrad's numbers on that route is refused with ``OpacusRouteError``: a parameter it
steps needs ``grad_sample`` kept (``keep_grad_sample=True``), untransformed, and of one forward only.

The checks plug into the core's ``INTEGRATION_CHECKS``: they run only in a process that imported Opacus.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from torch import nn

from pergrad._core.backward.engine import INTEGRATION_CHECKS, IntegrationCheck
from pergrad._core.backward.targets import Targets
from pergrad.errors import PergradError


class OpacusRouteError(PergradError, RuntimeError):
    """Opacus's ``DPOptimizer`` steps parameters of the wrapped model (``make_private(...,
    grad_sample_mode="no_op")``) in a way that would drop or mix what pergrad computed."""


def stepped_by_opacus(param: nn.Parameter) -> bool:
    """Whether Opacus's ``DPOptimizer`` steps ``param``: it gives every parameter it steps a
    ``summed_grad`` attribute when made (``make_private``), and clips ``p.grad_sample`` into it."""
    return "summed_grad" in vars(param)


_NO_OP_ROUTE = (
    "The route that keeps Opacus: PerSampleModule(model, keep_grad_sample=True) with no transform, and "
    'make_private(..., grad_sample_mode="no_op", loss_reduction=<the same as pergrad\'s>)'
)


def check_opacus(
    params: Container[nn.Parameter], keep_grad_sample: bool, targets: Targets, names: dict[nn.Parameter, str]
) -> None:
    """Opacus's ``DPOptimizer`` clips ``p.grad_sample`` itself and overwrites ``.grad``: a parameter it
    steps needs ``grad_sample`` kept, and a transform of pergrad would be dropped without a word."""
    # in the model's order (a parameter's hash is a Python call: asked only of those Opacus steps)
    stepped = [p for p in names if stepped_by_opacus(p) and p in params]
    if not stepped:
        return
    if not keep_grad_sample:
        raise OpacusRouteError(
            f"parameter {names[stepped[0]]!r} is stepped by Opacus's DPOptimizer (make_private), which clips "
            "p.grad_sample, but this PerSampleModule was made with keep_grad_sample=False, so there is none. "
            f"Pass keep_grad_sample=True. {_NO_OP_ROUTE}."
        )
    for target in targets:
        mine = set(target.params.values())
        covered = [p for p in stepped if p in mine]
        if covered:
            raise OpacusRouteError(
                f"parameter {names[covered[0]]!r} is stepped by Opacus's DPOptimizer (make_private), which clips "
                "p.grad_sample (before any transform) itself and overwrites .grad, but pergrad has a transform "
                f"registered for {target.label}: it would be dropped. Remove the transform and let make_private's "
                "max_grad_norm clip, or keep the transform and step a plain torch.optim optimizer (adding the noise "
                f"yourself). {_NO_OP_ROUTE}."
            )


def check_opacus_stale(held: Iterable[nn.Parameter], names: dict[nn.Parameter, str]) -> None:
    """A backward of a new forward would replace ``grad_sample`` (pergrad keeps the last forward's)
    while Opacus's ``DPOptimizer`` has not consumed and cleared the one of the forward before: it
    would clip only this backward's samples, not every sample since its last step."""
    stale = [p for p in held if stepped_by_opacus(p)]
    if stale:
        raise OpacusRouteError(
            f"parameter {names[stale[0]]!r} still holds the grad_sample of an earlier forward, which Opacus's "
            "DPOptimizer has not cleared, and pergrad keeps only the last forward's grad_sample: the optimizer "
            "would clip this backward's samples only. Call optimizer.step() and optimizer.zero_grad() after every "
            "backward; for a logical batch larger than one forward, use Opacus's BatchMemoryManager (virtual "
            "steps accumulate the clipped sums in the optimizer)."
        )


INTEGRATION_CHECKS["opacus"] = IntegrationCheck(
    libraries=("opacus",),
    begin=lambda engine, generation: check_opacus_stale(engine.grad_sample.held(generation), engine.param_names),
    end=lambda engine, batch: check_opacus(
        batch.params, engine.options.keep_grad_sample, engine.targets, engine.param_names
    ),
)
