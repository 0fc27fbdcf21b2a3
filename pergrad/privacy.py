"""DP-SGD as a library feature: Poisson sampling, clipping with Gaussian noise, and the privacy spent.

One step of DP-SGD (Abadi et al. 2016) on a batch drawn by Poisson sampling (every sample joins it
independently with probability ``q``, so the batch size ``B`` varies and may be 0)::

    .grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / E[B],   clip_C(g) = g * min(1, C / ||g||),  E[B] = q N

- ``PoissonBatchSampler``: the batches (a ``batch_sampler`` for ``DataLoader``), one Poisson draw per
  step, shared out over DDP ranks and, optionally, split into gradient-accumulation micro-batches;
  ``collate_with_empty`` lets a ``DataLoader`` hand out an empty batch.
- ``DPSGD``: registers the clipping on the wrapper (``transforms.clip_norm`` over the whole target,
  DP-SGD's flat clipping, computed in the ordinary backward) with the normalisation by ``E[B]`` folded
  into the clipping factors, so after the step's backward(s) ``.grad`` is ``sum_i clip_C(g_i) / E[B]``
  whatever the batch sizes, the wrapper's ``reduction`` and ``loss_scale``; ``add_noise()`` adds the
  noise once per optimizer step and counts the step.
- ``epsilon_of`` / ``noise_multiplier_for``: the (epsilon, delta) of ``steps`` Poisson-sampled Gaussian
  steps, and the noise multiplier that spends a given epsilon, from Google's ``dp_accounting``
  (``pip install pergrad[dp]``; imported only when called).

Only torch is needed to sample, clip and add noise. The noise comes from ``torch.randn`` with a
``torch.Generator``: reproducible, not a cryptographically secure source.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import Sampler, default_collate

from .errors import PrivacyError, TargetError
from .loss_scale import factor_reader
from .module import PerSampleModule
from .transforms import ClipNorm

ACCOUNTANTS = ("rdp", "pld")


# -- sampling --------------------------------------------------------------------------------------


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _seed_shared_by_ranks() -> int:
    """A fresh seed from torch's default generator; rank 0's under ``torch.distributed`` (broadcast)."""
    seed = [int(torch.randint(0, 2**62, ()))]
    if _world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return seed[0]


def _same_on_every_rank(generator: torch.Generator) -> bool:
    """Whether ``generator``'s state is the same on every rank (one small all-gather)."""
    state = generator.get_state().numpy().tobytes()
    digests: list[Any] = [None] * _world_size()
    dist.all_gather_object(digests, hashlib.sha256(state).hexdigest())
    return len(set(digests)) == 1


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches by Poisson sampling: at each step every index of ``range(num_samples)`` joins the batch
    independently with probability ``sample_rate`` (the sampling the privacy analysis of DP-SGD assumes).

    Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_with_empty(dataset))``: a
    batch may be EMPTY (its probability is ``(1 - q)^N``), which the default collate cannot stack.
    ``len(sampler)`` is the number of batches one pass yields: ``steps`` (default ``round(1 / q)``, one
    epoch in expectation) times ``micro_batches``. Each pass continues the generator: new draws.

    Several processes (``num_replicas > 1``): every rank draws the SAME batch and keeps the indices
    ``i`` with ``i % num_replicas == rank``: the ranks' batches together are one Poisson sample of the
    dataset. Every rank yields the same number of batches (some empty). The generators must agree: pass
    ``generator=torch.Generator().manual_seed(SEED)`` with one SEED on every rank (checked at the first
    pass under ``torch.distributed``), or None: one is seeded at the first pass from torch's default
    generator, rank 0's under ``torch.distributed`` (outside it, ``num_replicas > 1`` needs a generator).

    ``micro_batches=k``: each step's draw is split into ``k`` consecutive micro-batches (sizes within
    one of each other, some may be empty), for gradient accumulation over ``k`` backward passes per
    optimizer step (Lightning's ``accumulate_grad_batches=k``): the optimizer step sees one Poisson
    sample, as the accounting assumes. (``k`` independent draws, one per micro-batch, would put a
    sample in one step up to ``k`` times.)

    ``state_dict()`` / ``load_state_dict()`` keep the generator and the position in the current pass:
    a pass started after ``load_state_dict`` yields the batches the saved pass had not yet yielded.
    A ``DataLoader`` with workers fetches ahead of the training loop, so save its state where the
    loop is, or use ``num_workers=0``.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        micro_batches: int = 1,
    ) -> None:
        if not (isinstance(num_samples, int) and num_samples > 0):
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if steps is None:
            steps = max(1, round(1 / sample_rate))
        if not (isinstance(steps, int) and steps > 0):
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if not (isinstance(num_replicas, int) and num_replicas > 0 and 0 <= rank < num_replicas):
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank!r}, num_replicas={num_replicas!r}")
        if not (isinstance(micro_batches, int) and micro_batches > 0):
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.num_samples, self.sample_rate, self.steps = num_samples, float(sample_rate), steps
        self.num_replicas, self.rank, self.micro_batches = num_replicas, rank, micro_batches
        self._generator = generator  # None: seeded at the first pass (from rank 0 under torch.distributed)
        self._checked = False
        self.drawn = 0  # steps of the current (or last) pass drawn so far
        self._resume_at = 0

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    @property
    def generator(self) -> torch.Generator:
        """The generator of the draws; one seeded from torch's default generator (rank 0's under
        ``torch.distributed``) where none was given. With ``num_replicas > 1`` under ``torch.distributed``
        its state is checked, once, to be the same on every rank."""
        if self._generator is None:
            if self.num_replicas > 1 and _world_size() == 1:
                raise PrivacyError(
                    f"PoissonBatchSampler(num_replicas={self.num_replicas}) without a generator, outside "
                    "torch.distributed: the ranks would draw different batches. Pass "
                    "generator=torch.Generator().manual_seed(SEED) with the same SEED on every rank, or create the "
                    "sampler after torch.distributed.init_process_group"
                )
            self._generator = torch.Generator().manual_seed(_seed_shared_by_ranks())
            self._checked = True
        if not self._checked and self.num_replicas > 1 and _world_size() > 1:
            if not _same_on_every_rank(self._generator):
                raise PrivacyError(
                    "PoissonBatchSampler's generators differ between ranks, so the ranks' batches would not be "
                    "shares of one Poisson draw: pass generator=torch.Generator().manual_seed(SEED) with the same "
                    "SEED on every rank, or generator=None"
                )
            self._checked = True
        return self._generator

    def draw(self) -> Tensor:
        """One step's Poisson sample of ``range(num_samples)`` (every rank's share), sorted."""
        generator = self.generator
        keep = torch.rand(self.num_samples, generator=generator, device=generator.device) < self.sample_rate
        return keep.nonzero().flatten().cpu()

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume_at = self._resume_at, 0
        for step in range(start, self.steps):
            drawn = self.draw()
            self.drawn = step + 1
            mine = drawn[drawn % self.num_replicas == self.rank]
            for part in torch.tensor_split(mine, self.micro_batches):
                yield part.tolist()

    def state_dict(self) -> dict[str, Any]:
        """The generator's state and how many steps of the current pass were drawn (``steps``: none left)."""
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass yields the steps the saved pass had not drawn (a new
        pass if it had drawn them all), with the generator where it was."""
        self.generator.set_state(state["generator"])
        self._checked = False
        self.drawn = int(state["drawn"])
        self._resume_at = self.drawn % self.steps


def collate_with_empty(
    dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None
) -> Callable[[list[Any]], Any]:
    """A collate function that also takes an empty list (a Poisson batch may be empty): ``collate_fn``
    (default ``torch.utils.data.default_collate``) for a non-empty batch; for an empty one,
    ``collate_fn([dataset[0]])`` with every tensor cut to 0 rows (``[0, ...]``, the right dtype and
    trailing shape) and every list or tuple of other values emptied."""
    collate = default_collate if collate_fn is None else collate_fn

    def empty(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value[:0]
        if isinstance(value, dict):
            return type(value)({k: empty(v) for k, v in value.items()})
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(empty(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(empty(v) for v in value) if value and isinstance(value[0], Tensor) else type(value)()
        return value

    def collate_or_empty(batch: list[Any]) -> Any:
        if len(batch):
            return collate(batch)
        return empty(collate([dataset[0]]))

    return collate_or_empty


# -- clipping and noise ----------------------------------------------------------------------------


class PrivateClip(ClipNorm):
    """``clip_norm(C)`` whose factors also carry DP-SGD's normalisation: ``.grad`` receives
    ``sum_i clip_C(g_i) / E[B]`` from each backward, whatever the wrapper's ``reduction`` (its ``"mean"``
    divides by the batch size: the factors multiply by it) and ``loss_scale`` ``s`` (pergrad writes ``s``
    times the reduction: the factors divide by it)."""

    def __init__(self, max_norm: float, expected_batch_size: float, psm: PerSampleModule) -> None:
        super().__init__(max_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.psm = psm

    def factors(self, norms: Tensor | None, batch_size: int, like: Tensor) -> Tensor:
        weight = (batch_size if self.psm.reduction == "mean" else 1) / self.expected_batch_size
        factors = super().factors(norms, batch_size, like) * weight
        loss_scale = factor_reader(self.psm.loss_scale)
        scale = None if loss_scale is None else loss_scale()
        return factors if scale is None else factors / scale

    def __repr__(self) -> str:
        return f"PrivateClip(max_norm={self.max_norm!r}, expected_batch_size={self.expected_batch_size!r})"


class DPSGD:
    """DP-SGD on a ``PerSampleModule``: per-sample clipping, Gaussian noise, and the privacy spent.

    ``DPSGD(psm, max_grad_norm=C, noise_multiplier=sigma, sample_rate=q, expected_batch_size=q * N)``
    registers the clipping of each sample's gradient over ALL parameters of ``target`` (default: the
    wrapped model, DP-SGD's flat clipping) on the wrapper. Then, per optimizer step::

        loss.backward()          # once, or once per micro-batch of the step (gradient accumulation)
        dp.add_noise()           # .grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / expected_batch_size
        optimizer.step(); optimizer.zero_grad()

    The sum is over every sample of every backward since ``.grad`` was cleared (micro-batches of any
    sizes, an empty batch: no backward needed, ``.grad`` None becomes the noise alone) and, under DDP, of
    every rank. The division is by the EXPECTED batch size, not the drawn one (whose size would leak);
    give it as ``expected_batch_size`` or as ``num_samples`` (``N``, the dataset's size:
    ``expected_batch_size = q N``). ``add_noise`` counts one step for the accountant:
    ``dp.epsilon(delta)`` is ``epsilon_of(sigma, q, dp.steps, delta, accountant)``.

    The wrapper may use ``reduction="mean"`` or ``"sum"``, any ``loss_reduction``, ``keep_grad_sample``
    True or False, and a ``loss_scale`` (the loss divided by ``k`` for accumulation: say so with
    ``loss_scale=1/k``; the clipping sees each sample's own ``g_i``). Refused with ``PrivacyError``: a
    transform already covering the target's parameters, trainable parameters outside the target (their
    gradient would be neither clipped nor noised), ``grad_scaler=`` (fp16 loss scaling: use bf16 or
    float32), ``accumulate="samples"`` with ``reduction="mean"``, FSDP2, and ``reduction="mean"`` under
    ``torch.distributed`` (use ``"sum"``: pergrad's sum runs over every rank's samples).

    A ``loss_scale`` given as a callable is called once more per backward, by the clipping (to divide it
    out): it must return the same value both times.

    Several processes (DDP): every rank runs each backward, on an empty share of the batch too (DDP waits
    for every rank); every rank ends with the same ``.grad``, holding the noise once: the noise is
    drawn from generators that agree on every rank (``generator=None`` seeds one from rank 0; a
    generator you pass must be seeded alike on every rank, which the first ``add_noise`` checks).
    The noise is drawn on the generator's device (``torch.Generator("cuda")`` for a model on the GPU)
    in the parameters' dtype (at least float32), in the order of ``target.parameters()``.
    """

    def __init__(
        self,
        psm: PerSampleModule,
        max_grad_norm: float,
        noise_multiplier: float,
        sample_rate: float,
        expected_batch_size: float | None = None,
        target: nn.Module | str | None = None,
        generator: torch.Generator | None = None,
        accountant: str = "rdp",
        *,
        num_samples: int | None = None,
    ) -> None:
        if not isinstance(psm, PerSampleModule):
            raise PrivacyError(
                f"DPSGD needs the PerSampleModule wrapping the model, got {type(psm).__name__}: "
                "DPSGD(PerSampleModule(model), ...)"
            )
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        if (expected_batch_size is None) == (num_samples is None):
            raise PrivacyError(
                "DPSGD divides the summed clipped gradients by the EXPECTED batch size sample_rate * N (N: the "
                "dataset's size), not by the drawn one: pass exactly one of expected_batch_size=sample_rate * N or "
                f"num_samples=N (got expected_batch_size={expected_batch_size!r}, num_samples={num_samples!r})"
            )
        expected = sample_rate * num_samples if num_samples is not None else expected_batch_size
        assert expected is not None
        if not expected > 0:
            raise ValueError(f"the expected batch size must be > 0, got {expected!r}")
        self.psm = psm
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.sample_rate, self.expected_batch_size = float(sample_rate), float(expected)
        self.accountant = accountant
        self.steps = 0
        self._check_wrapper()
        self.target = psm.module if target is None else target
        self._name = self._find_target()
        self._check_outside()
        self._clip = PrivateClip(self.max_grad_norm, self.expected_batch_size, psm)
        try:
            psm.register_transform(self.target, self._clip)
        except TargetError as err:
            raise PrivacyError(
                f"DPSGD cannot clip {self._label()}: {err}. DP-SGD's clipping must be the only transform on the "
                "parameters it covers: remove the other transform (a new PerSampleModule) or let DPSGD register "
                "the clipping alone"
            ) from err
        self.generator = generator
        self._checked_ranks = False
        self._pending: Tensor | None = None  # a loaded generator state, for the generator made at the first noise

    # -- what is refused ---------------------------------------------------------------------------

    def _check_wrapper(self) -> None:
        psm = self.psm
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
        fsdp = __import__("sys").modules.get("torch.distributed.fsdp")
        if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in psm.module.modules()):
            raise PrivacyError(
                "DPSGD does not support FSDP2 (fully_shard) models yet: use DistributedDataParallel "
                "(PerSampleModule(DDP(model), reduction='sum'))"
            )
        self._check_distributed()

    def _check_distributed(self) -> None:
        if self.psm.reduction == "mean" and _world_size() > 1:
            raise PrivacyError(
                "under torch.distributed, DPSGD needs the wrapper's reduction='sum' (pergrad's sum runs over every "
                "rank's samples; its 'mean' is a mean of each rank's mean): PerSampleModule(ddp_model, "
                "reduction='sum'); the loss's own reduction (loss_reduction) may stay 'mean'"
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

    def params(self) -> list[nn.Parameter]:
        """The parameters DPSGD clips and noises: the target's trainable ones, in its order."""
        return [p for p in self.psm.module.get_submodule(self._name).parameters() if p.requires_grad]

    # -- the noise ---------------------------------------------------------------------------------

    def _generator(self, like: Tensor) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(like.device).manual_seed(_seed_shared_by_ranks())
            self._checked_ranks = self._pending is None
            if self._pending is not None:
                self.generator.set_state(self._pending)
                self._pending = None
        if not self._checked_ranks and _world_size() > 1 and not _same_on_every_rank(self.generator):
            raise PrivacyError(
                "DPSGD's noise generators differ between ranks, so the ranks' .grad would differ (each rank would "
                "step with its own noise): pass generator=torch.Generator().manual_seed(SEED) with the same SEED on "
                "every rank, or generator=None (DPSGD then seeds one from rank 0)"
            )
        self._checked_ranks = True
        return self.generator

    def add_noise(self) -> None:
        """After the step's backward pass(es), before ``optimizer.step()``: add ``N(0, sigma^2 C^2 I) /
        expected_batch_size`` to the ``.grad`` of every parameter DPSGD covers (a ``.grad`` of None, where
        no backward reached it or the batch was empty, becomes the noise alone), and count one step."""
        self._check_distributed()
        self._check_outside()
        params = self.params()
        std = self.noise_multiplier * self.max_grad_norm / self.expected_batch_size
        generator = self._generator(params[0]) if params else None
        for p in params:
            if self.noise_multiplier > 0:
                assert generator is not None
                dtype = torch.promote_types(p.dtype, torch.float32)
                noise = torch.randn(p.shape, generator=generator, device=generator.device, dtype=dtype)
                noise = noise.mul_(std).to(device=p.device, dtype=p.dtype)
            else:
                noise = torch.zeros_like(p)
            if p.grad is None:
                p.grad = noise
            else:
                p.grad.add_(noise)
        self.steps += 1

    # -- accounting and resuming -------------------------------------------------------------------

    def epsilon(self, delta: float) -> float:
        """The epsilon spent at ``delta`` by the steps so far (``epsilon_of``)."""
        return epsilon_of(self.noise_multiplier, self.sample_rate, self.steps, delta, self.accountant)

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the steps taken (the privacy spent) and the noise generator's state."""
        return {
            "steps": self.steps,
            "generator": None if self.generator is None else self.generator.get_state(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of the run being resumed)."""
        for key in ("noise_multiplier", "sample_rate"):
            if key in state and state[key] != getattr(self, key):
                raise PrivacyError(
                    f"the saved DP-SGD state has {key}={state[key]!r}, this DPSGD {getattr(self, key)!r}: the steps "
                    "taken with the saved one would be accounted at the wrong value. Resume with the same settings"
                )
        self.steps = int(state["steps"])
        if state.get("generator") is not None:
            if self.generator is None:  # made on the parameters' device at the first noise
                self._pending = state["generator"]
            else:
                self.generator.set_state(state["generator"])
            self._checked_ranks = False

    def __repr__(self) -> str:
        return (
            f"DPSGD({self._label()}, max_grad_norm={self.max_grad_norm}, noise_multiplier={self.noise_multiplier}, "
            f"sample_rate={self.sample_rate}, expected_batch_size={self.expected_batch_size}, steps={self.steps})"
        )


# -- accounting ------------------------------------------------------------------------------------


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ModuleNotFoundError as err:
        if err.name != "dp_accounting":
            raise
        raise ModuleNotFoundError(
            "pergrad.privacy's accountant is Google's dp_accounting: pip install 'pergrad[dp]' "
            "(or pip install 'dp-accounting>=0.6,<0.7')",
            name="dp_accounting",
        ) from err
    return dp_accounting


def _event(dp_accounting: Any, noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def _accountant(dp_accounting: Any, accountant: str) -> Any:
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _check_accounting(sample_rate: float, steps: int, delta: float) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def epsilon_of(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """The epsilon at ``delta`` of ``steps`` DP-SGD steps: ``steps`` compositions of a Poisson-sampled
    (rate ``sample_rate``) Gaussian mechanism with noise multiplier ``noise_multiplier`` (noise std over
    sensitivity), add-or-remove-one neighbours, from Google's ``dp_accounting``: its RDP accountant
    (``"rdp"``) or its tighter, slower privacy-loss-distribution accountant (``"pld"``). 0 for no
    step, ``inf`` for no noise."""
    _check_accounting(sample_rate, steps, delta)
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    dp_accounting = _dp_accounting()
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = _event(dp_accounting, noise_multiplier, sample_rate, steps)
    return float(_accountant(dp_accounting, accountant).compose(event).get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier whose ``steps`` DP-SGD steps at ``sample_rate`` spend at most
    ``target_epsilon`` at ``delta`` (``epsilon_of`` of it is <= ``target_epsilon``; found by
    ``dp_accounting.calibrate_dp_mechanism`` to 1e-6)."""
    _check_accounting(sample_rate, steps, delta)
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    if steps == 0:
        return 0.0
    dp_accounting = _dp_accounting()
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(dp_accounting, accountant),
        lambda s: _event(dp_accounting, s, sample_rate, steps),
        target_epsilon,
        delta,
        dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
    )
    return float(sigma)
