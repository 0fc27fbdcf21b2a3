"""TRAK mode's LDS on ``lds.py``'s language model by how a Kronecker projection splits ``k`` into
``r_row x r_col``, averaged over several projection seeds (one run's LDS moves by about 0.01 with the seed).

The ground truth, the 5 checkpoints and the torch.func per-sample margin gradients are ``lds.py --quick``'s
(40 half models); each projection is the matrix ``[P_1 ... P_m]`` of ``pergrad.attribution.projectors`` (version 3:
``kron_ranks``, ranks in the proportion of a weight's sides), the same with version 2's ranks (the larger
rank on the narrower side), or a dense one; the scores are TRAK's ``Phi_z (Phi^T Phi)^{-1} Phi^T`` averaged
over checkpoints, times the mean out-to-loss term. One CPU thread, about a minute per 8 seeds and rule.

    python benchmarks/kron_ranks.py [--seeds 8] [--k 128]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lds as bench

from pergrad.attribution import lds, retrain, subsets
from pergrad.attribution.projectors import Projector, Spec, gaussian, split


def version2_ranks(k: int, rows: int, cols: int) -> tuple[int, int]:
    """``pergrad.attribution.projectors`` version 2: ``split(k)``, the larger rank on the side with fewer entries."""
    small, large = split(k)
    return (large, small) if cols > rows else (small, large)


def matrix(name: str, shape: tuple[int, ...], k: int, seed: int, rule: str) -> Tensor:
    """``P_p`` ``[k, numel]`` float64 of one parameter under ``rule`` ("v3", "v2" or "dense")."""
    projector = Projector(Spec(k, "dense" if rule == "dense" else "kron", seed), name, shape)
    if rule != "v2" or not projector.kron:
        return projector.matrix()
    rows, cols = shape[0], math.prod(shape[1:])
    r_row, r_col = version2_ranks(k, rows, cols)
    row = gaussian(r_row, rows, seed, name, shape, "kron", "row", 0).mul_(1 / math.sqrt(r_row))
    col = gaussian(r_col, cols, seed, name, shape, "kron", "col", 0).mul_(1 / math.sqrt(r_col))
    return torch.kron(row, col)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--models", type=int, default=40)
    parser.add_argument("--checkpoints", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = bench.language_model(True)
    masks = subsets(task.n, args.models, seed=1)

    def train_on(idx: Tensor) -> torch.nn.Module:
        seed = int(idx[:8].sum()) + len(idx)
        model = task.make(seed)
        task.fit(model, idx, seed)
        return model

    outputs = retrain(masks, train_on, task.measure)
    checkpoints = []
    for c in range(args.checkpoints):
        model = task.make(10_000 + c)
        task.fit(model, torch.arange(task.n), 10_000 + c)
        checkpoints.append(model)
    grads = [bench.per_sample_grads(task, m, task.x, task.y, "output") for m in checkpoints]
    grads_test = [bench.per_sample_grads(task, m, task.x_test, task.y_test, "output") for m in checkpoints]
    with torch.no_grad():
        q = torch.stack([task.output(m(task.x), task.y)[1].double() for m in checkpoints]).mean(0)
    shapes = [(name, tuple(p.shape)) for name, p in checkpoints[0].named_parameters()]

    def trak_lds(p_of: Callable[[int], Tensor]) -> float:
        total = torch.zeros(task.x_test.shape[0], task.n, dtype=torch.float64)
        for c, (g, gz) in enumerate(zip(grads, grads_test)):
            p = p_of(c)
            phi, phi_z = g @ p.T, gz @ p.T
            total += phi_z @ torch.linalg.solve(phi.T @ phi, phi.T)
        per_test = lds(total / len(grads) * q, masks, outputs)
        return float(per_test[~per_test.isnan()].mean())

    found: dict[str, list[float]] = {}
    for rule in ("v2", "v3", "dense"):
        found[rule] = [
            trak_lds(
                lambda c, s=s, rule=rule: torch.cat(
                    [matrix(name, shape, args.k, 1000 * s + c, rule) for name, shape in shapes], 1
                )
            )
            for s in range(args.seeds)
        ]
        t = torch.tensor(found[rule])
        print(
            f"{rule:6} k={args.k}: LDS mean {t.mean():.3f}, sd {t.std():.3f} over {args.seeds} projection seeds "
            f"(standard error {t.std() / math.sqrt(args.seeds):.3f})",
            flush=True,
        )
    return found


if __name__ == "__main__":
    main()
