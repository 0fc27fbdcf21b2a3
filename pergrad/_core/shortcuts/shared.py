"""Tensors shared by the batch, and each sample's gradient through them.

Position embeddings look up one row of ids for every sample (``pos(torch.arange(T))``, or
HuggingFace's ``position_ids`` of shape ``[1, T]``); T5 looks up relative-position buckets
``[T, T]``; ViT prepends one learned ``cls_token`` to every sample. Such a layer output or raw
parameter is *shared* by the batch. It meets the batched activations in a broadcasting op
(``x + pos``, ``cls_token.expand(B, -1, -1)``), and autograd's backward of that op sums its
gradient over the samples: the per-sample gradient is gone before any hook on the layer sees it.

So pergrad hands the model a tracked alias of each shared tensor (``Shared``, a tensor subclass).
Ops on shared tensors alone keep the tracking. At the op where a shared tensor meets the batch, it
is expanded to the batch explicitly (a view) before the op runs, and a pre-hook on that
expansion's autograd node catches the gradient before it is summed:
``G[i] = d f_i / d s`` for the shared operand ``s``. One batched ``torch.autograd.grad`` pulls it
back through the ops between the shared layer output (or parameter) and ``s``; for a layer, the
result is each sample's own output gradient ``d_i``, and its rule gives ``g_i = rule(a, d_i)``
with the shared input ``a``; for a raw parameter, it is ``g_i`` itself.

Which layer inputs are shared, given the batch size B of the model's call (``batch_of_call``)
and the batch dim, follows from where the input came from (``Provenance`` follows every op of the
model's forward, for the forwards of each kind until they repeat: ``pergrad._core.shortcuts.followed``),
never from its size alone:

- computed from the model's batched tensor arguments (a view, ``labels[:, :-1]``, a shifted copy
  written in place, a mask): batched, on the dim the forward moved the batch to (``pergrad._core.capture.dims``:
  ``x.transpose(0, 1)`` into sequence-first layers puts it on dim 1; ``located``); without the batch
  on a dim of its own, an error (it was folded);
- derived from a shared tensor (a ``Shared`` input), a parameter, or anything else without the batch
  on the batch dim (its size there is 1, or missing, or another): shared;
- created inside the forward with B on the batch dim (``torch.arange(T)`` with T == B,
  ``torch.zeros(B, T)``, ``sin(arange(T)[:, None] * f)``, a buffer's rows ``table[:T]``): *maybe*
  shared. Its output is tracked until it meets a tensor computed from the batch: broadcast over the
  batch means shared, aligned with its batch dim means batched (then the tracking stops). A shared
  tensor broadcast along such a dim before either met the batch is caught there for the case
  that dim turns out to be the batch (``_defer``). Where an op cannot tell (``einsum``), or the
  output reaches the loss undecided, pergrad raises.

Code whose ops the mode does not see (TorchScript) hands the model tensors it never saw: one with
autograd history that reaches a layer or meets a shared tensor is refused (``UNTRACKED``). Under
``torch.compile`` pergrad's hooks, this mode and ``Shared`` are never traced: the model's forward runs
eagerly, so every op is seen.

Outside the model's forward (a submodule called on its own, recomputation under checkpointing)
nothing is followed: a layer input with autograd history or a float one that is not a buffer
counts as batched by its size (on the dim the forward's calls of the layer had it, for a
recomputation: ``LayerHooks._placed_before``), and nothing there counts as evidence that resolves a
*maybe* (which then raises at the backward).

A shared tensor that meets the batch in an op pergrad does not know how to split (``F.linear``
with a shared weight, indexing) raises an error that names the op and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.rnn
import torch.nn.utils.rnn
from torch import Tensor
from torch._C import DisableTorchFunctionSubclass
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from pergrad._core.capture.dims import (
    LOST,
    MIXED,
    attribute_dim,
    carries,
    counted,
    counting,
    folded,
    out_of_order,
    result_dims,
    torch_functions,
    uncounted,
    written,
)
from pergrad._core.shortcuts.followed import Stepped, dynamo_callback, eager_hook, never_traced, without_dynamo
from pergrad.errors import EAGER, BatchMixingError, BatchSizeError, SharedInputError


class _Local(threading.local):
    # defaults for every thread (a missing attribute would raise, slowly, at every hook)
    pulling = False
    provenance: Provenance | None = None  # the running forward's (see ``Provenance``)


_local = _Local()


def pulling() -> bool:
    """Whether a per-sample pull-back runs now (the hooks it passes through must stay quiet)."""
    return _local.pulling


@contextmanager
def pulling_back() -> Iterator[None]:
    """Run a per-sample pull-back (``pulling()`` is True inside)."""
    before = pulling()
    _local.pulling = True
    try:
        yield
    finally:
        _local.pulling = before


@dataclass
class Group:
    """What a set of tracked tensors turned out to be: ``"maybe"`` until known, then ``"shared"``
    (broadcast over the batch) or ``"batched"`` (it had the batch after all)."""

    state: str
    batch: int  # B
    dim: int  # where the batch is in the activations
    # groups broadcast along this one's batch-sized dim before either met the batch: shared if this
    # one turns out batched (see ``_defer``)
    then_shared: list[Group] = field(default_factory=list)


@dataclass(eq=False)
class Origin:
    """A shared layer output or raw parameter, as the model sees it (``tensor``, an alias)."""

    tensor: Tensor
    deliver: Callable[[Tensor], None]  # takes d f_i / d tensor for every sample: [B, *tensor.shape]
    group: Group
    label: str  # for messages: "layer 'pos' (Embedding)"
    delivered: int = 0  # meetings whose per-sample gradient arrived in this backward
    # a stand-in for ``parent`` in the tensors computed from a ``_defer`` expansion of it: void
    # once any of ``unless`` turns out batched (its per-sample gradient is delivered there)
    parent: Origin | None = None
    unless: tuple[Group, ...] = ()
    # where the pull-back ends (``aliased``): the gradient edge of what the alias was made of, as it was
    # then (an in-place op on the alias, ``out.mul_(s)``, moves the alias's own edge past the op)
    edge: GradientEdge | None = None
    version: int = -1  # the alias's version counter when made

    def aliased(self, alias: Tensor, source: Tensor) -> None:
        """Hand the model ``alias`` (``tensor``) for ``source``: each sample's gradient is pulled back to
        ``source``'s gradient edge as it is now."""
        self.tensor, self.edge = alias, get_gradient_edge(source)
        with DisableTorchFunctionSubclass():
            self.version = alias._version

    def untouched(self, x: Tensor) -> bool:
        """Whether ``x`` is the alias, with no in-place op on it (or on its memory) since it was made."""
        with DisableTorchFunctionSubclass():
            return x is self.tensor and x._version == self.version

    def live(self) -> bool:
        """Whether this origin still needs its per-sample gradient caught downstream."""
        return self.group.state != "batched" and not any(g.state == "batched" for g in self.unless)


