"""Lightning integration: a callback that wraps the LightningModule's network with pergrad for ``fit``.

``PerSample("model", transforms={"": clip_norm(1.0)})`` in ``Trainer(callbacks=[...])`` wraps
``pl_module.model`` (a qualified name inside the LightningModule) when training starts and removes
every hook when it ends; the training step calls ``self.model(x)`` as always. What it takes care of:

- the object to wrap: at ``on_fit_start`` the strategy has built its model. Under ``strategy="ddp"`` the
  network is wrapped as it is, inside the ``DistributedDataParallel`` Lightning put around the
  LightningModule, and pergrad finds that DDP at the first forward (``pergrad.distributed``: the bytes of
  plain DDP, every rank's ``.grad`` the reduction over every rank's samples);
- gradient accumulation: Lightning divides each micro-batch's loss by ``accumulate_grad_batches = k``,
  so the wrapper gets ``loss_scale = 1/k`` and the transforms see each sample's own gradient;
  ``.grad`` is then what plain Lightning computes with each ``g_i`` replaced by ``T(g_i)``;
- ``precision="16-mixed"``: the precision plugin's ``GradScaler`` is the wrapper's ``grad_scaler``;
- Trainer options that would silently defeat per-sample clipping are refused (``LightningOptionError``).

``DPSGD`` (a ``PerSample``) adds DP-SGD from ``pergrad.privacy``: flat clipping, noise once per
optimizer step (``on_before_optimizer_step``, after the step's backward passes, before the optimizer),
Poisson sampling (the train loader must draw its batches with ``pergrad.privacy.PoissonBatchSampler``;
``poisson_loader`` builds one), epsilon logged, and the privacy state in the checkpoints.

Nothing of this module is imported by ``import pergrad``; it needs ``pip install pergrad[lightning]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .errors import PergradError
from .module import PerSampleModule
from .transforms import ClipNorm, Transform

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("pergrad.lightning needs Lightning: pip install 'pergrad[lightning]'") from err


class LightningOptionError(PergradError, ValueError):
    """A Trainer option (or the way the LightningModule is set up) that would make ``.grad`` something
    other than what the registered per-sample transforms define, or that pergrad cannot make exact."""


TransformLike = Transform | Callable[[Any], Any]


class PerSample(Callback):
    """Wrap ``pl_module.<module>`` in a ``PerSampleModule`` for the length of ``Trainer.fit``.

    Args:
        module: qualified name of the network inside the LightningModule (``"model"`` for
            ``self.model``, ``"backbone.head"``); ``""`` for the LightningModule itself (one process only).
        transforms: ``{target: transform}`` registered on the wrapper, targets named relative to the
            wrapped network (``""``: all of it; ``"0.weight"``), as ``register_transform`` takes them.
        **options: keyword arguments of ``PerSampleModule`` (``keep_grad_sample``, ``track_statistics``,
            ``loss_reduction``, ...). ``loss_scale`` and ``grad_scaler`` are set from the Trainer.

    The wrapper is ``callback.psm`` from ``on_fit_start`` (the callback's runs before the
    LightningModule's) to the end of ``fit``; ``per_sample_module(pl_module)`` finds it from the module.
    """

    def __init__(self, module: str, *, transforms: Mapping[str, TransformLike] | None = None, **options: Any) -> None:
        for name in ("loss_scale", "grad_scaler"):
            if name in options:
                raise TypeError(
                    f"PerSample sets {name} itself (from accumulate_grad_batches and the precision plugin's scaler); "
                    f"do not pass {name}="
                )
        self.module_name = module
        self.transforms = dict(transforms or {})
        self.options = options
        self.psm: PerSampleModule | None = None

    # -- what may be trained with per-sample transforms --------------------------------------------

    def _clips(self) -> bool:
        """Whether ``.grad`` is meant to hold per-sample clipped gradients (aggregate clipping would undo it)."""
        return any(isinstance(t, ClipNorm) for t in self.transforms.values())

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._clips() and trainer.gradient_clip_val:
            raise LightningOptionError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips the batch's summed gradient after "
                "pergrad wrote (1/B) sum_i clip(g_i) into .grad: the result is no longer per-sample clipping (for "
                "DP-SGD, the noise scale no longer matches the sensitivity). Per-sample clipping is the clip_norm "
                "transform you registered; remove gradient_clip_val from the Trainer."
            )
        strategy = trainer.strategy
        if type(strategy) not in (SingleDeviceStrategy, DDPStrategy):
            raise LightningOptionError(
                f"pergrad.lightning is tested with strategy='auto' on one device and strategy='ddp', not with "
                f"{type(strategy).__name__}; its per-sample gradients are not known to be exact there. Use "
                "strategy='ddp' (or one device)."
            )
        if isinstance(strategy, DDPStrategy):
            if self.module_name == "":
                raise LightningOptionError(
                    "under strategy='ddp' Lightning runs training_step as the forward of the LightningModule, so the "
                    "LightningModule itself cannot be the wrapped network: keep the network in an attribute "
                    "(self.model = nn.Sequential(...)), call self.model(x) in training_step and pass "
                    "PerSample('model', ...)."
                )
            if strategy._ddp_kwargs.get("static_graph"):
                raise LightningOptionError(
                    "DDPStrategy(static_graph=True): pergrad writes part of .grad after DDP's buckets are set up "
                    "and cannot follow a static graph; remove static_graph=True."
                )

    def _network(self, pl_module: pl.LightningModule) -> nn.Module:
        try:
            return pl_module.get_submodule(self.module_name)
        except AttributeError as err:
            children = [name for name, _ in pl_module.named_children()]
            raise LightningOptionError(
                f"PerSample({self.module_name!r}): {type(pl_module).__name__} has no submodule {self.module_name!r} "
                f"({err}); its children are {children}. Pass the qualified name of the network its training_step "
                "calls."
            ) from None

    # -- Lightning's hooks ----------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, pl_module)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        psm = PerSampleModule(
            self._network(pl_module),
            loss_scale=1.0 / trainer.accumulate_grad_batches,
            grad_scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None,
            **self.options,
        )
        try:
            for target, fn in self.transforms.items():
                psm.register_transform(target, fn)
        except BaseException:
            psm.remove()
            raise
        self.psm = psm

    def _remove(self) -> None:
        if self.psm is not None:
            self.psm.remove()
            self.psm = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove()


def per_sample_module(pl_module: pl.LightningModule) -> PerSampleModule:
    """The ``PerSampleModule`` a ``PerSample`` callback of ``pl_module``'s Trainer holds (during ``fit``)."""
    for callback in pl_module.trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, PerSample) and callback.psm is not None:
            return callback.psm
    raise PergradError(
        f"{type(pl_module).__name__}'s Trainer has no PerSample callback holding a wrapper: pass "
        "Trainer(callbacks=[pergrad.lightning.PerSample('model', ...)]); the wrapper exists from on_fit_start to the "
        "end of fit."
    )
