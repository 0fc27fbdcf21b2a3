"""pergrad with HuggingFace's ``Trainer``: ``PerSampleTrainer`` (``pip install 'pergrad[hf]'``).

``PerSampleTrainer`` is a ``transformers.Trainer`` that wraps its model in a ``PerSampleModule`` in
``__init__`` (``trainer.psm``) and trains on each sample's OWN loss:

- the loss is ``(1/B) sum_i f_i`` with ``f_i`` computed from the model's outputs for sample i alone
  (``per_sample_loss(outputs, labels) -> [B]``; by default a causal LM's ``per_sample_lm_loss``, a
  sequence classifier's cross entropy / MSE / BCE per sample, a token classifier's sum over its tokens),
  never the model's own ``labels=`` loss (a mean over the batch's tokens) nor ``num_items_in_batch``;
- gradient accumulation: the wrapper averages over samples (``accumulate="samples"``) and the loss
  is not divided by the number of micro-batches (``loss_is_scaled_for_ga = True``), so every optimizer
  step's ``.grad`` is exactly ``mean_i T(g_i)`` over every sample of the step, whatever the micro-batch
  sizes (the last, smaller micro-batch of an epoch included);
- DP-SGD (``privacy=DPConfig(...)``, ``pergrad.privacy``): Poisson batches with the expected size of
  the ``TrainingArguments`` (``per_device_train_batch_size * gradient_accumulation_steps * world_size``),
  each split into ``gradient_accumulation_steps`` micro-batches (every rank runs the forward and backward
  of each, an empty one included), flat per-sample clipping with ``DPSGD``'s ``1/E[B]`` normalisation
  (the wrapper then uses ``reduction="sum"``, ``accumulate="backward"``: each backward adds ``sum_i
  clip(g_i) / E[B]``), the noise added once per optimizer step (``on_pre_optimizer_step``), the steps
  taken kept in the checkpoints (``pergrad_dp.pt`` in it), ``epsilon`` in the logs. The batches and the
  noise are seeded from the operating system's entropy, never from ``TrainingArguments.seed`` (a public
  seed would give away the batches or the noise); a resumed run draws new batches (Trainer's skipping of
  the batches already trained is off: it would draw batches and throw them away).

Tested on one process and on two (``torchrun``-style, gloo on CPU: DDP, which pergrad finds at its first
forward; the Poisson draw shared out over the ranks).

Options of ``TrainingArguments`` that would silently change these numbers are refused with a
``pergrad.TrainerConfigError`` (``max_grad_norm > 0`` with clipping, ``label_smoothing_factor``,
``nn.DataParallel``, DeepSpeed, FSDP, Liger kernels, LOMO, ``model_init``, a ``compute_loss_func``).

Why a ``Trainer`` subclass and not a ``TrainerCallback`` alone: a callback sees neither the loss nor
the data loader, and runs after ``Trainer.__init__`` has prepared the model; the loss (per sample),
the Poisson batch sampler and the arguments check all need the Trainer's own methods. The noise goes
in through ``on_pre_optimizer_step`` (the one point between the last backward and ``optimizer.step()``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments

from pergrad.integrations.errors import TrainerConfigError
from pergrad.integrations.lm import IGNORE_INDEX, per_sample_lm_loss
from pergrad.module import PerSampleModule
from pergrad.privacy import DPSGD, PoissonBatchSampler, collate_with_empty
from pergrad.transforms import Transform

PerSampleLoss = Callable[[Any, Any], Tensor]  # (outputs, labels) -> [B]: each sample's own loss

DP_STATE = "pergrad_dp.pt"  # in a checkpoint folder: the DP-SGD state (steps, noise generator)


@dataclass
class DPConfig:
    """DP-SGD for ``PerSampleTrainer(privacy=...)``: clip each sample's gradient over ``target`` (the
    whole model by default) to ``max_grad_norm``, add ``N(0, (noise_multiplier * max_grad_norm)^2)``
    once per optimizer step, divide by the expected batch size; Poisson batches. ``epsilon`` at
    ``delta`` is logged (``accountant``: ``"rdp"`` or ``"pld"``, dp-accounting).

    The batches and the noise come from the operating system's entropy (``secure_mode=True``: from a
    cryptographically secure stream, see ``pergrad.privacy.randomness``). ``seed`` makes the BATCHES
    reproducible (never the noise, never ``TrainingArguments.seed``): the privacy then rests on it being
    secret, and a checkpoint holds the sampler's state (keep it private)."""

    max_grad_norm: float
    noise_multiplier: float
    delta: float
    accountant: str = "rdp"
    target: nn.Module | str | None = None
    seed: int | None = None
    secure_mode: bool = False


