"""The engine: one backward pass, from the hooks' arrivals to ``.grad``.

During the backward, the hooks hand the engine what arrives (``on_*``), recorded in the backward's
state (``pergrad._core.backward.state``):

1. each hooked layer call's output gradient ``d`` (``on_output_grad``): with ``keep_grad_sample`` its
   rule turns ``(kept input, d)`` into per-sample gradients at once, summed per sample over every
   call of the layer and every layer sharing a parameter; otherwise ``(a, d)`` are kept for the end,
   where a consumer reads them, but consumed at once where one consumer alone reads them and takes them
   (``Consumer.take``: let go while the backward goes on), and let go where none does;
2. each parameter's ``AccumulateGrad`` node (it runs only in ``.backward()``, not in
   ``torch.autograd.grad``) is pre-hooked (``on_accumulate``): a parameter a transform covers gets a
   zero there (its ``.grad`` is written at the end); any other keeps autograd's own sum, rescaled
   where ``reduction`` differs from ``loss_reduction`` (``pergrad._core.backward.grads``).

At the end of the backward (an autograd engine callback) ``_end`` runs, top to bottom: collect the
backward's per-sample gradients into one source, check them, and hand them to each consumer in turn
(``pergrad._core.consumers``: ``grad_sample``, statistics, norms, those a feature added (``add``), the
reduction of each target's transform into ``.grad``: ``p.grad += (1/B) sum_i T(g_i)`` for ``"mean"``,
``sum_i T(g_i)`` for ``"sum"``).
A parallel back-end (``pergrad._core.parallel.world``) then communicates pergrad's part.

Per-sample gradients are those of each sample's OWN loss ``f_i``, where the loss is
``(1/B) sum_i f_i`` (``loss_reduction="mean"``) or ``sum_i f_i`` (``"sum"``): for ``"mean"`` each
sample's output gradient is B times the one autograd delivers, and that factor goes on a copy of
``d`` where that is far smaller, else in place on the rule's results (``sources.run_rule``).

Under loss scaling (``grad_scaler=``, ``loss_scale=``, see ``loss_scale``) autograd delivers ``S``
times every gradient: each output gradient is divided by ``S`` as it arrives (so per-sample
gradients, norms, statistics and activation gradients are those of the samples' own losses, and the
transforms see them), and what pergrad writes into ``.grad`` is multiplied by ``S`` again.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pergrad._core.backward.grads import GradWriter
from pergrad._core.backward.removal import AfterRemoval
from pergrad._core.backward.sources import Fused, Materialized, in_parameter_dtype, no_autocast, no_grad, run_rule
from pergrad._core.backward.state import (
    Arrivals,
    Backward,
    Backwards,
    Unchecked,
    any_replaced,
    queue_at_end,
    saving,
    will_accumulate,
)
from pergrad._core.backward.targets import Targets
from pergrad._core.backward.verify import (
    check_first,
    check_hooked,
    check_part,
    check_partial,
    check_reached,
    check_taps,
    unattributable,
)
from pergrad._core.capture.calls import Call, Detached, HookedLayer, Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad._core.consumers.grad_sample import GradSample, Holding
from pergrad._core.consumers.norms import Norms
from pergrad._core.consumers.reduction import Reduction
from pergrad._core.consumers.statistics import TrackStatistics
from pergrad._core.loss_scale import LossScale, on_device
from pergrad._core.memory.layout import allocating_from
from pergrad._core.memory.pool import BufferPool
from pergrad._core.options import Options
from pergrad._core.parallel.world import World
from pergrad._core.shortcuts.detach import Detacher
from pergrad._core.shortcuts.followed import eager_hook
from pergrad._core.shortcuts.reach import Taps, Unhooked
from pergrad.errors import BatchSizeError, HookStateError, PergradError, SecondOrderError, module_label
from pergrad.statistics import needs


def _shape(a: object) -> object:
    return tuple(a.shape) if isinstance(a, Tensor) else "several inputs"


def _keep_output(arrived: Arrivals, kept: Kept, d: Tensor, part: int) -> None:
    """Add ``d``, the gradient of output ``part`` of ``kept``'s call, to those its rule takes: it runs once per
    call with every output's gradient, at the end of the backward, as they may arrive at different nodes
    (``Engine._flush_outputs``)."""
    _, grads = arrived.outputs.setdefault(id(kept), (kept, [None] * len(kept.a.output_dims)))
    previous = grads[part]
    grads[part] = d if previous is None else previous + d


def _freed_graph(kept: Kept) -> HookStateError:
    """The error for an output gradient that arrived after its call's graph was freed."""
    return HookStateError(
        f"the output gradient of {kept.layer.label} arrived in a backward through a graph an earlier "
        "backward had already run and freed (it ran without retain_graph=True): pergrad let go of the "
        "layer's input then, as autograd let go of what it saved. Pass retain_graph=True to every backward "
        "but the last through the same graph, or run a new forward."
    )


def _two_forwards(name: str) -> HookStateError:
    """The error for a backward that reached layer ``name`` through two forwards."""
    return HookStateError(
        f"one backward pass reached {module_label(name)} through two different forward calls of the model; "
        "per-sample gradients would mix samples of different batches. Run backward once per forward, "
        "or concatenate the batches into one forward. (Layers called directly, outside a call of the "
        "wrapped model, make one forward until one of them is called again: to call a layer twice in one "
        "forward, call it in the wrapped model's forward, or wrap the module whose forward calls it twice.)"
    )


