"""After ``remove()``: the backward of a forward that ran a weight detached still owes it a gradient.

A forward run while pergrad was attached may have run a weight detached (``pergrad._core.shortcuts.detach``); if its
backward runs after ``remove()``, pergrad is gone, so the weight gets autograd's own gradient: the
sum of its per-sample gradients for the output gradients autograd delivered (no transform, no
rescaling), written at the end of that backward, where the backward accumulates into ``.grad`` (it
runs the weight's ``AccumulateGrad``, which ``detach.touch`` ties into the graph). The weight's
post-accumulate-grad hooks ran already, before this ``.grad`` was written: its ``AccumulateGrad``
runs with no gradient, and pergrad's pre-hook that held them back went with ``remove()``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pergrad._core.backward.sources import Fused, in_parameter_dtype, no_autocast, no_grad
from pergrad._core.backward.state import queue_at_end, will_accumulate
from pergrad._core.capture.calls import Call, Kept


class AfterRemoval:
    """Writes the detached weights' gradients of backward passes that run after ``remove()``."""

    def __init__(self) -> None:
        # by graph task: the calls with detached weights whose backward runs after remove()
        self._calls: dict[int, list[tuple[Call, tuple[nn.Parameter, ...]]]] = {}

    def on_output_grad(self, kept: Kept, d: Tensor) -> None:
        """The output gradient of a call that ran with its weight detached (``kept.detached``)."""
        detached = kept.detached
        assert detached is not None
        if not will_accumulate(get_gradient_edge(p).node for p in detached.params):  # no .grad to write
            return
        task = torch._C._current_graph_task_id()
        if task not in self._calls:
            self._calls[task] = []
            queue_at_end(lambda: self._write(task))
        kept, d = in_parameter_dtype(kept, d)  # (autocast) as autograd accumulates
        self._calls[task].append((Call(kept.layer, kept.a, d), detached.params))

    def _write(self, task: int) -> None:
        """Add autograd's gradient of every weight the backward's calls ran detached."""
        calls = self._calls.pop(task, [])
        if not calls:
            return
        params = list(dict.fromkeys(p for _, detached in calls for p in detached))
        with no_autocast(params[0].device.type), no_grad():
            ones = params[0].new_ones(calls[0][0].d.shape[0])
            totals = Fused([call for call, _ in calls]).summed(params, ones)
            for param, total in totals.items():
                param.grad = total.to(param.dtype) if param.grad is None else param.grad.add_(total)
