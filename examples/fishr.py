"""Fishr (Rame et al. 2022): match the per-sample gradient variances of the training domains.

Fishr ("Invariant Gradient Variances for Out-of-Distribution Generalization", ICML 2022) trains on
several domains and penalises, for the classifier head's parameters, how far each domain's
elementwise variance of the per-sample gradients is from their mean over domains:

    penalty = sum_e || v_e - mean_e' v_e' ||^2,    v_e = (1/n_e) sum_{i in e} (g_i - gbar_e)^2

``g_i`` the gradient of sample i's own loss with respect to the head's weight and bias, ``gbar_e``
their mean over domain e. Training minimises ``(1/n) sum_i f_i + lam * penalty``. pergrad gives the
``g_i`` (``head.weight.grad_sample``) in the ordinary backward; with ``backward(create_graph=True)``
they carry a graph, so the penalty is differentiated through them -- with respect to the head AND
to the layers below, whose features the head's gradients are made of.

The data: scikit-learn's digits (8x8, no download), the task "digit >= 5?" with 25% of the labels
flipped, so the digit's shape predicts the label at most 75% of the time. A spurious feature -- a
bright 2x2 patch in the top-left corner, where digits have no ink -- marks the label too: it is
there exactly when the (noisy) label is 1, except in a fraction ``flip`` of the samples: 0.05 in
training domain A and 0.3 in domain B (it predicts 95% and 70%, 82.5% over both: better than the
shape), and 0.9 in the test domain (reversed). A model that reads only the patch is right 82.5% of
the time in training and 10% in the test domain; one that reads only the shape, 75% everywhere.
(The Colored-MNIST construction of Arjovsky et al. 2019, on the digits, with a patch for the colour.)

The same MLP trains from the same start, full batch with Adam and weight decay: ERM (the mean
loss), and Fishr (ERM for ``--warmup`` steps, then the mean loss plus ``lam`` times the penalty,
Adam restarted as the authors do). A third row is the reference: ERM on training domains whose
patch is random (flip 0.5), so the shape is all there is to learn -- what an invariant model of this
size reaches on the test domain. The table gives each domain's accuracy and the final penalty,
mean and standard deviation over ``--seeds`` seeds (each seed draws its own split, noise, patches
and start).

Run: python examples/fishr.py [--epochs 300] [--warmup 100] [--lam 1000] [--seeds 5] [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule

DOMAINS = ("train A", "train B", "test")
FLIPS = (0.05, 0.3, 0.9)  # how often the patch disagrees with the label, per domain


@dataclass
class Domain:
    x: Tensor  # [n, 64] pixels in [0, 1]
    y: Tensor  # [n] 0/1 (noisy) labels, float


def make_domains(seed: int, noise: float = 0.25, flips: tuple[float, ...] = FLIPS) -> list[Domain]:
    """The digits shuffled by ``seed`` and cut into ``len(flips)`` domains of equal size."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(digits.target), generator=gen)
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16
    label = torch.tensor(digits.target)[order] >= 5
    label ^= torch.rand(len(label), generator=gen) < noise
    domains = []
    parts = zip(x.tensor_split(len(flips)), label.tensor_split(len(flips)), flips, strict=True)
    for part, y, flip in parts:
        pixels = part.clone().view(-1, 8, 8)
        patch = y ^ (torch.rand(len(y), generator=gen) < flip)
        pixels[patch, :2, :2] = 1.0
        domains.append(Domain(pixels.flatten(1), y.float()))
    return domains


class Net(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x)).squeeze(1)


def fishr_penalty(grads: Tensor, sizes: list[int]) -> Tensor:
    """``sum_e ||v_e - mean_e' v_e'||^2`` of per-sample gradients ``grads`` [n, P] whose rows are the
    domains' samples one domain after the other, ``sizes`` of them; ``v_e`` the elementwise (biased,
    1/n_e) variance over domain e's rows."""
    variances = torch.stack([g.var(0, correction=0) for g in grads.split(sizes)])
    return (variances - variances.mean(0)).square().sum()


def head_grads(model: Net) -> Tensor:
    """The head's per-sample gradients, weight and bias side by side: [n, P]."""
    return torch.cat([p.grad_sample.flatten(1) for p in model.head.parameters()], 1)  # type: ignore[attr-defined]


