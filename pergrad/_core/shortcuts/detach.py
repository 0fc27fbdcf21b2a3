"""Skipping autograd's weight gradient where pergrad writes ``.grad`` itself.

After the first backward, a layer whose weight gradient pergrad computes anyway can run with that
weight detached for the call (a swap in ``module._parameters``, undone by a forward hook that runs
even when the forward raises): autograd then spends no matmul or convolution backward on it, and
pergrad writes the weight's ``.grad`` from the layer's ``(a, d)``.

The shortcut is taken only where it provably gives what autograd would:

- the weight appears once in the model and in one hooked layer (a tied weight is also reached
  another way, whose share autograd would add on top of pergrad's sum);
- no tensor hook is registered on it (``p.register_hook``: autograd would never call it);
  post-accumulate-grad hooks are fine: pergrad calls them once it has written ``.grad``;
- every call of the layer in one forward runs the same way: the first call decides for the rest,
  so each parameter's ``.grad`` is either all autograd's or all pergrad's;
- not while the first backward's check still needs autograd's gradients, nor under torch.func
  transforms or torch.compile; under FSDP2 (``pergrad._core.parallel.distributed``) only weights a transform covers
  (every rank must leave the same unsharded parameters without a gradient).

A weight whose ``.grad`` is not needed at all (a projection target registered with ``grads=False``,
in one process) also runs detached, whatever its positions: pergrad then writes no ``.grad`` for it.

An *anchor* stays attached in the same call (see ``Detached``) and is *touched* with the detached
parameters (``touch``): a backward through it runs their ``AccumulateGrad`` at no matmul's cost, so
which backward passes reach a detached weight is told by its own ``AccumulateGrad``: in one process
it gets no gradient, and a guard refuses, with an error naming the layer, a backward that asks autograd
itself for the weight (``torch.autograd.grad``, ``backward(inputs=[weight])``); under DDP, whose reducer
waits for every parameter's ``AccumulateGrad``, it gets a broadcast zero. Under FSDP2 nothing is touched
and the anchor's own ``AccumulateGrad`` tells.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol, TypeGuard

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pergrad._core.capture.calls import Detached, HookedLayer
from pergrad._core.options import Options
from pergrad._core.parallel.world import World
from pergrad._core.shortcuts.reach import Taps, user_hooks, weakly
from pergrad.errors import DetachedWeightError

MANY = 16  # positions per sample from which summing built g_i beats autograd's weight gradient
# flops of a Linear's weight gradient by autograd (``2 B L |W|``) below which detaching the weight costs the host
# more (the calls of the swap, the touch and the taps, at every call of the layer) than the matmul it saves
FEW_FLOPS = 2**22


class _Touch(torch.autograd.Function):
    """``x`` unchanged; in the backward, ``x``'s gradient passes and every other input gets ``zero``
    (a scalar) expanded to its shape, or no gradient when ``zero`` is None (see ``touch``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, zero: Tensor | None, guard: _Guard | None, *params: Tensor) -> Tensor:
        ctx.zero, ctx.shapes, ctx.guard = zero, [p.shape for p in params], guard
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.guard is not None:
            ctx.guard.check()
        if ctx.zero is None:
            return (grad, None, None, *(None for _ in ctx.shapes))
        return (grad, None, None, *(ctx.zero.expand(shape) for shape in ctx.shapes))


