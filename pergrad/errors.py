"""Errors raised by pergrad.

Every message names where the problem is (a module path, a parameter, a transform target),
what was seen (types, shapes) and what to do about it.
"""

from __future__ import annotations

import importlib
import warnings


def module_label(name: str) -> str:
    """How messages name a module of the wrapped model by its qualified name: ``layer 'a.b'``, or
    ``the root module`` for the model itself (name ``""``)."""
    return "the root module" if name == "" else f"layer {name!r}"


# why Dynamo does not trace pergrad's code (``torch.compiler.disable(reason=...)``: fullgraph=True quotes it)
EAGER = (
    "pergrad's bookkeeping (its hooks on the wrapped model and its layers, and the tracking of which tensors carry "
    "the batch) runs eagerly, outside the compiled graph, so a model wrapped by pergrad cannot be compiled with "
    "fullgraph=True. Compile it without fullgraph=True (torch.compile(model)): Dynamo then compiles the model's "
    "own code between pergrad's hooks, with the same per-sample gradients"
)

# appended to a message about a call computed again inside a backward (``Kept.task``)
RECOMPUTED = (
    " This call was computed again inside the backward (reentrant activation checkpointing), where pergrad "
    "cannot follow which tensors carry the batch (it follows the model's own forward): checkpoint this segment "
    "with use_reentrant=False, or keep tensors shared by the batch (positions, raw parameters) outside it."
)


class PergradError(Exception):
    """Base class of every error pergrad raises on purpose."""


class UnsupportedLayerError(PergradError, TypeError):
    """A trainable module has no per-sample rule (raised when wrapping)."""


class BatchMixingError(PergradError, RuntimeError):
    """A layer couples the samples of a batch, so per-sample gradients are undefined."""


class BatchSizeError(PergradError, ValueError):
    """Layers or per-sample gradients disagree on the batch size, or where the batch is in a layer's
    input cannot be told (folded into another dim, moved where the layer cannot take it, or computed
    by code pergrad does not see run)."""


class TransformError(PergradError, ValueError):
    """A registered transform is invalid or returned something unusable."""


class TargetError(PergradError, ValueError):
    """A transform target is not part of the model, or overlaps another target."""


class HookStateError(PergradError, RuntimeError):
    """A backward pass reached parameters in a way pergrad cannot attribute to samples."""


class DetachedWeightError(HookStateError):
    """Autograd was asked for the gradient of a weight that ran detached (``torch.autograd.grad``,
    ``backward(inputs=...)``): pergrad computes that weight's ``.grad`` itself."""


class NormNotComputedError(PergradError, KeyError):
    """``per_sample_norms()[name]`` for a parameter whose norm the last backward did not compute."""

    def __str__(self) -> str:  # the message as it is (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


class SharedInputError(PergradError, RuntimeError):
    """A tensor shared by the batch (a layer output computed without the batch, a raw parameter)
    meets the batch in a way pergrad cannot split per sample."""


class TokenLossWarning(UserWarning):
    """The loss of a backward is a mean over the batch's tokens, not a sum of per-sample losses
    (a HuggingFace ``labels=`` loss with padding): per-sample gradients are not the samples' own."""


class StatisticNotTrackedError(PergradError, RuntimeError):
    """A statistic that ``track_statistics`` did not ask for was read."""


class SecondOrderError(PergradError, RuntimeError):
    """A backward with ``create_graph=True`` asks for differentiable per-sample gradients where pergrad
    cannot give them (a weight that ran detached, a layer whose rule is not differentiable)."""


class ProjectionError(PergradError, ValueError):
    """A projection (``register_projection``) is asked for with an unknown kind or a dimension that
    cannot be split, or its features are read before a backward computed them."""


class WrapperAttributeError(PergradError, AttributeError):
    """An attribute looked up on a ``PerSampleModule`` that it does not have: it is not an ``nn.Module``
    (``.to``, ``.config``, ``.save_pretrained``, ...); the message says to use the model itself."""


MOVED = {
    "CaptumError": "pergrad.integrations.errors",
    "OpacusRouteError": "pergrad.integrations.opacus",
    "PrivacyError": "pergrad.privacy.errors",
    "TrainerConfigError": "pergrad.integrations.errors",
}


def __getattr__(name: str) -> object:
    """The feature errors that lived here, by their old path (deprecated: each feature keeps its own)."""
    if name not in MOVED:
        raise AttributeError(f"module 'pergrad.errors' has no attribute {name!r}")
    warnings.warn(
        f"pergrad.errors.{name} moved to {MOVED[name]}.{name}; import it from there or from pergrad "
        "(the old path goes in pergrad 0.3)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(MOVED[name]), name)
