"""The rule registry: which function computes per-sample gradients for which layer type.

A rule is a pure function ``rule(layer, a, d) -> {param_name: Tensor[B, *param.shape]}``:

- ``layer`` is the module instance (read its hyperparameters and parameters, never mutate it);
- ``a`` is the layer's first positional input with the batch on dim 0;
- ``d`` is the gradient of the loss with respect to the layer's output, batch on dim 0, already
  scaled so that ``d[i]`` is the gradient of sample ``i``'s own loss ``f_i`` (for a rule registered
  with ``output_dims``: a tuple, one such gradient per tensor the layer returns, see ``RuleSpec``);
- the result maps each parameter name (as in ``layer.named_parameters(recurse=False)``) that
  requires grad to its per-sample gradients ``g_i = d f_i / d param``.

Lookup is by exact type: a subclass of ``nn.Linear`` may override ``forward``, so it only gets a
rule when someone registers one for it. A rule may also be registered for a class by its fully
qualified name (``"transformers.pytorch_utils.Conv1D"``: ``f"{cls.__module__}.{cls.__qualname__}"``),
so that pergrad supports layers of optional packages without importing them. That lookup is exact
too: it compares the qualified name of ``type(layer)`` itself, never of its bases.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

Rule = Callable[[nn.Module, Any, Any], dict[str, Tensor]]  # d: a Tensor, or OutputGrads with output_dims
OutputGrads = tuple[Tensor | None, ...]  # one per tensor of a call's output (output_tensors); None: no gradient
OutputDims = Callable[[nn.Module, Any, int], tuple[int | None, ...]]
Moments = tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]
LayerKey = type[nn.Module] | str  # a layer class, or its fully qualified name

_QUALIFIED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def output_tensors(output: Any) -> tuple[Tensor, ...]:
    """Every tensor of a layer call's output, in order: tuples, lists and dict values are walked
    (nested), a ``PackedSequence`` gives its data, anything else (None, ints) is left out."""
    if isinstance(output, Tensor):
        return (output,)
    if isinstance(output, PackedSequence):
        return (output.data,)
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, tuple | list):
        return tuple(t for o in output for t in output_tensors(o))
    return ()


def qualified_name(layer_type: type) -> str:
    """``"torch.nn.modules.linear.Linear"``: the name a class is registered under by name."""
    return f"{layer_type.__module__}.{layer_type.__qualname__}"


def _resolve(name: str) -> type[nn.Module] | None:
    """The class a qualified name denotes, if its module is imported already (nothing is imported)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is None:
            continue
        found: Any = module
        for attr in parts[split:]:
            found = getattr(found, attr, None)
        if isinstance(found, type) and issubclass(found, nn.Module) and qualified_name(found) == name:
            return found
    return None


