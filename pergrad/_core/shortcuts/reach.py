"""What reaches a parameter whose ``.grad`` pergrad writes, besides its layers' own outputs.

pergrad writes the ``.grad`` of a parameter a transform covers from its per-sample gradients, so
autograd's sum arriving at its ``AccumulateGrad`` node is not used. That sum must hold nothing but
what the parameter's layers sent it: a term of the loss that uses the parameter directly (a
regulariser switched on at some step) would be dropped. The first backward's check compares values;
the later ones compare by identity, with no host sync:

- for each forward, every hooked layer call reads the parameter through one *tap*, an alias of it
  (``aten.alias``, whose backward passes its gradient on as the very same tensor), swapped into the
  layer's ``_parameters`` for the call and shared by every call and every layer holding it (a layer
  called twice, tied weights): whatever the layers send the parameter meets in the tap's node;
- a hook on the tap keeps the gradient it passes on; the ``AccumulateGrad`` pre-hook then gets that
  very tensor, unless something else reached the parameter too (autograd then sums into another
  tensor: the kept one is referenced, so it is never summed into in place). Only then are the values
  compared (a host sync): a term that is exactly zero (``loss + 0 * p.sum()``) is let through.

The user's tensor hooks on a parameter (``p.register_hook``: a gradient logger, a hook that rescales)
run in its ``AccumulateGrad`` node before pergrad's pre-hook, and may return another tensor. pergrad
keeps a hook of its own first among them (``Unhooked``): it sees the sum autograd hands the node
before any of the user's hooks, which is what the tap is compared with (and what the first backward's
check and the statistics read as autograd's gradient).

Not tapped (left as before): parameters that run detached (their ``AccumulateGrad`` runs only when
something else reaches them, see ``Engine.on_accumulate``), layers whose rule covers a subtree or
parametrized tensors, layers that do not read their parameters from ``_parameters`` at call time
(``nn.RNN``'s flat weights: the tap never fires, so nothing is compared), FSDP2, ``verify=False``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pergrad._core.shortcuts.followed import eager_hook


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) holding its object weakly, for a hook that autograd keeps (on a tensor or a node of
    pergrad's): Python's collector does not follow references through autograd, so a strong one would keep a
    dropped wrapper alive for good."""
    ref = weakref.WeakMethod(method)

    @eager_hook
    def call(*args: Any) -> Any:
        found = ref()
        return None if found is None else found(*args)

    return call


class Taps:
    """The tap of each parameter that is checked, one per forward of the model."""

    def __init__(self, wanted: Callable[[nn.Parameter], bool], on_grad: Callable[[nn.Parameter, Tensor], None]) -> None:
        self._wanted, self._on_grad = wanted, on_grad
        self._generation = -1
        self._taps: dict[nn.Parameter, Tensor] = {}

    def tap(self, p: Tensor | None, generation: int) -> Tensor | None:
        """The tap the layers of forward ``generation`` read ``p`` through, or None where ``p`` is
        not checked (not a parameter pergrad writes, or detached for the call)."""
        if generation != self._generation:
            self._generation, self._taps = generation, {}
        if not (isinstance(p, nn.Parameter) and p.requires_grad and self._wanted(p)):
            return None
        found = self._taps.get(p)
        if found is None:
            found = self._taps[p] = torch.ops.aten.alias(p)
            on_grad = weakref.WeakMethod(self._on_grad)  # (autograd holds the hook: see ``weakly``; inline, per step)
            # on the tap's node, which gets the gradient of the tap alone (cheaper than a hook on the tensor)
            found.grad_fn.register_prehook(
                eager_hook(lambda grads: None if (seen := on_grad()) is None or grads[0] is None else seen(p, grads[0]))
            )
        return found

    def clear(self) -> None:
        self._generation, self._taps = -1, {}


class _First:
    """pergrad's tensor hook on a parameter (``Unhooked``): hands on the gradient it sees, changes nothing.
    Copied or pickled (should a copy of the parameter carry its hooks), it becomes one that does nothing."""

    def __init__(self, param: nn.Parameter, on_grad: Callable[[nn.Parameter, Tensor], None]) -> None:
        self.param, self.on_grad = weakref.ref(param), on_grad

    def __call__(self, grad: Tensor) -> None:
        param = self.param()
        if param is not None:
            self.on_grad(param, grad)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Passive:
        return _Passive()

    def __reduce__(self) -> tuple[type[_Passive], tuple[()]]:
        return (_Passive, ())


class _Passive:
    """What ``_First`` becomes in a copy: a tensor hook that does nothing."""

    def __call__(self, grad: Tensor) -> None:
        return None


def user_hooks(p: Tensor) -> bool:
    """Whether ``p.register_hook`` hooks of the user's are on ``p`` (pergrad's own ``_First`` left out)."""
    hooks = p._backward_hooks
    if not hooks:
        return False
    return any(not isinstance(hook, _First) for hook in hooks.values())


class Unhooked:
    """Keeps a hook of pergrad's first among the ``register_hook`` hooks of each parameter that has hooks
    of the user's, so that ``on_grad(param, grad)`` gets the gradient autograd summed for it before any
    of them ran (each may return another tensor, which the next one and ``AccumulateGrad`` get instead).

    Autograd calls a parameter's hooks in the order of its ``_backward_hooks`` dict as stored (the dict
    itself is what autograd holds): pergrad's is put first by taking the user's out and putting them
    back after it, their own order kept and their handles still valid. Parameters without hooks of the
    user's get none of pergrad's."""

    def __init__(self, on_grad: Callable[[nn.Parameter, Tensor], None]) -> None:
        self._on_grad = on_grad
        self._keys: dict[nn.Parameter, int] = {}  # parameter -> the key of pergrad's hook in its dict

    def place(self, params: Iterable[nn.Parameter]) -> None:
        """Put pergrad's hook first on each of ``params`` with hooks of the user's, and take it off
        those left with none."""
        for p in params:
            hooks, key = p._backward_hooks, self._keys.get(p)
            if hooks:
                self._first(p, hooks, key)
            elif key is not None:
                del self._keys[p]

    def _first(self, p: nn.Parameter, hooks: dict[int, Any], key: int | None) -> None:
        """Put pergrad's hook (under ``key``, None: not yet made) first among ``p``'s ``hooks``, or take it
        off where the user's are gone."""
        if key is not None and key in hooks:
            if len(hooks) == 1:  # the user's are gone
                del hooks[key], self._keys[p]
                return
            if next(iter(hooks)) == key:
                return
            ours = hooks.pop(key)
        else:
            ours, key = _First(p, self._on_grad), RemovableHandle(hooks).id  # (a key no handle will take)
        theirs = list(hooks.items())
        hooks.clear()
        hooks[key] = ours
        hooks.update(theirs)
        self._keys[p] = key

    def clear(self) -> None:
        """Take pergrad's hooks off every parameter (the user's stay, in their order)."""
        for p, key in self._keys.items():
            hooks = p._backward_hooks
            if hooks is not None:
                hooks.pop(key, None)
        self._keys.clear()
