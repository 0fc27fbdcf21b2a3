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
another dim, or it could not be followed. An op that moves samples out of their rows gives ``MIXED``: row
``i`` of a layer input computed from its result is no longer sample ``i`` alone (``Provenance`` refuses it):

- it reorders them (``x[perm]`` with an index other than ``arange(B)`` in order, ``x[perm] = y``, ``flip``,
  ``roll``, ``index_select``, ``gather``, ``index_put``, ``sort``, ``unbind``, ``rot90``, an embedding whose
  table is the batch, the batch as ``put``'s or ``masked_scatter``'s source) or mixes them (``cumsum`` and the
  other scans, ``softmax``, ``F.normalize``, ``fft``, ``fftshift``, ``gradient``, ``cross``, ``pixel_shuffle``, a
  conv or pool over the batch dim, ``P @ x`` or an ``einsum`` summing over it, a reduction over it:
  ``x - x.mean(0)``, a function of a whole matrix over its rows: ``linalg.qr``, ``svd``, attention with the batch
  as positions) along the batch dim, or pairs them (operands with the batch on two dims of the result: ``x @ x.T``,
  ``inner(x, x)``, ``cdist(x, x)``);
- it picks samples out of the batch or adds rows to it (``x[0]``, ``x[1:]``, ``narrow``, ``chunk``,
  ``F.pad``): a tensor rebuilt from the pieces (``torch.cat([x[1:], x[:1]])``) is not the batch in order.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

