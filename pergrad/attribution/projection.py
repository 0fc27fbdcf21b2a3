"""Projected per-sample gradients ``P vec(g_i)`` ``[B, k]`` of each projection target
(``psm.register_projection``, read by ``psm.per_sample_projections()``); the projections are in
``pergrad.attribution.projectors``, their Kronecker forms in ``pergrad.attribution.forms``.

Features are those of the samples' raw gradients ``g_i`` of their own losses ``f_i`` (before any
transform, unscaled under loss scaling), with ``loss_reduction`` "mean" as with "sum"; per token
(``per_token=True``), ``[B, T, k]``, those of each token's term ``g_it`` (``g_i = sum_t g_it``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pergrad._core.backward.sources import Fused, Materialized
from pergrad._core.backward.state import Backward
from pergrad._core.capture.calls import Call, HookedLayer, Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad.attribution.forms import forms_of
from pergrad.attribution.projectors import KINDS, Projector, Spec, splittable
from pergrad.errors import HookStateError, ProjectionError


@dataclass
class Projected:
    """One projection target: its name and each trainable parameter's block."""

    name: str  # qualified name of the target ("" for the whole model)
    spec: Spec
    params: dict[nn.Parameter, Projector]
    grads: bool = True  # False: its parameters' .grad is not needed (their weights may run detached, unwritten)
    per_token: bool = False  # features [B, T, k] of each token's term of g_i


class Projection(Consumer):
    """Computes ``sum_p P_p vec(g_i(p))`` of every target (a parameter the backward did not reach
    has ``g_i = 0``: it adds nothing). A call only it reads is projected as its output gradient arrives
    (``take``)."""

    takes_now = True

    def __init__(self, canonical: Callable[[nn.Parameter], nn.Parameter]) -> None:
        self.canonical = canonical
        self.targets: list[Projected] = []
        self.last: dict[str, Tensor] = {}  # the last backward's, by target name
        self.unreached: list[str] = []  # the targets none of whose parameters the last backward accumulated into
        self._gradless: tuple[tuple[Projected, ...], frozenset[nn.Parameter]] = ((), frozenset())

    @property
    def gradless(self) -> frozenset[nn.Parameter]:
        """The parameters of targets registered with ``grads=False``: pergrad does not write their ``.grad``
        where their weight runs detached (``pergrad._core.shortcuts.detach``). (Asked at every layer call: kept until
        the targets change.)"""
        targets, found = self._gradless
        if len(targets) != len(self.targets) or any(a is not b for a, b in zip(targets, self.targets)):
            found = frozenset(p for t in self.targets if not t.grads for p in t.params)
            self._gradless = (tuple(self.targets), found)
        return found

    def reads(self, kept: Kept) -> bool:
        return any(self.canonical(p) in t.params for t in self.targets for _, p in kept.layer.trainable())

    def keeps_inputs(self, kept: Kept) -> bool:
        """Whether a per-token target reads this call's ``(a, d)`` (kept even where ``g_i`` are built)."""
        return kept.batch_size > 0 and any(
            self.canonical(p) in t.params for t in self.targets if t.per_token for _, p in kept.layer.trainable()
        )

    def covers(self, param: nn.Parameter) -> bool:
        return any(param in target.params for target in self.targets)

    def take(self, call: Call, size: int, state: Backward) -> bool:
        """Project ``call`` (``size`` samples) as its output gradient arrives, so that its ``(a, d)`` are
        let go at once, read while still in cache: ``sum_p P_p vec(g_i(p))`` of its parameters ``p`` in
        each target, by a source of this call alone (``project``, as the end of the backward projects),
        added into that target's features ``[B, k]`` in ``state.arrived.taken[self]`` (by target name),
        whose parameters are recorded beside them. The caller makes sure the backward reaches every
        parameter of the call. False, adding nothing, where a per-token target reads the call (at the end)."""
        source = Fused([call], self.canonical)
        params = source.uses.keys()
        if any(t.per_token and not params.isdisjoint(t.params) for t in self.targets):
            return False
        into: dict[str, tuple[Tensor, set[nn.Parameter]]] = state.arrived.taken.setdefault(self, {})
        for target in self.targets:
            wanted = {p: target.params[p] for p in params if p in target.params}
            if not wanted:
                continue
            if target.name not in into:  # summed in the parameters' dtype, as at the end
                into[target.name] = (next(iter(target.params)).new_zeros((size, target.spec.dim)), set())
            total, covered = into[target.name]
            project(source, wanted, total)
            covered.update(wanted)
        return True

    def consume(self, batch: Batch) -> None:
        if not self.targets:
            return
        self.last = {}
        self.unreached = []
        tokens: Fused | None = None
        eager: dict[str, tuple[Tensor, set[nn.Parameter]]] = batch.state.arrived.taken.get(self, {})
        for target in self.targets:
            reached = {p: proj for p, proj in target.params.items() if p in batch.params}
            if not reached and batch.size:
                self.unreached.append(target.name)
            first = next(iter(target.params))
            if target.per_token:
                if tokens is None:  # the calls are kept for per-token targets where g_i are built too
                    source = batch.source
                    tokens = source if isinstance(source, Fused) else Fused(batch.state.arrived.calls, self.canonical)
                found = project_tokens(tokens, reached) if reached and batch.size else {}
                count = next(iter(found.values())).shape[1] if found else 0  # (no token reached: none)
                total = first.new_zeros((batch.size, count, target.spec.dim))
                for features in found.values():
                    total = total + features
            else:
                projected = eager.get(target.name)
                if projected is None:
                    total = first.new_zeros((batch.size, target.spec.dim))  # summed in the parameters' dtype, then cast
                else:
                    total, covered = projected
                    if not covered.issubset(reached):  # (asked only where the backward runs every AccumulateGrad)
                        missed = sorted(batch.names[p] for p in covered - reached.keys())
                        raise HookStateError(
                            f"the features of the projection {target.name!r} include {missed}, projected as their "
                            "output gradients arrived in a backward that then did not accumulate into them: a pergrad "
                            "bug, please report it with the model and the backward call"
                        )
                calls = batch.source.uses if isinstance(batch.source, Fused) else reached
                rest = {p: proj for p, proj in reached.items() if p in calls}  # those whose calls were kept
                if rest and batch.size:
                    project(batch.source, rest, total)
            self.last[target.name] = total if target.spec.dtype is None else total.to(target.spec.dtype)


