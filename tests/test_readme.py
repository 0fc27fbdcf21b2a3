"""The README's code is run, so it cannot rot."""

from __future__ import annotations

from pathlib import Path

import torch

import pergrad
from tests.reference import assert_close, reference_grad_sample, run_pergrad

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_writing_a_rule_example() -> None:
    block = README.split("### Writing a rule")[1].split("```python")[1].split("```")[0]
    registry = pergrad.default_registry.copy()
    namespace: dict[str, object] = {"registry": registry}
    patched = block.replace("@pergrad.register_rule(Scale)", "@registry.register(Scale)")
    exec(patched, namespace)
    scale = namespace["Scale"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), scale(4)).double()  # type: ignore[operator]
    with torch.no_grad():
        model[1].w.normal_()
    x, target = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(5, 2, 4, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    with pergrad.PerSampleModule(model, rules=registry) as psm:
        run_pergrad(psm, x, target)
        assert_close(model[1].w.grad_sample, ref["1.w"])


def test_readme_opens_with_the_two_commands() -> None:
    lines = README.split("```bash")[1].split("```")[0].strip().splitlines()
    assert lines[1].startswith('pip install -e ".[test]" && python -m pytest')


def test_loss_scaling_example() -> None:
    """The README's GradScaler loop, on the CPU: one step within 3% of the float32 step without
    autocast or scaling (the default scale 2**16 would shrink a clipped step 65536-fold)."""
    block = README.split("### Mixed precision and loss scaling")[1].split("```python")[1].split("```")[0]
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    models = [torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before = [p.detach().clone() for p in models[0].parameters()]
    namespace = {
        "torch": torch,
        "F": torch.nn.functional,
        "PerSampleModule": pergrad.PerSampleModule,
        "transforms": pergrad.transforms,
        "model": models[0],
        "optimizer": torch.optim.SGD(models[0].parameters(), lr=1.0),
        "x": x,
        "y": y,
    }
    exec(block.replace('"cuda"', '"cpu"'), namespace)
    with pergrad.PerSampleModule(models[1]) as psm:
        psm.register_transform(models[1], pergrad.transforms.clip_norm(1.0))
        torch.nn.functional.cross_entropy(psm(x), y).backward()
    for p, q, start in zip(models[0].parameters(), models[1].parameters(), before):
        assert q.grad is not None
        step = start - p.detach()
        assert (step - q.grad).norm() <= 3e-2 * q.grad.norm()


def test_attribution_example() -> None:
    """The README's projection snippet gives ``P vec(g_i)`` of each sample's own loss (torch.func's
    per-sample gradients times the regenerated P), float64."""
    from pergrad.projectors import Projector, Spec

    block = README.split("### Training-data attribution")[1].split("```python")[1].split("```")[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, target)

    namespace = {"PerSampleModule": pergrad.PerSampleModule, "model": model, "loss_fn": loss_fn, "x": x, "y": y}
    exec(block, namespace)
    features = namespace["features"]
    assert isinstance(features, torch.Tensor) and features.shape == (5, 512)
    ref = reference_grad_sample(model, x, y, loss=lambda out, t: torch.nn.functional.cross_entropy(out, t))
    spec = Spec(512, "kron", 0, None)
    expected = sum(Projector(spec, n, tuple(p.shape)).apply(ref[n]) for n, p in model.named_parameters())
    assert_close(features, expected, "README's projected features")  # type: ignore[arg-type]
