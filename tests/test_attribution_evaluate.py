"""pergrad.attribution.evaluate: ranks and Spearman against scipy, the LDS and leave-one-out correlation against
their loops written out, the retraining harness on a model whose outputs are known in closed form."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pergrad.attribution import ScoreArgumentError, lds, loo_correlation, ranks, retrain, spearman, subsets

stats = pytest.importorskip("scipy.stats")


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_ranks_and_spearman_equal_scipys_ties_included() -> None:
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    for row in x:
        assert torch.equal(ranks(row), torch.from_numpy(stats.rankdata(row.numpy()) - 1))
    a, b = randn(40, 3, seed=0).round(decimals=1), randn(40, 3, seed=1)  # ties in a
    got = spearman(a, b, dim=0)
    for j in range(3):
        expected = stats.spearmanr(a[:, j].numpy(), b[:, j].numpy()).statistic
        assert got[j].item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert torch.equal(ranks(x, dim=0), ranks(x.T, dim=1).T)


def test_subsets_are_seeded_halves() -> None:
    masks = subsets(11, 7, seed=3)
    assert masks.shape == (7, 11) and masks.dtype == torch.bool
    assert (masks.sum(1) == 6).all()  # round(5.5) = 6
    assert torch.equal(masks, subsets(11, 7, seed=3)) and not torch.equal(masks, subsets(11, 7, seed=4))
    assert (subsets(10, 2, 0.3).sum(1) == 3).all()
    with pytest.raises(ScoreArgumentError, match=r"fraction=1.5 in \(0, 1\]"):
        subsets(10, 2, 1.5)


def test_lds_is_the_spearman_of_summed_scores_and_outputs() -> None:
    m, n, r = 4, 15, 9
    scores, masks = randn(m, n, seed=0), subsets(n, r, seed=1)
    outputs = randn(r, m, seed=2)
    got = lds(scores, masks, outputs)
    for j in range(m):
        predicted = [scores[j, masks[s]].sum().item() for s in range(r)]
        expected = stats.spearmanr(predicted, outputs[:, j].numpy()).statistic
        assert got[j].item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    # outputs that are the summed scores: a perfect score; their negation: -1
    exact = (masks.double() @ scores.T).contiguous()
    assert torch.allclose(lds(scores, masks, exact), torch.ones(m, dtype=torch.float64))
    assert torch.allclose(lds(scores, masks, -exact), -torch.ones(m, dtype=torch.float64))
    with pytest.raises(ScoreArgumentError, match=r"pass scores \[m, n\], masks \[R, n\] and outputs \[R, m\]"):
        lds(scores, masks, outputs.T)


def test_loo_correlation_is_the_spearman_of_scores_and_the_change_left_out() -> None:
    m, left = 3, 12
    scores, full, without = randn(m, left, seed=0), randn(m, seed=1), randn(left, m, seed=2)
    got = loo_correlation(scores, full, without)
    for j in range(m):
        change = (full[j] - without[:, j]).numpy()
        assert got[j].item() == pytest.approx(stats.spearmanr(scores[j].numpy(), change).statistic, rel=1e-12)
    with pytest.raises(ScoreArgumentError, match=r"pass scores \[m, L\], full \[m\] and without \[L, m\]"):
        loo_correlation(scores, full, without.T)


def test_retrain_measures_a_model_per_subset() -> None:
    """A "model" that is the mean of its training targets: the outputs are known in closed form, and a
    least-squares datamodel of them scores an LDS of 1."""
    n, r = 20, 12
    y = randn(n, seed=0)
    masks = subsets(n, r, seed=5)
    seen: list[Tensor] = []

    def train_on(indices: Tensor) -> Tensor:
        seen.append(indices)
        return y[indices].sum()

    outputs = retrain(masks, train_on, lambda total: torch.stack([total, -2 * total]))
    assert outputs.shape == (r, 2) and outputs.dtype == torch.float64
    assert all(torch.equal(idx, torch.nonzero(mask).reshape(-1)) for idx, mask in zip(seen, masks))
    torch.testing.assert_close(outputs[:, 0], masks.double() @ y, rtol=1e-12, atol=1e-12)
    scores = torch.stack([y, -2 * y])  # the exact linear datamodel
    assert torch.allclose(lds(scores, masks, outputs), torch.ones(2, dtype=torch.float64))
