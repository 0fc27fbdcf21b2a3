"""Kronecker factors of projected weights (``psm.track_projected_factors``, read by
``psm.projected_factors()``): K-FAC curvature on the projected space (LoGra, EK-FAC), summed over
backward passes until ``psm.reset_projected_factors()``.

A weight projected by a Kronecker block ``P_row ⊗ P_col`` (its own projection target) has features
``phi_i = vec(sum_s u_is v_is^T)`` (row-major, ``[r_row * r_col]``), with ``u_is``, ``v_is`` the
projected factors of its layer's output gradient and input at position ``s`` (``Forms.factors``:
``u = P_row d``, ``v = P_col a`` for Linear and convolutions; ``P_row a``, ``P_col d`` for a weight
stored ``[in, out]`` (HF ``Conv1D``) and for an embedding, whose rows are the vocabulary). K-FAC
approximates the features' second moment ``(1/N) sum_i phi_i phi_i^T`` by ``S_row ⊗ S_col`` with::

    S_row = (1/N) sum_i sum_s u_is u_is^T      S_col = (1/N) sum_i sum_s v_is v_is^T

over the ``N`` samples of every backward since the last reset (normalised per sample: each sample's
positions are summed; ``positions / N`` per-token means are ``S * N / positions``). ``d`` is each
sample's own loss's output gradient (``loss_reduction="mean"`` as ``"sum"``, unscaled under loss
scaling): the factors are those of the features ``per_sample_projections()`` returns. Every call of
the weight counts (a layer called twice, tied weights: their positions together). Sums are kept in
float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pergrad._core.capture.calls import HookedLayer, Kept
from pergrad._core.consumers import Batch, Consumer
from pergrad.attribution.forms import forms_of
from pergrad.attribution.projection import Projected, Projection
from pergrad.attribution.projectors import Projector
from pergrad.errors import ProjectionError


@dataclass(frozen=True)
class Factors:
    """The K-FAC factors of one Kronecker-projected weight (see the module docstring)."""

    row: Tensor  # [r_row, r_row]: (1/N) sum_{i,s} u_is u_is^T
    col: Tensor  # [r_col, r_col]: (1/N) sum_{i,s} v_is v_is^T
    samples: int  # N: the samples of the backward passes summed
    positions: int  # the (sample, position) pairs summed


@dataclass
class _Sums:
    row: Tensor
    col: Tensor
    positions: int = 0


class ProjectedFactors(Consumer):
    """Sums ``u u^T`` and ``v v^T`` of every tracked projection target (one Kronecker-projected weight)
    over the backward passes, from each call's kept ``(a, d)`` (recomputed: ``r (i + o)`` per position)."""

    def __init__(self, projection: Projection, canonical: Callable[[nn.Parameter], nn.Parameter]) -> None:
        self.projection = projection
        self.canonical = canonical
        self.names: dict[str, None] = {}  # the tracked projection targets, in order (an ordered set)
        self.sums: dict[str, _Sums] = {}  # by target name, from the first call that reached it
        self.samples: dict[str, int] = {}  # by target name: the samples of every backward since tracked or reset

    def tracked(self) -> dict[nn.Parameter, tuple[str, Projector]]:
        """The weight of each tracked target, with the target's name and its Kronecker block."""
        out = {}
        for target in self.projection.targets:
            if target.name in self.names:
                ((p, projector),) = target.params.items()
                out[p] = (target.name, projector)
        return out

    def reads(self, kept: Kept) -> bool:
        if not self.names:
            return False
        tracked = self.tracked()
        return any(self.canonical(p) in tracked for _, p in kept.layer.trainable())

    def keeps_inputs(self, kept: Kept) -> bool:
        """The tracked layers' ``(a, d)`` are read at the end, beside the built ``g_i``."""
        return self.reads(kept)

    def consume(self, batch: Batch) -> None:
        if not self.names or not batch.size:
            return
        tracked = self.tracked()
        with torch.no_grad():
            for call in batch.state.arrived.calls:
                named = {n: self.canonical(p) for n, p in call.layer.trainable() if self.canonical(p) in tracked}
                if not named:
                    continue
                forms = forms_of(call.layer)
                d = call.d if call.scale == 1.0 else call.d * call.scale  # each sample's own loss's
                found = None
                if forms is not None and forms.factors is not None and not call.layer.spec.parametrized:
                    found = forms.factors(call.layer.module, call.a, d, {n: tracked[p][1] for n, p in named.items()})
                if found is None:  # refused at registration: a safeguard against a rule changed since
                    raise ProjectionError(
                        f"{call.layer.label} has no Kronecker factor form for {sorted(named)}: untrack it "
                        "(psm.reset_projected_factors() and track_projected_factors() without it)"
                    )
                for n, (u, v) in found.items():
                    self._add(tracked[named[n]][0], u, v)
        for name, _ in tracked.values():
            self.samples[name] = self.samples.get(name, 0) + batch.size

    def _add(self, name: str, u: Tensor, v: Tensor) -> None:
        """Add ``sum_{i,s} u u^T`` and ``sum_{i,s} v v^T`` of one call to the target's sums."""
        dtype = torch.float32 if u.device.type == "mps" else torch.float64
        u2, v2 = u.reshape(-1, u.shape[-1]).to(dtype), v.reshape(-1, v.shape[-1]).to(dtype)
        sums = self.sums.get(name)
        if sums is None:
            sums = self.sums[name] = _Sums(
                u2.new_zeros(u2.shape[1], u2.shape[1]), v2.new_zeros(v2.shape[1], v2.shape[1])
            )
        sums.row += u2.T @ u2
        sums.col += v2.T @ v2
        sums.positions += u2.shape[0]

    def factors(self) -> dict[str, Factors]:
        """The factors of every tracked target, by target name (zeros where no backward reached it)."""
        out = {}
        for name, projector in self.tracked().values():
            samples = self.samples.get(name, 0)
            if not samples:
                continue
            sums = self.sums.get(name)
            if sums is None:
                r_row, r_col = projector.ranks
                zeros = torch.zeros(r_row, r_row, dtype=torch.float64), torch.zeros(r_col, r_col, dtype=torch.float64)
                sums = _Sums(*zeros)
            out[name] = Factors(sums.row / samples, sums.col / samples, samples, sums.positions)
        return out

    def reset(self) -> None:
        """Forget every sum: the next backward starts new ones."""
        self.sums, self.samples = {}, {}


