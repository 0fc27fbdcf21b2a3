"""Memory over many steps of changing shapes, and speed for constant shapes (issue 12).

Memory rows: a training loop whose shapes change every step, run for ``--steps`` steps. After every
step it reads the bytes pergrad's own structures keep alive (``tests.reference.held_bytes``: the
buffer pool, ``grad_sample``, kept state) and the process's RSS. It reports both after the first
step, their peak and their final value, and the peak against what a fresh wrapper holds after ONE
step of the largest shape the run saw ("one step's worth": the more of its first step, whose check
runs every weight attached, and a later one, with weights detached and pergrad's zero anchors). The plain loop (no pergrad) gives the
RSS a training loop with these shapes reaches anyway (allocator fragmentation).

- ``poisson_mlp``: DP-SGD on Linear(784,512)-ReLU-Linear(512,512)-ReLU-Linear(512,10): Poisson
  sampling (each of 60,000 examples joins a batch with probability 256/60,000, so the batch size
  changes every step), root ``clip_norm(1.0)``, SGD; ``grad_sample`` materialised (the defaults).
- ``poisson_mlp_fused``: the same with ``keep_grad_sample=False``.
- ``lengths_seq``: Embedding(5000,256)-Linear(256,1024)-GELU-Linear(1024,256), B=32, every batch
  padded to its longest sequence (T drawn from 16..112 each step, padding labelled -100), each
  sample's loss the sum over its tokens, fused root ``clip_norm(1.0)``, SGD.
- ``lengths_seq_materialised``: the same with ``grad_sample`` materialised.

Speed rows: the same models with constant shapes (batch 256; T=64), the median of ``--timed``
steps after 3 warm-up steps. With ``--baseline DIR`` (a checkout of an earlier pergrad) every row
also runs on that code, interleaved round by round, and the ratio is the median of per-round ratios.
Every row runs in its own subprocess. Nothing here is a test; tests run ``--quick`` only.

    python benchmarks/memory.py --out benchmarks/runs/memory-run.json
    python benchmarks/memory.py --baseline /tmp/pergrad-main    # + the same rows on older code
    python benchmarks/memory.py --quick                          # tiny shapes, a few steps (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# row -> (model, keep_grad_sample); keep_grad_sample None: the plain loop, without pergrad
ROWS: dict[str, tuple[str, bool | None]] = {
    "poisson_mlp": ("mlp", True),
    "poisson_mlp_fused": ("mlp", False),
    "lengths_seq": ("seq", False),
    "lengths_seq_materialised": ("seq", True),
    "plain_poisson_mlp": ("mlp", None),
    "plain_lengths_seq": ("seq", None),
    # constant shapes, timed
    "mlp": ("mlp", True),
    "mlp_fused": ("mlp", False),
    "seq_fused": ("seq", False),
    "seq": ("seq", True),
}
MEMORY_ROWS = ["poisson_mlp", "poisson_mlp_fused", "lengths_seq", "lengths_seq_materialised"]
SPEED_ROWS = ["mlp", "mlp_fused", "seq_fused", "seq"]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- workloads (run in a child) ----------------------------------------------------------------------


def mlp_workload(quick: bool, constant: bool) -> tuple[Any, Any, Any]:
    """``(model, batches, loss)``; ``batches(size)`` draws a batch of ``size`` samples, by default a
    Poisson-sampled number of them (256 with ``constant``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    width, dataset, expected = (32, 2000, 16) if quick else (512, 60000, 256)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    gen = torch.Generator().manual_seed(1)
    sampler = torch.distributions.Binomial(dataset, torch.tensor(expected / dataset))

    def batches(size: int | None = None) -> tuple[Any, Any]:
        b = size if size is not None else expected if constant else int(sampler.sample())
        return torch.randn(b, 784, generator=gen), torch.randint(0, 10, (b,), generator=gen)

    def loss(out: Any, y: Any) -> Any:
        return F.cross_entropy(out, y, reduction="sum") / max(len(y), 1)

    return model, batches, loss


def seq_workload(quick: bool, constant: bool) -> tuple[Any, Any, Any]:
    """``(model, batches, loss)``; ``batches(size)`` draws a batch padded to length ``size``, by
    default a random one (the middle one with ``constant``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    vocab, dim, hidden, batch, (lo, hi) = (50, 16, 32, 4, (4, 12)) if quick else (5000, 256, 1024, 32, (16, 112))

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, dim, padding_idx=0)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.down(F.gelu(self.up(self.emb(idx))))  # [B, T, dim]: logits over dim classes

    torch.manual_seed(0)
    model = Seq()
    gen = torch.Generator().manual_seed(1)

    def batches(size: int | None = None) -> tuple[Any, Any]:
        t = (
            size
            if size is not None
            else (lo + hi) // 2
            if constant
            else int(torch.randint(lo, hi + 1, (1,), generator=gen))
        )
        lengths = torch.randint(t // 2, t + 1, (batch,), generator=gen)
        lengths[0] = t  # padded to the longest
        pad = torch.arange(t) >= lengths.unsqueeze(1)
        idx = torch.randint(1, vocab, (batch, t), generator=gen).masked_fill(pad, 0)
        labels = torch.randint(0, dim, (batch, t), generator=gen).masked_fill(pad, -100)
        return idx, labels

    def loss(out: Any, labels: Any) -> Any:  # the mean over samples of each sample's sum over its tokens
        tokens = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return tokens / labels.shape[0]

    return model, batches, loss


def child(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, args.pergrad)  # the pergrad under test (this checkout or --baseline)
    sys.path.insert(1, str(ROOT))  # tests.reference
    import torch

    import pergrad
    from pergrad import PerSampleModule, transforms
    from tests.reference import held_bytes

    torch.set_num_threads(args.threads)
    constant = args.row in SPEED_ROWS
    kind, keep = ROWS[args.row]
    build = mlp_workload if kind == "mlp" else seq_workload
    model, batches, loss = build(args.quick, constant)
    psm = None
    if keep is not None:
        psm = PerSampleModule(model, keep_grad_sample=keep)
        psm.register_transform(model, transforms.clip_norm(1.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start_rss = rss_mib()

    def step(x: Any, y: Any) -> None:
        opt.zero_grad()
        loss((psm or model)(x), y).backward()

    if constant:
        return timed(args, build, keep, (psm, loss), batches(), pergrad.__file__)
    held, rss, shapes = [], [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = batches()
        step(x, y)
        opt.step()
        held.append(held_bytes(psm) if psm is not None else 0)
        rss.append(rss_mib())
        shapes.append(list(x.shape))
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    result = {
        "steps": args.steps,
        "ms_per_step": ms,
        "held_mib": [h / 2**20 for h in held],
        "rss_mib": rss,
        "rss_before_mib": start_rss,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "shapes": shapes,
        "pergrad": pergrad.__file__,
    }
    if psm is not None:  # one step's worth: a fresh wrapper after a step of the largest shape seen
        psm.remove()
        del psm
        largest = max(s[0] if kind == "mlp" else s[1] for s in shapes)  # the batch size; the length
        fresh_model, _, _ = build(args.quick, constant)
        fresh = PerSampleModule(fresh_model, keep_grad_sample=keep)
        fresh.register_transform(fresh_model, transforms.clip_norm(1.0))
        x, y = batches(largest)
        held_after = []  # after the first backward (its check runs every weight attached) and a later one
        for _ in range(2):
            fresh.zero_grad()
            loss(fresh(x), y).backward()
            held_after.append(held_bytes(fresh))
        result["one_step_mib"] = max(held_after) / 2**20
        result["largest"] = largest
    return result


def load_baseline(directory: str) -> Any:
    """The ``pergrad`` package of another checkout, imported as ``pergrad_baseline`` (it imports
    itself only relatively), so both run in one process on the same machine state."""
    import importlib.util

    init = Path(directory) / "pergrad" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "pergrad_baseline", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pergrad_baseline"] = module
    spec.loader.exec_module(module)
    return module


def timed(
    args: argparse.Namespace, build: Any, keep: bool, current: tuple[Any, Any], batch: tuple[Any, Any], where: str
) -> dict[str, Any]:
    """Step times for one constant batch; with ``--baseline``, a second copy of the model wrapped by
    the baseline's pergrad steps in turn with this one (ABBA order), so both see the same load."""
    import torch

    runs = {"current": current}
    if args.baseline:
        base = load_baseline(args.baseline)
        other, _, other_loss = build(args.quick, True)
        wrapped = base.PerSampleModule(other, keep_grad_sample=keep)
        wrapped.register_transform(other, base.transforms.clip_norm(1.0))
        runs["baseline"] = (wrapped, other_loss)
    x, y = batch
    times: dict[str, list[float]] = {code: [] for code in runs}
    for i in range(3 + args.timed):
        for code in list(runs) if i % 2 == 0 else list(reversed(runs)):
            psm, loss = runs[code]
            psm.zero_grad()
            start = time.perf_counter()
            loss(psm(x), y).backward()
            if i >= 3:
                times[code].append(time.perf_counter() - start)
    out: dict[str, Any] = {f"{code}_ms": statistics.median(t) * 1e3 for code, t in times.items()}
    if args.baseline:
        out["ratio"] = statistics.median(c / b for c, b in zip(times["current"], times["baseline"]))
    return out | {"pergrad": where, "torch_threads": torch.get_num_threads()}


def run_child(args: argparse.Namespace, row: str, pergrad_dir: str, steps: int) -> dict[str, Any]:
    cmd = [
        args.python, str(Path(__file__).resolve()), "--child", "--row", row, "--pergrad", pergrad_dir,
        "--steps", str(steps), "--timed", str(args.timed), "--threads", str(args.threads),
    ]  # fmt: skip
    if args.baseline and steps == 0:  # a speed row times both codes in one process
        cmd += ["--baseline", str(Path(args.baseline).resolve())]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


# -- report ------------------------------------------------------------------------------------------


def _size(mib: float) -> str:
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB" if mib >= 0.1 else f"{mib * 1024:.1f} KiB"


def memory_line(row: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {row} | error: {r['error']} |"
    held, rss = r["held_mib"], r["rss_mib"]
    peak_step = max(range(len(held)), key=held.__getitem__) + 1
    one = r.get("one_step_mib")
    cells = [
        row,
        str(r["steps"]),
        f"{_size(held[0])} / {_size(max(held))} (step {peak_step}) / {_size(held[-1])}" if one is not None else "-",
        f"{_size(one)} ({max(held) / one:.2f}x)" if one is not None else "-",
        f"{rss[0]:.0f} / {max(rss):.0f} / {rss[-1]:.0f} ({rss[-1] / rss[0]:.2f}x)",
        f"{r['ms_per_step']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def report(results: dict[str, Any]) -> str:
    out = [
        "| row | steps | pergrad holds: step 1 / peak / final | one step of the largest shape (peak/it) "
        "| RSS MiB: step 1 / peak / final (final/first) | ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for code, rows in results["memory"].items():
        for row, r in rows.items():
            out.append(memory_line(row if code == "current" else f"{row} ({code})", r))
    speed = results.get("speed")
    if speed:
        base = bool(speed["baseline"])
        out += [
            "",
            "| constant shapes | ms/step |" + " baseline ms/step | ratio |" * base,
            "|---|---|" + "---|---|" * base,
        ]
        for row, r in speed["rows"].items():
            line = f"| {row} | {r['current_ms']:.1f} |"
            if speed["baseline"]:
                line += f" {r['baseline_ms']:.1f} | {r['ratio']:.2f}x |"
            out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 12 steps, one speed round")
    parser.add_argument("--steps", type=int, default=None, help="steps of every memory row (200; quick 12)")
    parser.add_argument("--rows", nargs="*", default=MEMORY_ROWS, help=f"memory rows, of {MEMORY_ROWS}")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain loops")
    parser.add_argument("--speed", nargs="*", default=SPEED_ROWS, help=f"speed rows, of {SPEED_ROWS}")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved speed rounds (5; quick 1)")
    parser.add_argument("--timed", type=int, default=None, help="timed steps per speed run (15; quick 2)")
    parser.add_argument("--baseline", help="a checkout of older pergrad to run the same rows on")
    parser.add_argument("--baseline-steps", type=int, default=20, help="its memory rows' steps (it may grow)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "memory.json")
    parser.add_argument("--from-json", type=Path, help="print the tables of a saved run and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--pergrad", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 12 if args.quick else 200
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.timed is None:
        args.timed = 2 if args.quick else 15
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.from_json:
        print(report(json.loads(args.from_json.read_text())))
        return 0
    codes = {"current": str(ROOT)} | ({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "memory": {},
    }
    for code, where in codes.items():
        steps = args.steps if code == "current" else min(args.steps, args.baseline_steps)
        plain = [] if args.no_plain or code != "current" else [f"plain_{r}" for r in args.rows if f"plain_{r}" in ROWS]
        rows = [*args.rows, *plain]
        results["memory"][code] = {}
        for row in rows:
            print(f"{code}: {row} ({steps} steps)", file=sys.stderr, flush=True)
            results["memory"][code][row] = run_child(args, row, where, steps)
    if args.speed:
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in args.speed}
        for i in range(args.rounds):
            for row in args.speed:
                print(f"speed round {i + 1}: {row}", file=sys.stderr, flush=True)
                runs[row].append(run_child(args, row, str(ROOT), 0))
        speed: dict[str, Any] = {"baseline": args.baseline, "rounds": args.rounds, "rows": {}}
        for row, rounds in runs.items():
            ok = [r for r in rounds if "error" not in r] or [{"current_ms": float("nan")}]
            entry = {
                key: statistics.median(r[key] for r in ok) for key in ok[0] if key.endswith("_ms") or key == "ratio"
            }
            speed["rows"][row] = entry | {"rounds": rounds}
        results["speed"] = speed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
