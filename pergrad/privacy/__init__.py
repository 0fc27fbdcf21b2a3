"""DP-SGD as a library feature: Poisson sampling, clipping with Gaussian noise, and the privacy spent.

One step of DP-SGD (Abadi et al. 2016) on a batch drawn by Poisson sampling (every sample joins it
independently with probability ``q``, so the batch size ``B`` varies and may be 0)::

    .grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / E[B],   clip_C(g) = g * min(1, C / ||g||),  E[B] = q N

- ``make_private``: all of it in one call, from the model, the optimizer, the dataset, the expected batch
  size, the epochs and a target epsilon (the noise multiplier calibrated, the rate given once).
- ``PoissonBatchSampler`` (``pergrad.privacy.sampling``): the batches (a ``batch_sampler`` for
  ``DataLoader``), one Poisson draw per step, shared out over DDP ranks and, optionally, split into
  gradient-accumulation micro-batches; ``collate_with_empty`` lets a ``DataLoader`` hand out an empty batch.
- ``DPSGD`` (``pergrad.privacy.dpsgd``): the clipping (``transforms.clip_norm`` over the whole target,
  computed in the ordinary backward, with the normalisation by ``E[B]`` folded in), the noise at every
  ``optimizer.step()``, and the checks that make the reported privacy the privacy the training got.
- ``epsilon_of`` / ``noise_multiplier_for`` (``pergrad.privacy.accounting``): the (epsilon, delta) of
  ``steps`` Poisson-sampled Gaussian steps, and the noise multiplier that spends a given epsilon, from
  Google's ``dp_accounting`` (``pip install 'pergrad[dp]'``; imported only when called).
- ``pergrad.privacy.randomness``: where the batches and the noise come from (the operating system's
  entropy by default; a cryptographically secure stream with ``secure_mode=True``).

Only torch is needed to sample, clip and add noise.
"""

from .accounting import ACCOUNTANTS, epsilon_of, noise_multiplier_for
from .dpsgd import DPSGD, PrivateClip
from .errors import PrivacyError
from .sampling import PoissonBatchSampler, collate_with_empty
from .setup import Private, make_private

__all__ = [
    "ACCOUNTANTS",
    "DPSGD",
    "PoissonBatchSampler",
    "PrivacyError",
    "Private",
    "PrivateClip",
    "collate_with_empty",
    "epsilon_of",
    "make_private",
    "noise_multiplier_for",
]
