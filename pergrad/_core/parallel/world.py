"""Where a parallel back-end plugs into one backward (``pergrad._core.parallel.distributed`` implements them).

The engine asks a ``World`` at named points of a backward's life: which parameter a gradient is
keyed by (``canonical``), what this rank contributes of a reduction (``contribution``), where a
reduced gradient goes (``take``: the world delivers it; ``slot``: a place instead of ``.grad``),
how many samples a running mean holds over every rank (``samples``), and, once pergrad's part is
written, to communicate it (``flush``). The defaults are those of one process.

A world reads the wrapper through ``Host``: the few things a back-end needs to know of it.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from pergrad._core.backward.state import Backward
from pergrad._core.options import Options


class Host(Protocol):
    """What a world reads of the wrapper that runs it (``pergrad._core.backward.engine.Engine`` is one)."""

    closed: bool  # the wrapper was removed
    options: Options  # ``reduction``: "mean" or "sum" over the samples; ``running_mean``: .grad is a running mean
    param_names: dict[nn.Parameter, str]  # every trainable parameter of the wrapped model, in order

    @property
    def transformed(self) -> set[nn.Parameter]:
        """The parameters a transform covers (pergrad writes their ``.grad``)."""
        ...

    def backward_state(self) -> Backward:
        """The state of the running backward pass."""
        ...

    def may_write(self, param: nn.Parameter) -> bool:
        """Whether pergrad may write ``param.grad`` itself in some backward pass (the same on every rank)."""
        ...

    def samples_in_grad(self, param: nn.Parameter) -> float:
        """How many samples the running mean in ``param.grad`` holds."""
        ...

    def new_samples(self, param: nn.Parameter, state: Backward) -> float:
        """How many samples the running backward adds to the running mean in ``param.grad`` (none for a
        second backward through the same forward)."""
        ...

    def on_accumulate(self, param: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        """What autograd adds to ``param.grad`` in place of ``grad`` (None: ``grad`` itself)."""
        ...


class World:
    """What the engine asks of a multi-process setting; the defaults are those of one process."""

    size = 1
    finish_early = False  # compute pergrad's part before the callbacks queued during the backward
    detaches = False  # weights may run detached (see detach.py)
    touches = False  # a detached weight's AccumulateGrad must still run (with a zero)

    def canonical(self, param: nn.Parameter) -> nn.Parameter:
        """The parameter the engine keys ``param``'s gradients by."""
        return param

    def contribution(self, reduced: Tensor) -> Tensor:
        """What this rank contributes of pergrad's reduction ``reduced`` of its own samples."""
        return reduced

    def take(self, param: nn.Parameter, reduced: Tensor, state: Backward) -> bool:
        """Whether the world delivers ``reduced`` into ``param.grad`` itself (at ``flush``)."""
        return False

    def slot(self, param: nn.Parameter, state: Backward) -> Tensor | None:
        """Where ``param``'s gradient is to be written instead of ``.grad`` (a DDP bucket), or None."""
        return None

    def flush(self, state: Backward, failed: bool) -> None:
        """pergrad's part of this backward is written: communicate it."""

    def samples(self, param: nn.Parameter, local: float, state: Backward) -> float:
        """``accumulate="samples"``: how many samples ``param.grad`` holds, ``local`` of them this rank's."""
        return local

    def install(self) -> None:
        """Start; the wrapper is complete."""

    def close(self) -> None:
        """The wrapper is removed."""
