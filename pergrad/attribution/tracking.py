"""One wrapper's attribution state (``PerSampleModule.register_projection``, ``track_projected_factors``
and their read-outs delegate here): the projection targets as registered, resolved again when the
model changes, and the consumers the feature adds to the wrapper's engine (``Engine.add``): the
projection with the first registered target, the projected factors with the first tracked one. A
wrapper that projects nothing has neither, and its backward runs none of their code."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy

from pergrad._core.backward.engine import Engine
from pergrad.attribution.factors import Factors, ProjectedFactors, check_factored
from pergrad.attribution.projection import Projected, Projection, check_per_token, check_request
from pergrad.attribution.projectors import Budget, Projector, Spec
from pergrad.errors import ProjectionError, TargetError

Ref = nn.Module | str  # a target as the wrapper finds it again: a module, or a parameter's qualified name
Resolve = Callable[[nn.Module | nn.Parameter | str], tuple[str, dict[str, nn.Parameter], bool, Ref]]
# a registered projection: (target, spec, grads, per_token, budget)
Registered = tuple[Ref, Spec, bool, bool, Budget]


class Attribution:
    """The projections and tracked factors of one wrapper, whose model is ``model()``; ``resolve`` is
    the wrapper's ``(label, parameters by name, one parameter?, ref)`` of a target."""

    def __init__(self, model: Callable[[], nn.Module], engine: Engine, resolve: Resolve) -> None:
        self.model, self.engine, self.resolve = model, engine, resolve
        self.registered: list[Registered] = []
        self.projection: Projection | None = None  # made with the first projection
        self.factors: ProjectedFactors | None = None  # made with the first tracked target

    @property
    def targets(self) -> list[Projected]:
        return [] if self.projection is None else self.projection.targets

    def bind(self) -> None:
        """Resolve every registered target again in the model as it is now (new projectors: their kept
        blocks counted afresh). A parameter of a lazy module added since is left out until the call that
        materialises it binds again, before its backward."""
        if self.projection is not None:
            self.projection.targets = [
                self.projected(ref, spec, grads, per_token, Budget(budget.limit), lazy=True)
                for ref, spec, grads, per_token, budget in self.registered
            ]

    def check_transform(self, label: str, params: dict[str, nn.Parameter]) -> None:
        """Refuse a transform on ``label`` covering a parameter of a projection registered with ``grads=False``."""
        for projected in self.targets:
            shared = set(params.values()) & set(projected.params) if not projected.grads else set()
            if shared:
                raise TargetError(self.gradless_overlap(label, projected.name, shared))

    def register(
        self,
        target: nn.Module | nn.Parameter | str,
        *,
        dim: int,
        kind: str,
        seed: int,
        dtype: torch.dtype | None,
        grads: bool,
        per_token: bool,
        cache_mb: float,
    ) -> None:
        """``PerSampleModule.register_projection``, checked and recorded (the caller installs the hooks
        again where ``grads=False``: its weights may now run detached)."""
        check_request(dim, kind, dtype, per_token)
        spec = Spec(dim, kind, seed, dtype)
        label, _, _, ref = self.resolve(target)
        budget = Budget(int(cache_mb * 2**20))
        projected = self.projected(ref, spec, grads, per_token, budget)
        if per_token:
            check_per_token(label, projected, self.engine.layers, self.engine.canonical)
        if any(other.name == projected.name for other in self.targets):
            raise TargetError(
                f"{label} already has a projection (per_sample_projections() holds one per target name); "
                "register it once, or project its parameters or submodules separately"
            )
        if not grads:
            for other in self.engine.targets:
                shared = set(projected.params) & set(other.params.values())
                if shared:
                    raise TargetError(self.gradless_overlap(other.label, projected.name, shared))
        if self.projection is None:
            self.projection = Projection(self.engine.canonical)
            self.engine.add(self.projection)
        self.registered.append((ref, spec, grads, per_token, budget))
        self.projection.targets.append(projected)

    def gradless_overlap(self, label: str, projected: str, shared: set[nn.Parameter]) -> str:
        names = sorted(self.engine.param_names[p] for p in shared)
        where = self.resolve(projected)[0]
        return (
            f"{label} has a transform, and the projection of {where} with grads=False leaves the .grad of "
            f"{names} unwritten: the transform's result would be lost. Register that projection with grads=True "
            "(the default), or do not transform its parameters."
        )

    def projected(
        self, target: Ref, spec: Spec, grads: bool, per_token: bool, budget: Budget, lazy: bool = False
    ) -> Projected:
        """The projection target ``target`` with a block per trainable parameter; ``lazy``: without those of
        lazy modules before their first forward (else refused: a block is drawn from its parameter's shape)."""
        label, params, _, ref = self.resolve(target)
        if not params:
            raise TargetError(f"{label} has no trainable parameters; nothing to project")
        model = self.model()
        name = ref if isinstance(ref, str) else next(n for n, m in model.named_modules() if m is ref)
        names = self.engine.param_names
        unshaped = sorted(names[p] for p in params.values() if is_lazy(p))
        if unshaped and not lazy:  # P_p is drawn from the parameter's shape, which it does not have yet
            raise ProjectionError(
                f"the projection of {label}: {unshaped} belong to a lazy module that has not run its first forward, "
                "and each parameter's block of P is drawn from its shape. Run one forward of the model "
                "(model(example_batch)) before register_projection."
            )
        if isinstance(model, DistributedDataParallel):  # named as in the model DDP holds: one process's P
            names = {p: n.removeprefix("module.") for p, n in names.items()}
        projectors = {p: Projector(spec, names[p], tuple(p.shape), budget) for p in params.values() if not is_lazy(p)}
        return Projected(name, spec, projectors, grads, per_token)

    def features(self) -> dict[str, Tensor]:
        """``PerSampleModule.per_sample_projections``."""
        projection = self.projection
        if projection is None or not projection.targets:
            raise ProjectionError("per_sample_projections(): no projection registered; call register_projection first")
        if not projection.last:
            raise ProjectionError("per_sample_projections() is available after a backward pass")
        if projection.unreached:
            raise ProjectionError(
                f"per_sample_projections(): the last backward accumulated into no parameter of the projection "
                f"target(s) {projection.unreached}, so it has no per-sample gradients of theirs to project (a "
                "torch.autograd.grad call, or backward(inputs=...) without them, computes no .grad for them). Call "
                "loss.backward() (or backward(inputs=[...]) naming their parameters) before reading the features"
            )
        return dict(projection.last)

    def specs(self) -> dict[str, Spec]:
        """``PerSampleModule.projection_specs``."""
        return {target.name: target.spec for target in self.targets}

    def track(self, *targets: nn.Module | nn.Parameter | str) -> None:
        """``PerSampleModule.track_projected_factors``."""
        if not targets:
            raise ProjectionError(
                "track_projected_factors() needs at least one projection target, e.g. "
                "track_projected_factors('fc.weight') after register_projection('fc.weight', dim=64)"
            )
        names = []
        model = self.model()
        for target in targets:
            label, params, _, ref = self.resolve(target)
            name = ref if isinstance(ref, str) else next(n for n, m in model.named_modules() if m is ref)
            if isinstance(ref, nn.Module):
                label = f"{label} ({type(ref).__name__})"
            projected = next((t for t in self.targets if t.name == name), None)
            if projected is None:
                weights = [self.engine.param_names[p] for p in params.values() if p.dim() >= 2]
                raise ProjectionError(
                    f"track_projected_factors: {label} has no projection; register one per weight first, e.g. "
                    f"register_projection({(weights or [name])[0]!r}, dim=64)"
                )
            check_factored(label, projected, self.engine.layers, self.engine.canonical, self.engine.param_names)
            names.append(name)
        if self.factors is None:
            assert self.projection is not None  # (every tracked target is a projection's)
            self.factors = ProjectedFactors(self.projection, self.engine.canonical)
            self.engine.add(self.factors)
        self.factors.names.update(dict.fromkeys(names))

    def tracked(self) -> list[str]:
        """The tracked targets' names, in order."""
        return [] if self.factors is None else list(self.factors.names)

    def summed_factors(self) -> dict[str, Factors]:
        """``PerSampleModule.projected_factors``."""
        factors = self.factors
        if factors is None or not factors.names:
            raise ProjectionError(
                "projected_factors(): no factors tracked; call track_projected_factors('fc.weight') first"
            )
        found = factors.factors()
        if not found:
            raise ProjectionError(
                "projected_factors() is available after a backward pass (since track_projected_factors or "
                "reset_projected_factors)"
            )
        return found

    def reset_factors(self) -> None:
        """``PerSampleModule.reset_projected_factors``."""
        if self.factors is not None:
            self.factors.reset()

    def recipe(self) -> tuple[list[tuple[Ref, Spec, bool, bool, int]], list[str]]:
        """The projections as registered (their cache budgets as limits) and the tracked targets, for a copy."""
        projections = [
            (ref, spec, grads, per_token, budget.limit) for ref, spec, grads, per_token, budget in self.registered
        ]
        return projections, self.tracked()
