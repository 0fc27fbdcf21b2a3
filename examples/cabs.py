"""CABS: choose the batch size from the per-sample gradient variance (Balles, Romero & Hennig 2017).

With learning rate lr, loss L and Sigma the covariance of the per-sample gradients, CABS sets

    B = lr * tr(Sigma) / L,

the batch size at which the gradient noise matches the expected decrease. tr(Sigma) is the sum of
the per-parameter variances ``(1/B) sum_i g_i^2 - g^2``, i.e. ``(1/B) sum_i ||g_i||^2 - ||g||^2``;
pergrad computes it in the ordinary backward from the per-sample norms
(``track_statistics={"trace_variance"}``), without building per-sample gradients.
As in the paper, tr(Sigma) and L are smoothed with running averages (0.95) and B is clipped to
[16, 2048]. Early on the gradient is large compared with its noise and B stays small; as the loss
falls the noise dominates and B grows.

Run: python examples/cabs.py [--steps 200] [--lr 2.0] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule

QUICK = {"steps": 120}  # --quick, what the tests run


def main(argv: list[str] | None = None) -> dict[str, list[int]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the teacher, the data, the model and the batches")
    parser.add_argument("--quick", action="store_true", help="120 steps")
    args = parser.parse_args(argv)
    if args.quick:  # the quick settings, under any option given explicitly
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    teacher = torch.randn(10, 4)
    x_all = torch.randn(20000, 10)
    y_all = (x_all @ teacher + 0.5 * torch.randn(20000, 4)).argmax(1)  # noisy labels: the variance stays
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    batch, trace_avg, loss_avg, history = 16, None, None, []
    with PerSampleModule(model, keep_grad_sample=False, track_statistics={"trace_variance"}) as psm:
        for step in range(args.steps):
            idx = torch.randint(0, len(y_all), (batch,))
            optimizer.zero_grad()
            loss = F.cross_entropy(psm(x_all[idx]), y_all[idx])
            loss.backward()
            optimizer.step()
            trace = float(psm.statistics().trace_variance)
            trace_avg = trace if trace_avg is None else 0.95 * trace_avg + 0.05 * trace
            loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
            batch = int(min(max(round(args.lr * trace_avg / loss_avg), 16), 2048))
            history.append(batch)
            if step % 25 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss_avg:.3f}  tr(Sigma) {trace_avg:.3f}  -> batch size {batch}")
    return {"batch_sizes": history}


if __name__ == "__main__":
    main()
