"""The records one layer call leaves on its way from the hooks to the engine.

- ``HookedLayer``: a layer pergrad computes per-sample gradients for (its module and rule);
- ``Kept``: what one call of it kept in the forward (its input, the forward it belongs to);
- ``Detached``: the parameters one call ran with detached (``pergrad._core.shortcuts.detach``);
- ``Call``: one call's input and output gradient, as the end of the backward reads them.

Plain data: the hooks (capture) make them, the sources and consumers read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pergrad._core.capture.parametrized import Computed, parametrization_parameters
from pergrad.errors import module_label
from pergrad.registry import LayerCall, RuleSpec, output_tensors


@dataclass(frozen=True)
class HookedLayer:
    """A layer pergrad computes per-sample gradients for."""

    name: str  # qualified name in the wrapped model ("" for the root)
    module: nn.Module
    spec: RuleSpec
    param: str = ""  # for a raw parameter (``spec.raw``): its name in the module
    # for a raw parameter held in a ParameterDict or ParameterList (never called itself): the module
    # whose forward reads it (peft's LoRA on an embedding reads lora_embedding_A/B this way)
    host: nn.Module | None = None

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the rule computes per-sample gradients for, named as the rule names them."""
        if self.param:
            p = self.module._parameters[self.param]
            return [(self.param, p)] if isinstance(p, nn.Parameter) and p.requires_grad else []
        if self.spec.subtree:
            return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        params = self.module._parameters
        found = [(n, p) for n, p in params.items() if p is not None and p.requires_grad]
        if len(found) > 2 or (len(found) == 2 and found[0][1] is found[1][1]):  # a parameter under two names
            own = {id(p): (n, p) for n, p in reversed(params.items()) if p is not None}
            found = [(n, p) for n, p in reversed(own.values()) if p.requires_grad]  # first name of each, in order
        if self.spec.parametrized:  # the original tensors its parametrized ones are computed from
            found += parametrization_parameters(self.module)
        return found

    @functools.cached_property
    def label(self) -> str:
        """How messages name it."""
        where = module_label(self.name)
        if self.param:
            return f"parameter {self.param!r} of {where} ({type(self.module).__name__})"
        return f"{where} ({type(self.module).__name__})"

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the layer's parameters: per-sample gradients are computed in it."""
        if self.param or self.spec.subtree or self.spec.parametrized:
            return next((p.dtype for _, p in self.trainable()), None)
        return next((p.dtype for p in self.module._parameters.values() if p is not None and p.requires_grad), None)


@dataclass(eq=False, slots=True)
class Kept:
    """What one call of a hooked layer left for the backward."""

    layer: HookedLayer
    a: Any  # the layer's input, batch on dim 0 (a LayerCall for rules that take all inputs)
    generation: int  # which forward of the wrapped model this call belongs to
    batch_size: int
    key: str = ""  # the layer's name, with ":k" for its k-th call (k >= 1) in that forward
    packed: bool = False  # the output is a PackedSequence: d is its data, rows of every sample mixed
    detached: Detached | None = None  # parameters this call ran with detached (see ``Detached``)
    # the backward pass (autograd graph task) that ran this call again (activation checkpointing
    # recomputes a segment inside a backward; see ``Engine.on_recompute``); None in a forward
    task: int | None = None
    # the input is shared by the batch (``pergrad._core.shortcuts.shared``): a detached copy is kept; or the
    # layer is a raw parameter. Either way d arrives at each meeting with the batch, not at a node of the call.
    shared: bool = False
    given: Tensor | None = None  # the input as the layer got it, where ``a`` is a view of it (batch moved to dim 0)

    def inputs(self) -> tuple[Tensor, ...]:
        """The tensors the call got as its input (every argument's, for a rule that takes all inputs),
        as the forward passed them to the layer."""
        a = self.given if self.given is not None else self.a
        if isinstance(a, Computed):
            a = a.input
        if isinstance(a, LayerCall):
            return output_tensors((a.args, a.kwargs))
        return (a,) if isinstance(a, Tensor) else ()


@dataclass(frozen=True, eq=False)
class Detached:
    """A layer call that runs with its weight detached.

    ``anchor`` tells which backward passes reach the detached parameters: its ``AccumulateGrad``
    node runs exactly when the call's output gradient flows in a backward that accumulates into
    ``.grad`` (``.backward()``, not ``torch.autograd.grad``). It is the layer's trainable bias, or,
    for a layer without one, a zero tensor of pergrad's (a leaf that requires grad) put in the
    bias's place for the call, or added to the call's output (a convolution: its backward computes
    the bias gradient only together with the weight gradient). Adding 0 changes no output value.
    ``swaps`` are the ``(name, original, replacement)`` entries of ``module._parameters`` for the call.
    """

    anchor: Tensor
    params: tuple[nn.Parameter, ...]
    swaps: tuple[tuple[str, Tensor | None, Tensor], ...]
    probe: bool = False  # the anchor is pergrad's zero, not the layer's bias
    on_output: bool = False  # the zero is added to the call's output (else it stands in as the bias)


@dataclass(eq=False, slots=True)
class Call:
    """One call of a hooked layer in this backward: its input and output gradient. Each sample's
    own output gradient is ``scale * d`` (``scale = B`` for a mean loss); the fused quantities put
    the scale on their (much smaller) results instead of on ``d``. For a rule that takes every
    output's gradient (``RuleSpec.output_dims``), ``d`` holds one per output tensor; such layers
    have no fused rule."""

    layer: HookedLayer
    a: Any
    d: Any  # a Tensor (every layer with a fused rule), or OutputGrads
    scale: float = 1.0
    built: dict[str, Tensor] | None = None  # the rule's result, where it ran during the backward
