"""Which layers of a model pergrad hooks, with which rule, or why it cannot.

Every module with trainable parameters of its own gets a rule: the registry's for its exact type
(or the class a lazy module becomes), the rule of its parametrized tensors pulled back to the
originals, the raw rule for a module of the user's own that uses its parameters in its forward,
the fallback (torch.func) where asked; otherwise an ``UnsupportedLayerError`` says what to do.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter
from torch.nn.utils import parametrize

from pergrad._core.capture.calls import HookedLayer
from pergrad._core.capture.parametrized import (
    base_type,
    check_hooked,
    hooked_originals,
    parametrizations_of,
    parametrized_spec,
    sites,
)
from pergrad.errors import UnsupportedLayerError, module_label
from pergrad.registry import RuleRegistry, RuleSpec, fsdp_wrapped, registration, type_names
from pergrad.rules.fallback import fallback as fallback_rule
from pergrad.rules.fallback import output_dims as fallback_output_dims
from pergrad.rules.raw import RAW


def _own_trainable(module: nn.Module) -> list[str]:
    return [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]


def _check_layer_options(name: str, module: nn.Module) -> None:
    """Options of supported layers whose per-sample gradient is not a gradient of f_i."""
    if isinstance(module, nn.Embedding):
        if module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                f"{module_label(name)} (nn.Embedding) has scale_grad_by_freq=True: autograd then divides each row's "
                "gradient by the row's frequency in the whole batch, which is not the gradient of any one "
                "sample's loss. Construct it with scale_grad_by_freq=False."
            )
        if module.sparse:
            raise UnsupportedLayerError(
                f"{module_label(name)} (nn.Embedding) has sparse=True: pergrad writes dense per-sample gradients and a "
                "dense .grad. Construct it with sparse=False (and use a dense optimizer)."
            )


FALLBACK = RuleSpec(fallback_rule, all_inputs=True, subtree=True, output_dims=fallback_output_dims)


def _plain_module(module: nn.Module, registry: RuleRegistry) -> bool:
    """A module of the user's or a library's own (not a ``torch.nn`` layer, nor a subclass of a layer
    with a rule): its own parameters are raw ones it uses in its forward (``pergrad.rules.raw``)."""
    if (fsdp_wrapped(type(module)) or type(module)).__module__.startswith("torch."):
        return False
    return not any(isinstance(module, t) for t in registry.supported_types())


def _inside(name: str, parent: str) -> bool:
    """Whether module ``name`` is a strict descendant of module ``parent`` ("" is the root)."""
    return name != parent and (parent == "" or name.startswith(f"{parent}."))


def layout_of(modules: list[nn.Module], canonical: Callable[[nn.Parameter], nn.Parameter]) -> tuple[object, ...]:
    """What the wrapper was built for, compared at every forward: each module's type (a lazy module becomes
    its ``cls_to_become``), then its children and parameters by identity and name (``prune.remove`` puts
    ``weight_orig`` back as ``weight``), each with whether it requires grad (and is materialised), its dtype,
    device and tensor (``model.to(...)``, ``.double()`` keep the ``Parameter`` but give it new data and a new
    ``AccumulateGrad`` node the hooks are not on; ``torch.utils.swap_tensors``, which conversions use under
    ``set_swap_module_params_on_conversion(True)``, swaps the tensor). One flat tuple, no call per module."""
    found: list[object] = []
    for m in modules:
        found.append(type(m))
        found.extend(map(id, m._modules.values()))  # (ints: never equal to a type or a parameter's tuple)
        for n, p in m._parameters.items():
            if p is not None:
                c = canonical(p)
                lazy = isinstance(p, UninitializedParameter)
                found.append((n, id(c), c._cdata, c.dtype, c.device, p.requires_grad, lazy))
    return tuple(found)


def _advice(cls: type[nn.Module], registry: RuleRegistry) -> str:
    """What to do about a module of type ``cls`` without a rule. For a subclass of a class with a
    rule: register that rule for it if the subclass keeps the parent's ``forward``; if it overrides
    ``forward`` (timm's ``BatchNormAct2d``, a ``LayerNorm2d`` that permutes channels), the parent's
    rule computes the wrong thing, so the advice is the fallback or a rule of its own."""
    mro = cls.__mro__
    found = next(((i, t, s) for i, t in enumerate(mro[1:], 1) if (s := registry.lookup_type(t)) is not None), None)
    fallback = "pass fallback=True to compute it with torch.func (exact, slower)"
    own_rule = f"write a rule for it with @pergrad.register_rule({cls.__name__})"
    if found is None:
        return f"{own_rule} (a function (layer, a, d) -> {{name: per-sample gradients}}), or {fallback}."
    index, parent, spec = found
    overriding = next((t for t in mro[:index] if "forward" in vars(t)), None)
    if overriding is not None:
        return (
            f"it subclasses {parent.__qualname__}, but {overriding.__qualname__} overrides forward, so the "
            f"{parent.__qualname__} rule does not compute its gradients: {fallback}, or {own_rule}."
        )
    return (
        f"it subclasses {parent.__qualname__} and keeps its forward; rules apply to their exact type only (a subclass "
        f"may change what forward computes). If nothing else it overrides changes the computation, register the "
        f"parent's rule: {registration(cls, spec)}. Or {fallback}."
    )


def _through_parametrizations(name: str, module: nn.Module, spec: RuleSpec) -> RuleSpec:
    """``spec``, or where the tensors it covers include parametrized ones (``torch.nn.utils.parametrize``,
    of the module or, for a rule covering its subtree, of a submodule), ``spec`` on the computed
    tensors pulled back to the original ones (``pergrad._core.capture.parametrized``)."""
    return parametrized_spec(spec) if sites(module, spec.subtree) else spec


def _in_parametrizations(model: nn.Module, name: str) -> bool:
    """Whether module ``name`` is part of a parametrized module's ``parametrizations`` (the
    ParametrizationLists holding the original tensors, and the parametrizations themselves)."""
    parts = name.split(".")
    return any(
        part == "parametrizations" and parametrize.is_parametrized(model.get_submodule(".".join(parts[:i])))
        for i, part in enumerate(parts)
    )


_CONTAINERS = (nn.ParameterDict, nn.ParameterList)  # hold parameters; never called
_UNCALLED = (*_CONTAINERS, nn.ModuleDict, nn.ModuleList)


def _hold_container(
    model: nn.Module, name: str, container: nn.Module, trainable: list[str], layers: list[HookedLayer], fallback: bool
) -> None:
    """Parameters in a ``ParameterDict``/``ParameterList`` are raw parameters of the nearest
    enclosing module that is called (its *host*, e.g. peft's LoRA ``Embedding`` reading
    ``lora_embedding_A[adapter]``): tracked from the host's call to where they meet the batch. With
    ``fallback=True`` the host is computed with torch.func as one unit instead."""
    host_name = name
    while True:
        if host_name == "":
            raise UnsupportedLayerError(
                f"{module_label(name)} ({type(container).__name__}) holds trainable parameters {trainable}, but no "
                "module of the model that is called encloses it, so nothing uses them in a forward pergrad sees. "
                "Wrap the module whose forward reads them."
            )
        host_name = host_name.rpartition(".")[0]
        host = model.get_submodule(host_name)
        if not isinstance(host, _UNCALLED):
            break
    if fallback:
        layers[:] = [layer for layer in layers if layer.name != host_name and not _inside(layer.name, host_name)]
        layers.append(HookedLayer(host_name, host, _through_parametrizations(host_name, host, FALLBACK)))
        return
    layers.extend(HookedLayer(name, container, RAW, param=p, host=host) for p in trainable)


# modules that use a child's parameters without calling the child, and return a loss reduced over the batch
_FUSED_LOSSES: tuple[type[nn.Module], ...] = tuple(
    t for t in (getattr(nn, "LinearCrossEntropyLoss", None),) if isinstance(t, type)
)


def _refuse_fused_loss(name: str, module: nn.Module) -> None:
    """``nn.LinearCrossEntropyLoss`` computes its logits from ``module.linear``'s weight inside
    ``F.linear_cross_entropy`` (the Linear is never called) and returns the loss already reduced
    over the batch: no rule sees its parameters, and its output has no per-sample part."""
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if not trainable:
        return
    attr = name.rpartition(".")[2] or "<attribute>"
    raise UnsupportedLayerError(
        f"{module_label(name)} ({type(module).__module__}.{type(module).__qualname__}) multiplies its input by "
        f"its parameters {trainable} inside F.linear_cross_entropy without calling its Linear, so no rule (nor "
        "fallback=True) sees that product, and (unless reduction='none') it reduces the loss over the batch. Replace it with its own "
        f"Linear, which holds the same parameters (parent.{attr} = parent.{attr}.linear), and compute the loss "
        "from the logits it returns (unflattened to [N, num_classes, *out_features] if it has out_features): "
        "F.cross_entropy(logits, target, reduction='none', weight=..., ignore_index=..., label_smoothing=...) "
        "as the module had them, summed or averaged over each sample's positions, then summed "
        "(loss_reduction='sum') or averaged (loss_reduction='mean') over the batch. Or freeze its parameters "
        "with requires_grad_(False)."
    )


def _covers_subtree(module: nn.Module, registry: RuleRegistry) -> bool:
    """Whether ``module``'s rule covers its submodules' parameters (``subtree``) and some of them are
    trainable: it is hooked without parameters of its own (``nn.LinearCrossEntropyLoss``)."""
    spec = registry.lookup_type(type(module))
    return spec is not None and spec.subtree and any(p.requires_grad for p in module.parameters())


def _lazy_spec(module: nn.Module, registry: RuleRegistry) -> RuleSpec | None:
    """For a lazy module before its first forward (``nn.LazyLinear``, ``nn.LazyConv2d``, ...), the rule
    of the class it becomes then (``cls_to_become``, whose forward it runs): its parameters are
    materialised in its own forward pre-hook (or by ``load_state_dict``), before pergrad's hooks run."""
    becomes = getattr(module, "cls_to_become", None) if isinstance(module, LazyModuleMixin) else None
    return None if becomes is None else registry.lookup_type(becomes)


