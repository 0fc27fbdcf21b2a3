"""Noticing a language-model loss that is not a sum of per-sample losses.

HuggingFace models called with token labels (``model(ids, labels=labels).loss``) return the mean
over ALL tokens of the batch, ``L = sum_i sum_{t in i} l_it / sum_j n_j`` (``n_j``: sample j's
tokens whose label is not -100). pergrad treats the batch loss as ``(1/B) sum_i f_i``, so what it
calls sample i's gradient is ``B / sum_j n_j * grad sum_t l_it``: the gradient of sample i's own
loss only when every sample has as many labelled tokens (then it is the mean of its token losses);
otherwise each sample's share moves with the other samples' lengths and a clipping bound means
something different at every step. When a backward runs through such a loss while the rows' label
counts differ, pergrad warns once per wrapper.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor

from .errors import TokenLossWarning

IGNORE_INDEX = -100  # the label HuggingFace's losses skip (padding, prompt tokens)


def token_labels(kwargs: dict[str, Any]) -> Tensor | None:
    """The ``labels=`` keyword of a model call when it labels tokens (integers, ``[B, T, ...]``)."""
    labels = kwargs.get("labels")
    if isinstance(labels, Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
        return labels
    return None


def watch(labels: Tensor, output: Any, warn: Callable[[str], None]) -> None:
    """Have ``warn`` called if a backward runs through ``output.loss`` while the rows of ``labels``
    hold different numbers of labelled tokens (one host sync, in that backward only)."""
    loss = getattr(output, "loss", None)
    if not (isinstance(loss, Tensor) and loss.grad_fn is not None):
        return
    counts = (labels != IGNORE_INDEX).flatten(1).sum(1)

    def check(grad_outputs: tuple[Tensor | None, ...]) -> None:
        if counts.numel() > 1 and bool(counts.min() != counts.max()):
            warn(
                f"the loss this backward runs through is the model's own labels= loss, a mean over all "
                f"{int(counts.sum())} labelled tokens of the batch, and its samples have different numbers of "
                f"labelled tokens ({int(counts.min())} to {int(counts.max())}): each sample's share is divided by "
                "the whole batch's token count, so grad_sample is not the gradient of any sample's own loss and a "
                "clipping bound moves with the other samples' lengths. Compute each sample's loss from the logits "
                "(sum or mean of ITS token losses, see docs/guides/language-models.md) and backpropagate their mean or sum."
            )

    loss.grad_fn.register_prehook(check)


def warner() -> Callable[[str], None]:
    """A ``warn`` that warns once (per wrapper), as a ``TokenLossWarning``."""
    done = False

    def warn(message: str) -> None:
        nonlocal done
        if not done:
            done = True
            warnings.warn(f"pergrad: {message}", TokenLossWarning, stacklevel=2)

    return warn


__all__ = ["IGNORE_INDEX", "token_labels", "warner", "watch"]
