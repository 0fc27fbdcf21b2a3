"""``make_private``: DP-SGD set up in one call, from the model, the optimizer, the data and a target epsilon."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..module import PerSampleModule
from .accounting import ACCOUNTANTS, noise_multiplier_for
from .dpsgd import DPSGD
from .randomness import world_size
from .sampling import PoissonBatchSampler, collate_with_empty


@dataclass
class Private:
    """What ``make_private`` set up: ``psm`` (the wrapped model: call it in the loop), ``loader`` (the
    Poisson batches), ``dp`` (the clipping, the noise at each ``optimizer.step()``, the steps taken),
    ``noise_multiplier`` (calibrated) and ``steps`` (the steps it was calibrated for: ``epochs`` passes of
    ``len(loader) / micro_batches`` steps; ``dp`` refuses one more)."""

    psm: PerSampleModule
    loader: DataLoader[Any]
    sampler: PoissonBatchSampler
    dp: DPSGD
    noise_multiplier: float
    steps: int
    delta: float

    def epsilon(self) -> float:
        """The epsilon spent so far at ``delta``."""
        return self.dp.epsilon(self.delta)


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: Any,
    *,
    target_epsilon: float,
    delta: float,
    epochs: int,
    max_grad_norm: float,
    expected_batch_size: float | None = None,
    sample_rate: float | None = None,
    micro_batches: int = 1,
    accountant: str = "rdp",
    secure_mode: bool = False,
    target: nn.Module | str | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    loader_options: Mapping[str, Any] | None = None,
    wrapper_options: Mapping[str, Any] | None = None,
) -> Private:
    """DP-SGD on ``model`` in one call: wrap it, build the Poisson loader over ``dataset``, calibrate the
    noise multiplier so that ``epochs`` passes spend ``target_epsilon`` at ``delta``, and hook ``optimizer``.

    The sampling rate is given once, as ``expected_batch_size`` (``q = expected_batch_size / len(dataset)``)
    or ``sample_rate``: the loader draws with it and the accountant counts with it. A pass is ``round(1 /
    q)`` steps (one epoch in expectation); the noise multiplier is ``noise_multiplier_for(target_epsilon,
    delta, q, epochs * round(1 / q), accountant)``, and the ``DPSGD`` refuses a step beyond those. The loop::

        private = make_private(model, optimizer, data, target_epsilon=3.0, delta=1e-5, epochs=3,
                               max_grad_norm=1.0, expected_batch_size=64)
        for epoch in range(3):
            for x, y in private.loader:  # Poisson batches: any size, empty ones included
                loss_fn(private.psm(x), y).backward()
                optimizer.step()  # clipped sum + noise, over q N
                optimizer.zero_grad()
        private.epsilon()  # at most target_epsilon

    ``micro_batches=k`` splits each draw into ``k`` micro-batches, one backward each, one optimizer step
    per draw (gradient accumulation; do not divide the loss by ``k``, or say so with
    ``wrapper_options={"loss_scale": 1 / k}``). Under ``torch.distributed`` (DDP: pass the DDP module as
    ``model``) every rank gets its share of each draw. ``secure_mode=True``: the batches and the noise
    from a cryptographically secure stream (``pergrad.privacy.randomness``). ``collate_fn`` (yours, for
    non-empty batches) and ``loader_options`` (``num_workers``, ...) go to the ``DataLoader``;
    ``wrapper_options`` to ``PerSampleModule`` (default ``keep_grad_sample=False``; ``reduction="sum"``).
    """
    if not hasattr(dataset, "__len__"):
        raise TypeError("make_private needs a dataset with a length: Poisson sampling draws from range(len(dataset))")
    n = len(dataset)
    if (expected_batch_size is None) == (sample_rate is None):
        raise ValueError(
            "give the sampling rate once: expected_batch_size=B (then q = B / len(dataset)) or sample_rate=q, "
            f"not both or neither (got expected_batch_size={expected_batch_size!r}, sample_rate={sample_rate!r})"
        )
    q = float(sample_rate) if sample_rate is not None else float(expected_batch_size) / n  # type: ignore[arg-type]
    if not 0 < q <= 1:
        raise ValueError(f"the sampling rate must be in (0, 1], got {q!r} (expected batch size {q * n:g} of {n})")
    if not (isinstance(epochs, int) and epochs > 0):
        raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    per_epoch = max(1, round(1 / q))
    steps = epochs * per_epoch
    sigma = noise_multiplier_for(target_epsilon, delta, q, steps, accountant)
    replicas = world_size()
    rank = torch.distributed.get_rank() if replicas > 1 else 0
    options = {"keep_grad_sample": False, "reduction": "sum", **(wrapper_options or {})}
    psm = PerSampleModule(model, **options)
    try:
        sampler = PoissonBatchSampler(
            n,
            q,
            steps=per_epoch,
            num_replicas=replicas,
            rank=rank,
            micro_batches=micro_batches,
            secure_mode=secure_mode,
        )
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_with_empty(dataset, collate_fn),
            **dict(loader_options or {}),
        )
        dp = DPSGD(
            psm,
            optimizer,
            sampler,
            max_grad_norm=max_grad_norm,
            noise_multiplier=sigma,
            target=target,
            accountant=accountant,
            max_steps=steps,
        )
    except BaseException:
        psm.remove()
        raise
    return Private(psm, loader, sampler, dp, sigma, steps, delta)
