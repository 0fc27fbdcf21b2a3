"""``p.grad_sample``: the built per-sample gradients ``[B, *p.shape]`` of the last forward's backward; and
the same held, whatever ``keep_grad_sample``, for the backward passes a ``Holder`` is armed for."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import Tensor, nn

from pergrad._core.backward.sources import Materialized
from pergrad._core.backward.targets import Target, Targets
from pergrad._core.capture.calls import Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad._core.memory.layout import allocating_from, fresh_buffer


class GradSample(Consumer):
    """Stores ``grad_sample`` on the parameters (``keep_grad_sample=True``). A backward of a new forward
    replaces every one; a second backward of the same forward (``retain_graph=True``) adds, like
    autograd does."""

    def __init__(self) -> None:
        self.generations: dict[nn.Parameter, int] = {}  # the forward each grad_sample kept belongs to
        # the last backward's own g_i (per_sample_norms() and statistics() read them): grad_sample itself
        # unless that backward added to an earlier one's
        self.last: dict[nn.Parameter, Tensor] = {}

    def reads(self, kept: Kept) -> bool:
        return False  # built as the output gradients arrive, not from kept (a, d)

    def consume(self, batch: Batch) -> None:
        grads = batch.state.arrived.grads
        generation = batch.state.generation
        self.last = {}
        for param in batch.params:
            g = self.last[param] = grads[param]
            previous: Tensor | None = getattr(param, "grad_sample", None)
            same_forward = self.generations.get(param) == generation
            if previous is not None and same_forward and previous.shape == g.shape:
                g = previous + g
            param.grad_sample = g  # type: ignore[attr-defined]
            if generation is not None:
                self.generations[param] = generation

    def held(self, generation: int) -> list[nn.Parameter]:
        """The parameters whose ``grad_sample`` (not cleared) belongs to another forward than ``generation``."""
        return [
            p
            for p, gen in self.generations.items()
            if gen != generation and getattr(p, "grad_sample", None) is not None
        ]

    def drop_stale(self, generation: int) -> None:
        """A backward of forward ``generation`` starts: drop the ``grad_sample`` of other forwards now,
        so the rules can write into their memory instead of allocating as much again."""
        for param, gen in list(self.generations.items()):
            if gen != generation:
                self.drop(param)

    def drop(self, param: nn.Parameter) -> None:
        """Drop ``param.grad_sample`` (the pool takes its memory back once no one else refers to it)."""
        self.generations.pop(param, None)
        self.last.pop(param, None)
        param.__dict__.pop("grad_sample", None)


@dataclass
class Held:
    """One backward pass's per-sample gradients, as a ``Holder`` receives them."""

    grads: dict[nn.Parameter, Tensor]  # g_i [B, *p.shape] of every parameter the backward reached
    batch_size: int
    # what the loss was multiplied by (``loss_scale=``, a GradScaler's scale): pergrad wrote that times its
    # reduction into .grad; None: 1
    loss_scale: Tensor | None
    targets: list[Target]  # the transforms the backward applied, as registered


class Holder:
    """A switch that holds per-sample gradients for its owner (an audit: ``pergrad.privacy.audit``): every
    backward pass that ends while ``armed`` is True hands it a ``Held`` record, whatever the wrapper's
    ``keep_grad_sample``. Arm it before the backward (its forward may run before or after). The wrapper
    refers to it weakly: one its owner let go of holds nothing."""

    def __init__(self, holders: weakref.WeakSet[Holder]) -> None:
        self.armed = False
        self.held: list[Held] = []
        self._holders = holders
        holders.add(self)

    def take(self) -> list[Held]:
        """The records held since the last ``take``, forgotten here."""
        held, self.held = self.held, []
        return held

    def close(self) -> None:
        """Hold nothing more, ever."""
        self.armed, self.held = False, []
        self._holders.discard(self)


class Holding(Consumer):
    """Hands each backward's built per-sample gradients to the armed ``Holder``\\ s. It runs after every
    other consumer, so a backward computes ``.grad`` as it would unarmed; while one is armed, the calls'
    ``(a, d)`` are kept until the end of the backward."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets
        self.holders: weakref.WeakSet[Holder] = weakref.WeakSet()

    def reads(self, kept: Kept) -> bool:
        return any(holder.armed for holder in self.holders)

    def consume(self, batch: Batch) -> None:
        armed = [holder for holder in self.holders if holder.armed]
        if not armed:
            return
        source = batch.source
        known = source.grads if isinstance(source, Materialized) else source.uses
        with allocating_from(fresh_buffer):  # not the pool's memory: the pool's bound stays that of unarmed steps
            grads = source.per_sample([p for p in batch.params if p in known]) if batch.size else {}
        held = Held({p: g.detach() for p, g in grads.items()}, batch.size, batch.state.loss_scale, list(self.targets))
        for holder in armed:
            holder.held.append(held)
