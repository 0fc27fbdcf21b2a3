"""Per-sample gradients of layers parametrized with ``torch.nn.utils.parametrize``.

``weight_norm``, ``spectral_norm``, ``orthogonal`` (``torch.nn.utils.parametrizations``) and a
user's own ``register_parametrization`` turn a layer's ``weight`` into a tensor computed at each
access, ``W = P(theta)``, from the *original* tensors ``theta`` (``parametrizations.weight.original``,
or ``original0``, ``original1``, ...; plus any parameters of the parametrization modules). The
optimizer updates ``theta``, so ``theta``'s per-sample gradients are the ones pergrad reports,
transforms and reduces: by the chain rule, for each sample

    g_i(theta) = J_P(theta)^T g_i(W),

with ``g_i(W)`` from the rule of the layer's class before parametrization (``ParametrizedLinear``
-> the ``nn.Linear`` rule) applied to a stand-in that holds the computed ``W`` as its ``weight``.

A rule that covers a whole subtree (``fallback=True``, ``nn.MultiheadAttention``: torch.func runs
the subtree's forward again) gets a stand-in of the subtree whose parametrized submodules hold
their computed tensors too, so it does not run their parametrizations again either.

``J_P^T`` is applied by differentiating the forward's own computation of ``W``: a forward hook on
the parametrization keeps the ``W`` the call used (with its autograd history), and one batched
``torch.autograd.grad(W, theta, g_W, is_grads_batched=True)`` pulls every sample back, during the
backward, before autograd frees that history. Nothing runs the parametrization again: spectral
norm's power iteration is not advanced a second time and the pull-back uses the same ``u``, ``v``
as the forward; a random parametrization uses the same draw.

torch's older, hook-based reparametrizations work the same way: ``torch.nn.utils.prune`` (``W =
weight_orig * weight_mask``), the legacy ``torch.nn.utils.weight_norm`` (``W`` from ``weight_g``,
``weight_v``) and ``torch.nn.utils.spectral_norm`` (``W = weight_orig / sigma``, ``sigma`` from the
power iteration's ``u``, ``v``). Their forward pre-hook computes ``W`` from the module's own
parameters and sets it as a plain attribute of the module, where the call reads it; a forward hook
on the module keeps it (the attribute the call used), and the pull-back above goes to those
parameters (``HOOKED``): ``g_i(weight_orig) = mask * g_i(W)`` for pruning.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from pergrad._core.memory.layout import recorded
from pergrad._core.shortcuts.shared import pulling_back
from pergrad.errors import HookStateError, UnsupportedLayerError
from pergrad.registry import RuleSpec


@dataclass(frozen=True)
class Computed:
    """What one call of a parametrized layer keeps: the input its rule takes, and each parametrized
    tensor as that call computed it, keyed relative to the layer (``"weight"``, ``"attn.out_proj.weight"``)."""

    input: Any
    tensors: dict[str, Tensor]


@dataclass(frozen=True)
class Site:
    """A parametrized tensor that a layer's rule covers: ``key`` relative to the layer, held by
    ``owner`` (the layer itself or a submodule) under ``tensor``. ``hooked``: computed by a forward
    pre-hook of ``owner`` (``hooked_originals``) rather than by ``torch.nn.utils.parametrize``."""

    key: str
    owner: nn.Module
    tensor: str
    hooked: bool = False


#: The forward pre-hooks of torch's hook-based reparametrizations: each computes a tensor of the
#: module (its name read off the hook) from parameters of the module (their suffixes).
HOOKED: dict[type, tuple[str, tuple[str, ...]]] = {
    prune.BasePruningMethod: ("_tensor_name", ("_orig",)),
    WeightNorm: ("name", ("_g", "_v")),
    SpectralNorm: ("name", ("_orig",)),
}


def hooked_originals(module: nn.Module) -> dict[str, list[str]]:
    """``{tensor: names of the module's parameters it is computed from}`` for every hook-based
    reparametrization of ``module`` (``HOOKED``)."""
    found: dict[str, list[str]] = {}
    for hook in module._forward_pre_hooks.values():
        for cls, (attribute, suffixes) in HOOKED.items():
            if isinstance(hook, cls):
                tensor = getattr(hook, attribute)
                found[tensor] = [tensor + suffix for suffix in suffixes]
    return found


def check_hooked(label: str, module: nn.Module) -> None:
    """Refuse a hook-based reparametrization of ``module`` (named ``label`` in messages) that computes
    its tensor from another reparametrized tensor (``weight_norm``, then ``prune`` of ``weight_v``):
    the forward's graph of the tensor leads there, not to parameters."""
    for hook in module._forward_pre_hooks.values():
        for cls, (attribute, suffixes) in HOOKED.items():
            if not isinstance(hook, cls):
                continue
            tensor = getattr(hook, attribute)
            for name in (tensor + suffix for suffix in suffixes):
                if not isinstance(module._parameters.get(name), nn.Parameter):
                    raise UnsupportedLayerError(
                        f"{label}: {type(hook).__name__} computes its {tensor!r} from {name!r}, which is not a "
                        "parameter of the layer but reparametrized itself; pergrad pulls per-sample gradients back "
                        "through one reparametrization per tensor. Keep one: undo the other with "
                        "torch.nn.utils.prune.remove, torch.nn.utils.remove_weight_norm or remove_spectral_norm."
                    )


def parametrization_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable tensors ``module``'s own parametrized tensors are computed from, by name
    relative to it, that are not its own parameters: those of ``torch.nn.utils.parametrize``."""
    if not parametrize.is_parametrized(module):
        return []
    return [(f"parametrizations.{n}", p) for n, p in parametrizations_of(module).named_parameters() if p.requires_grad]


def parametrizations_of(module: nn.Module) -> nn.ModuleDict:
    """``module.parametrizations``: ``{tensor name: ParametrizationList}``."""
    found = module.parametrizations
    assert isinstance(found, nn.ModuleDict)
    return found


def base_type(module: nn.Module) -> type[nn.Module]:
    """The class of ``module`` before parametrization (``nn.Linear`` for a ``ParametrizedLinear``)."""
    return parametrize.type_before_parametrizations(module)


def in_parametrizations(path: str) -> bool:
    """Whether the module at ``path`` (relative to a module) is part of a ``parametrizations`` dict."""
    return "parametrizations" in path.split(".")


def sites(module: nn.Module, subtree: bool) -> list[Site]:
    """The parametrized tensors of ``module`` and, with ``subtree``, of its submodules."""
    found: list[Site] = []
    for path, m in module.named_modules() if subtree else [("", module)]:
        if in_parametrizations(path):
            continue
        if parametrize.is_parametrized(m):
            found.extend(Site(f"{path}.{t}" if path else t, m, t) for t in parametrizations_of(m))
        found.extend(Site(f"{path}.{t}" if path else t, m, t, hooked=True) for t in hooked_originals(m))
    return found


def parametrized_spec(base: RuleSpec) -> RuleSpec:
    """The rule of a layer with parametrized tensors (its own, or its submodules' where ``base``
    covers a subtree): ``base`` on a stand-in of the layer that holds the computed tensors as plain
    parameters, then pulled back to the original tensors (module docstring)."""
    base_fn = base.fn

    def parametrized(layer: nn.Module, a: Any, d: Tensor) -> dict[str, Tensor]:
        assert isinstance(a, Computed)
        x = a.input
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != d.dtype:
            x = x.to(d.dtype)  # autocast: the rule computes in the parameters' dtype
        # second order: W with its graph, so what a rule reads of it (the fallback) is differentiable
        graph = recorded()
        computed = {key: (w if graph else w.detach()).to(d.dtype) for key, w in a.tensors.items()}
        grads = base_fn(stand_in(layer, computed), x, d)
        return pull_back(layer, a.tensors, grads)

    parametrized.__qualname__ = f"parametrized({getattr(base_fn, '__qualname__', 'rule')})"
    return RuleSpec(
        parametrized, base.batch_dim_fixed, base.all_inputs, fused=None, subtree=base.subtree, parametrized=True
    )


def stand_in(module: nn.Module, tensors: dict[str, Tensor]) -> nn.Module:
    """A shallow copy of ``module`` in which each parametrized tensor in ``tensors`` (keyed relative
    to ``module``: ``"weight"``, ``"attn.out_proj.weight"``) is a plain parameter holding its computed
    value, in a copy of its module of the class before parametrization: what a rule reads, and what
    torch.func can run without running a parametrization. Everything else (hyperparameters, other
    parameters and submodules) is shared; the copies have no hooks.

    Under second order (``layout.recorded()``) a computed tensor goes in as it is, with the graph
    of its parametrization, not as a (detached) ``nn.Parameter``: rules that read it then
    differentiate through it to the original tensors."""
    own = {key: t for key, t in tensors.items() if "." not in key}
    inner: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        if "." in key:
            child, _, rest = key.partition(".")
            inner.setdefault(child, {})[rest] = t
    cls = base_type(module) if own else type(module)
    twin = cls.__new__(cls)
    state = {k: v for k, v in module.__dict__.items() if k not in own}  # a hooked tensor is an attribute
    if own:
        hooked = hooked_originals(module)
        computed: dict[str, Tensor] = (
            dict(own)
            if recorded()
            else {name: nn.Parameter(t, requires_grad=bool(originals(module, name))) for name, t in own.items()}
        )
        inputs = {p for name in own for p in hooked.get(name, [])}  # not the layer's own parameters any more
        state["_parameters"] = {**{k: p for k, p in module._parameters.items() if k not in inputs}, **computed}
    dropped = "parametrizations" if own and parametrize.is_parametrized(module) else None
    modules = {k: m for k, m in module._modules.items() if k != dropped}
    state["_modules"] = {k: stand_in(m, inner[k]) if k in inner and m is not None else m for k, m in modules.items()}
    for key, value in state.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = OrderedDict()
    twin.__dict__ = state
    return twin


def originals(module: nn.Module, key: str) -> list[tuple[str, nn.Parameter]]:
    """The trainable tensors the parametrized tensor ``key`` (relative to ``module``) is computed
    from, named relative to ``module``: its originals and the parameters of its parametrizations."""
    path, _, tensor = key.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if not parametrize.is_parametrized(owner, tensor):  # a hook-based reparametrization (``HOOKED``)
        own = [(name, owner._parameters.get(name)) for name in hooked_originals(owner)[tensor]]
        return [(f"{path}.{n}" if path else n, p) for n, p in own if isinstance(p, nn.Parameter) and p.requires_grad]
    prefix = f"{path}.parametrizations.{tensor}." if path else f"parametrizations.{tensor}."
    plist = parametrizations_of(owner)[tensor]
    return [(prefix + n, p) for n, p in plist.named_parameters() if p.requires_grad]


def pull_back(module: nn.Module, tensors: dict[str, Tensor], grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """``g_i(theta) = J_P(theta)^T g_i(W)`` for every parametrized tensor in ``grads``, through the
    forward's own graph of ``W``; the other entries (an unparametrized bias) as they are."""
    out = {name: g for name, g in grads.items() if name not in tensors}
    for name, g in grads.items():
        if name not in tensors:
            continue
        sources = originals(module, name)
        if not sources:
            continue
        w = tensors[name]
        params = [p for _, p in sources]
        found = _vjp(w, params, g.to(w.dtype)) if w.grad_fn is not None else [None] * len(params)
        for (key, p), gp in zip(sources, found, strict=True):
            gp = g.new_zeros((g.shape[0], *p.shape)) if gp is None else gp.to(p.dtype)
            out[key] = gp if key not in out else out[key] + gp
    return out


def _vjp(w: Tensor, params: list[nn.Parameter], g: Tensor) -> list[Tensor | None]:
    """``J^T g_i`` for each sample i of ``g`` ([B, *w.shape]): one batched autograd call, or one call
    per sample where an op of the parametrization has no batching rule. Under second order
    (``layout.recorded()``) the result keeps its graph: differentiable in ``g`` and, through ``J``,
    in the original tensors."""
    graph = recorded()
    with pulling_back(), torch.enable_grad():
        try:
            return list(
                torch.autograd.grad(
                    [w], params, [g], retain_graph=True, create_graph=graph, allow_unused=True, is_grads_batched=True
                )
            )
        except RuntimeError as err:
            if "second time" in str(err) or "freed" in str(err):
                raise _freed(err) from err
        rows = [
            torch.autograd.grad([w], params, [gi], retain_graph=True, create_graph=graph, allow_unused=True) for gi in g
        ]
    return [None if rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _freed(err: Exception) -> HookStateError:
    return HookStateError(
        "the autograd history of a parametrized weight was freed before pergrad could pull the per-sample gradients "
        f"back to its original tensors ({str(err)[:120]}). Run one backward per forward (or retain_graph=True)."
    )


class Capture:
    """The tensors a parametrized layer's parametrizations computed during one of its calls.

    ``start`` runs in the layer's forward pre-hook, ``record`` in each parametrization's forward
    hook (for a hook-based one, in its module's forward hook: the tensor its pre-hook set for the
    call), ``take`` in the layer's forward hook. A tensor read from ``parametrize.cached()``'s cache
    is not computed in the call: it is the cached tensor itself.
    """

    def __init__(self, sites: list[Site]) -> None:
        self.sites = sites
        self._seen: dict[str, list[Tensor]] = {}

    def start(self) -> None:
        self._seen = {}

    def record(self, name: str, tensor: Any) -> None:
        if isinstance(tensor, Tensor):
            self._seen.setdefault(name, []).append(tensor)

    def take(self, label: str) -> dict[str, Tensor]:
        seen, self._seen = self._seen, {}
        out: dict[str, Tensor] = {}
        for site in self.sites:
            name = site.key
            found = seen.get(name, [])
            if len(found) > 1:
                how = (
                    f"Call {site.key.rpartition('.')[0]!r} once per call of the layer."
                    if site.hooked
                    else "Read it once in forward (or run the model under torch.nn.utils.parametrize.cached())."
                )
                raise HookStateError(
                    f"{label} computed its parametrized {name!r} {len(found)} times in one call; pergrad pulls "
                    f"per-sample gradients back through one computation per call. {how}"
                )
            if found:
                out[name] = found[0]
                continue
            # under parametrize.cached() a call after the first reads the cached tensor
            cached = None
            if not site.hooked and parametrize._cache_enabled:
                cached = parametrize._cache.get((id(site.owner), site.tensor))
            if cached is None and "." in name:
                continue  # a submodule this call did not run
            if cached is None:
                raise HookStateError(
                    f"{label} did not compute its parametrized {name!r} in its forward, so pergrad has no "
                    "computation to pull per-sample gradients back through. Read the tensor in the layer's forward."
                )
            out[name] = cached
        return out
