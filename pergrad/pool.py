"""Memory for the per-sample tensors pergrad builds, reused from one backward pass to the next.

Why: on CPU, writing per-sample gradients into fresh memory costs more than computing them (the
kernel faults the pages in and zeroes them first: a bmm into a fresh 8 MiB buffer took 8 ms, into
one the process already held 1.2 ms). So the tensors the rules write with ``out=`` (``grad_sample``,
the per-sample tensors a fused backward builds and drops) come from a ``BufferPool``.

How: a *block* is a flat tensor of one dtype on one device. A request for ``shape`` (``take``) is a
view of the first ``prod(shape)`` elements of a free block, so one block serves any shape that
fits: every batch size of Poisson sampling, every padded sequence length. Which free block:

1. the one that served the same request of the previous backward pass (the k-th request of a pass,
   counted from ``begin``: a backward asks in the same order every step) if it is large enough;
   if it is too small (a larger batch than ever before), it is released and a block of the new
   size is allocated, so each request's block follows the largest shape it has seen;
2. otherwise the smallest free block of the dtype and device holding ``n`` to ``2 n`` elements;
3. otherwise a fresh block of exactly ``n`` elements (``layout.fresh_buffer``).

The pool holds every block it handed out, and takes it back once nothing else refers to it (no
view, no ``grad_sample``): at the start of a backward pass (after the engine dropped the previous
``grad_sample``) and at its end (``settle``, the per-sample tensors a fused backward dropped). A
block still in use at the end of a later pass belongs to whoever holds it: the pool forgets it.

The bound: after every backward pass, the bytes of the pool's blocks -- free ones plus those
handed out in that pass and still in use (``grad_sample``) -- are at most ``limit``: the most
bytes of blocks one backward pass has had in use so far (``max_bytes`` if that is smaller;
``max_bytes=0`` turns reuse off). Free blocks beyond it are released, least recently used first.
So whatever sequence of shapes arrives, pergrad keeps about one step's worth of memory between
steps: that of its largest step. A pass's blocks hold at most twice what it asked for, except a
request's own block from step 1, which is at most the largest that request ever asked for.
Within a backward pass, fresh blocks for shapes larger than before come on top until its end.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import fresh_buffer

SLACK = 2  # a block not reserved for a request serves it if it holds at most SLACK times its size


@dataclass(eq=False)
class _Block:
    data: Tensor  # flat
    slot: int  # the request of its last backward pass it served (its index in that pass)
    round: int  # that pass
    used: int  # when it was last handed out (least recently used blocks are released first)


def _in_use(block: _Block) -> bool:
    """Whether anything but the pool refers to ``block``'s memory (a view of it, its tensor)."""
    data = block.data
    # references: the block's attribute and getrefcount's argument; storage: `data` and the
    # temporary storage object
    return sys.getrefcount(data) > 3 or torch._C._storage_Use_Count(data.untyped_storage()._cdata) > 2


class BufferPool:
    """Blocks of memory reused across backward passes, within ``limit`` bytes (see the module)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._free: list[_Block] = []
        self._out: list[_Block] = []  # handed out, not yet taken back
        self._round = 0  # backward passes settled
        self._slot = 0  # requests in this pass
        self._round_bytes = 0  # bytes of the blocks handed out in this pass
        self._peak = 0  # the most bytes of blocks one pass has had in use
        self._clock = 0

    @property
    def limit(self) -> int:
        """The bytes the pool may hold after a backward pass (see the module docstring)."""
        return self._peak if self.max_bytes is None else min(self._peak, self.max_bytes)

    @property
    def free_bytes(self) -> int:
        return sum(b.data.nbytes for b in self._free)

    @property
    def held_bytes(self) -> int:
        """Bytes of every block the pool holds: free ones and those it handed out and has not
        taken back or forgotten yet (``grad_sample`` among them)."""
        return self.free_bytes + sum(b.data.nbytes for b in self._out)

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device (``layout.Allocator``)."""
        n = math.prod(shape)
        if n == 0:
            return fresh_buffer(shape, like)
        slot, self._slot = self._slot, self._slot + 1
        block = self._pick(n, like.dtype, like.device, slot)
        if block is None:
            block = _Block(fresh_buffer((n,), like), slot, self._round, 0)
        else:
            self._free.remove(block)
        self._clock += 1
        block.slot, block.round, block.used = slot, self._round, self._clock
        self._out.append(block)
        self._round_bytes += block.data.nbytes
        return block.data[:n].view(shape)

    def _pick(self, n: int, dtype: torch.dtype, device: torch.device, slot: int) -> _Block | None:
        own: _Block | None = None  # the smallest block of this request that fits
        too_small: _Block | None = None
        other: _Block | None = None  # the smallest block within SLACK
        for block in self._free:
            data = block.data
            if data.dtype != dtype or data.device != device:
                continue
            size = data.numel()
            if block.slot == slot:
                if size < n:
                    too_small = block
                elif own is None or size < own.data.numel():
                    own = block
            if n <= size <= SLACK * n and (other is None or size < other.data.numel()):
                other = block
        if own is not None:
            return own
        if too_small is not None:  # outgrown: its memory goes before a larger block is allocated
            self._free.remove(too_small)
        return other

    def begin(self) -> None:
        """A backward pass starts (the previous ``grad_sample`` are dropped): take back what is free."""
        self._slot = self._round_bytes = 0
        self._reclaim()
        self._trim()

    def settle(self) -> None:
        """A backward pass ended: take back what it no longer uses, release blocks beyond ``limit``."""
        self._peak = max(self._peak, self._round_bytes)
        self._reclaim()
        self._out = [b for b in self._out if b.round == self._round]  # the rest is its holders' now
        self._trim()
        self._round += 1
        self._slot = self._round_bytes = 0

    def _reclaim(self) -> None:
        """Move the blocks nothing else refers to from ``_out`` to ``_free``."""
        out, self._out = self._out, []
        for block in out:
            (self._out if _in_use(block) else self._free).append(block)

    def _trim(self) -> None:
        """Release free blocks, least recently used first, until the free ones and those in use
        since this pass began take at most ``limit`` bytes."""
        in_use = sum(b.data.nbytes for b in self._out if b.round == self._round)
        excess = self.free_bytes + in_use - self.limit
        if excess > 0:
            self._free.sort(key=lambda b: b.used)
            while excess > 0 and self._free:
                excess -= self._free.pop(0).data.nbytes

    def clear(self) -> None:
        self._free.clear()
        self._out.clear()
