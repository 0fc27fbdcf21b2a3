"""A language model's per-sample loss, and noticing a loss that is not a sum of per-sample losses.

``per_sample_lm_loss`` is sample i's own next-token loss ``f_i`` (the sum, or mean, of ITS token losses);
``PerSampleLMLoss`` is the same as a HuggingFace ``Trainer`` ``compute_loss_func`` (the batch mean or sum
of the ``f_i``, never divided by the batch's token count).

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

import torch.nn.functional as F
from torch import Tensor

from pergrad._core.capture.hooks import CALL_WATCHERS
from pergrad._core.shortcuts.followed import eager_hook
from pergrad.errors import TokenLossWarning

IGNORE_INDEX = -100  # the label HuggingFace's losses skip (padding, prompt tokens)


def per_sample_lm_loss(
    logits: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    reduction: str = "sum",
    *,
    shift: bool = True,
) -> Tensor:
    """Each sample's own next-token loss, ``[B]``: the sum (or mean) of ITS token losses, padding ignored.

    ``labels`` are aligned with the inputs, as HuggingFace's causal LMs take them (``labels=input_ids``):
    with ``shift=True`` position t's logits predict label t+1. A label -100 (``IGNORE_INDEX``) or a
    position where ``attention_mask == 0`` is no target. ``reduction="mean"`` divides by the sample's
    own number of targets (a sample with none has loss 0). ``shift=False``: ``labels`` are already the
    targets of each position (``[B, T]``, as ``logits[:, :T]``).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    token_losses = F.cross_entropy(
        logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    losses = token_losses.flatten(1).sum(1)
    if reduction == "mean":
        losses = losses / (labels != IGNORE_INDEX).flatten(1).sum(1).clamp(min=1)
    return losses


class PerSampleLMLoss:
    """A causal language model's loss as HuggingFace ``Trainer``'s ``compute_loss_func``:
    ``(outputs, labels, num_items_in_batch=None) -> mean_i f_i`` (``batch="mean"``) or ``sum_i f_i``
    (``"sum"``), ``f_i = per_sample_lm_loss(outputs.logits, labels, reduction=token_reduction)``.

    ``num_items_in_batch`` (the token count of the whole accumulated batch, by which ``Trainer``'s own
    loss divides) is ignored on purpose: dividing by it makes every sample's loss depend on the other
    samples. With ``compute_loss_func`` set, ``Trainer`` does not divide the loss by
    ``gradient_accumulation_steps``: wrap with ``accumulate="samples"`` (what
    ``pergrad.integrations.hf.PerSampleTrainer`` does) so ``.grad`` is the mean over every sample of the step.
    Padding must be labelled -100 (HuggingFace's collators do); ``per_sample(outputs, labels)`` gives
    the ``[B]`` losses.
    """

    def __init__(self, token_reduction: str = "sum", batch: str = "mean") -> None:
        if token_reduction not in ("sum", "mean"):
            raise ValueError(f"token_reduction must be 'sum' or 'mean', got {token_reduction!r}")
        if batch not in ("sum", "mean"):
            raise ValueError(f"batch must be 'sum' or 'mean', got {batch!r}")
        self.token_reduction, self.batch = token_reduction, batch

    def per_sample(self, outputs: Any, labels: Tensor) -> Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else getattr(outputs, "logits", outputs)
        return per_sample_lm_loss(logits, labels, reduction=self.token_reduction)

    def __call__(self, outputs: Any, labels: Tensor, num_items_in_batch: Any = None) -> Tensor:
        losses = self.per_sample(outputs, labels)
        return losses.sum() if self.batch == "sum" else losses.mean()

    def __repr__(self) -> str:
        return f"PerSampleLMLoss(token_reduction={self.token_reduction!r}, batch={self.batch!r})"


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

    @eager_hook
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


def _watch_labels(labels: Any, output: Any, warned: set[str]) -> None:
    """A wrapped model's call with token ``labels=``: warn (once per wrapper) if a backward runs through its
    token-mean ``output.loss`` while the rows hold different numbers of labelled tokens."""
    labels = token_labels({"labels": labels})
    if labels is None:
        return

    def warn(message: str) -> None:
        if "token loss" not in warned:
            warned.add("token loss")
            warnings.warn(f"pergrad: {message}", TokenLossWarning, stacklevel=2)

    watch(labels, output, warn)


CALL_WATCHERS["labels"] = _watch_labels

__all__ = ["IGNORE_INDEX", "PerSampleLMLoss", "per_sample_lm_loss", "token_labels", "watch"]
