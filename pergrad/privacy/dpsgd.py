"""DP-SGD's step: each sample's gradient clipped, Gaussian noise once per optimizer step, the steps counted.

``DPSGD(psm, optimizer, sampler, max_grad_norm=C, noise_multiplier=sigma)`` makes every optimizer step a
DP-SGD step on the Poisson batch ``sampler`` drew for it::

    .grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / (q N),   clip_C(g) = g * min(1, C / ||g||)

and refuses, with a ``PrivacyError`` naming the fix, whatever would make the privacy reported by
``epsilon()`` differ from the privacy the training got.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from pergrad._core.capture.hooks import InertWhenCopied
from pergrad._core.loss_scale import factor_reader
from pergrad.integrations import lm as lm_loss
from pergrad.privacy.audit import Audit, AuditError, LossFn, Select

from ..errors import TargetError
from ..module import PerSampleModule
from ..transforms import ClipNorm
from .accounting import ACCOUNTANTS, epsilon_of
from .errors import PrivacyError
from .randomness import (
    SecureStream,
    collective_device,
    entropy_generator,
    public_seed,
    same_on_every_rank,
    world_size,
)
from .sampling import PoissonBatchSampler

# the live DPSGD of each optimizer (a second one would add its noise again) and of each sampler (two would
# take each other's draws)
_OWNERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, DPSGD] = weakref.WeakKeyDictionary()
_SAMPLERS: weakref.WeakKeyDictionary[PoissonBatchSampler, DPSGD] = weakref.WeakKeyDictionary()


class PrivateClip(ClipNorm):
    """``clip_norm(C)`` whose factors also carry DP-SGD's normalisation: ``.grad`` receives
    ``sum_i clip_C(g_i) / E[B]`` from each backward, whatever the wrapper's ``reduction`` (its ``"mean"``
    divides by the batch size: the factors multiply by it) and ``loss_scale`` ``s`` (pergrad writes ``s``
    times the reduction: the factors divide by it). ``on_batch`` is told each backward's batch size, and
    answers whether its samples count (False: a stand-in, whose factors are 0); outside a backward (the
    audit applying the transform to held gradients) the factors are computed alone."""

    def __init__(
        self,
        max_norm: float,
        expected_batch_size: float,
        psm: PerSampleModule,
        on_batch: Callable[[int], bool],
    ) -> None:
        super().__init__(max_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.psm, self.on_batch = psm, on_batch

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        # in a backward, the batch is reported (outside one, e.g. the audit applying T again: nothing happens)
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self.on_batch(batch_size):  # a stand-in batch: clipped to nothing
            return like.new_zeros(batch_size)
        weight = (batch_size if self.psm.reduction == "mean" else 1) / self.expected_batch_size
        factors = super().factors(norms, batch_size, like) * weight
        loss_scale = factor_reader(self.psm.loss_scale)
        scale = None if loss_scale is None else loss_scale()
        return factors if scale is None else factors / scale

    def __repr__(self) -> str:
        return f"PrivateClip(max_norm={self.max_norm!r}, expected_batch_size={self.expected_batch_size!r})"


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Callable[[], Any] | None, bool]:
    """The closure ``optimizer.step`` was given (``args`` begins with the optimizer), and whether it came
    as a keyword."""
    if kwargs.get("closure") is not None:
        return kwargs["closure"], True
    if len(args) > 1 and callable(args[1]):
        return args[1], False
    return None, False


class DPSGD:
    """DP-SGD on a ``PerSampleModule``: per-sample clipping, Gaussian noise at every step of ``optimizer``,
    on the Poisson batches of ``sampler``, and the privacy spent.

    ``DPSGD(psm, optimizer, sampler, max_grad_norm=C, noise_multiplier=sigma)`` registers the clipping of
    each sample's gradient over ALL trainable parameters of ``target`` (default: the wrapped model, DP-SGD's
    flat clipping) on the wrapper, and hooks ``optimizer.step``: before the parameters are updated (after
    the closure, for ``optimizer.step(closure)``, as Lightning calls it), the noise is added, once::

        .grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / (q N)

    the sum over every sample of every backward since the last step (micro-batches of one draw, an empty
    batch, and under DDP every rank's share), ``q = sampler.sample_rate``, ``N = sampler.num_samples``. The
    division is by the EXPECTED batch size ``q N``, not the drawn one (whose size would leak). The loop is
    the plain one::

        for x, y in loader:  # DataLoader(data, batch_sampler=sampler, collate_fn=collate_with_empty(data))
            loss_fn(psm(x), y).backward()  # on an empty batch too
            optimizer.step()  # the noise goes in here, and the step is counted
            optimizer.zero_grad()

    ``add_noise()`` adds it earlier in the step, for code that reads ``.grad`` before ``optimizer.step()``;
    the step then adds none. ``dp.epsilon(delta)`` is ``epsilon_of(sigma, q, dp.steps, delta, accountant)``.

    **What every step checks** (a ``PrivacyError`` naming the fix, before the parameters move):

    - the samples the step's backward passes clipped are exactly this rank's share of the oldest draw of
      ``sampler`` not yet trained on: a batch from any other loader (shuffled, a fixed size, another
      rate), a step over part of a draw or over two, and a batch backpropagated twice (each backward would
      clip it again: sensitivity ``2C``) are refused;
    - the wrapper is still there (``psm.remove()`` takes the clipping away) and the noise was not added
      twice; the optimizer holds no trainable parameter outside ``target`` (its raw gradient would be
      stepped: a temperature, a head outside the wrapped network); under ``torch.distributed``, this rank
      ran a forward for each of the step's ``sampler.micro_batches`` micro-batches, empty ones included
      (the ranks' gradient reductions pair up; a rank that skips one leaves every rank's ``.grad`` wrong);
    - no covered parameter moved between the step's backward and its noise (a hand-written update,
      an optimizer made after this ``DPSGD``, another optimizer stepping first; also checked at the next
      forward), the closure ran once (LBFGS evaluates it again: queries the accountant does not count), no
      backward came after the noise, the last step's batch is not trained again, and the sampler's rate is
      the one the accountant counts;
    - ``max_steps``, where given (``make_private`` gives the steps its noise was calibrated for): a step
      beyond it would spend more than the target epsilon.

    And at every backward: the model's own ``labels=`` loss of a HuggingFace model (a mean over the batch's
    tokens) is refused where the samples' label counts differ (each sample's share depends on the others).

    **The randomness.** The noise never comes from a stream that decides the batches, nor from a seed you
    set for anything else: without ``generator``, from a ``torch.Generator`` on the parameters' device seeded
    from the operating system's entropy (rank 0's seed under DDP, so every rank adds the same noise); with
    ``sampler.secure_mode``, from a cryptographically secure stream, Gaussians sampled so that their low bits
    do not leak (``pergrad.privacy.randomness``). ``generator=`` makes the noise reproducible, for
    experiments: the privacy then rests on its seed being secret, and it is refused where it is the
    sampler's generator, seeded like it, or torch's default generator (or seeded like it).

    The wrapper may use ``reduction="mean"`` or ``"sum"``, any ``loss_reduction``, ``keep_grad_sample``
    True or False, and a ``loss_scale`` (the loss divided by ``k`` for accumulation: say so with
    ``loss_scale=1/k``). A ``loss_scale`` given as a callable is called once more per backward, by the
    clipping (to divide it out): it must return the same value both times. Refused with ``PrivacyError``: a
    transform already covering the target's parameters, trainable parameters of the model outside the
    target, ``keep_grad_sample=True`` (each sample's raw gradient would sit on the parameters, and in any
    copy or checkpoint of the model), ``grad_scaler=`` (fp16 loss scaling: use bf16 or float32),
    ``accumulate="samples"`` with ``reduction="mean"``, FSDP2, ``reduction="mean"`` under
    ``torch.distributed`` (use ``"sum"``), samplers whose ranks are not the processes', a second live
    ``DPSGD`` on the same optimizer or sampler.

    ``dp.remove()`` takes DPSGD's hooks off the optimizer and the model (the clipping stays registered on
    the wrapper until ``psm.remove()``); a new ``DPSGD`` on the same optimizer replaces one whose wrapper
    was removed.
    """

    def __init__(
        self,
        psm: PerSampleModule,
        optimizer: torch.optim.Optimizer,
        sampler: PoissonBatchSampler,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        target: nn.Module | str | None = None,
        accountant: str = "rdp",
        generator: torch.Generator | None = None,
        max_steps: int | None = None,
    ) -> None:
        if not isinstance(psm, PerSampleModule):
            raise PrivacyError(
                f"DPSGD needs the PerSampleModule wrapping the model, got {type(psm).__name__}: "
                "DPSGD(PerSampleModule(model), optimizer, sampler, ...)"
            )
        if psm.removed:
            raise PrivacyError("DPSGD got a PerSampleModule that was removed: wrap the model again")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PrivacyError(
                f"DPSGD needs the torch.optim.Optimizer that steps the model (it adds the noise at its step and "
                f"checks what it steps), got {type(optimizer).__name__}"
            )
        if not isinstance(sampler, PoissonBatchSampler):
            raise PrivacyError(
                f"DPSGD's accounting assumes Poisson sampling: it takes the PoissonBatchSampler the batches come "
                f"from (its sample_rate and num_samples are the accountant's), got {type(sampler).__name__}. Use "
                "DataLoader(data, batch_sampler=PoissonBatchSampler(len(data), q), collate_fn=collate_with_empty(data)), "
                "or pergrad.privacy.make_private"
            )
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        if max_steps is not None and not (isinstance(max_steps, int) and max_steps >= 0):
            raise ValueError(f"max_steps must be an int >= 0 or None, got {max_steps!r}")
        self.psm, self.optimizer, self.sampler = psm, optimizer, sampler
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = sampler.sample_rate * sampler.num_samples
        self.secure_mode = sampler.secure_mode
        self.accountant, self.max_steps = accountant, max_steps
        self.steps = 0
        self._check_shares()  # (first: a collective, which every rank must reach)
        self._check_wrapper()
        self.target = psm.module if target is None else target
        self._name = self._find_target()
        self._check_outside()
        self._check_generator(generator)
        self.generator = generator
        self._seeded = generator is not None
        self._checked_ranks = False
        self._secure: SecureStream | None = None
        # what the running step has done so far: samples clipped, forwards run, noise added
        self._counted, self._forwards, self._noised = 0, 0, False
        self.standing_in = False  # inside stand_in(): backward passes that stand in for an empty share
        self.public_data = False  # inside public(): backward passes of samples that are not private
        # the covered parameters' versions at the step's last backward: an update before the noise changes them
        self._versions: list[int] | None = None
        self._closure_calls = 0
        # the model inputs of this step's forwards and of the last step's: the same batch in two steps is refused
        self._inputs: list[weakref.ref[Tensor]] = []
        self._previous: list[weakref.ref[Tensor]] = []
        self._audit: PrivateAudit | None = None
        previous = _OWNERS.get(optimizer)
        if previous is not None:
            if not previous.removed():
                raise PrivacyError(
                    f"the optimizer already has a DPSGD ({previous!r}): two would add their noise to one step. Call "
                    "remove() on the first one, or use one DPSGD"
                )
            previous.remove()
        self._check_optimizer()
        other = _SAMPLERS.get(sampler)
        if other is not None and not other.removed():
            raise PrivacyError(
                f"the sampler already feeds another DPSGD ({other!r}): each takes the sampler's draws as its own steps, "
                "so each would check its steps against the other's draws. Give each DPSGD its own "
                "PoissonBatchSampler (and loader), or call remove() on the other"
            )
        sampler.track_shares()
        self._clip = PrivateClip(self.max_grad_norm, self.expected_batch_size, psm, self._on_batch)
        try:
            psm.register_transform(self.target, self._clip)
        except TargetError as err:
            raise PrivacyError(
                f"DPSGD cannot clip {self._label()}: {err}. DP-SGD's clipping must be the only transform on the "
                "parameters it covers: remove the other transform (a new PerSampleModule) or let DPSGD register "
                "the clipping alone"
            ) from err
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            psm.module.register_forward_pre_hook(InertWhenCopied(self._on_forward)),
            psm.module.register_forward_hook(InertWhenCopied(self._on_output), with_kwargs=True),
        ]
        _OWNERS[optimizer] = self
        _SAMPLERS[sampler] = self

    # -- what is refused ---------------------------------------------------------------------------

    def _check_wrapper(self) -> None:
        psm = self.psm
        if psm.keep_grad_sample:
            raise PrivacyError(
                "DPSGD takes a wrapper with keep_grad_sample=False: with True, every parameter holds each sample's raw, "
                "unclipped gradient (p.grad_sample) after each backward, and so would any copy, pickle or checkpoint "
                "of the model (torch.save(model), EMA or SWA copies). DP-SGD's clipping needs none of them: "
                "PerSampleModule(model, keep_grad_sample=False)"
            )
        if psm.grad_scaler is not None:
            raise PrivacyError(
                "DPSGD does not take a wrapper with grad_scaler= (fp16 loss scaling): the noise would have to follow "
                "the scaler's scale, and an overflow skips a step the accountant cannot tell from one taken. Train in "
                "bfloat16 (torch.autocast(dtype=torch.bfloat16), no GradScaler) or float32"
            )
        if psm.accumulate == "samples" and psm.reduction == "mean":
            raise PrivacyError(
                "DPSGD does not take accumulate='samples' with reduction='mean': DP-SGD divides the sum over every "
                "sample of the step by the EXPECTED batch size, which DPSGD does itself. Use accumulate='backward' "
                "(the default), and loss_scale=1/k if each micro-batch's loss is divided by k"
            )
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in psm.module.modules()):
            raise PrivacyError(
                "DPSGD does not support FSDP2 (fully_shard) models yet: use DistributedDataParallel "
                "(PerSampleModule(DDP(model), reduction='sum'))"
            )
        self._check_distributed()

    def _check_distributed(self) -> None:
        world = world_size()
        if world == 1:
            return
        if self.psm.reduction == "mean":
            raise PrivacyError(
                "under torch.distributed, DPSGD needs the wrapper's reduction='sum' (pergrad's sum runs over every "
                "rank's samples; its 'mean' is a mean of each rank's mean): PerSampleModule(ddp_model, "
                "reduction='sum'); the loss's own reduction (loss_reduction) may stay 'mean'"
            )

    def _check_shares(self) -> None:
        """Under ``torch.distributed``, once, with every rank: the samplers' ranks are the processes' (each rank
        sees every rank's answer, so a misconfigured sampler stops them all instead of leaving the others
        waiting in their first gradient reduction)."""
        world = world_size()
        if world == 1:
            return
        mine = torch.tensor([self.sampler.num_replicas, self.sampler.rank], device=collective_device())
        gathered = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(gathered, mine)
        found = [(int(g[0]), int(g[1])) for g in gathered]
        if found != [(world, r) for r in range(world)]:
            raise PrivacyError(
                f"the ranks' PoissonBatchSamplers have (num_replicas, rank) = {found}, not (world size {world}, the "
                "process's rank): the ranks would not train on disjoint shares of one draw (every rank on the whole "
                "draw: each sample twice in the step, sensitivity 2C). Pass PoissonBatchSampler(..., "
                "num_replicas=world_size, rank=rank) on each rank, or use make_private"
            )

    def _find_target(self) -> str:
        """The target's qualified name (a module of the wrapped model)."""
        model, target = self.psm.module, self.target
        if isinstance(target, nn.Parameter):
            raise PrivacyError(
                "DPSGD's target is a module (its parameters' gradients are clipped together) or its qualified name, "
                "not a parameter: target=the module holding it, or None for the whole model"
            )
        if isinstance(target, str):
            try:
                model.get_submodule(target)
                return target
            except AttributeError as err:
                raise PrivacyError(
                    f"DPSGD's target {target!r} is not a module of the wrapped {type(model).__name__}: {err}"
                ) from err
        name = next((n for n, m in model.named_modules() if m is target), None)
        if name is None:
            raise PrivacyError(
                f"DPSGD's target, a {type(target).__name__}, is not part of the wrapped {type(model).__name__}"
            )
        return name

    def _label(self) -> str:
        return "the whole model" if self._name == "" else f"module {self._name!r}"

    def _check_outside(self) -> None:
        covered = {id(p) for p in self.params()}
        outside = [n for n, p in self.psm.module.named_parameters() if p.requires_grad and id(p) not in covered]
        if outside:
            raise PrivacyError(
                f"DPSGD clips and noises {self._label()} only, but {outside[:3]}{' ...' if len(outside) > 3 else ''} "
                "are trainable too: their gradients would be neither clipped nor noised, and training on them is not "
                "private. Freeze them (p.requires_grad_(False)) or pass target=None (the whole model)"
            )

    def _check_optimizer(self) -> None:
        """Every trainable parameter the optimizer steps must be one DPSGD clips and noises."""
        covered = {id(p) for p in self.params()}
        names = {id(p): n for n, p in self.psm.module.named_parameters()}
        outside = [
            names.get(id(p), f"param_groups[{g}]['params'][{k}] of shape {tuple(p.shape)}")
            for g, group in enumerate(self.optimizer.param_groups)
            for k, p in enumerate(group["params"])
            if p.requires_grad and id(p) not in covered
        ]
        if outside:
            raise PrivacyError(
                f"the optimizer steps {len(outside)} trainable parameter(s) DPSGD does not clip or noise "
                f"({', '.join(outside[:3])}{' ...' if len(outside) > 3 else ''}; outside {self._label()} of the "
                f"wrapped {type(self.psm.module).__name__}): their raw gradients would be stepped, and training on "
                "them is not private. Give the optimizer only the wrapped model's parameters "
                "(optimizer = SGD(model.parameters(), ...)), move the others into the wrapped model, or freeze them"
            )

    def _check_generator(self, generator: torch.Generator | None) -> None:
        if generator is None:
            return
        if self.secure_mode:
            raise PrivacyError(
                "the sampler is in secure mode: DPSGD then draws its noise from a cryptographically secure stream of "
                "its own; pass generator=None"
            )
        public = public_seed(generator)
        if public is not None:
            raise PrivacyError(
                f"DPSGD's noise generator is public: {public}. Whoever knows that seed (code is often published with "
                "its seeds) can regenerate the noise and subtract it. Leave generator=None (the noise is then seeded "
                "from the operating system's entropy), or seed it from a secret of yours"
            )
        drawn = self.sampler.generator if self.sampler.seeded else None
        if drawn is not None and (generator is drawn or generator.initial_seed() == drawn.initial_seed()):
            raise PrivacyError(
                f"DPSGD's noise generator is the sampler's generator or seeded like it ({generator.initial_seed()}): "
                "the noise would come from the stream that chose the batch, and each chosen sample's noise would be "
                "tied to its being chosen (a membership attack reads it off .grad). Leave generator=None (the noise "
                "is then seeded from the operating system's entropy), or seed the two from independent secrets"
            )

    def params(self) -> list[nn.Parameter]:
        """The parameters DPSGD clips and noises: the target's trainable ones, in its order."""
        return [p for p in self.psm.module.get_submodule(self._name).parameters() if p.requires_grad]

    # -- the hooks ---------------------------------------------------------------------------------

    def _on_batch(self, batch_size: int) -> bool:
        if self._noised:
            raise PrivacyError(
                "a backward after this step's noise and before optimizer.step(): its clipped sum would reach the "
                "update without noise of its own. Run every backward of the step before add_noise() (or leave the "
                "noise to optimizer.step())"
            )
        self._versions = [p._version for p in self.params()]
        if self.standing_in:
            return False
        if not self.public_data:
            self._counted += batch_size
        return True

    @contextlib.contextmanager
    def public(self) -> Iterator[None]:
        """For samples that are not private (a GAN's generated samples through its discriminator): the
        backward passes inside are clipped and reduced as any other, but their samples are not counted
        against the sampler's draw. Only for data that is public: private data inside it would be trained
        on without being one Poisson draw per step, as the accountant assumes."""
        self.public_data = True
        try:
            yield
        finally:
            self.public_data = False

    @contextlib.contextmanager
    def stand_in(self) -> Iterator[None]:
        """For a rank with an empty share under DDP whose model cannot run on 0 rows: the backward passes
        inside are stand-ins (a forward on a row of zeros, its loss multiplied by 0), so that the ranks'
        gradient reductions pair up. Their samples are clipped to nothing (factor 0) and not counted."""
        self.standing_in = True
        try:
            yield
        finally:
            self.standing_in = False

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled():
            return
        self._check_unchanged("before this forward")
        self._forwards += 1
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is None or self.standing_in or self.public_data:
            return
        if any(ref() is x for ref in self._previous):
            raise PrivacyError(
                "this forward's input is the batch the last optimizer step trained on: a Poisson draw trained in two "
                "steps is two queries of it, and the accountant counts one. Take one optimizer step per draw (for "
                "several local steps, draw a new batch for each)"
            )
        self._inputs.append(weakref.ref(x))

    def _check_unchanged(self, when: str) -> None:
        """Refuse where a parameter DPSGD covers changed since the step's last backward, before its noise:
        an update (a hand-written one, an optimizer DPSGD does not hook, another optimizer stepping first)
        that used the noiseless clipped sum."""
        if self._versions is None or self._noised:
            return
        moved = [p for p, v in zip(self.params(), self._versions, strict=False) if p._version != v]
        if not moved:
            return
        names = {id(p): n for n, p in self.psm.module.named_parameters()}
        raise PrivacyError(
            f"parameter(s) {[names.get(id(p), '?') for p in moved[:3]]} changed {when}, after the step's backward and "
            "before DP-SGD's noise: an update made from the noiseless clipped sum (a hand-written p -= lr * p.grad, "
            "an optimizer made after DPSGD, another optimizer stepping before this one). Step with the optimizer "
            "DPSGD hooks (a new optimizer needs a new DPSGD), or call dp.add_noise() before any update"
        )

    def _on_output(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        labels = lm_loss.token_labels(kwargs)
        if labels is not None and torch.is_grad_enabled():
            lm_loss.watch(labels, output, self._refuse_token_loss)

    def _refuse_token_loss(self, message: str) -> None:
        raise PrivacyError(
            f"DP-SGD: {message} Under DP-SGD this breaks the clipping bound: a sample's share of .grad can be far "
            "more than C. PerSampleTrainer computes each sample's own loss; in your own loop use "
            "pergrad.per_sample_lm_loss(logits, labels).mean()"
        )

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        closure, by_name = _closure_of(args, kwargs)
        if closure is None:
            self._complete()
            return None

        def closure_then_noise() -> Any:
            self._closure_calls += 1
            if self._closure_calls > 1:
                raise PrivacyError(
                    f"{type(optimizer).__name__} evaluated its closure again within one step (LBFGS and line searches "
                    "do): each evaluation is one more query of the private batch, which the accountant does not "
                    "count, and only the first one's gradient would be noised. DP-SGD takes one gradient per step: "
                    "use SGD, Adam or another first-order optimizer"
                )
            found = closure()
            self._complete()
            return found

        if by_name:
            return args, {**kwargs, "closure": closure_then_noise}
        return (args[0], closure_then_noise, *args[2:]), kwargs

    def _complete(self) -> None:
        if not self._noised:
            self.add_noise()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._counted, self._forwards, self._noised = 0, 0, False
        self._versions, self._closure_calls = None, 0
        self._previous, self._inputs = self._inputs, []

    # -- the noise ---------------------------------------------------------------------------------

    def _check_step(self) -> None:
        """Everything a step must hold before its noise goes in (see the class docstring)."""
        if self.psm.removed:
            raise PrivacyError(
                "the PerSampleModule this DPSGD clips through was removed (psm.remove()): the gradients are no longer "
                "clipped, and a step on them is not private. Wrap the model again and make a new DPSGD (it replaces "
                "this one on the optimizer), or call dp.remove() to train without DP-SGD from now on"
            )
        if self._noised:
            raise PrivacyError(
                "add_noise() was called twice in one optimizer step: the step would hold the noise twice. Call it at "
                "most once per step (optimizer.step() adds it where you did not)"
            )
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise PrivacyError(
                f"this DPSGD's budget is {self.max_steps} steps (max_steps: the steps its noise was calibrated for), "
                "all taken; one more would spend more than the target epsilon. "
                "Stop here, or set up the run again for more epochs (make_private(..., epochs=...))"
            )
        sampler = self.sampler
        if (sampler.sample_rate, sampler.sample_rate * sampler.num_samples, sampler.secure_mode) != (
            self.sample_rate,
            self.expected_batch_size,
            self.secure_mode,
        ):
            raise PrivacyError(
                f"the sampler's settings changed after DPSGD was made (sample_rate {sampler.sample_rate}, "
                f"num_samples {sampler.num_samples}, secure_mode {sampler.secure_mode}; DPSGD accounts for "
                f"sample_rate {self.sample_rate}, expected batch {self.expected_batch_size:g}): the accountant would "
                "count the steps at a rate they were not drawn at. Make a new sampler and DPSGD for new settings"
            )
        self._check_unchanged("before the noise")
        self._check_distributed()
        self._check_outside()
        self._check_optimizer()
        if world_size() > 1 and self._forwards < self.sampler.micro_batches:
            raise PrivacyError(
                f"this rank ran {self._forwards} forward pass(es) with gradients in this step, but each step has "
                f"{self.sampler.micro_batches} micro-batch(es): under torch.distributed every rank must run the "
                "forward and backward of every micro-batch, its empty share (a Poisson draw may give a rank no sample) "
                "included, or the ranks' gradient reductions pair with different steps. Remove any "
                "`if len(batch):` around the forward and backward"
            )
        share = self.sampler.take_share()
        if share is None or share != self._counted:
            drawn = (
                "no draw of the sampler is waiting" if share is None else f"this rank's share of the draw is {share}"
            )
            raise PrivacyError(
                f"this optimizer step trained on {self._counted} sample(s), but {drawn}: the step did not train on "
                "exactly one Poisson draw of DPSGD's sampler, so the accounting does not hold. Train on the batches "
                "of DataLoader(data, batch_sampler=sampler, collate_fn=collate_with_empty(data)) (not on another "
                "loader), one optimizer step per draw (with micro_batches=k, k backward passes per step), one "
                "backward per batch (two backward passes of one batch clip each sample twice). Samples that are not "
                "private and not from the draw (a GAN's generated samples through its discriminator): backpropagate "
                "them inside `with dp.public():`"
            )

    def _generator(self, like: Tensor) -> torch.Generator:
        if self.generator is None:
            self.generator = entropy_generator(like.device)
        if self._seeded and not self._checked_ranks and world_size() > 1 and not same_on_every_rank(self.generator):
            raise PrivacyError(
                "DPSGD's noise generators differ between ranks, so the ranks' .grad would differ (each rank would "
                "step with its own noise): pass generator=torch.Generator().manual_seed(SEED) with the same SEED on "
                "every rank, or generator=None (DPSGD then seeds one from rank 0's entropy)"
            )
        self._checked_ranks = True
        return self.generator

    def _noise(self, p: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
        if self.noise_multiplier == 0:
            return torch.zeros_like(p)
        if self.secure_mode:
            if self._secure is None:
                self._secure = SecureStream()
            return self._secure.normal(p.shape).mul_(std).to(device=p.device, dtype=p.dtype)
        assert generator is not None
        dtype = torch.promote_types(p.dtype, torch.float32)
        noise = torch.randn(p.shape, generator=generator, device=generator.device, dtype=dtype)
        return noise.mul_(std).to(device=p.device, dtype=p.dtype)

    def add_noise(self) -> None:
        """Add ``N(0, sigma^2 C^2 I) / (q N)`` to the ``.grad`` of every parameter DPSGD covers (a ``.grad``
        of None, where no backward reached it or the batch was empty, becomes the noise alone) and count one
        step, after checking the step (see the class docstring); with an ``audit``, audit it where due.
        ``optimizer.step()`` calls it where the step's code did not."""
        self._check_step()
        params = self.params()
        std = self.noise_multiplier * self.max_grad_norm / self.expected_batch_size
        audit = self._audit
        before = None
        if audit is not None and audit.due:
            if audit._batches is None:
                raise AuditError(
                    "the privacy audit is due this step, but audit.check(*batches) was not called: call it after the "
                    "step's backward passes, before optimizer.step(), with the step's batches (one per backward)"
                )
            before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        generator = None
        if params and self.noise_multiplier > 0 and not self.secure_mode:
            generator = self._generator(params[0])
        for p in params:
            noise = self._noise(p, std, generator)
            if p.grad is None:
                p.grad = noise
            else:
                p.grad.add_(noise)
        self.steps += 1
        self._noised = True
        if audit is not None:
            batches, audit._batches = audit._batches or (), None
            audit.audit.check_private(
                *batches,
                max_grad_norm=self.max_grad_norm,
                noise_std=std,
                expected_batch_size=self.expected_batch_size,
                params=params,
                grad_before_noise=before,
            )

    def audit(
        self,
        loss_fn: LossFn,
        *,
        every: int = 100,
        samples: int = 4,
        seed: int = 0,
        rtol: float | None = None,
        select: Select | None = None,
    ) -> PrivateAudit:
        """A privacy audit of this run (``pergrad.privacy.audit``), made before the training loop: on the first step
        and every ``every``-th, at the noise, ``samples`` samples' gradients are recomputed with plain autograd
        on a copy of the model (``loss_fn(model, batch)``, the loss the loop backpropagates), and the step is
        refused (``AuditError``, before the parameters move) unless every sample's clipped contribution is at
        most ``C`` and equal to pergrad's, the per-sample gradients add up to autograd's batch gradient (a loss
        whose reduction was not declared, a regulariser, samples mixing), ``.grad`` is their clipped sum, and
        the noise is there, once, with std ``sigma C / (q N)``. In the loop, ``audit.check(*batches)`` after the
        step's backward passes (one batch per backward), before ``optimizer.step()``: it hands the step's
        batches over; on a due step without it, the step is refused. One process; cost: docs/guides/audit.md."""
        if self._audit is not None:
            raise PrivacyError("this DPSGD already has an audit: use it, or close() it first")
        self._audit = PrivateAudit(
            Audit(self.psm, loss_fn, every=every, samples=samples, seed=seed, rtol=rtol, select=select), self
        )
        return self._audit

    def remove(self) -> None:
        """Take DPSGD's hooks off the optimizer and the model: its steps are no longer DP-SGD steps."""
        if self._audit is not None:
            self._audit.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if _OWNERS.get(self.optimizer) is self:
            del _OWNERS[self.optimizer]
        if _SAMPLERS.get(self.sampler) is self:
            del _SAMPLERS[self.sampler]

    def removed(self) -> bool:
        """Whether this DPSGD's hooks are gone (``remove()``) or its wrapper was removed."""
        return not self._handles or self.psm.removed

    # -- accounting and resuming -------------------------------------------------------------------

    def epsilon(self, delta: float) -> float:
        """The epsilon spent at ``delta`` by the steps so far (``epsilon_of``): the (epsilon, delta) of that
        many Poisson-sampled Gaussian steps, add-or-remove-one neighbours.

        What it assumes, besides the clipping and the noise this class checks: that no one can predict the
        batches or the noise. That holds with the defaults (both seeded from the operating system's entropy,
        never from a seed of yours) against anyone who sees the models or their gradients; torch's generator is
        not cryptographically secure, and its Gaussian sampler is a floating-point one whose low bits can leak
        the uniforms behind them (Holohan & Braghin 2021, Mironov 2012 for the Laplace case): against an
        adversary who reads the exact bits of what you release, use ``secure_mode=True`` on the sampler. With a
        ``generator`` of yours (here or in the sampler) it holds only while its seed stays secret."""
        return epsilon_of(self.noise_multiplier, self.sample_rate, self.steps, delta, self.accountant)

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the steps taken (the privacy spent), the settings they were taken with and,
        for a ``generator`` you passed, its state (keep such a checkpoint as private as the data: it lets
        its reader regenerate the noise)."""
        state = self.generator.get_state() if self._seeded and self.generator is not None else None
        return {
            "steps": self.steps,
            "generator": state,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "max_grad_norm": self.max_grad_norm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of the run being resumed)."""
        for key in ("noise_multiplier", "sample_rate", "max_grad_norm"):
            if key in state and state[key] != getattr(self, key):
                raise PrivacyError(
                    f"the saved DP-SGD state has {key}={state[key]!r}, this DPSGD {getattr(self, key)!r}: the steps "
                    "taken with the saved one would be accounted at the wrong value. Resume with the same settings"
                )
        self.steps = int(state["steps"])
        if state.get("generator") is not None and self._seeded:
            assert self.generator is not None
            self.generator.set_state(state["generator"])
            self._checked_ranks = False

    def __repr__(self) -> str:
        return (
            f"DPSGD({self._label()}, max_grad_norm={self.max_grad_norm}, noise_multiplier={self.noise_multiplier}, "
            f"sample_rate={self.sample_rate}, expected_batch_size={self.expected_batch_size}, steps={self.steps})"
        )


class PrivateAudit:
    """The privacy audit of a ``DPSGD`` (``dp.audit(loss_fn, every=...)``): ``check(*batches)`` hands it each
    step's batches, and the step's noise runs the audit where it is due (``Audit.check_private``)."""

    def __init__(self, audit: Audit, dp: DPSGD) -> None:
        self.audit, self.dp = audit, dp
        self._batches: tuple[Any, ...] | None = None

    @property
    def due(self) -> bool:
        """Whether the running step is audited (its ``check`` is then required)."""
        return self.audit.due

    @property
    def audited(self) -> int:
        """The steps audited (and passed) so far."""
        return self.audit.audited

    def check(self, *batches: Any) -> None:
        """The running step's batches (one per backward pass, in order), after its backward passes and before
        the noise (``optimizer.step()``, or an ``add_noise()`` of yours); the audit runs at the noise."""
        self._batches = batches

    def close(self) -> None:
        """Stop auditing: the hook and what the audit held are removed."""
        self.audit.close()
        if self.dp._audit is self:
            self.dp._audit = None

    def __repr__(self) -> str:
        return f"PrivateAudit({self.audit!r})"