def _roots(origins: list[Origin]) -> list[Origin]:
    """``origins`` with stand-ins replaced by the origins they stand for (each once)."""
    return list(dict.fromkeys(o.parent or o for o in origins))


@dataclass(frozen=True)
class BatchInfo:
    """The batch of one call of the model."""

    size: int
    dim: int
    storages: frozenset[int]  # data pointers of the storages of the call's tensor arguments
    buffers: Callable[[], frozenset[int]] = field(compare=False)  # those of the model's buffers

    def from_inputs(self, t: Tensor) -> bool:
        return _storage(t) in self.storages


def _storage(t: Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return -1


def batch_of_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, buffers: Callable[[], frozenset[int]]
) -> BatchInfo | None:
    """The batch of a model call (None: no tensor argument has a batch dim ``dim``): that of the model's
    input, its first positional argument, where all are tensors and it has the batch dim (the common call,
    without pytree's walk), else ``_batch_of_leaves``'s."""
    if not kwargs and args and all(isinstance(a, Tensor) for a in args) and args[0].dim() > dim:
        return BatchInfo(args[0].shape[dim], dim, frozenset(_storage(t) for t in args), buffers)
    return _batch_of_leaves(args, kwargs, dim, buffers)


def _batch_of_leaves(
    args: tuple[Any, ...], kwargs: dict[str, Any], dim: int, buffers: Callable[[], frozenset[int]]
) -> BatchInfo | None:
    """The batch of a model call, from every tensor in its arguments.

    The model's input, its first positional argument (``forward(input, ...)``), gives the batch size
    where it has the batch dim: the others may be shared by the samples (a mask ``[T, T]``, an
    initial state ``[layers, B, H]``). A call without one (keywords only, whose order means
    nothing) is decided by every tensor argument's size on the batch dim: those other than 1 (a
    size of 1 broadcasts over the batch, like ``position_ids`` of shape ``[1, T]``) must agree, or
    the call is refused. A ``PackedSequence``'s batch size is its ``batch_sizes[0]``.
    """
    if not kwargs and args and all(isinstance(a, Tensor) for a in args):
        leaves = list(args)
    else:
        leaves = tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, PackedSequence))[0]
    tensors = [t.data if isinstance(t, PackedSequence) else t for t in leaves if isinstance(t, Tensor | PackedSequence)]
    storages = frozenset(_storage(t) for t in tensors)
    first = args[0] if args else None
    if isinstance(first, PackedSequence):
        return BatchInfo(int(first.batch_sizes[0]), dim, storages, buffers)
    if isinstance(first, Tensor) and first.dim() > dim:
        return BatchInfo(first.shape[dim], dim, storages, buffers)
    sizes = [_batch_size(t, dim) for t in leaves if isinstance(t, Tensor | PackedSequence)]
    found = {size for size in sizes if size is not None}
    if not found:
        return None
    if len(found - {1}) > 1:
        flat = tree_flatten_with_path((args, kwargs), is_leaf=lambda x: isinstance(x, PackedSequence))[0]
        named = [f"{_argument(path)} ({_batch_size(t, dim)})" for path, t in flat if _batch_size(t, dim) is not None]
        raise BatchSizeError(
            f"the model was called with tensors that disagree on the batch size (their sizes on dim {dim}: "
            f"{', '.join(named)}), and without a positional input that says which is the batch. Pass the batched "
            "input as the model's first positional argument (model(ids, mask=...)), or give the tensors shared by "
            f"every sample size 1 on dim {dim}."
        )
    return BatchInfo(max(found), dim, storages, buffers)


def _batch_size(t: Any, dim: int) -> int | None:
    """The size of ``t`` on the batch dim, if it has one (a PackedSequence's ``batch_sizes[0]``)."""
    if isinstance(t, PackedSequence):
        return int(t.batch_sizes[0])
    return t.shape[dim] if isinstance(t, Tensor) and t.dim() > dim else None


def _argument(path: tuple[Any, ...]) -> str:
    """How messages name an argument of a model call from its pytree path ``((args, kwargs), ...)``."""
    where = path[1:]
    if not where:
        return "an argument"
    head = where[0]
    name = f"argument {head.idx}" if path[0].idx == 0 else repr(getattr(head, "key", head))
    return name + "".join(str(k) for k in where[1:])


UNTRACKED = (
    "computed by code whose ops pergrad does not see run (TorchScript: a torch.jit.script or torch.jit.trace "
    "function or module, whose ops run outside Python; or a tensor with autograd history made before this call of "
    "the model), so pergrad cannot tell whether or where it carries the batch. Call the plain Python function or "
    "module instead of its scripted or traced form inside the wrapped model, or pass such a tensor to the model "
    "as an argument"
)


def located(a: Any, dim: int, size: int, where: str, fixed: bool) -> int:
    """The batch dim of a layer's input ``a`` in this call: where the model's forward put it
    (``Provenance``: ``x.transpose(0, 1)`` puts it on dim 1), else the wrapper's ``dim``. ``fixed``: the
    layer takes the batch on ``dim`` only (a convolution's ``N``); elsewhere is an error."""
    found = provenance()
    if found is None or not isinstance(a, Tensor) or isinstance(a, Shared):
        data = getattr(a, "data", None)  # (a PackedSequence: its data holds the samples' rows)
        if found is not None and isinstance(data, Tensor) and found.lost_by(data).startswith(_MIXING):
            _refuse_lost(found, data, dim, size, where)
        return dim
    at = found.where(a)
    if at == UNSEEN and a.grad_fn is not None:
        raise BatchSizeError(f"{where} got an input of shape {tuple(a.shape)} " + UNTRACKED + ".")
    if at == LOST:  # an op pergrad could not follow: where the shape cannot tell either, an error
        _refuse_lost(found, a, dim, size, where)
        return dim
    if at < 0 or at == dim:
        return dim
    if fixed:
        raise _off_fixed_dim(a, dim, at, where)
    return at


