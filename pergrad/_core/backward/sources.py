"""Two ways to get quantities of the per-sample gradients ``g_i`` of one backward pass.

- ``Materialized``: the ``[B, *p.shape]`` tensors are built (``keep_grad_sample=True``), and every
  quantity is read off them.
- ``Fused``: only each layer call's kept input ``a`` and output gradient ``d`` are held, and the
  quantities come from the layer's fused rule without building ``g_i`` (norms by the outer-product
  or Gram form, weighted sums ``sum_i c_i g_i`` as one batch gradient with ``c_i d_i``, inner
  products with a fixed tensor). A parameter fed by several calls (a layer used twice, tied
  weights) has cross terms in its norm, so its per-sample gradients are built for that one
  parameter, used and dropped; so are those of layers without a fused rule.

Both answer the same questions, so the engine computes transforms and statistics one way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from pergrad._core.capture.calls import Call, HookedLayer, Kept
from pergrad._core.loss_scale import on_device
from pergrad._core.memory.layout import new_buffer, recorded, recording_buffers
from pergrad.errors import SecondOrderError, UnsupportedLayerError
from pergrad.registry import FusedRule, OutputGrads

Params = Iterable[nn.Parameter]


def no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Rules compute in the parameters' dtype: autocast off where it is on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def no_grad() -> contextlib.AbstractContextManager[Any]:
    """``torch.no_grad()`` where grad mode is on (in a backward it is off unless ``create_graph``)."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def in_parameter_dtype(kept: Kept, d: Tensor, loss_scale: Tensor | None = None) -> tuple[Kept, Tensor]:
    """``kept`` and ``d`` in the dtype of the layer's parameters (they differ under autocast); ``d`` divided by
    ``loss_scale`` after the cast (no underflow in float16)."""
    dtype = kept.layer.dtype
    if dtype is None or d.dtype == dtype:
        return kept, d
    if isinstance(kept.a, Tensor) and kept.a.is_floating_point() and kept.a.dtype != dtype:
        kept = replace(kept, a=kept.a.to(dtype))
    d = d.to(dtype)
    if loss_scale is not None:
        d.div_(on_device(loss_scale, d))  # our own copy
    return kept, d


def _weighted(d: Tensor, weights: Tensor, drop: Tensor | None = None) -> Tensor:
    """``w_i d_i`` per sample; samples in ``drop`` give exactly 0 (even where ``d_i`` is NaN)."""
    w = weights.view(-1, *([1] * (d.dim() - 1)))
    out = d * w if recorded() else torch.mul(d, w, out=new_buffer(tuple(d.shape), d))
    return out if drop is None else _zero_rows(out, drop)


def _per_sample_rows(g: Tensor) -> Tensor:
    """``[B, *shape] -> [B, numel]`` (also for a scalar parameter's ``[B]``)."""
    return g.reshape(g.shape[0], -1)


def _without_rows(a: Any, d: Tensor, drop: Tensor) -> tuple[Any, Tensor]:
    """A call's ``a`` and ``d`` with the rows of the samples in ``drop`` zeroed: either may hold the NaN (``d``
    alone where ``a`` holds ids)."""
    d = _zero_rows(d, drop)
    if isinstance(a, Tensor) and a.is_floating_point():
        a = _zero_rows(a, drop)
    return a, d


def _zero_rows(t: Tensor, drop: Tensor) -> Tensor:
    """``t`` with the rows (samples) in the mask ``drop`` set to 0: a copy, dropped after use (not
    pooled: one parameter's or layer call's at a time is alive)."""
    return t.masked_fill(drop.view(-1, *([1] * (t.dim() - 1))), 0)


def _sum_of_squares(g: Tensor) -> Tensor:
    """``sum_i g_i^2`` elementwise: one fused multiply-add per sample into a single accumulator (a
    reduction over dim 0 strides across the whole tensor and is ~40x slower on CPU)."""
    out = torch.zeros(g.shape[1:], dtype=g.dtype, device=g.device)
    for gi in g:
        out.addcmul_(gi, gi)
    return out


