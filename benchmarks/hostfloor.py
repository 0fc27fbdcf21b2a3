"""The least host work a clipped step can do: a floor for ``hostcost.py``'s ratios (issue 41).

pergrad's fused clipping, stripped to what any design must run, on ``hostcost.py``'s ``mlp`` (16 Linear layers,
width 16) or ``gpt`` (12 blocks, its Linear layers clipped; its embeddings trained plainly and its LayerNorms
frozen in every method, plain included), B=4, tiny tensors, float64, one thread; CPU time per step over plain's:

- ``floor``: a forward hook per Linear keeps its input ``a`` and hooks its output to catch ``d``; the weights do
  not require grad (autograd skips their gradient, as pergrad's detached weights do); after the backward
  (of the mean loss: ``d_i`` is ``1/B`` of sample ``i``'s own), ``||g_i||^2 = B^2 sum over layers of
  (sum_st (a_i a_i^T)_st (d_i d_i^T)_st + ||sum_s d_is||^2)`` (``||a_i||^2 ||d_i||^2 + ||d_i||^2`` with one
  position), ``c_i = min(1, C / ||g_i||)``, and per layer ``.grad = (c d)^T a``, ``.bias.grad = sum_i c_i d_i``
  over samples and positions: the clipped mean. No check, no shared input, no other layer type.
- ``floor, arithmetic compiled``: the same, the arithmetic after the backward one ``torch.compile``d function
  of all layers' ``(a, d)`` (inductor): the per-layer kernels fused across layers.
- ``sink``: no hook at all. Each Linear's forward keeps ``a`` as an attribute and adds a zero leaf tensor (the
  *sink*, made before the step) to its output, so ``d`` arrives as the sink's ``.grad``: autograd writes it, no
  Python runs in the backward. Then the floor's arithmetic.
- ``sink, compiled``: the same with the model's forward and the arithmetic compiled: nothing stops Dynamo from
  capturing the whole forward in one graph (the floor's tensor hook would break it at every layer), which is the
  shape a compiled clipped step needs (the goal: <= 1.5x compiled plain).
- ``plain compiled``: plain with the model's forward compiled (``torch.compile(model.forward)``), for scale.

Every method's ``.grad`` is checked against the clipped mean of torch.func's per-sample gradients (float64)
before timing. A step of 16 layers runs about as many kernels after the backward as plain runs in it, so the
eager floor cannot fall far below 2x without fusing them across layers.

    python benchmarks/hostfloor.py                      # the mlp, 16 rounds of 5 steps, about 1 minute
    python benchmarks/hostfloor.py --workload gpt       # about 3 minutes
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


def _linears(model: Any) -> list[Any]:
    from torch import nn

    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _frozen_but_linears(model: Any) -> Any:
    """``model`` with every parameter frozen but its Linears' and Embeddings' (the gpt's LayerNorms: the floor clips
    Linears only; its embeddings are trained plainly, so the first Linear's input requires grad)."""
    from torch import nn

    for m in model.modules():
        if not isinstance(m, nn.Linear | nn.Embedding):
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
    return model


def arithmetic(a: list[Any], d: list[Any]) -> list[tuple[Any, Any]]:
    """The clipped mean's ``(weight, bias)`` gradient per Linear from its ``a`` and ``d`` (module docstring)."""
    import torch

    sq = []
    for a_, d_ in zip(a, d, strict=True):
        if a_.dim() == 2:
            s = d_.square().sum(1)
            sq.append(a_.square().sum(1) * s + s)
        else:
            a3, d3 = a_.flatten(1, -2), d_.flatten(1, -2)
            sq.append((a3 @ a3.mT * (d3 @ d3.mT)).sum((1, 2)) + d3.sum(1).square().sum(1))
    norms = torch.stack(sq).sum(0).sqrt() * a[0].shape[0]
    c = (BOUND / (norms + 1e-12)).clamp(max=1.0)
    out = []
    for a_, d_ in zip(a, d, strict=True):
        cd = (c.view(-1, *[1] * (d_.dim() - 1)) * d_).reshape(-1, d_.shape[-1])
        out.append((cd.T @ a_.reshape(-1, a_.shape[-1]), cd.sum(0)))
    return out


def _write(layers: list[Any], grads: list[tuple[Any, Any]]) -> None:
    for m, (gw, gb) in zip(layers, grads, strict=True):
        m.weight.grad, m.bias.grad = gw, gb


def floor(model: Any, x: Any, y: Any, compiled: bool) -> Callable[[], None]:
    """The floor's step (module docstring); ``compiled``: its arithmetic after the backward compiled."""
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    layers = _linears(model)
    inputs: dict[nn.Module, Tensor] = {}
    grads: dict[nn.Module, Tensor] = {}

    def keep(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        inputs[module] = args[0]
        out.register_hook(lambda d: grads.__setitem__(module, d))

    for m in layers:
        m.weight.requires_grad_(False)
        m.bias.requires_grad_(False)
        m.register_forward_hook(keep)

    run = torch.compile(arithmetic) if compiled else arithmetic
    start = x.detach().requires_grad_(True) if x.is_floating_point() else x  # (every weight of the mlp is frozen)

    def step() -> None:
        F.cross_entropy(model(start), y).backward()
        _write(layers, run([inputs[m] for m in layers], [grads[m] for m in layers]))

    return step


def sink(model: Any, x: Any, y: Any, compiled: bool) -> Callable[[], None]:
    """The sink's step (module docstring); ``compiled``: the model's forward and the arithmetic compiled."""
    import types

    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    layers = _linears(model)
    shapes: dict[nn.Module, torch.Size] = {}
    found = [m.register_forward_hook(lambda m, args, out: shapes.__setitem__(m, out.shape)) for m in layers]
    with torch.no_grad():
        model(x)
    for handle in found:
        handle.remove()

    def forward(self: nn.Linear, a: Tensor) -> Tensor:
        self._a = a
        return F.linear(a, self.weight, self.bias) + self._sink

    for m in layers:
        m.weight.requires_grad_(False)
        m.bias.requires_grad_(False)
        m.forward = types.MethodType(forward, m)
    if compiled:
        model.forward = torch.compile(model.forward)
    run = torch.compile(arithmetic) if compiled else arithmetic

    def step() -> None:
        for m in layers:
            m._sink = torch.zeros(shapes[m], requires_grad=True)
        F.cross_entropy(model(x), y).backward()
        _write(layers, run([m._a for m in layers], [m._sink.grad for m in layers]))

    return step


METHODS: dict[str, tuple[bool, Callable[..., Callable[[], None]] | None, bool]] = {
    # label -> (the model's forward compiled, the step's builder (None: plain's), the builder's ``compiled``)
    "plain": (False, None, False),
    "floor": (False, floor, False),
    "floor, arithmetic compiled": (False, floor, True),
    "sink": (False, sink, False),
    "sink, compiled": (False, sink, True),
    "plain compiled": (True, None, False),
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)  # (the check is exact; the tensors stay tiny either way)
    steps: dict[str, Callable[[], None]] = {}
    reference = None
    for label, (compile_model, builder, compiled) in METHODS.items():
        model, x, y = hostcost.build(args.workload)
        model = _frozen_but_linears(model.double())
        x = x.double() if x.is_floating_point() else x
        clipped = [f"{n}.{k}" for n, m in model.named_modules() if m in _linears(model) for k in ("weight", "bias")]
        if reference is None:
            every = bench.per_sample_reference64(model, x, y)
            reference = bench.clipped_mean({n: every[n] for n in clipped})
        if compile_model:
            model.forward = torch.compile(model.forward)
        step = bench.setup("plain", model, x, y)[0] if builder is None else builder(model, x, y, compiled)
        for _ in range(args.warmup):
            step()
        if builder is not None:
            for name in clipped:
                torch.testing.assert_close(model.get_parameter(name).grad, reference[name], rtol=1e-10, atol=1e-12)
        steps[label] = step
    cpu = hostcost.interleaved(steps, args.rounds, args.steps)[0]
    base, compiled_base = statistics.median(cpu["plain"]), statistics.median(cpu["plain compiled"])
    rows = [
        {
            "method": m,
            "median_cpu_ms": round(statistics.median(t) * 1e3, 3),
            "ratio": round(statistics.median(t) / base, 3),
            "ratio_to_compiled": round(statistics.median(t) / compiled_base, 3),
        }
        for m, t in cpu.items()
    ]
    return {
        **hostcost.header("hostfloor.py", args.argv),
        "workload": args.workload,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="steps per method per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "hostfloor-run.json")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    report = run(args)
    print(f"{args.workload}, median CPU time per step (one thread, {args.rounds} rounds of {args.steps} steps)")
    print("| method | ms | over plain | over plain compiled |\n|---|---|---|---|")
    for row in report["rows"]:
        print(
            f"| {row['method']} | {row['median_cpu_ms']:.3f} | {row['ratio']:.2f}x | {row['ratio_to_compiled']:.2f}x |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