def _off_fixed_dim(a: Tensor, dim: int, at: int, where: str) -> BatchSizeError:
    """The error for a layer that takes the batch on ``dim`` only, called with it on dim ``at``."""
    return BatchSizeError(
        f"{where} takes the batch on dim {dim} of its input, but the model's forward moved it to dim {at} "
        f"(input shape {tuple(a.shape)}, e.g. by x.transpose(0, 1)): the layer would mix the samples. Move the "
        f"batch back before calling it (x.movedim({at}, {dim}))"
    )


_MIXING = "\0mixing "  # ``Provenance.lost_by`` of a tensor whose samples an op reordered or mixed: this, the op


def _refuse_lost(found: Provenance, a: Tensor, dim: int, size: int, where: str) -> None:
    """``a`` carries the batch on a dim pergrad did not follow: refused where its shape cannot tell either
    (several dims of the batch's size, ``dim`` among them), or where an op reordered or mixed its samples."""
    after = found.lost_by(a)
    if after.startswith(_MIXING):
        raise BatchMixingError(
            f"{where} got an input of shape {tuple(a.shape)} computed from the batch after the op "
            f"{after[len(_MIXING) :]} reordered or mixed the samples along the batch dim (x[perm], flip, roll, "
            "index_select, gather, sort, cumsum, softmax or a statistic such as x.mean(0) over the batch): its row i "
            "is not sample i alone, so per-sample gradients would go to the wrong samples. Reorder the batch before "
            "it reaches the model (in the DataLoader or the training step), keep each sample in its row inside the "
            "forward (pack_padded_sequence(..., enforce_sorted=False) sorts and unsorts by itself; a normalisation "
            "per sample, not over the batch), or register a rule for the module that does this "
            "(pergrad.register_rule)"
        )
    same = [j for j, s in enumerate(a.shape) if s == size]
    if size > 1 and len(same) > 1 and dim in same:
        raise BatchSizeError(
            f"{where} got an input of shape {tuple(a.shape)} computed from the batch, but pergrad lost track of "
            f"where the batch is in it{f' at the op {after}' if after else ''}, and its dims {same} all have the "
            f"batch's size {size}. Move the batch with ops pergrad follows (transpose, permute, movedim, view, "
            "reshape, basic indexing), or keep it on its own dim"
        )


def classify(a: Any, output: Tensor, dim: int, batch: BatchInfo, where: str) -> Group | None:
    """The group of a layer call on input ``a`` with ``output`` (batch on ``dim``, as ``located``
    finds it), or None where it is an ordinary batched call. See the module docstring."""
    if isinstance(a, Shared):
        live = [o for o in a.origins if o.live()]
        return live[0].group if live else None
    if not isinstance(a, Tensor):
        return None
    size, a_shape, out_shape = batch.size, a.shape, output.shape
    has_batch = len(out_shape) > dim and out_shape[dim] == size and len(a_shape) > dim and a_shape[dim] == size
    found = provenance()
    carried = a.grad_fn is not None if found is None else found.carries(a)  # outside the forward: by its history
    if carried:
        if not has_batch and not (size == 1 and len(out_shape) > dim and out_shape[dim] == 1):
            raise _folded(a, size, dim, where, found)
        return None
    if not has_batch or (isinstance(a, torch.nn.Parameter) and not batch.from_inputs(a)):
        return Group("shared", size, dim)
    return _maybe(a, dim, batch, found is None)


def _maybe(a: Tensor, dim: int, batch: BatchInfo, unfollowed: bool) -> Group | None:
    """``classify``'s group for an input ``a`` with the batch's size on ``dim`` that carries no batch
    (``unfollowed``: outside the model's forward): "maybe" batched, or None (an ordinary batched call)."""
    size = batch.size
    if size == 1 or batch.from_inputs(a) or a.stride(dim) == 0:
        return None
    if unfollowed and a.is_floating_point() and _storage(a) not in batch.buffers():
        return None
    return Group("maybe", size, dim)