def step(model: Net, domains: list[Domain], lam: float) -> tuple[float, float]:
    """Leave in ``.grad`` the gradient of ``(1/n) sum_i f_i + lam * penalty`` over the training
    ``domains``, the model's head wrapped by a ``PerSampleModule``; return the loss and the penalty.

    ``loss.backward(create_graph=True)`` writes the loss gradient into ``.grad`` and the head's
    per-sample gradients, both with a graph. The penalty's gradient is taken with
    ``torch.autograd.grad``, which leaves ``.grad`` alone, and added to the loss gradient's value,
    detached: the loss gradient is counted once, and the graph ``.grad`` held (a reference cycle
    parameter -> .grad -> graph -> parameter) is dropped. With ``lam=0`` a plain backward.
    """
    x, y = torch.cat([d.x for d in domains]), torch.cat([d.y for d in domains])
    sizes = [len(d.y) for d in domains]
    loss = F.binary_cross_entropy_with_logits(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if lam == 0:
        loss.backward()
        with torch.no_grad():
            return loss.item(), fishr_penalty(head_grads(model), sizes).item()
    with warnings.catch_warnings():
        # torch warns that .grad with a graph makes a reference cycle; the loop below replaces it by its value
        warnings.filterwarnings("ignore", message=r"Using backward\(\) with create_graph=True", category=UserWarning)
        loss.backward(create_graph=True)
    penalty = fishr_penalty(head_grads(model), sizes)
    extra = torch.autograd.grad(lam * penalty, params)
    for p, g in zip(params, extra):
        p.grad = p.grad.detach() + g  # type: ignore[union-attr]
    return loss.item(), penalty.item()


def accuracy(model: Net, domain: Domain) -> float:
    with torch.no_grad():
        return ((model(domain.x) > 0).float() == domain.y).float().mean().item()


def train(
    domains: list[Domain], seed: int, *, steps: int, warmup: int, lam: float, lr: float, l2: float, hidden: int = 64
) -> Net:
    """Full-batch Adam on the training ``domains``: ERM (plain PyTorch) for ``warmup`` steps, or all
    of them if ``lam=0``, then Fishr with pergrad on the head."""
    torch.manual_seed(seed)
    model = Net(hidden)
    x, y = torch.cat([d.x for d in domains]), torch.cat([d.y for d in domains])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=l2)
    for _ in range(steps if lam == 0 else warmup):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        optimizer.step()
    if lam == 0:
        return model
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=l2)  # the objective changed scale
    with PerSampleModule(model.head):  # only the head's per-sample gradients are needed
        for _ in range(steps - warmup):
            step(model, domains, lam)
            optimizer.step()
    return model


def measure(model: Net, domains: list[Domain]) -> dict[str, float]:
    """Accuracy on every domain, and the penalty over the training domains (all but the last)."""
    result = {name: accuracy(model, d) for name, d in zip(DOMAINS, domains)}
    with PerSampleModule(model.head):
        result["penalty"] = step(model, domains[:-1], 0.0)[1]
    for p in model.parameters():
        p.grad = None
    return result


@dataclass
class Run:
    method: str
    seed: int
    model: Net
    metrics: dict[str, float]  # accuracy per domain, penalty over the training domains


METHODS = ("ERM", "Fishr", "ERM, patch random")


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=300, help="full-batch steps")
    parser.add_argument("--warmup", type=int, default=100, help="Fishr's first steps, without the penalty")
    parser.add_argument("--lam", type=float, default=1000.0, help="weight of the penalty")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--l2", type=float, default=1e-2, help="Adam's weight decay")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 seeds")
    args = parser.parse_args(argv)
    seeds = 3 if args.quick else args.seeds
    runs = []
    for seed in range(seeds):
        for method in METHODS:
            domains = make_domains(seed, flips=(0.5, 0.5, FLIPS[-1]) if method == "ERM, patch random" else FLIPS)
            lam = args.lam if method == "Fishr" else 0.0
            model = train(domains[:2], seed, steps=args.epochs, warmup=args.warmup, lam=lam, lr=args.lr, l2=args.l2)
            runs.append(Run(method, seed, model, measure(model, domains)))
    print(
        f"digits >= 5, 25% of labels flipped, patch disagreeing with the label {FLIPS} (train A, train B, test); "
        f"{args.epochs} steps, Fishr lam={args.lam:g} after {args.warmup}; {seeds} seeds, mean ± std"
    )
    columns = (*DOMAINS, "penalty")
    print(f"{'method':18}" + "".join(f"{c:>20}" for c in columns))
    for method in METHODS:
        cells = []
        for c in columns:
            values = [r.metrics[c] for r in runs if r.method == method]
            mean, spread = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else math.nan
            cells.append(f"{mean:.2e} ± {spread:.1e}" if c == "penalty" else f"{mean:.3f} ± {spread:.3f}")
        print(f"{method:18}" + "".join(f"{c:>20}" for c in cells))
    return runs


if __name__ == "__main__":
    main()
