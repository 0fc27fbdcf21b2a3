"""Bring layer inputs and output gradients to the layouts the rules compute on."""

from __future__ import annotations

import math

from torch import Tensor


def batch_to_front(t: Tensor, batch_first: bool) -> Tensor:
    """``t`` with its batch dimension on dim 0 (a view; dim 1 holds the batch when not batch_first)."""
    return t if batch_first else t.movedim(1, 0)


def rows(t: Tensor) -> Tensor:
    """``[B, *shared, F] -> [B, S, F]``: every dimension between batch and features becomes one
    shared axis S (sequence positions, pixels), so Linear-like rules have a single layout."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])
