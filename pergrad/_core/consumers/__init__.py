"""Consumers of ``(a, d)``: what the end of a backward computes from the per-sample gradients.

Each consumer is one module with one class, and reads one finished backward through ``Batch``:
its per-sample gradients as a ``source`` (built ``g_i``, or each layer call's kept ``(a, d)`` and
its fused rule: ``pergrad._core.backward.sources``), the parameters it reached, its batch size, and a way to write
``.grad``. The engine calls them in order, so a later one reads what an earlier one left in the
batch (the per-sample norms statistics computed, which clipping reuses):

- ``grad_sample.GradSample``: ``p.grad_sample`` (``keep_grad_sample=True``);
- ``statistics.TrackStatistics``: ``psm.statistics()`` (``track_statistics=...``);
- ``norms.Norms``: ``psm.per_sample_norms()`` and the norms a clipping transform needs;
- those a feature adds (``Engine.add``: ``pergrad.attribution``'s projections and their factors), in the order added;
- ``reduction.Reduction``: each target's ``(1/B) sum_i T(g_i)`` into ``.grad``.
- ``grad_sample.Holding``: the built ``g_i`` handed to an armed ``Holder`` (an audit: ``pergrad.privacy.audit``), last.

Adding a consumer is a class deriving from ``Consumer`` (``reads`` and ``consume``; the other members
have defaults that ask for nothing more), and an instance handed to ``Engine.add`` when a user asks for
what it computes, so a step that did not ask runs none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import Tensor, nn

from pergrad._core.backward.sources import Fused, Materialized
from pergrad._core.backward.state import Backward
from pergrad._core.capture.calls import Call, Kept


@dataclass
class Batch:
    """One finished backward, as the consumers read it."""

    state: Backward
    source: Materialized | Fused
    params: dict[nn.Parameter, None]  # the parameters the backward reached, in order (an ordered set)
    names: dict[nn.Parameter, str]  # every trainable parameter's name in the wrapped model
    write: Callable[[nn.Parameter, Tensor], None]  # add a reduction (in .grad's units) to .grad
    owned: list[nn.Parameter]  # ran detached with no transform: .grad is the plain reduction
    unwritten: set[nn.Parameter] = field(default_factory=set)  # ran detached, .grad not needed: left as it is
    sq_norms: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # ||g_i||^2 [B] computed so far
    means: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # (1/B) sum_i g_i computed so far

    @property
    def size(self) -> int:
        assert self.state.batch_size is not None
        return self.state.batch_size

    def norms(self, params: Iterable[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
        """``||g_i||^2`` per sample of each of ``params``, computed once per backward (all that are
        missing in one call of the source: a layer's fused rule answers every parameter of it)."""
        params = list(params)
        missing = [p for p in params if p not in self.sq_norms]
        if missing:
            self.sq_norms.update(self.source.sq_norms(missing))
        return {p: self.sq_norms[p] for p in params}


class Consumer:
    """One consumer of ``(a, d)`` (see the package docstring). The defaults ask for nothing beyond
    ``reads`` and ``consume``."""

    # whether ``take`` may consume a call during the backward (the engine asks only such consumers)
    takes_now: bool = False

    def reads(self, kept: Kept) -> bool:
        """Whether ``consume`` reads this call's ``(a, d)`` (else they are let go as they arrive)."""
        raise NotImplementedError

    def consume(self, batch: Batch) -> None:
        """Compute from the finished backward ``batch`` (``batch.size`` may be 0: Poisson sampling)."""
        raise NotImplementedError

    def take(self, call: Call, size: int, state: Backward) -> bool:
        """Consume ``call`` (``size`` samples) now, as its output gradient arrives, so that its ``(a, d)``
        are let go at once; True if it did (what it computed goes in ``state.arrived.taken[self]``, read
        by ``consume``). Asked only of a consumer with ``takes_now``, where it alone reads the call and the
        end of the backward needs nothing of it (no check, ``create_graph``, empty batch or FSDP2 anchor;
        the backward accumulates into every parameter of the call)."""
        return False

    def keeps_inputs(self, kept: Kept) -> bool:
        """Whether this call's ``(a, d)`` are kept to the end of the backward even where its ``g_i`` are
        built as it arrives (``keep_grad_sample=True``)."""
        return False

    def covers(self, param: nn.Parameter) -> bool:
        """Whether it computes something per sample from ``param``'s gradient (beyond ``grad_sample``,
        norms, statistics and transforms, which the engine knows)."""
        return False

    @property
    def gradless(self) -> frozenset[nn.Parameter]:
        """The parameters whose ``.grad`` it says is not needed: where their weight runs detached
        (``pergrad._core.shortcuts.detach``), pergrad leaves their ``.grad`` as it is."""
        return frozenset()
