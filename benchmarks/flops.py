"""Matrix-product floating-point operations of one step, pergrad against the plain backward: the work
each mode adds in matmuls, convolutions and attention (what ``FlopCounterMode`` counts; elementwise
ops and memory traffic are not counted), a measure no machine load can disturb (timings on a shared
2-core machine can).

Counts ``torch.utils.flop_counter.FlopCounterMode`` over one forward and backward (after two warm-up
steps, so weights run detached as they do in training) for every workload of ``bench.py`` given.

    python benchmarks/flops.py                          # gpt2 and bert (bert needs transformers)
    python benchmarks/flops.py --workloads mlp seq --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MODES = ["plain", "materialise", "norms", "clip", "stats", "stats_trace"]


def flops(step: Callable[[], None]) -> dict[str, float]:
    """Total and per-operator GFLOP of one call of ``step`` (after two warm-up calls)."""
    from torch.utils.flop_counter import FlopCounterMode

    step()
    step()
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    per_op = {str(op): n / 1e9 for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return {"total": counter.get_total_flops() / 1e9, **per_op}


def measure(workload: str, quick: bool) -> dict[str, dict[str, float]]:
    import torch.nn.functional as F
    from bench import build, pergrad_for

    model, x, y = build(workload, quick)
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        if mode == "plain":

            def step() -> None:
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()

            out[mode] = flops(step)
            continue
        psm = pergrad_for(model, mode)

        def wrapped(psm: Any = psm, mode: str = mode) -> None:
            psm.zero_grad()
            F.cross_entropy(psm(x), y).backward()
            if mode == "norms":
                psm.per_sample_norms()
            elif mode.startswith("stats"):
                psm.statistics()

        out[mode] = flops(wrapped)
        psm.remove()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "bert"])
    parser.add_argument("--quick", action="store_true", help="the tiny shapes of bench.py --quick")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "flops.json")
    args = parser.parse_args(argv)
    results = {}
    for workload in args.workloads:
        try:
            results[workload] = measure(workload, args.quick)
        except ImportError as err:
            print(f"{workload}: skipped, {err.name} not installed")
    print("| mode | " + " | ".join(f"{w} GFLOP (x plain)" for w in results) + " |")
    print("|---|" + "---|" * len(results))
    for mode in MODES:
        cells = [f"{r[mode]['total']:.1f} ({r[mode]['total'] / r['plain']['total']:.3f}x)" for r in results.values()]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
