"""The engine: per backward pass, run the rules, apply the transforms, reduce into ``.grad``.

One backward pass goes like this:

1. each time a hooked layer's output gradient arrives, its rule turns ``(kept input, d)`` into
   per-sample gradients, summed per sample over every call of the layer and every layer that
   shares a parameter;
2. each parameter's ``AccumulateGrad`` node (it runs only in ``.backward()``, not in
   ``torch.autograd.grad``) is pre-hooked: a parameter that a transform covers gets a zero there
   (its ``.grad`` is written in step 3); any other parameter keeps autograd's own sum, rescaled
   when ``reduction`` differs from ``loss_reduction``;
3. at the end of the backward (an autograd engine callback) every target's transform is applied
   to its per-sample gradients and the reduction is added to ``.grad``:
   ``p.grad += (1/B) sum_i T(g_i)`` for ``"mean"``, ``sum_i T(g_i)`` for ``"sum"``.

Per-sample gradients are those of each sample's OWN loss ``f_i``, where the loss is
``(1/B) sum_i f_i`` (``loss_reduction="mean"``) or ``sum_i f_i`` (``"sum"``): for ``"mean"`` each
sample's output gradient is B times the one autograd delivers, and that factor goes on a copy of
``d`` where that is far smaller, else in place on the rule's results (``sources.run_rule``).

Under loss scaling (``grad_scaler=``, see ``loss_scale``) autograd delivers ``S`` times every
gradient: each output gradient is divided by ``S`` as it arrives (so per-sample gradients, norms,
statistics and activation gradients are those of the samples' own losses, and the transforms see
them), and what pergrad writes into ``.grad`` is multiplied by ``S`` (the scaler's units).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from .detach import Detached, Detacher, has_tensor_hooks
from .errors import RECOMPUTED, BatchSizeError, HookStateError, TransformError, module_label
from .hooks import HookedLayer, Kept
from .layout import allocating_from, may_hold_true
from .loss_scale import LossScale, on_device
from .pool import BufferPool
from .reach import Taps
from .sources import Call, Fused, Materialized, run_rule
from .statistics import Statistics, compute_statistics, needs
from .transforms import Scaling, Transform, check_output, check_unmodified
from .verify import check_sums, unattributable, unreached

if TYPE_CHECKING:
    from .distributed import World


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Rules compute in the parameters' dtype: autocast off where it is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _no_grad() -> contextlib.AbstractContextManager[Any]:
    """``torch.no_grad()`` where grad mode is on (in a backward it is off unless ``create_graph``)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def _shape(a: object) -> object:
    return tuple(a.shape) if isinstance(a, Tensor) else "several inputs"


def _all_finite(grads: Iterable[Tensor]) -> Tensor:
    """Whether every value of ``grads`` is finite, as a tensor on their device (one read of each, no
    temporary of their size: the inf-norm propagates NaN and Inf)."""
    found = [torch.isfinite(torch.linalg.vector_norm(g, float("inf"))) for g in grads if g.numel()]
    return torch.stack(found).all() if found else torch.tensor(True)


def _in_parameter_dtype(kept: Kept, d: Tensor) -> tuple[Kept, Tensor]:
    """``kept`` and ``d`` in the dtype of the layer's parameters (they differ under autocast)."""
    dtype = kept.layer.dtype
    if dtype is None or d.dtype == dtype:
        return kept, d
    if isinstance(kept.a, Tensor) and kept.a.is_floating_point() and kept.a.dtype != dtype:
        kept = replace(kept, a=kept.a.to(dtype))
    return kept, d.to(dtype)


@dataclass
class Target:
    """A transform and the parameters it sees, keyed as the transform sees them."""

    label: str  # for messages: 'module "0"', 'parameter "2.weight"', 'the whole model'
    params: dict[str, nn.Parameter]
    transform: Transform


@dataclass
class _Backward:
    """State of one backward pass (one autograd graph task)."""

    task_id: int
    generation: int | None = None
    batch_size: int | None = None
    first_layer: str = ""
    grads: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # keep_grad_sample=True
    calls: list[Call] = field(default_factory=list)  # keep_grad_sample=False
    passed: dict[nn.Parameter, None] = field(default_factory=dict)  # of calls whose (a, d) no one reads
    outputs: dict[int, tuple[Kept, list[Tensor | None]]] = field(default_factory=dict)  # id(kept): each output's d
    reached: dict[nn.Parameter, None] = field(default_factory=dict)  # ordered set
    batch_grads: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # autograd's, before accumulation
    overwrite: dict[nn.Parameter, None] = field(default_factory=dict)  # .grad holds autograd's sum only
    prior: dict[nn.Parameter, float] = field(default_factory=dict)  # samples already averaged into .grad
    activation_grads: dict[str, Tensor] = field(default_factory=dict)
    detached: list[Detached] = field(default_factory=list)  # of the calls whose output gradient arrived
    probed: bool = False  # a probe anchor's AccumulateGrad ran
    written: dict[nn.Parameter, None] = field(default_factory=dict)  # .grad written by pergrad, in order
    accumulated: dict[nn.Parameter, None] = field(default_factory=dict)  # AccumulateGrad ran (autograd's part)
    computed: bool = False  # the end-of-backward work ran (see ``Engine._graph_done``)
    verified: bool = False  # this backward ran the first backward's check
    error: BaseException | None = None  # what it raised, re-raised once the wrapper's communication is done
    loss_scale: Tensor | None = None  # the factor the loss was multiplied by (grad_scaler=, loss_scale=); None: 1
    amp: bool = False  # a GradScaler's scale is part of it: a NaN or Inf is an overflow that must reach .grad
    tapped: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # what each tap passed on (``pergrad.reach``)
    # what else reached a transformed parameter's AccumulateGrad: checked against its tap at the end
    # (reentrant checkpointing runs it twice: the recomputed layers' part in a nested backward)
    untapped: dict[nn.Parameter, list[Tensor]] = field(default_factory=dict)
    matched: set[nn.Parameter] = field(default_factory=set)  # the tap's very tensor arrived
    nested: bool = False  # a nested backward of a recomputed segment joined it (reentrant checkpointing)


