"""EK-FAC with the true (sampled-label) Fisher: ``sampled_labels`` draws from the model's predictive distribution
with the caller's generator; the factors summed in the backward of those labels' loss, the eigenvalue correction
from their features and the scores of the training labels' features all equal naive float64 formulas (one-sample
autograd on a copy of the model, the projection matrices regenerated from their spec)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution import FeatureStore, ekfac, feature_columns, sampled_labels, scores
from pergrad.attribution.projectors import Projector, Spec

N, M, DIM, SEED, DAMPING = 23, 5, 8, 3, 1e-3
WEIGHTS = ("0.weight", "2.weight")


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sampled_labels_are_the_multinomial_draws_of_the_softmax() -> None:
    logits = randn(6, 4, 5, seed=0)
    got = sampled_labels(logits, generator=torch.Generator().manual_seed(7))
    want = torch.multinomial(logits.reshape(-1, 5).softmax(1), 1, generator=torch.Generator().manual_seed(7)).reshape(
        6, 4
    )
    assert got.shape == (6, 4) and got.dtype == torch.int64
    assert torch.equal(got, want)
    again = sampled_labels(logits, generator=torch.Generator().manual_seed(7))
    assert torch.equal(got, again)
    assert not torch.equal(got, sampled_labels(logits, generator=torch.Generator().manual_seed(8)))
    targets = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(1))
    targets[1, 2] = targets[4, 0] = -100
    masked = sampled_labels(logits, generator=torch.Generator().manual_seed(7), targets=targets)
    assert masked[1, 2] == masked[4, 0] == -100
    keep = targets != -100
    assert torch.equal(masked[keep], got[keep])
    with pytest.raises(ValueError, match=r"targets must be logits.shape\[:-1\]"):
        sampled_labels(logits, targets=targets[:, :3])


def test_sampled_labels_follow_the_predictive_distribution() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    logits = probs.log().expand(40_000, 3)
    drawn = sampled_labels(logits, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=3).double() / drawn.numel()
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.01)  # 5 standard errors at most


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double()


def naive_features(net: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """Each sample's features ``[vec(u v^T) per weight]`` (``u = P_row d``, ``v = P_col a``, ``a`` the Linear's
    input, ``d`` its output gradient of the sample's own cross-entropy, one sample at a time on a copy) and
    the factors ``(1/n) sum u u^T``, ``(1/n) sum v v^T`` of each weight; the features checked against the
    sample's gradient times the whole matrix ``P``."""
    net = copy.deepcopy(net)
    layers = {name: net.get_submodule(name.split(".")[0]) for name in WEIGHTS}
    proj = {name: Projector(Spec(DIM, seed=SEED), name, tuple(net.get_parameter(name).shape)) for name in WEIGHTS}
    rows: list[Tensor] = []
    sums = {name: [torch.zeros(r, r, dtype=torch.float64) for r in proj[name].ranks] for name in WEIGHTS}
    seen: dict[str, tuple[Tensor, Tensor]] = {}
    for i in range(x.shape[0]):
        seen.clear()
        handles = [
            layer.register_forward_hook(lambda m, inp, out, name=name: seen.__setitem__(name, (inp[0], out)))
            for name, layer in layers.items()
        ]
        out = net(x[i : i + 1])
        for h in handles:
            h.remove()
        loss = F.cross_entropy(out, y[i : i + 1], reduction="sum")
        names = list(seen)
        grads = torch.autograd.grad(loss, [seen[n][1] for n in names] + [net.get_parameter(n) for n in names])
        d_of = dict(zip(names, grads[: len(names)]))
        g_of = dict(zip(names, grads[len(names) :]))
        row = []
        for name in WEIGHTS:
            p_row, p_col = proj[name].factors()
            u, v = p_row @ d_of[name][0], p_col @ seen[name][0][0].detach()
            feature = u.outer(v).flatten()
            torch.testing.assert_close(feature, proj[name].matrix() @ g_of[name].flatten(), rtol=1e-10, atol=1e-12)
            row.append(feature)
            sums[name][0] += u.outer(u)
            sums[name][1] += v.outer(v)
        rows.append(torch.cat(row))
    n = x.shape[0]
    return torch.stack(rows), {name: (s[0] / n, s[1] / n) for name, s in sums.items()}


