"""The ``pergrad`` command: ``pergrad demo`` (also ``python -m pergrad demo``)."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None


def _finite_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}") from None
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text, "must be a positive integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _limit(text: str) -> int:
    value = _int(text, "must be an integer >= 2")
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (one sample to train on, one to test), got {text}")
    return value


def _seed(text: str) -> int:
    value = _int(text, "must be an integer")
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**63), got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text, "must be a positive number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _finite_float(text, "must be a number >= 0")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _png_problem(png: Path) -> str | None:
    """Why the demo could not save its PNG as ``png``, or None if it can. Run before training:
    creates the folder if it is missing, and writes and removes a file in it."""
    out = png.parent
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create the folder {out}: {err.strerror or err}"
    if png.is_dir():
        return f"{png} is a folder, so the PNG cannot be saved under that name"
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        return f"cannot write in the folder {out}: {err.strerror or err}"
    return None


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="pergrad", description="Per-sample gradients for PyTorch.")
    commands = top.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits: plain SGD vs SGD on per-sample clipped gradients",
        description="Train a small CNN on scikit-learn's handwritten digits twice from the same start -- plain "
        "SGD and SGD on per-sample clipped gradients (DP-SGD's clipping, optional noise), momentum 0.9 -- and "
        "report test accuracy, time per epoch, the percentiles of the per-sample gradient norms ||g_i|| over the "
        "last epoch and the median of the batch sizes the CABS rule suggests over it; saves a PNG.",
    )
    demo.add_argument("--epochs", type=_positive_int, default=6)
    demo.add_argument("--batch-size", type=_positive_int, default=64)
    demo.add_argument("--clip", type=_positive_float, default=1.0, help="clipping bound C on ||g_i||")
    demo.add_argument("--lr", type=_positive_float, default=0.05, help="SGD's learning rate (momentum 0.9)")
    demo.add_argument("--noise", type=_non_negative_float, default=0.0, help="noise multiplier sigma (DP-SGD)")
    demo.add_argument("--out", type=Path, default=Path("pergrad-demo"), help="folder for the PNG")
    demo.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    demo.add_argument("--seed", type=_seed, default=0, help="the split, the initialisation and the batches")
    demo.add_argument("--limit", type=_limit, default=None, help=argparse.SUPPRESS)
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
        import matplotlib  # noqa: F401 -- the demo's extra dependencies: demo.py imports them where
        import sklearn.datasets  # noqa: F401 -- it uses them, after training has started
        import tqdm  # noqa: F401

        from pergrad.cli.demo import PNG_NAME, DemoConfig, Diverged, run
    except ImportError as err:
        print(
            f"pergrad demo needs {err.name}: pip install 'pergrad[demo]' (in a clone of pergrad: "
            "pip install -e '.[demo]')",
            file=sys.stderr,
        )
        return 2
    problem = _png_problem(args.out / PNG_NAME)
    if problem is not None:
        parser().error(f"--out: {problem}")
    cfg = DemoConfig(
        epochs=args.epochs, batch_size=args.batch_size, clip=args.clip, lr=args.lr, noise=args.noise,
        out=args.out, device=str(device), seed=args.seed, limit=args.limit, progress=not args.no_progress,
    )  # fmt: skip
    try:
        _, text, png = run(cfg)
    except Diverged as err:
        print(f"pergrad demo: error: {err}", file=sys.stderr)
        return 2
    print(text)
    print(f"\nsaved {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
