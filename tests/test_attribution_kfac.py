"""Kronecker-factored preconditioning (LoGra / EK-FAC on the projected factors): chunked scores equal
the dense formula with ``torch.kron(S_row, S_col)`` block by block (float64), EK-FAC equals its dense
formula, end to end from ``psm.projected_factors()``, and what does not fit is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution import (
    FeatureStore,
    KroneckerFactored,
    ScoreArgumentError,
    ekfac,
    feature_columns,
    scores,
    self_influence,
    top_k,
)

N, M = 29, 3
NAMES = ("e1", "e2")
WEIGHTS = (0.5, 0.2)
# columns 0:8 a 2 x 4 block, 8:11 outside any block (a bias: identity), 11:20 a 3 x 3 block
LAYOUT = {"a": (0, 2, 4), "bias": (8, None, 3), "b": (11, 3, 3)}
K = 20
CHUNKS = [1, 7, 29, 40]


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def spd(r: int, seed: int) -> Tensor:
    x = randn(r + 2, r, seed=seed)
    return x.T @ x / (r + 2)


def factors(seed: int) -> dict[range, tuple[Tensor, Tensor]]:
    return {
        range(start, start + r * c): (spd(r, seed + start), spd(c, seed + start + 1))
        for start, r, c in LAYOUT.values()
        if r is not None
    }


def dense_kfac(blocks: dict[range, tuple[Tensor, Tensor]], damping: float) -> Tensor:
    """``M``: ``(S_row ⊗ S_col + lambda I)^{-1}`` on each block, lambda = damping * mean eigenvalue; I elsewhere."""
    m = torch.eye(K, dtype=torch.float64)
    for columns, (row, col) in blocks.items():
        cols = slice(columns.start, columns.stop)
        c = torch.kron(row, col)
        lam = damping * row.trace() * col.trace() / c.shape[0]
        m[cols, cols] = torch.linalg.inv(c + lam * torch.eye(c.shape[0], dtype=torch.float64))
    return m


def dense_ekfac(blocks: dict[range, tuple[Tensor, Tensor]], phi: Tensor, damping: float) -> Tensor:
    """``M``: ``U diag(1 / (Lambda + lambda)) U^T`` on each block, ``U = U_row ⊗ U_col``, ``Lambda`` the mean
    square of the train features in that basis, lambda = damping * mean(Lambda); I elsewhere."""
    m = torch.eye(K, dtype=torch.float64)
    for columns, (row, col) in blocks.items():
        cols = slice(columns.start, columns.stop)
        u = torch.kron(torch.linalg.eigh(row)[1], torch.linalg.eigh(col)[1])
        lam_ = (phi[:, cols] @ u).square().mean(0)
        m[cols, cols] = u @ torch.diag(1 / (lam_ + damping * lam_.mean())) @ u.T
    return m


@pytest.fixture
def train() -> dict[str, Tensor]:
    return {name: randn(N, K, seed=c) for c, name in enumerate(NAMES)}


@pytest.fixture
def test() -> dict[str, Tensor]:
    return {name: randn(M, K, seed=10 + c) for c, name in enumerate(NAMES)}


@pytest.fixture
def store(tmp_path: Path, train: dict[str, Tensor]) -> FeatureStore:
    with FeatureStore.open(tmp_path / "s", n=N, k=K, dtype=torch.float64, checkpoints=NAMES) as writer:
        for name, phi in train.items():
            for idx in torch.arange(N).split(8):
                writer.write(idx, phi[idx], checkpoint=name)
    return FeatureStore.open(tmp_path / "s", readonly=True)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("damping", [1e-3, 0.5])
def test_kronecker_factored_scores_equal_the_dense_formula(
    store: FeatureStore, train: dict[str, Tensor], test: dict[str, Tensor], chunk: int, damping: float
) -> None:
    blocks = [factors(100), factors(200)]
    pre = KroneckerFactored(blocks, damping=damping)
    ms = [dense_kfac(b, damping) for b in blocks]
    want = sum(w * test[n] @ m @ train[n].T for w, n, m in zip(WEIGHTS, NAMES, ms))
    got = scores(test, store, preconditioner=pre, weights=WEIGHTS, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    diag = sum(w * ((train[n] @ m) * train[n]).sum(1) for w, n, m in zip(WEIGHTS, NAMES, ms))
    torch.testing.assert_close(self_influence(store, pre, weights=WEIGHTS, chunk=chunk), diag, rtol=1e-9, atol=1e-10)
    values, where = top_k(test, store, 4, preconditioner=pre, weights=WEIGHTS, chunk=chunk)
    torch.testing.assert_close(values, want.gather(1, where), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(values, want.topk(4, dim=1).values, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_ekfac_equals_its_dense_formula(
    store: FeatureStore, train: dict[str, Tensor], test: dict[str, Tensor], chunk: int
) -> None:
    blocks = [factors(100), factors(200)]
    pre = ekfac(store, blocks, damping=0.1, chunk=chunk)
    ms = [dense_ekfac(b, train[n], 0.1) for b, n in zip(blocks, NAMES)]
    want = sum(w * test[n] @ m @ train[n].T for w, n, m in zip(WEIGHTS, NAMES, ms))
    torch.testing.assert_close(scores(test, store, preconditioner=pre, weights=WEIGHTS), want, rtol=1e-9, atol=1e-10)
    subset = torch.tensor([3, 0, 17, 28, 5])
    on_subset = ekfac(store, blocks, damping=0.1, chunk=chunk, indices=subset)
    ms = [dense_ekfac(b, train[n][subset], 0.1) for b, n in zip(blocks, NAMES)]
    want = sum(w * test[n] @ m @ train[n].T for w, n, m in zip(WEIGHTS, NAMES, ms))
    torch.testing.assert_close(
        scores(test, store, preconditioner=on_subset, weights=WEIGHTS), want, rtol=1e-9, atol=1e-10
    )


def test_end_to_end_from_the_backwards_factors(tmp_path: Path) -> None:
    """Features of one projection target per weight, concatenated (``feature_columns``), the factors the
    backward passes summed, scores against the dense formula with ``torch.kron(row, col)``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    psm = PerSampleModule(net, keep_grad_sample=False)
    for name in ("0.weight", "2.weight"):
        psm.register_projection(name, dim=8, seed=1)
    psm.register_projection("2.bias", dim=2, kind="dense", seed=1)
    psm.track_projected_factors("0.weight", "2.weight")
    data = [(torch.randn(b, 5, 4, dtype=torch.float64), torch.randn(b, 5, 3, dtype=torch.float64)) for b in (4, 6, 5)]
    rows = []
    for x, y in data:
        net.zero_grad()
        ((psm(x) - y).pow(2).sum() / x.shape[0]).backward()
        rows.append(torch.cat(list(psm.per_sample_projections().values()), 1))
    phi = torch.cat(rows)
    columns = feature_columns(psm.per_sample_projections())
    assert columns == {"0.weight": range(8), "2.weight": range(8, 16), "2.bias": range(16, 18)}
    found = psm.projected_factors()
    assert {n: f.samples for n, f in found.items()} == {"0.weight": 15, "2.weight": 15}
    with FeatureStore.open(tmp_path / "s", n=phi.shape[0], k=18, dtype=torch.float64) as writer:
        writer.write(torch.arange(phi.shape[0]), phi)
    store = FeatureStore.open(tmp_path / "s", readonly=True)
    pre = KroneckerFactored({columns[n]: f for n, f in found.items()}, damping=0.01)
    m = torch.eye(18, dtype=torch.float64)
    for i, f in enumerate(found.values()):
        c = torch.kron(f.row, f.col)
        lam = 0.01 * f.row.trace() * f.col.trace() / 8
        m[8 * i : 8 * (i + 1), 8 * i : 8 * (i + 1)] = torch.linalg.inv(c + lam * torch.eye(8, dtype=torch.float64))
    test = phi[:3]
    torch.testing.assert_close(scores(test, store, preconditioner=pre, chunk=4), test @ m @ phi.T)
    psm.remove()


