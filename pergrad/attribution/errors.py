"""Errors raised by the feature store and the scores.

Each message names the store (its directory), what was seen and what to do about it. They derive from
:class:`pergrad.errors.PergradError`, so ``except PergradError`` catches them too.
"""

from __future__ import annotations

from ..errors import PergradError


class AttributionError(PergradError):
    """Base class of the errors of :mod:`pergrad.attribution`."""


class StoreSpecError(AttributionError, ValueError):
    """A store is opened with a spec (k, n, seed, checkpoints, ...) that differs from the one on disk, or
    with one that is incomplete or invalid."""


class StoreIndexError(AttributionError, IndexError):
    """Rows written or read by sample index are out of range, not owned by this rank, or the features
    written do not have the store's shape."""


class MissingFeaturesError(AttributionError, LookupError):
    """Rows are read (for scores, a preconditioner, ``read``) before they were written and flushed.

    ``missing``: the global sample indices asked for and not written (a list; empty where unknown)."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


class ScoreArgumentError(AttributionError, ValueError):
    """Scores asked with test features, weights or a preconditioner that do not fit the store."""