class Materialized:
    """Quantities read off built per-sample gradients ``{param: [B, *shape]}``."""

    def __init__(self, grads: dict[nn.Parameter, Tensor]) -> None:
        self.grads = grads

    def per_sample(self, params: Params) -> dict[nn.Parameter, Tensor]:
        return {p: self.grads[p] for p in params}

    # Each reads the [B, *shape] tensors once and allocates nothing of their size.

    def sq_norms(self, params: Params) -> dict[nn.Parameter, Tensor]:
        return {p: torch.linalg.vector_norm(_per_sample_rows(self.grads[p]), dim=1).square() for p in params}

    def summed(self, params: Params, weights: Tensor, drop: Tensor | None = None) -> dict[nn.Parameter, Tensor]:
        out = {}
        for p in params:
            g = self.grads[p]
            if drop is not None:  # leave the dropped samples out (0 * NaN would be NaN); no data-dependent shape
                g = _zero_rows(g, drop)
            out[p] = torch.tensordot(weights.to(g.dtype), g, dims=1)
        return out

    def dots(self, others: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        return {p: _per_sample_rows(self.grads[p]) @ g.flatten() for p, g in others.items()}

    def sum_squares(self, params: Params) -> dict[nn.Parameter, Tensor]:
        return {p: _sum_of_squares(self.grads[p]) for p in params}

    def moments(
        self, params: Params, means: dict[nn.Parameter, Tensor], squares: bool = True, dots: bool = True
    ) -> Moments:
        """``||g_i||^2``, ``sum_i g_i^2`` (if ``squares``) and ``<g_i, mean>`` (if ``dots``) of every
        parameter in ``params``; a mean missing from ``means`` is taken from the built ``g_i``:
        ``(1/B) sum_i g_i``."""
        params = list(params)
        means = {p: means[p] if p in means else self.grads[p].sum(0).div_(self.grads[p].shape[0]) for p in params}
        return Moments(
            self.sq_norms(params),
            self.sum_squares(params) if squares else {},
            self.dots(means) if dots else {},
            means,
        )


@dataclass(frozen=True)
class Moments:
    """Per parameter: ``sq_norms`` [B], ``sum_squares`` (param shape), ``dots`` [B] with the mean,
    and the ``means`` themselves."""

    sq_norms: dict[nn.Parameter, Tensor]
    sum_squares: dict[nn.Parameter, Tensor]
    dots: dict[nn.Parameter, Tensor]
    means: dict[nn.Parameter, Tensor]


def _numel(d: Tensor | OutputGrads) -> int:
    return d.numel() if isinstance(d, Tensor) else sum(g.numel() for g in d if g is not None)


#: ``run_rule`` scales a copy of ``d`` only where ``d`` is this many times smaller than the
#: per-sample gradients; otherwise it scales the gradients the rule returns, in place.
COPY_D_BELOW = 8


def _differentiable(layer: HookedLayer, d: Tensor | OutputGrads, built: dict[str, Tensor]) -> dict[str, Tensor]:
    """``built``, checked in a backward with ``create_graph=True``: a rule's result is linear in ``d``, so
    where ``d`` has autograd history every result must have some; one without was computed off the
    graph, and what is built from it would be silently constant."""
    tracked = d.requires_grad if isinstance(d, Tensor) else any(g is not None and g.requires_grad for g in d)
    flat = [name for name, g in built.items() if tracked and not g.requires_grad]
    if flat:
        raise SecondOrderError(
            f"backward(create_graph=True): the rule {layer.spec.fn.__qualname__} for {layer.label} returned "
            f"{flat[0]!r} with no autograd history although the layer's output gradient has one, so nothing built "
            "from it could be differentiated. The rule leaves autograd's graph (detach, no_grad, out= or in-place "
            "writes into a buffer, numpy). Compute it with differentiable torch operations when "
            "torch.is_grad_enabled() (pergrad._core.memory.layout.recorded()), or leave the layer to the fallback (fallback=True, no rule registered for its type)."
        )
    return built


def _times(d: Tensor | OutputGrads, scale: float) -> Tensor | OutputGrads:
    """``scale * d``, a new tensor (or tuple of them) unless ``scale`` is 1."""
    if scale == 1.0:
        return d
    return d * scale if isinstance(d, Tensor) else tuple(None if g is None else g * scale for g in d)


def run_rule(layer: HookedLayer, a: Any, d: Tensor | OutputGrads, scale: float = 1.0) -> dict[str, Tensor]:
    """The layer's rule for output gradients ``scale * d``. Rules are linear in ``d``, so the scale
    goes on a copy of ``d`` where that is far smaller than the per-sample gradients (a Linear on
    ``[B, D]``), and otherwise on the per-sample gradients the rule returns: in place where they are
    its own memory (a ``new_buffer``, or ``layout.owned``), so no copy of either is made (a copy of
    ``d`` as large as the gradients would double what a convolution's rule holds). A rule's
    ``UnsupportedLayerError`` (it knows the module, not where it is) is raised again naming the layer."""
    try:
        return _run_rule(layer, a, d, scale)
    except UnsupportedLayerError as err:
        if layer.label in str(err):
            raise
        raise UnsupportedLayerError(f"{layer.label}: {err}") from err


def _run_rule(layer: HookedLayer, a: Any, d: Tensor | OutputGrads, scale: float) -> dict[str, Tensor]:
    if recorded():  # second order: checked to carry the graph; nothing in place, nothing into out= buffers
        return _differentiable(layer, d, layer.spec.fn(layer.module, a, _times(d, scale)))
    if scale == 1.0:
        return layer.spec.fn(layer.module, a, d)
    if not isinstance(d, Tensor):  # every output's gradient (RuleSpec.output_dims): small per-sample rules
        return layer.spec.fn(layer.module, a, _times(d, scale))
    built_size = d.shape[0] * sum(p.numel() for _, p in layer.trainable())
    if d.numel() * COPY_D_BELOW <= built_size:
        return layer.spec.fn(layer.module, a, torch.mul(d, scale, out=new_buffer(tuple(d.shape), d)))
    with recording_buffers() as made:
        built = layer.spec.fn(layer.module, a, d)
    # scaled in place where the rule returned a buffer of its own once (no second copy of its size)
    returned = [id(g) for g in built.values()]
    own = {id(t) for t in made if returned.count(id(t)) == 1}
    return {name: g.mul_(scale) if id(g) in own else g * scale for name, g in built.items()}


class Fused:
    """Quantities computed from the kept ``(a, d)`` of every call, building ``g_i`` only where needed."""

    def __init__(self, calls: list[Call], canonical: Callable[[nn.Parameter], nn.Parameter] | None = None) -> None:
        self.calls = calls
        self._builds: dict[Call, dict[str, Tensor]] = {}
        self.uses: dict[nn.Parameter, list[tuple[Call, str]]] = {}
        # each call's parameters by the name its rule uses, as the engine keys them (FSDP2 swaps a
        # layer's sharded parameters for unsharded ones and back; ``canonical`` maps to the sharded)
        self._params: dict[Call, dict[str, nn.Parameter]] = {}
        self._canonical = canonical
        for call in calls:
            named = {name: p if canonical is None else canonical(p) for name, p in call.layer.trainable()}
            self._params[call] = named
            for name, p in named.items():
                self.uses.setdefault(p, []).append((call, name))

    def _param(self, call: Call, name: str) -> nn.Parameter:
        """The parameter a rule's result ``name`` belongs to (a name the layer gives it, maybe not its first)."""
        found = self._params[call].get(name)
        if found is None:
            found = call.layer.module.get_parameter(name)
            found = found if self._canonical is None else self._canonical(found)
        return found

    def _fused(self, p: nn.Parameter) -> tuple[Call, str, FusedRule] | None:
        """The single call that feeds ``p`` and its fused rule, or None if ``p`` needs building."""
        uses = self.uses[p]
        if len(uses) != 1:
            return None
        call, name = uses[0]
        fused = call.layer.spec.fused
        if fused is None or (fused.builds is not None and fused.builds(call.layer.module, call.a, call.d)):
            return None
        return call, name, fused

    def _calls_of(self, params: Params) -> list[Call]:
        """The calls that feed any of ``params``, each once, in forward order."""
        return list(dict.fromkeys(c for p in params for c, _ in self.uses[p]))

    def _by_call(self, params: Params) -> tuple[dict[Call, list[tuple[nn.Parameter, str]]], list[nn.Parameter]]:
        """Split ``params`` into those a single fused call answers (grouped by call) and the rest."""
        grouped: dict[Call, list[tuple[nn.Parameter, str]]] = {}
        rest = []
        for p in params:
            found = self._fused(p)
            if found is None:
                rest.append(p)
            else:
                grouped.setdefault(found[0], []).append((p, found[1]))
        return grouped, rest

    def _run(self, call: Call) -> dict[str, Tensor]:
        """The call's rule. A result no larger than the call's kept ``a`` and ``d`` is kept for the
        other quantities of this backward (norm layers, convolutions: norms and weighted sums read
        the same ``g_i``), and so is that of a layer without a fused rule, whose weighted sum has no
        other source (building it twice would cost more than materialising). Other large ones are
        not held: their weighted sums are batch gradients of weighted ``d``."""
        if call.built is not None:
            return call.built
        found = self._builds.get(call)
        if found is None:
            found = run_rule(call.layer, call.a, call.d, call.scale)
            kept = _numel(call.d) + (call.a.numel() if isinstance(call.a, Tensor) else 0)
            if call.layer.spec.fused is None or sum(g.numel() for g in found.values()) <= kept:
                self._builds[call] = found
        return found

    def lend_builds(self) -> None:
        """Hand the results of rules without a fused form that this source built (``_run``) to their calls
        (``Call.built``): another source of the same calls in this backward reads them instead of building
        them again."""
        for call, built in self._builds.items():
            if call.built is None and call.layer.spec.fused is None:
                call.built = built

    def per_sample(self, params: Params) -> dict[nn.Parameter, Tensor]:
        """Build ``g_i`` for ``params``: every call's rule, summed per sample."""
        wanted = dict.fromkeys(params)
        out: dict[nn.Parameter, Tensor] = {}
        for call in self._calls_of(wanted):
            for name, g in self._run(call).items():
                p = self._param(call, name)
                if p in wanted:
                    out[p] = g if p not in out else out[p] + g
        return out

    def _built(self, params: list[nn.Parameter]) -> Iterator[Materialized]:
        """Per-sample gradients of ``params``, one layer call at a time (a shared parameter alone)."""
        shared = dict.fromkeys(p for p in params if len(self.uses[p]) > 1)
        for call in self._calls_of(p for p in params if p not in shared):
            yield Materialized(self.per_sample(p for p in params if self.uses[p][0][0] is call and p not in shared))
        for p in shared:
            yield Materialized(self.per_sample([p]))

    def sq_norms(self, params: Params) -> dict[nn.Parameter, Tensor]:
        grouped, rest = self._by_call(params)
        out = {}
        for built in self._built(rest):
            out.update(built.sq_norms(built.grads))
        for call, pairs in grouped.items():
            assert call.layer.spec.fused is not None
            norms = call.layer.spec.fused.sq_norms(call.layer.module, call.a, call.d)
            out.update({p: norms[name] * call.scale**2 for p, name in pairs})
        return out

    def summed(self, params: Params, weights: Tensor, drop: Tensor | None = None) -> dict[nn.Parameter, Tensor]:
        """``sum_i w_i g_i``; rules are linear in d, so this is each call's batch gradient of ``w_i d_i``
        (or the weighted sum of its ``g_i`` where they were built for the norms already). Samples in
        ``drop`` are left out entirely (their input rows too, which may hold NaN)."""
        wanted = dict.fromkeys(params)
        out: dict[nn.Parameter, Tensor] = {}
        for call in self._calls_of(wanted):
            module, fused = call.layer.module, call.layer.spec.fused
            if fused is None or call in self._builds:  # weight the built g_i (d may not be laid out by sample)
                built = self._run(call)
                grads = {self._param(call, k): g for k, g in built.items()}
                per_call = Materialized(grads).summed(grads, weights, drop)
            else:
                a, d, w = call.a, call.d, weights * call.scale
                if drop is not None:
                    a, d = _without_rows(a, d, drop)
                bias = getattr(module, "bias", None)
                no_bias = not (isinstance(bias, Tensor) and bias.requires_grad)  # sum_i w_i d_i needs weighted d
                if fused.bilinear and no_bias and a.numel() < d.numel():  # weight the smaller of the two
                    a = _weighted(a, w)
                else:
                    d = _weighted(d, w)
                per_call = {self._param(call, k): g for k, g in fused.summed(module, a, d).items()}
            for p, g in per_call.items():
                if p in wanted:
                    out[p] = g if p not in out else out[p] + g
        return out

    def dots(self, others: dict[nn.Parameter, Tensor]) -> dict[nn.Parameter, Tensor]:
        grouped, rest = self._by_call(others)
        out = {}
        for built in self._built(rest):
            out.update(built.dots({p: others[p] for p in built.grads}))
        for call, pairs in grouped.items():
            assert call.layer.spec.fused is not None
            by_name = {name: others[p] for p, name in pairs}
            result = call.layer.spec.fused.dots(call.layer.module, call.a, call.d, by_name)
            out.update({p: result[name] * call.scale for p, name in pairs})
        return out

    def feeding(self, params: Container[nn.Parameter]) -> Iterator[tuple[Call, dict[str, nn.Parameter]]]:
        """Each call that feeds any of ``params``, in the order the calls arrived, with those of its
        parameters in ``params`` by the names its rule uses (for a feature's own forms of ``(a, d)``:
        ``pergrad.attribution.projection``)."""
        for call in self.calls:
            named = {name: p for name, p in self._params[call].items() if p in params}
            if named:
                yield call, named

    def built(self, call: Call) -> list[tuple[nn.Parameter, Tensor]]:
        """The per-sample gradients ``g_i`` of one call by parameter: its rule's, shared with the other
        quantities of this backward where they are kept."""
        return [(self._param(call, name), g) for name, g in self._run(call).items()]

    def moments(
        self, params: Params, means: dict[nn.Parameter, Tensor], squares: bool = True, dots: bool = True
    ) -> Moments:
        """Norms, sums of squares (if ``squares``) and inner products with the means (if ``dots``).
        Parameters without a single fused call (shared, or a rule that builds) have their ``g_i``
        built once, and all of them, a missing mean included, are read off them. With sums of
        squares, so are those of a call without a factorised sum of squares or whose mean is not in
        ``means`` (autograd did not compute it). Without, a fused call's missing mean is its batch
        gradient ``(1/B) sum_i g_i``."""
        params = list(params)
        grouped, rest = self._by_call(params)
        out = Moments({}, {}, {}, {p: means[p] for p in params if p in means})
        if squares:
            for call in [c for c, pairs in grouped.items() if any(p not in means for p, _ in pairs)]:
                rest.extend(p for p, _ in grouped.pop(call))
            rest.extend(self._factorised_moments(grouped, out, dots))
        elif grouped:
            fused = [p for pairs in grouped.values() for p, _ in pairs]
            out.sq_norms.update(self.sq_norms(fused))
            missing = [p for p in fused if p not in means]
            if missing:
                b = out.sq_norms[missing[0]].shape[0]
                out.means.update(self.summed(missing, out.sq_norms[missing[0]].new_full((b,), 1.0 / b)))
            if dots:
                out.dots.update(self.dots({p: out.means[p] for p in fused}))
        for built in self._built(rest):
            part = built.moments(built.grads, means, squares=squares, dots=dots)
            out.sq_norms.update(part.sq_norms)
            out.sum_squares.update(part.sum_squares)
            out.dots.update(part.dots)
            out.means.update(part.means)
        return out

    def _factorised_moments(
        self, grouped: dict[Call, list[tuple[nn.Parameter, str]]], out: Moments, dots: bool
    ) -> list[nn.Parameter]:
        """Norms, sums of squares and (if ``dots``) inner products with ``out.means`` of each call's
        parameters from its fused rule's factorised forms, into ``out``; returns the parameters of
        the calls that have none for these shapes (to be built)."""
        unfactorised: list[nn.Parameter] = []
        for call, pairs in grouped.items():
            fused, module = call.layer.spec.fused, call.layer.module
            assert fused is not None
            other = {name: out.means[p] for p, name in pairs} if dots else None
            found = None if fused.moments is None else fused.moments(module, call.a, call.d, other)
            if found is None and fused.sum_squares is not None:
                sums = fused.sum_squares(module, call.a, call.d)
                if sums is not None:
                    found = (
                        fused.sq_norms(module, call.a, call.d),
                        sums,
                        {} if other is None else fused.dots(module, call.a, call.d, other),
                    )
            if found is None:
                unfactorised.extend(p for p, _ in pairs)
                continue
            norms, sums, inner = found
            s2 = call.scale**2
            for p, name in pairs:  # fresh tensors: scaled in place
                out.sq_norms[p], out.sum_squares[p] = norms[name].mul_(s2), sums[name].mul_(s2)
                if dots:
                    out.dots[p] = inner[name].mul_(call.scale)
        return unfactorised