class _Guard:
    """Tells, in the backward, whether autograd itself is asked for a detached weight's gradient.

    The weights and a sentinel (pergrad's probe, which nothing but an ordinary ``.backward()`` of the
    whole graph accumulates into) are touched with the call's anchor (``touch``), so their
    ``AccumulateGrad`` nodes are in the graph: ``torch._C._will_engine_execute_node`` says whether one
    runs in this backward. A weight's runs (or ``torch.autograd.grad`` captures it: asking that of a
    leaf raises) while the sentinel's does not: ``torch.autograd.grad`` or ``backward(inputs=...)`` names
    the weight, whose gradient autograd does not compute (the call ran with it detached). One guard
    serves every call of its layer (the nodes are the parameters' own)."""

    def __init__(self, label: str, sentinel: Tensor, params: tuple[Tensor, ...]) -> None:
        self.label, self.params = label, params
        self.sentinel, self.nodes = get_gradient_edge(sentinel).node, [get_gradient_edge(p).node for p in params]

    def check(self) -> None:
        if not torch._C._will_engine_execute_node(self.sentinel):
            self._refuse_if_asked()

    def _refuse_if_asked(self) -> None:
        """The sentinel's ``AccumulateGrad`` does not run in this backward: refuse it if a weight's does."""
        will_run = torch._C._will_engine_execute_node
        try:
            asked = any(will_run(node) for node in self.nodes)
        except RuntimeError:  # asked of a leaf that torch.autograd.grad captures: the weight is asked for
            asked = True
        if not asked:
            return
        raise DetachedWeightError(
            f"autograd was asked for the gradient of the weight of {self.label} (torch.autograd.grad or "
            "backward(inputs=...)), but this forward ran it detached: pergrad computes its .grad itself, from "
            "the per-sample gradients (or not at all, for a projection registered with grads=False), and autograd "
            "skips it (captum's TracInCP asks this way). Pass detach_transformed=False to PerSampleModule to keep "
            "every weight in autograd's graph, or call psm.remove() (or leave its `with` block) before such a "
            "forward; or read each sample's gradient from p.grad_sample after an ordinary backward "
            "(pergrad.integrations.captum.tracin_influence and tracin_self_influence give TracInCP's scores from it)."
        )


