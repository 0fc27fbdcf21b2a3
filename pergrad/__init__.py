"""pergrad: per-sample gradients for PyTorch, and what you do with them before they are summed.

psm = PerSampleModule(model)                  # hooks the supported layers
psm.register_transform(model, transforms.clip_norm(1.0))
loss_fn(psm(x), y).backward()                 # p.grad_sample: [B, *p.shape]; p.grad: mean_i T(g_i)
"""

import importlib

from pergrad._core.convert import fix_batchnorm
from pergrad.integrations import lightning_loop as _lightning_loop  # noqa: F401 -- registers its check
from pergrad.integrations.errors import CaptumError, TrainerConfigError
from pergrad.integrations.lm import PerSampleLMLoss, per_sample_lm_loss
from pergrad.integrations.opacus import OpacusRouteError

from . import _moved, rules, transforms
from .errors import (
    BatchMixingError,
    BatchSizeError,
    DetachedWeightError,
    HookStateError,
    NormNotComputedError,
    PergradError,
    SecondOrderError,
    SharedInputError,
    StatisticNotTrackedError,
    TargetError,
    TokenLossWarning,
    TransformError,
    UnsupportedLayerError,
    WrapperAttributeError,
)
from .module import PerSampleModule
from .registry import LayerCall, RuleRegistry, default_registry, register_rule

__version__ = "0.1.0"

_moved.install()


def __getattr__(name: str) -> object:
    """``pergrad.attribution``, imported at its first use (a wrapper that projects nothing never loads it);
    ``pergrad.hf``, ``pergrad.projectors``, ...: the modules that moved, by their old names (deprecated)."""
    if name == "attribution":
        return importlib.import_module("pergrad.attribution")
    if name in _moved.MOVED and "." not in name:
        module = globals()[name] = _moved.moved(name)
        return module
    raise AttributeError(f"module 'pergrad' has no attribute {name!r}")


__all__ = [
    "BatchMixingError",
    "BatchSizeError",
    "CaptumError",
    "DetachedWeightError",
    "HookStateError",
    "LayerCall",
    "NormNotComputedError",
    "OpacusRouteError",
    "PerSampleLMLoss",
    "PerSampleModule",
    "PergradError",
    "RuleRegistry",
    "SecondOrderError",
    "SharedInputError",
    "StatisticNotTrackedError",
    "TargetError",
    "TokenLossWarning",
    "TrainerConfigError",
    "TransformError",
    "UnsupportedLayerError",
    "WrapperAttributeError",
    "default_registry",
    "fix_batchnorm",
    "per_sample_lm_loss",
    "register_rule",
    "rules",
    "transforms",
]
