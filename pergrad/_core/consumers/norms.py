"""Per-sample gradient norms ``||g_i||^2``, per parameter, without building ``g_i`` where a fused rule
gives them (``psm.per_sample_norms()``; the norms a clipping or normalising transform scales by)."""

from __future__ import annotations

from torch import Tensor, nn

from pergrad._core.backward.targets import Targets
from pergrad._core.capture.calls import Kept
from pergrad._core.consumers import Batch, Consumer


class Norms(Consumer):
    """Computes every reached parameter's norms (``track_norms=True``), else those a transform needs."""

    def __init__(self, track: bool, targets: Targets) -> None:
        self.track, self.targets = track, targets
        self.last: dict[nn.Parameter, Tensor] = {}  # the last backward's, by parameter

    def reads(self, kept: Kept) -> bool:
        return self.track  # (the transforms' norms: ``Reduction.reads``)

    def consume(self, batch: Batch) -> None:
        if batch.size == 0:
            self.last = {p: p.new_zeros(0) for p in batch.params}
            return
        needs = self.targets.needs_norms
        wanted = list(batch.params) if self.track else [p for p in batch.params if p in needs] if needs else []
        self.last = batch.norms(wanted)
