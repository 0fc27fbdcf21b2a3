"""The least host work a hook-based clipped step can do: a floor for ``hostcost.py``'s ratios (issue 41).

pergrad's fused clipping, stripped to what any design built on module hooks must run, on ``hostcost.py``'s
``mlp`` (16 Linear layers, width 16, B=4, tiny tensors, one thread; CPU time per step over plain's):

- ``floor``: a forward hook per layer keeps its input ``a`` and hooks its output to catch ``d``; the weights do
  not require grad (autograd skips their gradient, as pergrad's detached weights do); after the backward
  (of the mean loss: ``d_i`` is ``1/B`` of sample ``i``'s own), ``||g_i|| = B (sum over layers of
  ||a_i||^2 ||d_i||^2 + ||d_i||^2)^(1/2)``, ``c_i = min(1, C / ||g_i||)``, and per layer ``.grad = (c d)^T a``,
  ``.bias.grad = sum_i c_i d_i``: the clipped mean. No check, no shared input, no other layer type.
- ``floor, arithmetic compiled``: the same, the arithmetic after the backward one ``torch.compile``d function
  of all layers' ``(a, d)`` (inductor): the per-layer kernels fused across layers.
- ``plain compiled``: plain with the model's forward compiled (``torch.compile(model.forward)``), for scale.
  (The floor's forward compiled is not a floor: Dynamo breaks the graph at the hook that stores ``d``.)

Every method's ``.grad`` is checked against the clipped mean of torch.func's per-sample gradients (float64)
before timing. The floor's ratio is
what the eager goal (fused clipping <= 2.0x plain) is measured against: a step of 16 layers runs about as
many kernels after the backward as plain runs in it, so it cannot fall far below 2x without fusing them.

    python benchmarks/hostfloor.py                      # 16 rounds of 5 steps, about 1 minute
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import bench  # noqa: E402
import hostcost  # noqa: E402

BOUND = bench.CLIP_NORM


def floor(model: Any, x: Any, y: Any, compiled: bool) -> Callable[[], None]:
    """The floor's step (module docstring); ``compiled``: its arithmetic after the backward compiled."""
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs: dict[nn.Module, Tensor] = {}
    grads: dict[nn.Module, Tensor] = {}

    def keep(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        inputs[module] = args[0]
        out.register_hook(lambda d: grads.__setitem__(module, d))

    for m in layers:
        m.weight.requires_grad_(False)
        m.bias.requires_grad_(False)
        m.register_forward_hook(keep)

    def arithmetic(a: list[Tensor], d: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
        sq = [d_.square().sum(1) for d_ in d]
        norms = torch.stack([a_.square().sum(1) * s + s for a_, s in zip(a, sq, strict=True)]).sum(0).sqrt()
        c = (BOUND / (norms * a[0].shape[0] + 1e-12)).clamp(max=1.0)
        return [((c[:, None] * d_).T @ a_, (c[:, None] * d_).sum(0)) for a_, d_ in zip(a, d, strict=True)]

    run = torch.compile(arithmetic) if compiled else arithmetic
    start = x.detach().requires_grad_(True)  # (the loss must require grad: every weight is frozen)

    def step() -> None:
        F.cross_entropy(model(start), y).backward()
        for m, (gw, gb) in zip(layers, run([inputs[m] for m in layers], [grads[m] for m in layers]), strict=True):
            m.weight.grad, m.bias.grad = gw, gb

    return step


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # (the check is exact; the tensors stay tiny either way)
    steps: dict[str, Callable[[], None]] = {}
    reference = None
    for label, compile_model, kind in [
        ("plain", False, "plain"),
        ("floor", False, "floor"),
        ("floor, arithmetic compiled", False, "floor compiled"),
        ("plain compiled", True, "plain"),
    ]:
        model, x, y = hostcost.build("mlp")
        model = model.double()
        x = x.double()
        if reference is None:
            reference = bench.clipped_mean(bench.per_sample_reference64(model, x, y))
        if compile_model:
            model.forward = torch.compile(model.forward)
        step = bench.setup("plain", model, x, y)[0] if kind == "plain" else floor(model, x, y, kind == "floor compiled")
        for _ in range(args.warmup):
            step()
        if kind != "plain":
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, reference[name], rtol=1e-10, atol=1e-12)
        steps[label] = step
    cpu = hostcost.interleaved(steps, args.rounds, args.steps)[0]
    base = statistics.median(cpu["plain"])
    rows = [
        {
            "method": m,
            "median_cpu_ms": round(statistics.median(t) * 1e3, 3),
            "ratio": round(statistics.median(t) / base, 3),
        }
        for m, t in cpu.items()
    ]
    return {
        **hostcost.header("hostfloor.py", args.argv),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="steps per method per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "hostfloor-run.json")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    report = run(args)
    print(f"mlp, median CPU time per step / plain's (one thread, {args.rounds} rounds of {args.steps} steps)")
    print("| method | ms | ratio |\n|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['method']} | {row['median_cpu_ms']:.3f} | {row['ratio']:.2f}x |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
