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

``J_P^T`` is applied by differentiating the forward's own computation of ``W``: a forward hook on
the parametrization keeps the ``W`` the call used (with its autograd history), and one batched
``torch.autograd.grad(W, theta, g_W, is_grads_batched=True)`` pulls every sample back, during the
backward, before autograd frees that history. Nothing runs the parametrization again: spectral
norm's power iteration is not advanced a second time and the pull-back uses the same ``u``, ``v``
as the forward; a random parametrization uses the same draw.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .errors import HookStateError
from .registry import RuleSpec
from .shared import pulling_back


@dataclass(frozen=True)
class Computed:
    """What one call of a parametrized layer keeps: the input its base rule takes, and each
    parametrized tensor as that call computed it (``{"weight": W}``)."""

    input: Any
    tensors: dict[str, Tensor]


def parametrizations_of(module: nn.Module) -> nn.ModuleDict:
    """``module.parametrizations``: ``{tensor name: ParametrizationList}``."""
    found = module.parametrizations
    assert isinstance(found, nn.ModuleDict)
    return found


def base_type(module: nn.Module) -> type[nn.Module]:
    """The class of ``module`` before parametrization (``nn.Linear`` for a ``ParametrizedLinear``)."""
    return parametrize.type_before_parametrizations(module)


def parametrized_spec(base: RuleSpec) -> RuleSpec:
    """The rule of a parametrized layer whose base class has the rule ``base``: ``base`` on a
    stand-in holding the computed tensors, then pulled back to the originals (module docstring).
    It covers every parameter of the layer's subtree (the originals live in ``parametrizations``)."""
    base_fn = base.fn

    def parametrized(layer: nn.Module, a: Any, d: Tensor) -> dict[str, Tensor]:
        assert isinstance(a, Computed)
        x = a.input
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != d.dtype:
            x = x.to(d.dtype)  # autocast: the rule computes in the parameters' dtype
        computed = {name: w.detach().to(d.dtype) for name, w in a.tensors.items()}
        grads = base_fn(stand_in(layer, computed), x, d)
        return pull_back(layer, a.tensors, grads)

    parametrized.__qualname__ = f"parametrized({getattr(base_fn, '__qualname__', 'rule')})"
    return RuleSpec(
        parametrized, base.batch_dim_fixed, base.all_inputs, fused=None, subtree=True, parametrized=True
    )  # fmt: skip


def stand_in(module: nn.Module, tensors: dict[str, Tensor]) -> nn.Module:
    """A shallow copy of ``module`` of its class before parametrization, holding ``tensors`` (the
    computed ``weight``, ...) as plain parameters: what the base rule reads. It shares everything
    else (hyperparameters, other parameters, submodules) and has no hooks."""
    twin = base_type(module).__new__(base_type(module))
    state = dict(module.__dict__)
    computed = {name: nn.Parameter(t, requires_grad=bool(originals(module, name))) for name, t in tensors.items()}
    state["_parameters"] = {**module._parameters, **computed}
    state["_modules"] = {k: m for k, m in module._modules.items() if k != "parametrizations"}
    for key, value in state.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = OrderedDict()
    twin.__dict__ = state
    return twin


def originals(module: nn.Module, name: str) -> list[tuple[str, nn.Parameter]]:
    """The trainable tensors the parametrized tensor ``name`` is computed from, named relative to
    ``module``: its originals and the parameters of its parametrization modules."""
    prefix = f"parametrizations.{name}."
    plist = parametrizations_of(module)[name]
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
    per sample where an op of the parametrization has no batching rule."""
    with pulling_back(), torch.enable_grad():
        try:
            return list(
                torch.autograd.grad([w], params, [g], retain_graph=True, allow_unused=True, is_grads_batched=True)
            )
        except RuntimeError as err:
            if "second time" in str(err) or "freed" in str(err):
                raise _freed(err) from err
        rows = [torch.autograd.grad([w], params, [gi], retain_graph=True, allow_unused=True) for gi in g]
    return [None if rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _freed(err: Exception) -> HookStateError:
    return HookStateError(
        "the autograd history of a parametrized weight was freed before pergrad could pull the per-sample gradients "
        f"back to its original tensors ({str(err)[:120]}). Run one backward per forward (or retain_graph=True)."
    )


class Capture:
    """The tensors a parametrized layer's parametrizations computed during one of its calls.

    ``start`` runs in the layer's forward pre-hook, ``record`` in each parametrization's forward
    hook, ``take`` in the layer's forward hook. A tensor read from ``parametrize.cached()``'s cache
    is not computed in the call: it is the cached tensor itself.
    """

    def __init__(self) -> None:
        self._seen: dict[str, list[Tensor]] = {}

    def start(self) -> None:
        self._seen = {}

    def record(self, name: str, tensor: Any) -> None:
        if isinstance(tensor, Tensor):
            self._seen.setdefault(name, []).append(tensor)

    def take(self, module: nn.Module, label: str) -> dict[str, Tensor]:
        seen, self._seen = self._seen, {}
        out: dict[str, Tensor] = {}
        for name in parametrizations_of(module):
            found = seen.get(name, [])
            if len(found) > 1:
                raise HookStateError(
                    f"{label} computed its parametrized {name!r} {len(found)} times in one call; pergrad pulls "
                    "per-sample gradients back through one computation per call. Read it once in forward "
                    "(or run the model under torch.nn.utils.parametrize.cached())."
                )
            if found:
                out[name] = found[0]
                continue
            # under parametrize.cached() a call after the first reads the cached tensor
            cached = parametrize._cache.get((id(module), name)) if parametrize._cache_enabled else None
            if cached is None:
                raise HookStateError(
                    f"{label} did not compute its parametrized {name!r} in its forward, so pergrad has no "
                    "computation to pull per-sample gradients back through. Read the tensor in the layer's forward."
                )
            out[name] = cached
        return out


def parametrized_inside(module: nn.Module) -> str | None:
    """The name of a parametrized module strictly inside ``module`` (outside its own
    ``parametrizations``), or None."""
    for name, m in module.named_modules():
        if name and not name.startswith("parametrizations") and parametrize.is_parametrized(m):
            return name
    return None