LOST = -1  # carries the batch, on no dim pergrad could follow
MIXED = -5  # ``result_dims``: the op reordered or mixed the samples along the batch dim (marked LOST, see shared.py)
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
    "expand", "expand_as", "broadcast_to", "repeat", "matmul", "bmm", "mm", "mv",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__pow__", "__rpow__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "__and__", "__or__", "__xor__",
)  # fmt: skip
# ops that keep the number of dims but may reorder them (or whose results have their own layouts):
# always run again on meta tensors
_PROBED = torch_functions("einsum", "tensordot", "as_strided", "diagonal", "diag_embed")
_RNN = {torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu}  # (nn.LSTM, nn.GRU, nn.RNN)
_PADDED = {torch._VF._pad_packed_sequence}  # (nn.utils.rnn.pad_packed_sequence)
_REDUCE = torch_functions(
    "sum", "mean", "amax", "amin", "logsumexp", "nansum", "nanmean", "max", "min", "argmax", "argmin", "any", "all",
    "prod", "median",
)  # fmt: skip
_MATMUL = torch_functions("matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "mv")


def _functions_of(namespace: Any, names: tuple[str, ...]) -> list[Any]:
    """The functions of these names that exist in ``namespace`` (``torch.linalg``) in this torch."""
    return [getattr(namespace, name) for name in names if hasattr(namespace, name)]


# ops that act along the dims they are given (reorder, gather, scan or normalise across them): where the batch dim
# is one of them, the result's rows are not the operand's samples. By op: (position of the dim argument, counting
# the operand itself, its keyword, its default: None for every dim, or a fixed dim where the op takes none)
_KEYWORD_ONLY = 64  # (a position no argument has: the dim is given by keyword only, torch.gradient(x, dim=1))
_ALONG_DIMS: dict[Any, tuple[int, str, int | tuple[int, ...] | None]] = {
    **{f: (1, "dim", None) for f in torch_functions(
        "index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
        "scatter_reduce_", "index_copy", "index_copy_", "index_add", "index_add_", "index_fill", "index_fill_",
        "index_reduce", "index_reduce_", "cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin",
        "logcumsumexp",
    )},
    **{f: (1, "dim", -1) for f in torch_functions("sort", "argsort", "softmax", "log_softmax")},
    **{f: (1, "dims", None) for f in torch_functions("flip")},
    **{f: (2, "dims", None) for f in torch_functions("roll")},
    **{f: (2, "dim", None) for f in torch_functions("take_along_dim")},
    **{f: (2, "dim", -1) for f in torch_functions("topk", "diff")},
    **{f: (1, "dim", 0) for f in torch_functions("unbind")},
    **{f: (2, "dims", (0, 1)) for f in torch_functions("rot90")},
    **{f: (2, "dim", -1) for f in (torch.fft.fft, torch.fft.ifft, torch.fft.rfft, torch.fft.irfft, torch.fft.hfft,
                                   torch.fft.ihfft)},
    **{f: (2, "dim", None) for f in (torch.fft.fftn, torch.fft.ifftn, torch.fft.rfftn, torch.fft.irfftn,
                                     torch.fft.fft2, torch.fft.ifft2, torch.fft.rfft2, torch.fft.irfft2,
                                     torch.fft.hfftn, torch.fft.ihfftn, torch.fft.hfft2, torch.fft.ihfft2)},
    **{f: (-1, "", 0) for f in torch_functions("index_put", "index_put_")},
    **{f: (-1, "", 0) for f in torch_functions("flipud", "msort")},
    **{f: (1, "dim", None) for f in (torch.fft.fftshift, torch.fft.ifftshift)},
    **{f: (_KEYWORD_ONLY, "dim", None) for f in torch_functions("gradient")},
    **{f: (-1, "", (-3, -2, -1)) for f in torch_functions("pixel_shuffle", "pixel_unshuffle")},
    **{f: (-1, "", 1) for f in torch_functions("channel_shuffle", "native_channel_shuffle")},
    **{f: (-1, "", 1) for f in torch_functions("fliplr")},
    F.softmax: (1, "dim", -2), F.log_softmax: (1, "dim", -2), F.softmin: (1, "dim", -2),  # (-2: torch's implicit dim)
    F.normalize: (2, "dim", 1), F.gumbel_softmax: (4, "dim", -1),
    torch.special.softmax: (1, "dim", -1), torch.special.log_softmax: (1, "dim", -1),
    # functions of a whole matrix (its last two dims): a row of the result depends on every row of the operand
    **{f: (-1, "", (-2, -1)) for f in _functions_of(torch.linalg, (
        "qr", "svd", "svdvals", "pinv", "inv", "inv_ex", "det", "slogdet", "eig", "eigh", "eigvals", "eigvalsh",
        "cholesky", "cholesky_ex", "lu", "lu_factor", "lu_factor_ex", "matrix_exp", "matrix_power", "matrix_rank",
        "cond", "householder_product", "ldl_factor", "ldl_factor_ex",
    ))},
    **{f: (-1, "", (-2, -1)) for f in torch_functions(
        "svd", "qr", "pinverse", "inverse", "det", "logdet", "slogdet", "cholesky", "cholesky_inverse", "matrix_exp",
        "matrix_power", "geqrf", "svd_lowrank", "pca_lowrank", "lobpcg",
    )},
    torch.linalg.matrix_norm: (2, "dim", (-2, -1)),
}  # fmt: skip

_TAKE_ALONG = torch_functions("take_along_dim")
_PUT = torch_functions("index_put", "index_put_")
_INDEXED_ALONG = torch_functions("index_select", "gather") | _TAKE_ALONG  # (in order: each sample from its row)

_EINSUM = torch_functions("einsum")
# ops with a rule of their own for where the batch goes (``_RULES``); by op, the positions of its two matrix
# operands (products) and of its right-hand side (solves)
_PRODUCTS = {
    **{f: (1, 2) for f in torch_functions("addmm", "addmm_", "addbmm", "addbmm_", "baddbmm", "baddbmm_", "addmv")},
    torch.linalg.matmul: (0, 1), torch.sparse.mm: (0, 1), torch.sparse.addmm: (1, 2),
}  # fmt: skip
_SOLVES = {
    **{f: 1 for f in _functions_of(torch.linalg, ("solve", "solve_ex", "lstsq", "solve_triangular"))},
    **{f: 2 for f in _functions_of(torch.linalg, ("lu_solve",))},
    **{f: 0 for f in torch_functions("cholesky_solve", "triangular_solve", "lu_solve")},
}
_VECTORS = set(_functions_of(torch.linalg, ("solve", "solve_ex")))  # (b may be a batch of vectors: A's shape[:-1])
_NORMALISED = {F.layer_norm, F.rms_norm, torch.layer_norm, *torch_functions("rms_norm")}
_CHAINS = _functions_of(torch.linalg, ("multi_dot",)) + list(torch_functions("chain_matmul"))
_ATTENTION = {F.scaled_dot_product_attention}
_PAIRWISE = torch_functions("cdist")
_RENORM = torch_functions("renorm")
_TENSORDOT = torch_functions("tensordot")
_CONV_TBC = torch_functions("conv_tbc")
_INNER = torch_functions("inner")
_CROSS_FIRST_OF_3 = torch_functions("cross")  # (without dim: the first dim of size 3; linalg.cross: the last)
_CROSS = _CROSS_FIRST_OF_3 | set(_functions_of(torch.linalg, ("cross",)))
_LAID_IN_ORDER = torch_functions("masked_scatter", "masked_scatter_", "put", "put_")
# (F.linear has a rule too, kept out of the set: most of its calls take result_dims' fast path)
_RULED_OPS = {
    *_PRODUCTS, *_SOLVES, *_NORMALISED, *_CHAINS, *_ATTENTION, *_PAIRWISE, *_RENORM, *_TENSORDOT, *_CONV_TBC,
    *_INNER, *_CROSS, *_LAID_IN_ORDER,
    F.group_norm, F.instance_norm, F.local_response_norm, F.embedding_bag,
}  # fmt: skip
_SHAPED = torch_functions("as_strided")  # (the result's shape comes from the arguments: the probe cannot tell)
# ops that take the batch on dim 0 and mix along every other (channels, length): the batch elsewhere is mixed
_BATCH_FIRST = torch_functions(
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "avg_pool1d",
    "adaptive_avg_pool1d", "adaptive_max_pool1d", "max_pool1d", "max_pool2d", "max_pool3d",
) | {F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.max_pool1d, F.max_pool2d,
     F.max_pool3d, F.interpolate, F.unfold, F.fold, F.grid_sample, F.lp_pool1d, F.lp_pool2d,
     *_functions_of(F, ("max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
                        "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices",
                        "adaptive_max_pool3d_with_indices", "adaptive_max_pool2d", "adaptive_max_pool3d",
                        "fractional_max_pool2d", "fractional_max_pool3d", "lp_pool3d"))}  # fmt: skip

# how each op moves the batch (ops not listed keep it where it is: _KEEP)
_KEEP, _ALIGN, _MOVE, _RESHAPE_OP, _INDEX, _EMBED, _REDUCE_OP, _PROBE, _LAYOUT, _ALONG, _RULED = range(11)
_KIND: dict[Any, int] = {
    **{f: _ALONG for f in _ALONG_DIMS},
    **{f: _ALIGN for f in _BROADCAST},
    **{f: _PROBE for f in _PROBED},
    **{f: _REDUCE_OP for f in _REDUCE},
    **{f: _MOVE for f in _TRANSPOSE | _PERMUTE | _MOVEDIM | _T | _ADJOINT},
    **{f: _RESHAPE_OP for f in _RESHAPE},
    Tensor.__getitem__: _INDEX,
    F.embedding: _EMBED,
    **{f: _LAYOUT for f in (*_RNN, *_PADDED, F.multi_head_attention_forward)},
    **{f: _RULED for f in _RULED_OPS},  # (last: a rule of its own over any kind above)
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
    tensor of ``shape``: its own dim, folded into a dim with others, LOST where split over dims of its own
    (``x.view(2, B // 2, D)``), or MIXED where no dims hold it alone (``x.T.reshape(B, -1)`` of ``[D, B]``:
    a row of several samples' values)."""
    run = 1
    for j, s in enumerate(shape):
        if run == before and s == size:
            return j
        if run <= before and before % run == 0 and (run * s) % (before * size) == 0:
            return _FOLDED - before
        if (
            run == before
            and 1 < s < size
            and any(math.prod(shape[j:end]) == size for end in range(j + 1, len(shape) + 1))
        ):
            return LOST
        run *= s
    return MIXED if size > 1 else LOST


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
                found = MIXED  # one sample picked out (h[0].expand(B, -1) is not the batch)
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
    which that tensor varies, where it has ``size`` entries in order (``x[arange(B)[:, None], ids]``: a row
    per sample; MIXED for any other order, ``x[perm]``); an index tensor's batch goes where it is broadcast
    to. LOST where the batch is selected by an int, covered by a boolean mask (folded with the positions it
    selects), or goes nowhere one can tell; None where an item is of a kind not followed here."""
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
                return MIXED if size > 1 else LOST  # one sample picked out (h[0].expand(B, -1) is not the batch)
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
            if shape is _MASK:  # (over the batch dim alone: samples picked out; over more: folded with positions)
                if e[2] == (k,) or not all(entries[q][3] is e[3] for q in at):
                    return MIXED if e[2] == (k,) and size > 1 else LOST
                return _one_per_sample(e[3], e[2].index(k), start, size)
            strides = e[3].stride() if isinstance(e[3], Tensor) else (1,) * len(shape)
            varies = [j for j, s in enumerate(shape) if s != 1 and strides[j] != 0]  # (expanded: not varying)
            if varies == [] and size == 1:  # one sample: any dim of size 1 that every index keeps at 1
                varies = [j for j in range(len(shape)) if _ones(entries, at, width, j - len(shape) + width)][:1]
            if len(varies) > 1:  # (arange(B)[:, None].repeat(1, K): in order, and materialised)
                j = _rows_in_order(e[3], shape, size)
                return MIXED if j is None else broadcast_dim(shape, j)
            if len(varies) != 1 or shape[varies[0]] != size:
                return MIXED if size > 1 else LOST  # (rows picked or repeated)
            if not _in_order(e[3], shape, varies[0], size):
                return MIXED  # (x[perm]: row i is another sample)
            return broadcast_dim(shape, varies[0])
    return LOST


def _one_per_sample(mask: Tensor, m: int, start: int, size: int) -> int:
    """The batch dim of ``x[mask]``, a boolean mask over the batch dim (its dim ``m``) and others, whose picks land
    on dim ``start``: there, in order, where the mask picks one position of each sample and the batch is its first
    dim but for dims of size 1 (``h[arange(T) == (lengths - 1)[:, None]]``, the last token of each sample); told by
    its values. Else MIXED: row ``i`` of the result is not sample ``i``."""
    try:
        first = all(s == 1 for s in mask.shape[:m])  # (the batch the mask's first dim but for dims of size 1)
        one = first and bool(mask.flatten(m + 1).sum(-1).eq(1).all()) if mask.dim() > m + 1 else False
    except (RuntimeError, NotImplementedError):  # (meta tensors: no values to read)
        return LOST
    return start if one else MIXED if size > 1 else LOST


def _ones(entries: list[tuple[Any, ...]], at: list[int], width: int, j: int) -> bool:
    """Whether every index tensor has size 1 (or no dim) at dim ``j`` of the broadcast index shape."""
    for p in at:
        shape = entries[p][1]
        i = j - width + len(shape)
        if 0 <= i < len(shape) and shape[i] != 1:
            return False
    return True


def out_of_order(index: Any) -> bool:
    """Whether ``x[index] = value`` puts rows of ``value`` elsewhere than in order: an integer index tensor or list
    other than ``0, 1, ..., n - 1`` (``out[perm] = h``)."""
    for i in _items(index):
        if isinstance(i, Tensor) and i.dtype not in (torch.bool, torch.uint8) and i.dim() > 0:
            if i.dim() != 1 or not _in_order(i, tuple(i.shape), 0, len(i)):
                return True
        elif isinstance(i, list | tuple) and i:
            return list(i) != list(range(len(i)))
    return False


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
        return MIXED if not args[1:] and "dim" not in kwargs else None  # (over every dim, or another overload)
    if not isinstance(dims, int | tuple | list) or isinstance(dims, bool):
        return None
    reduced = {_index(d, rank) for d in _ints(dims)}
    if k in reduced:
        return MIXED  # (a statistic of the batch: each sample's rows then depend on the others')
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
        holding = _holding(tuple(t.shape), k, size)
        if kind == _ALONG and _acts_along(func, args, kwargs, holding, t.dim()):
            return MIXED  # (h.reshape(-1).flip(0): the samples' rows moved)
        if holding >= 0 and _sums_over(func, args, t, holding):
            return MIXED  # (P @ h.reshape(B * T, D): each row a mix of samples)
        if kind == _RULED:  # (HF's Conv1D: addmm(b, x.view(-1, D), W), the batch folded in x's rows)
            found = _ruled(func, args, kwargs, t, holding, t.dim(), r) if holding >= 0 else LOST
            if found is None:
                return _unfolding(_KEEP, own, t, k, r, size)
            return MIXED if found == MIXED else LOST  # (moved elsewhere: not followed while folded)
        return _unfolding(kind, own, t, k, r, size)
    rank = t.dim()
    if kind == _ALONG and _acts_along(func, args, kwargs, k, rank):
        return MIXED
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
    if _sums_over(func, args, t, k):
        return MIXED  # (P @ h: each row a mix of samples)
    if kind == _RULED or func is F.linear:
        found = _ruled(func, args, kwargs, t, k, rank, r)
        if found is not None:
            return found
    if (kind == _EMBED and not own) or (func in _BATCH_FIRST and own and k != 0):
        return MIXED  # (the samples as an embedding's table, or a conv/pool over the batch dim)
    if kind == _PROBE:
        return None
    if kind == _INDEX and len(args) > 1 and isinstance(args[0], Tensor):  # an index tensor with the batch
        return advanced(args[1], args[0].dim(), size, k, t)
    if r.dim() == rank:
        return k
    if kind == _ALIGN and r.dim() > rank and (func not in _MATMUL or rank >= 2):
        return k + r.dim() - rank
    return None


def _sums_over(func: Any, args: tuple[Any, ...], t: Tensor, k: int) -> bool:
    """Whether a product sums over dim ``k`` of operand ``t``: ``a @ b`` (``mm``, ``bmm``, ``matmul``) over ``a``'s
    last dim or ``b``'s last but one, ``F.linear`` over its input's last dim, ``einsum`` over a letter not in its
    output."""
    if func in _MATMUL:
        return _contracts(args, t, k, t.dim())
    if func is F.linear:
        return bool(args) and args[0] is t and k == t.dim() - 1
    return func in _EINSUM and _summed_over(args, t, k)


def _summed_over(args: tuple[Any, ...], t: Tensor, k: int) -> bool:
    """Whether ``einsum(equation, *operands)`` sums over dim ``k`` of operand ``t`` (its letter not in the output;
    ``...`` stands for the dims no letter names, aligned from the right as they broadcast)."""
    if not args or not isinstance(args[0], str):
        return False
    operands = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
    position = next((p for p, o in enumerate(operands) if o is t), None)
    inputs, arrow, output = args[0].replace(" ", "").partition("->")
    specs = inputs.split(",")
    if position is None or position >= len(specs) or len(specs) != len(operands):
        return False
    if "..." in args[0]:
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in args[0]]
        widths = [
            o.dim() - len(spec.replace("...", "")) if isinstance(o, Tensor) else 0
            for o, spec in zip(operands, specs, strict=True)
        ]
        width = max(widths, default=0)
        if width > len(free) or min(widths, default=0) < 0:
            return False
        specs = [spec.replace("...", "".join(free[width - w : width])) for spec, w in zip(specs, widths, strict=True)]
        implicit = "".join(free[:width])
        output = (
            output.replace("...", implicit)
            if arrow
            else implicit + "".join(c for c in sorted(set(inputs)) if c.isalpha() and inputs.count(c) == 1)
        )
        arrow = "->"
    spec = specs[position]
    if k >= len(spec):
        return False
    if not arrow:
        output = "".join(c for c in sorted(set(inputs)) if c.isalpha() and inputs.count(c) == 1)
    return spec[k] not in output


def _contracts(args: tuple[Any, ...], t: Tensor, k: int, rank: int) -> bool:
    """Whether ``a @ b`` sums over dim ``k`` of operand ``t``: ``a``'s last dim, ``b``'s last but one (its only
    one for a vector)."""
    if len(args) < 2:
        return False
    if args[0] is t:
        return k == rank - 1
    return args[1] is t and k == max(rank - 2, 0)


class _Operand(NamedTuple):
    """An operand of an op of ``_RULES``: where it is among the arguments (``at``: the same tensor may be several
    operands, ``cdist(h, h)``), its batch dim ``k`` of ``rank``, and the op's result ``r``."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    t: Tensor
    at: set[int]
    k: int
    rank: int
    r: Tensor

    @property
    def last(self) -> bool:
        return self.k == self.rank - 1

    @property
    def matrix(self) -> bool:  # (the batch on one of the dims a matrix function reads as rows or columns)
        return self.k >= self.rank - 2


def _ruled(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], t: Tensor, k: int, rank: int, r: Tensor
) -> int | None:
    """The batch position in result ``r`` of operand ``t`` (batch on dim ``k`` of ``rank``) of an op of
    ``_RULES``, by its rule: MIXED where the op combines rows along the batch dim, a dim where it moves it,
    None where it keeps it as an elementwise op would."""
    at = {i for i, a in enumerate(args) if a is t}
    return _RULES[func](_Operand(func, args, kwargs, t, at, k, rank, r))


def _product(o: _Operand) -> int | None:
    """a @ b by another name (``addmm``, ``baddbmm``, ``sparse.mm``): a's last dim and b's last but one summed."""
    first, second = _PRODUCTS[o.func]
    return MIXED if (first in o.at and o.last) or (second in o.at and o.k == max(o.rank - 2, 0)) else None


def _solve(o: _Operand) -> int | None:
    """A X = B: each row of X depends on every row of B (with ``left=False``, each column); A read whole."""
    rhs = _SOLVES[o.func]
    left = o.kwargs.get("left", True) is not False
    a = o.args[0] if rhs == 1 and o.args else None
    if rhs in o.at and isinstance(a, Tensor) and o.func in _VECTORS and o.t.shape == a.shape[:-1]:
        return MIXED if o.last else None  # (linalg.solve(A, b) of b [B, n] and A [B, n, n]: a vector per sample)
    solved = rhs in o.at and (o.rank == 1 or (o.k == o.rank - 2 and left) or (o.last and not left))
    return MIXED if solved or (o.at - {rhs} and o.matrix) or not o.at else None


def _normalised(o: _Operand) -> int | None:
    """``layer_norm``/``rms_norm``: normalised over the last ``len(normalized_shape)`` dims."""
    shape = _arg(o.args, o.kwargs, 1, "normalized_shape")
    n = len(shape) if isinstance(shape, tuple | list | torch.Size) else 1
    return MIXED if 0 in o.at and o.k >= o.rank - n else None


def _chain(o: _Operand) -> int | None:
    """``multi_dot([A, h])``: each matrix's rows summed with the one before it, its columns with the one after."""
    chain = o.args[0] if o.args and isinstance(o.args[0], list | tuple) else o.args
    places = [p for p, a in enumerate(chain) if a is o.t]
    return MIXED if any((p > 0 and o.k == 0) or (p < len(chain) - 1 and o.last) for p in places) else None


def _attention(o: _Operand) -> int | None:
    """``scaled_dot_product_attention``: each query attends to every key (keys and values read over their
    positions, queries over their features); a query's position is its own row."""
    query = 0 in o.at or o.kwargs.get("query") is o.t
    memory = bool(o.at & {1, 2}) or o.kwargs.get("key") is o.t or o.kwargs.get("value") is o.t
    return MIXED if (query and o.last) or (memory and o.matrix) else None


def _linear(o: _Operand) -> int | None:
    """``F.linear``: x @ W.T (x's last dim summed over: ``_sums_over``, checked first); W's rows go to the result's
    last dim, its columns are summed over."""
    if o.at - {0} and not (o.at == {1} and o.k == 0):
        return MIXED
    return o.r.dim() - 1 if 1 in o.at else None


def _pairwise(o: _Operand) -> int | None:
    """``cdist(x1, x2)``: x1's rows go to the result's rows, x2's to its columns; features summed over."""
    if o.last or (o.at >= {0, 1} and o.k == o.rank - 2):
        return MIXED
    return o.r.dim() - 1 if 1 in o.at and o.k == o.rank - 2 else None


def _renorm(o: _Operand) -> int | None:
    """``renorm(x, p, dim, maxnorm)``: each slice along ``dim`` rescaled by its norm over all other dims."""
    dim = _arg(o.args, o.kwargs, 2, "dim")
    return MIXED if not isinstance(dim, int) or _index(dim, o.rank) != o.k else None


def _embedding_bag(o: _Operand) -> int | None:
    """``embedding_bag``: the table's rows are looked up by every bag; the ids and weights are rows per sample."""
    return MIXED if 1 in o.at or o.kwargs.get("weight") is o.t else None


def _statistics_from(first: int) -> Callable[[_Operand], int | None]:
    """A normalisation of its input by statistics over the dims from ``first`` on (``group_norm``: 1,
    ``instance_norm``: 2)."""
    return lambda o: MIXED if 0 in o.at and o.k >= first else None


def _channels(o: _Operand) -> int | None:
    """``local_response_norm``: across the channels (dim 1); ``conv_tbc``: along time (dim 0), the batch on 1."""
    wrong = o.k == 1 if o.func is F.local_response_norm else o.k != 1
    return MIXED if 0 in o.at and wrong else None


def _inner(o: _Operand) -> int | None:
    """``inner(a, b)``: the last dims summed over; a's other dims, then b's, are the result's."""
    if o.last:
        return MIXED
    if o.at == {0, 1}:  # (inner(h, h): sample i with sample j)
        return MIXED if o.t.shape[o.k] > 1 else o.k
    return max(o.args[0].dim() - 1, 0) + o.k if 1 in o.at else None


def _cross(o: _Operand) -> int | None:
    """``cross(a, b, dim)``: each 3-vector along ``dim`` from both operands' there; without ``dim``, ``torch.cross``
    takes the first dim of size 3, ``linalg.cross`` the last."""
    dim, first = _arg(o.args, o.kwargs, 2, "dim"), o.args[0] if o.args else o.kwargs.get("input")
    if dim is None and o.func in _CROSS_FIRST_OF_3 and isinstance(first, Tensor):  # (of the first operand's dims)
        dim = next((j for j, s in enumerate(first.shape) if s == 3), -1) + o.r.dim() - first.dim()
    return MIXED if _index(-1 if dim is None else dim, o.r.dim()) == o.k + o.r.dim() - o.rank else None


def _laid_in_order(o: _Operand) -> int | None:
    """``masked_scatter(x, mask, source)``, ``put(x, index, source)``: source's elements go, one after another, to
    the places the mask or index picks, so source's rows are not the result's; x's rows stay where they are."""
    return MIXED if 2 in o.at or o.kwargs.get("source") is o.t else None


def _tensordot(o: _Operand) -> int:
    """``tensordot(a, b, dims)``: MIXED where ``dims`` sums over the batch (or cannot be read), else its place among
    the dims kept (a's, then b's)."""
    args, kwargs, at, k = o.args, o.kwargs, o.at, o.k
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("b")
    dims = _arg(args, kwargs, 2, "dims")
    dims = 2 if dims is None else dims
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or len(at & {0, 1}) != 1:
        return MIXED
    summed: tuple[Any, ...]
    try:
        if isinstance(dims, int):
            summed = (range(a.dim() - dims, a.dim()), range(dims))
        else:
            summed = tuple([_index(d, o.dim()) for d in _ints(ds)] for ds, o in zip(dims, (a, b), strict=True))
    except (TypeError, ValueError):  # (dims as tensors, or of another form)
        return MIXED
    side = 0 if 0 in at else 1
    kept = [[d for d in range(o.dim()) if d not in summed[i]] for i, o in enumerate((a, b))]
    if k not in kept[side]:
        return MIXED
    return kept[side].index(k) + (len(kept[0]) if side else 0)


_RULES: dict[Any, Callable[[_Operand], int | None]] = {
    **{f: _product for f in _PRODUCTS}, **{f: _solve for f in _SOLVES}, **{f: _normalised for f in _NORMALISED},
    **{f: _chain for f in _CHAINS}, **{f: _attention for f in _ATTENTION}, **{f: _pairwise for f in _PAIRWISE},
    **{f: _renorm for f in _RENORM}, **{f: _tensordot for f in _TENSORDOT}, **{f: _channels for f in _CONV_TBC},
    F.linear: _linear, F.embedding_bag: _embedding_bag, F.group_norm: _statistics_from(1),
    F.instance_norm: _statistics_from(2), F.local_response_norm: _channels, **{f: _inner for f in _INNER},
    **{f: _cross for f in _CROSS}, **{f: _laid_in_order for f in _LAID_IN_ORDER},
}  # fmt: skip


def _acts_along(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], k: int, rank: int) -> bool:
    """Whether op ``func`` (of ``_ALONG_DIMS``) acts along dim ``k`` of an operand of ``rank`` dims."""
    position, keyword, default = _ALONG_DIMS[func]
    dims = default if position < 0 else _arg(args, kwargs, position, keyword)
    if dims is None:  # (not given, or given as None)
        dims = default
    if dims == -2 and default == -2:  # F.softmax's implicit dim (deprecated): 0 for 0, 1 or 3 dims, else 1
        dims = 0 if rank in (0, 1, 3) else 1
    if dims is None:  # every dim (flattened: roll, take_along_dim)
        return True
    if func in _INDEXED_ALONG and _in_order_index(func, args, kwargs, rank):
        return False
    if func in _PUT:  # (x.index_put((idx, ...), values): values' rows go to the rows idx names)
        index = args[1][0] if len(args) > 1 and isinstance(args[1], tuple | list) and args[1] else None
        return not (
            isinstance(index, Tensor) and index.dim() == 1 and _in_order(index, tuple(index.shape), 0, len(index))
        )
    if not isinstance(dims, int | tuple | list | torch.Size) or isinstance(dims, bool):
        return True  # (a dim given by name, or another overload: not followed)
    return k in {_index(d, rank) for d in _ints(dims)}


def _in_order_index(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rank: int) -> bool:
    """Whether ``index_select``, ``gather`` or ``take_along_dim`` (along the batch dim of ``args[0]``) takes each
    sample from its own row: an index holding ``0, ..., B - 1`` along that dim."""
    index = _arg(args, kwargs, 1 if func in _TAKE_ALONG else 2, "indices" if func in _TAKE_ALONG else "index")
    dim = _arg(args, kwargs, 2 if func in _TAKE_ALONG else 1, "dim")
    x = args[0]
    if not isinstance(index, Tensor) or not isinstance(x, Tensor) or not isinstance(dim, int):
        return False
    k = _index(dim, rank)
    size = x.shape[k]
    if index.dim() == 1:
        return index.shape[0] == size and _in_order(index, (size,), 0, size)
    if index.dim() != rank or index.shape[k] != size:
        return False
    return _counts_in_order(index, k, size) or bool(index.eq(_positions(size, k, rank, index)).all())


def _rows_in_order(item: Any, shape: tuple[int, ...], size: int) -> int | None:
    """The dim ``j`` along which index ``item`` (``shape``) holds ``0, ..., size - 1`` and the same along every
    other dim (the batch's rows in order, materialised), told by its values; None where there is none."""
    index = item if isinstance(item, Tensor) else torch.as_tensor(item)
    for j, n in enumerate(shape):
        try:
            if n == size and bool(index.eq(_positions(size, j, len(shape), index)).all()):
                return j
        except (RuntimeError, NotImplementedError):  # (meta tensors: no values to read)
            return None
    return None


def _positions(size: int, k: int, rank: int, like: Tensor) -> Tensor:
    """``0, ..., size - 1`` along dim ``k`` of a tensor of ``rank`` dims (size 1 elsewhere)."""
    return torch.arange(size, device=like.device, dtype=like.dtype).view([size if d == k else 1 for d in range(rank)])


class _Aranges(threading.local):
    table: WeakTensorKeyDictionary | None = None  # the running forward's (``counting``)


_aranges = _Aranges()


def counting(table: WeakTensorKeyDictionary | None) -> WeakTensorKeyDictionary | None:
    """Make ``table`` the running forward's record of the ``torch.arange(n)`` it made (``counted``); the
    record it replaces, to put back when the forward ends."""
    before, _aranges.table = _aranges.table, table
    return before


def counted(t: Tensor) -> None:
    """Record ``t``, a ``torch.arange(n)`` the running forward just made, as holding ``0, 1, ..., n - 1``
    while its version (``t._version``, shared with its views) stays what it is now."""
    if _aranges.table is not None and not t.is_inference():
        _aranges.table[t] = t._version


def uncounted(t: Tensor) -> None:
    """Forget the record of every arange whose memory ``t`` shares (a view, ``detach()``, ``view(dtype)``, a
    ``Parameter`` made of it): ``t`` is about to be written into past the arange's version counter (``t.data``,
    ``t.numpy()``, its storage, ``set_``)."""
    table = _aranges.table
    if not table:
        return
    try:
        memory = t.untyped_storage().data_ptr()
        for arange in [a for a in table if a.untyped_storage().data_ptr() == memory]:
            del table[arange]
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: every record forgotten)
        table.clear()


def _counts_in_order(index: Tensor, j: int, size: int) -> bool:
    """Whether ``index`` holds ``0, ..., size - 1`` along dim ``j`` and the same along every other dim, told
    without reading its values: it is an arange the running forward made (``counted``) or a view of one
    (``arange(B)[:, None]``, expanded) that starts where the arange does and steps as it does along ``j`` only,
    neither written into since."""
    table = _aranges.table
    if table is None or index.is_inference():
        return False
    base = index if index._base is None else index._base
    version = table.get(base)
    if version is None or version != index._version or base.dim() != 1 or index.shape[j] != size:
        return False
    if index.storage_offset() != base.storage_offset() or size > base.shape[0]:
        return False
    strides = index.stride()
    return strides[j] == base.stride(0) and all(strides[d] == 0 or n == 1 for d, n in enumerate(index.shape) if d != j)


def _in_order(item: Any, shape: tuple[int, ...], j: int, size: int) -> bool:
    """Whether index ``item`` (a tensor or nested list of ints, ``shape``, varying along dim ``j`` only) holds
    ``0, 1, ..., size - 1`` along ``j``: it keeps each sample in its row (``mask[arange(B)[:, None], ids]``).
    An arange the forward made, or a view of one, is told by its layout (``_counts_in_order``); any other
    index by its values (on a GPU, a host sync)."""
    if isinstance(item, Tensor) and _counts_in_order(item, j, size):
        return True
    line = torch.as_tensor(item) if not isinstance(item, Tensor) else item
    if line.dim() != len(shape):
        return False
    line = line[tuple(slice(None) if d == j else 0 for d in range(line.dim()))]
    try:
        return bool(torch.equal(line.remainder(size), torch.arange(size, device=line.device, dtype=line.dtype)))
    except (RuntimeError, NotImplementedError):  # (meta tensors: no values to read)
        return False


def _tensor_items(values: Any) -> Iterator[Tensor]:
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, tuple | list):
            yield from (t for t in v if isinstance(t, Tensor))


