"""Hooks: keep each hooked layer's input in the forward, catch its output gradient in the backward.

Nothing is computed here; the hooks hand ``(kept input, output gradient)`` to the engine.

The output gradient is caught by a pre-hook on the autograd node that produced the layer's
output (``output.grad_fn``), not by a full module backward hook:
- in-place operations on the output afterwards (``ReLU(inplace=True)``, ``out += identity``) do
  not touch that node, so the hook still sees the gradient of the layer's own output;
- node pre-hooks run after every tensor hook and module backward hook upstream, so the gradient
  is exactly the one autograd feeds the layer's backward (user hooks that rescale included);
- each call of a layer has its own node and its own kept input, so a layer called several times
  in one forward, or a graph backwarded twice with ``retain_graph=True``, needs no stack.

pergrad's forward hooks on a layer run before the user's (``_run_first``), and before the forward hooks
registered for every module (``Ahead``), so the output kept and caught is the layer's own: a forward hook
of the user's that rescales or replaces it is an op of the model after the layer.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from pergrad._core.capture.calls import Detached, HookedLayer, Kept
from pergrad._core.capture.coupling import refuse_batch_statistics
from pergrad._core.capture.dims import LOST, carries
from pergrad._core.capture.parametrized import Capture, Computed, parametrizations_of, sites
from pergrad._core.memory.layout import batch_to_front
from pergrad._core.shortcuts.detach import anchor_output
from pergrad._core.shortcuts.followed import (
    Followed,
    Lean,
    Outputs,
    dynamo_callback,
    eager_hook,
    elementwise_from_outputs,
    kind_of,
    never_traced,
    reaches,
    signature,
    told,
    without_dynamo,
)
from pergrad._core.shortcuts.shared import (
    SEEN,
    BatchInfo,
    Group,
    Origin,
    Provenance,
    Shared,
    batch_of_call,
    classify,
    located,
    per_sample_input,
    provenance,
    pulling,
    track,
)
from pergrad.errors import (
    EAGER,
    RECOMPUTED,
    BatchMixingError,
    BatchSizeError,
    HookStateError,
    SharedInputError,
    UnsupportedLayerError,
    module_label,
)
from pergrad.registry import LayerCall, output_tensors
from pergrad.rules.fallback import RERUNNING, drawing, random_modules

OnOutputGrad = Callable[..., None]  # (kept, d) or, for a rule with output_dims, (kept, d, k): output k's gradient
ToDetach = Callable[[HookedLayer, Any, int, int], "Detached | None"]
ToTap = Callable[[Any, int], "Tensor | None"]  # (a module's parameter, generation) -> the tap it is read through
# Features that look at one keyword argument of the model's call and its output, by the keyword's name:
# ``watch(value, output, warned)``, with ``warned`` the wrapper's set of warnings given (to give each once).
# ``pergrad.integrations.lm`` registers ``labels`` (HuggingFace's token-mean loss); a call without keyword
# arguments runs none of them.
CALL_WATCHERS: dict[str, Callable[[Any, Any, set[str]], None]] = {}


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


class _Inert:
    """What a pergrad hook becomes in a deepcopied or unpickled model: a hook that does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class InertWhenCopied:
    """A hook calling ``fn`` whose copy (``copy.deepcopy`` or pickling of the model it is on) does nothing
    and holds nothing: for the hooks pergrad's features put on a model."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple[type[_Inert], tuple[()]]:
        return (_Inert, ())


class ModuleHook:
    """A module hook owned by one ``LayerHooks``. Copying or pickling the model copies no pergrad
    state: the copy gets a ``_Inert`` hook in its place."""

    def __init__(self, owner: LayerHooks, fn: Callable[..., Any], aside: bool = False, first: bool = False) -> None:
        self.owner, self.fn, self.aside = owner, fn, aside
        # removed while its module's call was running: torch runs the hooks it listed when the call began (a lazy
        # root materialised in its own pre-hook, then rebound by the model's) and no longer knows which took keyword
        # arguments; the hook then does nothing, and the hooks installed in its place run from the next call on
        self.removed = False
        self.first = first  # a layer's forward hook: run ahead of the global forward hooks (``Ahead``)
        # the ``args`` of the running calls it ran for already from ``Ahead`` (innermost last): the module's own
        # call of it for the same call (torch hands both the same tuple) then returns at once
        self.ahead: list[tuple[Any, ...]] = []

    @never_traced  # it runs eagerly, also in a compiled model (``Provenance``)
    def __call__(self, *args: Any) -> Any:
        if dynamo_callback() is not None:  # called from code Dynamo compiled: nothing called from here may be
            return without_dynamo(self.__call__, *args)  # (this call again, with no callback)
        if self.ahead and args[1] is self.ahead[-1]:
            self.ahead.pop()
            return None
        if self.removed:  # (see ``__init__``)
            return None
        try:
            if self.aside:  # a layer's hook: pergrad's own ops are not the model's (``Provenance.aside``)
                following = self.owner.following()
                if following is not None:
                    return following.aside(self.fn, *args)
            return self.fn(*args)
        except Exception:
            self.owner.failed()
            raise

    def __deepcopy__(self, memo: dict[int, Any]) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple[type[_Inert], tuple[()]]:
        return (_Inert, ())


def owners(model: nn.Module) -> list[LayerHooks]:
    """The ``LayerHooks`` whose hooks are installed on ``model`` or its submodules."""
    found: list[LayerHooks] = []
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            found.extend(h.owner for h in hooks.values() if isinstance(h, ModuleHook))
    return list(dict.fromkeys(found))


def _refuse_batch_statistics(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    """A forward pre-hook for BatchNorm: normalising with batch statistics couples the samples."""

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        assert isinstance(module, nn.modules.batchnorm._BatchNorm)
        if torch.is_grad_enabled() and (module.training or module.running_mean is None):
            raise BatchMixingError(
                f"{module_label(name)} ({type(module).__name__}) normalises with the statistics of the whole batch "
                f"({'training mode' if module.training else 'track_running_stats=False'}), so each sample's output "
                "depends on every other sample and per-sample gradients are undefined, for every layer before it too. "
                "Put it in eval mode with running statistics (model.eval(), or module.eval()), or use nn.GroupNorm "
                "or nn.LayerNorm instead: pergrad.fix_batchnorm(model) replaces every BatchNorm of the model by a "
                "GroupNorm of the same channels (before you build the optimizer: its parameters are new)."
            )

    return check


def _refuse_random_draws(layer: HookedLayer, drawers: list[tuple[str, nn.Module]]) -> Callable[..., None]:
    """A forward pre-hook for a layer whose rule runs its forward again in the backward
    (``rules.fallback.RERUNNING``): a random draw in that forward (dropout in training mode) would be
    drawn anew there, so the per-sample gradients would not be those of the forward that ran."""

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled():
            return
        for sub, drawer in drawers:
            found = drawing(drawer)
            if found is None:
                continue
            what, attr = found
            where = ".".join(n for n in (layer.name, sub) if n)
            label = f"its submodule {where!r} ({type(drawer).__name__})" if sub else "it"
            off = (
                f"set model.get_submodule({where!r}).{attr} = 0.0 (it stays 0 through model.train())"
                if attr
                else f"replace {where!r} by nn.LeakyReLU"
            )
            raise UnsupportedLayerError(
                f"{layer.label}: {label} draws {what} in training mode, and pergrad computes this layer's per-sample "
                "gradients by running its forward again for each sample in the backward, which would draw new random "
                "numbers, not the ones this forward drew: the gradients would not be this forward's. To train it "
                f"with pergrad, {off}, or run the model in eval mode. (A dropout between hooked layers, such as the "
                "nn.Dropout modules of nn.TransformerEncoderLayer around its attention, is fine: only the layers "
                "whose forward pergrad runs again are concerned.)"
            )

    return check


def _producer(output: Tensor) -> Tensor:
    """The tensor whose autograd node computed ``output``'s values.

    When ``output`` is a reshaping view (Linear on ``[B, T, D]`` returns a view of a 2-D matmul),
    an in-place op on it later (``relu_``, ``+=``) rewrites the view's history and its node never
    runs; the base's original node still does, with the gradient of the pre-in-place values.
    """
    base = output._base if output._is_view() else None
    if base is None or base.grad_fn is None or base.numel() != output.numel():
        return output
    return base if base.is_contiguous() and output.is_contiguous() else output


def _output_dims(layer: HookedLayer, returned: Any, batch_dim: int) -> tuple[int | None, ...]:
    """Where the batch is in each tensor the call returned, as the layer's ``output_dims`` says."""
    assert layer.spec.output_dims is not None
    dims = tuple(layer.spec.output_dims(layer.module, returned, batch_dim))
    found = len(output_tensors(returned))
    if len(dims) != found:
        raise TypeError(
            f"pergrad: output_dims of the rule {layer.spec.fn.__qualname__} gave {len(dims)} batch dims for layer "
            f"{layer.name!r}, which returned {found} tensors"
        )
    return dims


