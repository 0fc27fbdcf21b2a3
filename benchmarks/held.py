"""What pergrad holds between steps: the bytes its own structures keep alive (buffer pool,
``grad_sample``, kept state; ``tests.reference.held_bytes``) after a few steps of each workload of
``bench.py``, for each mode, next to the analytic ``B x #params x 4`` of ``grad_sample``; and the
bytes of tensors the graph of the last step holds after its backward (a training loop keeps its
``loss`` until the next step's is made), plain autograd's beside them (``plain``: nothing).

    python benchmarks/held.py [--steps 3] [--out benchmarks/runs/held-run.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MODES = ["hooks", "materialise", "clip", "norms", "stats"]


def tensor_bytes() -> int:
    """Bytes of every distinct storage of the tensors alive now."""
    import torch

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F
    from bench import build, pergrad_for

    from tests.reference import held_bytes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "seq", "resnet"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    for workload in args.workloads:
        rows[workload] = {}
        for mode in ["plain", *MODES]:
            model, x, y = build(workload, args.quick)
            psm = model if mode == "plain" else pergrad_for(model, mode)
            for _ in range(args.steps):
                psm.zero_grad()
                loss = F.cross_entropy(psm(x), y)
                loss.backward()
            if mode != "plain":
                rows[workload][mode] = held_bytes(psm) / 2**20
            with_graph = tensor_bytes()
            del loss
            rows[workload][f"{mode} graph"] = (with_graph - tensor_bytes()) / 2**20
            if mode != "plain":
                psm.remove()
        params = sum(p.numel() for p in model.parameters())
        rows[workload]["analytic"] = x.shape[0] * params * torch.finfo(torch.float32).bits / 8 / 2**20
    print(f"| held after {args.steps} steps (MiB) | " + " | ".join(args.workloads) + " |")
    print("|---|" + "---|" * len(args.workloads))
    for key in [*MODES, "analytic"]:
        print(f"| {key} | " + " | ".join(f"{rows[w][key]:.2f}" for w in args.workloads) + " |")
    print("\n| held by the last step's graph after its backward (MiB) | " + " | ".join(args.workloads) + " |")
    print("|---|" + "---|" * len(args.workloads))
    for mode in ["plain", *MODES]:
        print(f"| {mode} | " + " | ".join(f"{rows[w][mode + ' graph']:.2f}" for w in args.workloads) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