# -- each sample's own loss -------------------------------------------------------------------------


def _logits(outputs: Any) -> Tensor:
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, tuple | list):
        return outputs[0]
    if isinstance(outputs, Tensor):
        return outputs
    raise TrainerConfigError(
        f"the model returned {type(outputs).__name__} without logits; pass PerSampleTrainer(per_sample_loss=fn) with "
        "fn(outputs, labels) -> [B], each sample's own loss"
    )


class DefaultLoss:
    """Each sample's own loss from a HuggingFace model's logits, ``[B]``, as the model's own loss would
    compute it for that sample alone: a causal LM's next-token loss (``shift``) or a token classifier's,
    summed (``token_reduction="sum"``) or averaged over the sample's own labelled tokens; a sequence
    classifier's cross entropy (``problem_type`` single-label), squared error (regression) or binary
    cross entropy averaged over the labels (multi-label)."""

    def __init__(self, *, shift: bool, problem_type: str | None, num_labels: int | None, token_reduction: str) -> None:
        self.shift, self.problem_type, self.num_labels = shift, problem_type, num_labels
        self.token_reduction = token_reduction

    def __call__(self, outputs: Any, labels: Any) -> Tensor:
        logits = _logits(outputs)
        if not isinstance(labels, Tensor):
            raise TrainerConfigError(
                f"the default per-sample loss takes one label tensor, got {type(labels).__name__}; pass "
                "PerSampleTrainer(per_sample_loss=fn) with fn(outputs, labels) -> [B]"
            )
        if labels.dim() >= 2 and not labels.is_floating_point() and logits.dim() == labels.dim() + 1:
            return per_sample_lm_loss(logits, labels, reduction=self.token_reduction, shift=self.shift)
        problem = self.problem_type
        if problem is None:
            if self.num_labels == 1:
                problem = "regression"
            elif not labels.is_floating_point():
                problem = "single_label_classification"
            else:
                problem = "multi_label_classification"
        if problem == "regression":  # HF: MSE over every label of the batch; per sample: the mean over its own
            error = logits.view(labels.shape[0], -1) - labels.view(labels.shape[0], -1).to(logits.dtype)
            return error.square().mean(1)
        if problem == "single_label_classification":
            return F.cross_entropy(logits.view(labels.shape[0], -1), labels.view(-1), reduction="none")
        if problem == "multi_label_classification":
            bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
            return bce.flatten(1).mean(1)
        raise TrainerConfigError(
            f"no default per-sample loss for problem_type {problem!r}; pass PerSampleTrainer(per_sample_loss=fn)"
        )