def _batch_sizes(kept: Kept, state: Backward) -> BatchSizeError:
    """The error for a call whose batch size differs from the first call's of the same forward."""
    return BatchSizeError(
        f"{kept.layer.label} saw a batch of {kept.batch_size} samples "
        f"(input shape {_shape(kept.a)}), but {module_label(state.first_layer)} saw {state.batch_size} "
        "in the same forward. Every hooked layer must see the batch on the same dim "
        "(check reshapes that fold the batch into other dims, and batch_first)."
    )


def _output_batch(kept: Kept, d: Tensor) -> BatchSizeError:
    """The error for an output gradient whose batch differs from the call's input's."""
    return BatchSizeError(
        f"{kept.layer.label}: output gradient of shape {tuple(d.shape)} does not match the "
        f"batch of {kept.batch_size} samples of its input"
    )


@dataclass(frozen=True)
class IntegrationCheck:
    """What an integration checks of a library the wrapped model runs inside: ``forward(wrapper)`` at every call
    of the model, ``begin(engine, generation)`` at a backward's first arrival, ``end(engine, batch)`` with the
    core's checks once every gradient arrived. They run only in a process that imported one of ``libraries``."""

    libraries: tuple[str, ...]
    forward: Callable[[Any], None] | None = None
    begin: Callable[[Engine, int], None] | None = None
    end: Callable[[Engine, Batch], None] | None = None


# The integrations' checks by name (``pergrad.integrations.opacus``, ``pergrad.integrations.lightning_loop``)
INTEGRATION_CHECKS: dict[str, IntegrationCheck] = {}


def integration_checks() -> list[IntegrationCheck]:
    """The checks of ``INTEGRATION_CHECKS`` about a library this process imported."""
    return [c for c in INTEGRATION_CHECKS.values() if any(library in sys.modules for library in c.libraries)]


