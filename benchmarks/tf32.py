"""How far float32 results are from float64 with cuDNN's TF32 on and off: autograd's own ``.grad`` and pergrad's
Kronecker features (of the whole model and of each layer), against torch.func's float64 per-sample gradients.

PyTorch runs cuDNN convolutions in TF32 by default (``torch.backends.cudnn.allow_tf32``), and pergrad's own
convolutions follow the same setting. Each error is ``max |found - exact| / max |exact|``, after each of
``--steps`` backward passes (the detaching shortcut starts after the first). On the CPU the setting changes nothing.

    python benchmarks/tf32.py --device cuda --json benchmarks/runs/tf32-run.json
    python benchmarks/tf32.py --quick                # CPU, tiny shapes (a test runs this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench  # noqa: E402

DIM, SEED, LAYER_SEED = 512, 0, 1


def errors(workload: str, quick: bool, device: str, tf32: bool, steps: int) -> list[dict[str, Any]]:
    """One row per step: the relative error of plain ``.grad``, of the whole model's features and of each layer's."""
    import torch
    import torch.nn.functional as F

    from pergrad import PerSampleModule

    torch.backends.cudnn.allow_tf32 = tf32
    model, x, y = bench.build(workload, quick)
    model, x, y = model.to(device), x.to(device), y.to(device)
    exact = bench.per_sample_reference64(model, x, y)

    def relative(found: Any, want: Any) -> float:
        return float((found.double() - want).abs().max() / want.abs().max())

    F.cross_entropy(model(x), y).backward()
    plain = max(relative(p.grad, exact[n].mean(0)) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    layers = sorted({n.rsplit(".", 1)[0] for n, _ in model.named_parameters()})
    targets = {"": SEED, **{layer: LAYER_SEED for layer in layers}}
    want = {  # the projection each target computes, of the float64 per-sample gradients under it
        target: bench.pergrad_projectors(model, "kron", DIM, seed)(
            {n: g for n, g in exact.items() if target == "" or n.startswith(target + ".")}
        )
        for target, seed in targets.items()
    }
    rows = []
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        for target, seed in targets.items():
            psm.register_projection(target or model, dim=DIM, kind="kron", seed=seed, grads=False)
        for step in range(steps):
            F.cross_entropy(psm(x), y).backward()
            found = psm.per_sample_projections()
            features = {target or "model": relative(found[target], want[target]) for target in targets}
            rows.append({"workload": workload, "tf32": tf32, "step": step, "plain_grad": plain, "features": features})
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["cnn"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--json", type=Path, help="also save the rows here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for workload in args.workloads:
        for tf32 in (True, False):
            for row in errors(workload, args.quick, args.device, tf32, args.steps):
                rows.append(row)
                layers = " ".join(f"{k}={v:.1e}" for k, v in row["features"].items())
                print(
                    f"{workload} tf32={tf32} step {row['step']}: plain .grad {row['plain_grad']:.1e}; features {layers}"
                )
    if args.json is not None:
        report = {"command": " ".join(["python", "benchmarks/tf32.py", *(sys.argv[1:] if argv is None else argv)])}
        report |= {"device": bench.device_name(args.device, torch.get_num_threads()), "rows": rows}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
