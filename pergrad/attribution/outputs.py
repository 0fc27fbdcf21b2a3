"""Model output functions for TRAK (Park et al. 2023): what the features differentiate, and the out-to-loss term.

TRAK linearises the model output ``f`` whose loss is a logistic loss of it: for classification, the margin
``f_i = log p_i(y_i) - log(1 - p_i(y_i))`` (``= logit_y - logsumexp_{j != y} logit_j``), whose loss
``-log p_y = log(1 + exp(-f))`` has the derivative ``-(1 - p_y)``: the out-to-loss term ``Q_i = 1 - p_i(y_i)``
reweights each train sample's score. Each function returns ``(f [B], Q [B])``: backward ``f.sum()`` through a
``PerSampleModule(model, loss_reduction="sum")`` with a projection registered to get the features of each
sample's ``f_i``, and write ``Q`` beside them (``store.write(..., out_to_loss=Q)``); ``Q`` carries no gradient.
On the test side only ``f`` is used (the measurement: any per-sample scalar of the model will do).

:func:`sampled_labels` draws targets from the model's own predictive distribution: the backward of the loss
of those labels gives the true Fisher (kronfluence's default for EK-FAC) instead of the empirical Fisher of
the training labels.
"""

from __future__ import annotations

import torch
from torch import Tensor


def margin(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Classification: ``f_i = log p_y - log(1 - p_y) = logit_y - logsumexp_{j != y} logit_j`` and
    ``Q_i = 1 - p_y = sigmoid(-f_i)`` for ``logits`` ``[B, classes]`` and ``targets`` ``[B]`` (class indices)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"margin: logits {list(logits.shape)} and targets {list(targets.shape)}: pass logits [B, classes] and "
            "targets [B] (for [B, T, vocab] language-model logits use lm_margin)."
        )
    correct = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    chosen = torch.arange(logits.shape[1], device=logits.device) == targets.unsqueeze(1)
    others = logits.masked_fill(chosen, float("-inf")).logsumexp(1)
    f = correct - others
    return f, torch.sigmoid(-f.detach())


def lm_margin(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Language model: each sequence's sum of its tokens' margins, ``f_i = sum_t (log p_t - log(1 - p_t))``
    (``p_t`` the probability of target token ``t``), and ``Q_i`` the mean over its tokens of ``1 - p_t``
    (the out-to-loss term of a token, averaged: one number per sequence). ``logits`` ``[B, T, vocab]``,
    ``targets`` ``[B, T]``, positions with ``targets == ignore_index`` left out (a sequence without any
    token gets ``f = 0``, ``Q = 0``)."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"lm_margin: logits {list(logits.shape)} and targets {list(targets.shape)}: pass logits [B, T, vocab] "
            "and targets [B, T] (already shifted: targets[:, t] is the token predicted at position t)."
        )
    keep = targets != ignore_index
    safe = targets.masked_fill(~keep, 0)
    b, t, v = logits.shape
    f_tokens, q_tokens = margin(logits.reshape(b * t, v), safe.reshape(b * t))
    zero = logits.new_zeros(())
    f_tokens, q_tokens = torch.where(keep, f_tokens.view(b, t), zero), torch.where(keep, q_tokens.view(b, t), zero)
    count = keep.sum(1).clamp(min=1)
    return f_tokens.sum(1), q_tokens.sum(1) / count


def sampled_labels(
    logits: Tensor,
    *,
    generator: torch.Generator | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Labels drawn from the model's predictive distribution, ``y ~ softmax(logits)`` at each position:
    ``logits`` ``[..., classes]`` gives ``[...]`` class indices (int64), drawn by
    ``torch.multinomial(softmax(logits), 1, generator=generator)`` over the positions flattened in order
    (pass a seeded ``torch.Generator`` on the logits' device for draws that repeat). With ``targets``
    (the training labels, shaped ``[...]``), positions where ``targets == ignore_index`` keep
    ``ignore_index``. The loss of these labels, e.g. ``F.cross_entropy(logits, sampled_labels(logits),
    reduction="sum")``, backpropagated through a wrapper tracking ``track_projected_factors``, sums the
    Kronecker factors of the true Fisher ``E_{y ~ p(y|x)}[g g^T]``; write its features to a store of their
    own and pass that store to ``ekfac`` for the eigenvalue correction of the same Fisher."""
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"sampled_labels: logits {list(logits.shape)}: pass logits [..., classes].")
    if targets is not None and targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"sampled_labels: logits {list(logits.shape)} and targets {list(targets.shape)}: targets must be "
            "logits.shape[:-1] (one label per position)."
        )
    probs = logits.detach().reshape(-1, logits.shape[-1]).softmax(-1)
    drawn = torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])
    if targets is not None:
        drawn = drawn.masked_fill(targets == ignore_index, ignore_index)
    return drawn
