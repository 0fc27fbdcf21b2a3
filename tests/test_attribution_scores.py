"""pergrad.attribution scores: chunked equals dense (float64), top-k merge, Gram preconditioner,
self-influence, checkpoints weighted, the store read only through bounded chunks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from pergrad.attribution import (
    FeatureStore,
    MissingFeaturesError,
    ScoreArgumentError,
    gram,
    iter_scores,
    scores,
    self_influence,
    top_k,
)

N, K, M = 37, 6, 4
CHUNKS = [1, 5, 37, 60, 8]  # 1, not dividing, n, > n, not dividing
NAMES = ("e1", "e2")
WEIGHTS = (0.5, 0.1)  # TracIn: the learning rate at each checkpoint


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


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
            for idx in torch.arange(N).split(9):
                writer.write(idx, phi[idx], checkpoint=name)
    return FeatureStore.open(tmp_path / "s", readonly=True)


def dense_gram_inverse(phi: Tensor, damping: float = 1e-3) -> Tensor:
    g = phi.T @ phi
    return torch.linalg.inv(g + damping * g.trace() / phi.shape[1] * torch.eye(phi.shape[1], dtype=phi.dtype))


def dense(test: dict[str, Tensor], train: dict[str, Tensor], preconditioner: str) -> Tensor:
    """``sum_c w_c phi_c(test) M_c phi_c(train)^T`` with every matrix in memory."""
    out = torch.zeros(M, N, dtype=torch.float64)
    for w, name in zip(WEIGHTS, NAMES):
        m = dense_gram_inverse(train[name]) if preconditioner == "gram" else torch.eye(K, dtype=torch.float64)
        out += w * test[name] @ m @ train[name].T
    return out


class Counting:
    """A store seen through ``chunks`` only, counting what each call reads."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store
        self.n, self.k, self.dtype, self.checkpoints = store.n, store.k, store.dtype, store.checkpoints
        self.sizes: list[int] = []
        self.calls = 0

    def chunks(
        self, size: int, checkpoint: str | int | None = None, indices: Tensor | Sequence[int] | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        self.calls += 1
        for idx, chunk in self.store.chunks(size, checkpoint, indices):
            self.sizes.append(chunk.shape[0])
            yield idx, chunk


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("preconditioner", ["identity", "gram"])
def test_chunked_scores_equal_dense(
    store: FeatureStore, train: dict[str, Tensor], test: dict[str, Tensor], chunk: int, preconditioner: str
) -> None:
    expected = dense(test, train, preconditioner)
    got = scores(test, store, preconditioner=preconditioner, weights=WEIGHTS, chunk=chunk)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # the same checkpoints as a [C, m, k] tensor, a sequence, and weights by name
    stacked = torch.stack([test[name] for name in NAMES])
    by_name = dict(zip(NAMES, WEIGHTS))
    torch.testing.assert_close(
        scores(stacked, store, preconditioner=preconditioner, weights=by_name, chunk=chunk),
        expected,
        rtol=1e-12,
        atol=1e-12,
    )
    subset = torch.tensor([30, 2, 11, 36])
    # a subset scored: the columns of the whole store's scores (the Gram of every train sample, not the subset's)
    torch.testing.assert_close(
        scores(list(stacked), store, preconditioner=preconditioner, weights=WEIGHTS, chunk=chunk, indices=subset),
        expected[:, subset],
        rtol=1e-12,
        atol=1e-12,
    )
    values, where = top_k(test, store, 2, preconditioner=preconditioner, weights=WEIGHTS, chunk=chunk, indices=subset)
    best = expected[:, subset].topk(2, dim=1)
    torch.testing.assert_close(values, best.values, rtol=1e-12, atol=1e-12)
    assert torch.equal(where, subset[best.indices])


def test_a_subsets_own_gram_is_asked_for_explicitly(
    tmp_path: Path, store: FeatureStore, train: dict[str, Tensor], test: dict[str, Tensor]
) -> None:
    """``gram(store, indices=)`` is the Gram of those rows (another matrix); ``"gram"`` on a store with rows
    missing is refused, naming both fixes."""
    subset = torch.tensor([30, 2, 11, 36, 7, 8, 9])
    expected = torch.zeros(M, subset.numel(), dtype=torch.float64)
    for w, name in zip(WEIGHTS, NAMES):
        phi = train[name][subset]
        expected += w * test[name] @ dense_gram_inverse(phi) @ phi.T
    own = gram(store, indices=subset, chunk=3)
    got = scores(test, store, preconditioner=own, weights=WEIGHTS, indices=subset)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got, scores(test, store, preconditioner="gram", weights=WEIGHTS, indices=subset))
    with FeatureStore.open(tmp_path / "part", n=N, k=K, dtype=torch.float64) as part:
        part.write(torch.arange(20), train["e1"][:20])
    for run in (
        lambda: scores(test["e1"], part, preconditioner="gram", indices=torch.arange(20)),
        lambda: self_influence(part, "gram", indices=torch.arange(20)),
    ):
        with pytest.raises(
            MissingFeaturesError, match=r"whole store .* 17 of the store.s samples .*=gram\(store, indices="
        ):
            run()
    phi = train["e1"][:20]
    torch.testing.assert_close(
        scores(test["e1"], part, preconditioner=gram(part, indices=torch.arange(20)), indices=torch.arange(20)),
        test["e1"] @ dense_gram_inverse(phi) @ phi.T,
        rtol=1e-10,
        atol=1e-12,
    )