class Engine:
    """Turns kept inputs and output gradients into ``grad_sample``, ``.grad``, norms and statistics."""

    def __init__(
        self,
        options: Options,
        *,
        param_names: dict[nn.Parameter, str],
        loss_scale: LossScale | None = None,
        loss_factor: LossScale | None = None,
    ) -> None:
        self.options = options
        self.param_names = param_names
        self.track_norms = options.norms
        # elementwise second moments: g_i are built where a layer sees many positions (see detach.py)
        self.second_moments = needs(options.track_statistics)[0]
        self.verify_backwards = 1 if options.verify else 0  # backward passes that still run the first one's check
        self.detach_transformed = options.detach_transformed  # off while lazy modules are unmaterialised
        self.loss_scale = loss_scale  # the GradScaler's (grad_scaler=)
        self.loss_factor = loss_factor  # the user's own (loss_scale=: gradient accumulation dividing the loss)
        self.closed = False
        self.second_order = False  # a backward with create_graph=True ran: no weight runs detached any more
        # the autograd nodes of the output gradients (and the layer inputs' gradients) that create_graph=True
        # backward passes of the last forward caught: a later backward that runs one differentiates through
        # them (``_start``)
        self._second_order_nodes: list[Any] = []
        # those of the calls whose parameters such a backward did not accumulate into (torch.autograd.grad of
        # the model's input, for a gradient penalty), with the call's layer: pergrad computed nothing from them
        self._input_gradient_nodes: list[tuple[Any, HookedLayer]] = []
        # the hooks such a backward put on its calls' inputs to catch their gradients (``_catch_input_gradients``)
        self._input_hooks: list[RemovableHandle] = []
        self.layers: list[HookedLayer] = []  # the hooked layers (for messages)
        self._in_recompute = False  # a recomputed layer call announces itself (``on_recompute``)
        self.targets = Targets()
        self.backwards = Backwards(self._start)
        self.writer = GradWriter(options)
        self.pool = BufferPool()  # memory of per-sample tensors, reused across backward passes
        self.detacher = Detacher(self)
        # what reaches a parameter pergrad writes besides its layers' outputs (pergrad._core.shortcuts.reach): checked
        # on every backward unless verify=False
        self.checks_reach = options.verify
        self.taps = Taps(self._taps_param, self._on_tap)
        self.unhooked = Unhooked(self._on_unhooked)  # what reaches a parameter before the user's tensor hooks
        self.after_removal = AfterRemoval()
        self.last_activation_grads: dict[str, Tensor] = {}
        # the consumers of (a, d), in the order they run: each may read what the earlier ones left
        self.grad_sample = GradSample()
        # the statistics' consumer, where some are tracked
        self.statistics = (
            TrackStatistics(options.track_statistics, options.loss_reduction) if options.track_statistics else None
        )
        self.norms = Norms(self.track_norms, self.targets)
        self.reducer = Reduction(self.targets, options.reduction, self.canonical, lambda: self.gradless)
        self.consumers: list[Consumer] = [self.norms, self.reducer]
        if self.statistics is not None:
            self.consumers.insert(0, self.statistics)
        if options.keep_grad_sample:
            self.consumers.insert(0, self.grad_sample)
        self.holding: Holding | None = None  # per-sample gradients held for an audit (``hold``)
        self.accumulators: dict[nn.Parameter, Any] = {}  # each parameter's hooked AccumulateGrad node (the wrapper's)
        # called at a backward's start where a parameter's AccumulateGrad node is no longer the hooked one
        self.on_stale: Callable[[], None] | None = None

    # -- what the rest of the wrapper asks -------------------------------------------------------

    @property
    def world(self) -> World | None:
        """The parallel back-end (``pergrad._core.parallel.distributed``), or None in one process."""
        return self.writer.world

    @world.setter
    def world(self, world: World | None) -> None:
        self.writer.world = world

    @property
    def transformed(self) -> set[nn.Parameter]:
        return self.targets.transformed

    def add(self, consumer: Consumer) -> None:
        """Run ``consumer`` at the end of every backward from now on (a feature's, added when a user asks
        for what it computes), after those added before it and before the reduction into ``.grad``."""
        self.consumers.insert(self.consumers.index(self.reducer), consumer)

    def hold(self) -> Holding:
        """The consumer that hands per-sample gradients to an audit's ``Holder``: made at the first call,
        and run last, so that ``.grad`` is computed as without it."""
        if self.holding is None:
            self.holding = Holding(self.targets)
            self.consumers.append(self.holding)
        return self.holding

    @property
    def gradless(self) -> frozenset[nn.Parameter]:
        """The parameters whose ``.grad`` no consumer needs (``Consumer.gradless``: a projection registered
        with ``grads=False``): where their weight runs detached, their ``.grad`` is left as it is."""
        found: frozenset[nn.Parameter] = frozenset()
        for consumer in self.consumers:
            gradless = consumer.gradless
            if gradless:
                found = gradless if not found else found | gradless
        return found

    def canonical(self, p: nn.Parameter) -> nn.Parameter:
        """The parameter ``p`` is keyed by (FSDP2: the shard of an unsharded parameter)."""
        world = self.writer.world  # (``world``, without the property's call: this runs per parameter per call)
        return p if world is None else world.canonical(p)

    def may_write(self, param: nn.Parameter) -> bool:
        """Whether pergrad may write ``param.grad`` itself in some backward pass: a transform covers it,
        or it may run detached. The same answer on every rank, whatever the batch."""
        if param in self.transformed:
            return True
        builds = self.options.keep_grad_sample or self.track_norms or bool(self.options.track_statistics)
        return self.detach_transformed and builds and param in self.detacher.single

    def samples_in_grad(self, param: nn.Parameter) -> float:
        return self.writer.samples_in_grad(param)

    def new_samples(self, param: nn.Parameter, state: Backward) -> float:
        return self.writer.new_samples(param, state)

    def backward_state(self) -> Backward:
        """The state of the running backward pass."""
        return self.backwards.state()

    def may_tap(self, layer: HookedLayer) -> bool:
        """Whether a call of ``layer`` may read a parameter through a tap (its tapping hooks are
        installed only then)."""
        return any(self._taps_param(p) for _, p in layer.trainable())

    # -- arrivals, during the backward -----------------------------------------------------------

    def on_forward(self) -> None:
        """A forward of the model starts. A backward still running by pergrad's count, outside every backward,
        was stopped by an error raised outside pergrad's hooks (the user's ``autograd.Function``, hook or NaN
        check): its end never ran, and every ``.grad`` that was None before it is None again (as after a
        failed hook of pergrad's: ``on_failed_hook``), so autograd's own sum of a parameter pergrad was to
        write does not stay in ``.grad`` for the next backward to add to."""
        failed = self.backwards.current
        if failed is not None and torch._C._current_graph_task_id() == -1:
            self.writer.abandon(failed)
            self.backwards.ended(failed)
        self.backwards.forward()
        self._second_order_nodes.clear()
        self._input_gradient_nodes.clear()
        if self._input_hooks:  # (left by a backward that failed midway)
            self._drop_input_hooks()

    def on_recompute(self) -> None:
        """A hooked layer is called inside a backward pass (activation checkpointing computes a segment
        again): that backward's state exists from now on, and a backward that starts while it runs is
        the recomputed segment's (reentrant checkpointing: ``Backwards.state``)."""
        if not self.closed:
            self._in_recompute = True
            try:
                self.backwards.recomputing()
            finally:
                self._in_recompute = False

    def on_failed_hook(self) -> None:
        """A hook of pergrad's raised inside the running backward (not in ``on_output_grad``, which sees to
        it): the backward stops there and its end never runs, so every ``.grad`` that was None before it is
        None again (``Writer.abandon``)."""
        if not self.closed:
            self._abandon()

    def on_output_grad(self, kept: Kept, d: Tensor, part: int | None = None) -> None:
        """The gradient ``d`` of a layer call's output (of its output tensor number ``part``, for a rule
        that takes every output: see ``RuleSpec.output_dims``), batch on dim 0."""
        if kept.a is None:  # let go after a backward that freed the call's node (``Arrivals.let_go``)
            raise _freed_graph(kept)
        if self.closed:
            if kept.detached is not None and part is None:
                self.after_removal.on_output_grad(kept, d)
            return
        computes = self.options.keep_grad_sample or self.options.keep_activation_grads or kept.layer.spec.parametrized
        try:
            if not (computes or torch.is_grad_enabled()):  # records (a, d) only: nothing to compute
                self._arrived(kept, d, part)
            else:  # rules compute in the parameters' dtype, with a graph only under create_graph=True (grad mode on)
                with no_autocast(d.device.type):
                    self._arrived(kept, d, part)
        except Exception:  # the backward stops here: its end never runs
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Undo what the failed running backward wrote (``Writer.abandon``); one refused at its start
        (``_start`` raised) wrote nothing."""
        try:
            state = self.backwards.state()
        except PergradError:
            return
        self.writer.abandon(state)

    def _arrived(self, kept: Kept, d: Tensor, part: int | None) -> None:
        state = self.backwards.state()
        if state.mode_unknown:  # grad mode is the backward's here: on only with create_graph=True
            state.mode_unknown, state.create_graph = False, torch.is_grad_enabled()
            self.second_order = self.second_order or state.create_graph
        state.arrived.let_go()
        # the node whose pre-hook delivers d (it runs next), or one of the call's own after it; not for a
        # call on a shared input, delivered at each of its meetings with the batch (``pergrad._core.shortcuts.shared``)
        node = None if kept.shared else saving(torch._C._current_autograd_node())
        if node is not None:
            state.arrived.reached.append((kept, node))
        if state.through_second_order:
            return
        self._check_batch(state, kept, d, part)
        if state.create_graph:
            self._record_second_order(kept, d)
        layer = kept.layer
        # each sample's own output gradient is scale * d: the loss averaged over the batch
        scale = float(kept.batch_size) if self.options.loss_reduction == "mean" else 1.0
        if layer.dtype is not None and d.dtype != layer.dtype:  # autocast: compute in the parameters' dtype
            kept, d = in_parameter_dtype(kept, d, state.loss_scale)
        else:
            d = state.to_sample_units(d)
        arrived = state.arrived
        if self.options.keep_activation_grads and not layer.spec.raw:
            arrived.activation_grads[kept.key if not part else f"{kept.key}[{part}]"] = d * scale
        if kept.detached is not None:
            arrived.detached.append(kept.detached)
        if part is None:
            self._use(state, kept, d, scale)
        else:
            _keep_output(arrived, kept, d, part)

    def _record_second_order(self, kept: Kept, d: Tensor) -> None:
        """In a backward with ``create_graph=True``: refuse a call whose weight ran detached, and record the
        autograd nodes of ``d`` and of the call's inputs' gradients, which a later backward may differentiate
        through (``_start``)."""
        accumulates = self._accumulates(kept.layer)
        self._check_second_order(kept, accumulates)
        if d.grad_fn is not None and accumulates:
            self._second_order_nodes.append(d.grad_fn)
        elif d.grad_fn is not None:
            self._input_gradient_nodes.append((d.grad_fn, kept.layer))
        if not kept.shared:
            self._catch_input_gradients(kept, accumulates)

    def _check_batch(self, state: Backward, kept: Kept, d: Tensor, part: int | None) -> None:
        """The first arrival of a backward fixes its forward and batch size; every later one must match."""
        layer = kept.layer
        if state.generation is None:
            state.generation, state.batch_size, state.first_layer = kept.generation, kept.batch_size, layer.name
            held = [p for p in self.targets.nonlinear if self.writer.holds(p, kept.generation)]
            if held:
                self._refuse_transforming_twice(held)
            for check in integration_checks():
                if check.begin is not None:
                    check.begin(self, kept.generation)
            if self.grad_sample.generations:
                self.grad_sample.drop_stale(kept.generation)
            self.pool.begin()
        elif kept.generation != state.generation:
            raise _two_forwards(layer.name)
        elif kept.batch_size != state.batch_size:
            raise _batch_sizes(kept, state)
        batched = not kept.packed if part is None else kept.a.output_dims[part] is not None
        if batched and d.shape[0] != kept.batch_size:
            raise _output_batch(kept, d)

    def _refuse_transforming_twice(self, held: list[nn.Parameter]) -> None:
        """A backward through a forward that an earlier backward already ran through (``retain_graph=True``)
        may not reach a parameter whose ``.grad`` holds that backward's transformed reduction (``held``), for
        a transform that is not additive: each sample's gradient of the forward is ``g1_i + g2_i``, and
        ``T(g1_i) + T(g2_i)`` is not ``T(g1_i + g2_i)``. Raised at the backward's first arrival, before any
        ``.grad`` changes."""
        nodes = [self.accumulators.get(p) for p in held]
        reached = [p for p, node in zip(held, nodes, strict=True) if node is not None and will_accumulate([node])]
        if not reached:
            return
        target = self.targets.covering(reached[0])
        names = [name for p, name in self.param_names.items() if p in set(reached)]
        raise HookStateError(
            f"a second backward through the same forward (retain_graph=True) reaches {names}, whose .grad already "
            f"holds the first backward's reduction of T(g_i) for these samples, and the transform registered for "
            f"{target.label if target else 'them'} is not additive: each sample's gradient is the sum g1_i + g2_i "
            "of its gradients in both backward passes, and T(g1_i) + T(g2_i) is not T(g1_i + g2_i) (clip_norm(C) "
            "would let each sample contribute up to 2C). Backward the sum of the losses once ((loss1 + "
            "loss2).backward()), or, if each backward is a step of its own, clear .grad between them "
            "(psm.zero_grad() or optimizer.zero_grad())."
        )

    def _check_second_order(self, kept: Kept, accumulates: bool) -> None:
        """A backward with ``create_graph=True`` differentiates what pergrad computes (or, where it does
        not ``accumulate`` into the layer's parameters, what autograd returns): refuse where that
        derivative would be missing (never a silently constant tensor)."""
        layer = kept.layer
        if kept.detached is None:
            return
        what = (
            "what is computed from its per-sample gradients"
            if accumulates
            else "the gradient it returns (of the model's input, for a gradient penalty)"
        )
        raise SecondOrderError(
            f"{'backward' if accumulates else 'torch.autograd.grad'}(create_graph=True) reached {layer.label}, "
            "whose forward ran its weight detached (from the second backward on, pergrad writes a transformed "
            f"weight's .grad itself and autograd skips it), so {what} could not be differentiated through that "
            "weight. Pass detach_transformed=False to PerSampleModule (pergrad also stops detaching once it has "
            "seen a backward with create_graph=True)."
        )

    def _catch_input_gradients(self, kept: Kept, accumulates: bool) -> None:
        """In a backward with ``create_graph=True``, record the autograd node of the gradient that reaches
        each of the call's inputs as it arrives, as the output gradients' (``_arrived``): it is computed
        through the layer's backward (``d_input = d_output @ W``), so a term built from it depends on the
        layer's weights even where ``d`` carries no graph (the constant gradient of ``out.sum()`` at the
        top layer, a one-layer model). Where the backward ``accumulates`` into the layer's parameters
        (a penalty on ``x.grad``), a later backward through it is autograd's own (``through_second_order``);
        where not (``torch.autograd.grad`` of the input, for a gradient penalty), it is refused
        (``_refuse_input_gradient``). A tensor hook sees the gradient also where ``torch.autograd.grad``
        returns it (the input is one of its inputs)."""
        layer = kept.layer

        @eager_hook
        def caught(grad: Tensor) -> None:
            if grad.grad_fn is None:
                return
            if accumulates:
                self._second_order_nodes.append(grad.grad_fn)
            else:
                self._input_gradient_nodes.append((grad.grad_fn, layer))

        hooks = self._input_hooks
        for t in kept.inputs():
            if t.requires_grad:
                if not hooks:
                    queue_at_end(self._drop_input_hooks)
                hooks.append(t.register_hook(caught))

    def _drop_input_hooks(self) -> None:
        """Take ``_catch_input_gradients``'s hooks off the inputs."""
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks.clear()

    def _buffers(self, state: Backward) -> contextlib.AbstractContextManager[Any]:
        """Rules write into the pool's recycled buffers, except where autograd records them (second order)."""
        return contextlib.nullcontext() if state.create_graph else allocating_from(self.pool.take)

    def _use(self, state: Backward, kept: Kept, d: Any, scale: float) -> None:
        """Keep one call's ``(a, d)`` for the end of the backward, have a consumer take it now, or let it go where
        no one reads it; with ``keep_grad_sample``, build its per-sample gradients now (``_build``)."""
        if self.options.keep_grad_sample:
            self._build(state, kept, d, scale)
            return
        layer, arrived = kept.layer, state.arrived
        readers = (consumer for consumer in self.consumers if consumer.reads(kept))
        reader = next(readers, None)
        if reader is None and not (self.verify_backwards > 0 or layer.spec.parametrized):  # no one reads
            arrived.passed.update((self.canonical(p), None) for _, p in layer.trainable())
            return
        built = None
        if layer.spec.parametrized and kept.batch_size > 0:  # it needs the forward's graph: now, not at the end
            with self._buffers(state):
                built = run_rule(layer, kept.a, d, scale)
        call = Call(layer, kept.a, d, scale, built)
        if reader is not None and reader.takes_now and self._takes_now(state, kept, call, reader, readers):
            arrived.passed.update((self.canonical(p), None) for _, p in layer.trainable())
            return
        arrived.calls.append(call)
        if self.verify_backwards > 0:
            self._check_as_it_runs(state, call, read=reader is not None)

    def _build(self, state: Backward, kept: Kept, d: Any, scale: float) -> None:
        """``keep_grad_sample``: run the call's rule now and add its per-sample gradients to the backward's,
        summed per parameter over every call that feeds it."""
        layer, arrived = kept.layer, state.arrived
        if kept.batch_size == 0:  # an empty batch: no rule needs to run
            like = d if isinstance(d, Tensor) else next(g for g in d if g is not None)
            per_sample = {n: like.new_zeros((0, *p.shape)) for n, p in layer.trainable()}
        else:
            with self._buffers(state):
                per_sample = run_rule(layer, kept.a, d, scale)
        for name, g in per_sample.items():
            param = self.canonical(layer.module.get_parameter(name))  # FSDP: the layer holds the unsharded one now
            if g.shape != (kept.batch_size, *param.shape):
                raise HookStateError(
                    f"the rule {layer.spec.fn.__qualname__} for {layer.label} returned shape "
                    f"{tuple(g.shape)} for {name!r}; expected {(kept.batch_size, *param.shape)}"
                )
            previous = arrived.grads.get(param)
            arrived.grads[param] = g if previous is None else previous + g
        if any(consumer.keeps_inputs(kept) for consumer in self.consumers):  # read at the end, beside the built g_i
            arrived.calls.append(Call(layer, kept.a, d, scale, per_sample))

    def _check_as_it_runs(self, state: Backward, call: Call, read: bool) -> None:
        """In the first backward, have ``call``'s parameters compared as their ``AccumulateGrad`` runs
        (``verify.check_part``), not all at the end, where nothing but the check needs every call's
        ``(a, d)`` and autograd's gradient at once: not in a backward with ``create_graph=True`` or of
        an empty batch, with statistics (they read autograd's gradients) or under DDP and FSDP."""
        checking = state.checking
        if checking is None:
            if len(state.arrived.calls) > 1 or state.create_graph or state.mode_unknown or not state.batch_size:
                return  # (decided at the backward's first call)
            if self.options.track_statistics or self.world is not None:
                return
            checking = state.checking = Unchecked()
        params = {self.canonical(p) for _, p in call.layer.trainable()}
        for p in params:
            checking.since.setdefault(p, []).append(call)
        if not read:
            checking.waiting[call] = params

    def _takes_now(self, state: Backward, kept: Kept, call: Call, reader: Consumer, others: Iterator[Consumer]) -> bool:
        """Have ``reader``, the first consumer that reads a call (one that ``takes_now``), take it as its ``d``
        arrives (``Consumer.take``; its ``(a, d)`` are then let go) where no other consumer (``others``) reads
        it, unless the end of the backward needs its ``(a, d)``: the first backward's check, a backward with
        ``create_graph=True``, an empty batch."""
        if next(others, None) is not None:
            return False
        d = call.d
        if self.verify_backwards > 0 or state.create_graph or kept.batch_size == 0 or not isinstance(d, Tensor):
            return False
        if self.world is not None and not self.world.touches:  # FSDP2: detached weights are reached by anchor
            return False
        if not self._accumulates(kept.layer):  # only the parameters it reaches count: told at the end
            return False
        with no_autocast(d.device.type), self._buffers(state):
            return reader.take(call, kept.batch_size, state)

    def _accumulates(self, layer: HookedLayer) -> bool:
        """Whether the running backward runs the hooked ``AccumulateGrad`` node (``on_accumulate``) of every
        trainable parameter of ``layer`` (``backward.will_accumulate``)."""
        nodes = [self.accumulators.get(self.canonical(p)) for _, p in layer.trainable()]
        return None not in nodes and will_accumulate(nodes)

    def on_input_grad(self, generation: int, d: Tensor) -> None:
        """The gradient reaching the model's input (``keep_activation_grads=True``)."""
        if self.closed:
            return
        state = self.backwards.state()
        if state.generation not in (None, generation):
            return  # the mixed-forward error is raised by the layers' hook
        scale = d.shape[0] if self.options.loss_reduction == "mean" else 1
        state.arrived.activation_grads["input"] = state.to_sample_units(d) * scale

    def on_accumulate(self, param: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        """Pre-hook of ``param``'s AccumulateGrad node: what autograd adds to ``param.grad`` (None: a
        detached weight's, touched with no gradient: see ``detach.touch``)."""
        if self.closed:
            return None
        state = self.backwards.state()
        if state.through_second_order:
            return None  # autograd's own sum
        seen = state.autograd
        if param.grad is None and param not in seen.ran:
            seen.fresh[param] = None
        seen.reached[param] = None
        seen.ran[param] = None
        if grad is None:  # pergrad writes its .grad; autograd calls its post-accumulate hooks now
            self.writer.defer_hooks(param)
            return None
        # autograd's sum, before the user's tensor hooks (``grad``: what they returned, which autograd adds)
        summed = seen.unhooked.pop(param, grad)
        if self.options.track_statistics or self.verify_backwards > 0:
            self._autograd_part(state, param, state.to_sample_units(summed))
        self.writer.accumulating(param, state)
        transformed, detached = param in self.transformed, param in self.detacher.current
        if transformed or detached:
            self.writer.defer_hooks(param)
        if not transformed:
            return self.writer.autograd_part(param, grad, state)
        # .grad is written at the end of the backward
        if detached and not self.detacher.is_touch_zero(summed) and bool(summed.any()):  # (rare: a sync is fine)
            self._refuse_detached_gradient(state, param)
        if grad is not summed:  # a hook of the user's returned another tensor: compared at the end
            seen.rehooked.setdefault(param, []).append((summed, grad))
        if summed is seen.tapped.get(param):  # the tap's very tensor, unless another term reached it
            seen.matched.add(param)
        else:
            seen.untapped.setdefault(param, []).append(summed)
        return self.writer.hold(param, grad, state)

    def _refuse_detached_gradient(self, state: Backward, param: nn.Parameter) -> NoReturn:
        """A gradient reached ``param``'s ``AccumulateGrad`` although its weight ran detached in every call:
        nothing of the backward is written."""
        self.writer.abandon(state)
        raise HookStateError(
            unattributable(
                self.param_names[param], "it arrived although every call of its layer ran with the weight detached"
            )
        )

    def _autograd_part(self, state: Backward, param: nn.Parameter, part: Tensor) -> None:
        """Autograd's sum for ``param`` in this backward (``part``, in the samples' units): compared at once by
        the first backward's check as it runs (``verify.check_part``), or kept for it and the statistics."""
        if state.checking is None:
            before = state.autograd.batch_grads.get(param)  # (reentrant checkpointing: a nested backward's part too)
            state.autograd.batch_grads[param] = part if before is None else before + part
            return
        try:
            with no_autocast(part.device.type):
                check_part(state, param, part, self.options.loss_reduction, self.canonical)
        except Exception:  # a rule raised: no .grad of this backward is written
            self.writer.abandon(state)
            raise

    def on_probe(self, grad: Tensor | None) -> Tensor | None:
        """Gradient hook of a probe anchor (see ``Detached``): it runs exactly in backward passes that
        accumulate into ``.grad`` (with no gradient where it is a guard's sentinel: ``detach._Guard``)."""
        if not self.closed:
            self.backwards.state().autograd.probed = True
        return None if grad is None else torch.zeros_like(grad)

    def _taps_param(self, param: nn.Parameter) -> bool:
        """Whether the layers read ``param`` through a tap (``pergrad._core.shortcuts.reach``)."""
        if self.closed or not self.checks_reach or (self.world is not None and not self.world.touches):
            return False
        return self.canonical(param) in self.transformed

    def _on_unhooked(self, param: nn.Parameter, grad: Tensor) -> None:
        """pergrad's hook, first among ``param``'s tensor hooks: ``grad`` is autograd's sum before the user's."""
        if not self.closed:
            self.backwards.state().autograd.unhooked[param] = grad

    def _on_tap(self, param: nn.Parameter, grad: Tensor) -> None:
        """Hook of a tap: ``grad`` is what the layers holding ``param`` sent it in this backward."""
        if not self.closed:
            self.backwards.state().autograd.tapped[self.canonical(param)] = grad

    # -- one backward's life ---------------------------------------------------------------------

    def _start(self, task: int) -> Backward:
        """A new backward pass (a previous one that failed midway may have left its state: dropped)."""
        if _under_compiled_autograd():
            raise HookStateError(COMPILED_AUTOGRAD)
        self.writer.restore_hooks()
        if self.on_stale is not None and any_replaced(self.accumulators.items()):
            self.on_stale()  # new data since the wrapper last bound (a conversion there and back): hooked again
        self.unhooked.place(self.accumulators)  # (hooks the user registered since the last backward included)
        amp = None if self.loss_scale is None else self.loss_scale()
        factor = None if self.loss_factor is None else self.loss_factor()
        scale = amp if factor is None else factor if amp is None else amp * on_device(factor, amp)
        # in its hooks grad mode is that of the backward: on only with create_graph=True (not in a recomputation)
        recomputing = self._in_recompute
        create_graph = torch.is_grad_enabled() and not recomputing
        state = Backward(
            task, loss_scale=scale, amp=amp is not None, create_graph=create_graph, mode_unknown=recomputing
        )
        will_run = torch._C._will_engine_execute_node
        state.through_second_order = any(will_run(node) for node in self._second_order_nodes)
        penalised = next((layer for node, layer in self._input_gradient_nodes if will_run(node)), None)
        if penalised is not None:
            self._refuse_input_gradient(penalised)
            state.through_second_order = True
        self.second_order = self.second_order or state.create_graph  # no weight runs detached from now on
        # Queued by the first hook of the backward, so before the callbacks DDP and FSDP queue
        # later in it (DDP's waits for its buckets' all-reduce).
        queue_at_end(lambda: self._graph_done(state))
        return state

    def _refuse_input_gradient(self, layer: HookedLayer) -> None:
        """Refuse a backward that differentiates a gradient ``torch.autograd.grad(create_graph=True)``
        returned through ``layer`` (a penalty on the input's gradient: R1, WGAN-GP) where it accumulates
        into a parameter whose per-sample gradients pergrad computes. Raised as the backward starts,
        before any of the wrapper's parameters got a gradient from it.

        Such a penalty is a term of each sample's own loss, but its gradient reaches the weights through
        the layers' backward computations (``d_input = d_output @ W``), not through their outputs, so no
        ``(a, d)`` of a layer holds it: pergrad cannot split it into samples."""
        will_run = torch._C._will_engine_execute_node
        for param, node in self.accumulators.items():
            try:
                accumulates = will_run(node)
            except RuntimeError:  # asked of a leaf that torch.autograd.grad captures: not accumulated
                continue
            if not (accumulates and self._per_sample(param)):
                continue
            raise SecondOrderError(
                f"this backward differentiates a gradient that torch.autograd.grad(..., create_graph=True) "
                f"computed through {layer.label} (a gradient penalty, such as R1's or WGAN-GP's on the input), and "
                f"accumulates into parameter {self.param_names[param]!r}, whose per-sample gradients pergrad "
                "computes. The penalty is part of each sample's loss, but its gradient reaches the weights through "
                "the layers' backward computations (d_input = d_output @ W), not through their outputs, so pergrad "
                "cannot split it into samples: it would be missing from grad_sample, norms and the transforms. "
                "Backward the loss without the penalty through pergrad (loss.backward(retain_graph=True)), then take "
                "the penalty's gradient with torch.autograd.grad(penalty, params, allow_unused=True) and add it to "
                ".grad yourself: it is then neither per sample nor transformed. Or compute the per-sample gradients "
                "of the penalised loss with torch.func (vmap over grad) on the unwrapped model."
            )

    def _per_sample(self, param: nn.Parameter) -> bool:
        """Whether pergrad computes anything per sample from ``param``'s gradient (``grad_sample``, norms,
        statistics, a transform, or what a consumer ``covers``)."""
        if self.options.keep_grad_sample or self.track_norms or self.options.track_statistics:
            return True
        return param in self.transformed or any(consumer.covers(param) for consumer in self.consumers)

    def _graph_done(self, state: Backward) -> None:
        """The graph of the backward has run. Under DDP pergrad's part of ``.grad`` is computed now and
        goes into DDP's buckets before DDP waits for them; everything else runs after every callback
        queued during this backward (a callback queued from a callback goes to the end of the queue)."""
        if self.world is not None and self.world.finish_early:
            self._compute(state)
        queue_at_end(lambda: self._finish(state))

    def _finish(self, state: Backward) -> None:
        self.backwards.ended(state)
        try:
            self._compute(state)  # unless it ran before DDP's communication
            if state.error is not None:
                self.writer.abandon(state)
                raise state.error
            if not self.closed:
                self.writer.count_samples(state)
        finally:
            state.arrived.calls.clear()  # the kept inputs and output gradients, before the buffers go back
            state.arrived.let_go(final=True)
            self.pool.end()
            if state.verified:  # the check built what later backward passes do not: not their bound
                self.pool.forget_bound()
            deferred = self.writer.restore_hooks()
        self.writer.run_hooks(state, deferred)

    def _compute(self, state: Backward) -> None:
        """The end of the backward (``_end``), then the world's communication of pergrad's part, which
        runs even when the rest raised (every rank takes part in every collective); an error is kept
        in ``state.error`` and raised by ``_finish``."""
        if state.computed:
            return
        state.computed = True
        first = next(iter(state.autograd.reached), None)
        device = "cpu" if first is None else first.device.type
        grad_mode = torch.enable_grad() if state.create_graph else no_grad()  # second order: differentiable
        try:
            with no_autocast(device), grad_mode, self._buffers(state):
                self._end(state)
        except Exception as err:
            state.error = err
        if self.world is not None:
            with torch.no_grad():
                self.world.flush(state, failed=state.error is not None)

    def _end(self, state: Backward) -> None:
        """One backward's end: collect its per-sample gradients, check them, hand them to the consumers."""
        if self.closed or state.through_second_order:
            return
        if self.options.keep_activation_grads:
            self.last_activation_grads = state.arrived.activation_grads
        if state.batch_size is None and not state.autograd.reached:
            return
        batch = self._collect(state)
        self._check(batch)
        for consumer in self.consumers:
            consumer.consume(batch)

    def _collect(self, state: Backward) -> Batch:
        """The backward's per-sample gradients as one source, with every parameter it reached."""
        self._flush_outputs(state)
        owned = self._reach_detached(state) if state.arrived.detached else []
        source: Materialized | Fused = (
            Materialized(state.arrived.grads)
            if self.options.keep_grad_sample
            else Fused(state.arrived.calls, None if self.world is None else self.world.canonical)
        )
        write = functools.partial(self.writer.add, state=state)
        unwritten = {p for detached in state.arrived.detached for p in detached.params} & self.gradless
        return Batch(state, source, dict(state.autograd.reached), self.param_names, write, owned, unwritten)

    def _flush_outputs(self, state: Backward) -> None:
        """Run the rules that take every output's gradient, once per call (see ``RuleSpec.output_dims``)."""
        for kept, grads in state.arrived.outputs.values():
            scale = float(kept.batch_size) if self.options.loss_reduction == "mean" else 1.0
            self._use(state, kept, tuple(grads), scale)
        state.arrived.outputs.clear()

    def _reach_detached(self, state: Backward) -> list[nn.Parameter]:
        """Add the weights that ran detached to what the backward reached, where it did (autograd computed
        no gradient for them); returns those no transform covers (``.grad`` is their plain reduction),
        but for those whose ``.grad`` is not needed (``gradless``: left as it is)."""
        touched = self.world is None or self.world.touches  # their AccumulateGrad runs (detach.touch)
        reached = state.autograd.reached
        gradless = self.gradless
        owned: dict[nn.Parameter, None] = {}
        for detached in state.arrived.detached:
            if touched:  # reached in the backward passes that run their AccumulateGrad
                params = [p for p in detached.params if p in reached]
            else:  # reached in the backward passes that reach their anchor
                params = self._reached_by_anchor(state, detached)
            reached.update(dict.fromkeys(params))
            owned.update(dict.fromkeys(p for p in params if p not in self.transformed and p not in gradless))
        return list(owned)

    def _reached_by_anchor(self, state: Backward, detached: Detached) -> list[nn.Parameter]:
        """``detached``'s weights where the backward reached its anchor (its probe's hook ran, or autograd
        reached the anchor parameter), else none: where their ``AccumulateGrad`` does not run (FSDP2)."""
        anchor = (
            state.autograd.probed
            if detached.probe
            else self.canonical(cast(nn.Parameter, detached.anchor)) in state.autograd.reached
        )
        return list(detached.params) if anchor else []

    def _check(self, batch: Batch) -> None:
        """What every backward is checked for, and the first backward's sums (``pergrad._core.backward.verify``)."""
        state, source = batch.state, batch.source
        known = state.arrived.grads if isinstance(source, Materialized) else source.uses
        check_reached(state, known, self.param_names, self.layers, self.canonical)
        check_partial(state, self.targets, known, self.layers, self.canonical)
        if state.autograd.rehooked:
            check_hooked(state, self.param_names)
        if state.autograd.untapped:
            check_taps(state, self.detacher.current, self.param_names)
        for check in integration_checks():
            if check.end is not None:
                check.end(self, batch)
        if self.verify_backwards > 0 and batch.size > 0 and batch.params:
            self.verify_backwards -= 1
            state.verified = True
            check_first(batch, self.options.loss_reduction, self.canonical)


def _under_compiled_autograd() -> bool:
    """Whether compiled autograd traces the running backward (``torch._dynamo.compiled_autograd``, which every call
    of a function compiled with ``torch._dynamo.config.compiled_autograd`` on turns on around itself): it runs the
    hooks of the backward while it traces them into a graph, and pergrad's end of a backward needs autograd's own
    engine (its callbacks, its graph task), which torch refuses there (``COMPILED_AUTOGRAD``)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and bool(compiled_autograd.in_compiled_autograd_region)


COMPILED_AUTOGRAD = (
    "this backward runs under compiled autograd (torch._dynamo.compiled_autograd: turned on around every call "
    "of a function compiled while torch._dynamo.config.compiled_autograd was True, or around code with "
    "compiled_autograd._enable(...)). Compiled autograd traces the backward's hooks into a graph, and "
    "pergrad's per-sample work at the end of the backward needs autograd's own engine, which compiled "
    "autograd replaces. Nothing was written into .grad. Run this backward without compiled autograd: set "
    "torch._dynamo.config.compiled_autograd = False before torch.compile(...) of the function that calls "
    "loss.backward() (then compile it again), or call it outside compiled_autograd._enable. torch.compile of "
    "the model, or of a whole training step with loss.backward() inside it, works with pergrad, whose hooks "
    "run eagerly in autograd's engine."
)