def check_factored(
    label: str,
    projected: Projected,
    layers: list[HookedLayer],
    canonical: Callable[[nn.Parameter], nn.Parameter],
    names: dict[nn.Parameter, str],
) -> None:
    """Raise unless ``projected`` is one weight whose every layer has a Kronecker factor form (for
    ``psm.track_projected_factors``; ``names``: each parameter's qualified name, for messages)."""
    if len(projected.params) != 1:
        qualified = [names[p] for p in projected.params]
        raise ProjectionError(
            f"track_projected_factors: {label} projects {len(qualified)} parameters {qualified} into one sum of "
            "blocks, which no Kronecker factors describe: register one projection per weight "
            f"(register_projection({qualified[0]!r}, dim=...)) and track those"
        )
    ((param, projector),) = projected.params.items()
    if not projector.kron:
        why = "one dim: a CountSketch" if projector.spec.kind == "kron" else f"kind={projector.spec.kind!r}"
        raise ProjectionError(
            f"track_projected_factors: {label} (shape {list(projector.shape)}) has no Kronecker block ({why}); "
            "Kronecker factors need kind='kron' on a weight of two or more dims. Leave it untracked: "
            "KroneckerFactored applies the identity to columns outside its blocks"
        )
    layers = [layer for layer in layers if any(canonical(p) is param for _, p in layer.trainable())]
    for layer in layers:
        forms = forms_of(layer)
        if forms is None or forms.factors is None or layer.spec.parametrized:
            how = " (through a parametrization)" if layer.spec.parametrized else ""
            raise ProjectionError(
                f"track_projected_factors: {label} is computed by {layer.label}{how}, which has no Kronecker "
                "factor form (weights of Linear, Conv1d/2d/3d, Embedding and HF Conv1D have one). Leave it "
                "untracked: precondition its features with the identity or the Gram matrix"
            )
    if not layers:
        raise ProjectionError(
            f"track_projected_factors: no hooked layer of the wrapped model computes {label}; track the weight "
            "of a Linear, Conv1d/2d/3d, Embedding or HF Conv1D"
        )
