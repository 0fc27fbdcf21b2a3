"""The reduction into ``.grad``: ``p.grad += (1/B) sum_i T(g_i)`` (``"mean"``) or ``sum_i T(g_i)``
(``"sum"``) for each target's transform ``T``, and the plain reduction of the weights that ran
detached with no transform (autograd computed no gradient for them), except those of projections
registered with ``grads=False`` (their ``.grad`` is left as it is).

A transform that scales each sample's gradient (``T(g_i) = c_i g_i``: clipping, normalising,
weighting) is reduced as ``sum_i c_i g_i`` without building ``g_i`` where the source allows it;
any other transform gets the built ``g_i`` of its target, ``{name: [B, *shape]}``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from pergrad._core.backward.targets import Target, Targets
from pergrad._core.capture.calls import Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad._core.memory.layout import may_hold_true
from pergrad.errors import SecondOrderError, TransformError
from pergrad.transforms import Scaling, check_output, check_unmodified


def _all_finite(grads: Iterable[Tensor]) -> Tensor:
    """Whether every value of ``grads`` is finite, as a tensor on their device (one read of each, no
    temporary of their size: the inf-norm propagates NaN and Inf)."""
    found = [torch.isfinite(torch.linalg.vector_norm(g, float("inf"))) for g in grads if g.numel()]
    return torch.stack(found).all() if found else torch.tensor(True)


def _check_differentiable(label: str, per_sample: dict[str, Tensor], result: dict[str, Tensor]) -> None:
    """In a backward with ``create_graph=True``: ``T(g_i)`` must carry the graph ``g_i`` carries."""
    if not any(g.requires_grad for g in per_sample.values()):
        return
    flat = [key for key, t in result.items() if not t.requires_grad]
    if flat:
        raise SecondOrderError(
            f"backward(create_graph=True): the transform registered for {label} returned {flat[0]!r} with no "
            "autograd history although the per-sample gradients it got have one, so .grad would be a constant "
            "to differentiate. The transform leaves autograd's graph (detach, no_grad, numpy, an in-place write "
            "into a new tensor); write it with differentiable torch operations."
        )


class Reduction(Consumer):
    """Writes the ``.grad`` of every parameter a target covers, and of the detached weights."""

    def __init__(
        self,
        targets: Targets,
        reduction: str,
        canonical: Callable[[nn.Parameter], nn.Parameter],
        gradless: Callable[[], frozenset[nn.Parameter]],
    ) -> None:
        self.targets, self.reduction, self.canonical = targets, reduction, canonical
        self.unneeded = gradless  # the parameters whose .grad no one needs (``Engine.gradless``): left as it is
        self.last_dropped: dict[str, Tensor] = {}  # target label -> [B] mask of the samples left out

    def reads(self, kept: Kept) -> bool:
        """A call of a layer a transform covers, or one that ran a weight detached whose ``.grad`` pergrad writes."""
        transformed = self.targets.transformed
        if transformed and any(self.canonical(p) in transformed for _, p in kept.layer.trainable()):
            return True
        detached = kept.detached
        if detached is None:
            return False
        gradless = self.unneeded()
        return any(self.canonical(p) not in gradless for p in detached.params)

    def consume(self, batch: Batch) -> None:
        self.last_dropped = {}
        if batch.size == 0:
            self._empty(batch)
            return
        for target in self.targets:
            self._reduce(target, batch)
        if batch.owned:
            self._plain(batch)

    @staticmethod
    def _empty(batch: Batch) -> None:
        """A batch of no samples: every sum over samples is 0, so ``.grad`` gets nothing added (autograd's
        own sum is 0 too); a detached weight gets what autograd would have stored."""
        state = batch.state
        for p in (p for call in state.arrived.detached for p in call.params if p not in batch.unwritten):
            state.written.params[p] = None
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def _plain(self, batch: Batch) -> None:
        """The weights that ran detached with no transform: ``.grad`` gets the plain reduction."""
        owned, state = batch.owned, batch.state
        if all(p in batch.means for p in owned):  # computed by the statistics already
            size = 1.0 if self.reduction == "mean" else float(batch.size)
            totals = {p: state.to_grad_units(batch.means[p] * size) for p in owned}
        else:
            weight = 1.0 / batch.size if self.reduction == "mean" else 1.0
            weights = state.to_grad_units(owned[0].new_full((batch.size,), weight))
            totals = batch.source.summed(owned, weights)
        for param, reduced in totals.items():
            batch.write(param, reduced)

    def _reduce(self, target: Target, batch: Batch) -> None:
        """``T(g_i) = c_i g_i`` (a ``Scaling``): add ``sum_i c_i g_i`` to ``.grad`` without building ``g_i``
        where the source allows it (any other ``T``: ``_apply``). A parameter of the target that this
        backward did not reach has ``g_i = 0``: it adds 0. The norms are those of the samples' own losses
        (unscaled): a bound means the same under a scaler."""
        state, size = batch.state, batch.size
        params = [p for p in target.params.values() if p in state.autograd.reached]
        if not params:
            return
        transform = target.transform
        if not isinstance(transform, Scaling):
            self._apply(target, batch, params)
            return
        norms = None
        if transform.needs_norms:
            norms = torch.stack(list(batch.norms(params).values())).sum(0).sqrt()
        factors = transform.factors(norms, size, params[0].detach())
        drop = overflow = None
        if norms is not None:
            # a sample whose gradient holds NaN or Inf contributes nothing (no branch on its values) and is
            # reported by dropped_samples(); under loss scaling it is an overflow that must reach .grad (so
            # that the scaler skips the step): its factor is NaN
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
        weights = state.to_grad_units(factors / size if self.reduction == "mean" else factors)
        for param, reduced in batch.source.summed(params, weights, drop).items():
            batch.write(param, reduced)

    def _apply(self, target: Target, batch: Batch, params: list[nn.Parameter]) -> None:
        """Any other ``T``: built on the target's ``g_i`` (zeros for a parameter this backward did not
        reach), checked, and ``T(g_i)`` reduced into the ``.grad`` of each parameter it reached."""
        state = batch.state
        grads = batch.source.per_sample(params)
        first = grads[params[0]]
        per_sample = {
            key: grads[p] if p in grads else first.new_zeros((first.shape[0], *p.shape))
            for key, p in target.params.items()
        }
        versions = {key: g._version for key, g in per_sample.items()}
        result = target.transform.apply(per_sample)
        check_output(target.label, per_sample, result)
        if state.create_graph:
            _check_differentiable(target.label, per_sample, result)
        check_unmodified(target.label, per_sample, versions)
        inputs_finite = _all_finite(per_sample.values()) if state.amp else None
        for key, param in target.params.items():
            if (
                param not in state.autograd.reached
            ):  # as autograd leaves it (None stays None), whatever T made of its zeros
                continue
            reduced = result[key].sum(0) if self.reduction == "sum" else result[key].mean(0)
            if not torch.isfinite(reduced).all() and (
                _all_finite(per_sample.values()) if inputs_finite is None else inputs_finite
            ):
                raise TransformError(
                    f"the transform registered for {target.label} produced non-finite values for {key!r}"
                )
            reduced = state.to_grad_units(reduced)  # T(g_i) in the units of .grad
            if inputs_finite is not None:
                # an overflow in the target's g_i reaches .grad as NaN whatever T made of it (a clamp
                # would hide it from the scaler)
                reduced = torch.where(inputs_finite, reduced, torch.nan)
            batch.write(param, reduced)