def per_sample_input(a: Tensor, output: Tensor, dim: int, size: int) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The shared input as a batch ``[B, ...]`` for the layer's rule, and how a pulled-back gradient
    ``[B, *output.shape]`` becomes the per-sample output gradient the rule expects (batch first)."""
    if a.dim() > dim and a.shape[dim] == 1 and output.dim() > dim and output.shape[dim] == 1:
        rest = (*output.shape[:dim], *output.shape[dim + 1 :])
        return a.movedim(dim, 0).expand(size, *a.movedim(dim, 0).shape[1:]), lambda g: g.reshape(size, *rest)
    return a.unsqueeze(0).expand(size, *a.shape), lambda g: g


# -- the tracked tensor ---------------------------------------------------------------------------


_ELEMENTWISE = torch_functions(
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "true_divide", "true_divide_",
    "where", "masked_fill", "lerp", "addcmul", "addcdiv", "maximum", "minimum", "pow", "pow_", "atan2",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__", "__rmul__", "__imul__",
    "__truediv__", "__rtruediv__", "__itruediv__",
)  # fmt: skip
_MATMUL = torch_functions("matmul", "__matmul__", "__rmatmul__")
_EXPAND = torch_functions("expand", "expand_as", "broadcast_to", "repeat")
_SDPA = {torch.nn.functional.scaled_dot_product_attention}
_F = torch.nn.functional
_LAYER_OPS = {
    _F.linear, _F.conv1d, _F.conv2d, _F.conv3d, _F.conv_transpose1d, _F.conv_transpose2d, _F.conv_transpose3d,
    _F.layer_norm, _F.group_norm, _F.rms_norm, _F.embedding, _F.instance_norm,
}  # fmt: skip
_NEW = torch_functions(
    "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "zeros_like", "ones_like", "empty_like"
)
_GRAD = {torch.autograd.grad, torch.autograd.backward, Tensor.backward}
_LIKE = torch_functions("to", "type_as")
_VIEW_ATTRIBUTES = {getattr(Tensor, name).__get__ for name in ("T", "mT", "H", "mH")}
# what writes into a tensor past its version counter: the arange it is (or is a view of) counts no more
_PAST_VERSION = {
    *torch_functions("numpy", "untyped_storage", "storage", "_typed_storage", "__dlpack__", "__array__"),
    Tensor.data.__get__,  # type: ignore[attr-defined]
    Tensor.data.__set__,  # type: ignore[attr-defined]
}
_COUNTING = {torch.arange, *_PAST_VERSION}
_INTEGERS = {torch.int64, torch.int32, torch.int16, torch.int8}


def _plain(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class Shared(Tensor):
    """A tensor shared by the batch, tracked until it meets the batch (see the module docstring)."""

    origins: tuple[Origin, ...]

    @classmethod
    @torch.compiler.disable(reason=EAGER)  # (a compiled model runs eagerly under it)
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # conversions (the other tensor gives only its dtype or device) and x.T, x.mT: x's own tracking
        if func in _LIKE or func in _VIEW_ATTRIBUTES:
            own = args[0].origins if isinstance(args[0], Shared) else ()
            return _wrap(_plain(func, args, kwargs), [o for o in own if o.live()])
        if func in _GRAD or func in _NEW or getattr(func, "__name__", "") == "__get__":
            return _plain(func, args, kwargs)  # autograd, fresh tensors, attributes (shape, grad_fn, _base)
        flat = tree_flatten((args, kwargs))[0]
        tracked = [t for t in flat if isinstance(t, Shared)]
        origins = list(dict.fromkeys(o for t in tracked for o in t.origins if o.live()))
        if not origins:
            return _plain(func, args, kwargs)
        if func in _ELEMENTWISE or func in _MATMUL or func in _SDPA:
            return _meet(func, args, kwargs, flat, origins)
        if func in _EXPAND and isinstance(args[0], Shared):
            return _expand(func, args, kwargs, origins)
        return _unknown(func, args, kwargs, flat, origins)


def track(t: Tensor, origins: list[Origin]) -> Tensor:
    """``t`` as a ``Shared`` tensor of ``origins`` (an alias: same values, same autograd history)."""
    with DisableTorchFunctionSubclass():
        out = t.as_subclass(Shared)
    out.origins = tuple(origins)
    return out


def _wrap(result: Any, origins: list[Origin]) -> Any:
    """The tensors of an op's result, tracked as derived from ``origins``."""
    if not origins:
        return result
    if isinstance(result, Shared):
        result.origins = tuple(dict.fromkeys((*result.origins, *origins)))  # an in-place op's self
        return result
    if isinstance(result, Tensor):
        return track(result, origins) if result.is_floating_point() or result.is_complex() else result
    if isinstance(result, tuple | list) and any(isinstance(x, Tensor) for x in result):
        return type(result)([_wrap(x, origins) for x in result])
    return result


def _label(origins: list[Origin]) -> str:
    return ", ".join(dict.fromkeys(o.label for o in origins))


def _batch_evidence(flat: list[Any], group: Group, aligned: Callable[[Tensor], int | None]) -> bool:
    """Whether an untracked tensor operand computed from the batch (``Provenance``) has it where
    ``aligned`` puts the batch dim (None: wherever the operand has it). Outside the model's forward
    nothing is known to carry it."""
    found = provenance()
    if found is None:
        return False
    for t in flat:
        if not isinstance(t, Tensor) or isinstance(t, Shared):
            continue
        at = found.where(t)
        if at == UNSEEN and t.grad_fn is not None:
            raise BatchSizeError(
                f"{_label([o for o in _tracked_origins(flat) if o.live()])} is shared by the batch, and it meets a "
                f"tensor of shape {tuple(t.shape)} " + UNTRACKED + "."
            )
        if not carries(at):
            continue
        k = aligned(t)
        if k is None:
            k = at if at >= 0 else group.dim
        if 0 <= k < t.dim() and t.shape[k] == group.batch and t.stride(k) != 0 and (at in (k, LOST) or folded(at)):
            return True
    return False


def _tracked_origins(flat: list[Any]) -> list[Origin]:
    """The origins of the tracked tensors among ``flat``."""
    return list(dict.fromkeys(o for t in flat if isinstance(t, Shared) for o in t.origins))


def _meeting_dim(flat: list[Any], group: Group, rank: int) -> int:
    """Where the batch is in the result (``rank`` dims) of a broadcasting op: where the operands
    computed from the batch have it (aligned from the right; ``Provenance``), else the group's dim."""
    found = provenance()
    if found is None:
        return group.dim
    dims = set()
    for t in flat:
        if isinstance(t, Tensor) and not isinstance(t, Shared) and (at := found.where(t)) >= 0:
            dims.add(at + rank - t.dim())
    return dims.pop() if len(dims) == 1 else group.dim


