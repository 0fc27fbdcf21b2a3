"""Training-data attribution: find the mislabelled digits by their self-influence.

scikit-learn's digits (8x8, no download), 80% for training with 5% of the training labels flipped to
another class (seeded), 20% held out. A small MLP trains for a few epochs with SGD (plain PyTorch); at
the end of each epoch (a checkpoint), every training sample's projected gradient of its own loss,
``phi_c(i) = P_c vec(g_i)`` (a ``PerSampleModule`` with ``register_projection(model, dim=k,
kind="kron", seed=store.seed(c))``: ``k`` features, ``g_i`` never built, each checkpoint its own
projection), is written into a ``FeatureStore`` on disk, one checkpoint each. Samples are then ranked by
their self-influence::

    TracIn (Pruthi et al. 2020)   sum_c lr_c ||phi_c(i)||^2
    Gram of the loss gradients    sum_c lr_c phi_c(i)^T (Phi_c^T Phi_c + lambda I)^{-1} phi_c(i)

(``Phi_c`` the ``[n, k]`` features of checkpoint ``c``: ``gram(store)``), and the ranking is scored as
a detector of the flipped labels: ROC AUC and precision at k = the number flipped (the fraction of
flipped samples among the top k), against two baselines: each sample's loss at the last checkpoint,
and a random order (AUC 0.5, precision 5%).

The store lives in a temporary directory unless ``--store DIR`` keeps it. A run stopped part-way
(``--stop-after N``: write N batches of features, then stop, as a crash would) is resumed by running
the same command again: training is seeded (the same checkpoints on the same machine and thread
count), and each checkpoint's pass writes only ``store.missing(checkpoint)``, the rows not written and
flushed yet. A store written by another configuration is refused (its spec differs).

Run: python examples/attribution.py [--epochs 5] [--dim 512] [--seed 0] [--seeds 1] [--plot ranking.png]
     [--json record.json] [--store DIR [--stop-after N]] [--quick]
(needs scikit-learn, numpy; matplotlib for --plot: ``pip install -e ".[examples]"``)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution import FeatureStore, gram, self_influence

RANKINGS = ("TracIn self-influence", "loss-gradient Gram self-influence", "loss at the last checkpoint", "random")


@dataclass
class Data:
    x: Tensor  # [n, 64] training pixels in [0, 1]
    y: Tensor  # [n] training labels, 5% of them flipped
    flipped: Tensor  # [n] bool: which training labels were flipped
    x_test: Tensor  # [m, 64] held-out pixels
    y_test: Tensor  # [m] held-out labels (clean)


def make_data(seed: int, flip: float = 0.05, test: float = 0.2) -> Data:
    """The digits shuffled by ``seed``, a fraction ``test`` held out, and ``round(flip * n)`` of the
    training labels moved to another class (uniform over the nine others)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(digits.target), generator=gen)
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16
    y = torch.tensor(digits.target)[order]
    n = len(y) - round(test * len(y))
    y_train = y[:n].clone()
    flipped = torch.zeros(n, dtype=torch.bool)
    flipped[torch.randperm(n, generator=gen)[: round(flip * n)]] = True
    y_train[flipped] = (y_train[flipped] + torch.randint(1, 10, (int(flipped.sum()),), generator=gen)) % 10
    return Data(x[:n], y_train, flipped, x[n:], y[n:])


def mlp(hidden: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def wrap(model: nn.Module, dim: int, seed: int) -> PerSampleModule:
    """The model in a ``PerSampleModule`` that projects every sample's gradient of the whole model
    (``k = dim`` Kronecker features; the projection is regenerated from ``seed``). The loss is the
    batch mean of the samples' own losses (``loss_reduction="mean"``): the features are each sample's
    own loss's gradient, whatever the batch size."""
    psm = PerSampleModule(model, loss_reduction="mean", keep_grad_sample=False)
    psm.register_projection(model, dim=dim, kind="kron", seed=seed)
    return psm


def features(psm: PerSampleModule, x: Tensor, y: Tensor) -> Tensor:
    """``[B, dim]``: ``P vec(grad f_i)``, ``f_i`` sample i's cross-entropy, from one backward (``.grad``
    is cleared again: this is not a training step)."""
    loss = F.cross_entropy(psm(x), y)
    loss.backward()
    psm.module.zero_grad(set_to_none=True)
    return psm.per_sample_projections()[""]


def train_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: Data, batch: int, gen: torch.Generator
) -> None:
    """One epoch of minibatch SGD on the mean cross-entropy, in an order drawn from ``gen`` (plain PyTorch)."""
    for idx in torch.randperm(len(data.y), generator=gen).split(batch):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        optimizer.step()


