"""How a convolution's per-sample work is computed, one contraction against another, on the CPU.

Two tables, every row checked (the two ways must agree before either is timed):

- **unfold**: ``pergrad.rules.conv.im2col`` (one copy of a strided view of the padded input) against
  ``F.unfold`` of the same layer, on 1-D and 2-D convolutions with stride, dilation and padding;
- **stem features**: the Kronecker features ``P_row g_i(W) P_col^T`` of one call of a convolution with
  few input channels, as ``conv_project`` computes them now (the unfolded patches), against the
  batch-as-groups weight gradient it used before, beside the layer's own weight gradient (plain
  autograd's cost for the same call).

Times are the least of 5 repeats of the mean over ``--repeat`` calls (nothing else is timed).

    python benchmarks/convpaths.py --threads 2 --json benchmarks/runs/convpaths-run.json
    python benchmarks/convpaths.py --quick          # tiny shapes (CI smoke test)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (channels, spatial size, batch, kernel, stride, dilation, padding, spatial dims)
UNFOLD = [
    (3, 32, 64, 3, 1, 1, 1, 2),
    (32, 16, 64, 3, 1, 1, 1, 2),
    (1, 28, 64, 5, 1, 1, 2, 2),
    (16, 32, 32, 3, 2, 1, 1, 2),
    (8, 32, 32, 3, 1, 2, 2, 2),
    (16, 256, 32, 5, 1, 1, 2, 1),
]
# (input channels, output channels, spatial size, batch), 3x3 kernels, padding 1, k = 512 (16 x 32)
STEMS = [(3, 32, 32, 64), (1, 16, 28, 64), (3, 64, 32, 32), (3, 16, 64, 16)]
QUICK_UNFOLD = [(3, 8, 4, 3, 1, 1, 1, 2), (4, 16, 4, 3, 2, 1, 1, 1)]
QUICK_STEMS = [(3, 8, 8, 4)]


def best_us(fn: Callable[[], Any], repeat: int) -> float:
    """The least of 5 means over ``repeat`` calls of ``fn``, in microseconds."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def unfold_row(shape: tuple[int, ...], repeat: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pergrad.rules.conv import im2col

    channels, size, batch, kernel, stride, dilation, padding, dims = shape
    layer = (nn.Conv1d if dims == 1 else nn.Conv2d)(channels, 8, kernel, stride, padding, dilation)
    a = torch.randn(batch, channels, *([size] * dims))

    def reference() -> torch.Tensor:
        if dims == 1:  # as 2-D with height 1
            return F.unfold(a.unsqueeze(2), (1, kernel), (1, dilation), (0, padding), (1, stride))
        return F.unfold(a, kernel, dilation, padding, stride)

    if not torch.equal(im2col(layer, a), reference()):
        raise SystemExit(f"im2col differs from F.unfold on {tuple(a.shape)}")
    old, new = best_us(reference, repeat), best_us(lambda: im2col(layer, a), repeat)
    return {
        "input": list(a.shape), "kernel": kernel, "stride": stride, "dilation": dilation, "padding": padding,
        "F.unfold_us": round(old, 1), "im2col_us": round(new, 1), "speedup": round(old / new, 2),
    }  # fmt: skip


def stem_row(shape: tuple[int, ...], repeat: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from pergrad.attribution.forms.conv import conv_project
    from pergrad.attribution.projectors import Projector, Spec
    from pergrad.rules.conv import batch_as_groups

    cin, cout, size, batch = shape
    layer = nn.Conv2d(cin, cout, 3, padding=1)
    a, d = torch.randn(batch, cin, size, size), torch.randn(batch, cout, size, size)
    weight = Projector(Spec(512, seed=0), "weight", tuple(layer.weight.shape))
    row, col = weight.factors(d)
    p = row.shape[0]

    def now() -> torch.Tensor:
        total = d.new_zeros(batch, 512)
        conv_project(layer, a, d, {"weight": weight}, total, 1.0)
        return total

    def before() -> torch.Tensor:
        u = torch.matmul(row, d.reshape(batch, cout, -1)).view(batch, p, size, size)
        return torch.bmm(batch_as_groups(layer, a, u).view(batch, p, -1), col.T.expand(batch, -1, -1)).flatten(1)

    def plain() -> torch.Tensor:
        flags = [False, True, False]  # the weight's gradient alone
        return torch.ops.aten.convolution_backward(
            d, a, layer.weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, flags
        )[1]

    if not torch.allclose(now(), before(), rtol=1e-4, atol=1e-3):
        raise SystemExit(f"the stem's features differ between the two ways on {tuple(a.shape)}")
    return {
        "input": list(a.shape), "outputs": cout, "features_now_us": round(best_us(now, repeat), 1),
        "batch_as_groups_us": round(best_us(before, repeat), 1),
        "plain_weight_grad_us": round(best_us(plain, repeat), 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also save the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    repeat = 2 if args.quick else args.repeat
    unfold = [unfold_row(shape, repeat) for shape in (QUICK_UNFOLD if args.quick else UNFOLD)]
    stems = [stem_row(shape, repeat) for shape in (QUICK_STEMS if args.quick else STEMS)]
    print(f"CPU ({platform.machine()}), {args.threads} threads, torch {torch.__version__}")
    print("| input | kernel, stride, dilation, padding | F.unfold | im2col | speedup |")
    print("|---|---|---|---|---|")
    for r in unfold:
        knobs = f"{r['kernel']}, {r['stride']}, {r['dilation']}, {r['padding']}"
        print(f"| {r['input']} | {knobs} | {r['F.unfold_us']:.0f} us | {r['im2col_us']:.0f} us | {r['speedup']:.1f}x |")
    print("\n| stem input -> outputs | features now | by batch-as-groups | plain weight gradient |")
    print("|---|---|---|---|")
    for r in stems:
        print(
            f"| {r['input']} -> {r['outputs']} | {r['features_now_us']:.0f} us | {r['batch_as_groups_us']:.0f} us "
            f"| {r['plain_weight_grad_us']:.0f} us |"
        )
    if args.json is not None:
        saved = {"command": " ".join(["python", "benchmarks/convpaths.py", *(argv or sys.argv[1:])]),
                 "threads": args.threads, "unfold": unfold, "stem_features": stems}  # fmt: skip
        args.json.write_text(json.dumps(saved, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
