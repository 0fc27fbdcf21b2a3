"""Projected per-sample gradients ``P vec(g_i)`` ``[B, k]`` of each projection target
(``psm.register_projection``, read by ``psm.per_sample_projections()``); the projections are in
``pergrad.projectors``, their Kronecker forms in each layer family's rules file.

Features are those of the samples' raw gradients ``g_i`` of their own losses ``f_i`` (before any
transform, unscaled under loss scaling), with ``loss_reduction`` "mean" as with "sum"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ..calls import Kept
from ..projectors import Projector, Spec
from . import Batch


@dataclass
class Projected:
    """One projection target: its name and each trainable parameter's block."""

    name: str  # qualified name of the target ("" for the whole model)
    spec: Spec
    params: dict[nn.Parameter, Projector]


class Projection:
    """Computes ``sum_p P_p vec(g_i(p))`` of every target (a parameter the backward did not reach
    has ``g_i = 0``: it adds nothing)."""

    def __init__(self, canonical: Callable[[nn.Parameter], nn.Parameter]) -> None:
        self.canonical = canonical
        self.targets: list[Projected] = []
        self.last: dict[str, Tensor] = {}  # the last backward's, by target name

    def reads(self, kept: Kept) -> bool:
        return any(self.canonical(p) in t.params for t in self.targets for _, p in kept.layer.trainable())

    def consume(self, batch: Batch) -> None:
        if not self.targets:
            return
        self.last = {}
        for target in self.targets:
            reached = {p: proj for p, proj in target.params.items() if p in batch.params}
            found = batch.source.project(reached) if reached and batch.size else {}
            first = next(iter(target.params))
            total = first.new_zeros((batch.size, target.spec.dim))  # summed in the parameters' dtype, then cast
            for features in found.values():
                total = total + features
            self.last[target.name] = total if target.spec.dtype is None else total.to(target.spec.dtype)