class Engine:
    """Turns kept inputs and output gradients into ``grad_sample``, ``.grad``, norms and statistics."""

    def __init__(
        self,
        *,
        param_names: dict[nn.Parameter, str],
        loss_reduction: str,
        reduction: str,
        keep_grad_sample: bool,
        track_norms: bool = False,
        track_statistics: frozenset[str] = frozenset(),
        accumulate: str = "backward",
        keep_activation_grads: bool = False,
        world: World | None = None,
        verify_backwards: int = 1,
        detach_transformed: bool = False,
        loss_scale: LossScale | None = None,
        loss_factor: LossScale | None = None,
    ) -> None:
        self.world = world
        self.loss_scale = loss_scale  # the GradScaler's (grad_scaler=)
        self.loss_factor = loss_factor  # the user's own (loss_scale=: gradient accumulation dividing the loss)
        self.detach_transformed = detach_transformed
        self.verify_backwards = verify_backwards
        self.param_names = param_names
        self.layers: list[HookedLayer] = []  # the hooked layers (for messages)
        self.keep_activation_grads = keep_activation_grads
        self.last_activation_grads: dict[str, Tensor] = {}
        self.running_mean = accumulate == "samples" and reduction == "mean"
        self._seen: dict[nn.Parameter, tuple[float, int, int]] = {}  # samples in .grad, id and version of .grad
        self.loss_reduction = loss_reduction
        self.reduction = reduction
        self.keep_grad_sample = keep_grad_sample
        self.track_norms = track_norms or bool(track_statistics)
        self.track_statistics = track_statistics  # the names of the statistics computed (none: empty)
        # elementwise second moments: g_i are built where a layer sees many positions (see detach.py)
        self.second_moments = needs(track_statistics)[0]
        self.targets: list[Target] = []
        self.transformed: set[nn.Parameter] = set()
        self._needs_norms: set[nn.Parameter] = set()
        self.closed = False
        self.last_sq_norms: dict[nn.Parameter, Tensor] = {}
        self.last_statistics: Statistics | None = None
        self.last_dropped: dict[str, Tensor] = {}  # target label -> [B] mask of the samples left out
        self._current: _Backward | None = None
        self._grad_sample_generation: dict[nn.Parameter, int] = {}
        self.pool = BufferPool()  # memory of per-sample tensors, reused across backward passes
        self.detacher = Detacher(self)
        self._deferred: dict[nn.Parameter, dict[Any, Any]] = {}  # post-accumulate-grad hooks held back
        self._nested: dict[int, _Backward] = {}  # graph tasks of nested backward passes -> the outer one's state
        self._recomputing: int | None = None  # the backward that last recomputed a segment (on_recompute)
        # what reaches a parameter pergrad writes besides its layers' outputs (pergrad.reach): checked
        # on every backward unless verify=False
        self.checks_reach = verify_backwards > 0
        self.taps = Taps(self._taps_param, self._on_tap)
        # by graph task: the calls with detached weights whose backward runs after remove()
        self._removed: dict[int, list[tuple[Call, tuple[nn.Parameter, ...]]]] = {}

    def on_probe(self, grad: Tensor | None) -> Tensor | None:
        """Gradient hook of a probe anchor (see ``Detached``): it runs exactly in backward passes that
        accumulate into ``.grad`` (with no gradient where it is a guard's sentinel: ``detach._Guard``)."""
        if not self.closed:
            self._backward_state().probed = True
        return None if grad is None else torch.zeros_like(grad)

    def _taps_param(self, param: nn.Parameter) -> bool:
        """Whether the layers read ``param`` through a tap (``pergrad.reach``)."""
        if self.closed or not self.checks_reach or (self.world is not None and not self.world.touches):
            return False
        return self.canonical(param) in self.transformed and not has_tensor_hooks(param)

    def may_tap(self, layer: HookedLayer) -> bool:
        """Whether a call of ``layer`` may read a parameter through a tap (its tapping hooks are
        installed only then)."""
        return any(self._taps_param(p) for _, p in layer.trainable())

    def _on_tap(self, param: nn.Parameter, grad: Tensor) -> None:
        """Hook of a tap: ``grad`` is what the layers holding ``param`` sent it in this backward."""
        if not self.closed:
            self._backward_state().tapped[self.canonical(param)] = grad

    # -- called from hooks during backward -------------------------------------------------------

    def on_recompute(self) -> None:
        """A hooked layer is called inside a backward pass (activation checkpointing computes a segment
        again): that backward's state exists from now on, its end-of-backward work queued in it, and a
        backward that starts while it runs is the recomputed segment's (reentrant checkpointing)."""
        if not self.closed:
            self._recomputing = self._backward_state().task_id

    def on_forward(self) -> None:
        """A forward of the model starts: no backward is recomputing a segment any more."""
        self._recomputing = None

    def _backward_state(self) -> _Backward:
        """The state of the running backward pass. A nested one -- reentrant activation checkpointing
        backwards a recomputed segment in a graph task of its own, inside the outer backward -- is part
        of the backward that recomputed it (``on_recompute``): one set of per-sample gradients, one
        end-of-backward work, when the outer backward ends."""
        task = torch._C._current_graph_task_id()
        current = self._current
        if current is not None and current.task_id != task:
            if current.task_id == self._recomputing:
                self._nested[task] = current
                current.nested = True
            nested = self._nested.get(task)
            if nested is not None:
                return nested
        if current is not None and current.task_id == task:
            return current
        # A new backward pass. A previous one that failed midway left its state here: drop it.
        self.restore_deferred_hooks()
        amp = None if self.loss_scale is None else self.loss_scale()
        factor = None if self.loss_factor is None else self.loss_factor()
        scale = amp if factor is None else factor if amp is None else amp * on_device(factor, amp)
        state = _Backward(task, loss_scale=scale, amp=amp is not None)
        self._current = state
        # Queued by the first hook of the backward, so before the callbacks DDP and FSDP queue
        # later in it (DDP's waits for its buckets' all-reduce).
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._graph_done(state))
        return state

    def backward_state(self) -> _Backward:
        """The state of the running backward pass (for ``pergrad.distributed``)."""
        return self._backward_state()

    def _graph_done(self, state: _Backward) -> None:
        """The graph of the backward has run. Under DDP pergrad's part of ``.grad`` is computed now and
        goes into DDP's buckets before DDP waits for them; everything else runs after every callback
        queued during this backward (a callback queued from a callback goes to the end of the queue)."""
        if self.world is not None and self.world.finish_early:
            self._compute(state)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(state))

    def on_output_grad(self, kept: Kept, d: Tensor, part: int | None = None) -> None:
        """The gradient ``d`` of a layer call's output (of its output tensor number ``part``, for a rule
        that takes every output: see ``RuleSpec.output_dims``), batch on dim 0."""
        if self.closed:
            if kept.detached is not None and part is None:
                self._after_removal(kept, d)
            return
        computes = self.keep_grad_sample or self.keep_activation_grads or kept.layer.spec.parametrized
        if not (computes or torch.is_grad_enabled()):  # records (a, d) only: nothing to compute or keep off the graph
            self._on_output_grad(kept, d, part)
            return
        # rules compute in the parameters' dtype, and build no graph
        with _no_autocast(d.device.type), torch.no_grad():
            self._on_output_grad(kept, d, part)

    def _on_output_grad(self, kept: Kept, d: Tensor, part: int | None = None) -> None:
        state = self._backward_state()
        layer = kept.layer
        if state.generation is None:
            state.generation, state.batch_size, state.first_layer = kept.generation, kept.batch_size, layer.name
            self._recycle_stale(kept.generation)
        elif kept.generation != state.generation:
            raise HookStateError(
                f"one backward pass reached {module_label(layer.name)} through two different forward calls of the model; "
                "per-sample gradients would mix samples of different batches. Run backward once per forward, "
                "or concatenate the batches into one forward. (Layers called directly, outside a call of the "
                "wrapped model, make one forward until one of them is called again: to call a layer twice in one "
                "forward, call it in the wrapped model's forward, or wrap the module whose forward calls it twice.)"
            )
        elif kept.batch_size != state.batch_size:
            raise BatchSizeError(
                f"{layer.label} saw a batch of {kept.batch_size} samples "
                f"(input shape {_shape(kept.a)}), but {module_label(state.first_layer)} saw {state.batch_size} "
                "in the same forward. Every hooked layer must see the batch on the same dim "
                "(check reshapes that fold the batch into other dims, and batch_first)."
            )
        batched = not kept.packed if part is None else kept.a.output_dims[part] is not None
        if batched and d.shape[0] != kept.batch_size:
            raise BatchSizeError(
                f"{layer.label}: output gradient of shape {tuple(d.shape)} does not match the "
                f"batch of {kept.batch_size} samples of its input"
            )
        # each sample's own output gradient is scale * d: the loss averaged over the batch
        scale = float(kept.batch_size) if self.loss_reduction == "mean" else 1.0
        cast = layer.dtype is not None and d.dtype != layer.dtype
        if cast:  # autocast: compute in the parameters' dtype
            kept, d = _in_parameter_dtype(kept, d)
            if state.loss_scale is not None:  # unscale after the cast: no underflow in float16
                d.div_(on_device(state.loss_scale, d))  # our own copy
        elif state.loss_scale is not None:
            d = d / on_device(state.loss_scale, d)
        if self.keep_activation_grads and not layer.spec.raw:
            state.activation_grads[kept.key if not part else f"{kept.key}[{part}]"] = d * scale
        if kept.detached is not None:
            state.detached.append(kept.detached)
        if part is not None:
            # the rule runs once per call with every output's gradient, at the end of the backward:
            # they may arrive at different nodes (``_flush_outputs``)
            _, grads = state.outputs.setdefault(id(kept), (kept, [None] * len(kept.a.output_dims)))
            previous = grads[part]
            grads[part] = d if previous is None else previous + d
            return
        self._use(state, kept, d, scale)

    def _after_removal(self, kept: Kept, d: Tensor) -> None:
        """The output gradient of a call that ran with its weight detached, in a backward after
        ``remove()``: pergrad is gone, so the weight gets autograd's own gradient, at the end of the
        backward (``_write_after_removal``), where the backward accumulates into ``.grad`` (it
        runs the weight's ``AccumulateGrad``, which ``detach.touch`` ties into the graph)."""
        detached = kept.detached
        assert detached is not None
        try:
            runs = all(torch._C._will_engine_execute_node(get_gradient_edge(p).node) for p in detached.params)
        except RuntimeError:  # asked of a leaf in torch.autograd.grad: no .grad to write
            runs = False
        if not runs:  # torch.autograd.grad, or backward(inputs=...) naming other tensors
            return
        task = torch._C._current_graph_task_id()
        if task not in self._removed:
            self._removed[task] = []
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._write_after_removal(task))
        kept, d = _in_parameter_dtype(kept, d)  # (autocast) as autograd accumulates
        self._removed[task].append((Call(kept.layer, kept.a, d), detached.params))

    def _write_after_removal(self, task: int) -> None:
        """Add autograd's gradient of every weight the backward's calls ran detached: the sum of their
        per-sample gradients for the output gradients autograd delivered (no transform, no rescaling).
        Its post-accumulate-grad hooks ran already, before this ``.grad`` was written: its
        ``AccumulateGrad`` runs with no gradient (``detach.touch``), and pergrad's pre-hook that held them
        back went with ``remove()``."""
        calls = self._removed.pop(task, [])
        if not calls:
            return
        params = list(dict.fromkeys(p for _, detached in calls for p in detached))
        with _no_autocast(params[0].device.type), _no_grad():
            ones = params[0].new_ones(calls[0][0].d.shape[0])
            totals = Fused([call for call, _ in calls]).summed(params, ones)
            for param, total in totals.items():
                param.grad = total.to(param.dtype) if param.grad is None else param.grad.add_(total)

    def _flush_outputs(self, state: _Backward) -> None:
        """Run the rules that take every output's gradient, once per call (see ``RuleSpec.output_dims``)."""
        for kept, grads in state.outputs.values():
            scale = float(kept.batch_size) if self.loss_reduction == "mean" else 1.0
            self._use(state, kept, tuple(grads), scale)
        state.outputs.clear()

    def _use(self, state: _Backward, kept: Kept, d: Any, scale: float) -> None:
        """Turn one call's output gradient into per-sample gradients (or keep it for the end)."""
        layer = kept.layer
        if not self.keep_grad_sample:
            if not self._read_at_end(kept):  # nothing will read its (a, d): let them go now
                state.passed.update((self.canonical(p), None) for _, p in layer.trainable())
                return
            built = None
            if layer.spec.parametrized and kept.batch_size > 0:  # it needs the forward's graph: now, not at the end
                with allocating_from(self.pool.take):
                    built = run_rule(layer, kept.a, d, scale)
            state.calls.append(Call(layer, kept.a, d, scale, built))
            return
        if kept.batch_size == 0:  # an empty batch: no rule needs to run
            like = d if isinstance(d, Tensor) else next(g for g in d if g is not None)
            per_sample = {n: like.new_zeros((0, *p.shape)) for n, p in layer.trainable()}
        else:
            with allocating_from(self.pool.take):
                per_sample = run_rule(layer, kept.a, d, scale)
        for name, g in per_sample.items():
            param = self.canonical(layer.module.get_parameter(name))  # FSDP: the layer holds the unsharded one now
            if g.shape != (kept.batch_size, *param.shape):
                raise HookStateError(
                    f"the rule {layer.spec.fn.__qualname__} for {layer.label} returned shape "
                    f"{tuple(g.shape)} for {name!r}; expected {(kept.batch_size, *param.shape)}"
                )
            previous = state.grads.get(param)
            state.grads[param] = g if previous is None else previous + g

    def canonical(self, p: nn.Parameter) -> nn.Parameter:
        """The parameter ``p`` is keyed by (FSDP2: the shard of an unsharded parameter)."""
        return p if self.world is None else self.world.canonical(p)

    def _read_at_end(self, kept: Kept) -> bool:
        """Whether the end of the backward reads this call's ``(a, d)`` (without ``grad_sample``): for
        the first backward's check, norms, statistics, a transform over one of its parameters, or
        a weight it ran detached (whose ``.grad`` pergrad writes)."""
        if self.verify_backwards > 0 or self.track_norms or self.track_statistics:
            return True
        if kept.detached is not None or kept.layer.spec.parametrized:
            return True
        return any(self.canonical(p) in self.transformed for _, p in kept.layer.trainable())

    def on_input_grad(self, generation: int, d: Tensor) -> None:
        """The gradient reaching the model's input (``keep_activation_grads=True``)."""
        if self.closed:
            return
        state = self._backward_state()
        if state.generation not in (None, generation):
            return  # the mixed-forward error is raised by the layers' hook
        scale = d.shape[0] if self.loss_reduction == "mean" else 1
        if state.loss_scale is not None:
            d = d / on_device(state.loss_scale, d)
        state.activation_grads["input"] = d * scale

    def on_accumulate(self, param: nn.Parameter, grad: Tensor | None) -> Tensor | None:
        """Pre-hook of ``param``'s AccumulateGrad node: what autograd adds to ``param.grad`` (None: a
        detached weight's, touched with no gradient: see ``detach.touch``)."""
        if self.closed:
            return None
        state = self._backward_state()
        state.reached[param] = None
        state.accumulated[param] = None
        if grad is None:  # pergrad writes its .grad; autograd calls its post-accumulate hooks now
            if param._post_accumulate_grad_hooks:
                self._defer_post_accumulate_hooks(param)
            return None
        if self.track_statistics or self.verify_backwards > 0:
            unscaled = self._unscaled(grad, state)  # the units of the per-sample gradients
            before = state.batch_grads.get(param)  # (reentrant checkpointing: a nested backward's part too)
            state.batch_grads[param] = unscaled if before is None else before + unscaled
        if self.running_mean:
            state.prior[param] = self._samples_in_grad(param)
        transformed = param in self.transformed
        if param._post_accumulate_grad_hooks and (transformed or param in self.detacher.current):
            self._defer_post_accumulate_hooks(param)
        if transformed:  # .grad is written at the end of the backward
            detached = param in self.detacher.current
            if detached and not self.detacher.is_touch_zero(grad) and bool(grad.any()):  # (rare: a sync is fine)
                raise HookStateError(
                    unattributable(
                        self.param_names[param],
                        "it arrived although every call of its layer ran with the weight detached",
                    )
                )
            if grad is state.tapped.get(param):  # the tap's very tensor, unless another term reached it
                state.matched.add(param)
            else:
                state.untapped.setdefault(param, []).append(grad)
            if param.grad is None:
                state.overwrite[param] = None  # let autograd store its sum; replaced at the end
                return None
            return torch.zeros_like(grad)
        b = state.batch_size
        if self.world is not None and self.reduction == "sum" and b is not None:
            # DDP averages over ranks; scale so its average is the sum over every rank's samples
            return grad * self.world.size * (b if self.loss_reduction == "mean" else 1)
        if b is None or (self.reduction == self.loss_reduction and not self.running_mean):
            return None
        if self.reduction == "sum":
            return grad * b
        batch_mean = grad if self.loss_reduction == "mean" else grad / b
        if not self.running_mean or param.grad is None:
            return batch_mean
        # .grad := (n * .grad + b * batch_mean) / (n + b); autograd adds what is returned
        n = state.prior[param]
        return (batch_mean - param.grad) * (b / (n + b)) if n + b else None

    def _samples_in_grad(self, param: nn.Parameter) -> float:
        """How many samples the running mean in ``param.grad`` holds: 0 once ``.grad`` was set to
        None, replaced, or changed in place (``zero_grad(set_to_none=False)``) since pergrad wrote it."""
        seen, grad = self._seen.get(param), param.grad
        if seen is None or grad is None or seen[1:] != (id(grad), grad._version):
            return 0
        return seen[0]

    # -- end of backward -------------------------------------------------------------------------

    def _finish(self, state: _Backward) -> None:
        if self._current is state:
            self._current = None
        self._nested.clear()
        self._recomputing = None
        try:
            self._compute(state)  # unless it ran before DDP's communication
            if state.error is not None:
                raise state.error
            self._count_samples(state)
        finally:
            state.calls.clear()  # the kept inputs and output gradients, before the buffers go back
            self.pool.end()
            if state.verified:  # the check built what later backward passes do not: not their bound
                self.pool.forget_bound()
            deferred = self.restore_deferred_hooks()
        self._run_post_accumulate_hooks(state, deferred)

    def _compute(self, state: _Backward) -> None:
        """Transforms, reductions, norms, statistics of this backward, and the world's communication of
        pergrad's part, which runs even when the rest raised (every rank takes part in every collective);
        an error is kept in ``state.error`` and raised by ``_finish``."""
        if state.computed:
            return
        state.computed = True
        first = next(iter(state.reached), None)
        device = "cpu" if first is None else first.device.type
        try:
            with _no_autocast(device), _no_grad(), allocating_from(self.pool.take):
                self._finish_backward(state)
        except Exception as err:
            state.error = err
        if self.world is not None:
            with torch.no_grad():
                self.world.flush(state, failed=state.error is not None)

    def _count_samples(self, state: _Backward) -> None:
        """``accumulate="samples"``: how many samples each ``.grad`` now averages, recorded once ``.grad``
        is final (under DDP: after DDP wrote it, averaged over every rank's samples)."""
        if not self.running_mean or self.closed or state.batch_size is None:
            return
        for p, n in state.prior.items():
            if p.grad is not None:
                count = n + state.batch_size
                if self.world is not None:
                    count = self.world.samples(p, count, state)
                self._seen[p] = (count, id(p.grad), p.grad._version)

    def _finish_backward(self, state: _Backward) -> None:
        if self.closed:
            return
        if self.keep_activation_grads:
            self.last_activation_grads = state.activation_grads
        if state.batch_size is None and not state.reached:
            return
        canonical = None if self.world is None else self.world.canonical
        self._flush_outputs(state)
        owned: dict[nn.Parameter, None] = {}  # detached, no transform: .grad is the plain reduction
        touched = self.world is None or self.world.touches  # their AccumulateGrad runs (detach.touch)
        for detached in state.detached:
            if touched:  # reached in the backward passes that run their AccumulateGrad
                params = [p for p in detached.params if p in state.reached]
            else:  # reached in the backward passes that reach their anchor
                anchor = (
                    state.probed
                    if detached.probe
                    else self.canonical(cast(nn.Parameter, detached.anchor)) in state.reached
                )
                params = list(detached.params) if anchor else []
            state.reached.update(dict.fromkeys(params))
            owned.update(dict.fromkeys(p for p in params if p not in self.transformed))
        source: Materialized | Fused = (
            Materialized(state.grads) if self.keep_grad_sample else Fused(state.calls, canonical)
        )
        known = state.grads if isinstance(source, Materialized) else source.uses
        missing = [p for p in state.reached if p not in known and p not in state.passed]
        if missing:
            message = unreached(missing[0], self.param_names[missing[0]], self.layers, self.canonical)
            raise HookStateError(message + (RECOMPUTED if state.nested else ""))
        self._check_partial(state, known)
        self._check_taps(state)
        assert state.batch_size is not None
        reached = list(state.reached)
        self.last_dropped = {}
        if self.keep_grad_sample:
            self._store_grad_sample({p: state.grads[p] for p in reached}, state.generation)
        if self.verify_backwards > 0 and state.batch_size > 0 and reached:
            self.verify_backwards -= 1
            state.verified = True
            check_sums(source, reached, state.batch_grads, state.batch_size, self.loss_reduction, self.param_names)
        if state.batch_size == 0:
            # An empty batch (Poisson sampling): every sum over samples is 0, so .grad gets nothing
            # added (autograd's own sum is 0 too), norms are empty and there are no statistics.
            self.last_sq_norms = {p: state.batch_grads.get(p, p).new_zeros(0) for p in reached}
            self.last_statistics = None
            for p in (d for call in state.detached for d in call.params):
                state.written[p] = None
                if p.grad is None:  # what autograd would have stored
                    p.grad = torch.zeros_like(p)
            return
        if self.track_statistics and reached:
            # autograd's batch gradient is sum_i g_i / B ("mean") or sum_i g_i ("sum")
            scale = 1.0 if self.loss_reduction == "mean" else 1.0 / state.batch_size
            # a copy: .grad may alias the batch gradient; detached weights have none (computed then)
            means = {p: state.batch_grads[p] * scale for p in reached if p in state.batch_grads}
            names = {p: self.param_names[p] for p in reached}
            self.last_statistics, sq_norms = compute_statistics(
                source, names, state.batch_size, means, self.track_statistics
            )
        else:
            needs = self._needs_norms
            wanted = reached if self.track_norms else [p for p in reached if p in needs] if needs else []
            sq_norms = source.sq_norms(wanted) if wanted else {}
        self.last_sq_norms = sq_norms  # those a norm-based transform needs; every parameter's with track_norms
        for target in self.targets:
            self._reduce_target(target, source, state, sq_norms)
        if owned:
            weight = 1.0 / state.batch_size if self.reduction == "mean" else 1.0
            stats = self.last_statistics if self.track_statistics else None
            if stats is not None:  # the means are there already
                size = 1.0 if self.reduction == "mean" else float(state.batch_size)
                totals = {p: self._scaled(stats.params[self.param_names[p]].mean * size, state) for p in owned}
            else:
                weights = self._scaled(next(iter(owned)).new_full((state.batch_size,), weight), state)
                totals = source.summed(owned, weights)
            for param, reduced in totals.items():
                self._add_grad(param, reduced, state)

    def _check_taps(self, state: _Backward) -> None:
        """Whatever reached a tapped parameter's ``AccumulateGrad`` beside its tap's very tensor must add
        up to what the tap passed on (``pergrad.reach``): values read (a host sync) only where such an
        arrival happened. A term that is exactly zero (``loss + 0 * p.sum()``) is let through."""
        for param, grads in state.untapped.items():
            tapped = state.tapped.get(param)
            detached = param in self.detacher.current  # (recomputed detached after this arrived)
            if tapped is None and not detached:  # no layer sent it anything in this backward
                continue
            extra = torch.stack(grads).sum(0)
            if tapped is not None and param not in state.matched:  # summed with the tap's part
                extra = extra - tapped
            if bool(extra.any()):
                raise HookStateError(
                    unattributable(
                        self.param_names[param],
                        "it arrived beside what the parameter's layers sent it, in a backward after the first",
                    )
                    + " Or pass verify=False to PerSampleModule if dropping that part is intended."
                )

    def _check_partial(self, state: _Backward, known: dict[nn.Parameter, Any]) -> None:
        """A backward that accumulates into part of a transform's target only -- ``backward(inputs=...)``
        naming some of its parameters: their per-sample gradients were computed, their ``AccumulateGrad``
        did not run -- cannot transform: ``T`` of a sample's gradient needs every parameter it covers (a
        clipping norm over all of them). Told from a parameter of a layer whose rule computes one op on
        its parameters (an output gradient flowed, so they are in the graph); a rule over a subtree or
        every input may give zeros for parameters off the loss's path."""
        for target in self.targets:
            if not any(p in state.reached for p in target.params.values()):
                continue
            left = {p: n for n, p in target.params.items() if p in known and p not in state.reached}
            if left:
                in_graph = {
                    self.canonical(p)
                    for layer in self.layers
                    if not (layer.spec.subtree or layer.spec.all_inputs or layer.spec.parametrized)
                    for _, p in layer.trainable()
                }
                names = [n for p, n in left.items() if p in in_graph]
                if names:
                    raise TransformError(
                        f"this backward accumulates into some of the parameters the transform registered for "
                        f"{target.label} covers, but not into {names} (backward(inputs=...) names part of them), "
                        "although their per-sample gradients flowed: the transform of each sample's gradient "
                        "needs all of them. Name every parameter the target covers in inputs, or none."
                    )

    # -- post-accumulate-grad hooks of the parameters whose .grad pergrad writes -----------------

    def _defer_post_accumulate_hooks(self, param: nn.Parameter) -> None:
        """Hold ``param``'s post-accumulate-grad hooks back while autograd's ``AccumulateGrad`` runs:
        ``.grad`` is not final until pergrad writes it at the end of the backward."""
        hooks = param._post_accumulate_grad_hooks
        self._deferred.setdefault(param, {}).update(hooks)
        hooks.clear()

    def restore_deferred_hooks(self) -> set[nn.Parameter]:
        """Put held-back hooks back in place (also after a backward that failed midway)."""
        restored = set(self._deferred)
        for param, hooks in self._deferred.items():
            if param._post_accumulate_grad_hooks is not None:
                param._post_accumulate_grad_hooks.update(hooks)
        self._deferred.clear()
        return restored

    def _run_post_accumulate_hooks(self, state: _Backward, deferred: set[nn.Parameter]) -> None:
        """Call the post-accumulate-grad hooks of every parameter whose ``.grad`` pergrad wrote, now
        that it is final, unless autograd called them already (its own ``.grad``)."""
        for param in state.written:
            hooks = param._post_accumulate_grad_hooks
            if hooks and (param in deferred or param not in state.accumulated):
                for hook in list(hooks.values()):
                    hook(param)

    def clear_targets(self) -> None:
        self.targets.clear()
        self.transformed.clear()
        self._needs_norms.clear()

    def add_target(self, target: Target) -> None:
        self.targets.append(target)
        self.transformed.update(target.params.values())
        if isinstance(target.transform, Scaling) and target.transform.needs_norms:
            self._needs_norms.update(target.params.values())

    # -- grad_sample: the last forward's, its memory reused by the next (pool.py) ------------------

    def _recycle_stale(self, generation: int) -> None:
        """A backward of a new forward replaces every ``grad_sample``: drop the old ones now, so
        the rules can write into their memory instead of allocating as much again."""
        for param, gen in list(self._grad_sample_generation.items()):
            if gen != generation:
                self.recycle(param)
        self.pool.begin()

    def recycle(self, param: nn.Parameter) -> None:
        """Drop ``param.grad_sample`` (the pool takes its memory back once no one else refers to it)."""
        self._grad_sample_generation.pop(param, None)
        param.__dict__.pop("grad_sample", None)

    def _store_grad_sample(self, grads: dict[nn.Parameter, Tensor], generation: int | None) -> None:
        for param, g in grads.items():
            # a second backward of the same forward (retain_graph=True) adds, like autograd does
            previous = getattr(param, "grad_sample", None)
            same_forward = self._grad_sample_generation.get(param) == generation
            if previous is not None and same_forward and previous.shape == g.shape:
                g = previous + g
            param.grad_sample = g  # type: ignore[attr-defined]
            if generation is not None:
                self._grad_sample_generation[param] = generation

    def _reduce_target(
        self,
        target: Target,
        source: Materialized | Fused,
        state: _Backward,
        sq_norms: dict[nn.Parameter, Tensor],
    ) -> None:
        assert state.batch_size is not None
        batch_size = state.batch_size
        params = [p for p in target.params.values() if p in state.reached]
        if not params:
            return
        transform = target.transform
        if isinstance(transform, Scaling):
            # T(g_i) = c_i g_i: sum_i c_i g_i without building g_i where the source allows it.
            # A parameter of the target that this backward did not reach has g_i = 0: it adds 0.
            # The norms are those of the samples' own losses (unscaled): a bound means the same under a scaler.
            norms = torch.stack([sq_norms[p] for p in params]).sum(0).sqrt() if transform.needs_norms else None
            factors = transform.factors(norms, batch_size, params[0].detach())
            drop = overflow = None
            if norms is not None:
                # a sample whose gradient holds NaN or Inf has no finite clipped/normalised value:
                # it contributes nothing (on the device: no branch on its values), and is reported by
                # dropped_samples(). Under loss scaling it is an overflow, which must reach .grad so
                # that the scaler skips the step and lowers its scale: the sample's factor is NaN
                bad = ~torch.isfinite(norms)
                factors = factors.masked_fill(bad, 0)
                if state.amp:
                    overflow = bad
                else:
                    self.last_dropped[target.label] = bad
                    drop = bad if may_hold_true(bad) else None
            if not transform.finite_factors and not bool(torch.isfinite(factors).all()):  # a host sync
                raise TransformError(f"the transform registered for {target.label} produced non-finite scale factors")
            if overflow is not None:
                factors = factors.masked_fill(overflow, torch.nan)
            weights = self._scaled(factors / batch_size if self.reduction == "mean" else factors, state)
            for param, reduced in source.summed(params, weights, drop).items():
                self._add_grad(param, reduced, state)
            return
        grads = source.per_sample(params)
        first = grads[params[0]]
        batch = {
            key: grads[p] if p in grads else first.new_zeros((first.shape[0], *p.shape))
            for key, p in target.params.items()
        }
        versions = {key: g._version for key, g in batch.items()}
        result = transform.apply(batch)
        check_output(target.label, batch, result)
        check_unmodified(target.label, batch, versions)
        inputs_finite = _all_finite(batch.values()) if state.amp else None
        for key, param in target.params.items():
            if param not in state.reached:  # as autograd leaves it (None stays None), whatever T made of its zeros
                continue
            reduced = result[key].sum(0) if self.reduction == "sum" else result[key].mean(0)
            if not torch.isfinite(reduced).all() and (
                _all_finite(batch.values()) if inputs_finite is None else inputs_finite
            ):
                raise TransformError(
                    f"the transform registered for {target.label} produced non-finite values for {key!r}"
                )
            reduced = self._scaled(reduced, state)  # T(g_i) in the units of .grad
            if inputs_finite is not None:
                # an overflow in the target's g_i reaches .grad as NaN whatever T made of it (a clamp
                # would hide it from the scaler)
                reduced = torch.where(inputs_finite, reduced, torch.nan)
            self._add_grad(param, reduced, state)

    @staticmethod
    def _scaled(t: Tensor, state: _Backward) -> Tensor:
        """``t`` (in the samples' own units) in the units of ``.grad``: times the loss scale."""
        return t if state.loss_scale is None else t * on_device(state.loss_scale, t)

    @staticmethod
    def _unscaled(t: Tensor, state: _Backward) -> Tensor:
        """A gradient autograd delivered (times the loss scale) in the samples' own units."""
        return t if state.loss_scale is None else t / on_device(state.loss_scale, t)

    def _add_grad(self, param: nn.Parameter, reduced: Tensor, state: _Backward) -> None:
        """Add this batch's reduction to ``.grad`` (with ``accumulate="samples"``, fold it into the
        running mean over every sample since ``.grad`` was cleared).

        Several processes (``pergrad.distributed``): FSDP2 takes the reduction for its reduce-scatter;
        under DDP it goes where ``.grad`` would, but into the parameter's place in DDP's bucket (the
        bucket holds ``.grad`` as autograd left it), which is all-reduced once it is complete."""
        state.written[param] = None
        grad = param.grad
        if self.running_mean and param not in state.prior:  # no AccumulateGrad ran (a detached weight)
            state.prior[param] = 0.0 if grad is None else self._samples_in_grad(param)
        if self.world is not None:
            reduced = self.world.contribution(reduced)
            if self.world.take(param, reduced, state):
                return
            slot = self.world.slot(param, state)
            if slot is not None:
                if grad is None or param in state.overwrite:
                    slot.copy_(reduced)
                    return
                grad = slot
        if grad is None or param in state.overwrite:
            param.grad = reduced.to(param.dtype)
        elif self.running_mean:
            n = state.prior[param]
            b = state.batch_size or 0
            grad.mul_(n / (n + b)).add_(reduced, alpha=b / (n + b))
        else:
            grad.add_(reduced)

    def may_write(self, param: nn.Parameter) -> bool:
        """Whether pergrad may write ``param.grad`` itself in some backward pass: a transform covers it,
        or it may run detached. The same answer on every rank, whatever the batch."""
        if param in self.transformed:
            return True
        builds = self.keep_grad_sample or self.track_norms or bool(self.track_statistics)
        return self.detach_transformed and builds and param in self.detacher.single