def _out_shape(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    try:
        if func in _MATMUL:
            x, y = (args[1], args[0]) if func is Tensor.__rmatmul__ else (args[0], args[1])
            if not (isinstance(x, Tensor) and isinstance(y, Tensor) and x.dim() >= 2 and y.dim() >= 2):
                return None
            batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
            return (*batch, x.shape[-2], y.shape[-1])
        if func in _SDPA:
            q = args[0]
            return tuple(q.shape)
        return tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except (RuntimeError, IndexError):
        return None


def _defer(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    origins: list[Origin],
    rank: int,
    aligned: Callable[[Tensor], int],
) -> Any:
    """A broadcasting op without an operand computed from the batch: its result stays tracked.

    Where it broadcasts a tracked tensor S along the batch-sized dim of one that may carry the batch
    (M, ``"maybe"``: ``pos(arange(T)) + seg(torch.zeros(B, T))``), that dim is the batch exactly when
    M turns out batched. So S is expanded along it here, its hook delivering each sample's gradient
    only in that case (S's group is then shared); the result tracks S, through a stand-in, only for
    the other case, where the broadcast was over positions and S meets the batch later."""
    group = origins[0].group
    if func in _MATMUL and group.dim >= rank - 2:  # the batch-sized dim is a matrix dim: not a broadcast
        return _wrap(_plain(func, args, kwargs), origins)
    spread: list[Shared] = []
    maybe: list[Origin] = []
    for x in tree_flatten((args, kwargs))[0]:
        if not isinstance(x, Shared):
            continue
        live = [o for o in x.origins if o.live()]
        k = aligned(x)
        if live and (k < 0 or x.shape[k] == 1):
            spread.append(x)
            continue
        direct = [o for o in live if not o.unless]  # (stand-ins of earlier deferrals: broadcast along it)
        if direct and x.shape[k] == group.batch and all(o.group.state == "maybe" for o in direct):
            maybe += direct
    if not (spread and maybe):
        return _wrap(_plain(func, args, kwargs), origins)
    when = tuple({id(o.group): o.group for o in maybe}.values())
    stand_ins: dict[int, Origin] = {}
    for x in spread:
        for o in x.origins:
            if o.live() and id(o) not in stand_ins:
                root = o.parent or o
                stand_ins[id(o)] = dataclasses.replace(o, delivered=0, parent=root, unless=(*o.unless, *when))
                for g in when:
                    g.then_shared.append(o.group)

    def replace(x: Any) -> Any:
        if any(x is y for y in spread):
            return _expanded(x, _roots([o for o in x.origins if o.live()]), rank, when=when)
        return x

    result = _plain(func, tree_map(replace, args), tree_map(replace, kwargs))
    return _wrap(result, [stand_ins.get(id(o), o) for o in origins])


def _meet(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], origins: list[Origin]
) -> Any:
    """A broadcasting op (elementwise, matmul, attention mask) with tracked operands."""
    group = origins[0].group
    out = _out_shape(func, args, kwargs)
    rank = 0 if out is None else len(out)
    dim = _meeting_dim(flat, group, rank)
    if out is None or rank <= dim or out[dim] != group.batch:
        return _wrap(_plain(func, args, kwargs), origins)  # no batch in the result: still shared

    def aligned(t: Tensor) -> int:
        return dim - (rank - t.dim())

    if not _batch_evidence(flat, group, aligned):  # only shared tensors and constants: still shared
        return _defer(func, args, kwargs, origins, rank, aligned)
    if func in _MATMUL and dim == rank - 2:
        left, right = (args[1], args[0]) if func is Tensor.__rmatmul__ else (args[0], args[1])
        if isinstance(right, Shared) and isinstance(left, Tensor) and not isinstance(left, Shared) and left.dim() >= 2:
            return _row_matmul(left, right)

    def replace(x: Any) -> Any:
        if not isinstance(x, Shared):
            return x
        live = [o for o in x.origins if o.live()]
        if not live:
            return x
        k = aligned(x)
        if k < 0 or x.shape[k] == 1:  # broadcast over the batch: it meets the batch here
            for o in live:
                o.group.state = "shared"
            return _expanded(x, _roots(live), rank, dim)
        return _aligned_with_batch(x, live, k, func, group)

    return _plain(func, tree_map(replace, args), tree_map(replace, kwargs))


def _row_matmul(left: Tensor, right: Shared) -> Tensor:
    """``left @ right`` where the batch is the rows of the left operand ([T, B, r] @ [r, D], [B, r] @ [r, D]):
    each row made a matrix of its own, so the batch is a broadcast dim the shared operand expands along."""
    with DisableTorchFunctionSubclass():
        rows = left.unsqueeze(-2)
    found = provenance()
    if found is not None:  # (ops inside an op the mode sees are not seen again)
        found.mark(rows, found.where(left))
    out_rows = torch.matmul(rows, right)
    with DisableTorchFunctionSubclass():
        return out_rows.squeeze(-2)


def _aligned_with_batch(x: Shared, live: list[Origin], k: int, func: Callable[..., Any], group: Group) -> Any:
    """A tracked operand ``x`` whose dim ``k`` lines up with the batch dim of an operand that carries the
    batch: its ``"maybe"`` groups turn out batched (``x`` itself then, untracked where no origin is left);
    any other is refused."""
    direct = [o for o in live if not o.unless]  # (stand-ins: broadcast along this dim, see _defer)
    maybe = [o for o in direct if o.group.state == "maybe"]
    if maybe and len(maybe) == len(direct):  # aligned with the batch of an operand that carries it
        for o in maybe:
            o.group.state = "batched"
            for spread in o.group.then_shared:
                if spread.state == "maybe":
                    spread.state = "shared"
        if not any(o.live() for o in live):
            return x
    if maybe:
        raise SharedInputError(
            f"{_label([o for o in live if o.live() and o not in maybe])} is shared by the batch, and it was "
            f"combined with {_label(maybe)}, whose input was created inside the forward (not computed from the "
            f"model's inputs) with {group.batch} on the batch dim, before either met the batch: pergrad cannot "
            "tell whether that dim is the batch. If that input is the same for every sample, give it a batch "
            "dim of size 1 (ids[None]); if it is one row per sample, pass it to the model as an argument."
        )
    raise SharedInputError(
        f"{_label(live)} is shared by the batch (its input or parameter has no batch dim), but {func.__name__} "
        f"combines its dim {k} of size {x.shape[k]} with the batch dim of the other operands: pergrad cannot "
        "tell samples from positions there. Give the shared tensor a batch dim of size 1 (e.g. ids[None]) "
        "so that it broadcasts over the batch."
    )


def _expanded(
    x: Shared, origins: list[Origin], rank: int, dim: int | None = None, when: tuple[Group, ...] = ()
) -> Tensor:
    """``x`` expanded to the batch explicitly (rank ``rank``, batch on ``dim``, by default the
    group's), with a hook that catches each sample's gradient before the expansion's backward sums it
    (only where every group of ``when`` turned out batched: see ``_defer``)."""
    group = origins[0].group
    dim = group.dim if dim is None else dim
    new = rank - x.dim()
    # leading dims added by expand itself, as broadcasting adds them: its backward sums them into a new
    # tensor. (A reshape to the rank first would, at a batch of one, pass x the op's output gradient
    # itself, which autograd hands other operands too: two parameters' AccumulateGrad would make their
    # .grad of the same memory, and the next backward would add each one's gradient into both.)
    sizes = [group.batch if i == dim else 1 if i < new else -1 for i in range(rank)]
    with DisableTorchFunctionSubclass():
        expanded = x.expand(*sizes)
    shape, size = tuple(x.shape), group.batch
    # x as it is at this meeting (an in-place op on x later moves its own edge past the op)
    source, direct = get_gradient_edge(x), len(origins) == 1 and origins[0].untouched(x)

    @eager_hook
    def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
        g = grad_outputs[0]
        if g is None or pulling() or not all(group.state == "batched" for group in when):
            return
        _pull_back(source, direct, origins, g.movedim(dim, 0).reshape(size, *shape))

    assert expanded.grad_fn is not None
    expanded.grad_fn.register_prehook(catch)
    return expanded


