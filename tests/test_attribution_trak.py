"""TRAK mode and what it needs from the store: a projection seed per checkpoint (recorded, checked on write), the
model output (margin) and its out-to-loss term, float16 storage, per-token stores; every number against naive
float64 formulas (torch.func per-sample gradients of the margin times the whole matrix P)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import reference_grad_sample
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution import (
    TRAK,
    FeatureStore,
    MissingFeaturesError,
    ScoreArgumentError,
    StoreIndexError,
    StoreSpecError,
    checkpoint_seeds,
    gram,
    lm_margin,
    margin,
    scores,
    self_influence,
    token_scores,
    top_k,
    trak,
)
from pergrad.attribution.projectors import Projector, Spec

N, M, K = 23, 5, 16  # kron 4 x 4
NAMES = ("e1", "e2", "e3")


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def labels(n: int, seed: int, classes: int = 3) -> Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


# -- the model outputs ---------------------------------------------------------------------------------------------


def test_margin_is_log_odds_of_the_label_and_q_is_one_minus_p() -> None:
    logits = randn(9, 4, seed=0) * 3
    y = labels(9, 1, 4)
    f, q = margin(logits, y)
    p = logits.softmax(1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(f, torch.log(p) - torch.log1p(-p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q, 1 - p, rtol=1e-12, atol=1e-14)
    assert not q.requires_grad
    # the loss's derivative in f is -Q: d(cross-entropy)/d(logits) = -Q d f/d(logits), sample by sample
    x = logits.clone().requires_grad_(True)
    (g_loss,) = torch.autograd.grad(F.cross_entropy(x, y, reduction="sum"), x)
    (g_f,) = torch.autograd.grad(margin(x, y)[0].sum(), x)
    torch.testing.assert_close(g_loss, -q[:, None] * g_f, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"for \[B, T, vocab\] language-model logits use lm_margin"):
        margin(randn(2, 3, 4, seed=0), labels(2, 0))


def test_lm_margin_sums_the_tokens_margins_and_averages_their_q() -> None:
    logits = randn(3, 6, 5, seed=2) * 2
    targets = labels(18, 3, 5).view(3, 6)
    targets[1, 4:] = -100
    targets[2] = -100  # no token at all
    f, q = lm_margin(logits, targets)
    for i in range(3):
        keep = targets[i] != -100
        p = logits[i].softmax(-1)[torch.arange(6), targets[i].clamp(min=0)][keep]
        expected_f = (torch.log(p) - torch.log1p(-p)).sum()
        expected_q = (1 - p).mean() if keep.any() else torch.zeros((), dtype=torch.float64)
        torch.testing.assert_close(f[i], expected_f, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(q[i], expected_q, rtol=1e-12, atol=1e-14)
    x = logits.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(lm_margin(x, targets)[0].sum(), x)
    assert torch.equal(g[2], torch.zeros_like(g[2])) and torch.equal(g[1, 4:], torch.zeros_like(g[1, 4:]))


# -- a seed per checkpoint -----------------------------------------------------------------------------------------


def test_each_checkpoint_projects_with_its_own_recorded_seed(tmp_path: Path) -> None:
    with FeatureStore.open(tmp_path / "s", n=N, k=K, checkpoints=NAMES, seed=3, kind="kron") as store:
        assert store.spec.seeds == checkpoint_seeds(3, 3) == (3, 100_003, 200_003)
        assert [store.seed(name) for name in NAMES] == [3, 100_003, 200_003]
        assert store.projection("e2") == {"dim": K, "kind": "kron", "seed": 100_003}
    spec = json.loads((tmp_path / "s" / "spec.json").read_text())
    assert spec["seeds"] == [3, 100_003, 200_003] and spec["format_version"] == 2
    FeatureStore.open(tmp_path / "s", seed=3, readonly=True).close()
    FeatureStore.open(tmp_path / "s", seeds=[3, 100_003, 200_003], readonly=True).close()
    with pytest.raises(StoreSpecError, match=r"was written with seeds=\(3, 100003, 200003\), this call asks for"):
        FeatureStore.open(tmp_path / "s", seeds=[3, 3, 3])
    with pytest.raises(StoreSpecError, match=r"pass seed= .* or seeds= .*not both"):
        FeatureStore.open(tmp_path / "t", n=N, k=K, seed=1, seeds=[1])
    with pytest.raises(StoreSpecError, match=r"seeds \[1\] for checkpoints \['e1', 'e2', 'e3'\]: give one"):
        FeatureStore.open(tmp_path / "t", n=N, k=K, checkpoints=NAMES, seeds=[1], kind="kron")
    with FeatureStore.open(tmp_path / "same", n=N, k=K, checkpoints=NAMES, seeds=[5, 5, 5], kind="kron") as same:
        assert same.seed("e3") == 5  # asked for explicitly
    with FeatureStore.open(tmp_path / "default", n=N, k=K, checkpoints=NAMES[:2], kind="sjlt") as store:
        assert store.spec.seeds == (0, 100_000)
    with FeatureStore.open(tmp_path / "theirs", n=N, k=K) as theirs:
        with pytest.raises(StoreSpecError, match=r"records no kind: its features are not pergrad's projections"):
            theirs.projection()
        with pytest.raises(StoreSpecError, match=r"records no projection seeds"):
            theirs.seed()


def test_a_store_written_by_the_format_with_one_seed_is_refused(tmp_path: Path) -> None:
    with FeatureStore.open(tmp_path, n=4, k=K, kind="kron", checkpoints=NAMES) as store:
        for name in NAMES:
            store.write(torch.arange(4), torch.ones(4, K), checkpoint=name)
    path = tmp_path / "spec.json"
    old = json.loads(path.read_text())
    old["format_version"] = 1
    del old["seeds"], old["output"], old["out_to_loss"], old["tokens"]
    path.write_text(json.dumps(old))
    with pytest.raises(StoreSpecError, match=r"format_version 1; this pergrad reads 2 .*recorded one seed"):
        FeatureStore.open(tmp_path, readonly=True)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_write_from_refuses_features_of_another_projection(tmp_path: Path) -> None:
    net = mlp()
    x, y = randn(N, 5, seed=1), labels(N, 2)
    with FeatureStore.open(tmp_path, n=N, k=K, checkpoints=NAMES, kind="kron", dtype=torch.float64) as store:
        psm = PerSampleModule(net, loss_reduction="sum")
        psm.register_projection(net, **store.projection("e1"))
        F.cross_entropy(psm(x), y, reduction="sum").backward()
        store.write_from(psm, torch.arange(N), "e1")
        assert torch.equal(store.read(torch.arange(N), "e1"), psm.per_sample_projections()[""])
        for name in ("e2", "e3"):  # another checkpoint's seed: refused, nothing written
            with pytest.raises(StoreSpecError, match=rf"checkpoint '{name}': the projection of '' has seed=0, .*"):
                store.write_from(psm, torch.arange(N), name)
            assert store.missing(name).numel() == N
        with pytest.raises(StoreSpecError, match=r"has no projection of target 'fc'"):
            store.write_from(psm, torch.arange(N), "e1", target="fc")
        psm.remove()
        other = PerSampleModule(net, loss_reduction="sum")
        other.register_projection(net, dim=K, kind="dense", seed=100_000)
        F.cross_entropy(other(x), y, reduction="sum").backward()
        with pytest.raises(StoreSpecError, match=r"has kind='dense', this checkpoint's features kind='kron'"):
            other.module.zero_grad()
            store.write_from(other, torch.arange(N), "e2")
        other.remove()


# -- TRAK end to end -----------------------------------------------------------------------------------------------


def margin_loss(out: Tensor, y: Tensor) -> Tensor:
    return margin(out, y)[0].sum()


def projected(ref: dict[str, Tensor], net: nn.Module, spec: Spec) -> Tensor:
    """``P vec(g_i)`` with the whole matrix ``P = [P_1 ... P_m]`` regenerated from the spec."""
    return sum(  # type: ignore[return-value]
        ref[name].flatten(1) @ Projector(spec, name, tuple(p.shape)).matrix().T for name, p in net.named_parameters()
    )


def build_trak_store(
    tmp_path: Path,
    kind: str = "kron",
    dtype: torch.dtype = torch.float64,
    measure: Callable[[Tensor, Tensor], Tensor] = margin_loss,
) -> dict[str, object]:
    """Three checkpoints of an SGD run; at each, the margins' features of every train sample (batches of
    changing sizes through one wrapper with grads=False: weights detached from the second backward) and the
    features of ``measure`` (the query side's function: the margin unless said) of the test samples, written
    with write_from; returns the naive float64 ingredients beside the store."""
    net = mlp()
    x, y = randn(N, 5, seed=1), labels(N, 2)
    xt, yt = randn(M, 5, seed=3), labels(M, 4)
    store = FeatureStore.open(
        tmp_path, n=N, k=K, checkpoints=NAMES, seed=11, kind=kind, dtype=dtype, output="margin", out_to_loss=True
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    phi, phi_test, q, test = {}, {}, {}, {}
    for name in NAMES:
        spec = Spec(K, kind, store.seed(name))
        phi[name] = projected(reference_grad_sample(net, x, y, margin_loss), net, spec)
        phi_test[name] = projected(reference_grad_sample(net, xt, yt, measure), net, spec)
        with torch.no_grad():
            q[name] = 1 - net(x).softmax(1).gather(1, y[:, None]).squeeze(1)
        psm = PerSampleModule(net, loss_reduction="sum")
        psm.register_projection(net, **store.projection(name), grads=False)
        for idx in torch.arange(N).split(7):  # 7, 7, 7, 2
            f, qb = margin(psm(x[idx]), y[idx])
            f.sum().backward()
            store.write_from(psm, idx, name, out_to_loss=qb)
        measure(psm(xt), yt).backward()
        test[name] = psm.per_sample_projections()[""]
        psm.remove()
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    store.close()
    return {"phi": phi, "phi_test": phi_test, "q": q, "test": test}


def naive_trak(phi: dict[str, Tensor], query: dict[str, Tensor], q: dict[str, Tensor], damping: float) -> Tensor:
    """``Q_i sum_c phi_c(z)^T (Phi_c^T Phi_c + lambda_c I)^{-1} phi_c(i)``, ``Q`` averaged over checkpoints."""
    out = torch.zeros(next(iter(query.values())).shape[0], N, dtype=torch.float64)
    for name in NAMES:
        g = phi[name].T @ phi[name]
        lam = damping * g.trace() / K
        out += query[name] @ torch.linalg.inv(g + lam * torch.eye(K, dtype=torch.float64)) @ phi[name].T
    return out * torch.stack([q[name] for name in NAMES]).mean(0)


@pytest.mark.parametrize("kind", ["kron", "dense", "sjlt"])
def test_trak_scores_equal_the_naive_formula(tmp_path: Path, kind: str) -> None:
    built = build_trak_store(tmp_path, kind)
    phi, phi_test, q, test = built["phi"], built["phi_test"], built["q"], built["test"]
    assert isinstance(phi, dict) and isinstance(phi_test, dict) and isinstance(q, dict) and isinstance(test, dict)
    store = FeatureStore.open(tmp_path, readonly=True)
    for name in NAMES:  # the features and Q written are torch.func's margins' gradients times P
        torch.testing.assert_close(store.read(torch.arange(N), name), phi[name], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(test[name], phi_test[name], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(store.out_to_loss(name), q[name], rtol=1e-12, atol=1e-14)
    for damping in (1e-3, 0.0) if kind != "sjlt" else (1e-3,):  # (a sketch of 57 coordinates misses a feature)
        expected = naive_trak(phi, phi_test, q, damping)
        built_once = trak(store, damping, chunk=5)
        assert isinstance(built_once, TRAK)
        got = scores(test, store, preconditioner=built_once, chunk=6)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    expected = naive_trak(phi, phi_test, q, 1e-3)
    torch.testing.assert_close(scores(test, store, preconditioner="trak", chunk=4), expected, rtol=1e-9, atol=1e-12)
    subset = torch.tensor([20, 3, 4, 11])  # a subset scored: columns of the whole store's scores
    sub = scores(test, store, preconditioner="trak", indices=subset)
    torch.testing.assert_close(sub, expected[:, subset], rtol=1e-9, atol=1e-12)
    values, where = top_k(test, store, 4, preconditioner="trak", chunk=5)
    torch.testing.assert_close(values, expected.topk(4, dim=1).values, rtol=1e-9, atol=1e-12)
    assert torch.equal(where, expected.topk(4, dim=1).indices)
    own = naive_trak(phi, phi, q, 1e-3).diagonal()
    torch.testing.assert_close(self_influence(store, "trak", chunk=7), own, rtol=1e-9, atol=1e-12)


def other_class_log_probability(out: Tensor, y: Tensor) -> Tensor:
    """A measurement other than the training output: each test sample's log-probability of the class after its
    label, summed."""
    return out.log_softmax(1).gather(1, (y[:, None] + 1) % 3).sum()


@pytest.mark.parametrize("measure", [other_class_log_probability, F.cross_entropy], ids=["log_prob", "loss"])
def test_the_query_side_differentiates_a_measurement_of_its_own(
    tmp_path: Path, measure: Callable[[Tensor, Tensor], Tensor]
) -> None:
    """kronfluence's ``compute_measurement``: the train side's features are the margins' (TRAK), the query's those
    of any other per-sample scalar; the scores are the naive formula with the measurement's gradients."""
    loss = (lambda out, y: F.cross_entropy(out, y, reduction="sum")) if measure is F.cross_entropy else measure
    built = build_trak_store(tmp_path / "measure", measure=loss)
    phi, phi_test, q, test = built["phi"], built["phi_test"], built["q"], built["test"]
    assert isinstance(phi, dict) and isinstance(phi_test, dict) and isinstance(q, dict) and isinstance(test, dict)
    store = FeatureStore.open(tmp_path / "measure", readonly=True)
    for name in NAMES:
        torch.testing.assert_close(test[name], phi_test[name], rtol=1e-10, atol=1e-12)
    expected = naive_trak(phi, phi_test, q, 1e-3)
    torch.testing.assert_close(scores(test, store, preconditioner="trak", chunk=4), expected, rtol=1e-9, atol=1e-12)
    of_margin = build_trak_store(tmp_path / "margin")["test"]  # the same store, the margin's queries
    assert isinstance(of_margin, dict)
    assert not torch.allclose(scores(of_margin, store, preconditioner="trak"), expected, rtol=1e-3)


def test_trak_needs_the_out_to_loss_terms(tmp_path: Path) -> None:
    with FeatureStore.open(tmp_path / "plain", n=4, k=K, kind="kron") as plain:
        plain.write(torch.arange(4), randn(4, K, seed=0))
        with pytest.raises(StoreIndexError, match=r"opened without out_to_loss=True"):
            plain.write(torch.arange(4), randn(4, K, seed=0), out_to_loss=torch.ones(4))
    with pytest.raises(ScoreArgumentError, match=r"TRAK needs the out-to-loss term .*out_to_loss=True"):
        scores(randn(2, K, seed=1), plain, preconditioner="trak")
    with pytest.raises(StoreSpecError, match=r"keeps no out-to-loss terms"):
        plain.out_to_loss()
    with FeatureStore.open(tmp_path / "q", n=4, k=K, kind="kron", out_to_loss=True) as store:
        with pytest.raises(StoreIndexError, match=r"out_to_loss=True\): write got none; pass out_to_loss= \[len"):
            store.write(torch.arange(4), randn(4, K, seed=0))
        with pytest.raises(StoreIndexError, match=r"write got shape \[3\]"):
            store.write(torch.arange(4), randn(4, K, seed=0), out_to_loss=torch.ones(3))
        store.write(torch.arange(2), randn(2, K, seed=0), out_to_loss=torch.ones(2))
    with pytest.raises(MissingFeaturesError, match=r"preconditioner='trak' is built from the whole store .* 2 of"):
        scores(randn(2, K, seed=1), store, preconditioner="trak", indices=[0, 1])


# -- float16 and per-token stores ----------------------------------------------------------------------------------


def test_float16_features_are_stored_in_half_and_scored_in_float32(tmp_path: Path) -> None:
    phi, test = randn(N, K, seed=0), randn(M, K, seed=1)
    with FeatureStore.open(tmp_path, n=N, k=K, dtype=torch.float16) as store:
        store.write(torch.arange(N), phi)
    reader = FeatureStore.open(tmp_path, readonly=True)
    half = phi.half()
    assert (tmp_path / "features.c0.r0.npy").stat().st_size < 128 + N * K * 2 + 64
    assert torch.equal(reader.read(torch.arange(N)), half)
    got = scores(test.float(), reader, chunk=5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, test.float() @ half.float().T, rtol=1e-6, atol=1e-6)
    g = gram(reader)
    expected = half.double().T @ half.double()
    torch.testing.assert_close(
        g.factors[0] @ g.factors[0].T, expected + g.damping[0] * torch.eye(K, dtype=torch.float64)
    )
    assert self_influence(reader).dtype == torch.float32


def test_a_per_token_store_scores_per_token_and_per_sample(tmp_path: Path) -> None:
    T = 5
    tokens = randn(N, T, K, seed=0)
    tokens[7:14, 3:] = 0  # written as [B, 3, k]: the rest is padding
    test = {name: randn(M, K, seed=10 + c) for c, name in enumerate(NAMES[:2])}
    with FeatureStore.open(tmp_path, n=N, k=K, tokens=T, dtype=torch.float64, checkpoints=NAMES[:2]) as store:
        for c, name in enumerate(NAMES[:2]):
            scale = 1.0 + c
            store.write(torch.arange(7), tokens[:7] * scale, name)
            store.write(torch.arange(7, 14), tokens[7:14, :3] * scale, name)
            store.write(torch.arange(14, N), tokens[14:] * scale, name)
        with pytest.raises(
            StoreIndexError, match=r"per-token store takes \[len\(indices\), T, k\] = \[2, T <= 5, 16\]"
        ):
            store.write([0, 1], randn(2, 6, K, seed=0), "e1")
        with pytest.raises(StoreIndexError, match=r"per-token store takes"):
            store.write([0, 1], randn(2, K, seed=0), "e1")
    reader = FeatureStore.open(tmp_path, readonly=True)
    per_sample = {name: tokens.sum(1) * (1.0 + c) for c, name in enumerate(NAMES[:2])}
    assert torch.equal(reader.read(torch.arange(N), "e2", per_token=True), tokens * 2)
    torch.testing.assert_close(reader.read(torch.arange(N), "e2"), per_sample["e2"], rtol=1e-12, atol=1e-14)
    for preconditioner in ("identity", "gram"):
        m = gram(reader) if preconditioner == "gram" else None
        expected = torch.zeros(M, N, T, dtype=torch.float64)
        for c, name in enumerate(NAMES[:2]):
            mat = m.matrix(c) if m is not None else torch.eye(K, dtype=torch.float64)
            expected += torch.einsum("mk,kl,ntl->mnt", test[name], mat, tokens * (1.0 + c))
        got = token_scores(test, reader, preconditioner=preconditioner, chunk=4)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            got.sum(2), scores(test, reader, preconditioner=preconditioner), rtol=1e-10, atol=1e-12
        )
        subset = torch.tensor([9, 0, 22])
        torch.testing.assert_close(
            token_scores(test, reader, preconditioner=preconditioner, indices=subset),
            expected[:, subset],
            rtol=1e-10,
            atol=1e-12,
        )
    with FeatureStore.open(tmp_path / "flat", n=3, k=K) as flat:
        flat.write(torch.arange(3), randn(3, K, seed=0))
        with pytest.raises(StoreIndexError, match=r"per-token features: open the store with tokens=T"):
            flat.write(torch.arange(3), randn(3, 2, K, seed=0))
    with pytest.raises(ScoreArgumentError, match=r"token_scores needs a per-token store"):
        token_scores(randn(2, K, seed=0), flat)
    with pytest.raises(StoreSpecError, match=r"holds one row of features per sample, not per token"):
        flat.read([0], per_token=True)