def detection(score: Tensor, flipped: Tensor) -> dict[str, float]:
    """ROC AUC of ``score`` as a detector of ``flipped``, and precision at k = the number flipped."""
    from sklearn.metrics import roc_auc_score

    k = int(flipped.sum())
    top = torch.argsort(score, descending=True, stable=True)[:k]
    auc = float(roc_auc_score(flipped.numpy(), score.double().numpy()))
    return {"auc": auc, "precision": flipped[top].float().mean().item()}


def found_curve(score: Tensor, flipped: Tensor) -> Tensor:
    """Fraction of the flipped samples among the first j inspected, j = 0..n, highest score first."""
    hits = flipped[torch.argsort(score, descending=True, stable=True)].float()
    return torch.cat([torch.zeros(1), hits.cumsum(0) / hits.sum()])


@dataclass
class Result:
    seed: int
    n_train: int
    n_flipped: int
    epochs: int
    dim: int
    complete: bool  # False when --stop-after stopped the feature passes
    rows_written: int  # feature rows this run wrote (all checkpoints); fewer than n * epochs when resumed
    test_accuracy: float = float("nan")
    detection: dict[str, dict[str, float]] = field(default_factory=dict)  # ranking -> {"auc", "precision"}
    seconds: float = 0.0
    scores: dict[str, Tensor] = field(default_factory=dict, repr=False)  # ranking -> [n] (not in the record)

    def record(self) -> dict[str, object]:
        out = asdict(self)
        del out["scores"]
        return out


@contextlib.contextmanager
def store_dir(path: str | None) -> Iterator[Path]:
    if path is not None:
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="pergrad-attribution-") as tmp:
        yield Path(tmp)