def test_checkpoints_are_summed_with_their_weights(
    store: FeatureStore, train: dict[str, Tensor], test: dict[str, Tensor]
) -> None:
    one = scores(test, store, weights=(1.0, 0.0), chunk=7)
    two = scores(test, store, weights=(0.0, 1.0), chunk=7)
    torch.testing.assert_close(one, test["e1"] @ train["e1"].T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(two, test["e2"] @ train["e2"].T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        scores(test, store, weights=WEIGHTS, chunk=7), 0.5 * one + 0.1 * two, rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(scores(test, store, chunk=7), one + two, rtol=1e-12, atol=1e-12)  # default weights 1


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("preconditioner", ["identity", "gram"])
def test_top_k_equals_topk_of_the_dense_matrix(
    store: FeatureStore,
    train: dict[str, Tensor],
    test: dict[str, Tensor],
    chunk: int,
    largest: bool,
    preconditioner: str,
) -> None:
    full = dense(test, train, preconditioner)
    for k in (1, 5, N):
        values, where = top_k(
            test, store, k, largest=largest, preconditioner=preconditioner, weights=WEIGHTS, chunk=chunk
        )
        expected = torch.topk(full, k, dim=1, largest=largest)  # random features: no ties
        torch.testing.assert_close(values, expected.values, rtol=1e-12, atol=1e-12)
        assert torch.equal(where, expected.indices)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_top_k_breaks_ties_toward_the_smaller_index_among_scored_indices(tmp_path: Path, chunk: int) -> None:
    """Ties cut by a block's k-th value (many rows equal to it), the lowest as the highest, over train
    indices given in a shuffled order: the same rule, whatever the chunk."""
    base = torch.randint(-1, 2, (5, K), generator=torch.Generator().manual_seed(5)).double()
    phi = base[torch.arange(N) % 5]  # every score repeats about N / 5 times
    with FeatureStore.open(tmp_path, n=N, k=K, dtype=torch.float64) as store:
        store.write(torch.arange(N), phi)
    q = torch.randint(-1, 2, (M, K), generator=torch.Generator().manual_seed(6)).double()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(7))[: N - 3]
    full = q @ phi.T
    for largest in (True, False):
        values, where = top_k(q, store, 6, largest=largest, chunk=chunk, indices=order)
        sign = -1 if largest else 1
        for j in range(M):
            best = sorted(order.tolist(), key=lambda i: (sign * full[j, i].item(), i))[:6]
            assert where[j].tolist() == best, (largest, j)
            assert values[j].tolist() == [full[j, i].item() for i in best]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_top_k_breaks_ties_toward_the_smaller_index(tmp_path: Path, chunk: int) -> None:
    # every train row appears three times: rows i, i + 12, i + 24 score the same against any test sample
    # (small integers: the products are exact whatever the chunk, so the ties are exact too)
    base = torch.randint(-3, 4, (12, K), generator=torch.Generator().manual_seed(3)).double()
    phi = torch.cat([base, base, base, base[:1]])
    with FeatureStore.open(tmp_path, n=N, k=K, dtype=torch.float64) as store:
        store.write(torch.arange(N).flip(0), phi.flip(0))
    q = torch.randint(-3, 4, (M, K), generator=torch.Generator().manual_seed(4)).double()
    values, where = top_k(q, store, 7, chunk=chunk)
    full = q @ phi.T
    torch.testing.assert_close(values, torch.topk(full, 7, dim=1).values, rtol=0, atol=0)
    # the dense reference of the rule: sort by (-score, index)
    for j in range(M):
        order = sorted(range(N), key=lambda i: (-full[j, i].item(), i))[:7]
        assert where[j].tolist() == order
    assert (where[:, 0] < 12).all()  # of a tie of three rows (and 0, 12, 24, 36), the first one wins


def test_gram_preconditioner_equals_the_dense_formula(store: FeatureStore, train: dict[str, Tensor]) -> None:
    for damping in (1e-3, 0.5):
        g = gram(store, damping, chunk=6)
        for c, name in enumerate(NAMES):
            torch.testing.assert_close(g.matrix(c), dense_gram_inverse(train[name], damping), rtol=1e-10, atol=1e-12)
            phi = train[name]
            assert g.damping[c] == pytest.approx(damping * (phi.T @ phi).trace().item() / K, rel=1e-12)
    test = {name: randn(M, K, seed=20) for name in NAMES}
    once = gram(store, chunk=6)
    torch.testing.assert_close(
        scores(test, store, preconditioner=once, chunk=6),
        scores(test, store, preconditioner="gram", chunk=11),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("preconditioner", ["identity", "gram"])
def test_self_influence_is_the_diagonal_of_the_dense_scores(
    store: FeatureStore, train: dict[str, Tensor], chunk: int, preconditioner: str
) -> None:
    expected = _train_by_train(train, preconditioner).diagonal()
    got = self_influence(store, preconditioner, weights=WEIGHTS, chunk=chunk)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    subset = torch.tensor([5, 0, 36])
    sub = self_influence(store, "identity", weights=WEIGHTS, chunk=chunk, indices=subset)
    torch.testing.assert_close(sub, _train_by_train(train, "identity").diagonal()[subset], rtol=1e-12, atol=1e-12)


def _train_by_train(train: dict[str, Tensor], preconditioner: str) -> Tensor:
    out = torch.zeros(N, N, dtype=torch.float64)
    for w, name in zip(WEIGHTS, NAMES):
        m = dense_gram_inverse(train[name]) if preconditioner == "gram" else torch.eye(K, dtype=torch.float64)
        out += w * train[name] @ m @ train[name].T
    return out


@pytest.mark.parametrize("chunk", [1, 5, 8, 60])
def test_scoring_reads_the_store_in_bounded_chunks(store: FeatureStore, test: dict[str, Tensor], chunk: int) -> None:
    per_pass = math.ceil(N / chunk) * len(NAMES)  # chunks per pass over every checkpoint
    cases = [
        (lambda s: top_k(test, s, 3, chunk=chunk), 1),
        (lambda s: top_k(test, s, 3, preconditioner="gram", chunk=chunk), 2),  # the Gram pass, then scores
        (lambda s: self_influence(s, "gram", chunk=chunk), 2),
        (lambda s: list(iter_scores(test, s, chunk=chunk)), 1),
    ]
    for run, passes in cases:
        counting = Counting(store)
        run(counting)
        assert counting.calls == passes * len(NAMES)
        assert len(counting.sizes) == passes * per_pass
        assert max(counting.sizes) <= chunk
        assert sum(counting.sizes) == passes * N * len(NAMES)


def test_scores_refuse_what_does_not_fit(tmp_path: Path, store: FeatureStore, test: dict[str, Tensor]) -> None:
    with pytest.raises(ScoreArgumentError, match=r"test features for 1 checkpoint\(s\), the store has 2"):
        scores(test["e1"], store)
    with pytest.raises(
        ScoreArgumentError, match=r"test features of shape \[4, 5\]: each checkpoint's must be \[m, k\] with k=6"
    ):
        scores([t[:, :5] for t in test.values()], store)
    with pytest.raises(ScoreArgumentError, match=r"test features are given for checkpoints \['e1'\]"):
        scores({"e1": test["e1"]}, store)
    with pytest.raises(ScoreArgumentError, match=r"3 weights for the store's 2 checkpoints"):
        scores(test, store, weights=(1.0, 1.0, 1.0))
    with pytest.raises(ScoreArgumentError, match=r"preconditioner='kfac' is not known"):
        scores(test, store, preconditioner="kfac")
    with pytest.raises(
        ScoreArgumentError, match=r"top_k: k=38 must be between 1 and the number of train samples scored \(37\)"
    ):
        top_k(test, store, N + 1)
    with pytest.raises(ScoreArgumentError, match=r"the Gram preconditioner was built for 1 checkpoint\(s\) of k=6"):
        with FeatureStore.open(tmp_path / "one", n=3, k=K, dtype=torch.float64) as one:
            one.write([0, 1, 2], randn(3, K, seed=0))
        scores(test, store, preconditioner=gram(one))
    with pytest.raises(ScoreArgumentError, match=r"is singular .* pass a positive damping"):
        gram(one, damping=0.0)  # 3 rows span 3 of 6 directions
    with FeatureStore.open(tmp_path / "half", n=N, k=K) as half:
        half.write(torch.arange(10), torch.ones(10, K))
    with pytest.raises(MissingFeaturesError, match=r"27 of the samples asked for are not written"):
        top_k(torch.ones(2, K), half, 3)
    values, where = top_k(torch.ones(2, K), half, 3, indices=torch.arange(10))  # the rows written
    assert where.tolist() == [[0, 1, 2]] * 2 and torch.equal(values, torch.full((2, 3), float(K)))


def test_progress_bar_gives_the_same_numbers(
    store: FeatureStore, test: dict[str, Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    quiet = top_k(test, store, 4, chunk=5)
    loud = top_k(test, store, 4, chunk=5, progress=True)
    assert torch.equal(quiet[0], loud[0]) and torch.equal(quiet[1], loud[1])
    assert "scores" in capsys.readouterr().err
    assert self_influence(store, chunk=5).shape == (N,)
    assert capsys.readouterr().err == ""  # off by default


def test_tracin_end_to_end_from_torch_func_gradients(tmp_path: Path) -> None:
    """Features ``P g_i`` (``g_i`` from torch.func, ``P`` a fixed random projection) of two checkpoints,
    written batch by batch (changing sizes) as a training run would: TracIn scores, top-k and
    self-influence equal the dense products of the per-sample gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = randn(29, 5, seed=1), torch.randint(0, 3, (29,), generator=torch.Generator().manual_seed(2))
    xt, yt = randn(6, 5, seed=3), torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(4))
    size = sum(p.numel() for p in model.parameters())
    k = 16
    projection = randn(k, size, seed=5) / math.sqrt(k)
    lrs = {"step0": 0.3, "step3": 0.1}

    def per_sample_grads(xs: Tensor, ys: Tensor) -> Tensor:
        params = {name: p.detach() for name, p in model.named_parameters()}

        def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            out = functional_call(model, p, (xi.unsqueeze(0),))
            return nn.functional.cross_entropy(out, yi.unsqueeze(0))

        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
        return torch.cat([g[name].flatten(1) for name in params], 1)

    grads_train, grads_test = {}, {}
    with FeatureStore.open(
        tmp_path, n=29, k=k, dtype=torch.float64, checkpoints=list(lrs), seed=5, kind="dense"
    ) as store:
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        for step in range(4):
            name = f"step{step}"
            if name in lrs:
                for idx in torch.arange(29).split(8):  # batches of 8, 8, 8, 5
                    store.write(idx, per_sample_grads(x[idx], y[idx]) @ projection.T, checkpoint=name)
                grads_train[name] = per_sample_grads(x, y)
                grads_test[name] = per_sample_grads(xt, yt)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    test_features = {name: g @ projection.T for name, g in grads_test.items()}
    expected = sum(
        lr * (grads_test[name] @ projection.T) @ (grads_train[name] @ projection.T).T for name, lr in lrs.items()
    )
    assert isinstance(expected, Tensor)
    reader = FeatureStore.open(tmp_path, readonly=True)
    got = scores(test_features, reader, weights=lrs, chunk=6)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    values, where = top_k(test_features, reader, 5, weights=lrs, chunk=4)
    torch.testing.assert_close(values, torch.topk(expected, 5, dim=1).values, rtol=1e-12, atol=1e-14)
    assert torch.equal(where, torch.topk(expected, 5, dim=1).indices)
    own = sum(lr * ((grads_train[name] @ projection.T) ** 2).sum(1) for name, lr in lrs.items())
    torch.testing.assert_close(self_influence(reader, weights=lrs, chunk=10), own, rtol=1e-12, atol=1e-14)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch_size", [1, 3, M, M + 1])  # one query, not dividing m, m, more than m
@pytest.mark.parametrize("preconditioner", ["identity", "gram"])
def test_query_batches_give_the_unbatched_numbers(
    store: FeatureStore,
    train: dict[str, Tensor],
    test: dict[str, Tensor],
    batch_size: int,
    preconditioner: str,
) -> None:
    expected = dense(test, train, preconditioner)
    whole = scores(test, store, preconditioner=preconditioner, weights=WEIGHTS, chunk=5)
    got = scores(test, store, preconditioner=preconditioner, weights=WEIGHTS, chunk=5, batch_size=batch_size)
    torch.testing.assert_close(got, whole, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    subset = torch.tensor([30, 2, 11, 36])
    torch.testing.assert_close(
        scores(test, store, preconditioner=preconditioner, weights=WEIGHTS, indices=subset, batch_size=batch_size),
        expected[:, subset],
        rtol=1e-12,
        atol=1e-12,
    )
    for largest in (True, False):
        values, where = top_k(
            test, store, 5, largest=largest, preconditioner=preconditioner, weights=WEIGHTS, batch_size=batch_size
        )
        best = torch.topk(expected, 5, dim=1, largest=largest)
        torch.testing.assert_close(values, best.values, rtol=1e-12, atol=1e-12)
        assert torch.equal(where, best.indices)


@pytest.mark.parametrize("batch_size", [1, 3, M + 1])
def test_query_batches_read_the_store_once_per_batch_and_build_the_gram_once(
    store: FeatureStore, test: dict[str, Tensor], batch_size: int
) -> None:
    batches = math.ceil(M / batch_size)
    for run in (
        lambda s: scores(test, s, preconditioner="gram", chunk=8, batch_size=batch_size),
        lambda s: top_k(test, s, 3, preconditioner="gram", chunk=8, batch_size=batch_size),
    ):
        counting = Counting(store)
        run(counting)
        assert counting.calls == (1 + batches) * len(NAMES)  # the Gram pass, then one pass per batch
        assert sum(counting.sizes) == (1 + batches) * N * len(NAMES)


def test_query_batches_refuse_a_batch_of_no_queries(store: FeatureStore, test: dict[str, Tensor]) -> None:
    for bad in (0, -2):
        with pytest.raises(ScoreArgumentError, match=rf"batch_size={bad}: pass a positive number of queries"):
            scores(test, store, batch_size=bad)
        with pytest.raises(ScoreArgumentError, match=rf"batch_size={bad}: pass a positive number of queries"):
            top_k(test, store, 2, batch_size=bad)
