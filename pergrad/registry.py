"""The rule registry: which function computes per-sample gradients for which layer type.

A rule is a pure function ``rule(layer, a, d) -> {param_name: Tensor[B, *param.shape]}``:

- ``layer`` is the module instance (read its hyperparameters and parameters, never mutate it);
- ``a`` is the layer's first positional input with the batch on dim 0;
- ``d`` is the gradient of the loss with respect to the layer's output, batch on dim 0, already
  scaled so that ``d[i]`` is the gradient of sample ``i``'s own loss ``f_i``;
- the result maps each parameter name (as in ``layer.named_parameters(recurse=False)``) that
  requires grad to its per-sample gradients ``g_i = d f_i / d param``.

Lookup is by exact type: a subclass of ``nn.Linear`` may override ``forward``, so it only gets a
rule when someone registers one for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn

Rule = Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
Moments = tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]


@dataclass(frozen=True)
class FusedRule:
    """Per-sample quantities of a layer computed without building ``g_i`` (same arguments as a rule).

    - ``sq_norms(layer, a, d) -> {name: [B]}``: ``||g_i||^2``;
    - ``summed(layer, a, d) -> {name: param shape}``: ``sum_i g_i`` (callers fold weights ``c_i`` into d);
    - ``dots(layer, a, d, other) -> {name: [B]}``: ``<g_i, other[name]>`` for a fixed tensor per parameter;
    - ``sum_squares(layer, a, d) -> {name: param shape} | None``: ``sum_i g_i**2`` elementwise where a
      factorised form is exact for these shapes, else None (the caller then builds ``g_i``).
    - ``moments(layer, a, d, other) -> (sq_norms, sum_squares, dots) | None``: the three at once,
      sharing work, where factorised (else None: the caller uses the functions above or builds ``g_i``).
    - ``builds(layer, a, d) -> bool``: ``sq_norms`` would build every ``g_i`` for these shapes anyway
      (an outer product, not a Gram form): the caller then builds them once with the rule and reads
      norms, and weighted sums, off them.
    Every function returns entries only for parameters that require grad, as fresh tensors (the
    caller may scale them in place). ``bilinear``: the weight's
    ``g_i`` is linear in ``a_i`` as well, so for a layer without a trainable bias per-sample weights
    may scale whichever of ``a`` and ``d`` is smaller.
    """

    sq_norms: Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
    summed: Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
    dots: Callable[[nn.Module, Any, Tensor, dict[str, Tensor]], dict[str, Tensor]]
    sum_squares: Callable[[nn.Module, Any, Tensor], dict[str, Tensor] | None] | None = None
    bilinear: bool = False  # g_i(weight) is linear in a_i too (Linear, Conv): weights may go on a
    moments: Callable[[nn.Module, Any, Tensor, dict[str, Tensor]], Moments | None] | None = None
    builds: Callable[[nn.Module, Any, Tensor], bool] | None = None


@dataclass(frozen=True)
class RuleSpec:
    """A registered rule and how its inputs are laid out.

    ``batch_dim_fixed``: the layer's input always has the batch on dim 0 (convolutions), so the
    wrapper's ``batch_first=False`` does not apply to it.
    ``all_inputs``: the rule receives a ``LayerCall`` (every positional and keyword argument of
    the call, as given) instead of the first input, and the batch size is read off the output
    (layers whose input is not batched, such as ``nn.EmbeddingBag`` with offsets).
    """

    fn: Rule
    batch_dim_fixed: bool = False
    all_inputs: bool = False
    fused: FusedRule | None = None
    subtree: bool = False  # the rule covers the parameters of the layer's submodules too


@dataclass(frozen=True)
class LayerCall:
    """Every argument of one call of a layer, for rules registered with ``all_inputs=True``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_dim: int = 0  # where the batch is in the batched arguments (1 with batch_first=False)


class RuleRegistry:
    """A mapping from layer types to rules; ``default_registry`` holds the built-in ones."""

    def __init__(self, rules: dict[type[nn.Module], RuleSpec] | None = None) -> None:
        self._rules: dict[type[nn.Module], RuleSpec] = dict(rules or {})

    def register(
        self,
        *layer_types: type[nn.Module],
        overwrite: bool = False,
        batch_dim_fixed: bool = False,
        all_inputs: bool = False,
        subtree: bool = False,
    ) -> Callable[[Rule], Rule]:
        """Decorator: ``@registry.register(MyLayer)`` makes ``fn`` the rule for ``MyLayer``."""
        if not layer_types:
            raise TypeError("register() needs at least one layer type, e.g. register(MyLayer)")
        for layer_type in layer_types:
            if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
                raise TypeError(f"register() takes nn.Module subclasses, got {layer_type!r}")
            if layer_type in self._rules and not overwrite:
                raise ValueError(
                    f"a rule for {layer_type.__qualname__} is already registered "
                    f"({self._rules[layer_type].fn.__qualname__}); pass overwrite=True to replace it"
                )

        def decorator(fn: Rule) -> Rule:
            for layer_type in layer_types:
                self._rules[layer_type] = RuleSpec(fn, batch_dim_fixed, all_inputs, subtree=subtree)
            return fn

        return decorator

    def register_fused(self, layer_types: tuple[type[nn.Module], ...], fused: FusedRule) -> None:
        """Attach fused computations to the rules already registered for ``layer_types``."""
        for layer_type in layer_types:
            self._rules[layer_type] = replace(self._rules[layer_type], fused=fused)

    def lookup(self, layer: nn.Module) -> RuleSpec | None:
        """The rule registered for exactly ``type(layer)``, or None."""
        return self._rules.get(type(layer))

    def supported_types(self) -> list[type[nn.Module]]:
        return sorted(self._rules, key=lambda t: t.__qualname__)

    def copy(self) -> RuleRegistry:
        """An independent registry with the same rules (for tests and private extensions)."""
        return RuleRegistry(self._rules)

    def __contains__(self, layer_type: object) -> bool:
        return layer_type in self._rules


default_registry = RuleRegistry()


def register_rule(
    *layer_types: type[nn.Module],
    overwrite: bool = False,
    batch_dim_fixed: bool = False,
    all_inputs: bool = False,
    registry: RuleRegistry | None = None,
) -> Callable[[Rule], Rule]:
    """Register a per-sample rule for ``layer_types`` (in ``default_registry`` unless given).

    Example, reusing the built-in Linear rule for a subclass whose forward is unchanged::

        pergrad.register_rule(MyLinear)(pergrad.rules.linear)
    """
    target = default_registry if registry is None else registry
    return target.register(*layer_types, overwrite=overwrite, batch_dim_fixed=batch_dim_fixed, all_inputs=all_inputs)


def type_names(types: Iterable[type]) -> str:
    return ", ".join(t.__qualname__ for t in types)