def run(
    seed: int,
    *,
    epochs: int,
    dim: int,
    hidden: int = 64,
    lr: float = 0.3,
    batch: int = 32,
    flip: float = 0.05,
    store: str | None = None,
    stop_after: int | None = None,
    feature_batch: int = 256,
) -> Result:
    """Train, write the features of every checkpoint (resuming ``store`` if it holds some), then rank."""
    start = time.perf_counter()
    data = make_data(seed, flip)
    n = len(data.y)
    torch.manual_seed(seed)
    model = mlp(hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    names = [f"epoch{e + 1}" for e in range(epochs)]
    result = Result(seed, n, int(data.flipped.sum()), epochs, dim, complete=False, rows_written=0)
    description = f"digits MLP 64-{hidden}-{hidden}-10, seed {seed}, flip {flip}, SGD lr {lr} batch {batch}"
    with store_dir(store) as root:
        features_store = FeatureStore.open(
            root, n=n, k=dim, checkpoints=names, model=description, targets=[""], seed=seed, kind="kron"
        )
        with features_store:
            batches = 0
            for name in names:
                train_epoch(model, optimizer, data, batch, gen)
                todo = features_store.missing(name)
                if not len(todo):
                    continue
                # this checkpoint's own projection (seed + 100_000 * c): TRAK's ensemble wants independent ones
                psm = wrap(model, dim, features_store.seed(name))
                for idx in todo.split(feature_batch):
                    if stop_after is not None and batches >= stop_after:
                        psm.remove()
                        result.seconds = time.perf_counter() - start
                        return result  # leaving the `with` flushes what was written: the next run resumes
                    features(psm, data.x[idx], data.y[idx])
                    features_store.write_from(psm, idx, name)  # checks the projection is this checkpoint's
                    result.rows_written += len(idx)
                    batches += 1
                psm.remove()  # the model is a plain nn.Module again
        with torch.no_grad():
            loss = F.cross_entropy(model(data.x), data.y, reduction="none")
            result.test_accuracy = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        weights = [lr] * epochs  # TracIn: each checkpoint weighed by its learning rate
        result.scores = {
            RANKINGS[0]: self_influence(features_store, "identity", weights=weights),
            RANKINGS[1]: self_influence(features_store, gram(features_store), weights=weights),
            RANKINGS[2]: loss,
        }
    result.detection = {name: detection(score, data.flipped) for name, score in result.scores.items()}
    result.detection[RANKINGS[3]] = {"auc": 0.5, "precision": result.n_flipped / n}
    result.complete = True
    result.seconds = time.perf_counter() - start
    return result


def plot(result: Result, flipped: Tensor, path: str) -> None:
    """Fraction of the flipped labels found against the fraction of the training set inspected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = result.n_train
    inspected = torch.arange(n + 1) / n
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, score in result.scores.items():
        d = result.detection[name]
        ax.plot(inspected, found_curve(score, flipped), label=f"{name} (AUC {d['auc']:.3f})")
    ax.plot([0, 1], [0, 1], "k:", label="random (AUC 0.5)")
    ax.axvline(result.n_flipped / n, color="grey", lw=0.5)
    ax.set(xlabel="fraction of the training set inspected", ylabel="fraction of the flipped labels found")
    ax.set_title(f"digits, {result.n_flipped} of {n} labels flipped", fontsize=10)
    ax.set_xlim(0, 0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5, help="epochs; one checkpoint at the end of each")
    parser.add_argument("--dim", type=int, default=512, help="features per sample (r x r or r x 2r)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--flip", type=float, default=0.05, help="fraction of the training labels flipped")
    parser.add_argument("--seed", type=int, default=0, help="first seed (data split, flips, init, order)")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds, from --seed on")
    parser.add_argument("--store", help="keep the feature store in this directory (one per seed); resumes")
    parser.add_argument("--stop-after", type=int, help="write this many batches of features, then stop")
    parser.add_argument("--plot", help="save the ranking curves of the first seed to this image")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="3 epochs, dim 256")
    args = parser.parse_args(argv)
    epochs, dim = (3, 256) if args.quick else (args.epochs, args.dim)
    from tqdm.auto import tqdm

    results = []
    for seed in tqdm(range(args.seed, args.seed + args.seeds), desc="seeds", disable=args.seeds == 1):
        store = None if args.store is None else str(Path(args.store) / f"seed{seed}")
        results.append(
            run(
                seed,
                epochs=epochs,
                dim=dim,
                hidden=args.hidden,
                lr=args.lr,
                batch=args.batch,
                flip=args.flip,
                store=store,
                stop_after=args.stop_after,
            )
        )
    done = [r for r in results if r.complete]
    for r in results:
        if not r.complete:
            print(f"seed {r.seed}: stopped after {r.rows_written} feature rows; run again with --store to resume")
    if done:
        first = done[0]
        print(
            f"digits: {first.n_train} training samples, {first.n_flipped} labels flipped ({args.flip:.0%}); "
            f"MLP 64-{args.hidden}-{args.hidden}-10, SGD lr {args.lr}, {epochs} checkpoints, kron dim {dim}; "
            f"{len(done)} seed(s), mean (min..max)"
        )
        print(f"{'ranking by':36}{'ROC AUC':>24}{f'precision at {first.n_flipped}':>24}")
        for name in RANKINGS:
            cells = []
            for metric in ("auc", "precision"):
                values = [r.detection[name][metric] for r in done]
                cells.append(f"{statistics.mean(values):.3f} ({min(values):.3f}..{max(values):.3f})")
            print(f"{name:36}" + "".join(f"{c:>24}" for c in cells))
        accuracy = statistics.mean(r.test_accuracy for r in done)
        print(f"held-out accuracy {accuracy:.3f}; {statistics.mean(r.seconds for r in done):.1f} s per seed")
        if args.plot:
            plot(first, make_data(first.seed, args.flip).flipped, args.plot)
            print(f"ranking plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.record() for r in results], indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