def default_loss(model: nn.Module, token_reduction: str = "sum") -> DefaultLoss:
    """The ``DefaultLoss`` for ``model`` (a ``PreTrainedModel``, or a peft model around one)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model
    get_base = getattr(model, "get_base_model", None)  # peft
    if callable(get_base):
        base = get_base()
    config = getattr(base, "config", None)
    # a causal LM predicts the next token: by its loss type, or (GPT2LMHeadModel has none) by its class
    causal = LOSS_MAPPING.get(str(getattr(base, "loss_type", None))) is ForCausalLMLoss
    causal = causal or type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    shift = causal and not getattr(config, "is_encoder_decoder", False)
    return DefaultLoss(
        shift=shift,
        problem_type=getattr(config, "problem_type", None),
        num_labels=getattr(config, "num_labels", None),
        token_reduction=token_reduction,
    )


# -- refusals ----------------------------------------------------------------------------------------


def check_arguments(args: TrainingArguments, *, clips: bool, private: bool) -> None:
    """Refuse the ``TrainingArguments`` that would silently change the per-sample numbers."""
    fix_end = "(pergrad.integrations.hf.PerSampleTrainer)"
    if clips and args.max_grad_norm and args.max_grad_norm > 0:
        raise TrainerConfigError(
            f"TrainingArguments(max_grad_norm={args.max_grad_norm}) clips the norm of the AGGREGATE gradient after "
            "pergrad clipped each sample's: that is not per-sample clipping (DP-SGD's sensitivity bound is the "
            "per-sample one, and the aggregate clip rescales the noise too). Set TrainingArguments(max_grad_norm=0) "
            f"{fix_end}; the per-sample bound is DPConfig(max_grad_norm=...) or your clip_norm transform."
        )
    if args.label_smoothing_factor:
        raise TrainerConfigError(
            f"TrainingArguments(label_smoothing_factor={args.label_smoothing_factor}) makes Trainer compute the loss "
            "with its LabelSmoother, a mean over all tokens of the batch, not a sum of per-sample losses. Set it to 0 "
            "and pass per_sample_loss=fn with F.cross_entropy(..., label_smoothing=..., reduction='none') per sample."
        )
    if args.n_gpu > 1:
        raise TrainerConfigError(
            f"this process sees {args.n_gpu} GPUs, so Trainer would train through nn.DataParallel, whose replicas "
            "run outside the wrapped model's hooks. Launch one process per GPU (torchrun: DistributedDataParallel, "
            "which pergrad follows) or make one GPU visible (CUDA_VISIBLE_DEVICES=0)."
        )
    if args.deepspeed:
        raise TrainerConfigError(
            "TrainingArguments(deepspeed=...) partitions and reduces gradients itself, out of pergrad's sight. "
            "Train with DistributedDataParallel (torchrun, no deepspeed) with PerSampleTrainer."
        )
    if args.fsdp:
        raise TrainerConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}): Trainer's FSDP integration is not tested with pergrad (pergrad "
            "follows FSDP2's fully_shard only, applied to the model it wraps). Train with DistributedDataParallel "
            "(torchrun, no fsdp) with PerSampleTrainer."
        )
    if args.use_liger_kernel:
        raise TrainerConfigError(
            "TrainingArguments(use_liger_kernel=True) swaps the model's layers and loss for fused kernels after "
            "pergrad wrapped it (a fused linear-cross-entropy computes no per-sample loss). Set use_liger_kernel=False."
        )
    if str(getattr(args.optim, "value", args.optim)) in ("lomo", "adalomo"):
        raise TrainerConfigError(
            f"TrainingArguments(optim={args.optim!r}) updates the parameters inside the backward from autograd's "
            "gradients, before pergrad wrote .grad. Use another optimizer (adamw_torch, sgd, ...)."
        )
    if private and args.train_sampling_strategy != "random":
        raise TrainerConfigError(
            f"TrainingArguments(train_sampling_strategy={args.train_sampling_strategy!r}) chooses the batches, but "
            "DP-SGD's accounting needs Poisson batches (PerSampleTrainer draws them). Leave it at 'random'."
        )


# -- Poisson batches for DP-SGD ------------------------------------------------------------------------


def _rows(inputs: Mapping[str, Any]) -> int | None:
    for value in inputs.values():
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def _stand_in(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A batch of one row of zeros shaped as ``inputs`` (a batch of 0 rows): for the forward and backward a
    rank with an empty share runs under DDP."""
    return {
        k: v.new_zeros((1, *v.shape[1:])) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in inputs.items()
    }


class _DPCallback(TrainerCallback):
    """Adds DP-SGD's noise once per optimizer step and keeps its state in the checkpoints."""

    def __init__(self, trainer: PerSampleTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        dp = self.trainer.dp
        assert dp is not None
        dp.add_noise()

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        dp = self.trainer.dp
        assert dp is not None
        folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder) and args.should_save:
            state_dict = {**dp.state_dict(), "sampler": self.trainer.dp_sampler.state_dict()}
            torch.save(state_dict, os.path.join(folder, DP_STATE))


# -- the Trainer --------------------------------------------------------------------------------------


class PerSampleTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on per-sample gradients (see the module docstring).

    Args (beyond ``Trainer``'s; ``model`` is the model itself, not a ``PerSampleModule``):
        per_sample_loss: ``fn(outputs, labels) -> [B]``, each sample's own loss (default: ``DefaultLoss``
            for the model). ``labels`` is the batch's ``labels`` (or a tuple, for several ``label_names``).
        token_reduction: the default loss of a token-level model: ``"sum"`` (default) or ``"mean"`` of a
            sample's own token losses.
        transforms: ``{target: transform}`` registered on the wrapper (``""``: the whole model); more can
            be registered on ``trainer.psm`` before ``train()``.
        projections: ``{target: kwargs of register_projection}`` (``{"": {"dim": 512}}``).
        per_sample_options: keyword arguments of ``PerSampleModule`` (``keep_grad_sample``, ``track_norms``,
            ``track_statistics``, ``fallback``, ...; default ``keep_grad_sample=False``). ``loss_reduction``,
            ``reduction``, ``accumulate``, ``grad_scaler`` and ``loss_scale`` are the trainer's.
        privacy: a ``DPConfig`` for DP-SGD (needs ``TrainingArguments(max_grad_norm=0)``).
    """

    # compute_loss returns the micro-batch's mean of per-sample losses; with accumulate="samples" the
    # wrapper averages over every sample of the step, so Trainer must not divide by the micro-batches
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        per_sample_loss: PerSampleLoss | None = None,
        token_reduction: str = "sum",
        transforms: Mapping[nn.Module | nn.Parameter | str, Transform | Callable[[Any], Any]] | None = None,
        projections: Mapping[nn.Module | nn.Parameter | str, Mapping[str, Any]] | None = None,
        per_sample_options: Mapping[str, Any] | None = None,
        privacy: DPConfig | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if isinstance(model, PerSampleModule):
            raise TrainerConfigError(
                "PerSampleTrainer(model=...) takes the model itself, not a PerSampleModule: it wraps the model in "
                "__init__ (trainer.psm). Call psm.remove() and pass psm.module (per_sample_options= and transforms= "
                "carry what the wrapper was built with)."
            )
        if model is None:
            raise TrainerConfigError(
                "PerSampleTrainer needs model= (model_init re-creates the model in train(), after pergrad wrapped the "
                "first one): build the model and pass it."
            )
        if trainer_kwargs.get("compute_loss_func") is not None:
            raise TrainerConfigError(
                "PerSampleTrainer computes the loss from each sample's own loss: pass per_sample_loss=fn with "
                "fn(outputs, labels) -> [B] instead of compute_loss_func (which returns one number for the batch)."
            )
        if not hasattr(Trainer, "loss_is_scaled_for_ga"):  # transformers < 5.24 would divide the loss again
            raise TrainerConfigError(
                "PerSampleTrainer needs transformers>=5.24,<5.25 (pip install 'pergrad[hf]', or in a clone of pergrad "
                "pip install -e '.[hf]'): it relies on Trainer's "
                "loss_is_scaled_for_ga to keep Trainer from dividing the loss by gradient_accumulation_steps"
            )
        if token_reduction not in ("sum", "mean"):
            raise ValueError(f"token_reduction must be 'sum' or 'mean', got {token_reduction!r}")
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        options = dict(per_sample_options or {})
        mine = {"loss_reduction", "reduction", "accumulate", "grad_scaler", "loss_scale"} & set(options)
        if mine:
            raise TrainerConfigError(
                f"per_sample_options={sorted(mine)} are set by PerSampleTrainer (the loss is the batch mean of the "
                "per-sample losses, .grad the mean over every sample of the optimizer step): leave them out"
            )
        options.setdefault("keep_grad_sample", False)
        transforms = dict(transforms or {})
        check_arguments(args, clips=bool(transforms) or privacy is not None, private=privacy is not None)
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        assert isinstance(self.model, nn.Module)
        self.per_sample_loss: PerSampleLoss = per_sample_loss or default_loss(self.model, token_reduction)
        self.privacy = privacy
        scaler = getattr(self.accelerator, "scaler", None)
        # without DP: .grad is the mean over every sample of the optimizer step (accumulate="samples");
        # with DP: DPSGD's clipping factors make every backward add sum_i clip(g_i) / E[B] (any reduction;
        # "sum" also under DDP), and its add_noise() completes the step
        how: dict[str, Any] = {"accumulate": "samples"} if privacy is None else {"reduction": "sum"}
        self.psm = PerSampleModule(self.model, loss_reduction="mean", grad_scaler=scaler, **how, **options)
        try:
            for target, transform in transforms.items():
                self.psm.register_transform(target, transform)
            for target, kwargs in (projections or {}).items():
                self.psm.register_projection(target, **kwargs)
            # with privacy: the DPSGD is made with the optimizer (create_optimizer), on this sampler
            self.dp: DPSGD | None = None
            self._dp_resumed: dict[str, Any] | None = None
            if privacy is not None:
                self.dp_sampler = self._make_sampler(privacy)
                self.args.ignore_data_skip = True  # skipping would draw Poisson batches and throw them away
                self.add_callback(_DPCallback(self))
        except BaseException:
            self.psm.remove()
            raise

    # -- DP-SGD ---------------------------------------------------------------------------------------

    def _expected_batch_size(self) -> int:
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size

    def _make_sampler(self, privacy: DPConfig) -> PoissonBatchSampler:
        dataset = self.train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            raise TrainerConfigError(
                "DP-SGD needs a train_dataset with a length (Poisson sampling draws each sample with probability "
                "expected_batch_size / len(train_dataset)); an IterableDataset cannot be Poisson-sampled."
            )
        expected, n = self._expected_batch_size(), len(dataset)
        if expected > n:
            raise TrainerConfigError(
                f"the expected batch size per optimizer step, per_device_train_batch_size * "
                f"gradient_accumulation_steps * world_size = {expected}, exceeds the {n} training samples"
            )
        if privacy.seed is not None and privacy.seed == self.args.seed:
            raise TrainerConfigError(
                f"DPConfig(seed={privacy.seed}) is TrainingArguments.seed: the training seed is public (it is in the "
                "arguments, the logs and usually the code), and whoever knows it replays every Poisson batch. Leave "
                "DPConfig(seed=None) (the batches then come from the operating system's entropy), or give it a "
                "secret seed of its own"
            )
        generator = None if privacy.seed is None else torch.Generator().manual_seed(privacy.seed)
        return PoissonBatchSampler(
            n,
            expected / n,
            steps=max(1, round(n / expected)),
            generator=generator,
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            micro_batches=self.args.gradient_accumulation_steps,
            secure_mode=privacy.secure_mode,
        )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer; with ``privacy``, hooked by the ``DPSGD`` made here (its noise at each step)."""
        optimizer = super().create_optimizer() if model is None else super().create_optimizer(model)
        if self.privacy is not None and self.dp is None:
            privacy = self.privacy
            self.dp = DPSGD(
                self.psm,
                optimizer,
                self.dp_sampler,
                max_grad_norm=privacy.max_grad_norm,
                noise_multiplier=privacy.noise_multiplier,
                target=privacy.target,
                accountant=privacy.accountant,
            )
            if self._dp_resumed is not None:
                self.dp.load_state_dict(self._dp_resumed)
                self._dp_resumed = None
        return optimizer

    def epsilon(self) -> float:
        """The epsilon spent so far at ``privacy.delta`` (DP-SGD only; 0 before the first step)."""
        if self.privacy is None:
            raise TrainerConfigError("epsilon() needs PerSampleTrainer(privacy=DPConfig(...))")
        return 0.0 if self.dp is None else float(self.dp.epsilon(self.privacy.delta))

    def get_train_dataloader(self) -> DataLoader:
        """Trainer's loader, or with ``privacy``: the Poisson batches of ``dp_sampler``, one draw per optimizer
        step, each in ``gradient_accumulation_steps`` micro-batches; empty ones are batches of 0 rows."""
        if self.privacy is None:
            return super().get_train_dataloader()
        from transformers.trainer_utils import seed_worker
        from transformers.utils import is_datasets_available

        dataset, collate = self.train_dataset, self.data_collator
        assert dataset is not None
        if is_datasets_available() and isinstance(dataset, __import__("datasets").Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="Training")
        batches = self.dp_sampler
        loader = DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=collate_with_empty(dataset, collate),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            worker_init_fn=partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        )
        prepared = self.accelerator.prepare(loader)
        # the batches are per rank already (num_replicas/rank): accelerate must not shard them again
        shard = getattr(prepared, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is batches:
            shard.num_processes, shard.process_index = 1, 0
        return prepared

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the arguments are checked again (transforms registered on ``trainer.psm``
        since), and a DP-SGD run resumed from a checkpoint gets its steps back (and, with ``DPConfig.seed``,
        its sampler's state: the batches continue, none is drawn again)."""
        private = self.privacy is not None
        check_arguments(self.args, clips=bool(self.psm.registered_transforms()), private=private)
        if private and resume_from_checkpoint not in (None, False):
            folder = resume_from_checkpoint
            if folder is True:
                from transformers.trainer_utils import get_last_checkpoint

                folder = get_last_checkpoint(self.args.output_dir)
            if isinstance(folder, str):
                path = os.path.join(folder, DP_STATE)
                if not os.path.isfile(path):
                    raise TrainerConfigError(
                        f"{folder} has no {DP_STATE}: it was not saved by a PerSampleTrainer with privacy=, so the "
                        "privacy spent before it is unknown. Resume from a checkpoint of this DP-SGD run."
                    )
                state = torch.load(path, weights_only=False)
                sampler_state = state.pop("sampler", None)
                if sampler_state is not None:
                    # a new pass from the saved generator: Trainer starts the resumed epoch again (no skipping)
                    self.dp_sampler.load_state_dict({**sampler_state, "drawn": 0})
                if self.dp is not None:
                    self.dp.load_state_dict(state)
                else:
                    self._dp_resumed = state
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log, with DP-SGD's ``epsilon`` spent so far at ``privacy.delta`` in training logs.

        With DP-SGD, Trainer's ``grad_norm`` is left out: Trainer measures it before the noise is added,
        so it would publish the norm of the clipped sum itself. (The logged ``loss`` is the private
        batches' loss, as in every DP-SGD library: keep training logs private.)"""
        if self.dp is not None and "loss" in logs:
            logs.pop("grad_norm", None)
            logs["epsilon"] = self.epsilon()
        super().log(logs, start_time)

    # -- the loss -------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Tensor | int | None = None
    ) -> Tensor:
        """Trainer's step; the loss returned for logging is divided by the micro-batches of the step.

        A micro-batch of 0 rows (Poisson sampling) runs no forward in one process. Under DDP every rank must
        take part in every backward (the ranks' gradient reductions pair up), and a model may not take 0
        rows: it runs on one stand-in row of zeros whose loss is multiplied by 0, inside ``dp.stand_in()``
        (clipped to nothing, not counted as a sample)."""
        if _rows(inputs) == 0:
            if self.args.world_size == 1 or self.dp is None:
                return torch.zeros((), device=self.args.device)
            with self.dp.stand_in():
                super().training_step(model, _stand_in(inputs), num_items_in_batch)
            return torch.zeros((), device=self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        return loss / self.current_gradient_accumulation_steps

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, Any]:
        """``(1/B) sum_i f_i``, ``f_i = per_sample_loss(outputs, labels)[i]`` (``num_items_in_batch``, the
        token count of the whole accumulated batch, is not used: it would tie each sample's loss to the others)."""
        inputs = dict(inputs)
        names = [name for name in self.label_names if name in inputs]
        if not names:
            raise TrainerConfigError(
                f"the batch has none of the label columns {self.label_names} (TrainingArguments.label_names): "
                "each sample's loss needs its labels; for a causal LM set labels = input_ids with -100 at padding"
            )
        found = [inputs.pop(name) for name in names]
        labels = found[0] if len(found) == 1 else tuple(found)
        outputs = model(**inputs)
        losses = self.per_sample_loss(outputs, labels)
        batch = _rows(inputs)
        if not isinstance(losses, Tensor) or losses.dim() != 1 or (batch is not None and losses.shape[0] != batch):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise TrainerConfigError(
                f"per_sample_loss returned {shape}; it must return [B] = [{batch}], each sample's own loss (no mean "
                "over the batch)"
            )
        loss = losses.mean()
        if self.dp is not None and self.dp.standing_in:
            loss = loss * 0  # a stand-in for an empty share (training_step): contributes nothing
        return (loss, outputs) if return_outputs else loss


__all__ = ["IGNORE_INDEX", "DPConfig", "DefaultLoss", "PerSampleTrainer", "check_arguments", "default_loss"]
