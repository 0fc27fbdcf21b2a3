"""Statistics of the per-sample gradients of one batch, as optimisation research uses them.

Notation: ``g_i`` the gradient of sample i's own loss (``p.grad_sample[i]``), ``B`` the batch size,
``g = (1/B) sum_i g_i`` the mean gradient, ``p_i = <g_i, g>``, norms and inner products over every
trainable parameter of the model. Per parameter, elementwise:

- ``mean = g``, ``second_moment = (1/B) sum_i g_i^2``;
- ``variance = second_moment - mean^2`` (the biased, 1/B estimate, as CABS uses it; multiply by
  ``B / (B - 1)`` for the unbiased one);
- ``snr = mean^2 / variance`` (inf where the variance is 0 and the mean is not).

Whole model:

- ``trace_variance = sum_j variance_j`` (tr of the per-sample gradient covariance, biased);
- ``norm_test = sqrt( sum_i ||g_i - g||^2 / (B-1) / (B ||g||^2) )`` (Byrd et al. 2012);
- ``inner_product_test = sqrt( (sum_i p_i^2 - B ||g||^4) / (B-1) / (B ||g||^4) )`` (Bollapragada et al. 2018);
- ``orthogonality_test = sqrt( (sum_i ||g_i||^2 - sum_i p_i^2 / ||g||^2) / (B-1) / (B ||g||^2) )``
  (Bollapragada et al. 2018);
- ``cabs_batch_size(lr, loss) = lr * trace_variance / loss`` (Balles, Romero & Hennig 2017),
  clipped to ``[16, 2048]``.

The three tests need ``B >= 2`` and are NaN otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .sources import Fused, Materialized


class ParamStatistics:
    """Elementwise statistics of one parameter's per-sample gradients (each of the parameter's shape).

    ``mean`` and ``second_moment`` are kept; ``variance`` and ``snr`` are computed when first read.
    """

    def __init__(self, mean: Tensor, second_moment: Tensor) -> None:
        self.mean, self.second_moment = mean, second_moment

    @functools.cached_property
    def variance(self) -> Tensor:
        """``second_moment - mean^2`` (biased)."""
        return self.second_moment - self.mean.square()

    @functools.cached_property
    def snr(self) -> Tensor:
        """``mean^2 / variance``."""
        return self.mean.square() / self.variance

    def __repr__(self) -> str:
        return f"ParamStatistics(shape={tuple(self.mean.shape)})"


@dataclass(frozen=True)
class Statistics:
    """Statistics of one backward's per-sample gradients; see the module docstring for formulas."""

    batch_size: int
    params: dict[str, ParamStatistics]
    sq_norms: Tensor  # [B]: ||g_i||^2 over the whole model
    grad_sq_norm: Tensor  # ||g||^2
    trace_variance: Tensor
    norm_test: Tensor
    inner_product_test: Tensor
    orthogonality_test: Tensor

    def cabs_batch_size(self, lr: float, loss: float, low: int = 16, high: int = 2048) -> int:
        """CABS: ``lr * tr(Sigma) / loss``, rounded and clipped to ``[low, high]``."""
        if not loss > 0:
            raise ValueError(f"cabs_batch_size needs a positive loss, got {loss!r}")
        suggested = lr * float(self.trace_variance) / loss
        return int(min(max(round(suggested) if math.isfinite(suggested) else high, low), high))


def compute_statistics(
    source: Materialized | Fused, names: dict[nn.Parameter, str], batch_size: int, means: dict[nn.Parameter, Tensor]
) -> tuple[Statistics, dict[nn.Parameter, Tensor]]:
    """All statistics for the parameters in ``names``, given their mean gradients ``g`` (those
    missing are computed from the per-sample gradients); also returns the per-parameter
    ``||g_i||^2`` computed on the way."""
    b = batch_size
    params = list(names)
    moments = source.moments(params, means)
    means = moments.means
    per_param = {}
    second_moments, mean_squares = [], []
    for p in params:
        m2 = moments.sum_squares[p].div_(b)  # a fresh tensor of the moments
        per_param[names[p]] = ParamStatistics(means[p], m2)
        second_moments.append(m2.sum())
        flat = means[p].reshape(-1)
        mean_squares.append(torch.dot(flat, flat))
    sample_sq = torch.stack([moments.sq_norms[p] for p in params]).sum(0)
    p_i = torch.stack([moments.dots[p] for p in params]).sum(0)
    g2 = torch.stack(mean_squares).sum()
    trace = torch.stack(second_moments).sum() - g2  # sum_j (second_moment_j - mean_j^2)
    denominator = (b - 1) if b > 1 else float("nan")
    # each numerator is a sum of squares (>= 0); clamp the round-off of a cancellation to 0
    norm_test = ((sample_sq.sum() - b * g2).clamp(min=0) / denominator / (b * g2)).sqrt()
    ip_test = ((p_i.square().sum() - b * g2.square()).clamp(min=0) / denominator / (b * g2.square())).sqrt()
    orth_test = ((sample_sq.sum() - p_i.square().sum() / g2).clamp(min=0) / denominator / (b * g2)).sqrt()
    stats = Statistics(b, per_param, sample_sq, g2, trace, norm_test, ip_test, orth_test)
    return stats, moments.sq_norms
