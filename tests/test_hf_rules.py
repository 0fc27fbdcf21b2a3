"""Layers of optional packages (HuggingFace ``transformers``) supported by qualified class name:
the registry's by-name API."""

from __future__ import annotations

import sys

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad.registry import RuleRegistry, qualified_name  # noqa: E402


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class SubScale(Scale):
    pass


def scale_rule(layer: nn.Module, a: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": torch.einsum("n...f,n...f->nf", a, d)}


def test_register_by_name_is_exact_and_one_key_with_the_class() -> None:
    registry = RuleRegistry()
    name = qualified_name(Scale)
    registry.register(name)(scale_rule)
    assert Scale in registry and name in registry and SubScale not in registry
    assert registry.lookup(SubScale()) is None  # a subclass has its own name
    assert registry.supported_types() == [Scale] and registry.supported_names() == [name]
    with pytest.raises(ValueError, match=r"a rule for Scale is already registered \(scale_rule\).*overwrite=True"):
        registry.register(Scale)(scale_rule)
    with pytest.raises(ValueError, match=rf"a rule for {name} is already registered"):
        registry.register(name)(scale_rule)
    copied = registry.copy()
    copied.register(Scale, overwrite=True)(pergrad.rules.linear)  # the class replaces the name
    assert copied.supported_names() == [name] and copied.lookup(Scale()).fn is pergrad.rules.linear
    assert registry.lookup(Scale()).fn is scale_rule  # the copy is independent
    never_imported = "some_package_not_imported.layers.FancyNorm"
    registry.register(never_imported)(scale_rule)
    assert never_imported in registry and never_imported in registry.supported_names()
    assert registry.supported_types() == [Scale]  # not resolvable without importing it: left out
    assert "some_package_not_imported" not in sys.modules


@pytest.mark.parametrize("bad", ["Conv1D", "transformers..Conv1D", "a.<locals>.B", 3])
def test_register_rejects_what_is_not_a_class_or_qualified_name(bad: object) -> None:
    with pytest.raises(TypeError, match=r"register\(\) takes nn.Module subclasses or .*qualified class names"):
        RuleRegistry().register(bad)(scale_rule)  # type: ignore[arg-type]


def test_register_fused_needs_a_rule() -> None:
    spec = pergrad.default_registry.lookup(nn.Linear(2, 2))
    assert spec is not None and spec.fused is not None
    fused = spec.fused
    with pytest.raises(KeyError, match=r"no rule is registered for 'x.Y'"):
        RuleRegistry().register_fused(("x.Y",), fused)