class _Anchored(torch.autograd.Function):
    """``x`` itself (marked as written in place: no copy), tied to the scalar ``anchor``: in the
    backward, ``x``'s gradient passes and ``anchor`` gets a zero (see ``anchor_output``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.new_zeros(())


def anchor_output(output: Tensor, anchor: Tensor) -> Tensor:
    """A call's ``output`` tied to a probe ``anchor`` (``Detached.on_output``): a backward through the
    output runs the anchor's ``AccumulateGrad``. In place, at no pass over the output, unless the output
    is a view or a leaf (then ``output + anchor``: adding 0 changes no value)."""
    if output._is_view() or (output.requires_grad and output.grad_fn is None):
        return output + anchor
    found = _Anchored.apply(output, anchor)
    assert isinstance(found, Tensor)
    return found


def touch(x: Tensor, params: tuple[Tensor, ...], zero: Tensor | None, guard: _Guard | None = None) -> Tensor:
    """``x``, tied to ``params`` so that a backward through it runs their ``AccumulateGrad`` with
    ``zero`` expanded to their shapes (no memory of their size until autograd stores it), or with no
    gradient (None) where ``zero`` is None; ``guard`` checks what the backward asks for."""
    out = _Touch.apply(x, zero, guard, *params)
    assert isinstance(out, Tensor)
    return out


def positions(module: nn.Module, a: Any, batch_dim: int) -> int:
    """How many positions per sample a Linear or convolution applies its weight at (1 otherwise)."""
    if not isinstance(a, Tensor) or a.dim() <= batch_dim or a.shape[batch_dim] == 0:
        return 1
    if isinstance(module, nn.Linear):
        return a.numel() // (a.shape[batch_dim] * a.shape[-1])
    if isinstance(module, nn.modules.conv._ConvNd):
        return math.prod(a.shape[2:])
    return 1


def few_flops(module: nn.Module, a: Any, batch_dim: int, count: int) -> bool:
    """Whether autograd's weight gradient for this call of a Linear on ``a`` costs fewer than ``FEW_FLOPS`` flops
    (``2 B L |W|`` at ``count`` positions per sample). Not asked of a convolution: its weight gradient (one
    ``convolution_backward`` with the input's) costs the host more than its flops say, and more than detaching."""
    if not isinstance(module, nn.Linear) or not isinstance(a, Tensor) or a.dim() <= batch_dim:
        return False
    return 2 * a.shape[batch_dim] * count * module.weight.numel() < FEW_FLOPS


def has_tensor_hooks(p: Tensor) -> bool:
    """Whether ``p.register_hook`` hooks of the user's are on ``p`` (autograd calls them with its own
    gradient; pergrad's own, ``reach.Unhooked``, left out)."""
    return user_hooks(p)


class Wrapper(Protocol):
    """What the detacher reads of the wrapper it decides for (``pergrad._core.backward.engine.Engine`` is one)."""

    detach_transformed: bool  # may weights run detached at all
    world: World | None
    closed: bool
    verify_backwards: int  # > 0: the first backward's check still needs autograd's weight gradients
    options: Options
    track_norms: bool
    second_moments: bool  # elementwise second moments are tracked
    second_order: bool  # a backward with create_graph=True ran: its derivatives need every weight attached
    taps: Taps

    @property
    def transformed(self) -> set[nn.Parameter]: ...

    @property
    def gradless(self) -> frozenset[nn.Parameter]: ...  # of projections registered with grads=False

    def canonical(self, p: nn.Parameter) -> nn.Parameter: ...

    def on_probe(self, grad: Tensor | None) -> Tensor | None: ...


class Detacher:
    """Decides, for each call of a hooked layer, whether its weight runs detached (``for_call``).

    The first call of a layer in a forward decides for every later one: detached where pergrad writes the
    weight's ``.grad`` at less cost than autograd's weight gradient (``_owned``) --

    - a transform covers the weight: pergrad computes ``.grad`` from ``(a, d)`` anyway;
    - ``grad_sample`` is built (or second moments tracked) and the layer sees many positions per
      sample (a convolution, a Linear on sequences): ``.grad`` (the mean) is then the sum of
      the built ``g_i``, one read of ``B x |W|`` values, where autograd spends ``2 B L |W|``
      flops on L positions;
    - norms of a convolution are tracked (they build its ``g_i``: see ``conv_builds``);
    - a projection registered with ``grads=False`` covers the weight (one process): its ``.grad``
      is not needed, and pergrad leaves it unwritten;

    and, in one process with ``verify=True``, where autograd's weight gradient of a Linear costs at least
    ``FEW_FLOPS``: below it, the host's work of running detached costs more than the matmul saved."""

    def __init__(self, engine: Wrapper) -> None:
        self.engine = engine
        self.single: set[nn.Parameter] = set()  # appear once in the model, in one hooked layer
        self._probes: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._zeros: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # what ``touch`` expands
        self._generation = -1
        self._decided: dict[str, bool] = {}  # layer name -> did its first call in this forward detach
        self.current: set[nn.Parameter] = set()  # the parameters detached in this forward
        self._guards: dict[str, _Guard] = {}  # layer name -> the guard of its calls

    def candidates(self, layers: list[HookedLayer], model: nn.Module) -> None:
        """Record which parameters may ever run detached: those the model holds once, in a layer
        whose rule takes its first input alone (not a subtree or all-inputs rule), and whose weight
        is a parameter (not computed by a parametrization: its gradient flows back to the originals)."""
        counts: dict[nn.Parameter, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            counts[p] = counts.get(p, 0) + 1
        self.single = {
            p
            for layer in layers
            if not (layer.spec.all_inputs or layer.spec.subtree or layer.spec.raw or layer.spec.parametrized)
            for _, p in layer.module.named_parameters(recurse=False)
            if counts.get(p) == 1
        }

    def may_detach(self, layer: HookedLayer) -> bool:
        """Whether a call of ``layer`` may run detached with the wrapper configured as it is now
        (``for_call`` decides per call); its detaching hooks are installed only then. Registering a
        transform installs them again."""
        engine, module = self.engine, layer.module
        if not engine.detach_transformed or (engine.world is not None and not engine.world.detaches):
            return False
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, nn.Parameter) and engine.canonical(weight) in self.single):
            return False
        return self._owned(module, engine.canonical(weight), many=True)  # the most a call can ask for

    def _owned(self, module: nn.Module, key: nn.Parameter, many: bool, few: bool = False) -> bool:
        """Whether pergrad writes the ``.grad`` of ``module``'s weight ``key`` itself when the call
        applies it at ``many`` positions per sample, its weight gradient costing ``few`` flops (see the class)."""
        engine = self.engine
        world = engine.world
        if world is None and key in engine.gradless:
            return True  # its .grad is not needed: autograd's weight gradient is pure cost
        if world is not None and not world.touches:
            # FSDP2 reduce-scatters what has a gradient: detach alike on every rank, whatever
            # its batch (an empty one has "few" positions), so only the weights a transform covers
            return key in engine.transformed
        # (DDP: every rank alike, whatever its batch; verify=False: no tap would check what else reaches an
        # attached weight, where a detached one's guard refuses it)
        if few and world is None and engine.options.verify:
            return False
        # with second moments, the mean of a detached weight comes from its built g_i (many positions)
        owned = (
            many if engine.second_moments else key in engine.transformed or (engine.options.keep_grad_sample and many)
        )
        return owned or (engine.track_norms and many and isinstance(module, nn.modules.conv._ConvNd))

    def reset(self) -> None:
        """Forget the running forward's decisions (the hooks are being installed again)."""
        self._generation, self._decided, self.current = -1, {}, set()
        self._guards = {}

    def renew_guards(self) -> None:
        """The parameters have new ``AccumulateGrad`` nodes: each layer's guard is made again at its next call."""
        self._guards = {}

    def _ok(self, p: Any) -> TypeGuard[nn.Parameter]:
        if not (isinstance(p, nn.Parameter) and p.requires_grad):
            return False
        return self.engine.canonical(p) in self.single and not has_tensor_hooks(p)

    def for_call(self, layer: HookedLayer, a: Any, batch_dim: int, generation: int) -> Detached | None:
        """The parameters this call of ``layer`` on input ``a`` runs detached, or None; the first call of a
        layer in a forward decides for every later one (see the class)."""
        engine = self.engine
        if generation != self._generation:
            self._generation, self._decided, self.current = generation, {}, set()
        if not engine.detach_transformed or engine.closed or engine.verify_backwards > 0:
            return None
        world = engine.world
        if world is not None and not world.detaches:
            return None
        first = self._decided.get(layer.name)
        # no weight runs detached in the forwards after a backward with create_graph=True; a segment that
        # activation checkpointing computes again inside that backward runs as its forward did
        if first is False or (engine.second_order and first is None):
            return None
        module = layer.module
        # (read where the swap writes; a plain attribute named weight is not a parameter to detach)
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias", "absent")
        found = None
        if self._ok(weight):
            owned = first is not None  # (the layer's first call in this forward detached)
            if not owned:
                count = positions(module, a, batch_dim)
                owned = self._owned(
                    module, engine.canonical(weight), count >= MANY, few_flops(module, a, batch_dim, count)
                )
            if owned:
                found = self._detach(module, weight, bias)
        if found is not None:
            if world is None:
                found = self._touched(found, *self._guard(layer, found.params), None, generation)
            else:
                found = self._across(found, world, generation)
        if first is None:
            self._decided[layer.name] = found is not None
        if found is not None:
            self.current.update(found.params)
        return found

    def _across(self, found: Detached, world: World, generation: int) -> Detached:
        """Several processes: ``found`` touched where the world's reducer waits for every parameter (DDP),
        its parameters the ones the world keys gradients by."""
        if world.touches:
            found = self._touched(found, None, found.params, self._zero(found.params[0]), generation)
        return replace(found, params=tuple(map(self.engine.canonical, found.params)))

    def _detach(self, module: nn.Module, weight: nn.Parameter, bias: Any) -> Detached | None:
        """What a call of ``module`` runs with its ``weight`` detached: the swaps and the anchor (see
        ``Detached``), or None where no anchor is found."""
        engine = self.engine
        swaps: list[tuple[str, Tensor | None, Tensor]] = [("weight", weight, weight.detach())]
        trainable_bias = isinstance(bias, nn.Parameter) and bias.requires_grad
        if isinstance(module, nn.modules.conv._ConvNd):
            # mkldnn computes a convolution's bias gradient with its weight gradient, so the bias
            # is detached too (when pergrad can write its .grad) and the probe added to the output
            if not trainable_bias:
                return Detached(self.probe(weight), (weight,), tuple(swaps), probe=True, on_output=True)
            assert isinstance(bias, nn.Parameter)
            writes_bias = self.engine.canonical(bias) in engine.transformed
            if engine.world is None:
                writes_bias = writes_bias or bias in engine.gradless
            if engine.world is None or engine.world.touches:
                writes_bias = writes_bias or engine.options.keep_grad_sample or engine.track_norms
            if writes_bias and self._ok(bias):
                swaps.append(("bias", bias, bias.detach()))
                return Detached(self.probe(weight), (weight, bias), tuple(swaps), probe=True, on_output=True)
        if trainable_bias:
            assert isinstance(bias, nn.Parameter)
            return Detached(bias, (weight,), tuple(swaps))
        if type(module) is nn.Embedding:  # no bias: the probe is added to the output (which the weight alone
            # makes: without the probe, a detached lookup would leave the output outside the graph)
            return Detached(self.probe(weight), (weight,), tuple(swaps), probe=True, on_output=True)
        if bias is None and isinstance(module, nn.Linear):  # the probe as a zero bias: addmm adds it
            probe = self.probe(weight)
            swaps.append(("bias", None, probe.expand(module.out_features)))
            return Detached(probe, (weight,), tuple(swaps), probe=True)
        return None  # a frozen bias, or one the module does not keep as `bias`

    def _guard(self, layer: HookedLayer, params: tuple[nn.Parameter, ...]) -> tuple[_Guard, tuple[Tensor, ...]]:
        """The guard of ``layer``'s calls whose ``params`` run detached, and what to touch with it: the
        sentinel and the parameters (see ``_Guard``); made once per layer and parameters."""
        sentinel, found = self.probe(params[0]), self._guards.get(layer.name)
        if found is None or len(found.params) != len(params) or any(a is not b for a, b in zip(found.params, params)):
            found = self._guards[layer.name] = _Guard(layer.label, sentinel, params)
        return found, (sentinel, *params)

    def _touched(
        self, found: Detached, guard: _Guard | None, params: tuple[Tensor, ...], zero: Tensor | None, generation: int
    ) -> Detached:
        """``found`` with its anchor touched by the detached ``params`` (see ``touch``): where the anchor stands in
        as the bias, the swapped-in bias; where it is added to the output, the anchor itself.

        Under DDP (no ``guard``) their ``AccumulateGrad`` gets ``zero`` (its reducer waits for every
        parameter); in one process no gradient, so that their ``AccumulateGrad`` tells which backward
        passes reach them, and the guard refuses a backward that asks autograd for them. A bias that is the
        anchor is read through its tap (``pergrad._core.shortcuts.reach``): the layer's tapper sees the touched view."""

        def tied(x: Tensor) -> Tensor:
            return touch(x, params, zero, guard)

        if found.on_output:  # (built directly: dataclasses.replace costs as much as the rest, at every call)
            return Detached(tied(found.anchor), found.params, found.swaps, found.probe, found.on_output)
        swaps = list(found.swaps)
        index = next(i for i, (name, _, _) in enumerate(swaps) if name == "bias") if found.probe else None
        if index is None:  # the layer's own bias is the anchor: swap in a touched view of it (of its tap)
            tapped = self.engine.taps.tap(found.anchor, generation)
            swaps.append(("bias", found.anchor, tied(found.anchor if tapped is None else tapped)))
        else:
            name, original, replacement = swaps[index]
            swaps[index] = (name, original, tied(replacement))
        return Detached(found.anchor, found.params, tuple(swaps), found.probe, found.on_output)

    def _zero(self, like: Tensor) -> Tensor:
        """The scalar zero ``touch`` expands for parameters of ``like``'s dtype and device."""
        key = (like.dtype, like.device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros((), dtype=like.dtype, device=like.device)
        return zero

    def is_touch_zero(self, grad: Tensor) -> bool:
        """Whether ``grad`` is the zero ``touch`` handed a detached parameter, untouched by any other
        gradient: known by its memory, without reading a value (no host sync)."""
        zero = self._zeros.get((grad.dtype, grad.device))
        return zero is not None and grad.data_ptr() == zero.data_ptr() and not any(grad.stride())

    def probe(self, like: Tensor) -> Tensor:
        """pergrad's zero anchor for ``like``'s dtype and device (see ``Detached``)."""
        key = (like.dtype, like.device)
        probe = self._probes.get(key)
        if probe is None:
            probe = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)
            probe.register_hook(weakly(self.engine.on_probe))  # (its hooks are out of the collector's sight)
            self._probes[key] = probe
        return probe
