"""Following the batch only where the forward is new: ``Provenance`` for the first forwards of each kind, then
a check of each layer call.

``Provenance`` (``pergrad._core.shortcuts.shared``) follows every op of the model's forward to tell, at each
layer call, where the batch is in the layer's input and whether the input carries it at all. In the
steady state of training the answers repeat: the same model, called with arguments of the same shapes,
calls the same layers on inputs of the same shapes computed the same way. So the forwards of one *kind*
(``kind_of``: the shapes, strides, dtypes and devices of the call's tensor arguments, its other arguments, the
batch, the model's training mode, autocast) are followed until two in a row were *plain* and alike, and
then run *lean*: without the mode, each layer call checked against the record (``signature``: the
input's and output's shapes, dtype, the autograd node that made the input, whether it is the call's own
argument), with the answers the record had.

A forward is plain where every layer call took its input batched on the wrapper's batch dim: nothing
shared by the batch (no ``Shared`` tensor, no raw parameter), no batch moved to another dim or lost,
no ``PackedSequence``, no segment that checkpointing computes again, no nested call of the model, and every
call's signature telling its path (``told``; a ``path`` not cut short at ``PATH`` nodes). Those
forwards keep being followed, as do the kinds whose two first followed forwards differ (a layer skipped at
random, a branch on the data) and the kinds past ``KINDS``.

A lean forward whose layer call matches no record (a branch not taken in the forwards followed) is
answered where the call's input settles it without the mode: it is the call's own tensor argument, or
its autograd history reaches the output of a layer call of this forward (computed from the batch), and
its only dim of the batch's size is the batch dim. The kind is followed again from then on. Anything
else raises ``BatchSizeError`` (pergrad follows every forward of the model after that), never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.decorators import skip
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pergrad.errors import EAGER

KINDS = 64  # kinds of forward remembered per wrapper (sequence lengths that vary, say); past it: followed
ALIKE = 2  # plain, alike followed forwards of a kind before its forwards run lean
PATH = 64  # autograd nodes of a layer input's path that its signature names at most
WALK = 10_000  # autograd nodes a lean forward's unmatched call walks at most to find the batch

Kind = tuple[Any, ...]
Outputs = dict[Any, tuple[str, int, int | None]]  # by autograd node: a layer call's key, the output's rank, batch dim
Signature = tuple[Any, ...]
F = TypeVar("F", bound=Callable[..., Any])


def kind_of(args: tuple[Any, ...], kwargs: dict[str, Any], size: int, dim: int, training: bool) -> Kind:
    """What a lean forward must share with the followed ones: its tensor arguments' shapes, strides (``x[:, :T]``
    of a wider batch is another layout of the same shape), dtypes, devices and ``requires_grad``, its other
    arguments (a scalar by value, anything else by type), their structure,
    the batch, the model's training mode and autocast."""
    if not kwargs and all(isinstance(a, Tensor) for a in args):  # the common call, without pytree's walk
        leaves: list[Any] = list(args)
        spec: Any = len(args)
    else:
        leaves, spec = tree_flatten((args, kwargs))
    return (
        spec,
        size,
        dim,
        training,
        torch.is_autocast_enabled(),
        *(
            (tuple(x.shape), x.stride() if x.layout == torch.strided else None, x.dtype, x.device, x.requires_grad)
            if isinstance(x, Tensor)
            else (x if isinstance(x, bool | int | float | str | None) else type(x))
            for x in leaves
        ),
    )


def signature(a: Any, output: Tensor, from_inputs: bool, outputs: Outputs) -> Signature:
    """What a layer call of a lean forward must share with its record: its input's shape, strides and dtype,
    whether it is the call's own argument, the ops it was computed by since the outputs of earlier layer
    calls (``path``), and its output's shape and dtype."""
    if not isinstance(a, Tensor):
        return (type(a), tuple(output.shape))
    return (tuple(a.shape), a.stride(), a.dtype, from_inputs, path(a, outputs), tuple(output.shape), output.dtype)


def told(a: Any, size: int, dim: int, from_inputs: bool) -> bool:
    """Whether a layer input's ``signature`` tells where its batch is: ``a`` has an autograd history (its
    ``path``), or it is the call's own argument, or its only dim of the batch's ``size`` is ``dim``. An input
    computed inside the forward without autograd history (``x - x.mean()`` of an input that needs no gradient)
    has no path, and with T == B ``h.transpose(0, 1).contiguous()`` has ``h``'s shape and strides: a followed
    call on such an input is not plain."""
    if not isinstance(a, Tensor) or a.grad_fn is not None or from_inputs:
        return True
    return [j for j, n in enumerate(a.shape) if n == size] == [dim]


