"""How good are the scores on your task: the linear datamodeling score (LDS) and leave-one-out correlation.

The LDS (Park et al. 2023): train models on random subsets ``S_1 .. S_R`` of the training set (half of it,
usually), measure each test sample's output ``f_j`` (its margin) in each, and correlate, test sample by test
sample, the sum of the scores of each subset's members with the output measured::

    masks = subsets(n, 100, seed=0)                            # [100, n] bool, random halves
    outputs = retrain(masks, train_on, measure)                # [100, m]: f_j of a model trained on each
    print(lds(scores, masks, outputs).mean())                  # scores [m, n] of any method

``retrain`` is the harness: ``train_on(indices)`` returns a model trained on those train samples only,
``measure(model)`` the ``[m]`` outputs. The same masks and outputs score every method: compute them once.
Spearman correlations, as the LDS is defined (ties get their average rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .errors import ScoreArgumentError


def subsets(n: int, count: int, fraction: float = 0.5, *, seed: int = 0) -> Tensor:
    """``[count, n]`` bool masks, each of ``round(fraction * n)`` train samples drawn without replacement
    (a ``torch.Generator`` seeded with ``seed``: the same masks on every machine)."""
    if not 0 < fraction <= 1 or n < 1 or count < 1:
        raise ScoreArgumentError(f"subsets: n={n}, count={count} must be positive and fraction={fraction} in (0, 1].")
    gen = torch.Generator().manual_seed(seed)
    size = max(1, round(fraction * n))
    out = torch.zeros(count, n, dtype=torch.bool)
    for r in range(count):
        out[r, torch.randperm(n, generator=gen)[:size]] = True
    return out


def retrain(
    masks: Tensor,
    train_on: Callable[[Tensor], Any],
    measure: Callable[[Any], Tensor],
    *,
    progress: bool = False,
) -> Tensor:
    """``[R, m]``: ``measure(train_on(indices of mask r))`` for each of the ``R`` masks (``subsets``), the
    outputs a model trained on each subset gives the ``m`` test samples."""
    items: Any = masks
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(masks, desc="retrain", unit="model")
    rows = []
    for mask in items:
        model = train_on(torch.nonzero(mask).reshape(-1))
        rows.append(torch.as_tensor(measure(model)).detach().reshape(-1).to("cpu", torch.float64))
    return torch.stack(rows)


def ranks(x: Tensor, dim: int = -1) -> Tensor:
    """Ranks along ``dim`` (0-based, float64), ties given their average rank (as ``scipy.stats.rankdata``)."""
    x = x.movedim(dim, -1).to(torch.float64)
    order = x.argsort(dim=-1, stable=True)
    sorted_x = x.gather(-1, order)
    positions = torch.arange(x.shape[-1], dtype=torch.float64).expand_as(x)
    # the average position of each run of equal values, given to every member of the run
    new = torch.ones_like(sorted_x, dtype=torch.bool)
    new[..., 1:] = sorted_x[..., 1:] != sorted_x[..., :-1]
    run = new.cumsum(-1) - 1
    total = torch.zeros_like(sorted_x).scatter_add_(-1, run, positions)
    count = torch.zeros_like(sorted_x).scatter_add_(-1, run, torch.ones_like(positions))
    averaged = (total / count.clamp(min=1)).gather(-1, run)
    out = torch.empty_like(averaged).scatter_(-1, order, averaged)
    return out.movedim(-1, dim)


def spearman(a: Tensor, b: Tensor, dim: int = -1) -> Tensor:
    """Spearman's rank correlation of ``a`` and ``b`` along ``dim`` (the Pearson correlation of their
    ranks); NaN where either is constant."""
    ra, rb = ranks(a, dim), ranks(b, dim)
    ra = ra - ra.mean(dim, keepdim=True)
    rb = rb - rb.mean(dim, keepdim=True)
    return (ra * rb).sum(dim) / (ra.square().sum(dim) * rb.square().sum(dim)).sqrt()


def lds(scores: Tensor, masks: Tensor, outputs: Tensor) -> Tensor:
    """``[m]``: each test sample's linear datamodeling score, Spearman's correlation over the ``R`` subsets
    between ``sum_{i in S_r} scores[j, i]`` and ``outputs[r, j]``. ``scores`` ``[m, n]``, ``masks``
    ``[R, n]`` (bool), ``outputs`` ``[R, m]``. The LDS of a method is the mean (``.nanmean()``)."""
    if scores.dim() != 2 or masks.shape != (outputs.shape[0], scores.shape[1]) or outputs.shape[1] != scores.shape[0]:
        raise ScoreArgumentError(
            f"lds: scores {list(scores.shape)}, masks {list(masks.shape)}, outputs {list(outputs.shape)}: pass "
            "scores [m, n], masks [R, n] and outputs [R, m] (R subsets, n train and m test samples)."
        )
    predicted = masks.to(torch.float64) @ scores.to(torch.float64).T  # [R, m]
    return spearman(predicted, outputs.to(torch.float64), dim=0)


def loo_correlation(scores: Tensor, full: Tensor, without: Tensor) -> Tensor:
    """``[m]``: each test sample's Spearman correlation, over the ``L`` train samples left out one at a time,
    between their scores ``scores[j, l]`` (``[m, L]``, the columns of those samples) and the change of the
    output when each is left out, ``full[j] - without[l, j]`` (``full`` ``[m]``: a model on every sample,
    ``without`` ``[L, m]``: one without sample ``l``)."""
    if scores.dim() != 2 or without.shape != (scores.shape[1], scores.shape[0]) or full.shape != scores.shape[:1]:
        raise ScoreArgumentError(
            f"loo_correlation: scores {list(scores.shape)}, full {list(full.shape)}, without "
            f"{list(without.shape)}: pass scores [m, L], full [m] and without [L, m]."
        )
    change = full.to(torch.float64).unsqueeze(0) - without.to(torch.float64)  # [L, m]
    return spearman(scores.to(torch.float64).T, change, dim=0)
