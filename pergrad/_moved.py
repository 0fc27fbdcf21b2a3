"""The modules that moved in 0.2's layout (``pergrad/_core``, ``integrations``, ``attribution``, ``cli``):
importing one by its old path still works for this release, with a ``DeprecationWarning`` naming the new
one. The old name and the new one are the same module object."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    "audit": "privacy.audit",
    "backward": "_core.backward.state",
    "calls": "_core.capture.calls",
    "captum": "integrations.captum",
    "consumers": "_core.consumers",
    "consumers.factors": "attribution.factors",
    "consumers.grad_sample": "_core.consumers.grad_sample",
    "consumers.norms": "_core.consumers.norms",
    "consumers.projection": "attribution.projection",
    "consumers.reduction": "_core.consumers.reduction",
    "consumers.statistics": "_core.consumers.statistics",
    "convert": "_core.convert",
    "coupling": "_core.capture.coupling",
    "demo": "cli.demo",
    "detach": "_core.shortcuts.detach",
    "dims": "_core.capture.dims",
    "discover": "_core.capture.discover",
    "distributed": "_core.parallel.distributed",
    "engine": "_core.backward.engine",
    "grads": "_core.backward.grads",
    "hf": "integrations.hf",
    "hooks": "_core.capture.hooks",
    "layout": "_core.memory.layout",
    "lightning": "integrations.lightning",
    "lm_loss": "integrations.lm",
    "loss_scale": "_core.loss_scale",
    "parametrized": "_core.capture.parametrized",
    "pool": "_core.memory.pool",
    "projectors": "attribution.projectors",
    "reach": "_core.shortcuts.reach",
    "removal": "_core.backward.removal",
    "shared": "_core.shortcuts.shared",
    "sources": "_core.backward.sources",
    "targets": "_core.backward.targets",
    "verify": "_core.backward.verify",
    "world": "_core.parallel.world",
}


def moved(old: str) -> ModuleType:
    """The module that ``pergrad.<old>`` names now, with the warning that says where it lives."""
    new = f"pergrad.{MOVED[old]}"
    warnings.warn(
        f"pergrad.{old} moved to {new}; import it from there (the old path goes in pergrad 0.3)",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    # under the old name too: ``pergrad.hf`` read as an attribute, then ``import pergrad.hf``, warns once
    sys.modules.setdefault(f"pergrad.{old}", module)
    return module


class _Loader(importlib.abc.Loader):
    def __init__(self, old: str) -> None:
        self.old = old

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = moved(self.old)
        self.spec = module.__spec__  # the import system sets the old name's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its new name already: its own spec goes back (``importlib.resources``,
        ``importlib.reload`` and submodule lookups read it)."""
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        old = fullname.removeprefix("pergrad.")
        if fullname.startswith("pergrad.") and old in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Loader(old))
        return None


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
