"""Poisson sampling: the batches DP-SGD's privacy analysis assumes, and a collate that takes an empty one."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Sampler, default_collate

from .errors import PrivacyError
from .randomness import SecureStream, entropy_generator, public_seed, same_on_every_rank, world_size


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches by Poisson sampling: at each step every index of ``range(num_samples)`` joins the batch
    independently with probability ``sample_rate`` (the sampling the privacy analysis of DP-SGD assumes).

    Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_with_empty(dataset))``: a
    batch may be EMPTY (its probability is ``(1 - q)^N``), which the default collate cannot stack.
    ``len(sampler)`` is the number of batches one pass yields: ``steps`` (default ``round(1 / q)``, one
    epoch in expectation) times ``micro_batches``. Each pass continues the randomness: new draws.

    Where the draws come from (the accounting assumes no one else can tell which samples a step used):

    - ``generator=None`` (default): a ``torch.Generator`` seeded from the operating system's entropy at the
      first pass, never from ``torch.manual_seed``: a public seed would tell an observer every batch;
    - ``secure_mode=True``: a cryptographically secure stream (``pergrad.privacy.randomness.SecureStream``);
    - ``generator=torch.Generator().manual_seed(SEED)``: reproducible batches, for experiments. The privacy
      then rests on SEED being secret, and ``DPSGD`` refuses to draw its noise from the same stream.

    Several processes (``num_replicas > 1``): every rank draws the SAME batch and keeps the indices
    ``i`` with ``i % num_replicas == rank``: the ranks' batches together are one Poisson sample of the
    dataset. Every rank yields the same number of batches (some empty), and must run its forward and
    backward on each, empty ones included (DDP pairs the ranks' gradient reductions). Without a generator,
    rank 0's seed (or key) is sent to every rank; a generator you pass must be seeded alike on every rank
    (checked at the first pass under ``torch.distributed``).

    ``micro_batches=k``: each step's draw is split into ``k`` consecutive micro-batches (sizes within
    one of each other, some may be empty), for gradient accumulation over ``k`` backward passes per
    optimizer step: the optimizer step sees one Poisson sample, as the accounting assumes.

    Once a ``DPSGD`` uses the sampler, each step's draw is remembered (this rank's share of it) until
    ``DPSGD`` checks, at the optimizer step, that the step trained on exactly that many samples: a batch
    from another loader, a step over part of a draw or over two draws, and a batch backpropagated twice
    are refused there.

    ``state_dict()`` / ``load_state_dict()`` keep the position in the current pass and, for a generator you
    passed, its state: a pass started after ``load_state_dict`` yields the steps the saved pass had not
    drawn (under a ``DPSGD``: not trained on; draws a loader fetched ahead are drawn again, as the
    uninterrupted run had them), from where the generator was then. Without a generator, or in secure mode, no randomness is
    saved: a resumed run draws afresh (never a batch it trained on again).
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
        *,
        secure_mode: bool = False,
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
        if secure_mode and generator is not None:
            raise PrivacyError(
                "PoissonBatchSampler(secure_mode=True) draws from a cryptographically secure stream of its own: "
                "pass generator=None"
            )
        public = None if generator is None else public_seed(generator)
        if public is not None:
            raise PrivacyError(
                f"PoissonBatchSampler's generator is public: {public}. Whoever knows that seed replays every batch, "
                "and the privacy the accountant counts from the sampling is lost. Leave generator=None (seeded from "
                "the operating system's entropy), or seed it from a secret of yours"
            )
        self.num_samples, self.sample_rate, self.steps = num_samples, float(sample_rate), steps
        self.num_replicas, self.rank, self.micro_batches = num_replicas, rank, micro_batches
        self.secure_mode = secure_mode
        self._generator = generator  # None: seeded from OS entropy at the first pass (rank 0's)
        self.seeded = generator is not None  # reproducible draws from a generator the user seeded
        self._secure: SecureStream | None = None
        self._checked = False
        self.drawn = 0  # steps of the current (or last) pass drawn so far
        self._resume_at = 0
        # once a DPSGD checks the steps (``track_shares``): this rank's share of each draw it has not taken
        # yet, and (a generator of yours) the generator's state before that draw
        self._tracked = False
        self._shares: deque[tuple[int, Tensor | None]] = deque()

    def __len__(self) -> int:
        return self.steps * self.micro_batches

    def _check_outside_distributed(self) -> None:
        if self.num_replicas > 1 and world_size() == 1:
            raise PrivacyError(
                f"PoissonBatchSampler(num_replicas={self.num_replicas}) without a generator, outside "
                "torch.distributed: the ranks would draw different batches. Create the sampler after "
                "torch.distributed.init_process_group (rank 0's seed is then sent to every rank)"
            )

    @property
    def generator(self) -> torch.Generator | None:
        """The ``torch.Generator`` of the draws (None in secure mode): yours, or one seeded from OS
        entropy at the first use (rank 0's seed under ``torch.distributed``). A generator you passed is
        checked, once, to be in the same state on every rank."""
        if self.secure_mode:
            return None
        if self._generator is None:
            self._check_outside_distributed()
            self._generator = entropy_generator()
            self._checked = True
        if not self._checked and self.num_replicas > 1 and world_size() > 1:
            if not same_on_every_rank(self._generator):
                raise PrivacyError(
                    "PoissonBatchSampler's generators differ between ranks, so the ranks' batches would not be "
                    "shares of one Poisson draw: pass generator=torch.Generator().manual_seed(SEED) with the same "
                    "SEED on every rank, or generator=None"
                )
            self._checked = True
        return self._generator

    def _uniforms(self) -> Tensor:
        if self.secure_mode:
            if self._secure is None:
                self._check_outside_distributed()
                self._secure = SecureStream()
            return self._secure.uniform(self.num_samples)
        generator = self.generator
        assert generator is not None
        return torch.rand(self.num_samples, generator=generator, device=generator.device, dtype=torch.float64)

    def draw(self) -> Tensor:
        """One step's Poisson sample of ``range(num_samples)`` (every rank's share), sorted."""
        keep = self._uniforms() < self.sample_rate
        return keep.nonzero().flatten().cpu()

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume_at = self._resume_at, 0
        self._shares.clear()  # a new pass: draws of an abandoned one were never trained on
        for step in range(start, self.steps):
            tracked = self._tracked
            before = self.generator.get_state() if tracked and self.seeded and self.generator is not None else None
            drawn = self.draw()
            self.drawn = step + 1
            mine = drawn[drawn % self.num_replicas == self.rank]
            if tracked:
                self._shares.append((len(mine), before))
            for part in torch.tensor_split(mine, self.micro_batches):
                yield part.tolist()

    def track_shares(self) -> None:
        """From now on, remember each draw (this rank's share) until ``take_share`` takes it: what ``DPSGD``
        checks each step against, and what ``state_dict`` counts as trained on."""
        self._tracked = True

    def take_share(self) -> int | None:
        """This rank's number of samples in the oldest draw not yet taken (None: no draw waiting)."""
        return self._shares.popleft()[0] if self._shares else None

    def state_dict(self) -> dict[str, Any]:
        """How many steps of the current pass were trained on (``steps``: none left) and, for a generator you
        passed, its state before the first draw not yet trained on: draws a loader fetched ahead of the
        training loop are drawn again after a resume, as the uninterrupted run trains on them."""
        if self._shares:
            drawn, state = self.drawn - len(self._shares), self._shares[0][1]
        else:
            drawn = self.drawn
            state = self.generator.get_state() if self.seeded and self.generator is not None else None
        return {"generator": state, "drawn": drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass yields the steps the saved pass had not drawn (a new
        pass if it had drawn them all), from the saved generator state (with a generator you passed)."""
        if state.get("generator") is not None and self.seeded:
            generator = self.generator
            assert generator is not None
            generator.set_state(state["generator"])
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
