"""Bring layer inputs and output gradients to the layouts the rules compute on."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

Allocator = Callable[[tuple[int, ...], Tensor], Tensor]
_allocator: ContextVar[Allocator | None] = ContextVar("pergrad_allocator", default=None)


def new_buffer(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised tensor for a rule's result (``like``'s dtype and device).

    Rules write per-sample gradients into it with ``out=``. Inside ``allocating_from`` it may be
    a recycled buffer of an earlier step: writing into memory the process already holds is several
    times faster than into fresh pages, which the kernel must fault in and zero first.
    """
    alloc = _allocator.get()
    if alloc is not None:
        return alloc(shape, like)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


@contextmanager
def allocating_from(alloc: Allocator) -> Iterator[None]:
    token = _allocator.set(alloc)
    try:
        yield
    finally:
        _allocator.reset(token)


def batch_to_front(t: Tensor, batch_first: bool) -> Tensor:
    """``t`` with its batch dimension on dim 0 (a view; dim 1 holds the batch when not batch_first)."""
    return t if batch_first else t.movedim(1, 0)


def rows(t: Tensor) -> Tensor:
    """``[B, *shared, F] -> [B, S, F]``: every dimension between batch and features becomes one
    shared axis S (sequence positions, pixels), so Linear-like rules have a single layout."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])
