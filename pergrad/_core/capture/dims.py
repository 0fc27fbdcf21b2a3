"""Where the batch is in the result of an op, from where it is in the operands that carry it.

``Provenance`` (``pergrad._core.shortcuts.shared``) follows which tensors of the model's forward carry the batch;
this module says on which dim. The model's input has the batch on the wrapper's batch dim, and an
op can move it: ``x.transpose(0, 1)`` turns a batch-first ``[B, T, D]`` into a sequence-first
``[T, B, D]``, whose batch dim is 1. With ``T == B`` the two cannot be told apart by their shapes,
so the dim is followed op by op:

- ops that permute dims (``transpose``, ``permute``, ``movedim``, ``.T``, ``.mT``, ...) map it;
- reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``) keep it
  where the dims before it multiply to the same size and it stays a dim of its own;
- basic indexing (ints, slices, ``None``, ``...``) maps it, and so does advanced indexing (index
  tensors, as torch places their broadcast dims; the batch of a dim indexed by a tensor goes where
  that tensor has its rows: ``mask[arange(B)[:, None, None, None], kv]``, HuggingFace's masks);
- ``nn.LSTM``'s, ``nn.GRU``'s and ``nn.RNN``'s kernels, ``pad_packed_sequence`` and
  ``F.multi_head_attention_forward`` put it where their layouts do (a ``PackedSequence``'s data holds
  no batch dim);
- any other op whose result has as many dims as the operand keeps it where it was (elementwise
  ops, layers, ``cat``, attention: none of torch's functions moves dims other than those above),
  and a broadcasting op (``+``, ``where``, ``expand``, ``@``) with a result of more dims keeps it
  aligned from the right;
- anything else (``einsum``, reductions, ``stack``, custom ops) is run again on
  ``meta`` tensors, the batch given a size no other dim has: the result's dim of that size is where
  the batch went.

Where none of that finds one dim of the batch's size, the batch is ``LOST``: the op folded it into
another dim, or picked samples out of it, or it could not be followed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

LOST = -1  # carries the batch, on no dim pergrad could follow
_FOLDED = -16  # below: the batch folded into one dim with others (x.view(B * T, D)): _FOLDED - P, P the
# product of the dims before the batch in row-major order, so a reshape can give it its own dim again


def carries(code: int) -> bool:
    """Whether a batch position (a dim, LOST, or folded) says the tensor carries the batch."""
    return code >= LOST or code < _FOLDED


def folded(code: int) -> bool:
    """Whether the batch is folded into a dim with others (``x.view(B * T, D)``)."""
    return code < _FOLDED


def torch_functions(*names: str) -> set[Any]:
    """The torch and Tensor callables of these names that exist in this torch."""
    found: set[Any] = set()
    for name in names:
        for owner in (torch, torch.Tensor):
            fn = getattr(owner, name, None)
            if fn is not None:
                found.add(fn)
    return found


_TRANSPOSE = torch_functions("transpose", "transpose_", "swapaxes", "swapaxes_", "swapdims", "swapdims_")
_PERMUTE = torch_functions("permute")
_MOVEDIM = torch_functions("movedim", "moveaxis")
_T = torch_functions("t", "t_")
_ADJOINT = torch_functions("adjoint")
_REVERSED = {getattr(Tensor, name).__get__ for name in ("T", "H")}  # (attribute getters)
_SWAPPED = {getattr(Tensor, name).__get__ for name in ("mT", "mH")}
_RESHAPE = torch_functions(
    "view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "squeeze_", "unsqueeze",
    "unsqueeze_", "contiguous", "ravel",
)  # fmt: skip
_BROADCAST = torch_functions(
    "add", "sub", "mul", "div", "true_divide", "where", "masked_fill", "lerp", "addcmul", "addcdiv", "maximum",
    "minimum", "pow", "atan2", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "expand", "expand_as", "broadcast_to", "repeat", "matmul", "bmm",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__pow__", "__rpow__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__and__", "__or__", "__xor__",
)  # fmt: skip
# ops that keep the number of dims but may reorder them (or whose results have their own layouts):
# always run again on meta tensors
_PROBED = torch_functions("einsum", "tensordot", "rot90", "as_strided", "diagonal", "diag_embed")
_RNN = {torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu}  # (nn.LSTM, nn.GRU, nn.RNN)
_PADDED = {torch._VF._pad_packed_sequence}  # (nn.utils.rnn.pad_packed_sequence)
_REDUCE = torch_functions(
    "sum", "mean", "amax", "amin", "logsumexp", "nansum", "nanmean", "max", "min", "argmax", "argmin", "any", "all",
    "prod", "median",
)  # fmt: skip
_MATMUL = torch_functions("matmul", "__matmul__", "__rmatmul__", "bmm")

# how each op moves the batch (ops not listed keep it where it is: _KEEP)
_KEEP, _ALIGN, _MOVE, _RESHAPE_OP, _INDEX, _EMBED, _REDUCE_OP, _PROBE, _LAYOUT = range(9)
_KIND: dict[Any, int] = {
    **{f: _ALIGN for f in _BROADCAST},
    **{f: _PROBE for f in _PROBED},
    **{f: _REDUCE_OP for f in _REDUCE},
    **{f: _MOVE for f in _TRANSPOSE | _PERMUTE | _MOVEDIM | _T | _ADJOINT},
    **{f: _RESHAPE_OP for f in _RESHAPE},
    Tensor.__getitem__: _INDEX,
    F.embedding: _EMBED,
    **{f: _LAYOUT for f in (*_RNN, *_PADDED, F.multi_head_attention_forward)},
}


def _kind(func: Any) -> int:
    try:
        kind = _KIND.get(func)
    except TypeError:  # (an unhashable callable)
        kind = None
    if kind is not None:
        return kind
    return _PROBE if isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket) else _KEEP


def _index(v: Any, rank: int) -> int:
    return int(v) % rank if rank else 0


def _ints(v: Any) -> list[int]:
    return [int(i) for i in v] if isinstance(v, tuple | list | torch.Size) else [int(v)]


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, *names: str) -> Any:
    if len(args) > i:
        return args[i]
    return next((kwargs[n] for n in names if n in kwargs), None)


def _permuted(order: list[int], k: int) -> int:
    """Where dim ``k`` goes when the result's dim j is the operand's ``order[j]``."""
    return order.index(k) if k in order else LOST


def _moved(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], k: int, rank: int) -> int | None:
    """The batch dim after a dim-permuting op (None: not one of them)."""
    if func in _TRANSPOSE:
        a = _index(_arg(args, kwargs, 1, "dim0", "axis0"), rank)
        b = _index(_arg(args, kwargs, 2, "dim1", "axis1"), rank)
        return b if k == a else a if k == b else k
    if func in _PERMUTE:
        dims = (
            args[1:]
            if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int))
            else _arg(args, kwargs, 1, "dims")
        )
        return _permuted([_index(d, rank) for d in _ints(dims)], k)
    if func in _MOVEDIM:
        return _movedim(args, kwargs, k, rank)
    if func in _T:
        return 1 - k if rank == 2 else k
    if func in _ADJOINT:
        return rank - 1 - (k - rank + 2) if k >= rank - 2 else k
    return None


def _movedim(args: tuple[Any, ...], kwargs: dict[str, Any], k: int, rank: int) -> int | None:
    """The batch dim after ``movedim(source, destination)``: the moved dims at their destinations, the
    others in their order in the dims left."""
    sources = [_index(d, rank) for d in _ints(_arg(args, kwargs, 1, "source"))]
    targets = [_index(d, rank) for d in _ints(_arg(args, kwargs, 2, "destination"))]
    order: list[int | None] = [None] * rank
    for s, t in zip(sources, targets, strict=True):
        order[t] = s
    rest = iter(d for d in range(rank) if d not in sources)
    return _permuted([next(rest) if o is None else o for o in order], k)


def attribute_dim(func: Any, rank: int, k: int) -> int:
    """The batch dim of ``x.T``, ``x.mT``, ``x.H``, ``x.mH`` (``func``: the attribute's getter), and of
    any other tensor attribute of ``x`` (``x.data``: where it is in ``x``)."""
    if k == LOST:
        return LOST
    if folded(k):
        return LOST if func in _REVERSED or func in _SWAPPED else k
    if func in _REVERSED:
        return rank - 1 - k
    if func in _SWAPPED and k >= rank - 2:
        return rank - 1 - (k - rank + 2)
    return k


def placed(shape: tuple[int, ...], before: int, size: int) -> int:
    """Where a batch of ``size`` samples whose leading dims multiply to ``before`` (row-major) is in a
    tensor of ``shape``: its own dim, folded into a dim with others, or LOST (split over dims)."""
    run = 1
    for j, s in enumerate(shape):
        if run == before and s == size:
            return j
        if run <= before and before % run == 0 and (run * s) % (before * size) == 0:
            return _FOLDED - before
        run *= s
    return LOST


def _reshaped(shape: tuple[int, ...], k: int, out: tuple[int, ...], size: int) -> int:
    """The batch position after a reshape from ``shape`` (batch at ``k``) to ``out``."""
    return placed(out, _FOLDED - k if folded(k) else math.prod(shape[:k]), size)


def _holding(shape: tuple[int, ...], k: int, size: int) -> int:
    """The dim that holds a folded batch (``k``: its code), or -1."""
    before, run = _FOLDED - k, 1
    for j, s in enumerate(shape):
        if run <= before and before % run == 0 and (run * s) % (before * size) == 0:
            return j
        run *= s
    return -1


def indexed(index: Any, k: int, rank: int) -> int | None:
    """The batch dim of ``x[index]`` (None for advanced indexing: tensors, lists, bools)."""
    items = index if isinstance(index, tuple) else (index,)
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    found: int | None = None
    out = dim = 0
    for i in items:
        if i is Ellipsis:
            skipped = rank - used
            if found is None and dim <= k < dim + skipped:
                found = out + k - dim
            out, dim = out + skipped, dim + skipped
        elif i is None:
            out += 1
        elif isinstance(i, slice):
            if dim == k:
                found = out
            out, dim = out + 1, dim + 1
        elif isinstance(i, int) and not isinstance(i, bool):
            if dim == k:
                found = LOST  # one sample picked out
            dim += 1
        else:
            return None  # (an advanced index anywhere moves the dims: ``advanced``)
    return out + k - dim if found is None else found


def _nested_shape(v: Any) -> tuple[int, ...] | None:
    """The shape of an index given as nested lists of ints (``x[:, [[0], [1]]]``), None for anything else."""
    if isinstance(v, int) and not isinstance(v, bool):
        return ()
    if not isinstance(v, list | tuple) or not v:
        return None
    inner = [_nested_shape(i) for i in v]
    if inner[0] is None or any(s != inner[0] for s in inner):
        return None
    return (len(v), *inner[0])


def _items(index: Any) -> tuple[Any, ...]:
    """The items of an index as torch reads them: a list holding tensors, lists, slices, ``None`` or
    ``...`` is a tuple of items (numpy's legacy rule), a list of ints one index tensor."""
    if isinstance(index, tuple):
        return index
    if (
        isinstance(index, list)
        and len(index) < 32
        and any(isinstance(i, Tensor | list | tuple | slice) or i is None or i is Ellipsis for i in index)
    ):
        return tuple(index)
    return (index,)


_MASK = (-1,)  # the shape of each index tensor a boolean mask becomes (its size: how many it selects)


def advanced(index: Any, rank: int, size: int, k: int | None = None, operand: Tensor | None = None) -> int | None:
    """The batch dim of ``x[index]`` with tensors (or lists) among the items: where ``x`` (``rank``
    dims) has the batch on dim ``k``, or where the index tensor ``operand`` has it on dim ``k``.

    As torch indexes: ints (and 0-dim integer tensors) select first; then the index tensors are
    broadcast together, and their broadcast dims take the place of the dims they index where those are
    adjacent, else go first. The batch of ``x`` on a dim indexed by a tensor goes to the one dim along
    which that tensor varies, where it has ``size`` entries (``x[arange(B)[:, None], ids]``: a row per
    sample; picking samples in another order is the model's choice, as ``x[perm]`` is); an index
    tensor's batch goes where it is broadcast to. LOST where the batch is selected by an int, covered by
    a boolean mask (folded with the positions it selects), or goes nowhere one can tell; None where an
    item is of a kind not followed here."""
    items = _items(index)
    shapes: list[tuple[int, ...] | None] = []  # per item: the shape of its index tensor(s); None for basic
    used = 0
    for i in items:
        if i is None or i is Ellipsis or isinstance(i, bool):
            shapes.append(None)
        elif isinstance(i, int | slice):
            shapes.append(None)
            used += 1
        elif isinstance(i, Tensor):
            mask = i.dtype in (torch.bool, torch.uint8)
            shapes.append(None if i.dim() == 0 and not mask else tuple(i.shape))
            used += i.dim() if mask else 1
        elif (found := _nested_shape(i)) is not None:
            shapes.append(found)
            used += 1
        else:
            return None
    # the dims of the intermediate result (after the selections), each ("x", dim of x), ("new",) or
    # ("index", shape, dims of x it indexes, item)
    entries: list[tuple[Any, ...]] = []
    dim = 0
    for i, shape in zip(items, shapes, strict=True):
        if i is Ellipsis:
            skipped = rank - used
            entries += [("x", d) for d in range(dim, dim + skipped)]
            dim += skipped
        elif i is None:
            entries.append(("new",))
        elif isinstance(i, bool) or (isinstance(i, Tensor) and i.dim() == 0 and i.dtype in (torch.bool, torch.uint8)):
            entries.append(("index", (1,), (), i))  # (unsqueezed, then indexed by [0] or by nothing)
        elif shape is None:
            if isinstance(i, slice):
                entries.append(("x", dim))
            elif k == dim and operand is None:
                return LOST  # one sample picked out
            dim += 1
        elif isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8):
            covered = tuple(range(dim, dim + i.dim()))
            entries += [("index", _MASK, covered, i)] * i.dim()
            dim += i.dim()
        else:
            entries.append(("index", shape, (dim,), i))
            dim += 1
    entries += [("x", d) for d in range(dim, rank)]
    at = [p for p, e in enumerate(entries) if e[0] == "index"]
    if not at:  # (0-dim integer tensors alone: selections)
        return LOST if operand is not None else next((p for p, e in enumerate(entries) if e == ("x", k)), LOST)
    width = max(len(entries[p][1]) for p in at)  # the rank of the broadcast index shape
    adjacent = at == list(range(at[0], at[-1] + 1))
    start = at[0] if adjacent else 0  # where the broadcast dims are in the result

    def broadcast_dim(shape: tuple[int, ...], j: int) -> int:
        return start + j + width - len(shape)

    if operand is not None:  # an index tensor with the batch on its dim k
        entry = next((entries[p] for p in at if entries[p][3] is operand), None)
        if entry is None or entry[1] is _MASK:
            return LOST
        return broadcast_dim(entry[1], k) if k is not None else LOST
    for p, e in enumerate(entries):
        if e[0] == "x" and e[1] == k:
            before = sum(1 for q in range(p) if entries[q][0] != "index")
            return p - len(at) + width if adjacent and p > at[-1] else p if adjacent else width + before
        if e[0] == "index" and k in e[2]:
            shape = e[1]
            if shape is _MASK:
                return LOST
            strides = e[3].stride() if isinstance(e[3], Tensor) else (1,) * len(shape)
            varies = [j for j, s in enumerate(shape) if s != 1 and strides[j] != 0]  # (expanded: not varying)
            if varies == [] and size == 1:  # one sample: any dim of size 1 that every index keeps at 1
                varies = [j for j in range(len(shape)) if _ones(entries, at, width, j - len(shape) + width)][:1]
            if len(varies) != 1 or shape[varies[0]] != size:
                return LOST  # (or along several dims: samples and positions mixed)
            return broadcast_dim(shape, varies[0])
    return LOST


def _ones(entries: list[tuple[Any, ...]], at: list[int], width: int, j: int) -> bool:
    """Whether every index tensor has size 1 (or no dim) at dim ``j`` of the broadcast index shape."""
    for p in at:
        shape = entries[p][1]
        i = j - width + len(shape)
        if 0 <= i < len(shape) and shape[i] != 1:
            return False
    return True


def written(index: Any, rank: int, k: int, value_rank: int) -> int:
    """The batch dim of ``x`` (``rank`` dims) after ``x[index] = value``, the value's batch on ``k``:
    the dim of ``x`` that the value's batch dim lands on, aligned from the right in ``x[index]``
    (LOST for advanced indexing)."""
    items = index if isinstance(index, tuple) else (index,)
    picked = [isinstance(i, int) and not isinstance(i, bool) for i in items]
    if not all(p or i is None or i is Ellipsis or isinstance(i, slice) for p, i in zip(picked, items, strict=True)):
        return LOST
    j = k + rank - sum(picked) + sum(i is None for i in items) - value_rank
    return next((d for d in range(rank) if indexed(index, d, rank) == j), LOST)


def _reduced(args: tuple[Any, ...], kwargs: dict[str, Any], k: int, rank: int) -> int | None:
    """The batch dim after a reduction ``x.sum(dim, keepdim)`` (None: not called with dims)."""
    dims = _arg(args, kwargs, 1, "dim")
    if dims is None:
        return LOST if not args[1:] and "dim" not in kwargs else None  # (over every dim, or another overload)
    if not isinstance(dims, int | tuple | list) or isinstance(dims, bool):
        return None
    reduced = {_index(d, rank) for d in _ints(dims)}
    if k in reduced:
        return LOST
    return k if _arg(args, kwargs, 2, "keepdim") is True else k - sum(d < k for d in reduced)


def _recurrent(args: tuple[Any, ...], carried: list[tuple[Tensor, int]], n: int) -> list[int]:
    """The batch dims of what a recurrent kernel returns: ``(output, h_n)`` or ``(output, h_n, c_n)``,
    called as ``(input, hx, weights, ..., batch_first)`` or, on a PackedSequence's data, as ``(data,
    batch_sizes, hx, weights, ...)``: the output as ``batch_first`` says (a PackedSequence's data: LOST),
    the states ``[layers * directions, B, H]`` on dim 1. All LOST where an operand has the batch on
    another dim than the kernel takes it on (it would take samples for time steps)."""
    packed = not isinstance(args[2], list)
    layout = LOST if packed else 0 if args[-1] is True else 1
    for t, k in carried:
        expected = layout if t is args[0] else LOST if packed and t is args[1] else 1
        if k >= 0 and expected >= 0 and k != expected:
            return [LOST] * n
    return [layout, *([1] * (n - 1))]


def _unfolding(kind: int, own: bool, t: Tensor, k: int, r: Tensor, size: int) -> int:
    """The batch position in result ``r`` of an operand ``t`` whose batch is folded (code ``k``): a
    reshape may give it its own dim again; an op that keeps the dims up to the one holding it keeps it."""
    if own and kind == _RESHAPE_OP:
        return _reshaped(tuple(t.shape), k, tuple(r.shape), size)
    if kind not in (_KEEP, _ALIGN) or r.dim() != t.dim():
        return LOST
    j = _holding(tuple(t.shape), k, size)
    return k if j >= 0 and r.shape[: j + 1] == t.shape[: j + 1] else LOST


def _follow(
    kind: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], t: Tensor, k: int, r: Tensor, size: int
) -> int | None:
    """The batch position in result ``r`` of an operand ``t`` with the batch at ``k`` (op ``func`` of
    kind ``kind``), or None where the op must be run on meta tensors to tell."""
    own = bool(args) and args[0] is t
    if folded(k):
        return _unfolding(kind, own, t, k, r, size)
    rank = t.dim()
    if own and kind != _KEEP and kind != _ALIGN:
        if kind == _MOVE:
            return _moved(func, args, kwargs, k, rank)
        if kind == _RESHAPE_OP:
            return _reshaped(tuple(t.shape), k, tuple(r.shape), size)
        if kind == _INDEX:
            found = indexed(args[1], k, rank)
            return found if found is not None else advanced(args[1], rank, size, k)
        if kind == _EMBED:
            return k
        if kind == _REDUCE_OP:
            return _reduced(args, kwargs, k, rank)
    if kind == _PROBE:
        return None
    if kind == _INDEX and len(args) > 1 and isinstance(args[0], Tensor):  # an index tensor with the batch
        return advanced(args[1], args[0].dim(), size, k, t)
    if r.dim() == rank:
        return k
    if kind == _ALIGN and r.dim() > rank and (func not in _MATMUL or rank >= 2):
        return k + r.dim() - rank
    return None


