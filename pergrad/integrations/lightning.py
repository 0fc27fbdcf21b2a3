"""Lightning integration: a callback that wraps the LightningModule's network with pergrad for ``fit``.

``PerSample("model", transforms={"": clip_norm(1.0)})`` in ``Trainer(callbacks=[...])`` wraps
``pl_module.model`` (a qualified name inside the LightningModule) when training starts and removes
every hook when it ends; the training step calls ``self.model(x)`` as always. What it takes care of:

- the object to wrap: at ``on_fit_start`` the strategy has built its model. Under ``strategy="ddp"`` the
  network is wrapped as it is, inside the ``DistributedDataParallel`` Lightning put around the
  LightningModule, and pergrad finds that DDP at the first forward (``pergrad._core.parallel.distributed``: the bytes of
  plain DDP, every rank's ``.grad`` the reduction over every rank's samples);
- gradient accumulation: Lightning divides each micro-batch's loss by ``accumulate_grad_batches = k``,
  so the wrapper gets ``loss_scale = 1/k`` (read at each backward: a ``GradientAccumulationScheduler``
  may change k between epochs) and the transforms see each sample's own gradient;
  ``.grad`` is then what plain Lightning computes with each ``g_i`` replaced by ``T(g_i)``;
- ``precision="16-mixed"``: the precision plugin's ``GradScaler`` is the wrapper's ``grad_scaler``;
- Trainer options that would silently defeat per-sample clipping are refused (``LightningOptionError``).

``DPSGD`` (a ``PerSample``) adds DP-SGD from ``pergrad.privacy``: flat clipping, noise once per
optimizer step (``on_before_optimizer_step``, after the step's backward passes, before the optimizer),
Poisson sampling (the train loader must draw its batches with ``pergrad.privacy.PoissonBatchSampler``;
``poisson_loader`` builds one), epsilon logged, and the privacy state in the checkpoints.

Nothing of this module is imported by ``import pergrad``; it needs ``pip install 'pergrad[lightning]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from pergrad import privacy
from pergrad.errors import PergradError
from pergrad.module import PerSampleModule
from pergrad.transforms import ClipNorm, Transform

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pergrad.integrations.lightning needs Lightning: pip install 'pergrad[lightning]' "
        "(in a clone of pergrad: pip install -e '.[lightning]')"
    ) from err


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
                f"pergrad.integrations.lightning is tested with strategy='auto' on one device and strategy='ddp', not with "
                f"{type(strategy).__name__}; its per-sample gradients are not known to be exact there. Use "
                "strategy='ddp' (or one device)."
            )
        if isinstance(strategy, DDPStrategy) and self.module_name == "":  # static_graph=True: pergrad refuses it
            raise LightningOptionError(
                "under strategy='ddp' Lightning runs training_step as the forward of the LightningModule, so the "
                "LightningModule itself cannot be the wrapped network: keep the network in an attribute "
                "(self.model = nn.Sequential(...)), call self.model(x) in training_step and pass "
                "PerSample('model', ...)."
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
            # read at each backward: a GradientAccumulationScheduler changes k between epochs
            loss_scale=lambda: 1.0 / trainer.accumulate_grad_batches,
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


class DPSGD(PerSample):
    """DP-SGD in Lightning: ``PerSample`` with ``pergrad.privacy.DPSGD``'s clipping, noise and accounting.

    Per optimizer step ``.grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / (q N)``, the sum over every
    sample of the step's micro-batches (and, under DDP, of every rank), ``q N`` the expected batch size.
    The train loader must draw its batches with ``pergrad.privacy.PoissonBatchSampler`` (``poisson_loader``
    builds one), with ``micro_batches=accumulate_grad_batches``; ``q`` and ``N`` are read from it.

    Args:
        module: as for ``PerSample``.
        max_grad_norm: the clipping bound ``C`` (flat: one norm over all of ``target``).
        noise_multiplier: ``sigma``; ``pergrad.privacy.noise_multiplier_for`` finds it for a target epsilon.
        delta: the delta the logged epsilon is for.
        target: the module clipped and noised, relative to the network (default: all of it; other
            trainable parameters are refused).
        generator: a noise generator of yours, for reproducible noise (default: seeded from the operating
            system's entropy, rank 0's under DDP; see ``pergrad.privacy.DPSGD``).
        accountant: ``"rdp"`` or ``"pld"`` (``dp_accounting``).
        log_epsilon: ``"epoch"`` (default), ``"step"`` or None: ``pl_module.log("epsilon", ...)``.
        **options: ``PerSampleModule``'s; ``reduction`` defaults to ``"sum"`` (what DDP needs; the
            normalisation is DPSGD's).

    ``callback.dp`` is the ``pergrad.privacy.DPSGD`` (``dp.steps``, ``dp.epsilon(delta)``) from
    ``on_train_start``, on the Trainer's one optimizer: every optimizer step is checked to train on one
    Poisson draw of the loader's sampler, and an optimizer that steps a trainable parameter outside the
    clipped network (a learned temperature, a head beside ``self.model``) is refused, as is
    ``limit_train_batches`` that cuts an epoch inside an accumulation window. Checkpoints keep the steps
    taken and, for generators you passed, their states: such a resume continues exactly as the
    uninterrupted run; without them it draws afresh (never a batch or a noise again). A second ``fit``
    with the same callback continues the accounting.
    """

    def __init__(
        self,
        module: str,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        delta: float,
        target: str | None = None,
        generator: torch.Generator | None = None,
        accountant: str = "rdp",
        log_epsilon: str | None = "epoch",
        **options: Any,
    ) -> None:
        if "transforms" in options:
            raise TypeError("DPSGD registers the clipping itself; other transforms cannot share its parameters")
        if log_epsilon not in ("epoch", "step", None):
            raise ValueError(f"log_epsilon must be 'epoch', 'step' or None, got {log_epsilon!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        options.setdefault("reduction", "sum")
        options.setdefault("keep_grad_sample", False)  # (DPSGD refuses True: raw per-sample gradients on the model)
        super().__init__(module, **options)
        self.max_grad_norm, self.noise_multiplier, self.delta = max_grad_norm, noise_multiplier, delta
        self.target, self.generator, self.accountant, self.log_epsilon = target, generator, accountant, log_epsilon
        self.dp: privacy.DPSGD | None = None
        self.sampler: privacy.PoissonBatchSampler | None = None
        self._pending: dict[str, Any] | None = None  # loaded from a checkpoint before the DPSGD exists

    def _clips(self) -> bool:
        return True

    def _remove(self) -> None:
        if self.dp is not None:
            self.dp.remove()  # its state stays readable: steps, epsilon
        super()._remove()

    def _poisson_sampler(self, trainer: pl.Trainer) -> privacy.PoissonBatchSampler:
        loader = trainer.train_dataloader
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, privacy.PoissonBatchSampler):
            raise LightningOptionError(
                f"DP-SGD's privacy accounting assumes Poisson sampling, but the train loader draws its batches with "
                f"{type(sampler).__name__ if sampler is not None else type(loader).__name__}. Build it with "
                "pergrad.integrations.lightning.poisson_loader(dataset, sample_rate, trainer=self.trainer) in train_dataloader() "
                "(a DataLoader with batch_sampler=pergrad.privacy.PoissonBatchSampler(...) and collate_fn="
                "collate_with_empty(dataset)); under strategy='ddp' also pass Trainer(use_distributed_sampler=False)."
            )
        k = trainer.accumulate_grad_batches
        if sampler.micro_batches != k:
            raise LightningOptionError(
                f"Trainer(accumulate_grad_batches={k}) but the PoissonBatchSampler splits each step's draw into "
                f"micro_batches={sampler.micro_batches}: an optimizer step would not see one Poisson sample. Pass "
                f"micro_batches={k} (poisson_loader(..., trainer=self.trainer) does)."
            )
        if (sampler.num_replicas, sampler.rank) != (trainer.world_size, trainer.global_rank):
            raise LightningOptionError(
                f"the PoissonBatchSampler has num_replicas={sampler.num_replicas}, rank={sampler.rank}; this process "
                f"is rank {trainer.global_rank} of {trainer.world_size}: the ranks would not share one Poisson draw. "
                "Pass num_replicas=trainer.world_size, rank=trainer.global_rank (poisson_loader(..., "
                "trainer=self.trainer) does)."
            )
        return sampler

    def _optimizer(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.optim.Optimizer:
        if len(trainer.optimizers) != 1:
            raise LightningOptionError(
                f"DPSGD takes a LightningModule with one optimizer (configure_optimizers returned "
                f"{len(trainer.optimizers)}): each optimizer step adds the noise and counts as one DP-SGD step"
            )
        optimizer = trainer.optimizers[0]
        assert self.psm is not None
        clipped = {id(p) for p in self.psm.module.parameters()}
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        outside = [n for n, p in pl_module.named_parameters() if id(p) in stepped and id(p) not in clipped]
        if outside:
            raise LightningOptionError(
                f"the optimizer steps {outside[:3]}{' ...' if len(outside) > 3 else ''}, trainable parameters of "
                f"{type(pl_module).__name__} outside the network DPSGD clips ({self.module_name!r}): their raw, "
                "noiseless gradients would be stepped, and training on them is not private. Move them into "
                f"self.{self.module_name or 'model'} (so they are clipped with it), freeze them, or give the optimizer "
                f"only self.{self.module_name or 'model'}.parameters()"
            )
        return optimizer

    def _check_window(self, trainer: pl.Trainer) -> None:
        k, batches = trainer.accumulate_grad_batches, trainer.num_training_batches
        if isinstance(batches, int) and batches % k:
            raise LightningOptionError(
                f"an epoch has {batches} micro-batches (limit_train_batches?), not a multiple of "
                f"accumulate_grad_batches={k}: its last optimizer step would train on part of a Poisson draw, which "
                "the accounting does not cover. Make limit_train_batches a multiple of accumulate_grad_batches (or "
                "leave it unset)"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.psm is not None
        sampler = self._poisson_sampler(trainer)
        self._check_window(trainer)
        optimizer = self._optimizer(trainer, pl_module)
        before = self.dp.state_dict() if self.dp is not None else None  # a second fit continues the accounting
        if self.dp is not None:
            self.dp.remove()
        self.dp = privacy.DPSGD(
            self.psm,
            optimizer,
            sampler,
            max_grad_norm=self.max_grad_norm,
            noise_multiplier=self.noise_multiplier,
            target=self.target,
            generator=self.generator,
            accountant=self.accountant,
        )
        self.sampler = sampler
        if self._pending is not None:
            self.dp.load_state_dict(self._pending["dp"])
            if self._pending.get("sampler") is not None:
                sampler.load_state_dict(self._pending["sampler"])
            self._pending = None
        elif before is not None:
            self.dp.load_state_dict(before)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is not None and self.sampler.micro_batches != trainer.accumulate_grad_batches:
            raise LightningOptionError(
                f"accumulate_grad_batches changed to {trainer.accumulate_grad_batches} (a GradientAccumulationScheduler?) "
                f"but the PoissonBatchSampler splits each draw into {self.sampler.micro_batches} micro-batches: an "
                "optimizer step would not see one Poisson sample. Keep accumulate_grad_batches fixed under DP-SGD."
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        assert self.dp is not None
        self.dp.add_noise()
        if self.log_epsilon == "step":
            pl_module.log("epsilon", self.dp.epsilon(self.delta), on_step=True, on_epoch=False)  # same on every rank

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.log_epsilon == "epoch" and self.dp is not None:
            epsilon = self.dp.epsilon(self.delta)  # the same on every rank
            pl_module.log("epsilon", epsilon, on_step=False, on_epoch=True, sync_dist=trainer.world_size > 1)

    def state_dict(self) -> dict[str, Any]:
        """The privacy state (``DPSGD.state_dict``: steps, noise generator) and the sampler's."""
        if self.dp is None:
            return dict(self._pending or {})
        return {"dp": self.dp.state_dict(), "sampler": None if self.sampler is None else self.sampler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores callbacks before ``on_train_start`` builds the DPSGD: kept until then."""
        self._pending = dict(state_dict) if state_dict else None
        if self._pending is not None and self.dp is not None and self.sampler is not None:
            self.dp.load_state_dict(self._pending["dp"])
            self.sampler.load_state_dict(self._pending["sampler"])
            self._pending = None


def poisson_loader(
    dataset: Any,
    sample_rate: float,
    *,
    trainer: pl.Trainer | None = None,
    steps: int | None = None,
    generator: torch.Generator | None = None,
    secure_mode: bool = False,
    **loader_options: Any,
) -> DataLoader[Any]:
    """A ``DataLoader`` over ``dataset`` whose batches are Poisson samples (``pergrad.privacy``), for
    ``DPSGD``: each index joins a step's batch with probability ``sample_rate``; ``len`` is ``steps``
    (default ``round(1 / sample_rate)``, one epoch in expectation) times the micro-batches. ``trainer``
    (``self.trainer`` in ``train_dataloader()``) gives the ranks (``world_size``, ``global_rank``) and
    ``accumulate_grad_batches`` (each step's draw split into that many micro-batches). Empty batches are
    collated to tensors of 0 rows (``collate_with_empty``; ``collate_fn=`` wraps yours). The draws come from
    the operating system's entropy, a cryptographically secure stream (``secure_mode=True``), or a
    ``generator`` of yours (reproducible batches; its seed must stay secret); see ``PoissonBatchSampler``."""
    for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
        if name in loader_options:
            raise TypeError(f"poisson_loader draws the batches itself: do not pass {name}=")
    sampler = privacy.PoissonBatchSampler(
        len(dataset),
        sample_rate,
        steps=steps,
        generator=generator,
        num_replicas=trainer.world_size if trainer is not None else 1,
        rank=trainer.global_rank if trainer is not None else 0,
        micro_batches=trainer.accumulate_grad_batches if trainer is not None else 1,
        secure_mode=secure_mode,
    )
    collate = privacy.collate_with_empty(dataset, loader_options.pop("collate_fn", None))
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_options)


def per_sample_module(pl_module: pl.LightningModule) -> PerSampleModule:
    """The ``PerSampleModule`` a ``PerSample`` callback of ``pl_module``'s Trainer holds (during ``fit``)."""
    for callback in pl_module.trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, PerSample) and callback.psm is not None:
            return callback.psm
    raise PergradError(
        f"{type(pl_module).__name__}'s Trainer has no PerSample callback holding a wrapper: pass "
        "Trainer(callbacks=[pergrad.integrations.lightning.PerSample('model', ...)]); the wrapper exists from on_fit_start to the "
        "end of fit."
    )