def _check_layout(module: nn.Module, first: Any, dim: int, label: str, known: bool = False) -> None:
    """Refuse a layer with a layout of its own (``batch_first`` of ``nn.LSTM``, ``nn.MultiheadAttention``)
    called with the batch on another dim of its input (``dim``, as the forward put it; ``known``: as it
    put it in the calls a checkpoint computes again): it would take the samples for time steps and mix them."""
    own = getattr(module, "batch_first", None)
    if not isinstance(own, bool) or not isinstance(first, Tensor):
        return
    found = provenance()
    if not known and (found is None or found.where(first) < 0):
        return
    if first.dim() >= 3 and dim != (0 if own else 1):
        raise BatchMixingError(
            f"{label} has batch_first={own}, so it takes dim {0 if own else 1} of its "
            f"input for the batch, but the model's forward gives it the batch on dim {dim} (input shape "
            f"{tuple(first.shape)}): it would mix the samples. Build it with batch_first={not own}, or move the "
            f"batch to dim {0 if own else 1} before calling it"
        )


def _place_outputs(tensors: tuple[Tensor, ...], dims: tuple[int | None, ...], size: int) -> None:
    """Tell the running forward's ``Provenance`` that the tensors a batched layer call returned have the batch
    where its rule takes their gradients' batch (``dims``: the input's batch dim for one output), whatever ops
    the layer ran inside (HuggingFace's ``Conv1D`` folds it: ``x.view(-1, D)``)."""
    found = provenance()
    if found is None:
        return
    for t, dim in zip(tensors, dims, strict=False):
        if dim is not None and t.dim() > dim and t.shape[dim] == size:
            found.mark(t, dim)


def _behind_global_hook(label: str) -> HookStateError:
    """The error for a global forward hook registered during a hooked call (``Ahead.behind``)."""
    return HookStateError(
        f"{label}: a forward hook registered for every module (register_module_forward_hook) "
        "during this call of the layer, after pergrad's pre-hook of it ran, runs before pergrad's own "
        "forward hook, so pergrad cannot tell the layer's own output from what that hook returned. "
        "Register the global hook before the call (pergrad then runs its own ahead of it), or register "
        "it on the modules themselves with register_forward_hook."
    )


def _unsplit(label: str, shared: bool, a_shape: tuple[int, ...], size: int, dim: int, again: bool) -> SharedInputError:
    """The error for the output gradient of a call whose input is shared by the batch (``shared``) or may be,
    that reached the loss without meeting the batch in an op that splits it per sample (``again``: the call
    was computed again inside the backward)."""
    if shared and again:
        return SharedInputError(
            f"{label}, computed again inside the backward, took its input (shape {a_shape}) for one "
            "shared by the batch, and its output's gradient reached the loss without meeting the batch in "
            "an op that splits it per sample." + RECOMPUTED
        )
    if shared:
        return SharedInputError(
            f"the output of {label} is shared by the batch (its input has no batch dim: shape "
            f"{a_shape}), but its gradient reached the loss without meeting the batch in an op that "
            "broadcasts it over the samples, so it cannot be split per sample. If the layer's input folds "
            "the batch into another dim, keep the batch on its own dim."
        )
    return SharedInputError(
        f"{label} got an input of shape {a_shape} created inside the forward (not computed "
        f"from the model's inputs) with {size} on the batch dim {dim}, and its output reached the loss "
        "without meeting a tensor computed from the model's inputs in an op that shows whether that dim "
        "is the batch. If that input is the same for every sample, give it a batch dim of size 1 "
        "(ids[None]); if it is one row per sample, pass it to the model as an argument." + (RECOMPUTED if again else "")
    )


def _outside_model(label: str, what: str) -> SharedInputError:
    """The error for a call ``what`` (on an input shared by the batch) in a direct forward (``_refuse_direct``)."""
    return SharedInputError(
        f"{label} was called {what} outside a call of the wrapped model (a submodule called directly); "
        "pergrad follows which tensors carry the batch through the model's forward only, so it cannot "
        "split this call's gradient per sample. Call it through the wrapped model (a forward that makes "
        "these calls), or wrap the module you call (PerSampleModule(model.backbone)) instead of the model."
    )


def _main_output(output: Any, nested: bool) -> tuple[int | None, Tensor | None]:
    """The tensor whose gradient is caught, of a call that returned more than one (a layer whose rule takes
    the whole call), with the batch size where it is a ``PackedSequence``'s data (a recurrent layer, packed;
    else None): the first tensor of a tuple or list, or, for a rule that takes every output (``nested``), the
    first of ``output_tensors`` (dicts and nesting walked)."""
    if isinstance(output, tuple | list) and output and isinstance(output[0], PackedSequence):
        return int(output[0].batch_sizes[0]), output[0].data
    if nested:
        tensors = output_tensors(output)
    else:
        tensors = tuple(o for o in output if isinstance(o, Tensor)) if isinstance(output, tuple | list) else ()
    return None, tensors[0] if tensors else None


def _no_batch_dim(label: str, batched: Tensor, dim: int, batch_first: bool) -> BatchSizeError:
    """The error for a layer called on a tensor without the batch dim ``dim``."""
    return BatchSizeError(
        f"{label} got input of shape {tuple(batched.shape)}, which has "
        f"no batch dim {dim}; pergrad needs batched inputs"
        + ("" if batch_first else " (batch_first=False puts the batch on dim 1)")
    )


def _run_first(module: nn.Module, ids: list[int]) -> None:
    """Run the forward hooks of ``module`` of these handle ``ids`` before every other forward hook of it, in
    their order (as ``prepend=True`` would): pergrad's run before the user's, whenever those were
    registered, so that the output kept is the layer's own; a hook of the user's that rescales or
    replaces it (``out * s``, ``out.mul_(s)``: a schedule, stochastic depth) is then an op of the model
    after the layer, like any other."""
    hooks = cast(OrderedDict[int, Callable[..., Any]], module._forward_hooks)  # (an OrderedDict, typed as a dict)
    for found in reversed(ids):
        if found in hooks:
            hooks.move_to_end(found, last=False)