def naive_ekfac(factors: dict[str, tuple[Tensor, Tensor]], fisher: Tensor) -> Tensor:
    """``M``: ``U diag(1 / (Lambda + lambda)) U^T`` on each weight's block, ``U = U_row ⊗ U_col`` the factors'
    eigenbases, ``Lambda`` the mean square of the sampled-label features in that basis."""
    m = torch.zeros(2 * DIM, 2 * DIM, dtype=torch.float64)
    for b, (row, col) in enumerate(factors.values()):
        cols = slice(b * DIM, (b + 1) * DIM)
        u = torch.kron(torch.linalg.eigh(row)[1], torch.linalg.eigh(col)[1])
        lam = (fisher[:, cols] @ u).square().mean(0)
        m[cols, cols] = u @ torch.diag(1 / (lam + DAMPING * lam.mean())) @ u.T
    return m


def test_ekfac_of_the_sampled_label_fisher_equals_the_naive_formula(tmp_path: Path) -> None:
    net = mlp()
    x, y = randn(N, 5, seed=1), torch.randint(0, 4, (N,), generator=torch.Generator().manual_seed(2))
    xt, yt = randn(M, 5, seed=3), torch.randint(0, 4, (M,), generator=torch.Generator().manual_seed(4))
    psm = PerSampleModule(net, loss_reduction="sum", keep_grad_sample=False)
    for name in WEIGHTS:
        psm.register_projection(name, dim=DIM, seed=SEED, grads=False)
    psm.track_projected_factors(*WEIGHTS)
    batches = torch.arange(N).split(7)  # 7, 7, 7, 2: the shortcuts start after the first backward
    gen = torch.Generator().manual_seed(5)
    drawn = []
    with FeatureStore.open(tmp_path / "fisher", n=N, k=2 * DIM, dtype=torch.float64) as fisher:
        for idx in batches:
            out = psm(x[idx])
            labels = sampled_labels(out, generator=gen)
            drawn.append(labels)
            F.cross_entropy(out, labels, reduction="sum").backward()
            fisher.write(idx, torch.cat(list(psm.per_sample_projections().values()), 1))
    found = psm.projected_factors()
    columns = feature_columns(dict.fromkeys(WEIGHTS, DIM))
    blocks = {columns[name]: f for name, f in found.items()}
    with FeatureStore.open(tmp_path / "train", n=N, k=2 * DIM, dtype=torch.float64) as train:
        for idx in batches:
            F.cross_entropy(psm(x[idx]), y[idx], reduction="sum").backward()
            train.write(idx, torch.cat(list(psm.per_sample_projections().values()), 1))
    F.cross_entropy(psm(xt), yt, reduction="sum").backward()
    test = torch.cat(list(psm.per_sample_projections().values()), 1)
    psm.remove()

    # the labels: the model's own draws with a generator seeded alike, batch by batch, not the training labels
    again = torch.Generator().manual_seed(5)
    with torch.no_grad():
        want = torch.cat([torch.multinomial(net(x[idx]).softmax(1), 1, generator=again).squeeze(1) for idx in batches])
    labels = torch.cat(drawn)
    assert torch.equal(labels, want) and not torch.equal(labels, y)

    phi_fisher, factors = naive_features(net, x, labels)
    phi_train, empirical = naive_features(net, x, y)
    phi_test, _ = naive_features(net, xt, yt)
    for name in WEIGHTS:  # the backward's sums are the sampled labels' factors, not the training labels'
        torch.testing.assert_close(found[name].row, factors[name][0], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(found[name].col, factors[name][1], rtol=1e-10, atol=1e-13)
        assert not torch.allclose(found[name].row, empirical[name][0], rtol=1e-3)
    fisher_store = FeatureStore.open(tmp_path / "fisher", readonly=True)
    train_store = FeatureStore.open(tmp_path / "train", readonly=True)
    torch.testing.assert_close(fisher_store.read(torch.arange(N)), phi_fisher, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(train_store.read(torch.arange(N)), phi_train, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(test, phi_test, rtol=1e-10, atol=1e-12)
    m = ekfac(fisher_store, blocks, DAMPING, chunk=6)
    want_scores = phi_test @ naive_ekfac(factors, phi_fisher) @ phi_train.T
    torch.testing.assert_close(scores(test, train_store, preconditioner=m, chunk=5), want_scores, rtol=1e-9, atol=1e-12)
    empirical_scores = phi_test @ naive_ekfac(empirical, phi_train) @ phi_train.T
    assert not torch.allclose(want_scores, empirical_scores, rtol=1e-2)  # the two Fishers give other scores
