"""Writing ``.grad``: autograd's part, pergrad's part, and when ``.grad`` is final.

A parameter's ``.grad`` gets one of two things in a backward:

- autograd's own sum, arriving at its ``AccumulateGrad`` node, rescaled where ``reduction`` differs
  from ``loss_reduction`` or ``.grad`` holds a running mean (``autograd_part``);
- pergrad's reduction of the (transformed) per-sample gradients, at the end of the backward
  (``add``); autograd's sum is then held back (``hold``), and so are the parameter's
  post-accumulate-grad hooks until ``.grad`` is final (``defer_hooks`` ... ``run_hooks``).

With ``accumulate="samples"`` ``.grad`` is the mean over every sample since it was cleared:
``.grad := (n .grad + b R) / (n + b)`` for ``n`` samples in ``.grad`` and a batch of ``b`` with mean
``R``; ``samples_in_grad`` tells ``n``. A second backward through the same forward (``retain_graph=True``)
brings no new samples: their gradients grow by the new loss's, ``.grad := .grad + (b / n) R``
(``again``). A parallel back-end (``pergrad._core.parallel.world``) decides where a reduction goes and how samples
are counted over every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from pergrad._core.backward.state import Backward
from pergrad._core.options import Options
from pergrad._core.parallel.world import World


class GradWriter:
    """Writes ``.grad`` for one wrapper (see the module docstring)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.world: World | None = None
        # samples in .grad, id and version of .grad, the forward whose backward wrote it last
        self._seen: dict[nn.Parameter, tuple[float, int, int, int | None]] = {}
        self._deferred: dict[nn.Parameter, dict[Any, Any]] = {}  # post-accumulate-grad hooks held back

    # -- at AccumulateGrad -----------------------------------------------------------------------

    def accumulating(self, param: nn.Parameter, state: Backward) -> None:
        """``param``'s ``AccumulateGrad`` runs: note how many samples ``.grad`` holds before it."""
        if self.options.running_mean:
            self._note(param, state)

    def _note(self, param: nn.Parameter, state: Backward) -> None:
        """How many samples ``.grad`` holds before this backward adds to it, and whether they include
        this backward's own (an earlier backward of the same forward counted them)."""
        state.written.prior[param] = self.samples_in_grad(param)
        if self.holds(param, state.generation):
            state.written.again[param] = None

    def holds(self, param: nn.Parameter, generation: int | None) -> bool:
        """Whether ``param.grad`` holds what a backward of forward ``generation`` wrote (unchanged since)."""
        seen, grad = self._seen.get(param), param.grad
        if seen is None or grad is None or generation is None:
            return False
        return seen[1:] == (id(grad), grad._version, generation)

    def new_samples(self, param: nn.Parameter, state: Backward) -> float:
        """How many samples the running backward adds to ``param.grad``'s running mean: its batch, or none
        where an earlier backward of the same forward counted them."""
        noted = param in state.written.prior  # (then .grad may have changed already)
        again = param in state.written.again if noted else self.holds(param, state.generation)
        return 0.0 if again else float(state.batch_size or 0)

    def hold(self, param: nn.Parameter, grad: Tensor, state: Backward) -> Tensor | None:
        """What autograd adds to the ``.grad`` of a parameter pergrad writes at the end: nothing (a
        zero), or, where ``.grad`` is None, its own sum, replaced at the end."""
        if param.grad is None:
            state.autograd.overwrite[param] = None
            return None
        return torch.zeros_like(grad)

    def autograd_part(self, param: nn.Parameter, grad: Tensor, state: Backward) -> Tensor | None:
        """What autograd adds to ``param.grad`` for its own sum ``grad`` (None: ``grad`` unchanged)."""
        b = state.batch_size
        if self.world is not None and self.options.reduction == "sum" and b is not None:
            # DDP averages over ranks; scale so its average is the sum over every rank's samples
            return grad * self.world.size * (b if self.options.loss_reduction == "mean" else 1)
        if b is None or (self.options.reduction == self.options.loss_reduction and not self.options.running_mean):
            return None
        if self.options.reduction == "sum":
            return grad * b
        batch_mean = grad if self.options.loss_reduction == "mean" else grad / b
        if not self.options.running_mean or param.grad is None:
            return batch_mean
        # .grad := (n * .grad + b * batch_mean) / (n + b); autograd adds what is returned
        n = state.written.prior[param]
        if param in state.written.again:  # the same samples again: .grad := .grad + (b / n) batch_mean
            return batch_mean * (b / n)
        return (batch_mean - param.grad) * (b / (n + b)) if n + b else None

    # -- at the end of the backward --------------------------------------------------------------

    def add(self, param: nn.Parameter, reduced: Tensor, state: Backward) -> None:
        """Add this batch's reduction (in ``.grad``'s units) to ``.grad`` (with ``accumulate="samples"``,
        fold it into the running mean over every sample since ``.grad`` was cleared: ``_fold``; several
        processes: ``_across``)."""
        state.written.params[param] = None
        grad = param.grad
        overwrite = param in state.autograd.overwrite
        if self.options.running_mean and param not in state.written.prior:  # no AccumulateGrad ran (a detached weight)
            self._note(param, state)
        if self.world is not None:
            found = self._across(param, grad, overwrite, reduced, state)
            if found is None:
                return
            grad, reduced = found
        if grad is None or overwrite:
            param.grad = reduced.to(param.dtype)
        elif self.options.running_mean:
            self._fold(param, grad, reduced, state)
        else:
            grad.add_(reduced)

    def _across(
        self, param: nn.Parameter, grad: Tensor | None, overwrite: bool, reduced: Tensor, state: Backward
    ) -> tuple[Tensor | None, Tensor] | None:
        """Several processes: FSDP2 takes the reduction for its reduce-scatter; under DDP it goes where
        ``.grad`` would, but into the parameter's place in DDP's bucket (the bucket holds ``.grad`` as
        autograd left it), which is all-reduced once it is complete. Returns what ``add`` adds this rank's
        contribution to and the contribution, or None where it is delivered already."""
        assert self.world is not None
        reduced = self.world.contribution(reduced)
        if self.world.take(param, reduced, state):
            return None
        slot = self.world.slot(param, state)
        if slot is None:
            return grad, reduced
        if grad is None or overwrite:
            slot.copy_(reduced)
            return None
        return slot, reduced

    def _fold(self, param: nn.Parameter, grad: Tensor, reduced: Tensor, state: Backward) -> None:
        """``accumulate="samples"``: ``.grad := (n .grad + b R) / (n + b)``, or ``.grad + (b / n) R`` for the
        same samples again (see the module docstring)."""
        n, b = state.written.prior[param], state.batch_size or 0
        if param in state.written.again:
            grad.add_(reduced, alpha=b / n)
        else:
            grad.mul_(n / (n + b)).add_(reduced, alpha=b / (n + b))

    def abandon(self, state: Backward) -> None:
        """A backward failed (an error raised in it, or at its end): every ``.grad`` that was None before it
        is None again, so no ``.grad`` keeps autograd's own sum where pergrad was to replace it (a parameter
        a transform covers: ``hold``). A ``.grad`` that held something before keeps it: pergrad's part of a
        parameter it writes is added in full or not at all; autograd's part of another is added (in place,
        as plain autograd does: it cannot be taken back)."""
        if self.world is not None:  # the parallel back-end's buckets hold .grad: left to it
            return
        for param in (*state.autograd.fresh, *state.autograd.overwrite):
            param.grad = None

    def samples_in_grad(self, param: nn.Parameter) -> float:
        """How many samples the running mean in ``param.grad`` holds: 0 once ``.grad`` was set to
        None, replaced, or changed in place (``zero_grad(set_to_none=False)``) since pergrad wrote it."""
        seen, grad = self._seen.get(param), param.grad
        if seen is None or grad is None or seen[1:3] != (id(grad), grad._version):
            return 0
        return seen[0]

    def count_samples(self, state: Backward) -> None:
        """Once ``.grad`` is final (under DDP: after DDP wrote it), record which forward's backward wrote
        each ``.grad`` it reached and, with ``accumulate="samples"``, how many samples each averages."""
        if state.batch_size is None:
            return
        written, mean = state.written, self.options.running_mean
        for p in dict.fromkeys([*written.prior, *written.params, *state.autograd.ran]):
            if p.grad is not None:
                count = self._count(p, state) if mean and p in written.prior else 0.0
                self._seen[p] = (count, id(p.grad), p.grad._version, state.generation)

    def _count(self, param: nn.Parameter, state: Backward) -> float:
        """How many samples ``param.grad``'s running mean holds after this backward (under DDP: averaged
        over every rank's samples)."""
        assert state.batch_size is not None
        count = state.written.prior[param] + (0.0 if param in state.written.again else state.batch_size)
        return count if self.world is None else self.world.samples(param, count, state)

    # -- post-accumulate-grad hooks of the parameters whose .grad pergrad writes -----------------

    def defer_hooks(self, param: nn.Parameter) -> None:
        """Hold ``param``'s post-accumulate-grad hooks back while autograd's ``AccumulateGrad`` runs:
        ``.grad`` is not final until pergrad writes it at the end of the backward."""
        hooks = param._post_accumulate_grad_hooks
        if hooks:
            self._deferred.setdefault(param, {}).update(hooks)
            hooks.clear()

    def restore_hooks(self) -> set[nn.Parameter]:
        """Put held-back hooks back in place (also after a backward that failed midway)."""
        restored = set(self._deferred)
        for param, hooks in self._deferred.items():
            if param._post_accumulate_grad_hooks is not None:
                param._post_accumulate_grad_hooks.update(hooks)
        self._deferred.clear()
        return restored

    @staticmethod
    def run_hooks(state: Backward, deferred: set[nn.Parameter]) -> None:
        """Call the post-accumulate-grad hooks of every parameter whose ``.grad`` pergrad wrote, now
        that it is final, unless autograd called them already (its own ``.grad``)."""
        for param in state.written.params:
            hooks = param._post_accumulate_grad_hooks
            if hooks and (param in deferred or param not in state.autograd.ran):
                for hook in list(hooks.values()):
                    hook(param)