def _probe(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    carried: list[tuple[Tensor, int]],
    n: int,
    one: bool,
) -> list[int]:
    """The op run again on meta tensors, each carried operand's batch given a size no other dim has:
    the dim of that size in each of its ``n`` result tensors; MIXED where there is none (summed over) or
    several from two operands (samples paired, unless the batch is ``one`` sample: LOST)."""
    if any(folded(k) for _, k in carried):
        return [LOST] * n
    single = len(carried) == 1  # (one operand with the batch on several dims of the result: diag(v), no pairing)
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
    size = 2 * max([1, *(s for x in leaves for s in x.shape)]) + 11
    dims = {id(t): k for t, k in carried}
    # (dims counted from the right where the batch is; an operand made like the batch, ones_like(h), may broadcast
    # with it there)
    ends = {(t.dim() - k, t.shape[k]) for t, k in carried}

    def meta(x: Any, aligned: bool = False) -> Any:
        if not isinstance(x, Tensor):
            return x
        shape = list(x.shape)
        k = dims.get(id(x))
        if k is not None:
            shape[k] = size
        elif aligned:
            shape = [size if (len(shape) - j, s) in ends else s for j, s in enumerate(shape)]
        return torch.empty(shape, dtype=x.dtype, device="meta")

    others = {n: v for n, v in kwargs.items() if n != "out"}
    try:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            try:
                out = func(*tree_map(meta, args), **tree_map(meta, others))
            except Exception:  # (cosine_similarity(h, ones_like(h), dim=0): the sizes must agree)
                aligned = functools.partial(meta, aligned=True)
                out = func(*tree_map(aligned, args), **tree_map(aligned, others))
    except Exception:  # an op that needs values (masks, nonzero) or sizes given as numbers
        return [LOST] * n
    results = list(_tensor_items((out,)))
    if len(results) != n:
        return [LOST] * n
    found = []
    for r in results:
        at = [j for j, s in enumerate(r.shape) if s == size]
        # (none: summed over, std(0), einsum; several: samples paired, cosine_similarity(h[:, None], h[None]);
        # as_strided: the sizes are its arguments)
        found.append(at[0] if len(at) == 1 else LOST if func in _SHAPED or (at and (one or single)) else MIXED)
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
    if len(carried) == 1 and len(results) == 1 and kind == _KEEP and func not in _BATCH_FIRST:  # (most ops)
        (t, k), r = carried[0], results[0]
        if k >= 0 and r.dim() == t.dim() and not (func is F.linear and (k == t.dim() - 1 or t is not args[0])):
            return [k if r.shape[k] == size else _picked(k, r, size)]
    if any(k == LOST for _, k in carried):
        mixes = func in _MATMUL and any(k >= 0 and _contracts(args, t, k, t.dim()) for t, k in carried)
        return [MIXED if mixes or (size > 1 and r.dim() == 0) else LOST for r in results]
    found: list[int] = []
    probed: list[int] | None = None
    for i, r in enumerate(results):
        if size > 1 and r.dim() == 0:  # (one number from several samples, h.flatten().mean(): all went into it)
            found.append(MIXED)
            continue
        at: set[int] = set()
        for t, k in carried:
            j = _follow(kind, func, args, kwargs, t, k, r, size)
            if j is None:
                if probed is None:
                    probed = _probe(func, args, kwargs, carried, len(results), size == 1)
                j = probed[i]
            at.add(j if j == MIXED or folded(j) or (0 <= j < r.dim() and r.shape[j] == size) else _picked(j, r, size))
        if len(at) == 1:
            found.append(at.pop())
        else:
            found.append(MIXED if MIXED in at or (size > 1 and _paired(at)) else LOST)
    return found


