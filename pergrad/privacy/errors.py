"""The errors of DP-SGD."""

from __future__ import annotations

from pergrad.errors import PergradError


class PrivacyError(PergradError, ValueError):
    """DP-SGD (``pergrad.privacy``) is asked for with a setting whose noise or normalisation it cannot make
    exact (another transform on the clipped parameters, trainable parameters left unclipped, a GradScaler,
    ...), or with generators that differ across ranks."""
