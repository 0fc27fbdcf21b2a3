"""The ``pergrad`` command: ``pergrad demo`` (also ``python -m pergrad demo``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="pergrad", description="Per-sample gradients for PyTorch.")
    commands = top.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits: plain SGD vs SGD on per-sample clipped gradients",
        description="Train a small CNN on scikit-learn's handwritten digits twice -- plain SGD and SGD on "
        "per-sample clipped gradients (DP-SGD's clipping, optional noise) -- and report test accuracy, time "
        "per epoch, per-sample gradient norm percentiles and the CABS-suggested batch size; saves a PNG.",
    )
    demo.add_argument("--epochs", type=_positive_int, default=6)
    demo.add_argument("--batch-size", type=_positive_int, default=64)
    demo.add_argument("--clip", type=_positive_float, default=1.0, help="clipping bound C on ||g_i||")
    demo.add_argument("--lr", type=_positive_float, default=0.5)
    demo.add_argument("--noise", type=_non_negative_float, default=0.0, help="noise multiplier sigma (DP-SGD)")
    demo.add_argument("--out", type=Path, default=Path("pergrad-demo"), help="folder for the PNG")
    demo.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--limit", type=_positive_int, default=None, help=argparse.SUPPRESS)
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser().error(f"--device: unknown device {args.device!r} (use cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser().error("--device cuda: no CUDA device is available here (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        parser().error(f"--device: {args.device!r} is not supported by the demo (use cpu or cuda)")
    try:
        from .demo import DemoConfig, run
    except ImportError as err:  # the demo's extra dependencies
        print(f"pergrad demo needs {err.name}: pip install -e '.[demo]'", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        epochs=args.epochs, batch_size=args.batch_size, clip=args.clip, lr=args.lr, noise=args.noise,
        out=args.out, device=str(device), seed=args.seed, limit=args.limit, progress=not args.no_progress,
    )  # fmt: skip
    _, text, png = run(cfg)
    print(text)
    print(f"\nsaved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