def _paired(at: set[int]) -> bool:
    """Whether operands put the batch on two different dims of a result (``h @ h.T``, ``h[:, None] - h[None]``):
    its entry ``[i, j]`` combines sample ``i`` with sample ``j``."""
    return sum(1 for j in at if j >= 0) > 1


def _picked(j: int, r: Tensor, size: int) -> int:
    """The batch position of result ``r`` where the op put the batch on dim ``j`` but ``r`` has not the batch's
    size there: samples picked out of it (``h[1:]``, ``narrow``, ``chunk``) or added to it (``F.pad``), so a
    tensor rebuilt from it is not the samples in their rows (MIXED); LOST where ``j`` is no dim of ``r``."""
    return MIXED if 0 <= j < r.dim() and size > 1 else LOST


def _laid_out(func: Any, args: tuple[Any, ...], carried: list[tuple[Tensor, int]], n: int) -> list[int]:
    """The batch dims of what an op with a layout of its own returns (``_recurrent``; a
    ``PackedSequence`` padded: ``(data, batch_sizes, batch_first, ...) -> (padded, lengths)``;
    ``F.multi_head_attention_forward``: ``[L, B, E]`` in, ``(out [L, B, E], weights [B, ...])`` out)."""
    if func in _RNN:
        return _recurrent(args, carried, n)
    if func in _PADDED:
        return [0 if args[2] is True else 1, 0][:n]
    attended = [(t, k) for t, k in carried if any(t is x for x in args[:3])]  # (query, key, value)
    if all(k == 1 and t.dim() == 3 for t, k in attended):
        return [1, 0][:n]
    memory = any(t is args[1] or t is args[2] for t, _ in attended) if len(args) > 2 else True
    if not memory and all(k == 0 for _, k in attended):  # (queries of a memory without the batch: their own rows)
        return [0, 0 if args[0].dim() == 2 else 1][:n]
    return [MIXED if any(k >= 0 for _, k in attended) else LOST] * n  # (the batch as positions or features)
