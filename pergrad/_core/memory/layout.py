"""Bring layer inputs and output gradients to the layouts the rules compute on."""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token

import torch
from torch import Tensor

Allocator = Callable[[tuple[int, ...], Tensor], Tensor]
_allocator: ContextVar[Allocator | None] = ContextVar("pergrad_allocator", default=None)
_made: ContextVar[list[Tensor] | None] = ContextVar("pergrad_made", default=None)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` where transparent huge pages are given on request ("[madvise]")."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():
                return None  # "[always]" needs no advice, "[never]" refuses it
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def fresh_buffer(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """``torch.empty``; on CPU a large one is advised to use 2 MiB pages before it is touched, so
    the kernel faults it in 512 times less often (advice only: a refusal changes nothing)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    madvise = _madvise() if out.device.type == "cpu" and out.nbytes >= 2 * _HUGE_PAGE else None
    if madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # the whole huge pages inside it
        end = (out.data_ptr() + out.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)
    return out


def recorded() -> bool:
    """Whether autograd records what the rules compute: in a backward with ``create_graph=True``
    (second order), where per-sample gradients must be differentiable, so no ``out=`` buffers and
    nothing scaled in place."""
    return torch.is_grad_enabled()


def new_buffer(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised tensor (``like``'s dtype and device) a rule writes its result into with ``out=``;
    inside ``allocating_from`` a recycled buffer of an earlier step: writing into memory the process already
    holds is several times faster than into fresh pages, which the kernel must fault in and zero first."""
    alloc = _allocator.get()
    out = fresh_buffer(shape, like) if alloc is None else alloc(shape, like)
    made = _made.get()
    if made is not None:
        made.append(out)
    return out


def owned(t: Tensor) -> Tensor:
    """Mark ``t``, a fresh result of a rule that nothing else refers to (not ``a``, ``d`` or a view
    of them), as the rule's own memory, like a ``new_buffer``: the caller may then scale it in place
    (``sources.run_rule``) instead of copying it."""
    made = _made.get()
    if made is not None:
        made.append(t)
    return t


class allocating_from:
    """``new_buffer`` takes its buffers from ``alloc`` inside the block (a class, not a generator:
    it is entered at every backward)."""

    def __init__(self, alloc: Allocator) -> None:
        self._alloc = alloc
        self._token: Token[Allocator | None] | None = None

    def __enter__(self) -> None:
        self._token = _allocator.set(self._alloc)

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _allocator.reset(self._token)


READ_FREELY = frozenset({"cpu"})  # devices whose tensors the host reads without waiting for queued work


def may_hold_true(mask: Tensor) -> bool:
    """Whether the boolean ``mask`` may hold a True, for a branch that saves a copy when it does not: read
    on the CPU (nothing to wait for); yes on an accelerator, where reading it would wait for every queued
    kernel (a host sync), and the caller takes the path that is exact whatever the mask holds."""
    return mask.device.type not in READ_FREELY or bool(mask.any())


@contextmanager
def recording_buffers() -> Iterator[list[Tensor]]:
    """The buffers ``new_buffer`` hands out inside the block, in a list: memory no one else holds."""
    made: list[Tensor] = []
    token = _made.set(made)
    try:
        yield made
    finally:
        _made.reset(token)


def batch_to_front(t: Tensor, batch_first: bool) -> Tensor:
    """``t`` with its batch dimension on dim 0 (a view; dim 1 holds the batch when not batch_first)."""
    return t if batch_first else t.movedim(1, 0)


def rows(t: Tensor) -> Tensor:
    """``[B, *shared, F] -> [B, S, F]``: every dimension between batch and features becomes one
    shared axis S (sequence positions, pixels), so Linear-like rules have a single layout."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])
