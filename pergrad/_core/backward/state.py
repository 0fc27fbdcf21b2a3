"""The state of one backward pass, split by who writes it, and which backward a hook runs in.

A backward pass is one autograd graph task. Its state is written by three parties, one part each:

- ``Arrivals``: what the hooked layers delivered (each call's output gradient; per-sample
  gradients where they are built as they arrive);
- ``Accumulated``: what autograd's ``AccumulateGrad`` nodes saw (which parameters the backward
  reached, autograd's own batch gradient), and what the taps passed on (``pergrad._core.shortcuts.reach``);
- ``Written``: what pergrad wrote into ``.grad`` (``pergrad._core.backward.grads``).

``Backward`` holds them with what identifies the pass (its forward, its batch size, its loss scale)
and how far its end-of-backward work went. ``Backwards`` tells, from inside a hook, which backward
is running: a nested graph task of reentrant activation checkpointing is part of the backward that
recomputed its segment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pergrad._core.capture.calls import Call, Detached, Kept
from pergrad._core.loss_scale import on_device
from pergrad._core.shortcuts.followed import eager_hook
from pergrad.registry import LayerCall


@dataclass
class Arrivals:
    """What the hooked layers delivered in this backward."""

    grads: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # built as they arrive (keep_grad_sample)
    calls: list[Call] = field(default_factory=list)  # each call's (a, d), read at the end (keep_grad_sample=False)
    # the calls that arrived at an autograd node holding saved tensors, with that node (``let_go``)
    reached: list[tuple[Kept, Any]] = field(default_factory=list)
    passed: dict[nn.Parameter, None] = field(default_factory=dict)  # of calls whose (a, d) no one reads
    # by consumer: what it computed of the calls it took as their d arrived (``Consumer.take``)
    taken: dict[Any, Any] = field(default_factory=dict)
    outputs: dict[int, tuple[Kept, list[Tensor | None]]] = field(default_factory=dict)  # id(kept): each output's d
    activation_grads: dict[str, Tensor] = field(default_factory=dict)
    detached: list[Detached] = field(default_factory=list)  # of the calls whose output gradient arrived

    def let_go(self, final: bool = False) -> None:
        """Let go of the input of every call of this backward whose node has run and freed the tensors it
        saved (``holds_saved``: the backward runs without ``retain_graph=True``), as autograd lets go of
        them: the graph may outlive the backward (the loss a training loop keeps until the next step),
        and a layer input held by it would stay alive through the next forward. Autograd refuses to run
        such a node again, so no later backward needs the input. A call whose ``(a, d)`` the end of the
        backward reads holds its own reference (``Call``) until then; one whose rule takes every output's
        gradient is read from its ``Kept`` at the end (``final``)."""
        waiting = []
        for kept, node in self.reached:
            if not final and isinstance(kept.a, LayerCall) and kept.a.output_dims:
                waiting.append((kept, node))
            elif not holds_saved(node):
                kept.a = None
        self.reached[:] = waiting


@dataclass
class Accumulated:
    """What autograd's ``AccumulateGrad`` nodes (and the taps in front of them) saw in this backward."""

    reached: dict[nn.Parameter, None] = field(default_factory=dict)  # ordered set
    ran: dict[nn.Parameter, None] = field(default_factory=dict)  # AccumulateGrad ran (autograd's part)
    batch_grads: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # autograd's, in the samples' units
    overwrite: dict[nn.Parameter, None] = field(default_factory=dict)  # .grad holds autograd's sum only
    fresh: dict[nn.Parameter, None] = field(default_factory=dict)  # .grad was None when its AccumulateGrad ran
    probed: bool = False  # a probe anchor's AccumulateGrad ran (``detach.Detached``)
    tapped: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # what each tap passed on
    # what else reached a tapped parameter's AccumulateGrad: checked against its tap at the end
    # (reentrant checkpointing runs it twice: the recomputed layers' part in a nested backward)
    untapped: dict[nn.Parameter, list[Tensor]] = field(default_factory=dict)
    matched: set[nn.Parameter] = field(default_factory=set)  # the tap's very tensor arrived
    # what autograd summed for a parameter with tensor hooks of the user's, before them (``pergrad._core.shortcuts.reach``)
    unhooked: dict[nn.Parameter, Tensor] = field(default_factory=dict)
    # a parameter pergrad writes whose tensor hooks returned another tensor: (autograd's sum, what they returned)
    rehooked: dict[nn.Parameter, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)