class Ahead:
    """torch runs the forward hooks registered for every module (``register_module_forward_hook``) before a
    module's own, so one that changes a hooked layer's output (``out * s``) would hand pergrad's forward hook
    the changed output as the layer's. While such a hook of the user's exists, a global forward hook of
    pergrad's, kept first among them (``check``, at every hooked call), runs each module's pergrad forward
    hooks (``ModuleHook.first``) before them, on the layer's own output; the module's own call of them then
    returns at once. Gone with the last global hook of the user's, or the last wrapper (``owners``)."""

    handle: RemovableHandle | None = None
    owners: ClassVar[weakref.WeakSet[LayerHooks]] = weakref.WeakSet()  # those with layers hooked

    @classmethod
    def check(cls) -> None:
        hooks = cast(OrderedDict[int, Callable[..., Any]], nn.modules.module._global_forward_hooks)
        if not hooks:
            return
        ours = cls.handle
        if ours is not None and ours.id in hooks:
            if cls.idle():
                cls.release()
            elif next(iter(hooks)) != ours.id:
                hooks.move_to_end(ours.id, last=False)
            return
        if cls.owners:
            cls.handle = nn.modules.module.register_module_forward_hook(_run_ahead, with_kwargs=True, always_call=True)
            hooks.move_to_end(cls.handle.id, last=False)

    @classmethod
    def idle(cls) -> bool:
        """Whether pergrad's global forward hook has nothing to run ahead of (it is the only one), or no wrapper
        needs it."""
        return len(nn.modules.module._global_forward_hooks) == 1 or not cls.owners

    @classmethod
    def behind(cls) -> bool:
        """Whether a global forward hook of the user's runs before pergrad's (registered after the call's
        pre-hooks ran: ``check`` put pergrad's first before the forward)."""
        hooks = nn.modules.module._global_forward_hooks
        ours = cls.handle
        return bool(hooks) and (ours is None or next(iter(hooks)) != ours.id)

    @classmethod
    def release(cls) -> None:
        """Take pergrad's global forward hook away, with what torch keeps of it beside the hooks."""
        if cls.handle is not None:
            key = cls.handle.id
            cls.handle.remove()
            nn.modules.module._global_forward_hooks_with_kwargs.pop(key, None)
            nn.modules.module._global_forward_hooks_always_called.pop(key, None)
            cls.handle = None


@torch.compiler.disable(reason=EAGER)
def _run_ahead(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
    """pergrad's global forward hook (``Ahead``): ``(module, args, kwargs, output)``, or, where the forward
    raised, ``(module, args, output)``."""
    if Ahead.idle():
        Ahead.release()  # (torch listed the hooks before this call: taking it away now is safe)
        return None
    output = returned = rest[-1]
    kwargs = rest[0] if len(rest) == 2 else {}
    for hook in list(module._forward_hooks.values()):
        if isinstance(hook, ModuleHook) and hook.first and not hook.removed:
            try:
                result = hook(module, args, kwargs, output)
            finally:
                hook.ahead.append(args)
            if result is not None:
                output = result
    return None if output is returned else output


Edge = tuple[Any, int]  # an autograd node and the index of one of its outputs


def _consumers(starts: set[Any], stop: set[Any], wanted: set[Edge]) -> dict[Edge, list[Edge]]:
    """The nodes of a layer call's own graph that use each ``wanted`` node output, with the index of
    the edge they use it by: the graph backward from ``starts`` (the nodes of its outputs) down to
    ``stop`` (the nodes of its inputs, left out)."""
    found: dict[Edge, list[Edge]] = {}
    seen, stack = set(starts), list(starts)
    while stack:
        node = stack.pop()
        if node in stop:
            continue
        for e, (used, nr) in enumerate(node.next_functions):
            if used is None:
                continue
            if (used, nr) in wanted:
                found.setdefault((used, nr), []).append((node, e))
            if used not in seen:
                seen.add(used)
                stack.append(used)
    return found


def _catch_outputs(kept: Kept, returned: Any, inputs: Any, on_output_grad: OnOutputGrad) -> None:
    """Catch the gradient of every tensor the call returned (``output_tensors``) and hand output k's,
    batch on dim 0 (``kept.a.output_dims``), to ``on_output_grad(kept, d, k)``.

    Each is caught on the node that computed it (the first one where ``_producer`` finds it, so that
    in-place operations on it later do not hide it). A node's gradient is the tensor's whole
    gradient: where the layer itself computed another output from it (``h, h.sum()``; hidden
    states returned with the last of them), what the nodes inside the layer send back into it is
    taken out again (post-hooks on them), so that each output's gradient is the one that reached it
    from outside the layer and no path is counted twice. A tensor returned twice is caught once.
    """
    assert isinstance(kept.a, LayerCall)
    tensors, dims = output_tensors(returned), kept.a.output_dims
    own: list[Edge | None] = [None if t.grad_fn is None else (t.grad_fn, t.output_nr) for t in tensors]
    caught = list(own)
    if own and own[0] is not None:
        produced = _producer(tensors[0])
        caught[0] = (produced.grad_fn, produced.output_nr)
    starts = {edge[0] for edge in [*own, *caught] if edge is not None}
    stop = {t.grad_fn for t in output_tensors(inputs) if t.grad_fn is not None} - starts
    used_by = _consumers(starts, stop, {edge for edge in [*own, *caught] if edge is not None})
    view = own[0][0] if own and own[0] is not None and caught[0] != own[0] else None
    base = caught[0] if view is not None else None
    if base is not None and any(node is not view for node, _ in used_by.get(base, [])):
        caught[0], view = own[0], None  # the view's base is used inside the layer too: catch the view
    done: set[Edge] = set()
    for k, edge in enumerate(caught):
        if edge is None or edge in done:
            continue
        done.add(edge)
        inside = [(node, e) for node, e in used_by.get(edge, []) if node is not view]
        _catch(kept, k, edge, tuple(tensors[k].shape), dims[k], inside, on_output_grad)


def _catch(
    kept: Kept,
    k: int,
    edge: Edge,
    shape: tuple[int, ...],
    dim: int | None,
    inside: list[Edge],
    on_output_grad: OnOutputGrad,
) -> None:
    """Hand the gradient of output k, less what ``inside`` sent back into it, to ``on_output_grad``."""
    node, index = edge
    taken: dict[int, Tensor] = {}  # per backward pass (graph task): what the layer's own nodes sent

    def take(position: int) -> Callable[[tuple[Tensor | None, ...], tuple[Tensor | None, ...]], None]:
        @eager_hook
        def hook(grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]) -> None:
            g = grad_inputs[position]
            if g is not None and not pulling():
                task = torch._C._current_graph_task_id()
                taken[task] = g if task not in taken else taken[task] + g

        return hook

    for consumer, position in inside:
        consumer.register_hook(take(position))

    @eager_hook
    def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
        d, inner = grad_outputs[index], taken.pop(torch._C._current_graph_task_id(), None)
        taken.clear()  # left by a backward pass that failed midway
        if d is None or pulling():
            return
        d = (d if inner is None else d - inner).reshape(shape)
        on_output_grad(kept, d if dim is None else d.movedim(dim, 0), k)

    node.register_prehook(catch)