def project(source: Materialized | Fused, projectors: dict[nn.Parameter, Projector], total: Tensor) -> None:
    """Adds ``sum_p P_p vec(g_i(p))`` into ``total`` ``[B, k]``. From built ``g_i`` (``Materialized``): those
    of the parameters with built ``g_i``. From kept calls (``Fused``): call by call in the order they
    arrived (as ``Projection.take`` adds them, one call at a time: the same numbers either way), a call's
    projected form (``pergrad.attribution.forms``: Kronecker blocks from ``(a, d)``, no ``g_i``) where its
    rule has one for these projectors, else its built ``g_i`` projected (shared with the other quantities
    as the source keeps them). Projections are linear, so a parameter fed by several calls (a layer called
    twice, tied weights) adds each call's projection."""
    if isinstance(source, Materialized):
        for p, proj in projectors.items():
            if p in source.grads:
                proj.apply(source.grads[p], total)
        return
    for call, named in source.feeding(projectors):
        forms = forms_of(call.layer)
        if call.built is None and forms is not None:
            by_name = {n: projectors[p] for n, p in named.items()}
            if forms.project(call.layer.module, call.a, call.d, by_name, total, call.scale):
                continue
        for p, g in source.built(call):
            if p in projectors:
                projectors[p].apply(g, total)


def project_tokens(source: Fused, projectors: dict[nn.Parameter, Projector]) -> dict[nn.Parameter, Tensor]:
    """``P_p vec(g_it)`` ``[B, T, k]`` of each parameter, ``g_it`` the term of ``g_i`` at token ``t``
    (summed over its calls: tied and reused layers), from each call's ``Forms.project_tokens``;
    ``ProjectionError`` for a call without one (a layer or input shape with no per-token form) or
    calls of different token counts."""
    out: dict[nn.Parameter, Tensor] = {}
    fed: dict[nn.Parameter, HookedLayer] = {}
    for call, named in source.feeding(projectors):
        layer, forms = call.layer, forms_of(call.layer)
        found = None
        if forms is not None and forms.project_tokens is not None and isinstance(call.a, Tensor):
            found = forms.project_tokens(layer.module, call.a, call.d, {n: projectors[p] for n, p in named.items()})
        if found is None:
            shape = tuple(call.a.shape) if isinstance(call.a, Tensor) else "several inputs"
            raise ProjectionError(
                f"register_projection(per_token=True): {layer.label} was called on an input of shape {shape}; "
                "per-token features exist for nn.Linear and HF Conv1D on [B, T, features] and nn.Embedding on "
                "[B, T] (one token dim after the batch). Register its projection with per_token=False for "
                "per-sample features, or reshape its input to [B, T, features]."
            )
        for name, f in found.items():
            p = named[name]
            if p in out and out[p].shape != f.shape:
                raise ProjectionError(
                    f"register_projection(per_token=True): {fed[p].label} and {layer.label} share parameter "
                    f"{name!r} but see {out[p].shape[1]} and {f.shape[1]} tokens per sample; per-token features "
                    "need the same tokens in every call. Register its projection with per_token=False."
                )
            out[p] = f * call.scale if p not in out else out[p] + f * call.scale
            fed.setdefault(p, layer)
    return out


def check_request(dim: int, kind: str, dtype: torch.dtype | None, per_token: bool) -> None:
    """Refuse a ``register_projection`` request that cannot be honoured, saying what to pass instead."""
    if kind not in KINDS:
        raise ProjectionError(f"register_projection: unknown kind {kind!r}; pass kind='kron', 'dense' or 'sjlt'")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ProjectionError(f"register_projection: dim must be a positive int, got {dim!r}")
    if kind == "kron" and not splittable(dim):
        raise ProjectionError(
            f"register_projection(kind='kron'): dim={dim} cannot be split into r_row * r_col as r x r or "
            "r x 2r; pass a square or twice a square (64, 128, 256, 512, 1024, ...), or kind='dense'"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise ProjectionError(f"register_projection: dtype must be a floating point dtype, got {dtype}")
    if per_token and kind != "kron":
        raise ProjectionError(
            f"register_projection(per_token=True): per-token features are Kronecker only, got kind={kind!r}; "
            "pass kind='kron', or per_token=False for dense per-sample features"
        )


def check_per_token(
    label: str, projected: Projected, layers: list[HookedLayer], canonical: Callable[[nn.Parameter], nn.Parameter]
) -> None:
    """Every layer feeding the target has a per-token form (``Forms.project_tokens``)."""
    for layer in layers:
        if not any(canonical(p) in projected.params for _, p in layer.trainable()):
            continue
        forms = forms_of(layer)
        if forms is None or forms.project_tokens is None:
            raise ProjectionError(
                f"register_projection(per_token=True) on {label}: {layer.label} has no per-token form "
                "(per-token features exist for nn.Linear and HF Conv1D on [B, T, features] and nn.Embedding "
                "on [B, T]). Register per_token=False for per-sample features of it, or project only the "
                "layers that have one per token."
            )