def path(a: Tensor, outputs: Outputs) -> tuple[Any, ...] | None:
    """The autograd nodes ``a`` was computed by, depth first from its own, down to the outputs of the forward's
    layer calls (``outputs``: by node, the call's key and the output's dims, named in their place) and the parameters: their types
    (a node met again: 0). ``x.transpose(0, 1)`` before a layer, a layer called on another layer's output, a skip
    connection: each changes it. None where there are more than ``PATH`` of them: a path cut short cannot tell
    apart two that differ past its end (a transpose under a long loop of ops), so such a call is not plain."""
    start = a.grad_fn
    if start is None:
        return ()
    found: list[Any] = []
    seen, stack = {start}, [start]
    while stack and len(found) < PATH:
        node = stack.pop()
        key = outputs.get(node)
        if key is not None:
            found.append(key)
            continue
        found.append(type(node))
        for nxt, _ in reversed(node.next_functions):
            if nxt is None:
                continue
            if nxt in seen:
                found.append(0)
            else:
                seen.add(nxt)
                stack.append(nxt)
    return None if stack else tuple(found)


@dataclass
class _Record:
    calls: dict[str, Signature] | None = None  # by call key (``name`` or ``name:k``), of the last plain forward
    alike: int = 0  # plain followed forwards in a row with these calls
    followed: bool = False  # always followed (not plain, or not alike)


@dataclass
class Followed:
    """Which forwards the wrapper follows (``Provenance``) and which run lean; the records of the kinds."""

    off: bool = False  # every forward followed (a lean forward met a call it could not answer)
    _records: dict[Kind, _Record] = field(default_factory=dict)
    _kind: Kind | None = None  # of the running forward
    _notes: dict[str, Signature] = field(default_factory=dict)  # its calls so far
    _plain: bool = True  # whether it is plain so far
    lean: bool = False  # whether the running forward runs lean
    recording: bool = False  # whether the running forward is followed and its calls noted for its kind's record

    def start(self, kind: Kind | None) -> bool:
        """A forward of the model of ``kind`` starts (None: not one to record); True where it runs lean."""
        self._kind, self._notes, self._plain = kind, {}, True
        record = None if kind is None or self.off else self._records.get(kind)
        self.lean = record is not None and not record.followed and record.alike >= ALIKE
        self.recording = kind is not None and not self.off and not self.lean and not (record and record.followed)
        return self.lean

    def note(self, key: str, sig: Signature, plain: bool) -> None:
        """A layer call of a followed forward: its signature, and whether its answers were the plain ones (a
        signature whose ``path`` was cut short does not tell the call's path: not plain)."""
        self._notes[key] = sig
        self._plain = self._plain and plain and not (len(sig) > 4 and sig[4] is None)

    def not_plain(self) -> None:
        """The running forward is not plain (see the module docstring)."""
        self._plain = False

    def matches(self, key: str, sig: Signature) -> bool:
        """Whether a layer call of a lean forward matches its record."""
        assert self._kind is not None
        calls = self._records[self._kind].calls
        return calls is not None and calls.get(key) == sig

    def unmatched(self) -> None:
        """A lean forward met a call without a record, answered from the call itself: its kind is followed again."""
        if self._kind is not None and self._kind in self._records:
            self._records[self._kind].followed = True

    def returned(self) -> None:
        """The running forward returned: a followed one's record counts it."""
        kind, self._kind = self._kind, None
        if kind is None or not self.recording:
            return
        record = self._records.get(kind)
        if record is None:
            if len(self._records) >= KINDS:
                return
            record = self._records[kind] = _Record()
        if not self._plain or (record.calls is not None and record.calls != self._notes):
            record.followed = True
        elif not record.followed:
            record.calls, record.alike = self._notes, record.alike + 1

    def forget(self) -> None:
        """The layers were hooked again: every kind is followed anew."""
        self._records.clear()
        self._kind, self.lean, self.recording = None, False, False


SKIP = object()  # ``_walk``: do not go past this node


def _walk(t: Tensor, step: Callable[[Any], Any]) -> bool | None:
    """Depth-first through ``t``'s autograd history, ``step(node)`` at each node: True or False ends the walk
    with that answer, ``SKIP`` does not go past the node, None goes on through its inputs. False beyond ``WALK``
    nodes; None where the history ran out."""
    start = t.grad_fn
    if start is None:
        return None
    seen, stack = {start}, [start]
    while stack:
        if len(seen) > WALK:
            return False
        node = stack.pop()
        found = step(node)
        if found is SKIP:
            continue
        if found is not None:
            return bool(found)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return None