class LayerHooks:
    """Installs and removes the forward hooks of the hooked layers and the root's generation counter.

    The root's hook stays for the wrapper's lifetime; the layers' hooks are installed for one set of
    layers and replaced when the model's parameters change (``install``/``uninstall``).
    """

    def __init__(
        self,
        model: nn.Module,
        batch_first: bool,
        on_output_grad: OnOutputGrad,
        on_input_grad: Callable[[int, Tensor], None] | None = None,
        to_detach: ToDetach | None = None,
        on_model_call: Callable[[], None] | None = None,
        may_detach: Callable[[HookedLayer], bool] | None = None,
        on_recompute: Callable[[], None] | None = None,
        to_tap: ToTap | None = None,
        may_tap: Callable[[HookedLayer], bool] | None = None,
        on_model_returned: Callable[[], None] | None = None,
        on_failed: Callable[[], None] | None = None,
        lean: bool = False,
    ) -> None:
        self._model = model
        self._on_recompute = on_recompute
        self._on_failed = on_failed  # a hook raised inside a backward: that backward stops there
        self._batch_first = batch_first
        self._to_detach = to_detach
        self._may_detach = may_detach  # which layers get the detaching hooks (all, when None)
        self._detached: dict[str, Detached] = {}  # layer name -> parameters detached for the running call
        self._to_tap, self._may_tap = to_tap, may_tap  # see ``pergrad._core.shortcuts.reach``
        self._tapped: dict[nn.Module, list[tuple[str, Tensor, Tensor]]] = {}  # (name, parameter, tap) per call
        self._on_output_grad = self._reaching(on_output_grad)
        self._on_input_grad = on_input_grad
        self._on_model_call = on_model_call
        self._on_model_returned = on_model_returned
        self._calls: dict[str, int] = {}
        self.generation = 0
        self.batch: BatchInfo | None = None  # the batch of the running call of the model
        self._buffer_storages: frozenset[int] | None = None
        # raw parameters swapped for a call, by the module whose call it is: (holder, name, parameter, alias)
        self._swapped: dict[nn.Module, list[tuple[nn.Module, str, Tensor, Tensor]]] = {}
        # calls of the model running (nested: several); whether the running forward is a direct call
        # of its layers (not through the model); the forward the latest output gradient belongs to
        self._in_model, self._direct, self._reached = 0, False, -1
        # first of the model's pre-hooks, whenever the user's were registered: the batch is read where the caller
        # put it (``batch_first``), and a pre-hook of the user's that moves it (``x.transpose(0, 1)`` for a
        # sequence-first model) is an op of the forward, followed like any other
        self._root = model.register_forward_pre_hook(
            ModuleHook(self, self._next_generation), with_kwargs=True, prepend=True
        )
        self._warned: set[str] = set()  # what ``CALL_WATCHERS`` warned of, once per wrapper
        self._root_out = model.register_forward_hook(ModuleHook(self, self._model_returned), with_kwargs=True)
        # of the running forwards of the model (nested calls: several); a lean forward's mode is a ``Lean``
        self._provenance: list[Provenance | Lean] = []
        self.followed = Followed(off=not lean)  # which forwards are followed (``pergrad._core.shortcuts.followed``)
        # the autograd nodes of the running forward's calls' outputs: their keys, ranks and batch dims
        self._outputs: Outputs = {}
        self._root_done = model.register_forward_hook(ModuleHook(self, self._forward_done), always_call=True)
        self._handles: list[RemovableHandle] = []
        # per layer, the dims its calls in the running forward had the batch on (LOST: not followed), for the
        # calls that checkpointing computes again inside the backward (``_placed_before``)
        self._placed: dict[str, set[int]] = {}
        self._installs = 0  # how many times ``install`` ran (the root's own hooks, made again in its call: ``_missed``)
        self._graph_unchecked = True  # the first graph is checked for batch statistics (pergrad._core.capture.coupling)
        self._captures: dict[str, Capture] = {}  # parametrized layers: what their parametrizations computed
        weakref.finalize(self, Ahead.check)  # a wrapper collected with its layers hooked: ``Ahead.owners`` lost it

    def install(self, layers: list[HookedLayer]) -> None:
        """Hook ``layers`` (and refuse batch statistics in every BatchNorm of the model)."""
        self.uninstall()
        Ahead.owners.add(self)
        self._installs += 1
        self.followed.forget()
        raw: dict[nn.Module, list[HookedLayer]] = {}
        for layer in layers:
            if layer.spec.raw:
                raw.setdefault(layer.module if layer.host is None else layer.host, []).append(layer)
                continue
            batch_dim = 0 if self._batch_first or layer.spec.batch_dim_fixed else 1
            mine = len(self._handles)
            spec = layer.spec
            drawers = random_modules(layer.module) if spec.fn in RERUNNING else []
            detachable = not (spec.all_inputs or spec.subtree or spec.parametrized)
            detach = (
                self._to_detach is not None and detachable and (self._may_detach is None or self._may_detach(layer))
            )
            tap = (
                self._to_tap is not None
                and not (spec.subtree or spec.parametrized)
                and (self._may_tap is None or self._may_tap(layer))
            )
            firsts: list[int] = []  # pergrad's forward hooks of the layer, in order (``_run_first``)
            pre = ModuleHook(self, self._before_call(layer, batch_dim, drawers, detach, tap, firsts))
            self._handles.append(layer.module.register_forward_pre_hook(pre, with_kwargs=True))
            if layer.spec.parametrized:
                self._capture(layer)
            post = ModuleHook(self, self._after_call(layer, detach, tap), aside=True, first=True)
            self._handles.append(layer.module.register_forward_hook(post, with_kwargs=True, always_call=True))
            _run_first(layer.module, [h.id for h in self._handles[mine:]])
            firsts.extend(h.id for h in self._handles[mine:] if h.id in layer.module._forward_hooks)
        for module, own in raw.items():
            enter = ModuleHook(self, self._direct_call([layer.name for layer in own], 0 if self._batch_first else 1))
            self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(ModuleHook(self, self._tracker(own))))
            self._handles.append(module.register_forward_hook(ModuleHook(self, self._untracker), always_call=True))
        for name, module in self._model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                hook = ModuleHook(self, _refuse_batch_statistics(name))
                self._handles.append(module.register_forward_pre_hook(hook))

    def _before_call(
        self,
        layer: HookedLayer,
        dim: int,
        drawers: list[tuple[str, nn.Module]],
        detach: bool,
        tap: bool,
        own: list[int],
    ) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        """The one forward pre-hook of a hooked layer: pergrad's forward hooks of the layer (``own``, ids in
        order) first among its forward hooks again, ahead of one the user registered since with
        ``prepend=True`` (``_run_first``); a call outside the model's starts a forward (``_direct_call``); a layer whose
        rule runs its forward again refuses random draws; then, aside from the forward's ``Provenance``,
        the weights pergrad owns are detached for the call (``_detacher``) and the parameters it checks
        through their taps swapped in (``_tapper``: a weight detached for the call is not tapped)."""
        enter = self._direct_call([layer.name], dim)
        refuse = _refuse_random_draws(layer, drawers) if drawers else None
        detacher = self._detacher(layer) if detach else None
        tapper = self._tapper if tap else None

        def swap(module: nn.Module, args: tuple[Any, ...]) -> None:
            if detacher is not None:
                detacher(module, args)
            if tapper is not None:
                tapper(module, args)

        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if own and next(iter(module._forward_hooks), own[0]) != own[0]:  # (torch reads them after the forward)
                _run_first(module, own)
            if nn.modules.module._global_forward_hooks:
                Ahead.check()
            if not self._in_model:  # (a call outside the model's)
                enter(module, args, kwargs)
            if refuse is not None:
                refuse(module, args)
            if detacher is None and tapper is None:
                return
            following = self.following()
            if following is None:
                swap(module, args)
            else:
                following.aside(swap, module, args)

        return before

    def _after_call(self, layer: HookedLayer, detach: bool, tap: bool) -> Callable[..., Tensor | None]:
        """The one forward hook of a hooked layer (run first among its forward hooks, also when the forward
        raised): the real parameters back in place (``_reattach``, ``_untapper``), then, for a call that
        returned, its input kept and its output gradient caught (``_keeper``), on the output with the
        probe added where the weights ran detached."""
        name, detached = layer.name, self._detached
        untap = self._untapper if tap else None
        keep = self._keeper(layer)

        def after(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> Tensor | None:
            # (module, args, kwargs, output); the output is None where the forward raised
            output = returned = rest[-1]
            found = detached.get(name) if detach else None
            if found is not None:
                output = self._reattach(module, name, found, output)
            if untap is not None:
                untap(module, args, output)
            if returned is None:
                return None
            if nn.modules.module._global_forward_hooks and Ahead.behind():
                raise _behind_global_hook(layer.label)
            kept = keep(module, args, rest[0], output)
            if kept is not None:
                return kept
            return None if output is returned else output

        return after

    def _capture(self, layer: HookedLayer) -> None:
        """Keep what each parametrization of ``layer`` computes during a call (``pergrad._core.capture.parametrized``)."""
        capture = self._captures[layer.name] = Capture(sites(layer.module, layer.spec.subtree))
        self._handles.append(layer.module.register_forward_pre_hook(ModuleHook(self, lambda m, args: capture.start())))
        for site in capture.sites:
            if site.hooked:  # computed by the owner's pre-hook, an attribute of the owner during its call

                def read(
                    m: nn.Module, args: tuple[Any, ...], out: Any, key: str = site.key, t: str = site.tensor
                ) -> None:
                    capture.record(key, m.__dict__.get(t))

                self._handles.append(site.owner.register_forward_hook(ModuleHook(self, read)))
                continue

            def record(m: nn.Module, args: tuple[Any, ...], out: Any, key: str = site.key) -> None:
                capture.record(key, out)

            plist = parametrizations_of(site.owner)[site.tensor]
            self._handles.append(plist.register_forward_hook(ModuleHook(self, record)))

    def uninstall(self) -> None:
        for handle in self._handles:
            hooks = handle.hooks_dict_ref()
            hook = None if hooks is None else hooks.get(handle.id)
            if isinstance(hook, ModuleHook):
                hook.removed = True
            handle.remove()
        self._handles.clear()
        Ahead.owners.discard(self)
        Ahead.check()  # (where only pergrad's global forward hook is left, or no wrapper: taken away)
        self._captures.clear()
        self._detached.clear()
        for module in list(self._tapped):
            self._untapper(module, (), None)
        for module in list(self._swapped):
            self._untracker(module, (), None)

    def _next_generation(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The model's first forward pre-hook: a forward starts (its generation and batch, ``_new_forward``) and
        is followed (``_follow``); the call's arguments, its input's gradient caught where asked."""
        self._in_model += 1  # (back down in ``_forward_done``, also when this raises)
        installs = self._installs
        if self._on_model_call is not None:
            self._on_model_call()  # (may wrap the model again as it is now: ``install``)
        self._direct = False
        self._new_forward(args, kwargs, 0 if self._batch_first else 1)
        given, x = args, args[0] if args else None
        if self._on_input_grad is not None and torch.is_grad_enabled() and isinstance(x, Tensor) and x.requires_grad:
            args = (self._input_caught(x), *args[1:])
        self._follow(args, kwargs)
        if self._installs != installs:
            self._missed(module, args, kwargs)
        return None if args is given else (args, kwargs)

    def _input_caught(self, x: Tensor) -> Tensor:
        """A view of the model's input ``x`` (a fresh node of this forward) for the forward to go on with, whose
        node's pre-hook hands d loss / d input (batch first) to ``on_input_grad``."""
        view = x.view_as(x)
        generation, on_input_grad, batch_first = self.generation, self._on_input_grad, self._batch_first
        assert view.grad_fn is not None and on_input_grad is not None

        @eager_hook
        def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
            if grad_outputs[0] is not None and not pulling():
                on_input_grad(generation, batch_to_front(grad_outputs[0], batch_first))

        view.grad_fn.register_prehook(catch)
        return view

    def _missed(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the forward pre-hooks that ``install`` just put on the model itself (a module with raw
        parameters, ``cls_token`` on a ViT; a layer wrapped alone), which this call of it misses: torch
        listed the hooks to run when the call began, before the model was wrapped again (``_sync``:
        ``requires_grad`` switched)."""
        with_kwargs = module._forward_pre_hooks_with_kwargs
        for key, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, ModuleHook) and hook.owner is self and key != self._root.id:
                if key in with_kwargs:
                    hook(module, args, kwargs)
                else:
                    hook(module, args)

    def following(self) -> Provenance | Lean | None:
        """The running forward's ``Provenance`` (or ``Lean`` mode) where it is the innermost torch function
        mode (a layer's hooks then run aside from it), else None."""
        if not self._provenance:
            return None
        found = self._provenance[-1]
        return found if found.on_top() else None

    def _follow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Follow, for this forward, which tensors carry the batch (``pergrad._core.shortcuts.shared.Provenance``),
        starting from the call's tensor arguments with the batch on the batch dim."""
        batch = self.batch
        if batch is None:
            return
        tensors: Any = args
        packed: list[PackedSequence] = []
        if kwargs or not all(isinstance(a, Tensor) for a in args):
            tensors = tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, PackedSequence))[0]
            packed = [t for t in tensors if isinstance(t, PackedSequence)]
        if self._in_model > 1:
            self.followed.off = True  # a call of the model inside its own forward: followed from now on
        if not self.followed.off and self._went_lean(args, kwargs, batch, bool(packed)):  # (``lean_forwards=True``)
            return
        dim, size = batch.dim, batch.size
        seeds = [(t, dim) for t in tensors if isinstance(t, Tensor) and t.dim() > dim and t.shape[dim] == size]
        if packed:  # (a PackedSequence's data holds no batch dim)
            seeds += [(t.data, LOST) for t in packed if int(t.batch_sizes[0]) == size]
        found = Provenance(seeds, [t for t in tensors if isinstance(t, Tensor)], size)
        found.__enter__()
        self._provenance.append(found)

    def _went_lean(self, args: tuple[Any, ...], kwargs: dict[str, Any], batch: BatchInfo, packed: bool) -> bool:
        """Whether this forward runs lean (``pergrad._core.shortcuts.followed``: a forward of a kind already
        recorded, whose calls are only checked against the record): then in ``Lean`` mode, following nothing."""
        kind = None if packed else kind_of(args, kwargs, batch.size, batch.dim, self._model.training)
        if not self.followed.start(kind):
            return False
        lean = Lean()
        lean.__enter__()
        self._provenance.append(lean)
        return True

    def _forward_done(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of the root (also when the forward raised): stop following the batch."""
        self._in_model = max(self._in_model - 1, 0)
        if not self._provenance:
            return
        found = self._provenance.pop()
        stack = torch._C._len_torch_function_stack()
        if stack and torch._C._get_function_stack_at(stack - 1) is found:
            found.__exit__(None, None, None)

    def _new_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], dim: int) -> None:
        """A forward starts (a call of the model, or a direct call of its layers): its generation, and
        its batch read from the call's arguments."""
        self.generation += 1
        self.followed.lean = self.followed.recording = False
        self._outputs.clear()
        self._calls.clear()
        self._placed.clear()
        self._buffer_storages = None
        tracking = torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
        tracking = tracking and not torch.compiler.is_compiling()
        self.batch = batch_of_call(args, kwargs, dim, self._buffers) if tracking else None

    def _direct_call(self, names: list[str], dim: int) -> Callable[..., None]:
        """Forward pre-hook of a hooked layer (or a module with raw parameters; ``names``: the hooked
        layers it is) for calls outside a call of the model (``model.backbone(x)``, then
        ``model.head(h)``): the first such call starts a forward whose batch is read from its
        arguments, as a call of the model starts one. The calls after it belong to that forward,
        until a backward has reached it or a layer is called again (a forward of its own: a
        backward through both is refused, as for two calls of the model)."""

        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._in_model or not torch.is_grad_enabled() or pulling():
                return
            if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
                return
            if torch._C._current_graph_task_id() != -1:
                return  # computed again inside a backward (activation checkpointing): its forward's
            if self._direct and self._reached != self.generation and not any(n in self._calls for n in names):
                return  # a later call of the running direct forward
            self._direct = True
            self._new_forward(args, kwargs, dim)

        return enter

    def _refuse_direct(self, label: str, what: str) -> None:
        """Refuse a call in a direct forward (``_direct_call``) that needs the batch followed through
        the forward (``pergrad._core.shortcuts.shared.Provenance``, active in a call of the model only)."""
        if self._direct and not self._in_model and torch._C._current_graph_task_id() == -1:
            raise _outside_model(label, what)

    def _reaching(self, on_output_grad: OnOutputGrad) -> OnOutputGrad:
        """``on_output_grad``, noting which forward a backward has reached (see ``_direct_call``)."""

        def reached(kept: Kept, *rest: Any) -> None:
            self._reached = kept.generation
            on_output_grad(kept, *rest)

        return reached

    def _buffers(self) -> frozenset[int]:
        """The storages of the model's buffers (computed once per forward, when first asked)."""
        if self._buffer_storages is None:
            self._buffer_storages = frozenset(b.untyped_storage().data_ptr() for b in self._model.buffers())
        return self._buffer_storages

    def _detacher(self, layer: HookedLayer) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        """Forward pre-hook: run this call with the parameters pergrad owns detached (see ``Detached``)."""
        assert self._to_detach is not None
        to_detach = self._to_detach

        def detach(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
                return
            if torch.compiler.is_compiling():
                return
            batch_dim = 0 if self._batch_first or layer.spec.batch_dim_fixed else 1
            a = _first_input(args, {})
            following = provenance()
            at = following.where(a) if following is not None and isinstance(a, Tensor) else LOST
            found = to_detach(layer, a, at if at >= 0 else batch_dim, self.generation)
            if found is None:
                return
            self._detached[layer.name] = found
            for name, _, replacement in found.swaps:
                module._parameters[name] = replacement  # type: ignore[assignment]

        return detach

    def _reattach(self, module: nn.Module, layer_name: str, found: Detached, output: Any) -> Any:
        """In the forward hook of a call of layer ``layer_name`` that ran with detached parameters (``_detacher``; also when
        the forward raised): put the real parameters back; the output to go on with (the probe added to it, for
        an anchor on the output)."""
        for name, original, replacement in found.swaps:
            if module._parameters.get(name) is replacement:  # (FSDP2 may have put its shard back)
                module._parameters[name] = original  # type: ignore[assignment]
        if not isinstance(output, Tensor):  # the forward raised: the keeper will not run
            self._detached.pop(layer_name)
            return output
        if not found.on_output:
            return output
        anchored = anchor_output(output, found.anchor)  # (aside from the forward's Provenance: marked here)
        following = self._provenance[-1] if self._provenance else None
        if anchored is not output and isinstance(following, Provenance):
            at = following.where(output)
            if carries(at):
                following.mark(anchored, at)
            elif at == SEEN:
                following.see(anchored)
        return anchored

    def _tapper(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: the call reads the parameters pergrad checks through their taps."""
        to_tap = self._to_tap
        if to_tap is None or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            return
        if torch.compiler.is_compiling():
            return
        swaps: list[tuple[str, Tensor, Tensor]] = []
        for name, p in module._parameters.items():
            tap = to_tap(p, self.generation)
            if p is not None and tap is not None:
                module._parameters[name] = tap  # type: ignore[assignment]
                swaps.append((name, p, tap))
        if swaps:
            self._tapped[module] = swaps

    def _untapper(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook (also when the forward raised): the parameters back in place."""
        for name, p, tap in self._tapped.pop(module, []):
            if module._parameters.get(name) is tap:  # (FSDP2 may have put its shard back)
                module._parameters[name] = p  # type: ignore[assignment]

    def _keeper(self, layer: HookedLayer) -> Callable[..., Tensor | None]:
        """The part of a hooked layer's forward hook that keeps a call's input (batch on dim 0) in a ``Kept`` and
        registers, on the node that produced its output, the pre-hook that hands ``(kept, d)`` to the engine."""
        # fixed for the layer: looked up once here, not at every call (this runs at every forward)
        name, spec = layer.name, layer.spec
        all_inputs, every = spec.all_inputs, spec.output_dims is not None  # every: the rule takes every output
        batch_first = self._batch_first or spec.batch_dim_fixed
        batch_dim = 0 if batch_first else 1
        on_output_grad, detached_calls, captures = self._on_output_grad, self._detached, self._captures
        grad_enabled, transforming = torch.is_grad_enabled, torch._C._are_functorch_transforms_active

        def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Tensor | None:
            detached = detached_calls.pop(name, None) if detached_calls else None
            returned, packed = output, None  # packed: the batch size of a recurrent layer's packed output
            if all_inputs and not isinstance(output, Tensor):
                packed, output = _main_output(output, every)
            if not (grad_enabled() and isinstance(output, Tensor)):
                if self.batch is not None and self._provenance and not grad_enabled():
                    self._place(layer, _first_input(args, kwargs), batch_dim)  # (a reentrant checkpoint's segment)
                return None
            if not any(t.grad_fn is not None for t in output_tensors(returned)) if every else output.grad_fn is None:
                return None  # nothing will flow back through this call: keep nothing
            if transforming():
                return None  # torch.func is differentiating the model itself (vmap/grad): not ours to track
            capture = captures.get(name) if captures else None
            computed = None if capture is None else capture.take(layer.label)
            first = _first_input(args, kwargs)
            dim = batch_dim  # where the batch is in this call's input (the forward may have moved it)
            if self.batch is not None:
                if provenance() is None and torch._C._current_graph_task_id() != -1:  # computed again (checkpoint)
                    dim = self._placed_again(module, layer, first, batch_dim)
                elif self.followed.lean:  # checked against its kind's record (``pergrad._core.shortcuts.followed``)
                    if not self.followed.matches(self._next_key(name), self._signature(first, output)):
                        self._unmatched(layer.label, first, output, dim)
                    self._placed.setdefault(name, set()).add(dim)
                else:
                    dim = located(first, batch_dim, self.batch.size, layer.label, spec.batch_dim_fixed)
                    if all_inputs:
                        _check_layout(module, first, dim, layer.label)
                    if self._provenance:
                        self._placed.setdefault(name, set()).add(dim)
            dims = _output_dims(layer, returned, dim) if every else ()
            reduced = bool(dims) and all(dim is None for dim in dims)  # it returns no batch (a loss reduced over it)
            batched = output if all_inputs and not reduced else first  # (reduced: the batch is its first input's)
            if not isinstance(batched, Tensor):
                raise TypeError(f"pergrad: {layer.label} was called without a tensor input")
            if self.batch is not None and not self.followed.lean:
                group = None if all_inputs else classify(first, output, dim, self.batch, layer.label)
                if self.followed.recording:
                    self._record(name, first, output, group is None and dim == batch_dim and packed is None, dim)
                if group is not None:
                    return self._keep_shared(layer, first, output, dim, group, detached, computed)
            shape = output.shape
            if packed is None and (batched.dim() <= dim or (len(shape) <= dim and not reduced)):
                raise _no_batch_dim(layer.label, batched, dim, batch_first)
            batch_size = batched.shape[dim] if packed is None else packed
            a = LayerCall(args, kwargs, dim, dims, batch_size if every else None) if all_inputs else first
            kept_input: Any = a if isinstance(a, LayerCall) or dim == 0 else a.movedim(dim, 0)
            given = a if isinstance(a, Tensor) and kept_input is not a else None  # (the rule reads a view of it)
            if computed is not None:
                kept_input = Computed(kept_input, computed)
            key, task = self._key(name), self._recomputed()
            kept = Kept(
                layer, kept_input, self.generation, batch_size, key, packed is not None, detached, task, given=given
            )
            outs, out_dims = (output_tensors(returned), dims) if every else ((output,), (dim,))
            if self.batch is not None and packed is None:
                _place_outputs(outs, out_dims, batch_size)
            if self.followed.recording or self.followed.lean:
                self._note(kept.key, outs, out_dims)
            if isinstance(a, LayerCall) and a.output_dims:  # the rule takes every output's gradient
                _catch_outputs(kept, returned, (args, kwargs), on_output_grad)
                return None
            produced = _producer(output)
            node, index, turn = produced.grad_fn, produced.output_nr, 0 if kept.packed else dim
            assert node is not None

            @eager_hook
            def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
                d = grad_outputs[index]
                if d is not None and not pulling():
                    if d.shape != shape:  # the producer is the output's base (see _producer)
                        d = d.reshape(shape)
                    on_output_grad(kept, d.movedim(turn, 0) if turn else d)

            node.register_prehook(catch)
            return None

        return keep

    def failed(self) -> None:
        """One of pergrad's hooks raises: inside a backward (a layer computed again by activation
        checkpointing, an output shared by the batch whose gradient met no op that splits it), that backward
        stops there and its end never runs, so the engine undoes what it wrote of ``.grad`` (``on_failed``)."""
        if self._on_failed is not None and torch._C._current_graph_task_id() != -1:
            self._on_failed()

    def _place(self, layer: HookedLayer, a: Any, dim: int) -> None:
        """Note where the running forward has the batch in the input ``a`` of a call of ``layer`` that keeps
        nothing (grad mode off: a reentrant checkpoint's segment runs so in the forward), for the calls computed
        again (``_placed_before``): as ``Provenance`` follows it, or, in a lean forward, on ``dim`` where
        ``_unmatched`` accepts that."""
        if self.followed.lean:
            self._unmatched(layer.label, a, a, dim)
            self._placed.setdefault(layer.name, set()).add(dim)
            return
        self.followed.not_plain()
        found = provenance()
        if found is not None and isinstance(a, Tensor) and not isinstance(a, Shared):
            at = found.where(a)
            if at >= 0 or at == LOST:
                self._placed.setdefault(layer.name, set()).add(at)

    def _record(self, name: str, a: Any, output: Tensor, plain: bool, dim: int) -> None:
        """Note a call of a forward that is recorded for its kind (``Followed.note``): plain where ``plain`` (kept
        as an ordinary call on the wrapper's batch dim) and its input's batch dim ``dim`` told by its shape."""
        assert self.batch is not None
        own = isinstance(a, Tensor) and self.batch.from_inputs(a)
        plain = plain and told(a, self.batch.size, dim, own)
        self.followed.note(self._next_key(name), self._signature(a, output), plain)

    def _note(self, key: str, outputs: tuple[Tensor, ...], dims: tuple[int | None, ...]) -> None:
        """Note the autograd nodes of the outputs of call ``key`` of a recorded or lean forward, with their ranks
        and batch dims ``dims``: ``signature`` reads them for the calls after it."""
        for t, at in zip(outputs, dims, strict=False):
            if t.grad_fn is not None:
                self._outputs[t.grad_fn] = (key, t.dim(), at)

    def _placed_again(self, module: nn.Module, layer: HookedLayer, a: Any, dim: int) -> int:
        """``_placed_before`` for a call of ``layer`` computed again inside the backward, the layer's own
        layout checked against it (``_check_layout``)."""
        found = self._placed_before(layer.name, a, dim, layer.label)
        if layer.spec.all_inputs and found != dim:
            _check_layout(module, a, found, layer.label, known=True)
        return found

    def _placed_before(self, name: str, a: Any, dim: int, label: str) -> int:
        """The batch dim of the input ``a`` of a call of layer ``name`` computed again inside the backward
        (activation checkpointing), where ``Provenance`` does not run: where this forward's calls of the layer
        had it (``x.transpose(0, 1)`` before a sequence-first segment: dim 1), else ``dim``. Refused where
        those calls had it on several dims and ``a``'s shape cannot tell which."""
        found = self._placed.get(name)
        if not found or not isinstance(a, Tensor) or self.batch is None:
            return dim
        size = self.batch.size
        fits = [d for d in range(a.dim()) if a.shape[d] == size]
        known = [d for d in found if d in fits]
        if not fits or size == 1:  # (no batch here: ``classify`` says why; one sample: any dim of size 1)
            return known[0] if known else dim
        if LOST not in found:
            if len(known) <= 1:
                return known[0] if known else dim
        elif len(fits) == 1:  # the forward lost track of it in some call: as ``located`` does then
            return known[0] if known else dim
        raise BatchSizeError(
            f"{label} is computed again inside the backward (activation checkpointing), where pergrad does not see "
            "the forward's ops; it takes its input's batch dim from this forward's calls of it, which had the batch "
            f"on dims {sorted(d for d in found if d >= 0)}"
            + (" or on one pergrad lost track of" if LOST in found else "")
            + f", and this call's input (shape {tuple(a.shape)}) has the batch's size {size} on dims {fits}: pergrad "
            "cannot tell which is the batch. Call the layer with the batch on the same dim every time (move it back "
            "with x.movedim(...) before the call), or keep it outside the checkpointed segment"
        )

    def _recomputed(self) -> int | None:
        """The backward pass this call runs inside (activation checkpointing computes a segment again
        during the backward), announced to the engine; None for a call in an ordinary forward."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return None
        if self._on_recompute is not None:
            self._on_recompute()
        return task

    def _key(self, name: str) -> str:
        """``name``, with ":k" for its k-th call (k >= 1) in this forward."""
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        return name if call == 0 else f"{name}:{call}"

    def _next_key(self, name: str) -> str:
        """The key ``_key`` gives the call of layer ``name`` it is asked for next."""
        call = self._calls.get(name, 0)
        return name if call == 0 else f"{name}:{call}"

    def _signature(self, a: Any, output: Tensor) -> tuple[Any, ...]:
        """A layer call's ``signature`` (``pergrad._core.shortcuts.followed``)."""
        assert self.batch is not None
        return signature(a, output, isinstance(a, Tensor) and self.batch.from_inputs(a), self._outputs)

    def _unmatched(self, label: str, a: Any, output: Tensor | None, dim: int) -> None:
        """A call of a lean forward (``pergrad._core.shortcuts.followed``) without a record: answered as batched on
        ``dim`` where its input ``a`` settles it (``a`` and ``output`` have the batch's size on ``dim``, and ``a``
        was computed from outputs of this forward's calls by elementwise ops alone; or it is the call's own
        argument or computed from such an output, with the batch's size on ``dim`` alone, or a batch of one),
        else refused."""
        batch = self.batch
        assert batch is not None
        size = batch.size
        if isinstance(a, Tensor) and not isinstance(a, Shared) and output is not None:
            fits = [j for j, n in enumerate(a.shape) if n == size]
            if dim in fits and output.dim() > dim and output.shape[dim] == size:
                alone = fits == [dim]
                if (
                    size == 1  # one sample: its gradient is the batch's, batched or shared, on any dim of size 1
                    or (alone and (batch.from_inputs(a) or reaches(a, self._outputs)))
                    or elementwise_from_outputs(a, self._outputs, dim)
                ):
                    self.followed.unmatched()
                    return
        self.followed.off = True
        raise BatchSizeError(
            f"{label} was called in a forward of the model that took a path the forwards pergrad followed with "
            "arguments of the same shapes did not take (pergrad follows where the batch is through every op of a "
            "model's forward until the forwards of those shapes repeat, then only checks each layer call against "
            "them), and this call's input does not tell where the batch is without following the forward"
            + (f" (input shape {tuple(a.shape)})" if isinstance(a, Tensor) else "")
            + ". pergrad follows every forward of this model from now on: run the step again"
        )

    def _keep_shared(
        self,
        layer: HookedLayer,
        a: Any,
        output: Tensor,
        dim: int,
        group: Group,
        detached: Detached | None,
        computed: dict[str, Tensor] | None,
    ) -> Tensor:
        """A call whose output is (or may be) shared by the batch (see ``pergrad._core.shortcuts.shared``): the model
        goes on with a tracked alias of the output, whose meetings with the batch deliver each
        sample's output gradient; the gradient autograd sums over the batch is then not used."""
        assert isinstance(a, Tensor)
        self._refuse_direct(layer.label, f"on an input shared by the batch (shape {tuple(a.shape)})")
        with torch._C.DisableTorchFunctionSubclass():
            plain = a.view_as(a)  # a plain tensor, with a's graph (second order differentiates through it)
        size = group.batch
        key = self._key(layer.name)
        a_shared, per_sample = per_sample_input(plain, output, dim, size)

        def kept_input(x: Tensor) -> Any:
            return x if computed is None else Computed(x, computed)

        task = self._recomputed()
        shared = Kept(
            layer, kept_input(a_shared), self.generation, size, key, detached=detached, task=task, shared=True
        )
        on_output_grad = self._on_output_grad
        origin = Origin(output, lambda g: on_output_grad(shared, per_sample(g)), group, layer.label)
        before = a.origins if isinstance(a, Shared) else ()
        alias = track(output, [*before, origin])
        produced = _producer(output)
        origin.aliased(alias, produced)  # (where the output gradient arrives, as ``catch`` below reads it)
        # the batched reading of the same call, for a group that turns out batched after all
        batched = replace(shared, a=kept_input(batch_to_front(plain, dim == 0))) if group.state == "maybe" else None
        node, index, shape, a_shape = produced.grad_fn, produced.output_nr, output.shape, tuple(a.shape)
        assert node is not None
        # The hook holds the origin weakly: the origin holds the alias, whose graph holds ``node``, and a
        # cycle through an autograd node is one Python's gc cannot collect (every step's call would stay).
        # An origin gone by the time its output's gradient arrives was met by no op of this graph.
        delivered_to = weakref.ref(origin)

        @eager_hook
        def catch(grad_outputs: tuple[Tensor | None, ...]) -> None:
            d = grad_outputs[index]
            if d is None or pulling():
                return
            if group.state == "shared":
                met = delivered_to()
                if met is not None and met.delivered:
                    met.delivered = 0
                    return
            if group.state in ("shared", "maybe"):  # (its gradient met no op that splits it per sample)
                self.failed()
                raise _unsplit(layer.label, group.state == "shared", a_shape, size, dim, task is not None)
            assert batched is not None, "only a group that may be batched turns out batched"
            on_output_grad(batched, batch_to_front(d.reshape(shape), dim == 0))

        node.register_prehook(catch)
        return alias

    def _tracker(self, layers: list[HookedLayer]) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        """Forward pre-hook of a module with raw parameters: for the call, the module holds tracked
        aliases of them (see ``pergrad._core.shortcuts.shared``), whose meetings with the batch deliver ``g_i``."""

        def swap(module: nn.Module, args: tuple[Any, ...]) -> None:
            batch = self.batch
            if batch is None or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
                return
            self._refuse_direct(layers[0].label, "with raw parameters shared by the batch")
            if self.followed.lean:
                self._unmatched(layers[0].label, None, None, batch.dim)
            self.followed.not_plain()
            saved: list[tuple[nn.Module, str, Tensor, Tensor]] = []
            for layer in layers:
                holder = layer.module  # the module itself, or a ParameterDict/ParameterList of it
                p = holder._parameters.get(layer.param)
                if not (isinstance(p, nn.Parameter) and p.requires_grad):
                    continue
                key = self._key(layer.name)
                kept = Kept(layer, layer.param, self.generation, batch.size, key, task=self._recomputed(), shared=True)
                origin = Origin(p, self._deliver(kept), Group("shared", batch.size, batch.dim), layer.label)
                tap = None if self._to_tap is None else self._to_tap(p, self.generation)
                alias = track(p if tap is None else tap, [origin])
                origin.aliased(alias, alias)
                holder._parameters[layer.param] = origin.tensor  # type: ignore[assignment]
                saved.append((holder, layer.param, p, origin.tensor))
            self._swapped[module] = saved

        return swap

    def _deliver(self, kept: Kept) -> Callable[[Tensor], None]:
        on_output_grad = self._on_output_grad
        return lambda g: on_output_grad(kept, g)

    def _untracker(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook (also when the forward raised): the module's own parameters back in place."""
        for holder, name, p, alias in self._swapped.pop(module, []):
            if holder._parameters.get(name) is alias:  # (FSDP2's forward hook may have put its own back)
                holder._parameters[name] = p  # type: ignore[assignment]

    def _model_returned(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self.followed.recording:
            self.followed.returned()
        if self.batch is not None and self._graph_unchecked:  # the first forward that builds a graph
            self._graph_unchecked = False
            refuse_batch_statistics(output_tensors(output))
        if self._on_model_returned is not None:
            self._on_model_returned()
        if kwargs and self.batch is not None:
            for key in kwargs.keys() & CALL_WATCHERS.keys():
                CALL_WATCHERS[key](kwargs[key], output, self._warned)

    def remove(self) -> None:
        self.uninstall()
        self._root.remove()
        self._root_out.remove()
        self._root_done.remove()