def _through_graph(
    source: GradientEdge, origins: list[Origin], grads: Tensor, second: bool
) -> tuple[Tensor | None, ...]:
    """Each origin's per-sample gradient, ``grads`` carried back from ``source`` to the origins' aliases
    through the ops between them (in one batched ``torch.autograd.grad``)."""
    ends = [o.edge for o in origins if o.edge is not None]
    assert len(ends) == len(origins), "every origin's alias is made by ``Origin.aliased``"
    with pulling_back(), DisableTorchFunctionSubclass():
        return torch.autograd.grad(
            [source],
            ends,
            [grads],
            retain_graph=True,
            create_graph=second,
            allow_unused=True,
            is_grads_batched=True,
        )


def _pull_back(source: GradientEdge, direct: bool, origins: list[Origin], grads: Tensor) -> None:
    """Hand every origin its per-sample gradient, from ``grads`` = d f_i / d x, with ``source`` the
    gradient edge of the shared operand x where it met the batch (``direct``: x is the one origin's
    untouched alias), differentiable in a backward with ``create_graph=True`` (grad mode on)."""
    second = torch.is_grad_enabled()
    found = (grads,) if direct else _through_graph(source, origins, grads, second)
    for origin, g in zip(origins, found, strict=True):
        if g is not None:
            if g.shape[1:] != origin.tensor.shape:  # the edge of the base the layer's output is a view of
                g = g.reshape(len(g), *origin.tensor.shape)
            origin.delivered += 1
            origin.deliver(g if second else g.detach())


def _expand(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], origins: list[Origin]) -> Any:
    """``expand``/``broadcast_to``/``expand_as``/``repeat`` of a tracked tensor: where it gives the
    tensor the batch, that is where it meets the batch."""
    x = args[0]
    group = origins[0].group
    result = _plain(func, args, kwargs)
    out = tuple(result.shape)
    rank = len(out)
    k = group.dim - (rank - x.dim())
    if rank <= group.dim or out[group.dim] != group.batch or (0 <= k < x.dim() and x.shape[k] != 1):
        return _wrap(result, origins)  # the batch is not what this expansion adds
    for o in origins:
        o.group.state = "shared"
    expanded = _expanded(x, _roots(origins), rank)
    if func in torch_functions("repeat"):  # the batch factor is done: repeat the other dims as asked
        factors = [1 if i == group.dim else s // max(e, 1) for i, (s, e) in enumerate(zip(out, expanded.shape))]
        with DisableTorchFunctionSubclass():
            return expanded.repeat(*factors)
    with DisableTorchFunctionSubclass():
        return expanded.expand(out)


_EMBEDDING = inspect.signature(_F.embedding)


def _embedding(args: tuple[Any, ...], kwargs: dict[str, Any], origins: list[Origin]) -> Tensor:
    """``F.embedding(ids, weight)`` with batched ids and a shared weight (peft's LoRA on an
    embedding looks its ``lora_embedding_A`` up this way): each sample looks its rows up in its own
    view of the weight, ``out[i] = weight_i[ids[i]]`` with ``weight_i`` the weight expanded to the
    batch, so the expansion's hook catches ``d f_i / d weight`` (rows outside sample i's ids: 0;
    the row at ``padding_idx``: 0, as autograd gives it)."""
    bound = _EMBEDDING.bind(*args, **kwargs)
    bound.apply_defaults()
    ids, weight, padding_idx = bound.arguments["input"], bound.arguments["weight"], bound.arguments["padding_idx"]
    if bound.arguments["max_norm"] is not None or bound.arguments["scale_grad_by_freq"]:
        raise SharedInputError(
            f"{_label(origins)} is shared by the batch and looked up by F.embedding with max_norm or "
            "scale_grad_by_freq, which make each sample's output or gradient depend on the whole batch: "
            "pass max_norm=None and scale_grad_by_freq=False."
        )
    group = origins[0].group
    live = [o for o in weight.origins if o.live()]
    for o in live:
        o.group.state = "shared"
    per_sample = _expanded(weight, _roots(live), weight.dim() + 1, dim=0)  # [B, V, D]
    found = provenance()
    at = LOST if found is None else found.where(ids)
    dim = at if at >= 0 else group.dim
    with DisableTorchFunctionSubclass():
        ids_b = ids.movedim(dim, 0)
        samples = torch.arange(group.batch, device=ids.device).view(-1, *([1] * (ids_b.dim() - 1)))
        out = per_sample[samples, ids_b]  # [B, *ids_b.shape[1:], D]
        if padding_idx is not None:
            pad = padding_idx if padding_idx >= 0 else padding_idx + weight.shape[0]
            out = torch.where((ids_b == pad).unsqueeze(-1), out.detach(), out)
        return out.movedim(0, dim)


def _unknown(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], flat: list[Any], origins: list[Origin]
) -> Any:
    """Any other op: fine among shared tensors and constants; an error where it meets the batch."""
    group = origins[0].group
    candidates = flat
    if func in _LAYER_OPS:  # weights never carry the batch: only the layer's input can
        candidates = [args[0]] if args else []
    if _batch_evidence(candidates, group, lambda t: None):
        return _unknown_meets_batch(func, args, kwargs, origins)
    return _wrap(_plain(func, args, kwargs), origins)


def _unknown_meets_batch(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], origins: list[Origin]
) -> Any:
    """An op ``_unknown`` met with the batch: ``F.embedding`` of batched ids in a shared weight is split per
    sample (``_embedding``); any other is refused."""
    if func is _F.embedding and len(args) > 1 and isinstance(args[1], Shared) and not isinstance(args[0], Shared):
        return _embedding(args, kwargs, origins)
    group = origins[0].group
    name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    maybe = [o for o in origins if o.group.state == "maybe"]
    if maybe:
        raise SharedInputError(
            f"{_label(maybe)} got an input created inside the forward (not computed from the model's inputs) "
            f"with {group.batch} on the batch dim, and its output meets the batch in {name}, which does not "
            "show whether that dim is the batch. Write that op as a broadcasting one (+, *, matmul, where, "
            "expand: h @ pos.mT for einsum('btd,sd->bts', h, pos)), or, if that input is one row per sample, "
            "pass it to the model as an argument."
        )
    raise SharedInputError(
        f"{_label(origins)} is shared by the batch (it has no batch dim), and it meets the batch in {name}, "
        "which pergrad cannot split per sample (it splits broadcasting ops: +, *, matmul, where, expand, "
        "attention masks). Register a rule for the module that does this (pergrad.register_rule), or pass "
        "fallback=True to PerSampleModule."
    )


