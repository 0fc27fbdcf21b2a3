"""Per-sample gradients with respect to layer outputs and the model input, against retain_grad."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import PergradError, PerSampleModule


class TwoCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_activation_grads_match_retain_grad(loss_reduction: str) -> None:
    torch.manual_seed(0)
    model = TwoCalls().double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    target = torch.randn(5, 2, dtype=torch.float64)
    outputs: list[tuple[str, torch.Tensor]] = []

    def retain(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            out.retain_grad()
            count = sum(n.split(":")[0] == name for n, _ in outputs)
            outputs.append((name if count == 0 else f"{name}:{count}", out))

        return hook

    handles = [m.register_forward_hook(retain(n)) for n, m in model.named_children()]
    loss = (model(x) - target).pow(2).sum()
    scale = 5 if loss_reduction == "mean" else 1
    (loss / scale).backward()
    expected = {n: out.grad * scale for n, out in outputs}
    expected["input"] = x.grad * scale
    for h in handles:
        h.remove()
    x.grad = None
    with PerSampleModule(model, loss_reduction=loss_reduction, keep_activation_grads=True) as psm:
        ((psm(x) - target).pow(2).sum() / scale).backward()
        got = psm.activation_grads()
    assert sorted(got) == ["input", "lin", "lin:1", "out"]
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_activation_grads_need_the_flag() -> None:
    with PerSampleModule(nn.Linear(2, 2)) as psm, pytest.raises(PergradError, match=r"keep_activation_grads=True"):
        psm.activation_grads()