def fsdp_wrapped(layer_type: type) -> type | None:
    """The class FSDP2's ``fully_shard`` generated ``layer_type`` from (``FSDPLinear`` -> ``Linear``), or
    None. FSDP2 makes ``type(f"FSDP{cls.__name__}", (FSDPModule, cls), ...)`` and swaps it in as the
    module's class; it adds no forward. Nothing is imported: without FSDP2 loaded there is none."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_class = getattr(fsdp, "FSDPModule", None)
    if module_class is None:
        return None
    bases = layer_type.__bases__
    if len(bases) == 2 and bases[0] is module_class and "forward" not in vars(layer_type):
        return bases[1]
    return None


@dataclass(frozen=True)
class FusedRule:
    """Per-sample quantities of a layer computed without building ``g_i`` (same arguments as a rule).

    - ``sq_norms(layer, a, d) -> {name: [B]}``: ``||g_i||^2``;
    - ``summed(layer, a, d) -> {name: param shape}``: ``sum_i g_i`` (callers fold weights ``c_i`` into d);
    - ``dots(layer, a, d, other) -> {name: [B]}``: ``<g_i, other[name]>`` for a fixed tensor per parameter;
    - ``sum_squares(layer, a, d) -> {name: param shape} | None``: ``sum_i g_i**2`` elementwise where a
      factorised form is exact for these shapes, else None (the caller then builds ``g_i``).
    - ``moments(layer, a, d, other) -> (sq_norms, sum_squares, dots) | None``: the three at once,
      sharing work, where factorised (else None: the caller uses the functions above or builds ``g_i``);
      ``other=None`` asks for no inner products (``dots`` empty).
    - ``builds(layer, a, d) -> bool``: ``sq_norms`` would build every ``g_i`` for these shapes anyway
      (an outer product, not a Gram form): the caller then builds them once with the rule and reads
      norms, and weighted sums, off them.
    Every function returns entries only for parameters that require grad, as fresh tensors (the caller may
    scale them in place). A feature keeps its own forms beside these, keyed by the ``FusedRule`` they extend
    (``pergrad.attribution.forms``). ``bilinear``: the weight's
    ``g_i`` is linear in ``a_i`` as well, so for a layer without a trainable bias per-sample weights
    may scale whichever of ``a`` and ``d`` is smaller.
    """

    sq_norms: Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
    summed: Callable[[nn.Module, Any, Tensor], dict[str, Tensor]]
    dots: Callable[[nn.Module, Any, Tensor, dict[str, Tensor]], dict[str, Tensor]]
    sum_squares: Callable[[nn.Module, Any, Tensor], dict[str, Tensor] | None] | None = None
    bilinear: bool = False  # g_i(weight) is linear in a_i too (Linear, Conv): weights may go on a
    moments: Callable[[nn.Module, Any, Tensor, dict[str, Tensor] | None], Moments | None] | None = None
    builds: Callable[[nn.Module, Any, Tensor], bool] | None = None


@dataclass(frozen=True)
class RuleSpec:
    """A registered rule and how its inputs are laid out.

    ``batch_dim_fixed``: the layer's input always has the batch on dim 0 (convolutions), so the
    wrapper's ``batch_first=False`` does not apply to it.
    ``all_inputs``: the rule receives a ``LayerCall`` (every positional and keyword argument of
    the call, as given) instead of the first input, and the batch size is read off the output
    (layers whose input is not batched, such as ``nn.EmbeddingBag`` with offsets).
    ``output_dims`` (with ``all_inputs``): the rule takes the gradients of every tensor the layer
    returns (``output_tensors``: ``out, (h_n, c_n)`` of an LSTM), not only of the first one. ``d`` is
    then a tuple with one entry per tensor, None where no gradient reached it this backward.
    ``output_dims(layer, output, batch_dim)`` says where the batch is in each tensor as the layer
    returns it (``batch_dim``: the wrapper's); its gradient then comes with the batch on dim 0. None
    hands the gradient over as returned (a PackedSequence's data; an output whose batch the rule
    finds itself, as the fallback does). The rule finds them in ``LayerCall.output_dims``, and the
    batch size in ``LayerCall.batch_size``. A layer whose every output is handed over as returned
    (None), such as a loss reduced over the batch, has its batch size read off its first input.
    """

    fn: Rule
    batch_dim_fixed: bool = False
    all_inputs: bool = False
    fused: FusedRule | None = None
    subtree: bool = False  # the rule covers the parameters of the layer's submodules too
    output_dims: OutputDims | None = None
    raw: bool = (
        False  # one raw parameter of a module, tracked where it meets the batch (``pergrad._core.shortcuts.shared``)
    )
    # a layer parametrized with torch.nn.utils.parametrize: its kept input is a ``pergrad._core.capture.parametrized.Computed``
    # and the rule differentiates the forward's graph, so it runs during the backward
    parametrized: bool = False


@dataclass(frozen=True)
class LayerCall:
    """Every argument of one call of a layer, for rules registered with ``all_inputs=True``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_dim: int = 0  # where the batch is in the batched arguments (1 with batch_first=False)
    output_dims: tuple[int | None, ...] = ()  # the batch dim of each output tensor (rules with output_dims)
    batch_size: int | None = None  # B (rules with output_dims)


class RuleRegistry:
    """A mapping from layer classes to rules; ``default_registry`` holds the built-in ones.

    Keys are classes (``nn.Linear``) or fully qualified class names (``"transformers.pytorch_utils.Conv1D"``);
    both match ``type(layer)`` exactly. A class and a name that denote the same class are the same
    key: registering both needs ``overwrite=True``, and the later registration wins.
    """

    def __init__(self, rules: Mapping[LayerKey, RuleSpec] | None = None) -> None:
        self._rules: dict[type[nn.Module], RuleSpec] = {}
        self._named: dict[str, RuleSpec] = {}
        for key, spec in (rules or {}).items():
            if isinstance(key, str):
                self._named[key] = spec
            else:
                self._rules[key] = spec

    def register(
        self,
        *layer_types: LayerKey,
        overwrite: bool = False,
        batch_dim_fixed: bool = False,
        all_inputs: bool = False,
        subtree: bool = False,
        output_dims: OutputDims | None = None,
    ) -> Callable[[Rule], Rule]:
        """Decorator: ``@registry.register(MyLayer)`` makes ``fn`` the rule for ``MyLayer``.

        A layer type may be given as the class or as its fully qualified name
        (``f"{cls.__module__}.{cls.__qualname__}"``), e.g. ``register("transformers.pytorch_utils.Conv1D")``:
        the class's package is then never imported by pergrad, and the rule applies to modules whose
        type has exactly that name. ``output_dims`` (see ``RuleSpec``) needs ``all_inputs=True``.
        """
        if not layer_types:
            raise TypeError("register() needs at least one layer type, e.g. register(MyLayer)")
        if output_dims is not None and not all_inputs:
            raise TypeError("register(output_dims=...) needs all_inputs=True: the rule then takes a LayerCall")
        for layer_type in layer_types:
            if isinstance(layer_type, str):
                if not _QUALIFIED.fullmatch(layer_type):
                    raise TypeError(
                        "register() takes nn.Module subclasses or fully qualified class names such as "
                        f"'transformers.pytorch_utils.Conv1D', got {layer_type!r}"
                    )
            elif not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
                raise TypeError(f"register() takes nn.Module subclasses or qualified class names, got {layer_type!r}")
            stored = self._stored(layer_type)
            if stored is not None and not overwrite:
                label = layer_type if isinstance(layer_type, str) else layer_type.__qualname__
                raise ValueError(
                    f"a rule for {label} is already registered ({stored[1].fn.__qualname__}); "
                    "pass overwrite=True to replace it"
                )

        def decorator(fn: Rule) -> Rule:
            for layer_type in layer_types:
                spec = RuleSpec(fn, batch_dim_fixed, all_inputs, subtree=subtree, output_dims=output_dims)
                self._set(layer_type, spec)
            return fn

        return decorator

    def _stored(self, key: LayerKey) -> tuple[LayerKey, RuleSpec] | None:
        """The key under which a rule for ``key`` is stored (the class itself, or its qualified name)
        and that rule; None if there is none."""
        if isinstance(key, str):
            if key in self._named:
                return key, self._named[key]
            return next(((t, spec) for t, spec in self._rules.items() if qualified_name(t) == key), None)
        if key in self._rules:
            return key, self._rules[key]
        name = qualified_name(key)
        return (name, self._named[name]) if name in self._named else None

    def _set(self, key: LayerKey, spec: RuleSpec) -> None:
        """Store ``spec`` for ``key``, dropping what the other form of the same key held (so it wins)."""
        if isinstance(key, str):
            for t in [t for t in self._rules if qualified_name(t) == key]:
                del self._rules[t]
            self._named[key] = spec
        else:
            self._named.pop(qualified_name(key), None)
            self._rules[key] = spec

    def register_fused(self, layer_types: tuple[LayerKey, ...], fused: FusedRule) -> None:
        """Attach fused computations to the rules already registered for ``layer_types``."""
        for layer_type in layer_types:
            stored = self._stored(layer_type)
            if stored is None:
                raise KeyError(
                    f"no rule is registered for {layer_type!r}; register the rule before its fused functions"
                )
            key, spec = stored
            self._set(key, replace(spec, fused=fused))

    def lookup(self, layer: nn.Module) -> RuleSpec | None:
        """The rule registered for exactly ``type(layer)`` (as a class, else by its qualified name), or None."""
        return self.lookup_type(type(layer))

    def lookup_type(self, layer_type: type) -> RuleSpec | None:
        """The rule registered for exactly ``layer_type`` (as a class, else by its qualified name), or None.

        A class FSDP2's ``fully_shard`` generated (``FSDPLinear``: bases ``FSDPModule`` and the layer's own
        class, forward unchanged) has the rule of the class it was generated for, exactly that class's.
        """
        spec = self._exact(layer_type)
        if spec is None:
            wrapped = fsdp_wrapped(layer_type)
            if wrapped is not None:
                spec = self._exact(wrapped)
        return spec

    def _exact(self, layer_type: type) -> RuleSpec | None:
        spec = self._rules.get(layer_type)
        if spec is None and self._named:
            spec = self._named.get(qualified_name(layer_type))
        return spec

    def supported_types(self) -> list[type[nn.Module]]:
        """The classes with a rule: those registered as classes, and those registered by name whose
        module is imported (a model holding such a layer has imported it). Names whose module is not
        imported are listed by ``supported_names``."""
        types = set(self._rules)
        types.update(t for t in map(_resolve, self._named) if t is not None)
        return sorted(types, key=lambda t: (t.__qualname__, t.__module__))

    def supported_names(self) -> list[str]:
        """The fully qualified name of every class with a rule, however it was registered."""
        return sorted({*map(qualified_name, self._rules), *self._named})

    def copy(self) -> RuleRegistry:
        """An independent registry with the same rules (for tests and private extensions)."""
        rules: list[tuple[LayerKey, RuleSpec]] = [*self._rules.items(), *self._named.items()]
        return RuleRegistry(dict(rules))

    def __contains__(self, layer_type: object) -> bool:
        """``nn.Linear in registry`` or ``"transformers.pytorch_utils.Conv1D" in registry``."""
        if isinstance(layer_type, str) or (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
            return self._stored(layer_type) is not None
        return False


default_registry = RuleRegistry()


def register_rule(
    *layer_types: LayerKey,
    overwrite: bool = False,
    batch_dim_fixed: bool = False,
    all_inputs: bool = False,
    subtree: bool = False,
    registry: RuleRegistry | None = None,
    output_dims: OutputDims | None = None,
) -> Callable[[Rule], Rule]:
    """Register a per-sample rule for ``layer_types`` (in ``default_registry`` unless given).

    A layer type is a class, or its fully qualified name as a string (the package is not imported).
    ``batch_dim_fixed``, ``all_inputs`` and ``subtree`` are described in ``RuleSpec``.
    Example, reusing the built-in Linear rule for a subclass whose forward is unchanged, and for a
    class of another package given by name::

        pergrad.register_rule(MyLinear)(pergrad.rules.linear)
        pergrad.register_rule("my_package.layers.MyLinear")(pergrad.rules.linear)
    """
    target = default_registry if registry is None else registry
    return target.register(
        *layer_types,
        overwrite=overwrite,
        batch_dim_fixed=batch_dim_fixed,
        all_inputs=all_inputs,
        subtree=subtree,
        output_dims=output_dims,
    )


def rule_path(fn: Rule) -> str:
    """How to name a rule function in code: ``pergrad.rules.group_norm`` for a built-in one,
    ``module.function`` for another importable one, else its qualified name."""
    name = getattr(fn, "__name__", "")
    if getattr(sys.modules.get("pergrad.rules"), name, None) is fn:  # (the rules import this module)
        return f"pergrad.rules.{name}"
    qualname = getattr(fn, "__qualname__", name)
    module = getattr(fn, "__module__", None)
    return qualname if module is None or "<" in qualname else f"{module}.{qualname}"


def registration(layer_type: type, spec: RuleSpec) -> str:
    """The call that registers ``spec``'s rule, with its options, for ``layer_type``."""
    options = "".join(f", {flag}=True" for flag in ("batch_dim_fixed", "all_inputs", "subtree") if getattr(spec, flag))
    return f"pergrad.register_rule({layer_type.__name__}{options})({rule_path(spec.fn)})"


def type_names(types: Iterable[type]) -> str:
    return ", ".join(t.__qualname__ for t in types)
