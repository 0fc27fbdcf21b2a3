"""``p.grad_sample``: the built per-sample gradients ``[B, *p.shape]`` of the last forward's backward."""

from __future__ import annotations

from torch import Tensor, nn

from ..calls import Kept
from . import Batch


class GradSample:
    """Stores ``grad_sample`` on the parameters (``keep_grad_sample=True``). A backward of a new forward
    replaces every one; a second backward of the same forward (``retain_graph=True``) adds, like
    autograd does."""

    def __init__(self) -> None:
        self._generation: dict[nn.Parameter, int] = {}  # the forward each grad_sample belongs to
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
            same_forward = self._generation.get(param) == generation
            if previous is not None and same_forward and previous.shape == g.shape:
                g = previous + g
            param.grad_sample = g  # type: ignore[attr-defined]
            if generation is not None:
                self._generation[param] = generation

    def held(self, generation: int) -> list[nn.Parameter]:
        """The parameters whose ``grad_sample`` (not cleared) belongs to another forward than ``generation``."""
        return [
            p
            for p, gen in self._generation.items()
            if gen != generation and getattr(p, "grad_sample", None) is not None
        ]

    def drop_stale(self, generation: int) -> None:
        """A backward of forward ``generation`` starts: drop the ``grad_sample`` of other forwards now,
        so the rules can write into their memory instead of allocating as much again."""
        for param, gen in list(self._generation.items()):
            if gen != generation:
                self.drop(param)

    def drop(self, param: nn.Parameter) -> None:
        """Drop ``param.grad_sample`` (the pool takes its memory back once no one else refers to it)."""
        self._generation.pop(param, None)
        self.last.pop(param, None)
        param.__dict__.pop("grad_sample", None)
