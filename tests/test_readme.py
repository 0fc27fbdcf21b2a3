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
