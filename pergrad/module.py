"""``PerSampleModule``: the wrapper that owns all of pergrad's state for one model."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from pergrad._core.backward.engine import Engine, integration_checks
from pergrad._core.backward.sources import Materialized
from pergrad._core.backward.state import any_replaced
from pergrad._core.backward.targets import Target
from pergrad._core.capture.calls import HookedLayer
from pergrad._core.capture.discover import discover, is_lazy_module, layout_of
from pergrad._core.capture.hooks import LayerHooks, owners
from pergrad._core.consumers.grad_sample import Holder
from pergrad._core.loss_scale import GradScalerLike, LossScaleLike, factor_reader, loss_scale_reader
from pergrad._core.options import Options
from pergrad._core.parallel.distributed import DataParallel, running_ddp, world_for
from pergrad._core.shortcuts.followed import dynamo_callback, eager_hook, never_traced, without_dynamo

from .errors import (
    NormNotComputedError,
    PergradError,
    TargetError,
    TransformError,
    WrapperAttributeError,
)
from .registry import RuleRegistry, default_registry
from .statistics import Statistics, compute_statistics, requested
from .transforms import Transform, UserTransform

if TYPE_CHECKING:
    from pergrad.attribution.factors import Factors
    from pergrad.attribution.projectors import Spec
    from pergrad.attribution.tracking import Attribution

_HOLDER = "pergrad"  # the key, in the metadata of a parameter's AccumulateGrad node, of the wrapper hooking it


def _same(p: nn.Parameter) -> nn.Parameter:
    return p


class PerSampleModule:
    """Wrap ``model`` so that a normal forward/backward also yields per-sample gradients.

    After ``loss.backward()``, for every trainable parameter ``p``:

    - ``p.grad_sample``, shape ``[B, *p.shape]``: ``g_i = d f_i / d p``, the gradient of sample i's
      OWN loss, where the loss is ``(1/B) sum_i f_i`` (``loss_reduction="mean"``) or ``sum_i f_i``
      (``"sum"``). With ``"mean"`` this is B times the sample's share of ``p.grad``.
    - ``p.grad`` accumulates ``(1/B) sum_i T(g_i)`` (``reduction="mean"``) or ``sum_i T(g_i)``
      (``"sum"``), T the transform registered for a target covering ``p`` (identity if none).
      ``reduction`` defaults to ``loss_reduction``, so with no transforms ``p.grad`` is what plain
      autograd gives.

    Args:
        model: the model; it is not modified beyond hooks, which ``remove()`` takes away.
        loss_reduction: how the loss combines the samples' losses: ``"mean"`` or ``"sum"``.
        reduction: how ``.grad`` combines the transformed per-sample gradients (default: same).
        batch_first: the batch is dim 0 of the model's input (False: dim 1, for a sequence-first
            model). pergrad follows it from there through the forward, so a layer inside may take it
            on another dim (``x.transpose(0, 1)`` into ``nn.LSTM()`` or
            ``nn.TransformerEncoderLayer(batch_first=False)``); convolutions and norms over the batch
            layout must get it on dim 0.
        keep_grad_sample: store ``p.grad_sample`` after each backward. With False, nothing of size
            ``B x #params`` is built where a fused path exists: scaling transforms (``clip_norm``,
            ``normalize``, ``scale``) and norms come from each layer's input and output gradient.
        track_norms: compute every parameter's per-sample gradient norms in each backward
            (``per_sample_norms()``); needed only with ``keep_grad_sample=False``, where without it
            only the norms that norm-based transforms use are computed (and kept).
        track_statistics: compute ``statistics()`` in each backward (needed only with
            ``keep_grad_sample=False``): ``True`` for every statistic, or the names of those to
            compute (``pergrad.statistics.NAMES``); the others then raise when read. The means,
            ``sq_norms``, ``trace_variance`` and ``norm_test`` come with the per-sample norms;
            ``inner_product_test`` and ``orthogonality_test`` cost one more product per layer, and
            ``second_moment`` (``variance``, ``snr``) one more, or building ``g_i`` for layers that see
            many positions. E.g. ``{"trace_variance"}`` for CABS.
        accumulate: how ``.grad`` combines several backward passes before it is cleared:
            ``"backward"`` (autograd's way: each backward adds its own reduction) or ``"samples"``
            (with ``reduction="mean"``, ``.grad`` is the mean over every sample of every backward
            since ``.grad`` was cleared, so micro-batches of any sizes give the full-batch result).
        keep_activation_grads: keep, per backward, the gradient of each sample's own loss with
            respect to every hooked layer's output and the model's input (``activation_grads()``).
        verify: on the first backward, check that the per-sample gradients add up to autograd's
            gradient of every parameter (it fails when part of the loss uses a parameter outside its
            layer, e.g. a regulariser, which pergrad cannot attribute to samples). Costs one batch
            gradient per layer, once.
        fallback: give modules without a rule (custom modules with raw parameters, ``nn.PReLU``,
            multi-input modules) per-sample gradients computed with ``torch.func`` from their kept
            inputs and output gradient, instead of an error.
        rules: a private ``RuleRegistry`` (default: ``pergrad.registry.default_registry``).
        detach_transformed: after the first backward, run each layer whose weight a transform
            covers with that weight detached (its bias stays attached), so autograd skips the weight
            gradient that pergrad replaces anyway: one matmul or convolution backward less per
            layer. ``torch.autograd.grad`` with respect to such a weight then raises (it is not in
            the graph); pass False if you need that.
        lean_forwards: once two forwards of one kind (the same argument shapes, batch, training mode and
            autocast) were followed op by op (where the batch is in each layer's input) and alike, run the
            later ones without following, each layer call checked against their record (less host time per
            step: ``benchmarks/hostcost.py``). Off by default: a lean forward that takes a path the followed
            ones did not take (a branch on the step or the data, an auxiliary head on some steps) is answered
            only where the call's input settles where the batch is, and else refused with a
            ``BatchSizeError`` (every forward is followed after it); and a forward that moves the batch to
            another dim of the same size depending on the data, by the same kinds of ops either way, is
            answered as the followed ones were. See ``docs/how-it-works.md``, "followed / lean forward".
        grad_scaler: the ``torch.amp.GradScaler`` whose ``scaler.scale(loss)`` the backward passes
            run on (mixed precision). Its scale is read, as a tensor, at each backward; the
            transforms see the per-sample gradients of the samples' own (unscaled) losses, so a
            clipping bound means the same with and without it, and ``.grad`` gets ``S`` times the
            reduction (the scaler's units: ``scaler.unscale_`` and ``scaler.step`` work unchanged).
            ``grad_sample``, ``per_sample_norms()``, ``statistics()`` and ``activation_grads()``
            are unscaled. A NaN or Inf (an overflow) reaches ``.grad`` instead of being left out of
            a norm-based transform, so the scaler skips the step and lowers its scale. Also
            accepted: the loss scale itself (a number, or a one-element tensor read at each
            backward) or a callable returning it (or None for an unscaled backward). A disabled
            scaler, or one before its first ``scale()``, means an unscaled backward.
        loss_scale: the factor ``s`` the loss is multiplied by before its backward, beyond a
            GradScaler's: gradient accumulation that divides each micro-batch's loss by ``k`` (Lightning's
            ``accumulate_grad_batches=k``, HF ``Trainer``'s ``gradient_accumulation_steps``, most
            hand-written loops) is ``loss_scale=1/k``. Autograd then delivers ``s g_i``; pergrad divides it
            out, so ``grad_sample``, norms and the transforms see each sample's own ``g_i`` (a clipping
            bound ``C`` stays ``C``, not ``C/s``), and writes ``s`` times the reduction into ``.grad``: the
            ``k`` micro-batches add up to the mean of their ``(1/B) sum_i T(g_i)``. A number or one-element
            tensor, or a callable returning it at each backward; settable later as ``psm.loss_scale``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_reduction: str = "mean",
        reduction: str | None = None,
        batch_first: bool = True,
        keep_grad_sample: bool = True,
        track_norms: bool = False,
        track_statistics: bool | Iterable[str] = False,
        accumulate: str = "backward",
        keep_activation_grads: bool = False,
        verify: bool = True,
        fallback: bool = False,
        rules: RuleRegistry | None = None,
        detach_transformed: bool = True,
        lean_forwards: bool = False,
        grad_scaler: GradScalerLike = None,
        loss_scale: LossScaleLike = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"PerSampleModule wraps an nn.Module, got {type(model).__name__}")
        options = Options(
            loss_reduction=loss_reduction,
            reduction=loss_reduction if reduction is None else reduction,
            batch_first=batch_first,
            keep_grad_sample=keep_grad_sample,
            track_norms=track_norms,
            track_statistics=requested(track_statistics),
            accumulate=accumulate,
            keep_activation_grads=keep_activation_grads,
            verify=verify,
            fallback=fallback,
            detach_transformed=detach_transformed,
            lean_forwards=lean_forwards,
        )
        if owners(model):
            raise PergradError(
                f"this {type(model).__name__} (or a submodule of it) is already wrapped by a PerSampleModule; two "
                "wrappers would each write .grad. Call .remove() on the first one (or leave its `with` block) first."
            )
        self.module = model
        self.options = options
        self._loss_scale = loss_scale
        self._grad_scaler = grad_scaler
        self.loss_reduction, self.reduction, self.batch_first = options.loss_reduction, options.reduction, batch_first
        self._rules, self._registry = rules, default_registry if rules is None else rules
        self._engine = Engine(
            options, param_names={}, loss_scale=loss_scale_reader(grad_scaler), loss_factor=factor_reader(loss_scale)
        )
        # DDP or FSDP2: how pergrad's part of .grad reaches every rank (pergrad._core.parallel.distributed)
        self._engine.world = world_for(model, self._engine, accumulate)
        self._canonical = self._engine.world.canonical if self._engine.world is not None else _same
        self._targets: list[tuple[nn.Module | str, Transform]] = []  # as registered, resolved again on rebinding
        self._attribution: Attribution | None = None  # made at the first use of a projection (``_attributing``)
        self._layers: list[HookedLayer] = []
        self._accumulate_handles: list[RemovableHandle] = []
        self._hooks: LayerHooks | None = None
        self._bind()  # raises for unsupported layers before any hook is installed
        on_input = self._engine.on_input_grad if keep_activation_grads else None
        detacher = self._engine.detacher
        to_detach = detacher.for_call if detach_transformed else None
        try:  # all or nothing: a construction that fails leaves the model as it was
            self._hooks = LayerHooks(
                model,
                batch_first,
                self._engine.on_output_grad,
                on_input,
                to_detach,
                self._sync,
                detacher.may_detach,
                on_recompute=self._engine.on_recompute,
                to_tap=self._engine.taps.tap,
                may_tap=self._engine.may_tap,
                on_model_returned=self._after_call,
                on_failed=self._engine.on_failed_hook,
                lean=lean_forwards,
            )
            self._install_hooks()
            self._install_accumulate_hooks()
            self._engine.on_stale = self._rehook
            if self._engine.world is not None:
                self._engine.world.install()
        except BaseException:
            self._uninstall()
            raise

    @property
    def loss_scale(self) -> LossScaleLike:
        """The factor the loss is multiplied by before its backward (see the ``loss_scale`` argument)."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: LossScaleLike) -> None:
        self._engine.loss_factor = factor_reader(value)
        self._loss_scale = value

    @property
    def grad_scaler(self) -> GradScalerLike:
        """The ``grad_scaler`` whose scale the backward passes run on (None: the loss is not scaled for mixed
        precision); settable, e.g. to the scaler you drive after loading a pickled wrapper."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, value: GradScalerLike) -> None:
        self._engine.loss_scale = loss_scale_reader(value)
        self._grad_scaler = value

    @property
    def accumulate(self) -> str:
        """How ``.grad`` combines several backward passes: ``"backward"`` or ``"samples"`` (see the argument)."""
        return self.options.accumulate

    # -- following the model: its parameters, as they are at each forward ------------------------

    def _bind(self) -> None:
        """Find the layers and parameters of the model as it is now, and what the transforms cover."""
        model = self.module
        self._layers = discover(model, self._registry, self.options.fallback)
        self._submodules = list(model.modules())
        self._layout = layout_of(self._submodules, self._canonical)
        engine = self._engine
        engine.param_names = {self._canonical(p): name for name, p in model.named_parameters() if p.requires_grad}
        self._lazy = any(map(is_lazy_module, self._submodules))
        # a call that materialises a lazy module is bound at its end (``_after_call``) and its backward
        # checked (``verify``), which needs every weight attached: none runs detached until then
        engine.detach_transformed = self.options.detach_transformed and not self._lazy
        engine.layers = self._layers
        engine.detacher.candidates(self._layers, model)
        engine.targets.clear()
        for target, transform in self._targets:
            label, params, _, _ = self._resolve(target)
            engine.targets.add(Target(label, params, transform))
        if self._attribution is not None:
            self._attribution.bind()

    def _install_hooks(self) -> None:
        """The layers' forward hooks, for the layers and transforms as they are now."""
        assert self._hooks is not None
        self._engine.detacher.reset()
        self._hooks.install(self._layers)

    def _install_accumulate_hooks(self) -> None:
        for handle in self._accumulate_handles:
            handle.remove()
        self._accumulate_handles.clear()
        self._engine.unhooked.clear()  # (put back where needed at the next backward, ``Engine._start``)
        self._release_nodes()
        # a lazy module's parameters get theirs once materialised (``_after_call``)
        params = [p for p in self._engine.param_names if not is_lazy(p)]
        # AccumulateGrad nodes are cached weakly by their parameter: the engine holds them so hooks stay on them.
        nodes: dict[nn.Parameter, Any] = {p: get_gradient_edge(p).node for p in params}
        for p, node in nodes.items():
            self._refuse_other_holder(p, node)
        self._engine.accumulators = nodes
        for node in nodes.values():
            node.metadata[_HOLDER] = weakref.ref(self)
        self._accumulate_handles = [node.register_prehook(self._accumulate_hook(p)) for p, node in nodes.items()]

    def _rehook(self) -> None:
        """At a forward (``_sync``) or a backward's start, where a parameter's ``AccumulateGrad`` node is not the
        hooked one (a conversion there and back since the last forward that bound, which left the dtype, device
        and tensor, and so the layers and their rules, as they were): the hooks go on the current nodes, before
        they run, and the detached weights' guards are made again on them. At the forward: a backward's first
        node may be one of them (a weight used only under reentrant checkpointing, and by a term of the loss),
        which runs before any hook of pergrad's starts the backward."""
        self._install_accumulate_hooks()
        self._engine.detacher.renew_guards()

    def _refuse_other_holder(self, param: nn.Parameter, node: Any) -> None:
        """Refuse a parameter that another wrapper (not removed) hooks too: a weight shared by two wrapped
        models (``b.weight = a.weight``). Each wrapper would take the other's share of its gradient for a
        part that no layer of its own produced, and both would write its ``.grad``."""
        found = node.metadata.get(_HOLDER)
        other = None if found is None else found()
        if other is None or other is self or other._engine.closed:
            return
        name = self._engine.param_names[param]
        there = other._engine.param_names.get(param, "?")
        raise PergradError(
            f"parameter {name!r} of this {type(self.module).__name__} is also parameter {there!r} of the "
            f"{type(other.module).__name__} wrapped by another PerSampleModule ({other!r}), which has not been "
            "removed: each wrapper would take the other's share of its gradient for a part that no layer of its "
            "own produced, and both would write its .grad. Call .remove() on the other wrapper and wrap one module "
            "that holds both models (a parent module whose forward calls them, or nn.ModuleList([a, b]), whose "
            "members you then call as before); a weight shared between its layers gets the per-sample sum."
        )

    def _release_nodes(self) -> None:
        """Unmark the AccumulateGrad nodes this wrapper hooked (``_refuse_other_holder``)."""
        for node in self._engine.accumulators.values():
            found = node.metadata.get(_HOLDER)
            if found is not None and found() is self:
                del node.metadata[_HOLDER]

    def _sync(self) -> None:
        """At every call of the model: take up DDP applied since wrapping (``_late_ddp``), run the
        integrations' forward checks, hook the new ``AccumulateGrad`` nodes a conversion there and back left,
        and wrap the model again if its parameters are no longer the ones it was wrapped with (``_rewrap``)."""
        engine = self._engine
        if engine.world is None and not engine.closed and dist.is_available() and dist.is_initialized():
            self._late_ddp()
        engine.on_forward()
        if not engine.closed and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            for check in integration_checks():
                if check.forward is not None:
                    check.forward(self)
        if engine.closed:
            return
        if layout_of(self._submodules, self._canonical) != self._layout:
            self._rewrap()
            return
        # a conversion there and back (model.float().double()) since the last forward: the parameters have
        # new AccumulateGrad nodes, hooked now, before a backward whose first node may be one of them
        tracking = torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
        if tracking and any_replaced(engine.accumulators.items()):
            self._rehook()

    def _late_ddp(self) -> None:
        """If DDP was applied after wrapping (to the model or a parent of it) and this is its forward, carry
        pergrad's gradients in its buckets from now on (``pergrad._core.parallel.distributed``)."""
        ddp = running_ddp(self.module)  # (DDP needs a process group)
        if ddp is not None:
            world = DataParallel(ddp, self._engine, late=True)
            world.install()
            self._engine.world = world

    def _rewrap(self) -> None:
        """The model's parameters are no longer the ones the wrapper was built for (replaced by
        ``load_state_dict(assign=True)``, a module swapped in, ``requires_grad`` switched): wrap the model as it
        is now -- the registered transforms included -- and check the next backward against autograd again
        (``verify``)."""
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return  # torch.func or the compiler runs the model with parameters of its own
        if any(not isinstance(p, nn.Parameter) for _, p in self.module.named_parameters(remove_duplicate=False)):
            return  # torch.func.functional_call swapped plain tensors in for this call only
        before = set(self._engine.param_names)
        self._bind()
        self._install_hooks()
        self._install_accumulate_hooks()
        for param in before - set(self._engine.param_names):
            self._engine.grad_sample.drop(param)  # no grad_sample left on parameters the model no longer holds
        self._engine.verify_backwards = 1 if self.options.verify else 0

    def _after_call(self) -> None:
        """At the end of every call of the model while it holds lazy modules before their first
        forward: those that this call materialised (each in its own forward, after ``_sync`` ran)
        are bound now, before the backward of the call that materialised them."""
        if self._lazy:
            self._sync()

    def _accumulate_hook(self, param: nn.Parameter) -> Callable[[tuple[Tensor, ...]], tuple[Tensor, ...] | None]:
        # the engine held weakly: autograd holds the hook (a tap's graph holds the node), and a reference through
        # autograd is one Python's collector cannot follow, so a dropped wrapper would never be collected
        engine = weakref.ref(self._engine)

        @eager_hook
        def hook(grads: tuple[Tensor | None, ...]) -> tuple[Tensor, ...] | None:
            found = engine()
            new = None if found is None else found.on_accumulate(param, grads[0])
            return None if new is None else (new,)

        return hook

    # -- the model's face ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name the wrapper does not have: the wrapper is not an ``nn.Module`` (its
        parameters, ``state_dict`` keys and checkpoints are the model's own, registered once), so say
        where the attribute is. An ``AttributeError``, so ``hasattr``/``getattr(..., default)`` work;
        it reads nothing of ``self`` through attribute lookup (``copy``/``pickle`` call it on an
        instance whose ``__init__`` never ran)."""
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol lookups (__setstate__, __deepcopy__, ...): the plain answer
        model = vars(self).get("module")
        kind = "" if model is None else f" ({type(model).__name__})"
        where = f" The model{kind} has it: use psm.module.{name}." if model is not None and hasattr(model, name) else ""
        raise WrapperAttributeError(
            f"PerSampleModule has no attribute {name!r}: it is not an nn.Module but a plain object that hooks the "
            f"model it wraps, whose parameters, state_dict keys and checkpoints stay the model's own.{where} Call "
            "the model's own methods on the model (psm.module.to(device), psm.module.config, "
            "psm.module.save_pretrained(...)), and give frameworks the model, not the wrapper (AveragedModel(psm.module)): "
            "for HuggingFace's "
            "Trainer use pergrad.integrations.hf.PerSampleTrainer(model=model, ...), which wraps it."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> PerSampleModule:
        self.module.train(mode)
        return self

    def eval(self) -> PerSampleModule:
        return self.train(False)

    @never_traced  # pergrad's state changes (``grad_sample`` dropped) run eagerly, also in a compiled step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``model.zero_grad`` and drop every ``grad_sample``."""
        if dynamo_callback() is not None:  # called from code Dynamo compiled: nothing called from here may be
            without_dynamo(self.zero_grad, set_to_none)
            return
        self.module.zero_grad(set_to_none)
        if self._engine.options.keep_grad_sample:  # otherwise pergrad sets none
            self._clear_grad_sample()

    # -- what the last backward measured ---------------------------------------------------------

    def _materialized(self) -> tuple[Materialized, dict[nn.Parameter, str], int]:
        """The last backward's own ``g_i`` (not ``grad_sample``, which a second backward of the same forward
        adds to), as a source."""
        last = self._engine.grad_sample.last
        names = {p: n for p, n in self._engine.param_names.items() if p in last}
        if not self._engine.options.keep_grad_sample or not names:
            raise PergradError(
                "nothing to measure: run a backward first; with keep_grad_sample=False pass "
                "track_norms=True (for per_sample_norms) or track_statistics=True (for statistics) to the wrapper"
            )
        grads = {p: last[p] for p in names}
        return Materialized(grads), names, next(iter(grads.values())).shape[0]

    def per_sample_norms(self) -> dict[str, Tensor]:
        """``{qualified param name: Tensor[B]}``: ``||g_i||`` of each parameter in the last backward,
        before any transform (the norms clipping compared with its bound; unscaled under
        ``grad_scaler``): of that backward's own ``g_i``, also after a second backward through the same
        forward (where ``grad_sample`` holds the sum over both). The norm of a module's or the model's gradient is ``sqrt(sum of squares)``
        of these. Which parameters it holds:

        - ``track_norms=True`` (or ``track_statistics=True``): every parameter the backward reached;
        - ``keep_grad_sample=True``: every parameter with a ``grad_sample`` (read off it);
        - otherwise: those the backward computed anyway, the parameters a norm-based transform
          (``clip_norm``, ``normalize``) covers and the backward reached.

        Looking up another parameter raises ``NormNotComputedError`` (a ``KeyError``) saying why.
        """
        engine = self._engine
        trainable = sorted(engine.param_names.values())
        if engine.track_norms or (not engine.options.keep_grad_sample and engine.norms.last):
            found = {engine.param_names[p]: sq.sqrt() for p, sq in engine.norms.last.items()}
        elif engine.options.keep_grad_sample:
            source, names, _ = self._materialized()
            found = {names[p]: sq.sqrt() for p, sq in source.sq_norms(names).items()}
        else:
            raise PergradError(
                "no per-sample norms: with keep_grad_sample=False, per_sample_norms() answers after a backward that "
                "computed norms: for the parameters a norm-based transform (clip_norm, normalize) covers, or for every "
                "parameter with PerSampleModule(..., track_norms=True)"
            )
        why = (
            "the parameter received no gradient in the last backward"
            if engine.track_norms or engine.options.keep_grad_sample
            else "with keep_grad_sample=False and track_norms=False the backward computes only the norms that its "
            "norm-based transforms (clip_norm, normalize) use, those of the parameters they cover; pass "
            "track_norms=True to PerSampleModule for every parameter's"
        )
        return PerSampleNorms(found, trainable, why)

    def statistics(self) -> Statistics:
        """Statistics of the last backward's per-sample gradients (formulas: ``pergrad.statistics``)."""
        tracking = self._engine.statistics
        if tracking is not None:
            if tracking.last is None:
                raise PergradError("statistics() is available after a backward pass")
            return tracking.last
        source, names, batch_size = self._materialized()
        return compute_statistics(source, names, batch_size, {})[0]  # means from grad_sample

    def activation_grads(self) -> dict[str, Tensor]:
        """Per-sample gradients of the last backward with respect to activations, ``[B, ...]``:

        - ``"<layer>"``: ``d f_i / d output`` of each hooked layer (``"<layer>:k"`` for its k-th extra
          call in one forward), scaled like ``grad_sample`` (each sample's OWN loss ``f_i``);
        - ``"<layer>[k]"``: ``d f_i / d`` the k-th tensor (k >= 1) the layer returned, for layers whose
          rule takes every output (``h_n`` and ``c_n`` of ``nn.RNN``/``nn.GRU``/``nn.LSTM``, the
          attention weights of ``nn.MultiheadAttention``); with ``fallback=True``, laid out as the
          module returned it (the fallback finds its batch dim in the backward);
        - ``"input"``: ``d f_i / d x`` for the model's first input, when it requires grad.

        Needs ``keep_activation_grads=True``. Saliency maps are ``activation_grads()["input"].abs()``;
        the fast-gradient-sign direction is its ``.sign()``.
        """
        if not self._engine.options.keep_activation_grads:
            raise PergradError("activation_grads() needs PerSampleModule(..., keep_activation_grads=True)")
        return dict(self._engine.last_activation_grads)

    def dropped_samples(self) -> dict[str, Tensor]:
        """``{target: indices}`` of the samples the last backward left out of a norm-based transform
        (``clip_norm``, ``normalize``) because their gradient over that target held NaN or Inf.

        Such a sample contributes nothing to that target's ``.grad``; the other samples are reduced
        as usual (with ``reduction="mean"`` still divided by the full batch size B).
        """
        return {label: bad.nonzero().flatten() for label, bad in self._engine.reducer.last_dropped.items() if bad.any()}

    def hold_per_sample(self) -> Holder:
        """A switch for audits (``pergrad.privacy.audit``): while ``holder.armed`` is True, every backward pass
        hands the returned ``Holder`` its per-sample gradients ``g_i`` ``[B, *p.shape]`` of every
        parameter it reached, whatever ``keep_grad_sample``, with its batch size, loss scale and
        transforms (``holder.take()``). ``.grad`` is computed as unarmed; with ``keep_grad_sample=False``
        an armed backward keeps every layer call's input and output gradient until its end and builds
        ``g_i`` there. ``holder.close()`` when done."""
        return Holder(self._engine.hold().holders)

    # -- transforms ------------------------------------------------------------------------------

    def registered_transforms(self) -> dict[str, Transform]:
        """``{target: transform}`` as registered, each target named as messages name it
        (``"the whole model"``, ``"module 'encoder'"``, ``"parameter 'head.weight'"``)."""
        return {target.label: target.transform for target in self._engine.targets}

    def register_transform(
        self, target: nn.Module | nn.Parameter | str, fn: Callable[[Any], Any] | Transform, *, batched: bool = False
    ) -> None:
        """Apply ``fn`` to each sample's gradient of ``target`` before the reduction into ``.grad``.

        ``target`` is a parameter, a module, or the wrapped model itself (the root), as the object
        or its qualified name (``"2.weight"``, ``"0"``, ``""``). ``fn`` is written for ONE sample: a
        parameter target passes it a tensor of the parameter's shape; a module or root target a dict
        ``{name: tensor}`` of the trainable parameters it covers (names relative to the target).
        It must return the same structure and shapes. With ``batched=True`` it receives and returns
        the whole batch ``[B, ...]``. The built-ins of ``pergrad.transforms`` are batched already.
        """
        self._refuse_removed("register_transform")
        label, params, single, ref = self._resolve(target)
        if not params:
            raise TargetError(f"{label} has no trainable parameters; nothing to transform")
        if self._attribution is not None:
            self._attribution.check_transform(label, params)
        for other in self._engine.targets:
            shared = set(params.values()) & set(other.params.values())
            if shared:
                names = sorted(self._engine.param_names[p] for p in shared)
                raise TargetError(
                    f"{label} overlaps {other.label}, which already has a transform: both cover {names}. "
                    "Each parameter takes at most one transform; register one on a common parent instead."
                )
        if isinstance(fn, Transform):
            transform: Transform = fn
        elif callable(fn):
            transform = UserTransform(fn, batched=batched, single_tensor=single, target=label)
        else:
            raise TransformError(f"the transform for {label} must be callable, got {type(fn).__name__}")
        self._targets.append((ref, transform))
        self._engine.targets.add(Target(label, params, transform))
        self._install_hooks()  # the weights it covers may now run detached

    # -- projections ----------------------------------------------------------------------------

    def register_projection(
        self,
        target: nn.Module | nn.Parameter | str,
        *,
        dim: int,
        kind: str = "kron",
        seed: int = 0,
        dtype: torch.dtype | None = None,
        grads: bool = True,
        per_token: bool = False,
        cache_mb: float = 0,
    ) -> None:
        """Compute ``P vec(g_i)``, ``dim`` features of each sample's gradient of ``target``, in every
        backward; read them with ``per_sample_projections()``.

        ``target`` is a parameter, a module or the wrapped model, as for ``register_transform`` (the
        object or its qualified name). ``P = [P_1 ... P_m]`` projects the target's whole gradient (its
        parameters concatenated): each parameter's block ``P_p`` has ``dim`` rows and is regenerated
        from ``(seed, the parameter's qualified name, its shape, kind)``, never saved, so features of
        the same model agree across batches, processes and restarts (``pergrad.attribution.projectors``). Under DDP
        each rank gets its own samples' features, ``P`` named as in the model DDP holds (without DDP's
        ``module.`` prefix): the features one process computes for those samples.

        - ``kind="kron"``: a parameter of two or more dims gets ``P_row ⊗ P_col`` with
          ``r_row * r_col = dim`` (``dim`` a square or twice a square: every power of two is one), the
          factor pair of ``dim`` in the proportion of the weight's sides (``pergrad.attribution.projectors.kron_ranks``:
          a ``[256, 32]`` LM head at ``dim=128`` gets ``32 x 4``, a square weight ``r x r`` or ``r x 2r``),
          computed without building ``g_i`` for Linear (any leading dims),
          Conv1d/2d/3d and ConvTranspose1d/2d/3d (any stride, padding, dilation, groups, output
          padding), Embedding and HF ``Conv1D``, and from
          the built ``g_i`` of one layer at a time for every other layer; one-dim parameters (biases,
          norm weights) get a CountSketch (``pergrad.attribution.projectors``: one pass over ``g_i``).
        - ``kind="dense"``: a dense Rademacher ``[dim, numel]`` block per parameter (entries ``±1/sqrt(dim)``),
          applied to the built ``g_i`` of one layer at a time, drawn again at every backward in chunks of
          4M entries (never held whole when large) unless ``cache_mb`` MiB (for the whole target) can keep
          it: then it is drawn once.
        - ``kind="sjlt"``: a CountSketch of every parameter (a sparse JL transform, one nonzero per column):
          one pass over the built ``g_i`` of one layer at a time.

        Features are of the raw ``g_i`` (before any transform) of each sample's own loss, in ``dtype``
        (default: the parameters'); computed in the parameters' dtype.

        ``per_token=True`` gives ``[B, T, dim]`` features: those of each token's term ``g_it`` of
        ``g_i = sum_t g_it`` (they sum over ``t`` to the per-sample features): for a Linear or HF ``Conv1D``
        on ``[B, T, features]``, ``vec(P_row d_it (P_col a_it)^T)`` from the gradient ``d_it`` reaching the
        token's output and its input ``a_it``; for an Embedding on ``[B, T]``, the token's row. Where
        positions do not mix (no attention or convolution over tokens between the layer and the loss),
        ``g_it`` is the gradient of token t's own loss term. Needs ``kind="kron"`` and a target whose every
        layer is one of these (``ProjectionError`` otherwise, naming the layer; another input shape is
        refused in the backward). A target the backward did not reach gets ``[B, 0, dim]``.

        ``grads=False`` says the target's ``.grad`` is not needed (an attribution pass: features only).
        Its layers' weights then run detached (``pergrad._core.shortcuts.detach``): autograd spends no weight-gradient
        matmul or convolution on them, and pergrad writes no ``.grad`` for them either: it is left as it
        was (None after ``zero_grad()``), so do not step an optimizer on the target. The features are
        unchanged (the gradient reaching each layer does not depend on its weight's gradient). This holds
        in one process, after the first backward (its ``verify`` check needs autograd's gradients; from
        the first with ``verify=False``), with ``detach_transformed=True`` (the default), for the weights
        ``pergrad._core.shortcuts.detach`` may detach (held once in the model, with no ``register_hook`` hook, of a
        Linear, convolution or HF ``Conv1D``); any other parameter of the target (a bias, an embedding,
        a tied weight, under DDP or FSDP2) keeps autograd's ``.grad``. A transform cannot cover a
        parameter of such a target (``TargetError``: its ``.grad`` would be missing).
        """
        self._refuse_removed("register_projection")
        self._attributing().register(
            target, dim=dim, kind=kind, seed=seed, dtype=dtype, grads=grads, per_token=per_token, cache_mb=cache_mb
        )
        if not grads:
            self._install_hooks()  # its weights may now run detached

    def _refuse_removed(self, call: str) -> None:
        """Refuse ``call`` on a removed wrapper: the model is no longer hooked, so nothing would apply what it
        registers (and installing hooks for it would hook the model again)."""
        if self._engine.closed:
            raise PergradError(
                f"{call} on a PerSampleModule that was removed (psm.remove(), or the end of its `with` block): the "
                "model is no longer hooked, so nothing would apply it. Wrap the model again "
                "(psm = PerSampleModule(model)) and register it on the new wrapper."
            )

    def _attributing(self) -> Attribution:
        """The attribution feature's state of this wrapper (``pergrad.attribution.tracking``), made at its
        first use: the one way from the wrapper into a feature, imported here so that a wrapper that
        projects nothing loads and runs none of it."""
        from pergrad.attribution.tracking import Attribution

        if self._attribution is None:
            self._attribution = Attribution(lambda: self.module, self._engine, self._resolve)
        return self._attribution

    def per_sample_projections(self) -> dict[str, Tensor]:
        """``{target name: Tensor[B, dim]}``: the projected per-sample gradients ``P vec(g_i)`` of the last
        backward, one entry per ``register_projection`` target, keyed by its qualified name (``""``
        for the whole model). See ``register_projection``."""
        return self._attributing().features()

    def projection_specs(self) -> dict[str, Spec]:
        """``{target name: Spec}``: how each ``register_projection`` target projects (``dim``, ``kind``,
        ``seed``, ``dtype``), keyed as ``per_sample_projections()``; a feature store checks them before it
        takes the features (``FeatureStore.write_from``)."""
        return self._attributing().specs()

    def track_projected_factors(self, *targets: nn.Module | nn.Parameter | str) -> None:
        """Sum, in every backward from now on, the Kronecker factors of each target's projected gradient
        (K-FAC curvature on the projected space, for LoGra / EK-FAC-style preconditioning in
        ``pergrad.attribution.KroneckerFactored``); read them with ``projected_factors()``, start again
        with ``reset_projected_factors()``.

        Each target is a projection target (``register_projection(weight, dim=...)``, ``kind="kron"``)
        of ONE weight of a Linear, Conv1d/2d/3d, Embedding or HF ``Conv1D``: register one projection
        per weight (a target of several parameters sums their blocks into one feature vector, which no
        Kronecker factors describe). With ``u_is``, ``v_is`` the projected factors of sample ``i`` at
        position ``s`` (its features are ``vec(sum_s u_is v_is^T)``), ``N`` the samples summed::

            row = (1/N) sum_{i,s} u_is u_is^T  [r_row, r_row]    col = (1/N) sum_{i,s} v_is v_is^T  [r_col, r_col]

        (``pergrad.attribution.factors``). With ``keep_grad_sample=True`` the tracked layers' inputs and
        output gradients are held until the end of each backward.
        """
        self._refuse_removed("track_projected_factors")
        self._attributing().track(*targets)

    def projected_factors(self) -> dict[str, Factors]:
        """``{target name: Factors(row, col, samples, positions)}``: the Kronecker factors of each target
        of ``track_projected_factors``, summed over every backward since it was tracked or since
        ``reset_projected_factors()`` (float64, on the weight's device)."""
        return self._attributing().summed_factors()

    def reset_projected_factors(self) -> None:
        """Forget the factors summed so far: the next backward starts new sums (targets stay tracked)."""
        if self._attribution is not None:
            self._attribution.reset_factors()

    def _resolve(
        self, target: nn.Module | nn.Parameter | str
    ) -> tuple[str, dict[str, nn.Parameter], bool, nn.Module | str]:
        """The target's label, the trainable parameters it covers (by name relative to it), whether
        it is one parameter, and how to find it again when the model changes (a parameter by its
        qualified name, a module as given)."""
        modules = dict(self.module.named_modules())
        parameters = {n: self._canonical(p) for n, p in self.module.named_parameters()}
        if isinstance(target, str):
            if target in modules:
                target = modules[target]
            elif target in parameters:
                target = parameters[target]
            else:
                compiled = f"_orig_mod.{target}"  # torch.compile's OptimizedModule holds the network as _orig_mod
                hint = (
                    f": the wrapped model is compiled (torch.compile's OptimizedModule holds the network as "
                    f"'_orig_mod'), so it is named {compiled!r}; pass {compiled!r}, or wrap the network before "
                    "compiling it"
                    if compiled in modules or compiled in parameters
                    else f"; qualified names look like {list(parameters)[:3]} (use '' for the whole model)"
                )
                raise TargetError(f"no module or parameter named {target!r} in the wrapped model{hint}")
        if isinstance(target, nn.Parameter):
            name = next((n for n, p in parameters.items() if p is target), None)
            if name is None:
                raise TargetError(f"the parameter of shape {tuple(target.shape)} is not part of the wrapped model")
            params = {name: target} if target.requires_grad else {}
            return f"parameter {name!r}", params, True, name
        if isinstance(target, nn.Module):
            name = next((n for n, m in modules.items() if m is target), None)
            if name is None:
                raise TargetError(
                    f"the module {type(target).__name__} is not part of the wrapped model: it was replaced after a "
                    "transform or projection was registered on it (by object or by name: either holds the module), "
                    "or it never was. Wrap the model again (psm.remove(); psm = PerSampleModule(model)) and register the "
                    "transform or projection on the module it holds now."
                )
            params = {n: self._canonical(p) for n, p in target.named_parameters() if p.requires_grad}
            label = "the whole model" if name == "" else f"module {name!r}"
            return label, params, False, target
        raise TargetError(
            f"a transform target is a module, a parameter or a qualified name, got {type(target).__name__}"
        )

    # -- lifetime --------------------------------------------------------------------------------

    def _clear_grad_sample(self) -> None:
        for p in self.module.parameters():
            self._engine.grad_sample.drop(p)

    def _uninstall(self) -> None:
        """Take away everything the wrapper installed on the model (also of one half built)."""
        self._engine.closed = True
        if self._engine.world is not None:
            self._engine.world.close()
        self._engine.writer.restore_hooks()
        if self._hooks is not None:
            self._hooks.remove()
        for handle in self._accumulate_handles:
            handle.remove()
        self._accumulate_handles.clear()
        self._release_nodes()
        self._engine.accumulators.clear()
        self._engine.unhooked.clear()

    @property
    def keep_grad_sample(self) -> bool:
        """Whether each backward stores ``p.grad_sample`` (see the ``keep_grad_sample`` argument)."""
        return self._engine.options.keep_grad_sample

    @property
    def removed(self) -> bool:
        """Whether ``remove()`` was called (or the construction failed): the model is no longer hooked."""
        return self._engine.closed

    def remove(self) -> None:
        """Remove every hook and every ``grad_sample``: the model is as it was before wrapping."""
        self._uninstall()
        self._clear_grad_sample()
        self._engine.pool.clear()

    # -- copies: a new wrapper on a copy of the model -----------------------------------------------

    def _recipe(self) -> tuple[nn.Module, dict[str, Any], list[Any], list[Any], list[str], bool]:
        """What a copy is built from: the model, the options, the transforms and projections as
        registered, the tracked factors, and whether the wrapper was removed."""
        if self._engine.world is not None:
            raise PergradError(
                "a PerSampleModule under DistributedDataParallel or FSDP2 cannot be copied or pickled (its hooks are "
                "part of the parallel back-end of this process). Save the model's state_dict "
                "(torch.save(psm.module.state_dict(), path)) and wrap the model again where it is loaded."
            )
        options = {f.name: getattr(self.options, f.name) for f in fields(self.options)}
        options.update(rules=self._rules, grad_scaler=self._grad_scaler, loss_scale=self._loss_scale)
        projections, factors = ([], []) if self._attribution is None else self._attribution.recipe()
        return self.module, options, list(self._targets), projections, factors, self._engine.closed

    def __deepcopy__(self, memo: dict[int, Any]) -> PerSampleModule:
        """A new wrapper, with the same options, transforms and projections, on ``copy.deepcopy`` of the
        model (the copy shares nothing with this one: no ``grad_sample``, norms or kept state; its
        first backward is checked again) but the ``grad_scaler`` and ``loss_scale`` the user drives. ``copy.deepcopy(psm.module)`` is the model alone, unwrapped."""
        for shared in (self._grad_scaler, self._loss_scale):  # driven by the user: the copy reads the same one
            if shared is not None:
                memo[id(shared)] = shared
        return _rebuilt(*copy.deepcopy(self._recipe(), memo))

    def __copy__(self) -> PerSampleModule:
        """A shallow copy, as for any object: the same model, hooks and state under a second name (removing
        either removes both); ``copy.deepcopy`` makes a wrapper of its own."""
        shallow = PerSampleModule.__new__(PerSampleModule)
        vars(shallow).update(vars(self))
        return shallow

    def __reduce__(self) -> tuple[Callable[..., PerSampleModule], tuple[Any, ...]]:
        """Pickling (``torch.save(psm, ...)``) saves the model, the options and the registered transforms
        and projections; loading builds a new wrapper on the loaded model, as ``__deepcopy__`` does. The
        transforms must be picklable (a lambda is not). A ``grad_scaler`` is pickled with the wrapper: save
        both in one file (``torch.save({"psm": psm, "scaler": scaler}, path)``) and drive the loaded scaler, or
        set ``psm.grad_scaler`` to the one you drive. To keep the weights alone, save ``psm.module.state_dict()``."""
        return _rebuilt, self._recipe()

    def __enter__(self) -> PerSampleModule:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"PerSampleModule({type(self.module).__name__}, loss_reduction={self.loss_reduction!r}, "
            f"reduction={self.reduction!r}, layers={len(self._layers)}, transforms={len(self._engine.targets)})"
        )