def _tensor_items(values: Any) -> Iterator[Tensor]:
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, tuple | list):
            yield from (t for t in v if isinstance(t, Tensor))


def _probe(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], carried: list[tuple[Tensor, int]], n: int
) -> list[int]:
    """The op run again on meta tensors, each carried operand's batch given a size no other dim has:
    the dim of that size in each of its ``n`` result tensors (LOST where there is not exactly one)."""
    if any(folded(k) for _, k in carried):
        return [LOST] * n
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
    size = 2 * max([1, *(s for x in leaves for s in x.shape)]) + 11
    dims = {id(t): k for t, k in carried}

    def meta(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        shape = list(x.shape)
        k = dims.get(id(x))
        if k is not None:
            shape[k] = size
        return torch.empty(shape, dtype=x.dtype, device="meta")

    try:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            out = func(*tree_map(meta, args), **tree_map(meta, {n: v for n, v in kwargs.items() if n != "out"}))
    except Exception:  # an op that needs values (masks, nonzero) or sizes given as numbers
        return [LOST] * n
    results = list(_tensor_items((out,)))
    if len(results) != n:
        return [LOST] * n
    found = []
    for r in results:
        at = [j for j, s in enumerate(r.shape) if s == size]
        found.append(at[0] if len(at) == 1 else LOST)
    return found


def result_dims(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: list[Tensor],
    carried: list[tuple[Tensor, int]],
    size: int,
) -> list[int]:
    """The batch position of each tensor of an op's result (``results``, in the order ``_tensor_items``
    gives), from ``carried``: the operands that carry the batch, each with its position (a dim, LOST,
    or folded); ``size``: the batch size. Operands that disagree on where the batch goes leave it LOST."""
    kind = _kind(func)
    if kind == _LAYOUT:
        return _laid_out(func, args, carried, len(results))
    if len(carried) == 1 and len(results) == 1 and kind == _KEEP:  # (most ops: elementwise, layers)
        (t, k), r = carried[0], results[0]
        if k >= 0 and r.dim() == t.dim():
            return [k if r.shape[k] == size else LOST]
    if any(k == LOST for _, k in carried):
        return [LOST] * len(results)
    found: list[int] = []
    probed: list[int] | None = None
    for i, r in enumerate(results):
        at: set[int] = set()
        for t, k in carried:
            j = _follow(kind, func, args, kwargs, t, k, r, size)
            if j is None:
                if probed is None:
                    probed = _probe(func, args, kwargs, carried, len(results))
                j = probed[i]
            at.add(j if folded(j) or (0 <= j < r.dim() and r.shape[j] == size) else LOST)
        found.append(at.pop() if len(at) == 1 else LOST)
    return found


def _laid_out(func: Any, args: tuple[Any, ...], carried: list[tuple[Tensor, int]], n: int) -> list[int]:
    """The batch dims of what an op with a layout of its own returns (``_recurrent``; a
    ``PackedSequence`` padded: ``(data, batch_sizes, batch_first, ...) -> (padded, lengths)``;
    ``F.multi_head_attention_forward``: ``[L, B, E]`` in, ``(out [L, B, E], weights [B, ...])`` out)."""
    if func in _RNN:
        return _recurrent(args, carried, n)
    if func in _PADDED:
        return [0 if args[2] is True else 1, 0][:n]
    ok = all(k == 1 and t.dim() == 3 for t, k in carried if any(t is x for x in args[:3]))
    return [1, 0][:n] if ok else [LOST] * n