def test_what_does_not_fit_is_refused(store: FeatureStore, test: dict[str, Tensor]) -> None:
    blocks = factors(100)
    with pytest.raises(ScoreArgumentError, match=r"factors for 1 checkpoint\(s\), the store has 2"):
        scores(test, store, preconditioner=KroneckerFactored(blocks))
    wide = {range(8): blocks[range(8)], range(15, 24): blocks[range(11, 20)]}
    with pytest.raises(ScoreArgumentError, match=r"a block up to column 24, the store has k=20"):
        scores(test, store, preconditioner=KroneckerFactored([wide, wide]))
    with pytest.raises(ScoreArgumentError, match=r"the block range\(0, 9\) with factors of shapes \[2, 2\], \[4, 4\]"):
        KroneckerFactored({range(9): blocks[range(8)]})
    with pytest.raises(ScoreArgumentError, match=r"the blocks 0:8 and 6:15 overlap"):
        KroneckerFactored({range(8): blocks[range(8)], range(6, 15): blocks[range(11, 20)]})
    zero = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ScoreArgumentError, match=r"columns 11:20 \(checkpoint 0\) has zero curvature"):
        KroneckerFactored({range(11, 20): (zero, zero)})
    with pytest.raises(ScoreArgumentError, match=r"damping=-1 must be >= 0"):
        KroneckerFactored(blocks, damping=-1)
