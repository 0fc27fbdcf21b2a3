"""Host cost of a training step: the CPU time of Python and the dispatcher, next to plain backward (issue 41).

With tiny tensors the arithmetic costs next to nothing, so a step's CPU time on one thread
(``time.process_time``) is what the host spends on it: what bounds a small or medium model on a GPU.
Every method runs in one process, interleaved: each round runs a few steps of every method in turn,
so a busy spell of a shared machine hits all of them alike; per method it reports the median CPU time
of a step over the rounds and its ratio to the plain backward's. Warm-up steps come first (pergrad's
first backward checks and records, later ones run lean). Methods a peer does not support, or peers
not installed, are skipped with a printed line. Nothing is checked here: ``bench.py`` checks the same
methods against torch.func.

Workloads (B=4, float32): ``gpt``: 12 pre-norm blocks of causal attention and a GELU MLP (d=16, T=8);
``mlp``: 16 Linear layers of width 16 with ReLU; ``cnn``: 6 blocks of 3x3 convolution (8 channels)
and ReLU on 8x8 images; ``hf``: HuggingFace's ``GPT2LMHeadModel`` from a 2-layer config (d=16, T=8),
its logits averaged over positions.

    python benchmarks/hostcost.py --quick          # under 2 minutes
    python benchmarks/hostcost.py --quick --device cuda   # host (CPU) and wall time of the same steps on a GPU
    python benchmarks/hostcost.py --rounds 20 --steps 5 --workloads mlp gpt --methods pergrad_hooks pergrad_clip
    python benchmarks/hostcost.py --compile --workloads mlp gpt cnn   # every model compiled: plain and pergrad
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench  # noqa: E402
import transformer  # noqa: E402

# label -> bench.setup's method
METHODS = {
    "plain": "plain",
    "hooks only": "pergrad_hooks",
    "hooks, lean forwards": "pergrad_hooks_lean",
    "grad_sample": "pergrad",
    "fused norms": "pergrad_norms",
    "fused clip": "pergrad_clip",
    "fused clip, lean forwards": "pergrad_clip_lean",
    "project kron": "pergrad_project_kron",
    "Opacus hooks": "opacus_hooks",
    "Opacus ghost clip": "opacus_ghost_clip",
    "BackPACK": "backpack",
    "torch.func": "torch_func",
}
WORKLOADS = ["gpt", "mlp", "cnn", "hf"]
BATCH = 4
PROJECT_DIM = 16  # Kronecker 4 x 4: the features' arithmetic stays tiny like the rest


def build(workload: str) -> tuple[Any, Any, Any]:
    """``(model, x, y)`` of a workload, tiny tensors, fixed seed; the model maps ``x`` to ``[B, classes]``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "gpt":
        t, vocab = 8, 50
        model = transformer.gpt_stack(16, 2, t, 12, vocab)
        return model, torch.randint(0, vocab, (BATCH, t)), torch.randint(0, 10, (BATCH,))
    if workload == "mlp":
        layers: list[nn.Module] = [nn.Linear(32, 16), nn.ReLU()]
        for _ in range(14):
            layers += [nn.Linear(16, 16), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(16, 10))
        return model, torch.randn(BATCH, 32), torch.randint(0, 10, (BATCH,))
    if workload == "cnn":
        convs: list[nn.Module] = []
        for i in range(6):
            convs += [nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.ReLU()]
        model = nn.Sequential(*convs, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
        return model, torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))
    if workload == "hf":
        import transformers

        config = transformers.GPT2Config(
            vocab_size=50, n_positions=8, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip

        class Hf(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gpt = transformers.GPT2LMHeadModel(config)

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                return self.gpt(idx).logits.mean(1)

        return Hf().eval(), torch.randint(0, 50, (BATCH, 8)), torch.randint(0, 50, (BATCH,))
    raise ValueError(f"unknown workload {workload!r}")


# --compile measures these: the peers' steps are not compiled here
COMPILED = ("plain", "pergrad_hooks", "pergrad", "pergrad_norms", "pergrad_clip")


def prepare(
    method: str, workload: str, warmup: int, device: str = "cpu", compile: bool = False
) -> Callable[[], None] | str:
    """A step of ``method`` on a fresh model of ``workload`` on ``device``, warmed up; or why it cannot run.
    ``compile``: the model's forward compiled (``torch.compile``: inductor, default mode) before the method's setup
    wraps the model, so each step runs its compiled forward and the backward of what Dynamo captured. (Not
    ``model.compile()``: on an ``nn.Sequential`` it compiles nothing in torch 2.13.)"""
    model, x, y = build(workload)
    model, x, y = model.to(device), x.to(device), y.to(device)
    if compile:
        if method not in COMPILED:
            return "not compiled here (--compile measures plain and pergrad)"
        import torch

        model.forward = torch.compile(model.forward)
    try:
        if method.startswith("pergrad_project_"):
            step = bench.setup_projection(method, model, x, y, PROJECT_DIM)[0]
        else:
            step = bench.setup(method, model, x, y)[0]
        for _ in range(warmup):
            step()
    except ImportError as e:
        return f"not installed ({e.name})"
    except Exception as e:  # a peer's own refusal or crash: reported, not measured
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return step


def interleaved(
    steps: dict[str, Callable[[], None]], rounds: int, per_round: int, sync: Callable[[], None] = lambda: None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """CPU and wall time per step of each of ``steps``, one sample per round: each round runs ``per_round`` steps
    of every method in turn, in reverse order every other round (``sync``: waits for a GPU's queued kernels)."""
    cpu: dict[str, list[float]] = {m: [] for m in steps}
    wall: dict[str, list[float]] = {m: [] for m in steps}
    for r in range(rounds):
        order = list(steps.items()) if r % 2 == 0 else list(reversed(steps.items()))
        for label, step in order:
            sync()
            start, started = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                step()
            sync()  # (on a GPU: the wall time includes the kernels the steps queued)
            cpu[label].append((time.process_time() - start) / per_round)
            wall[label].append((time.perf_counter() - started) / per_round)
    return cpu, wall


def header(script: str, argv: list[str]) -> dict[str, Any]:
    """What a saved run of ``benchmarks/<script>`` starts with: its command, commit and machine (one thread)."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return {
        "command": " ".join(["python", f"benchmarks/{script}", *argv]),
        "commit": commit.stdout.strip() or None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds for each workload; returns the report (also printed as a table)."""
    import torch

    warnings.filterwarnings("ignore", message=".*batching rule")  # torch.func on HF's attention: a known fallback
    torch.set_num_threads(1)
    if args.compile:
        # every method's model is an instance of the same class: without guards on module hooks, code Dynamo
        # compiled for plain's model would run the wrapped ones unhooked (pergrad then refuses the backward)
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.config.recompile_limit = 512
        torch._dynamo.config.accumulated_recompile_limit = 4096
    cuda = args.device.startswith("cuda")
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else lambda: None
    labels = [m for m in METHODS if METHODS[m] in args.methods or m == "plain"]
    rows: list[dict[str, Any]] = []
    skipped: dict[str, dict[str, str]] = {}
    for w in args.workloads:
        steps: dict[str, Callable[[], None]] = {}
        for label in labels:
            found = prepare(METHODS[label], w, args.warmup, args.device, args.compile)
            if isinstance(found, str):
                skipped.setdefault(w, {})[label] = found
                print(f"{w}: {label} skipped: {found}", file=sys.stderr, flush=True)
            else:
                steps[label] = found
        cpu, wall = interleaved(steps, args.rounds, args.steps, sync)
        plain, plain_wall = statistics.median(cpu["plain"]), statistics.median(wall["plain"])
        for label in steps:
            med = statistics.median(cpu[label])
            rows.append(
                {
                    "workload": w,
                    "method": label,
                    "bench_method": METHODS[label],
                    "median_cpu_ms": round(med * 1e3, 3),
                    "min_cpu_ms": round(min(cpu[label]) * 1e3, 3),
                    "max_cpu_ms": round(max(cpu[label]) * 1e3, 3),
                    "ratio": round(med / plain, 3),
                    "median_wall_ms": round(statistics.median(wall[label]) * 1e3, 3),
                    "wall_ratio": round(statistics.median(wall[label]) / plain_wall, 3),
                }
            )
        print(f"{w} done", file=sys.stderr, flush=True)
    return {
        **header("hostcost.py", args.argv),
        "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(args.device),
        "batch": BATCH,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup": args.warmup,
        "compiled": args.compile,
        "rows": rows,
        "skipped": skipped,
    }


def table(report: dict[str, Any], time: str = "cpu") -> str:
    """Markdown: one row per workload, one column per method, the median CPU (or wall) time per step / plain's."""
    rows = report["rows"]
    ratio = "ratio" if time == "cpu" else "wall_ratio"
    labels = [m for m in METHODS if any(r["method"] == m for r in rows) and m != "plain"]
    lines = [f"| | plain ({time}, ms) | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for w in dict.fromkeys(r["workload"] for r in rows):
        by = {r["method"]: r for r in rows if r["workload"] == w}
        cells = [f"{by[m][ratio]:.2f}x" if m in by else "-" for m in labels]
        lines.append(f"| {w} | {by['plain'][f'median_{time}_ms']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS.values()), choices=list(METHODS.values()))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps per method per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the tensors live (cuda: CPU time is the host's work, wall time the step's)",
    )
    parser.add_argument("--quick", action="store_true", help="6 rounds of 3 steps (under 2 minutes)")
    parser.add_argument(
        "--compile", action="store_true", help="each model compiled (inductor, default mode): plain and pergrad only"
    )
    parser.add_argument("--json", type=Path, default=HERE / "results" / "hostcost-run.json")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.quick:
        args.rounds, args.steps = 6, 3
    report = run(args)
    compiled = ", every model compiled (inductor)" if args.compile else ""
    print(
        f"median CPU time per step / plain's (one thread, B={BATCH}, {args.rounds} rounds of {args.steps} steps{compiled})"
    )
    print(table(report))
    if args.device != "cpu":
        print(f"median wall time per step / plain's on {report['device']} (kernels included)")
        print(table(report, "wall"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
