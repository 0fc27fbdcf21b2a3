"""Statistics of the per-sample gradients (``track_statistics=...``): the formulas and what each
costs are in ``pergrad.statistics``; this consumer computes the tracked ones in the backward."""

from __future__ import annotations

from pergrad._core.capture.calls import Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad.statistics import Statistics, compute_statistics


class TrackStatistics(Consumer):
    """Computes the ``tracked`` statistics over every parameter the backward reached."""

    def __init__(self, tracked: frozenset[str], loss_reduction: str) -> None:
        self.tracked, self.loss_reduction = tracked, loss_reduction
        self.last: Statistics | None = None

    def reads(self, kept: Kept) -> bool:
        return bool(self.tracked)

    def consume(self, batch: Batch) -> None:
        if not self.tracked or batch.size == 0 or not batch.params:
            self.last = None
            return
        # autograd's batch gradient is sum_i g_i / B ("mean") or sum_i g_i ("sum")
        scale = 1.0 if self.loss_reduction == "mean" else 1.0 / batch.size
        autograd = batch.state.autograd.batch_grads
        # a copy: .grad may alias the batch gradient; detached weights have none (computed then)
        means = {p: autograd[p] * scale for p in batch.params if p in autograd}
        names = {p: batch.names[p] for p in batch.params}
        self.last, sq_norms = compute_statistics(batch.source, names, batch.size, means, self.tracked)
        batch.sq_norms.update(sq_norms)
        batch.means.update({p: self.last.params[names[p]].mean for p in batch.params})