@dataclass
class Unchecked:
    """The first backward's check as its backward runs (``pergrad._core.backward.verify.check_part``): each
    parameter is compared when its ``AccumulateGrad`` runs, with the calls that fed it since its sums last
    agreed with autograd's (``since``; autograd's parts since then wait in ``Accumulated.batch_grads``). A
    call no consumer reads is kept only for the check: let go once every parameter it feeds agreed
    (``waiting``: those that have not yet)."""

    since: dict[nn.Parameter, list[Call]] = field(default_factory=dict)
    agreed: dict[nn.Parameter, None] = field(default_factory=dict)
    waiting: dict[Call, set[nn.Parameter]] = field(default_factory=dict)


@dataclass
class Written:
    """What pergrad wrote into ``.grad`` in this backward."""

    params: dict[nn.Parameter, None] = field(default_factory=dict)  # in order
    prior: dict[nn.Parameter, float] = field(default_factory=dict)  # samples already averaged into .grad
    # .grad holds a part of this backward's forward already (an earlier backward of it): its samples are counted
    again: dict[nn.Parameter, None] = field(default_factory=dict)


@dataclass
class Backward:
    """One backward pass (one autograd graph task, with the nested ones that joined it)."""

    task_id: int
    loss_scale: Tensor | None = None  # the factor the loss was multiplied by (grad_scaler=, loss_scale=); None: 1
    amp: bool = False  # a GradScaler's scale is part of it: a NaN or Inf is an overflow that must reach .grad
    generation: int | None = None  # the forward it runs through
    batch_size: int | None = None
    first_layer: str = ""
    nested: bool = False  # a nested backward of a recomputed segment joined it (reentrant checkpointing)
    create_graph: bool = False  # backward(create_graph=True): what pergrad computes is differentiable too
    # started inside a recomputation (activation checkpointing), whose grad mode is on whatever the backward's:
    # ``create_graph`` is read at its first arrival (``Engine._arrived``)
    mode_unknown: bool = False
    # it differentiates through an earlier create_graph=True backward (a penalty built from per-sample
    # gradients): not a backward of per-sample losses, so autograd's own numbers, pergrad stays out
    through_second_order: bool = False
    arrived: Arrivals = field(default_factory=Arrivals)
    autograd: Accumulated = field(default_factory=Accumulated)
    written: Written = field(default_factory=Written)
    computed: bool = False  # the end-of-backward work ran (see ``Engine._graph_done``)
    verified: bool = False  # this backward ran the first backward's check
    checking: Unchecked | None = None  # that check, parameter by parameter as it runs (``Engine._use``)
    error: BaseException | None = None  # what it raised, re-raised once the wrapper's communication is done

    def to_grad_units(self, t: Tensor) -> Tensor:
        """``t`` (in the samples' own units) in the units of ``.grad``: times the loss scale."""
        return t if self.loss_scale is None else t * on_device(self.loss_scale, t)

    def to_sample_units(self, t: Tensor) -> Tensor:
        """A gradient autograd delivered (times the loss scale) in the samples' own units."""
        return t if self.loss_scale is None else t / on_device(self.loss_scale, t)


