"""Scoring from a feature store in bounded memory: ``pergrad.attribution.top_k`` of test x train features.

A ``FeatureStore`` of ``--train`` random float32 features (``--k`` each) is written to a temporary
directory; then, once per chunk size, a fresh process reads it chunk by chunk and keeps the ``--top``
best train samples of each of ``--test`` test samples. Each process reports its time and its peak
resident memory (``ru_maxrss``: everything the process touched, the store's mapped pages included)
next to what the whole score matrix would take (``test x train x 4`` bytes). Every run is checked: the
top-k of the first ``CHECKED`` test samples equals ``torch.topk`` of their exact scores against every
train sample. Nothing here is a test: tests only run ``--quick`` and assert nothing about time.

    python benchmarks/scoring.py                  # 100k train x 10k test, k=512, chunks 256 1024 4096
    python benchmarks/scoring.py --quick          # 2000 x 200, k=64 (CI smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CHECKED = 64  # test samples whose top-k is checked against their exact scores
WRITE_BLOCK = 8192  # rows written at a time


def features(rows: int, k: int, seed: int, start: int = 0) -> Any:
    """Rows ``start .. start + rows`` of a fixed random feature matrix (float32, a function of ``seed``)."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + start)
    return torch.randn(rows, k, generator=generator)


def write(args: argparse.Namespace) -> dict[str, Any]:
    """The train store: ``--train`` rows of ``--k`` random features, written block by block."""
    from pergrad.attribution import FeatureStore

    start = time.perf_counter()
    with FeatureStore.open(args.store, n=args.train, k=args.k, seed=0, kind="random") as store:
        for first in range(0, args.train, WRITE_BLOCK):
            rows = min(WRITE_BLOCK, args.train - first)
            store.write(range(first, first + rows), features(rows, args.k, seed=1, start=first))
    size = sum(f.stat().st_size for f in Path(args.store).iterdir())
    return {"write_s": time.perf_counter() - start, "store_mib": size / 2**20}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def score(args: argparse.Namespace) -> dict[str, Any]:
    """``top_k`` of the test features against the store with chunk ``--chunk``: time, peak RSS, check."""
    import torch

    from pergrad.attribution import FeatureStore, top_k

    torch.set_num_threads(args.threads)
    test = features(args.test, args.k, seed=2)
    store = FeatureStore.open(args.store, readonly=True)
    before = rss_mib()
    start = time.perf_counter()
    values, where = top_k(test, store, args.top, chunk=args.chunk)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the check: the first CHECKED test samples' exact scores against every train sample
    checked = min(CHECKED, args.test)
    exact = torch.cat([test[:checked] @ block.T for _, block in store.chunks(WRITE_BLOCK)], 1)
    best = exact.topk(args.top, dim=1)
    rows = torch.arange(checked).unsqueeze(1)
    correct = bool(
        torch.equal(where[:checked], best.indices)
        and torch.allclose(values[:checked], best.values, rtol=1e-5, atol=1e-4)
        and torch.allclose(exact[rows, where[:checked]], values[:checked], rtol=1e-5, atol=1e-4)
    )
    return {
        "chunk": args.chunk,
        "seconds": seconds,
        "peak_rss_mib": peak,
        "rss_before_mib": before,
        "peak_beyond_start_mib": peak - before,
        "score_matrix_mib": args.test * args.train * 4 / 2**20,
        "correct": correct,
        "checked_test_samples": checked,
    }


def run_child(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--store", str(args.store),
        "--train", str(args.train), "--test", str(args.test), "--k", str(args.k), "--top", str(args.top),
        "--threads", str(args.threads), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def table(report: dict[str, Any]) -> str:
    out = [
        f"{report['train']} train x {report['test']} test features, k={report['k']} float32, top {report['top']}; "
        f"store {report['store_mib']:.0f} MiB on disk (written in {report['write_s']:.1f} s); "
        f"the whole score matrix would be {report['score_matrix_mib']:.0f} MiB",
        "",
        "| chunk | time (s) | test x train scores / s | peak RSS (MiB) | peak beyond start (MiB) | correct |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "error" in r:
            out.append(f"| {r.get('chunk', '?')} | crash: {r['error']} | | | | |")
            continue
        rate = report["test"] * report["train"] / r["seconds"]
        out.append(
            f"| {r['chunk']} | {r['seconds']:.1f} | {rate:.2e} | {r['peak_rss_mib']:.0f} "
            f"| {r['peak_beyond_start_mib']:.0f} | {r['correct']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2000 train x 200 test, k=64")
    parser.add_argument("--train", type=int, default=100_000)
    parser.add_argument("--test", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "scoring.json")
    parser.add_argument("--from-json", type=Path, help="print the table of a saved run and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(write(args) if args.write else score(args)))
        return 0
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return 0
    if args.quick:
        args.train, args.test, args.k, args.chunks = 2000, 200, 64, [128, 512]
    with tempfile.TemporaryDirectory(prefix="pergrad-scoring-") as tmp:
        args.store = Path(tmp) / "store"
        written = run_child(args, "--write")
        if "error" in written:
            print(f"writing the store failed: {written['error']}")
            return 1
        runs = []
        for chunk in args.chunks:
            r = run_child(args, "--chunk", str(chunk))
            runs.append({"chunk": chunk, **r})
            status = (
                r.get("error") or f"{r['seconds']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, correct={r['correct']}"
            )
            print(f"chunk {chunk}: {status}", flush=True)
    report = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {args.threads} threads, python {platform.python_version()}",
        "command": " ".join(["python", "benchmarks/scoring.py", *(argv if argv is not None else sys.argv[1:])]),
        "train": args.train,
        "test": args.test,
        "k": args.k,
        "top": args.top,
        "score_matrix_mib": args.test * args.train * 4 / 2**20,
        **written,
        "runs": runs,
    }
    print()
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
