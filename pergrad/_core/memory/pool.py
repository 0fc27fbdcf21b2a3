"""Memory for the per-sample tensors pergrad builds, reused from one backward pass to the next.

Why: on CPU, writing per-sample gradients into fresh memory costs more than computing them (the
kernel faults the pages in and zeroes them first: a bmm into a fresh 8 MiB buffer took 8 ms, into
one the process already held 1.2 ms). So the tensors the rules write with ``out=`` (``grad_sample``,
the per-sample tensors a fused backward builds and drops) come from a ``BufferPool``.

How: a *block* is a flat tensor of one dtype on one device; a request for ``shape`` gets a view of
the first ``prod(shape)`` elements of one, so a block serves every shape that fits (every batch
size of Poisson sampling, every padded length). A backward pass asks in the same order every step,
so the k-th request of a pass is served by

1. the block that served the k-th request of the previous pass, if it is large enough; one that is
   too small (a larger batch than ever) is released before a larger one is allocated;
2. otherwise the smallest free block of ``n`` to ``SLACK * n`` elements that no later request of
   the pass had the previous time;
3. otherwise a fresh block of ``n`` elements (``layout.fresh_buffer``).

A block is taken back once nothing else refers to its memory (no ``grad_sample``, no view of it),
checked when a backward pass begins (after the engine dropped the previous ``grad_sample``) and
when it ends (for the tensors the pass built and dropped). A block still referred to when the pass
after the one it served ends is its holder's: the pool forgets it.

The one bound, ``limit``: the most bytes one backward pass has asked for, i.e. its largest step.
When a pass begins and when it ends, free blocks are released, least recently used first, until
the free blocks and those serving the running pass hold at most ``limit`` bytes. So whatever
sequence of shapes arrives, what the pool keeps between steps is at most one step's worth: that of
the largest step so far. (Only when a pass's own tensors sit in blocks sized for larger earlier
requests can they take more than ``limit``; then no free block is kept.)
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from pergrad._core.memory.layout import fresh_buffer

SLACK = 2  # a block serves a request it did not serve the previous time if at most SLACK times larger


@dataclass(eq=False)
class _Block:
    data: Tensor  # flat
    round: int  # the pass it served last
    slot: int  # the request of that pass it served (the k-th); (round, slot) orders blocks by last use
    free: bool = False


def _in_use(block: _Block) -> bool:
    """Whether anything but the pool refers to ``block``'s memory (its tensor, a view of it)."""
    data = block.data
    # Python references: the block's attribute, `data`, getrefcount's argument; storage references:
    # `data` and the temporary storage object
    return sys.getrefcount(data) > 3 or torch._C._storage_Use_Count(data.untyped_storage()._cdata) > 2


class BufferPool:
    """Blocks of memory reused across backward passes, within ``limit`` bytes (see the module)."""

    def __init__(self) -> None:
        self._blocks: dict[_Block, None] = {}  # every block the pool holds, free or handed out
        self._slots: dict[int, _Block] = {}  # k -> the block that served the k-th request last
        self._round = 0  # backward passes begun
        self._slot = 0  # requests in the running pass so far
        self._last = 0  # requests in the last pass that ended
        self._asked = 0  # bytes the running pass asked for so far
        self.limit = 0  # the bound: the most bytes one pass asked for

    @property
    def held_bytes(self) -> int:
        """Bytes of every block the pool holds: free ones and those it handed out and has not
        taken back or forgotten yet (``grad_sample`` among them)."""
        return sum(b.data.nbytes for b in self._blocks)

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device (a ``layout.Allocator``)."""
        n = math.prod(shape)
        if n == 0:
            return fresh_buffer(shape, like)
        slot, self._slot = self._slot, self._slot + 1
        self._asked += n * like.element_size()
        block = self._pick(n, like.dtype, like.device, slot)
        if block is None:
            block = _Block(fresh_buffer((n,), like), self._round, slot)
            self._blocks[block] = None
        elif self._slots.get(block.slot) is block:
            del self._slots[block.slot]
        block.round, block.slot, block.free = self._round, slot, False
        self._slots[slot] = block
        return block.data[:n].view(shape)

    def _pick(self, n: int, dtype: torch.dtype, device: torch.device, slot: int) -> _Block | None:
        """The block for the ``slot``-th request of this pass, or None (see the module: 1., then ``_search``)."""
        own = self._slots.get(slot)
        if own is not None and own.free and own.data.dtype == dtype and own.data.device == device:
            if own.data.numel() >= n:
                return own
            self._release(own)  # outgrown: its memory goes before a larger block is allocated
        return self._search(n, dtype, device, slot)

    def _search(self, n: int, dtype: torch.dtype, device: torch.device, slot: int) -> _Block | None:
        """The smallest free block of ``n`` to ``SLACK * n`` elements that no later request of the pass had
        the previous time, or None (see the module: 2.)."""
        best: _Block | None = None
        for block in self._blocks:
            data = block.data
            if not block.free or data.dtype != dtype or data.device != device or not n <= data.numel() <= SLACK * n:
                continue
            if slot < block.slot < self._last and self._slots.get(block.slot) is block:
                continue  # a later request of this pass had it the previous time
            if best is None or data.numel() < best.data.numel():
                best = block
        return best

    def _release(self, block: _Block) -> None:
        del self._blocks[block]
        if self._slots.get(block.slot) is block:
            del self._slots[block.slot]

    def begin(self) -> None:
        """A backward pass begins (the engine has dropped the previous ``grad_sample``)."""
        self._round += 1
        self._slot = self._asked = 0
        self._settle(forget=False)

    def end(self) -> None:
        """A backward pass ended."""
        self.limit = max(self.limit, self._asked)
        self._last, self._slot, self._asked = self._slot, 0, 0
        self._settle(forget=True)

    def _settle(self, forget: bool) -> None:
        """Take back the blocks nothing else refers to (``forget``: let go of those others still hold from
        an earlier pass), then keep the free ones and those serving this pass within ``limit`` (``_trim``)."""
        for block in list(self._blocks):
            if not block.free:
                if not _in_use(block):
                    block.free = True
                elif forget and block.round != self._round:
                    self._release(block)
        excess = sum(b.data.nbytes for b in self._blocks if b.free or b.round == self._round) - self.limit
        if excess > 0:
            self._trim(excess)

    def _trim(self, excess: int) -> None:
        """Release free blocks, least recently used first, until ``excess`` bytes are gone."""
        for block in sorted((b for b in self._blocks if b.free), key=lambda b: (b.round, b.slot)):
            if excess <= 0:
                break
            excess -= block.data.nbytes
            self._release(block)

    def forget_bound(self) -> None:
        """Let the next backward pass set ``limit`` afresh: the one that ended was not typical (the
        first backward's check builds per-sample tensors that later passes do not), so what it asked
        for is released when the next pass begins, except what that pass takes again."""
        self.limit = 0

    def clear(self) -> None:
        self._blocks.clear()
        self._slots.clear()