def reaches(t: Tensor, nodes: Outputs) -> bool:
    """Whether ``t``'s autograd history reaches one of ``nodes`` (within ``WALK`` nodes)."""
    return _walk(t, lambda node: True if node in nodes else None) is True


# autograd nodes of elementwise ops: the batch stays on the dim it had in their operands of the same rank
ELEMENTWISE = frozenset(
    f"{name}Backward{k}"
    for name in (
        "Add", "Sub", "Mul", "Div", "Neg", "Relu", "Gelu", "Silu", "Tanh", "Sigmoid", "LeakyRelu", "Elu", "Hardtanh",
        "Softplus", "Exp", "Log", "Pow", "Sqrt", "Rsqrt", "Abs", "Clamp", "ClampMin", "ClampMax", "Threshold",
        "NativeDropout", "Clone", "ToCopy", "MaskedFill", "Where", "Sin", "Cos", "Erf", "Mish", "Hardswish",
    )
    for k in (0, 1)
)  # fmt: skip


def elementwise_from_outputs(a: Tensor, outputs: Outputs, dim: int) -> bool:
    """Whether ``a`` was computed from outputs of the forward's layer calls (of its rank, with the batch on
    ``dim``: not a recurrent layer's ``h_n [layers, B, H]``) by elementwise ops alone, with parameters as the
    other operands: then it has the batch on ``dim``, where those outputs have it."""
    reached: list[Any] = []

    def step(node: Any) -> Any:
        found = outputs.get(node)
        if found is not None:
            if found[1] != a.dim() or found[2] != dim:
                return False
            reached.append(node)
            return SKIP
        name = type(node).__name__
        if name == "AccumulateGrad":
            return SKIP
        return None if name in ELEMENTWISE else False

    return _walk(a, step) is None and bool(reached)


def never_traced(fn: F) -> F:
    """``fn``, marked for Dynamo to neither trace nor compile (``skip``: free in eager, where the wrapper of
    ``torch.compiler.disable`` costs a handful of calls at each call), with pergrad's reason, which
    ``fullgraph=True`` quotes (``EAGER``)."""
    skip(fn)
    fn._torchdynamo_disable_msg = EAGER  # type: ignore[attr-defined]
    return fn


_EAGER_ALL = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and every frame it calls
_EAGER_CODE: set[CodeType] = set()  # the code objects marked so (a mark outlives ``torch._dynamo.reset()``)


def eager_hook(fn: F) -> F:
    """``fn``, a hook or callback autograd calls in a backward, run eagerly with every frame it calls: a backward
    called from code Dynamo compiled (``loss.backward()`` inside a compiled training step) runs its hooks with
    Dynamo's frame callback still set, which would trace and compile pergrad's frames. Free at each call: the
    code object is marked once, at the first hook made from it."""
    code = getattr(fn, "__func__", fn).__code__
    if code not in _EAGER_CODE:
        set_code_exec_strategy(code, _EAGER_ALL)
        _EAGER_CODE.add(code)
    return fn


# Dynamo's frame callback, None unless code Dynamo compiled is running: pergrad's hooks and modes are marked
# ``skip`` (Dynamo neither traces nor compiles them, at no cost in eager) and, where it is set, run their work
# through ``without_dynamo``, so no frame they call is compiled (torch is pinned: a private name)
dynamo_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


@torch.compiler.disable(reason=EAGER)
def without_dynamo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with Dynamo's frame evaluation off."""
    return fn(*args, **kwargs)


class Stepped(TorchFunctionMode):
    """A torch function mode of pergrad's, which pergrad's own work in a layer's hook steps aside from."""

    def aside(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with this mode off the stack of torch function modes (it must be on top): pergrad's own
        work in a hook of a layer, whose ops would otherwise each pass through the mode."""
        torch._C._pop_torch_function_stack()
        try:
            return fn(*args)
        finally:
            torch._C._push_on_torch_function_stack(self)

    def on_top(self) -> bool:
        """Whether this mode is the innermost torch function mode (no other entered inside it)."""
        stack = torch._C._len_torch_function_stack()
        return bool(stack) and torch._C._get_function_stack_at(stack - 1) is self


class Lean(Stepped):
    """The mode of a lean forward: it follows nothing. It keeps a compiled model's forward running eagerly,
    as under ``Provenance``, so a lean forward runs the same code (and makes the same autograd nodes) as the
    followed ones it is checked against."""

    @never_traced  # as ``Provenance.__torch_function__``
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if dynamo_callback() is not None:  # called from code Dynamo compiled: nothing called from here may be
            return without_dynamo(func, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
