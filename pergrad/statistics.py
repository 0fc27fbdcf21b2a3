r"""Statistics of the per-sample gradients of one batch, as optimisation research uses them.

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

In formulas, with \(\bar g = \frac{1}{B} \sum_i g_i\):

$$
\begin{aligned}
\mathrm{variance}_j &= \frac{1}{B} \sum_{i=1}^{B} g_{ij}^2 - \bar g_j^2, \\
\mathrm{tr}\,\Sigma &= \sum_j \mathrm{variance}_j = \frac{1}{B} \sum_{i=1}^{B} \lVert g_i \rVert^2 - \lVert \bar g \rVert^2, \\
B_{\mathrm{CABS}} &= \mathrm{lr} \cdot \mathrm{tr}\,\Sigma \,/\, L.
\end{aligned}
$$

The three tests need ``B >= 2`` and are NaN otherwise.

What each costs (``track_statistics`` takes the names of those to compute): the means, ``||g_i||^2``,
``trace_variance = (1/B) sum_i ||g_i||^2 - ||g||^2``, ``norm_test`` and CABS come with the per-sample
norms (``FREE``); the inner product and orthogonality tests need ``p_i``, one more product per layer
(``WITH_DOTS``); the elementwise ``second_moment`` (``variance``, ``snr``) needs ``sum_i g_i^2``, one
more product per layer, or ``g_i`` built where a layer sees many positions (``WITH_SQUARES``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pergrad._core.backward.sources import Fused, Materialized

from .errors import StatisticNotTrackedError

#: Statistics that come with the per-sample norms and the mean gradient, at no extra cost.
FREE = ("mean", "sq_norms", "grad_sq_norm", "trace_variance", "norm_test", "cabs_batch_size")
#: Statistics that need the inner products ``p_i = <g_i, g>``: one more product per layer.
WITH_DOTS = ("inner_product_test", "orthogonality_test")
#: Elementwise per-parameter statistics that need ``sum_i g_i^2``: one more product per layer
#: (``(a^2)^T (d^2)`` for a Linear), or building ``g_i`` where a layer sees many positions.
WITH_SQUARES = ("second_moment", "variance", "snr")
NAMES = FREE + WITH_DOTS + WITH_SQUARES


def requested(track: bool | Iterable[str]) -> frozenset[str]:
    """The statistics ``track_statistics`` asks for: every one for ``True``, none for ``False``,
    else the names given (see ``NAMES``)."""
    if isinstance(track, bool):
        return frozenset(NAMES) if track else frozenset()
    if isinstance(track, str):
        raise TypeError(
            f"track_statistics takes True or a collection of names, e.g. {{{track!r}}}, got the string {track!r}"
        )
    names = frozenset(track)
    unknown = sorted(n for n in names if n not in NAMES)
    if unknown:
        raise ValueError(
            f"track_statistics: unknown statistic(s) {unknown}; choose from {list(NAMES)} (or True for every one)"
        )
    return names


def needs(tracked: frozenset[str]) -> tuple[bool, bool]:
    """Whether the statistics ``tracked`` need ``sum_i g_i^2`` (``WITH_SQUARES``) and whether they
    need the inner products ``<g_i, g>`` (``WITH_DOTS``)."""
    return any(n in tracked for n in WITH_SQUARES), any(n in tracked for n in WITH_DOTS)


def _not_tracked(what: str, tracked: frozenset[str]) -> StatisticNotTrackedError:
    return StatisticNotTrackedError(
        f"statistics().{what} was not computed: the wrapper tracks {sorted(tracked)}. Add {what!r} to "
        f"PerSampleModule(..., track_statistics={{...}}), or pass track_statistics=True for every statistic"
    )


class ParamStatistics:
    """Elementwise statistics of one parameter's per-sample gradients (each of the parameter's shape).

    ``mean`` and (when tracked) ``second_moment`` are kept; ``variance`` and ``snr`` are computed
    when first read.
    """

    def __init__(self, mean: Tensor, second_moment: Tensor | None, tracked: frozenset[str] = frozenset(NAMES)) -> None:
        self.mean, self._second_moment, self._tracked = mean, second_moment, tracked

    @property
    def second_moment(self) -> Tensor:
        """``(1/B) sum_i g_i^2``."""
        if self._second_moment is None:
            raise _not_tracked("params[...].second_moment", self._tracked)
        return self._second_moment

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
    """Statistics of one backward's per-sample gradients; see the module docstring for formulas.
    Those that were not tracked (``track_statistics`` named others) raise when read."""

    batch_size: int
    params: dict[str, ParamStatistics]
    sq_norms: Tensor  # [B]: ||g_i||^2 over the whole model
    grad_sq_norm: Tensor  # ||g||^2
    trace_variance: Tensor
    norm_test: Tensor
    tests: tuple[Tensor, Tensor] | None  # inner product and orthogonality tests, where tracked
    tracked: frozenset[str] = frozenset(NAMES)

    @property
    def inner_product_test(self) -> Tensor:
        if self.tests is None:
            raise _not_tracked("inner_product_test", self.tracked)
        return self.tests[0]

    @property
    def orthogonality_test(self) -> Tensor:
        if self.tests is None:
            raise _not_tracked("orthogonality_test", self.tracked)
        return self.tests[1]

    def cabs_batch_size(self, lr: float, loss: float, low: int = 16, high: int = 2048) -> int:
        """CABS: ``lr * tr(Sigma) / loss``, rounded and clipped to ``[low, high]``."""
        if not loss > 0:
            raise ValueError(f"cabs_batch_size needs a positive loss, got {loss!r}")
        suggested = lr * float(self.trace_variance) / loss
        return int(min(max(round(suggested) if math.isfinite(suggested) else high, low), high))


def compute_statistics(
    source: Materialized | Fused,
    names: dict[nn.Parameter, str],
    batch_size: int,
    means: dict[nn.Parameter, Tensor],
    tracked: frozenset[str] = frozenset(NAMES),
) -> tuple[Statistics, dict[nn.Parameter, Tensor]]:
    """The ``tracked`` statistics for the parameters in ``names``, given their mean gradients ``g``
    (those missing are computed from the per-sample gradients); also returns the per-parameter
    ``||g_i||^2`` computed on the way. ``trace_variance`` is ``(1/B) sum_i ||g_i||^2 - ||g||^2``,
    so it needs no elementwise second moment."""
    b = batch_size
    params = list(names)
    squares, dots = needs(tracked)
    moments = source.moments(params, means, squares=squares, dots=dots)
    means = moments.means
    per_param = {}
    mean_squares = []
    for p in params:
        m2 = moments.sum_squares[p].div_(b) if squares else None  # a fresh tensor of the moments
        per_param[names[p]] = ParamStatistics(means[p], m2, tracked)
        flat = means[p].reshape(-1)
        mean_squares.append(torch.dot(flat, flat))
    sample_sq = torch.stack([moments.sq_norms[p] for p in params]).sum(0)
    g2 = torch.stack(mean_squares).sum()
    trace = sample_sq.sum() / b - g2  # sum_j (second_moment_j - mean_j^2)
    denominator = (b - 1) if b > 1 else float("nan")
    # each numerator is a sum of squares (>= 0); clamp the round-off of a cancellation to 0
    norm_test = ((sample_sq.sum() - b * g2).clamp(min=0) / denominator / (b * g2)).sqrt()
    tests = None
    if dots:
        p_i = torch.stack([moments.dots[p] for p in params]).sum(0)
        ip_test = ((p_i.square().sum() - b * g2.square()).clamp(min=0) / denominator / (b * g2.square())).sqrt()
        orth_test = ((sample_sq.sum() - p_i.square().sum() / g2).clamp(min=0) / denominator / (b * g2)).sqrt()
        tests = (ip_test, orth_test)
    stats = Statistics(b, per_param, sample_sq, g2, trace, norm_test, tests, tracked)
    return stats, moments.sq_norms
