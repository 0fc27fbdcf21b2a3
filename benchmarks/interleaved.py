"""Steps of several ``bench.py`` methods interleaved in one process, for a machine shared with other jobs.

Every round runs one step of each method in turn; per method it prints the least disturbed step
(minimum wall time), the median, and the minimum CPU time of the process (``time.process_time``: a
step descheduled by other jobs keeps its CPU time), each as a ratio to the plain backward's. No check:
``bench.py`` checks the same methods.

    python benchmarks/interleaved.py --threads 1 --methods plain pergrad_hooks pergrad_project_kron
    python benchmarks/interleaved.py --workloads seq --rounds 200 --json benchmarks/results/seq.json

``--json`` saves the command, the commit and one row per workload and method (``min_ms``, ``ratio_min``,
``median_ms``, ``min_cpu_ms``, ``ratio_min_cpu``): the rows of ``runs/project-kron-*-run.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "seq"])
    parser.add_argument("--methods", nargs="+", default=["plain", "pergrad_hooks", "pergrad_project_kron"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also save the rows here")
    parser.add_argument("--keep-freed-memory", action="store_true", help="glibc keeps freed memory (bench.py's flag)")
    args = parser.parse_args(argv)
    if args.keep_freed_memory and not bench.keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc's malloc")
    torch.set_num_threads(args.threads)
    methods = ["plain", *[m for m in args.methods if m != "plain"]]
    rows: list[dict[str, Any]] = []
    for w in args.workloads:
        steps = {}
        for m in methods:
            model, x, y = bench.build(w, False)
            steps[m] = bench.setup(m, model, x, y)[0]
            steps[m]()
            steps[m]()
        wall: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for m, step in steps.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                step()
                wall[m].append(time.perf_counter() - start)
                cpu[m].append(time.process_time() - cpu_start)
        plain, plain_cpu = min(wall["plain"]), min(cpu["plain"])
        for m in methods:
            rows.append(
                {
                    "workload": w,
                    "threads": args.threads,
                    "method": m,
                    "min_ms": round(min(wall[m]) * 1e3, 2),
                    "ratio_min": round(min(wall[m]) / plain, 3),
                    "median_ms": round(statistics.median(wall[m]) * 1e3, 2),
                    "min_cpu_ms": round(min(cpu[m]) * 1e3, 2),
                    "ratio_min_cpu": round(min(cpu[m]) / plain_cpu, 3),
                }
            )
            print(
                f"{w} threads={args.threads} {m:22s} min {min(wall[m]) * 1e3:7.1f} ms ({min(wall[m]) / plain:.2f}x)  "
                f"median {statistics.median(wall[m]) * 1e3:7.1f} ms  "
                f"min cpu {min(cpu[m]) * 1e3:7.1f} ms ({min(cpu[m]) / plain_cpu:.2f}x)",
                flush=True,
            )
    if args.json is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
        report = {
            "command": " ".join(["python", "benchmarks/interleaved.py", *(sys.argv[1:] if argv is None else argv)]),
            "commit": commit.stdout.strip() or None,
            "rounds": args.rounds,
            "rows": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