@pytest.mark.parametrize("batch_size", [1, 2, M, M + 1])  # one query, not dividing m, m, more than m
def test_token_scores_in_query_batches_give_the_unbatched_numbers(
    tmp_path: Path, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    T, weights = 4, [0.5, 2.0]
    tokens = randn(N, T, K, seed=0)
    test = {name: randn(M, K, seed=10 + c) for c, name in enumerate(NAMES[:2])}
    with FeatureStore.open(tmp_path, n=N, k=K, tokens=T, dtype=torch.float64, checkpoints=NAMES[:2]) as store:
        for c, name in enumerate(NAMES[:2]):
            store.write(torch.arange(N), tokens * (1.0 + c), name)
    reader = FeatureStore.open(tmp_path, readonly=True)
    g = gram(reader)
    passes = {False: 0, True: 0}  # per_token -> passes over the store
    read = reader.chunks

    def counted(*args: Any, per_token: bool = False) -> Iterator[tuple[Tensor, Tensor]]:
        passes[per_token] += 1
        return read(*args, per_token=per_token)

    q = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    for preconditioner in ("identity", "gram", TRAK(g.factors, g.damping, q)):
        expected = torch.zeros(M, N, T, dtype=torch.float64)
        for c, name in enumerate(NAMES[:2]):
            mat = torch.eye(K, dtype=torch.float64) if preconditioner == "identity" else g.matrix(c)
            expected += weights[c] * torch.einsum("mk,kl,ntl->mnt", test[name], mat, tokens * (1.0 + c))
        if isinstance(preconditioner, TRAK):
            expected *= q[None, :, None]
        whole = token_scores(test, reader, preconditioner=preconditioner, weights=weights, chunk=7)
        passes.update({False: 0, True: 0})
        with monkeypatch.context() as patch:
            patch.setattr(reader, "chunks", counted)
            got = token_scores(
                test, reader, preconditioner=preconditioner, weights=weights, chunk=7, batch_size=batch_size
            )
        torch.testing.assert_close(got, whole, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        batches = -(-M // batch_size)
        assert passes == {False: 2 if preconditioner == "gram" else 0, True: batches * 2}
        subset = torch.tensor([9, 0, 22])
        torch.testing.assert_close(
            token_scores(
                test, reader, preconditioner=preconditioner, weights=weights, indices=subset, batch_size=batch_size
            ),
            expected[:, subset],
            rtol=1e-10,
            atol=1e-12,
        )
    for bad in (0, -1):
        with pytest.raises(ScoreArgumentError, match=rf"batch_size={bad}: pass a positive number of queries"):
            token_scores(test, reader, batch_size=bad)