def _rebuilt(
    model: nn.Module,
    options: dict[str, Any],
    targets: list[tuple[nn.Module | str, Transform]],
    projections: list[tuple[nn.Module | str, Spec, bool, bool, int]],
    factors: list[str],
    removed: bool,
) -> PerSampleModule:
    """A wrapper on ``model`` as ``PerSampleModule._recipe`` describes it (a copy, or an unpickled one)."""
    psm = PerSampleModule(model, **options)
    for target, transform in targets:
        psm.register_transform(target, transform)
    for target, spec, grads, per_token, limit in projections:
        psm.register_projection(
            target,
            dim=spec.dim,
            kind=spec.kind,
            seed=spec.seed,
            dtype=spec.dtype,
            grads=grads,
            per_token=per_token,
            cache_mb=limit / 2**20,
        )
    if factors:
        psm.track_projected_factors(*factors)
    if removed:
        psm.remove()
    return psm


class PerSampleNorms(dict[str, Tensor]):
    """What ``per_sample_norms()`` returns: a dict whose missing keys say why they are missing."""

    def __init__(self, norms: dict[str, Tensor], trainable: list[str], why: str) -> None:
        super().__init__(norms)
        self.trainable, self.why = trainable, why

    def __missing__(self, key: str) -> Tensor:
        if key not in self.trainable:
            raise NormNotComputedError(
                f"{key!r} is not a trainable parameter of the wrapped model; qualified names look like "
                f"{self.trainable[:3]}"
            )
        raise NormNotComputedError(f"no per-sample norm of parameter {key!r} from the last backward: {self.why}")
