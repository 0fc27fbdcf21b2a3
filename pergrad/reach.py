"""What reaches a parameter whose ``.grad`` pergrad writes, besides its layers' own outputs.

pergrad writes the ``.grad`` of a parameter a transform covers from its per-sample gradients, so
autograd's sum arriving at its ``AccumulateGrad`` node is not used. That sum must hold nothing but
what the parameter's layers sent it: a term of the loss that uses the parameter directly (a
regulariser switched on at some step) would be dropped. The first backward's check compares values;
the later ones compare by identity, with no host sync:

- for each forward, every hooked layer call reads the parameter through one *tap*, an alias of it
  (``aten.alias``, whose backward passes its gradient on as the very same tensor), swapped into the
  layer's ``_parameters`` for the call and shared by every call and every layer holding it (a layer
  called twice, tied weights): whatever the layers send the parameter meets in the tap's node;
- a hook on the tap keeps the gradient it passes on; the ``AccumulateGrad`` pre-hook then gets that
  very tensor, unless something else reached the parameter too (autograd then sums into another
  tensor: the kept one is referenced, so it is never summed into in place). Only then are the values
  compared (a host sync): a term that is exactly zero (``loss + 0 * p.sum()``) is let through.

Not tapped (left as before): parameters that run detached (their ``AccumulateGrad`` runs only when
something else reaches them, see ``Engine.on_accumulate``), layers whose rule covers a subtree or
parametrized tensors, layers that do not read their parameters from ``_parameters`` at call time
(``nn.RNN``'s flat weights: the tap never fires, so nothing is compared), parameters with tensor
hooks (``p.register_hook`` may return another tensor), FSDP2, ``verify=False``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class Taps:
    """The tap of each parameter that is checked, one per forward of the model."""

    def __init__(self, wanted: Callable[[nn.Parameter], bool], on_grad: Callable[[nn.Parameter, Tensor], None]) -> None:
        self._wanted, self._on_grad = wanted, on_grad
        self._generation = -1
        self._taps: dict[nn.Parameter, Tensor] = {}

    def tap(self, p: Tensor | None, generation: int) -> Tensor | None:
        """The tap the layers of forward ``generation`` read ``p`` through, or None where ``p`` is
        not checked (not a parameter pergrad writes, or detached for the call)."""
        if generation != self._generation:
            self._generation, self._taps = generation, {}
        if not (isinstance(p, nn.Parameter) and p.requires_grad and self._wanted(p)):
            return None
        found = self._taps.get(p)
        if found is None:
            found = self._taps[p] = torch.ops.aten.alias(p)
            on_grad = self._on_grad
            found.register_hook(lambda grad: on_grad(p, grad))
        return found

    def clear(self) -> None:
        self._generation, self._taps = -1, {}
