"""Bytes on the wire and step time of data-parallel training with pergrad: DDP and FSDP2, plain and
with flat per-sample clipping (``clip_norm`` over the whole model), on CPU processes with gloo.

Every rank runs every method in the same order (the processes start once). Per method: warm-up
steps, one step with every ``torch.distributed`` collective counted (the bytes of the whole tensor
each all-reduce / reduce-scatter reduces or all-gather gathers; DDP's native C++ all-reduce, which
no Python function sees, is counted as the gradients' bytes per synchronised backward), then
``--steps`` timed steps (zero_grad, forward, backward, SGD step); a step's time is the slowest
rank's, and the table shows the median. Two references take the network or the other ranks out:
``local_*`` runs the same step with no communication at all (each rank alone, all at once), and
``allreduce`` all-reduces one flat buffer of the gradients' size (communication alone).

    python benchmarks/distributed.py                       # 2 processes, every workload and method
    python benchmarks/distributed.py --quick               # tiny shapes (the test runs this)
    python benchmarks/distributed.py --from-json benchmarks/runs/distributed-run.json

Nothing here is a test; tests/test_distributed.py checks the byte counts exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

METHODS = [
    "local_plain",
    "local_pergrad",
    "allreduce",
    "ddp_plain",
    "ddp_pergrad",
    "ddp_pergrad_keep",
    "fsdp_plain",
    "fsdp_pergrad",
]
CLIP_NORM = 1.0


def build(workload: str, quick: bool) -> tuple[Any, Any, Any]:
    """``(model, x, y)``, float32, the same model on every rank (seed 0), this rank's batch."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "mlp":
        width, b = (64, 8) if quick else (2048, 32)
        model = nn.Sequential(
            nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )  # fmt: skip
        return model, torch.randn(b, 1024), torch.randint(0, 10, (b,))
    if workload == "seq":  # a token MLP over T positions, like a transformer's feed-forward blocks
        d, t, b, vocab = (16, 8, 4, 100) if quick else (256, 64, 8, 8000)

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

            def forward(self, h: torch.Tensor) -> torch.Tensor:
                return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

        class Seq(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                self.blocks = nn.Sequential(Block(), Block())
                self.head = nn.Linear(d, 10)

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(self.emb(idx)).mean(1))

        return Seq(), torch.randint(0, vocab, (b, t)), torch.randint(0, 10, (b,))
    raise ValueError(workload)


def _shard(model: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in reversed(list(model.modules())):  # every module with parameters of its own, then the root
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_method(workload: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One method on this rank: counted bytes and collectives of one step, step times."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from pergrad import PerSampleModule, transforms
    from tests.reference import counting  # the collectives' bytes, counted as the tests count them

    model, x, y = build(workload, args.quick)
    # this rank's samples: the same shapes on every rank, different values
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = (
        torch.randint(0, int(x.max()) + 1, x.shape, generator=gen)
        if x.dtype == torch.long
        else torch.randn(x.shape, generator=gen)
    )
    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    native_ddp = False
    if method == "allreduce":
        flat = torch.zeros(n_params)

        def step() -> None:
            dist.all_reduce(flat)

        params: list[Any] = []
    else:
        root = model
        if method.startswith("ddp"):
            root = DistributedDataParallel(model)
            native_ddp = method == "ddp_plain"
        elif method.startswith("fsdp"):
            _shard(model)
        run = root
        if "pergrad" in method:
            run = PerSampleModule(root, keep_grad_sample=method.endswith("_keep"))
            run.register_transform(root, transforms.clip_norm(CLIP_NORM))
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()

    for _ in range(args.warmup):
        step()
    with counting() as seen:
        step()
    if native_ddp:  # DDP's reducer all-reduced every bucket in C++
        seen["bytes"] += grad_bytes
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        times.append(float(elapsed))
    return {
        "params": n_params,
        "gradient_bytes": grad_bytes,
        "bytes": seen["bytes"] if method.split("_")[0] != "local" else 0,
        "collectives": "native" if native_ddp else seen["calls"],
        "step_ms": statistics.median(times) * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
    }


def worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, Any]] = {}
    try:
        for workload in args.workloads:
            results[workload] = {}
            for method in args.methods:
                try:
                    results[workload][method] = run_method(workload, method, args)
                except Exception as err:  # the same on every rank: go on with the next
                    results[workload][method] = {"error": f"{type(err).__name__}: {err}"}
                dist.barrier()
        if rank == 0:
            report = {
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "backend": "gloo",
                    "world": world,
                    "threads_per_process": args.threads,
                },
                "command": " ".join(sys.argv),
                "steps": args.steps,
                "date": time.strftime("%Y-%m-%d"),
                "results": results,
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
    finally:
        dist.destroy_process_group()


def table(report: dict[str, Any]) -> str:
    """Markdown: per workload, each method's bytes and step time, and both against plain DDP."""
    lines = []
    for workload, methods in report["results"].items():
        base = methods.get("ddp_plain", {})
        info = next((m for m in methods.values() if "params" in m), {})
        lines.append(
            f"\n{workload}: {info.get('params', 0):,} parameters, {info.get('gradient_bytes', 0):,} bytes of gradients\n"
        )
        lines.append("| method | bytes / step | x ddp_plain | collectives / step | step (median) | x ddp_plain |")
        lines.append("|---|---|---|---|---|---|")
        for method, r in methods.items():
            if "error" in r:
                lines.append(f"| {method} | {r['error']} | | | | |")
                continue
            ratio_b = f"{r['bytes'] / base['bytes']:.2f}x" if base.get("bytes") else "-"
            ratio_t = f"{r['step_ms'] / base['step_ms']:.2f}x" if base.get("step_ms") else "-"
            lines.append(
                f"| {method} | {r['bytes']:,} | {ratio_b} | {r['collectives']} | {r['step_ms']:.1f} ms | {ratio_t} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 steps")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "seq"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "distributed.json")
    parser.add_argument("--from-json", type=Path, help="print the table of a saved run and exit")
    args = parser.parse_args()
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return
    if args.quick:
        args.steps, args.warmup = 3, 1
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "init"), args), nprocs=args.world, join=True)
    report = json.loads(args.out.read_text())
    m = report["machine"]
    print(f"{m['world']} processes, gloo, {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}, {args.steps} steps")
    print(table(report))
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
