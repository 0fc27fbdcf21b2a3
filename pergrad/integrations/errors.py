"""The errors of the integrations (training frameworks, Captum): importing them imports no integration."""

from __future__ import annotations

from pergrad.errors import PergradError


class TrainerConfigError(PergradError, ValueError):
    """A training framework's option (HuggingFace ``Trainer``'s ``TrainingArguments``, ...) that would
    silently break the per-sample numbers: aggregate clipping after per-sample clipping, a loss that is
    not a sum of per-sample losses, a data-parallel mode pergrad does not follow."""


class CaptumError(PergradError, ValueError):
    """``pergrad.integrations.captum`` was asked for scores it cannot compute from per-sample gradients (a loss that
    is not one per sample, a wrapper that keeps no ``grad_sample``)."""
