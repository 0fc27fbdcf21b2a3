"""What a ``PerSampleModule`` is made with: one frozen record, checked once, read by every part of the core
(the engine, the detaching shortcut, the parallel back-ends) as ``engine.options``."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class Options:
    """The wrapper's options (``PerSampleModule``'s arguments of the same names, which document them);
    ``track_statistics`` holds the names of the statistics computed (none: empty)."""

    loss_reduction: str = "mean"
    reduction: str = "mean"
    batch_first: bool = True
    keep_grad_sample: bool = True
    track_norms: bool = False
    track_statistics: frozenset[str] = field(default_factory=frozenset)
    accumulate: str = "backward"
    keep_activation_grads: bool = False
    verify: bool = True
    fallback: bool = False
    detach_transformed: bool = True
    lean_forwards: bool = False

    def __post_init__(self) -> None:
        for arg, value in (("loss_reduction", self.loss_reduction), ("reduction", self.reduction)):
            if value not in REDUCTIONS:
                raise ValueError(f"{arg} must be 'mean' or 'sum', got {value!r}")
        if self.accumulate not in ("backward", "samples"):
            raise ValueError(f"accumulate must be 'backward' or 'samples', got {self.accumulate!r}")

    # (cached: read per layer call; a frozen record's answers never change)
    @cached_property
    def norms(self) -> bool:
        """Whether every backward computes every parameter's per-sample norms (the statistics need them)."""
        return self.track_norms or bool(self.track_statistics)

    @cached_property
    def running_mean(self) -> bool:
        """``accumulate="samples"`` with a mean: ``.grad`` is the mean over every sample since it was cleared."""
        return self.accumulate == "samples" and self.reduction == "mean"
