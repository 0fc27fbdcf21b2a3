"""The demo: plain SGD next to SGD on per-sample clipped gradients, on real handwritten digits.

The data set is scikit-learn's digits (1,797 8x8 images that ship with the package, no download).
Both runs train the same small CNN from the same initialisation and batches (``--seed``), with SGD
(momentum 0.9, learning rate ``--lr``):

- ``plain``: SGD on the batch gradient ``(1/B) sum_i g_i``;
- ``clipped``: SGD on ``(1/B) sum_i clip(g_i)``, ``clip(g) = g * min(1, C / ||g||)`` over the whole
  model (DP-SGD's flat clipping, computed in one backward without per-sample tensors), plus
  Gaussian noise ``N(0, (sigma C / B)^2)`` per coordinate with ``--noise sigma``.

Both wrappers also track per-sample gradient norms and statistics, so the demo reports the
distribution of ``||g_i||`` over the last epoch's samples (percentiles p50, p90, p99, before
clipping) and the median over the last epoch's batches of the batch size the CABS rule suggests
(``lr * tr(Sigma) / loss``, Balles et al. 2017).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, transforms

PNG_NAME = "pergrad-demo.png"
MOMENTUM = 0.9


class Diverged(RuntimeError):
    """A run's loss, parameters or per-sample gradient norms stopped being finite."""


@dataclass
class DemoConfig:
    epochs: int = 6
    batch_size: int = 64
    clip: float = 1.0
    lr: float = 0.05
    noise: float = 0.0
    out: Path = Path("pergrad-demo")
    device: str = "cpu"
    seed: int = 0
    limit: int | None = None  # use only this many samples (quick checks)
    progress: bool = True


@dataclass
class RunResult:
    name: str
    accuracy: list[float] = field(default_factory=list)  # test accuracy after each epoch
    epoch_seconds: list[float] = field(default_factory=list)
    layer_norms: dict[str, list[float]] = field(default_factory=dict)  # ||g_i|| per layer, last epoch
    cabs: list[int] = field(default_factory=list)  # CABS-suggested batch size, last epoch


def load_data(cfg: DemoConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits scaled to [0, 1], shape [N, 1, 8, 8]; a fixed 80/20 train/test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(cfg.seed))
    if cfg.limit is not None:
        order = order[: cfg.limit]
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    dev = torch.device(cfg.device)
    return x[train].to(dev), y[train].to(dev), x[test].to(dev), y[test].to(dev)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def train(cfg: DemoConfig, name: str, data: tuple[torch.Tensor, ...]) -> RunResult:
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = data
    model = make_model(cfg.seed).to(cfg.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=MOMENTUM)
    result = RunResult(name)
    layers = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters()}
    with PerSampleModule(model, keep_grad_sample=False, track_statistics={"trace_variance"}) as psm:
        if name == "clipped":
            psm.register_transform(model, transforms.clip_norm(cfg.clip))
        for epoch in range(cfg.epochs):
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            batches = order.split(cfg.batch_size)
            norms: dict[str, list[torch.Tensor]] = {layer: [] for layer in layers}
            cabs = []
            start = time.perf_counter()
            for idx in tqdm(
                batches, desc=f"{name:8s} epoch {epoch + 1}/{cfg.epochs}", disable=not cfg.progress, leave=False
            ):
                optimizer.zero_grad()
                loss = F.cross_entropy(psm(x_train[idx]), y_train[idx])
                loss_value = loss.item()
                if not math.isfinite(loss_value):
                    raise Diverged(_diverged(cfg, name, epoch, f"the loss is {loss_value}"))
                loss.backward()
                if name == "clipped" and cfg.noise > 0:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.add_(torch.randn_like(p.grad) * (cfg.noise * cfg.clip / len(idx)))
                optimizer.step()
                per_param = psm.per_sample_norms()
                for layer in layers:
                    squares = [v.square() for k, v in per_param.items() if k.rsplit(".", 1)[0] == layer]
                    norms[layer].append(torch.stack(squares).sum(0).sqrt().cpu())
                if len(idx) > 1:
                    cabs.append(psm.statistics().cabs_batch_size(cfg.lr, loss_value))
            result.epoch_seconds.append(time.perf_counter() - start)
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                raise Diverged(_diverged(cfg, name, epoch, "the parameters are not finite"))
            with torch.no_grad():
                result.accuracy.append((model(x_test).argmax(1) == y_test).float().mean().item())
        result.layer_norms = {layer: torch.cat(v).tolist() for layer, v in sorted(norms.items())}
        if not all(math.isfinite(v) for values in result.layer_norms.values() for v in values):
            raise Diverged(_diverged(cfg, name, cfg.epochs - 1, "the per-sample gradient norms are not finite"))
        result.cabs = cabs
    return result