class Backwards:
    """Which backward pass a hook runs in; ``start(task_id)`` makes the state of a new one."""

    def __init__(self, start: Callable[[int], Backward]) -> None:
        self._start = start
        self.current: Backward | None = None
        self._nested: dict[int, Backward] = {}  # graph tasks of nested backward passes -> the outer one's state
        self._recomputing: int | None = None  # the backward that last recomputed a segment

    def state(self) -> Backward:
        """The state of the running backward pass. A nested one -- reentrant activation checkpointing
        backwards a recomputed segment in a graph task of its own, inside the outer backward -- is part
        of the backward that recomputed it (``recomputing``): one set of per-sample gradients, one
        end-of-backward work, when the outer backward ends."""
        task = torch._C._current_graph_task_id()
        current = self.current
        if current is not None:
            if current.task_id == task:
                return current
            nested = self._nested_in(current, task)
            if nested is not None:
                return nested
        self.current = self._start(task)
        return self.current

    def _nested_in(self, current: Backward, task: int) -> Backward | None:
        """The state of the ``current`` backward where graph task ``task`` is nested in it (it started while
        ``current`` recomputed a segment), else None."""
        if current.task_id == self._recomputing:
            self._nested[task] = current
            current.nested = True
        return self._nested.get(task)

    def recomputing(self) -> None:
        """A hooked layer is called inside the running backward (activation checkpointing computes a
        segment again): a backward that starts while it runs is that segment's."""
        self._recomputing = self.state().task_id

    def forward(self) -> None:
        """A forward of the model starts: no backward is recomputing a segment any more."""
        self._recomputing = None

    def ended(self, state: Backward) -> None:
        """``state``'s backward ended (its nested ones with it)."""
        if self.current is state:
            self.current = None
        self._nested.clear()
        self._recomputing = None


def queue_at_end(callback: Callable[[], Any]) -> None:
    """Run ``callback`` when the running backward's graph has run (after callbacks queued before it)."""
    torch.autograd.Variable._execution_engine.queue_callback(eager_hook(callback))


_SAVED: dict[type, tuple[str, ...]] = {}  # by type of autograd node: the attributes that hold its saved tensors


def holds_saved(node: Any) -> bool:
    """Whether the autograd ``node`` holds a tensor saved for its backward (or what a saved-tensors hook
    packed for it), read without unpacking anything. A backward that ran it without ``retain_graph=True``
    frees them, and autograd then refuses to run it again: ``holds_saved`` true before and false after
    tells that backward apart from one that retained the graph."""
    if node is None:
        return False
    kind = type(node)
    names = _SAVED.get(kind)
    if names is None:
        names = _SAVED[kind] = tuple(name for name in dir(kind) if name.startswith("_raw_saved_"))
    for name in names:
        try:
            found = getattr(node, name)
        except RuntimeError:  # a custom Function's, freed
            return False
        for saved in found if isinstance(found, tuple | list) else (found,):
            if saved is not None and (saved.data is not None or saved.unpack_hook is not None):
                return True
    return False


def saving(node: Any, depth: int = 2) -> Any:
    """``node``, or the first node within ``depth`` steps after it in the backward that holds saved tensors
    (``holds_saved``); None if none does. Mostly the rest of the same layer's backward: a Linear on
    sequences is caught at the reshape after its matmul, a convolution run detached at pergrad's zero
    added to its output. Any such node that has run tells whether its backward retained the graph."""
    level = [node]
    for _ in range(depth + 1):
        for found in level:
            if holds_saved(found):
                return found
        level = [fn for found in level if found is not None for fn, _ in found.next_functions if fn is not None]
    return None


def any_replaced(accumulators: Iterable[tuple[Tensor, Any]]) -> bool:
    """Whether some parameter's current ``AccumulateGrad`` node (the one a backward through a new forward
    runs) is not the one paired with it in ``accumulators``: torch replaces it when the parameter gets data of
    another dtype or device (``model.to``, ``.double()``), also when a second conversion brings dtype and
    device back. Grad mode is switched once for all of them."""
    with torch.enable_grad():
        for param, node in accumulators:
            view = param.view_as(param)
            assert view.grad_fn is not None
            if view.grad_fn.next_functions[0][0] is not node:
                return True
    return False


def will_accumulate(nodes: Iterable[Any]) -> bool:
    """Whether the running backward runs every one of these ``AccumulateGrad`` nodes: not in
    ``torch.autograd.grad`` (which captures its inputs' gradients instead), nor for the parameters that
    ``backward(inputs=...)`` leaves out."""
    will_run = torch._C._will_engine_execute_node
    try:
        return all(will_run(node) for node in nodes)
    except RuntimeError:  # asked of a leaf that torch.autograd.grad captures
        return False
