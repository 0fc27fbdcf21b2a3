"""Where DP-SGD's randomness comes from: never from a seed the user or the data order also uses.

The privacy analysis of DP-SGD assumes that neither the batch choice (Poisson sampling) nor the noise can
be predicted by anyone else: an observer who can regenerate the noise subtracts it, and one who knows the
batches loses nothing to the sampling's amplification. So, by default, both are seeded from the operating
system's entropy (``secrets``), once, on rank 0 under ``torch.distributed`` (broadcast: every rank
draws the same batch and adds the same noise), and never from ``torch.manual_seed``'s stream.

- ``entropy_seed()``: a 63-bit seed from OS entropy (rank 0's on every rank), for a ``torch.Generator``:
  torch's Mersenne Twister and its Gaussian sampler, fast on every device, not cryptographically secure.
- ``SecureStream``: a cryptographically secure stream (SHAKE-256 from ``hashlib``, keyed with 256 bits of
  OS entropy, rank 0's key on every rank) for ``secure_mode=True``: uniforms of 53 bits for the Poisson
  draws, and Gaussians sampled in float64 by Box-Muller and summed four at a time (``(z1 + z2 + z3 + z4) /
  2``, as Opacus's secure mode does after Holohan & Braghin 2021), so that the low bits of a noise value do
  not reveal the uniforms it came from. It runs on the host at about 300 MB of output a second (32 bytes per
  noise value): about 0.4 s per million parameters and step on this project's 2-core CPU.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import torch
import torch.distributed as dist
from torch import Tensor

KEY_BYTES = 32
_MANTISSA = 2.0**-53


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors: the current CUDA device under NCCL,
    the CPU otherwise. (pergrad's collectives send tensors, not pickled objects: torch's ``*_object``
    collectives need numpy, which pergrad does not require.)"""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank0s(value: bytes) -> bytes:
    """``value`` as rank 0 has it, on every rank (itself in one process); every rank passes as many bytes."""
    if world_size() == 1:
        return value
    found = torch.tensor(list(value), dtype=torch.uint8, device=collective_device())
    dist.broadcast(found, src=0)
    return bytes(found.tolist())


def same_on_every_rank(generator: torch.Generator) -> bool:
    """Whether ``generator``'s state is the same on every rank (one small all-gather of its SHA-256)."""
    digest = torch.tensor(
        list(hashlib.sha256(bytes(generator.get_state().tolist())).digest()), dtype=torch.uint8,
        device=collective_device(),
    )  # fmt: skip
    digests = [torch.empty_like(digest) for _ in range(world_size())]
    dist.all_gather(digests, digest)
    return all(torch.equal(d, digest) for d in digests)


def public_seed(generator: torch.Generator) -> str | None:
    """Why ``generator``'s stream is public (anyone who knows the code can replay it), or None: torch's
    default generator itself, a generator never seeded (torch's fixed default seed), or one seeded like
    torch's default generator (``torch.manual_seed``'s seed, which the code usually shows)."""
    if generator is torch.default_generator:
        return "it is torch's default generator (seeded by torch.manual_seed)"
    if generator.initial_seed() == torch.Generator().initial_seed():
        return f"it was never seeded: torch.Generator()'s fixed default seed {generator.initial_seed()}"
    if generator.initial_seed() == torch.initial_seed():
        return f"it is seeded like torch's default generator ({generator.initial_seed()}, torch.manual_seed's seed)"
    return None


def entropy_seed() -> int:
    """A fresh seed of 63 bits from the operating system's entropy; rank 0's under ``torch.distributed``."""
    return int.from_bytes(_rank0s(secrets.randbits(63).to_bytes(8, "little")), "little")


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded by ``entropy_seed()``."""
    return torch.Generator(device).manual_seed(entropy_seed())


class SecureStream:
    """A cryptographically secure random stream: block ``n`` is ``SHAKE-256(key || n)``, the key 256 bits of
    OS entropy (rank 0's under ``torch.distributed``). Nothing of it is saved in a checkpoint: a resumed run
    draws from a new key."""

    def __init__(self) -> None:
        self._key = _rank0s(secrets.token_bytes(KEY_BYTES))
        self._block = 0

    def _bytes(self, n: int) -> bytes:
        out = hashlib.shake_256(self._key + self._block.to_bytes(8, "little")).digest(n)
        self._block += 1
        return out

    def uniform(self, n: int) -> Tensor:
        """``n`` uniforms in [0, 1), float64, each from 53 random bits."""
        if n == 0:
            return torch.empty(0, dtype=torch.float64)
        words = torch.frombuffer(bytearray(self._bytes(8 * n)), dtype=torch.int64)
        return (words & (2**53 - 1)).double().mul_(_MANTISSA)

    def normal(self, shape: torch.Size | tuple[int, ...]) -> Tensor:
        """Standard normal values of ``shape``, float64: each the sum of four Box-Muller normals over 2."""
        count = math.prod(shape)
        u = self.uniform(4 * count).view(2, 2 * count)  # 2 count Box-Muller pairs: 4 count normals
        radius = torch.sqrt(-2.0 * torch.log1p(-u[0]))  # 1 - u in (0, 1]: no log(0)
        angle = (2 * math.pi) * u[1]
        z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])
        return z.view(4, count).sum(0).div_(2.0).view(shape)