def is_lazy_module(module: nn.Module) -> bool:
    """Whether ``module`` is a lazy module whose parameters or class change in its next forward."""
    if not isinstance(module, LazyModuleMixin):
        return False
    return module.has_uninitialized_params() or getattr(module, "cls_to_become", None) is not None


def discover(model: nn.Module, registry: RuleRegistry, fallback: bool) -> list[HookedLayer]:
    """The layers of ``model`` pergrad hooks, each with its rule; raises for a trainable parameter no
    rule covers, naming the module, its type and what to do."""
    layers: list[HookedLayer] = []
    for name, module in model.named_modules():
        if any(layer.spec.subtree and _inside(name, layer.name) for layer in layers):
            continue  # inside a module whose rule covers its whole subtree
        if isinstance(module, _FUSED_LOSSES) and registry.lookup_type(type(module)) is None:
            _refuse_fused_loss(name, module)
        if _in_parametrizations(model, name):
            continue  # the original tensors of a parametrized module: its rule covers them
        parametrized = parametrize.is_parametrized(module)
        check_hooked(f"{module_label(name)} ({type(module).__name__})", module)
        reparametrized = parametrized or bool(hooked_originals(module))  # its rule covers computed tensors
        trainable = _own_trainable(module)
        if parametrized:  # its parametrized tensors are computed from these
            plists = parametrizations_of(module).named_parameters()
            trainable += [f"parametrizations.{n}" for n, p in plists if p.requires_grad]
        if not (trainable or _covers_subtree(module, registry)):
            continue
        if isinstance(module, _CONTAINERS):
            _hold_container(model, name, module, trainable, layers, fallback)
            continue
        layer_type = base_type(module)
        spec = registry.lookup_type(layer_type) or _lazy_spec(module, registry)
        if spec is None and fallback:
            spec = FALLBACK
        if spec is None and not reparametrized and _plain_module(module, registry):
            layers.extend(HookedLayer(name, module, RAW, param=p) for p in trainable)
            continue
        if spec is None:
            kind = ", parametrized" if reparametrized else ""
            raise UnsupportedLayerError(
                f"{module_label(name)} ({layer_type.__module__}.{layer_type.__qualname__}{kind}) has trainable "
                f"parameters {trainable} but no per-sample rule: {_advice(layer_type, registry)} Supported types: "
                f"{type_names(registry.supported_types())}. Or freeze its parameters with requires_grad_(False)."
            )
        _check_layer_options(name, module)
        layers.append(HookedLayer(name, module, _through_parametrizations(name, module, spec)))
    return layers
