"""Two checkouts of pergrad side by side in one run: is a change slower?

Runs ``bench.py``'s child of each checkout (its own pergrad first on the path) for every workload and
method, alternating the checkouts within each repetition, so slow spells of a shared machine hit both
alike. Prints, per (workload, method), each checkout's median ratio to the plain backward of the same
repetition and checkout, the spread of those ratios (min-max), and the allocated memory; saves JSON.

    python benchmarks/compare.py --before ../old-checkout --after . --reps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def child(root: Path, workload: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        args.python, str(root / "benchmarks" / "bench.py"), "--child", "--workload", workload, "--method", method,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{root} {workload} {method}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of pergrad (the reference)")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="the checkout to compare (default: this one)")
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "seq", "resnet"])
    parser.add_argument(
        "--methods", nargs="+", default=["pergrad_hooks", "pergrad", "pergrad_norms", "pergrad_clip", "pergrad_stats"]
    )
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "compare.json")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    memory: dict[tuple[str, str, str], float] = {}
    for rep in range(args.reps):
        for workload in args.workloads:
            for label, root in trees.items() if rep % 2 == 0 else reversed(trees.items()):
                plain = child(root, workload, "plain", args)
                for method in args.methods:
                    found = child(root, workload, method, args)
                    if not found.get("correct", False):
                        raise RuntimeError(f"{label} {workload} {method}: result differs from torch.func")
                    key = (workload, method, label)
                    ratios.setdefault(key, []).append(found["median_ms"] / plain["median_ms"])
                    memory[key] = (found.get("alloc_extra_mib") or 0.0) - (plain.get("alloc_extra_mib") or 0.0)
                print(f"rep {rep + 1}/{args.reps} {workload} {label} done", file=sys.stderr, flush=True)
    print(f"{args.reps} repetitions x {args.steps} steps, {args.threads} threads; ratio to plain: median (min-max)\n")
    print(
        f"| workload | method | before ({trees['before'].name}) | after ({trees['after'].name}) | after / before "
        "| allocated beyond plain, MiB (before / after) |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for workload in args.workloads:
        for method in args.methods:
            b, a = ratios[(workload, method, "before")], ratios[(workload, method, "after")]
            mb, ma = statistics.median(b), statistics.median(a)
            print(
                f"| {workload} | {method} | {mb:.2f}x ({min(b):.2f}-{max(b):.2f}) | "
                f"{ma:.2f}x ({min(a):.2f}-{max(a):.2f}) | {ma / mb:.2f} | "
                f"{memory[(workload, method, 'before')]:.0f} / {memory[(workload, method, 'after')]:.0f} |"
            )
            rows.append(
                {
                    "workload": workload,
                    "method": method,
                    "before": b,
                    "after": a,
                    "allocated_mib_before": memory[(workload, method, "before")],
                    "allocated_mib_after": memory[(workload, method, "after")],
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
