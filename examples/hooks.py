"""PyTorch's module backward hooks on a two-layer example small enough to check by hand.

The model is ``block -> head`` with ``block = Linear(1, 1)`` (weight 2, bias 0) inside a
``Sequential`` and ``head = Linear(1, 1)`` (weight 3, bias 0); the loss is ``sum_i out_i`` over a
batch ``x = [1, 2]``. By hand, for every sample:

    d loss / d out        = 1                        (head's grad_output)
    d loss / d h          = 3                        (head's grad_input = block's grad_output)
    d loss / d x          = 3 * 2 = 6                (block's grad_input)
    d loss / d head.w     = h_i = 2 x_i              -> per sample [2, 4]
    d loss / d block.w    = 3 * x_i                  -> per sample [3, 6]

- ``register_full_backward_hook(hook)`` sees ``grad_input`` (gradients w.r.t. the module's inputs)
  and ``grad_output`` (w.r.t. its outputs) of the whole module, however many ops it runs. Returning
  a new ``grad_input`` replaces what flows further back: it changes the gradients of everything
  BEFORE the module, never the module's own parameter gradients.
- ``register_backward_hook`` (legacy, deprecated) is attached to the last autograd node of the
  module, so for a Linear its "grad_input" is that node's inputs' gradients (bias, input, weight;
  summed over the batch here: [6, 12, 9]), not the module's input: easy to misread.
- pergrad catches each layer's output gradient after every hook has run, so its per-sample
  gradients are what autograd itself propagates, hooks included.

Run: python examples/hooks.py [--quick]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

from pergrad import PerSampleModule


def build() -> nn.Sequential:
    block, head = nn.Sequential(nn.Linear(1, 1)), nn.Linear(1, 1)
    with torch.no_grad():
        block[0].weight.fill_(2.0), block[0].bias.zero_(), head.weight.fill_(3.0), head.bias.zero_()
    return nn.Sequential(block, head)


def run(rescale_head_input: float | None) -> dict[str, list[float]]:
    model = build()
    seen: dict[str, list[float]] = {}

    def full(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple):  # type: ignore[no-untyped-def]
            seen[f"{name} full grad_input"] = [g for t in grad_input if t is not None for g in t.flatten().tolist()]
            seen[f"{name} full grad_output"] = grad_output[0].flatten().tolist()
            if name == "head" and rescale_head_input is not None:
                return (grad_input[0] * rescale_head_input,)
            return None

        return hook

    def legacy(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        seen["block[0] legacy grad_input"] = [round(float(t.sum()), 4) for t in grad_input if t is not None]

    model[0].register_full_backward_hook(full("block"))
    model[1].register_full_backward_hook(full("head"))
    model[0][0].register_backward_hook(legacy)
    x = torch.tensor([[1.0], [2.0]], requires_grad=True)
    with PerSampleModule(model, loss_reduction="sum") as psm, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy hook is deprecated: that is the point
        psm(x).sum().backward()
        seen["x.grad"] = x.grad.flatten().tolist()  # type: ignore[union-attr]
        seen["pergrad head.weight per sample"] = model[1].weight.grad_sample.flatten().tolist()
        seen["pergrad block.weight per sample"] = model[0][0].weight.grad_sample.flatten().tolist()
        seen["autograd block.weight (sum)"] = model[0][0].weight.grad.flatten().tolist()  # type: ignore[union-attr]
    return seen


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the default run: two backward passes (the tests run it)")
    parser.parse_args(argv)
    results = {"no rescaling": run(None), "head returns 0.5 * grad_input": run(0.5)}
    for title, seen in results.items():
        print(f"== {title}")
        for key, value in seen.items():
            print(f"  {key:34s} {value}")
    return results


if __name__ == "__main__":
    main()
