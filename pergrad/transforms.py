"""Per-sample transforms T: what happens to each sample's gradient before the reduction.

A target (a parameter, a module, or the whole model) hands its transform the per-sample gradients
of the parameters it covers, as ``{name: Tensor[B, *param.shape]}``. The built-ins below work on
the whole batch at once; a user function written for ONE sample is vectorised with
``torch.func.vmap`` (or called on the batch directly with ``batched=True``).

Norms are over everything the target covers: for a module target, the concatenation of its
parameters' gradients; for the root, of every trainable parameter (DP-SGD's flat clipping).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .errors import TransformError

Grads = dict[str, Tensor]


def per_sample_norms(grads: Mapping[str, Tensor]) -> Tensor:
    """``||g_i|| = sqrt(sum_k ||g_ik||^2)`` over every tensor k of the mapping; shape [B]."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()]
    return torch.stack(squares).sum(0).sqrt()


def _times(grads: Mapping[str, Tensor], factor: Tensor) -> Grads:
    """Multiply every sample's gradients by its own factor (``factor`` has shape [B])."""
    return {k: g * factor.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


class Transform:
    """A transform that works on a whole batch: ``apply({name: [B, ...]}) -> {name: [B, ...]}``.

    Subclass it (and implement ``apply``) for a transform that is batched natively.
    """

    def apply(self, grads: Grads) -> Grads:
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Scaling(Transform):
    """A transform that multiplies each sample's gradient by one number: ``T(g_i) = c_i g_i``.

    Because every rule is linear in the output gradient, ``sum_i c_i g_i`` is the layer's ordinary
    batch gradient with output gradients ``c_i d_i``: with ``keep_grad_sample=False`` pergrad never
    builds ``g_i`` for these, it only needs the per-sample norms (when ``needs_norms``).
    """

    needs_norms = True
    # True where ``factors`` is finite wherever the norms are: pergrad then leaves its check of the
    # factors out (reading them on the host would wait for the device: a sync per step)
    finite_factors = False

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        """``c_i`` for each sample, shape [B]; ``norms`` is ``||g_i||`` over the target."""
        raise NotImplementedError

    def apply(self, grads: Grads) -> Grads:
        first = next(iter(grads.values()))
        norms = per_sample_norms(grads) if self.needs_norms else None
        return _times(grads, self.factors(norms, first.shape[0], first))


class ClipNorm(Scaling):
    """``T(g_i) = g_i * min(1, C / ||g_i||)``; a zero gradient stays zero."""

    finite_factors = True  # in (0, 1] for every norm >= 0, inf included

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0:
            raise TransformError(f"clip_norm needs max_norm > 0, got {max_norm!r}")
        self.max_norm = float(max_norm)

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        assert norms is not None
        return (self.max_norm / norms).clamp(max=1.0)  # C / 0 = inf, clamped to 1


class Normalize(Scaling):
    """``T(g_i) = g_i / (||g_i|| + eps)``: every sample gets (almost) unit norm."""

    def __init__(self, eps: float = 1e-12) -> None:
        if not eps >= 0:
            raise TransformError(f"normalize needs eps >= 0, got {eps!r}")
        self.eps = float(eps)

    @property
    def finite_factors(self) -> bool:  # type: ignore[override]
        return self.eps > 0  # with eps = 0 a zero gradient has no unit direction: 1 / 0

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        assert norms is not None
        return 1.0 / (norms + self.eps)


class Scale(Scaling):
    """``T(g_i) = w_i * g_i`` with one weight per sample (importance weights, masks)."""

    needs_norms = False

    def __init__(self, weights: Tensor) -> None:
        weights = torch.as_tensor(weights)
        if weights.dim() != 1:
            raise TransformError(f"scale needs a 1-D weight per sample, got shape {tuple(weights.shape)}")
        self.weights = weights

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        if self.weights.shape[0] != batch_size:
            raise TransformError(
                f"scale has {self.weights.shape[0]} weights but the batch has {batch_size} samples; "
                "pass one weight per sample (update the transform's .weights each step)"
            )
        return self.weights.to(device=like.device, dtype=like.dtype)


class Square(Transform):
    """``T(g_i) = g_i ** 2`` elementwise: with ``reduction="mean"``, ``p.grad`` is the second moment."""

    def apply(self, grads: Grads) -> Grads:
        return {k: g.square() for k, g in grads.items()}


def clip_norm(max_norm: float) -> ClipNorm:
    """Clip each sample's gradient to norm at most ``max_norm`` (norm over the whole target)."""
    return ClipNorm(max_norm)


def normalize(eps: float = 1e-12) -> Normalize:
    """Scale each sample's gradient to unit norm: ``g_i / (||g_i|| + eps)``."""
    return Normalize(eps)


def scale(weights: Tensor) -> Scale:
    """Multiply sample i's gradient by ``weights[i]``."""
    return Scale(weights)


def square() -> Square:
    """Square each sample's gradient elementwise."""
    return Square()


class UserTransform(Transform):
    """A user function wrapped to work on a batch.

    ``single_tensor``: the target is one parameter and ``fn`` takes and returns a tensor rather
    than a dict. ``batched``: ``fn`` already handles the batch dim; otherwise it is written for
    one sample and vectorised with ``torch.func.vmap``.
    """

    def __init__(self, fn: Callable[[Any], Any], *, batched: bool, single_tensor: bool, target: str) -> None:
        self.fn, self.batched, self.single_tensor, self.target = fn, batched, single_tensor, target

    def apply(self, grads: Grads) -> Grads:
        fn = self.fn if self.batched else torch.func.vmap(self.fn)
        arg: Any = next(iter(grads.values())) if self.single_tensor else grads
        try:
            result = fn(arg)
        except Exception as err:  # add the target and the way out; keep the original as cause
            how = (
                ""
                if self.batched
                else (
                    " It runs under torch.func.vmap on one sample at a time: use tensor ops only (torch.where, "
                    "not `if`/.item()), or register it with batched=True to receive the whole [B, ...] batch."
                )
            )
            raise TransformError(
                f"the transform registered for {self.target} raised {type(err).__name__}: {err}.{how}"
            ) from err
        if self.single_tensor:
            if not isinstance(result, Tensor):
                raise TransformError(
                    f"the transform registered for {self.target} returned {type(result).__name__}; "
                    "a parameter transform must return a tensor of the shape it was given"
                )
            return {next(iter(grads)): result}
        if not isinstance(result, Mapping):
            raise TransformError(
                f"the transform registered for {self.target} returned {type(result).__name__}; "
                f"a module or model transform must return a dict with the keys it was given ({sorted(grads)})"
            )
        return dict(result)


def check_output(target: str, before: Grads, after: Grads) -> None:
    """Raise unless ``after`` has exactly the keys, types and shapes of ``before``."""
    if set(after) != set(before):
        raise TransformError(
            f"the transform registered for {target} returned keys {sorted(after)}, expected {sorted(before)}"
        )
    for name, g in before.items():
        out = after[name]
        if not isinstance(out, Tensor):
            raise TransformError(
                f"the transform registered for {target} returned {type(out).__name__} for {name!r}; expected a tensor"
            )
        if out.shape != g.shape:
            raise TransformError(
                f"the transform registered for {target} changed the shape of {name!r}: "
                f"got {tuple(out.shape)}, expected {tuple(g.shape)} (per sample {tuple(g.shape[1:])}); "
                "a transform must return gradients of the shapes it was given"
            )


def check_unmodified(target: str, before: Grads, versions: dict[str, int]) -> None:
    """Raise if the transform wrote into the gradients it was given (``versions``: their version
    counters before it ran): they are ``grad_sample``, which holds the gradients before T."""
    for name, g in before.items():
        if g._version != versions[name]:
            raise TransformError(
                f"the transform registered for {target} modified its input {name!r} in place; it holds the "
                "per-sample gradients before T (p.grad_sample). Return a new tensor instead: g * c, not "
                "g.mul_(c) (torch.where, g.clamp(...), not in-place ops or assignments into g)"
            )
