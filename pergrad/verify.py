"""The first backward's check, and what pergrad says when a gradient reached a parameter in a way
it cannot split into samples.

The check: the per-sample gradients must add up to autograd's gradient of every parameter,
``sum_i g_i = grad`` (``(1/B) sum_i g_i`` for a mean loss). They do unless part of the loss reaches
a parameter other than through its layer's output: a regulariser added to the loss, or a parent
module using the parameter directly. pergrad cannot attribute that part to samples, so it refuses
rather than drop or transform it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .errors import HookStateError
from .hooks import HookedLayer
from .sources import Fused, Materialized


def check_sums(
    source: Materialized | Fused,
    params: list[nn.Parameter],
    batch_grads: dict[nn.Parameter, Tensor],
    batch_size: int,
    loss_reduction: str,
    names: dict[nn.Parameter, str],
) -> None:
    """Raise ``HookStateError`` for the first parameter whose per-sample gradients do not add up to
    autograd's ``batch_grads`` (in the units of the per-sample gradients), within the round-off of
    two summation orders."""
    first = batch_grads[params[0]]
    weight = 1.0 / batch_size if loss_reduction == "mean" else 1.0
    totals = source.summed(params, first.new_full((batch_size,), weight))
    for p in params:
        autograd = batch_grads[p]
        ours = totals[p].to(autograd.dtype)
        if not torch.isfinite(autograd).all():
            continue  # non-finite values: nothing to compare; a poisoned sample is handled elsewhere
        # round-off of two summation orders, relative to the larger side, plus a floor for sums
        # that cancel to ~0 (a term below the floor would not change training anyway)
        rel, floor = (1e-6, 1e-10) if autograd.dtype == torch.float64 else (1e-2, 1e-4)
        scale = torch.maximum(autograd.abs().max(), ours.abs().max())
        if not torch.allclose(autograd, ours, rtol=0, atol=float(rel * scale + floor)):
            raise HookStateError(
                unattributable(names[p], f"max difference {float((autograd - ours).abs().max()):.3g}")
                + " Or pass verify=False to PerSampleModule if dropping that part is intended."
            )


def unreached(
    param: nn.Parameter, name: str, layers: list[HookedLayer], canonical: Callable[[nn.Parameter], nn.Parameter]
) -> str:
    """What pergrad saw when a parameter got a gradient that none of its layers' outputs passed on."""
    holders = [layer for layer in layers if any(canonical(p) is param for _, p in layer.trainable())]

    def caught(layer: HookedLayer) -> str:
        if layer.spec.raw:
            return f"the uses of {layer.label} in its forward"
        if layer.spec.output_dims is not None:
            return f"any tensor returned by {layer.label}"
        return (
            f"the first tensor returned by {layer.label}" if layer.spec.all_inputs else f"the output of {layer.label}"
        )

    where = " or ".join(caught(layer) for layer in holders)
    return (
        f"parameter {name!r} received a gradient in this backward pass, but pergrad caught "
        f"no gradient on {where or 'the output of a hooked layer holding it'} in a forward of the wrapped "
        "model: the gradient reached the parameter another way, which pergrad cannot split into samples. "
        "Such a way is a loss computed from a forward run before wrapping (or through another wrapper), a "
        "module using the parameter outside the layer's own forward (e.g. F.linear(x, self.emb.weight)), or "
        "an output of the layer that its rule does not take (a rule registered without output_dims takes "
        "the first tensor the layer returns)."
    )


def unattributable(name: str, seen: str) -> str:
    """A parameter's gradient has a part no hooked layer's output produced (``seen``: the evidence)."""
    return (
        f"parameter {name!r}: its gradient has a part that no hooked layer's output "
        f"produced ({seen}). A term of the loss that uses the parameter directly (a regulariser such as "
        "weight decay: use the optimizer's weight_decay instead) or a parent module using it outside the "
        "layer's forward (e.g. F.linear(x, self.emb.weight)) cannot be attributed to samples. Compute it "
        "through the layer."
    )
