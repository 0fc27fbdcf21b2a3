"""What the registered transforms cover: each target's parameters, and which need per-sample norms."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from pergrad.transforms import Scaling, Transform


@dataclass
class Target:
    """A transform and the parameters it sees, keyed as the transform sees them."""

    label: str  # for messages: 'module "0"', 'parameter "2.weight"', 'the whole model'
    params: dict[str, nn.Parameter]
    transform: Transform


class Targets:
    """The targets of the wrapper, in the order they were registered."""

    def __init__(self) -> None:
        self._targets: list[Target] = []
        self.transformed: set[nn.Parameter] = set()  # covered by some transform: pergrad writes their .grad
        self.needs_norms: set[nn.Parameter] = set()  # covered by a transform that scales by the norm
        # covered by a transform for which T(g + h) is not T(g) + T(h) (all but fixed per-sample weights)
        self.nonlinear: set[nn.Parameter] = set()

    def __iter__(self) -> Iterator[Target]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def clear(self) -> None:
        self._targets.clear()
        self.transformed.clear()
        self.needs_norms.clear()
        self.nonlinear.clear()

    def add(self, target: Target) -> None:
        self._targets.append(target)
        self.transformed.update(target.params.values())
        if isinstance(target.transform, Scaling) and target.transform.needs_norms:
            self.needs_norms.update(target.params.values())
        if not (isinstance(target.transform, Scaling) and not target.transform.needs_norms):
            self.nonlinear.update(target.params.values())

    def covering(self, param: nn.Parameter) -> Target | None:
        """The target whose transform covers ``param``, if any."""
        return next((t for t in self._targets if any(p is param for p in t.params.values())), None)