# -- which tensors carry the batch ----------------------------------------------------------------

_IN_PLACE_DUNDERS = frozenset(
    f"__{op}__"
    for op in (
        "setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
        "iand", "ior", "ixor", "ilshift", "irshift",
    )
)  # fmt: skip


def _writes_into_first(name: str) -> bool:
    """Whether an op writes into its first argument (``x.add_(y)``, ``x[i] = y``, ``x += y``)."""
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _tensors(values: Any) -> Iterator[Tensor]:
    """The tensors among ``values`` and in the lists and tuples among them (``torch.cat([x, y])``)."""
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, list | tuple):
            yield from (t for t in v if isinstance(t, Tensor))


SEEN = -2  # ``Provenance.where``: seen computed in the forward, without the batch
UNSEEN = -3  # ``Provenance.where``: never seen (held before the call, or computed by code the mode does not see)


class Provenance(Stepped):
    """Which tensors of one forward of the model carry the batch, by where they came from, and on which dim.

    The model's tensor arguments with the batch on the batch dim carry it, and so does every tensor
    an op computes from one of them (``labels[:, :-1]``, ``ids != pad``, ``x.clone()``,
    ``torch.cat``, ``masked_fill``), or writes into in place from one (``shifted[:, 1:] =
    labels[:, :-1]`` makes ``shifted`` carry it). Tensors created inside the forward
    (``torch.arange(T)``, ``torch.ones``, ``x.new_zeros(...)``, ``torch.zeros_like(x)``: their
    values do not come from ``x``), buffers and their slices, parameters, and what ops compute from
    those alone do not, whatever their size. Where an op moves the batch to another dim
    (``x.transpose(0, 1)``), ``pergrad._core.capture.dims`` follows it. Active (a ``TorchFunctionMode``, so every
    torch op is seen) for the model's forward only; tensors are held by weak reference.

    pergrad's own work in a layer's hook runs aside from it (``Stepped.aside``): what that work returns into
    the forward is marked by hand (``mark``).

    Code whose ops the mode does not see (TorchScript) makes tensors it never saw: ``where`` says so.
    Dynamo never traces it: a compiled model's forward runs eagerly under it, so no op is hidden from it."""

    def __init__(self, seeds: list[tuple[Tensor, int]], seen: list[Tensor], size: int) -> None:
        super().__init__()
        self._size = size  # the batch size of the call
        # by id: a weak reference telling that tensor from a later one given the same id (no callback:
        # a callback removing the entry would make a reference cycle through this dict), its batch
        # position (``pergrad._core.capture.dims``; SEEN: no batch), and the op that lost it (for LOST)
        self._marks: dict[int, tuple[weakref.ref[Tensor], int, str]] = {}
        self._before: Provenance | None = None
        self._aranges_before: WeakTensorKeyDictionary | None = None
        for t in seen:
            self.see(t)
        for t, dim in seeds:
            self.mark(t, dim)

    def mark(self, t: Tensor, dim: int, by: str = "") -> None:
        """Count ``t`` as carrying the batch on ``dim`` (LOST: on no dim followed, after op ``by``)."""
        self._marks[id(t)] = (weakref.ref(t), dim, by)

    def see(self, t: Tensor) -> None:
        """Count ``t`` as seen computed in the forward, without the batch (unless it carries it)."""
        if self._own(t) == UNSEEN:
            self._marks[id(t)] = (weakref.ref(t), SEEN, "")

    def _own(self, t: Tensor) -> int:
        found = self._marks.get(id(t))
        return found[1] if found is not None and found[0]() is t else UNSEEN

    def where(self, t: Tensor) -> int:
        """``t``'s batch dim; LOST where it carries the batch on a dim not followed; SEEN where it was
        computed in the forward without the batch; UNSEEN where the mode never saw it (a view of a seen
        tensor counts as that tensor, its batch dim kept where the view has the same shape)."""
        found = self._own(t)
        if found != UNSEEN:
            return found
        with torch._C.DisableTorchFunction():
            return self._where_base(t)

    def _where_base(self, t: Tensor) -> int:  # (where torch functions are not seen: in this mode's handler)
        found = self._own(t)
        if found != UNSEEN:
            return found
        base = t._base
        if base is None:
            return UNSEEN
        found = self._own(base)
        return found if not carries(found) or base.shape == t.shape else LOST

    def carries(self, t: Tensor) -> bool:
        """Whether ``t`` was computed from the batch (itself, or the tensor it is a view of)."""
        return carries(self.where(t))

    def lost_by(self, t: Tensor) -> str:
        """The op after which ``t``'s batch dim could not be followed (empty if not known)."""
        found = self._marks.get(id(t))
        return found[2] if found is not None and found[0]() is t else ""

    @never_traced  # a compiled model's frames run eagerly under it
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if dynamo_callback() is not None:  # called from code Dynamo compiled: nothing called from here may be
            return without_dynamo(self._follow_op, func, args, kwargs or {})
        return self._follow_op(func, args, kwargs or {})

    def _follow_op(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` and mark what it returns (see the class docstring)."""
        result = func(*args, **kwargs)
        if func in _COUNTING:
            _count(func, args, kwargs, result)
        if result is not None and not isinstance(result, Tensor | tuple | list):
            return result  # x.dim(), x.numel(), x.shape, x.item(): nothing to mark
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute: x.T, x.data, x.shape (the last not a tensor)
            if isinstance(result, Tensor) and args and isinstance(args[0], Tensor):
                self._attribute(func, args[0], result)
            return result
        operands = args[1:] if func in _NEW else args  # x.new_zeros(n): nothing of x's values
        carried = []
        for t in _tensors(operands if not kwargs else (*operands, *kwargs.values())):
            k = self._where_base(t)
            if carries(k):
                carried.append((t, k))
        out = kwargs.get("out")
        if isinstance(result, Tensor) and out is None:
            results = [result]
        else:
            results = list(_tensors((result, *(out if isinstance(out, tuple | list) else (out,)))))
        writes = _writes_into_first(name) and bool(args) and isinstance(args[0], Tensor)
        if writes:  # (into an alias of an arange with a version counter of its own: ``j.set_(i)``)
            uncounted(args[0])
        if not carried:
            for t in results:
                self.see(t)
            return result
        for t, k in carried:  # computed from samples out of their rows (even by ops that follow no batch: an LSTM)
            if k == LOST and (mixing := self.lost_by(t)).startswith(_MIXING):
                self._mix(name, args, results, mixing)
                return result
        if writes and not carries(self._where_base(args[0])):
            self._written(name, args, carried)
        for t, dim in zip(results, result_dims(func, args, kwargs, results, carried, self._size), strict=True):
            if dim == MIXED and _packing():
                dim = _in_place_of(carried, t, self._size)
            if dim == MIXED:  # (an op reordered or mixed the samples: lost for good, refused at a layer)
                self.mark(t, LOST, _MIXING + name)
            elif dim == LOST:  # (named after the op that lost it first)
                self.mark(t, dim, _first_lost(name, [self.lost_by(u) for u, k in carried if k == LOST]))
            else:
                self.mark(t, dim)
        return result

    def _mix(self, name: str, args: tuple[Any, ...], results: list[Tensor], mixing: str) -> None:
        """Mark ``results`` (and what the op wrote into, and the tensor that is a view of) as computed from
        samples an op reordered (``mixing``: that op, as ``lost_by`` gives it)."""
        written_into = (
            [args[0], args[0]._base] if _writes_into_first(name) and args and isinstance(args[0], Tensor) else []
        )
        for t in (*results, *written_into):
            if t is not None:
                self.mark(t, LOST, mixing)

    def _attribute(self, func: Callable[..., Any], base: Tensor, result: Tensor) -> None:
        """Mark ``result``, the tensor attribute ``func`` read of ``base`` (``x.T``, ``x.data``)."""
        found = self._where_base(base)
        if carries(found):
            self.mark(result, attribute_dim(func, base.dim(), found), self.lost_by(base) if found == LOST else "")
        else:
            self.see(result)

    def _written(self, name: str, args: tuple[Any, ...], carried: list[tuple[Tensor, int]]) -> None:
        """Mark ``args[0]``, which did not carry the batch, and the tensor it is a view of, as carrying it
        now that an op wrote into it from ``carried`` (``x[i] = y``, ``x.copy_(y)``): on the dim the
        writer's batch lands on (aligned from the right; through the index for ``x[i] = y``)."""
        target: Tensor = args[0]
        value, k = carried[-1]
        dim = LOST
        if k >= 0 and name == "__setitem__" and len(args) > 2 and value is args[2]:
            dim = written(args[1], target.dim(), k, value.dim())
        elif k >= 0:
            dim = k + target.dim() - value.dim()
        if not (0 <= dim < target.dim() and target.shape[dim] == value.shape[k]):
            dim = LOST
        by = _MIXING + name if dim == LOST and name == "__setitem__" and out_of_order(args[1]) else name
        self.mark(target, dim, by if dim == LOST else "")
        base = target._base
        if base is not None and not carries(self._own(base)):
            self.mark(base, dim if base.shape == target.shape else LOST, by)

    def __enter__(self) -> Provenance:
        super().__enter__()
        self._before, _local.provenance = _local.provenance, self
        self._aranges_before = counting(WeakTensorKeyDictionary())
        return self

    def __exit__(self, *exc: object) -> None:
        counting(self._aranges_before)
        _local.provenance = self._before
        super().__exit__(*exc)


def _count(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
    """Record an integer ``torch.arange(n)`` (or ``arange(0, n)``, ``arange(0, n, 1)``) the forward made, whose
    views then index the batch in order with no values read (``pergrad._core.capture.dims.counted``); forget
    one about to be written into past its version counter."""
    if func is not torch.arange:
        for t in _tensors((*args, *kwargs.values())):  # (``j.data = i``: ``i`` too; ``set_`` is unseen: see writes)
            uncounted(t)
        return
    start, step = (0, 1) if len(args) < 2 else (args[0], 1 if len(args) < 3 else args[2])
    if any(n in kwargs for n in ("start", "step", "out")) or type(start) is not int or type(step) is not int:
        return
    fits = isinstance(result, Tensor) and result.dtype in _INTEGERS and result.dim() == 1
    if start == 0 and step == 1 and fits and torch.iinfo(result.dtype).max >= result.shape[0]:  # (none wrapped)
        counted(result)


_PACKING = frozenset({torch.nn.utils.rnn.__file__, torch.nn.modules.rnn.__file__})


def _packing() -> bool:
    """Whether the running op is called by torch's packed-sequence code: ``pack_padded_sequence(
    enforce_sorted=False)`` sorts the batch by length and records the order in the ``PackedSequence``
    (``sorted_indices``, which ``pergrad.rules.recurrent`` reads); ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` put
    ``h_n`` back in the samples' order, and ``pad_packed_sequence`` the output."""
    frame: Any = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_filename in _PACKING:
            return True
        frame = frame.f_back
    return False


def _in_place_of(carried: list[tuple[Tensor, int]], result: Tensor, size: int) -> int:
    """The batch dim of ``result`` of a reordering op as if it had kept each row's place: the first operand's
    where the result has the same rank and the batch's size there (sorting in ``torch.nn.utils.rnn``)."""
    t, k = carried[0]
    return k if k >= 0 and result.dim() == t.dim() and result.shape[k] == size else LOST


def _first_lost(name: str, found: list[str]) -> str:
    """The op named as the one that lost the batch of an op's result: an operand's that reordered the samples
    first, else the first operand's that lost it, else this op's (``name``)."""
    return next((by for by in found if by.startswith(_MIXING)), next((by for by in found if by), name))


def _folded(a: Tensor, size: int, dim: int, where: str, found: Provenance | None) -> BatchSizeError:
    """The error for a layer input computed from the batch that has not the batch's size on ``dim``."""
    after = "" if found is None else found.lost_by(a).removeprefix(_MIXING)
    return BatchSizeError(
        f"{where} got input of shape {tuple(a.shape)} computed from the batch, but the model was called with "
        f"a batch of {size} samples on dim {dim}: keep the batch on its own dim (a reshape that folds it into "
        "another dim, or indexing that picks samples out of it, mixes samples for pergrad)"
        + (
            f"; pergrad lost track of the batch at the op {after}, which folded it, picked samples out of it, "
            "or moved it in a way pergrad does not follow (move it with transpose, permute, movedim, view "
            "or reshape)"
            if after
            else ""
        )
    )


def provenance() -> Provenance | None:
    """The running forward's ``Provenance`` (None outside the model's forward)."""
    return _local.provenance
