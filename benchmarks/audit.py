"""What ``pergrad.privacy.audit.Audit`` costs: one training step (forward, backward, ``check``, optimizer step) of
a small MLP with per-sample clipping (``keep_grad_sample=False``), without an audit, on a step the audit
is not due, on a due step and on the step after a due one; and the mean step at ``every=100`` (98 steps
without an audit, a due one, the one after it) against the step without an audit. Medians over interleaved
repeats (``--device cuda``: on the GPU).

    python benchmarks/audit.py [--batch 64] [--samples 4] [--repeats 30] [--device cpu] [--out benchmarks/runs/audit-run.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pergrad import PerSampleModule, transforms
    from pergrad.privacy.audit import Audit

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples recomputed alone on a due step")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats (a smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    width, batch, repeats = (16, 8, 2) if args.quick else (256, args.batch, args.repeats)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model.to(args.device)
    x, y = torch.randn(batch, 784, device=args.device), torch.randint(0, 10, (batch,), device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(1.0))

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    def step(audit: Audit | None) -> float:
        sync()
        start = time.perf_counter()
        loss_fn(psm, (x, y)).backward()
        if audit is not None:
            audit.check((x, y))
        optimizer.step()
        optimizer.zero_grad()
        sync()
        return time.perf_counter() - start

    def timed(name: str) -> float:
        """One step: without an audit; with one due (made before its forward); the step after a due step (it
        allocates again what the due step held); a step the audit is not due, two steps after a due one."""
        if name == "no audit":
            return step(None)
        with Audit(psm, loss_fn, every=1 if name == "due" else 10**9, samples=args.samples) as audit:
            for _ in range({"due": 0, "after due": 1, "not due": 2}[name]):
                step(audit)
            elapsed = step(audit)
            assert audit.audited == 1
        return elapsed

    names = ["no audit", "not due", "due", "after due"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats + 2):  # interleaved; the first two warm up
        for name in names:
            elapsed = timed(name)
            if repeat >= 2:
                times[name].append(elapsed)
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain = medians["no audit"]
    # a step not due runs a counter more than one without an audit: the two differ by this machine's noise, so
    # the mean over a hundred steps counts 98 steps without an audit
    amortised = (98 * plain + medians["due"] + medians["after due"]) / 100
    report = {
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "device": args.device,
        "model": f"MLP 784-{width}-{width}-10, batch {batch}, float32, clip_norm on the model, keep_grad_sample=False",
        "samples": args.samples,
        "median_ms": {name: 1e3 * m for name, m in medians.items()},
        "relative_to_no_audit": {name: m / plain for name, m in medians.items()},
        "every_100_relative": amortised / plain,
    }
    for name, m in medians.items():
        print(f"{name:>9}: {1e3 * m:8.2f} ms  ({m / plain:.2f}x the step without an audit)")
    print(f"every=100: {amortised / plain:.3f}x the step without an audit, on average")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