def _diverged(cfg: DemoConfig, name: str, epoch: int, what: str) -> str:
    hint = "--lr or --noise" if name == "clipped" and cfg.noise > 0 else "--lr"
    return f"the {name} run diverged in epoch {epoch + 1}: {what}; try a smaller {hint}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def table(results: list[RunResult]) -> str:
    header = ["run", "test acc", "s/epoch", "||g_i|| p50", "p90", "p99", "CABS batch"]
    rows = []
    for r in results:
        all_norms = [
            math.sqrt(sum(v[i] ** 2 for v in r.layer_norms.values()))
            for i in range(len(next(iter(r.layer_norms.values()))))
        ]
        cabs = sorted(r.cabs)[len(r.cabs) // 2] if r.cabs else float("nan")
        rows.append([
            r.name, f"{r.accuracy[-1]:.3f}", f"{sum(r.epoch_seconds) / len(r.epoch_seconds):.2f}",
            f"{percentile(all_norms, 50):.3f}", f"{percentile(all_norms, 90):.3f}", f"{percentile(all_norms, 99):.3f}", str(cabs),
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)])


def settings(cfg: DemoConfig, train_size: int, test_size: int) -> str:
    """The line under the table: what was run, the seed included."""
    noise = f", noise sigma {cfg.noise:g}" if cfg.noise > 0 else ""
    return (
        f"digits: {train_size} train / {test_size} test, seed {cfg.seed}, {cfg.epochs} epochs of batches of "
        f"{cfg.batch_size}, SGD lr {cfg.lr:g} momentum {MOMENTUM:g}, clip C={cfg.clip:g}{noise}, 1 CPU thread; "
        "||g_i|| over the last epoch's samples, CABS batch the median over its batches"
    )


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(results[0].layer_norms)
    fig, axes = plt.subplots(1, len(layers) + 1, figsize=(3.2 * (len(layers) + 1), 3.2))
    for ax, layer in zip(axes[:-1], layers, strict=True):
        values = [v for r in results for v in r.layer_norms[layer] if v > 0]
        low, high = (min(values), max(values)) if values else (1e-3, 1.0)
        bins = torch.logspace(math.log10(low), math.log10(high * 1.001), 40).tolist()  # norms span decades
        for r in results:
            ax.hist(r.layer_norms[layer], bins=bins, alpha=0.55, label=r.name)
        ax.set_title(f"layer {layer}: ||g_i|| (before clipping)", fontsize=9)
        ax.set_xscale("log")
    axes[0].legend(fontsize=8)
    for r in results:
        axes[-1].plot(range(1, len(r.accuracy) + 1), r.accuracy, marker="o", label=r.name)
    axes[-1].set_title("test accuracy", fontsize=9)
    axes[-1].set_xlabel("epoch")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: DemoConfig) -> tuple[list[RunResult], str, Path]:
    """Train both runs, print the table, save the PNG; returns the results, the table and the PNG path.

    Raises ``Diverged`` when a run's loss, parameters or per-sample gradient norms stop being finite
    (too large a learning rate or noise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's steps are tiny: threads cost more than they give
    try:
        data = load_data(cfg)
        results = [train(cfg, name, data) for name in ("plain", "clipped")]
    finally:
        torch.set_num_threads(threads)
    text = table(results) + "\n\n" + settings(cfg, len(data[1]), len(data[3]))
    cfg.out.mkdir(parents=True, exist_ok=True)
    png = cfg.out / PNG_NAME
    plot(results, png)
    return results, text, png
