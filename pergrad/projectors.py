"""Random projections ``P vec(g_i)`` of per-sample gradients, regenerated (never saved) from
``(seed, parameter name, shape, kind)``.

Every parameter of a projection target has its own block ``P_p`` with ``k`` rows, and the target's
features are ``sum_p P_p vec(g_i(p))``: the projection ``[P_1 ... P_m]`` of the target's whole
gradient (its parameters concatenated), ``k`` features whatever the number of parameters.

- ``"kron"``: a parameter of two or more dims, stored ``[R, C, *rest]`` (a Linear ``[out, in]``, a
  convolution ``[out, in/groups, *kernel]``, a transposed one ``[in, out/groups, *kernel]``, an embedding
  ``[vocab, dim]``, HF ``Conv1D`` ``[in, out]``)
  gets ``P_p = P_row ⊗ P_col`` with ``P_row`` ``[r_row, R]`` and ``P_col`` ``[r_col, C * prod(rest)]``:
  ``P_p vec(g) = vec(P_row g P_col^T)``, flattened row-major (``[r_row, r_col]``), with
  ``r_row * r_col = k`` (``split``). A layer with a Kronecker rule (``FusedRule.project``) computes it
  from its input and output gradient without building ``g_i``. A one-dim parameter (bias, norm
  weight) gets a CountSketch (Charikar et al. 2002): coordinate ``j`` is added, with a random sign
  ``s_j``, to one feature ``h_j`` (``P[h_j, j] = s_j``): inner products are unbiased, with about the
  variance of a Gaussian block's, at the cost of one pass over ``g_i`` rather than ``k`` (a dense
  ``[k, 512]`` block per bias cost as much as the layer's weight gradient).
- ``"dense"``: one Gaussian ``[k, numel]`` block per parameter, applied to the built ``g_i``.

Entries are Gaussian with variance ``1/k`` (``1/r_row`` and ``1/r_col`` for the two factors), so
``E[P^T P] = I`` and inner products are preserved in expectation (Johnson-Lindenstrauss). They are
drawn on the CPU in float64 by a ``torch.Generator`` seeded from a SHA-256 of the key, then cast:
the same on every device, thread count, process and restart. Kronecker factors and dense blocks of
at most ``CACHED`` elements are kept by the ``Projector`` once drawn; larger dense blocks are drawn
again at each backward, ``CHUNK`` elements (32 MiB of float64) at a time, so the whole block is never
held: a dense projection holds one chunk and one parameter's ``g_i`` at a time.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

KINDS = ("kron", "dense")
CHUNK = 1 << 22  # float64 elements of a dense block drawn at once
CACHED = 1 << 20  # blocks up to this many elements are drawn once per Projector, then kept


def split(k: int) -> tuple[int, int]:
    """``(r_row, r_col)`` with ``r_row * r_col = k``: ``(r, r)`` for ``k = r^2``, ``(r, 2r)`` for
    ``k = 2 r^2`` (every power of two); ``ValueError`` for any other ``k``."""
    for factor in (1, 2):
        r = math.isqrt(k // factor)
        if factor * r * r == k and r > 0:
            return r, factor * r
    raise ValueError(k)


def splittable(k: int) -> bool:
    try:
        split(k)
    except ValueError:
        return False
    return True


def _generator(seed: int, *key: object) -> torch.Generator:
    """A CPU generator seeded from ``(seed, *key)`` (stable across processes: no ``hash()``)."""
    digest = hashlib.sha256(repr((seed, *key)).encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def gaussian(rows: int, cols: int, seed: int, *key: object) -> Tensor:
    """``[rows, cols]`` standard Gaussian float64 entries on the CPU, a function of ``(seed, *key)``."""
    return torch.randn(rows, cols, generator=_generator(seed, *key), dtype=torch.float64)


def kron_features(u: Tensor, v: Tensor) -> Tensor:
    """A Kronecker block's features from its factors at every position (a rule's ``FusedRule.factors``):
    ``vec(sum_s u_is v_is^T)`` row-major, ``u [n, s, p]``, ``v [n, s, q]`` -> ``[n, p * q]``, with no
    ``[p, q]`` tensor per position."""
    return torch.bmm(u.transpose(1, 2), v).flatten(1)  # nsp,nsq->npq


def kron_token_features(u: Tensor, v: Tensor) -> Tensor:
    """Per position: ``vec(u_it v_it^T)``, ``u [n, t, p]``, ``v [n, t, q]`` -> ``[n, t, p * q]``."""
    return (u.unsqueeze(3) * v.unsqueeze(2)).flatten(2)  # ntp,ntq->ntpq


@dataclass(frozen=True)
class Spec:
    """One ``register_projection``: ``k`` features of each sample, of this kind, seed and dtype."""

    dim: int
    kind: str = "kron"
    seed: int = 0
    dtype: torch.dtype | None = None  # of the features (None: the parameters')


@dataclass
class Projector:
    """The block ``P_p`` of one parameter, by its qualified name and shape."""

    spec: Spec
    name: str
    shape: tuple[int, ...]
    _kept: dict[tuple[str, int], Tensor] = field(default_factory=dict, repr=False)  # float64 CPU blocks
    _cast: dict[tuple[str, int, torch.dtype, torch.device], Tensor] = field(default_factory=dict, repr=False)

    @property
    def kron(self) -> bool:
        """Whether ``P_p = P_row ⊗ P_col`` (else a sketch or dense)."""
        return self.spec.kind == "kron" and len(self.shape) >= 2

    @property
    def sketch(self) -> bool:
        """Whether ``P_p`` is a CountSketch (a one-dim parameter of a Kronecker projection)."""
        return self.spec.kind == "kron" and len(self.shape) < 2

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _key(self, part: str) -> tuple[object, ...]:
        return (self.name, self.shape, self.spec.kind, part)

    def _block(self, part: str, index: int, rows: int, cols: int, scale: float) -> Tensor:
        """A float64 CPU block of the projection, kept when small."""
        found = self._kept.get((part, index))
        if found is None:
            found = gaussian(rows, cols, self.spec.seed, *self._key(part), index).mul_(scale)
            if rows * cols <= CACHED:
                self._kept[(part, index)] = found
        return found

    def _like(self, part: str, index: int, block: Tensor, like: Tensor) -> Tensor:
        if block.numel() > CACHED:
            return block.to(like.device, like.dtype)
        key = (part, index, like.dtype, like.device)
        found = self._cast.get(key)
        if found is None:
            found = self._cast[key] = block.to(like.device, like.dtype)
        return found

    def factors(self, like: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``P_row [r_row, R]`` and ``P_col [r_col, C * prod(rest)]`` of a Kronecker block, in the
        dtype and on the device of ``like`` (float64 CPU without it)."""
        assert self.kron
        r_row, r_col = split(self.spec.dim)
        rows, cols = self.shape[0], self.numel // self.shape[0]
        row = self._block("row", 0, r_row, rows, 1 / math.sqrt(r_row))
        col = self._block("col", 0, r_col, cols, 1 / math.sqrt(r_col))
        if like is None:
            return row, col
        return self._like("row", 0, row, like), self._like("col", 0, col, like)

    def sketched(self, like: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A CountSketch's feature of each coordinate ``h`` ``[numel]`` (int64) and its sign ``s``
        ``[numel]`` (float64 on the CPU, or in the dtype and on the device of ``like``)."""
        assert self.sketch
        if ("sketch", 0) not in self._kept:
            generator = _generator(self.spec.seed, *self._key("sketch"))
            self._kept[("sketch", 0)] = torch.randint(0, self.spec.dim, (self.numel,), generator=generator)
            signs = torch.randint(0, 2, (self.numel,), generator=generator).to(torch.float64)
            self._kept[("sketch", 1)] = signs.mul_(2).sub_(1)
        where, signs = self._kept[("sketch", 0)], self._kept[("sketch", 1)]
        if like is None:
            return where, signs
        return where.to(like.device), self._like("sketch", 1, signs, like)

    def dense_blocks(self, like: Tensor | None = None) -> Iterator[tuple[slice, Tensor]]:
        """The rows of a dense block ``[k, numel]``, ``CHUNK`` elements at a time: (rows, block)."""
        k, numel = self.spec.dim, self.numel
        step = max(1, CHUNK // numel)
        for index, start in enumerate(range(0, k, step)):
            stop = min(k, start + step)
            block = self._block("dense", index, stop - start, numel, 1 / math.sqrt(k))
            yield slice(start, stop), block if like is None else self._like("dense", index, block, like)

    def apply(self, g: Tensor) -> Tensor:
        """``P_p vec(g_i)`` for built per-sample gradients ``g`` ``[B, *shape]`` -> ``[B, k]``."""
        n = g.shape[0]
        if self.kron:
            row, col = self.factors(g)
            return (row @ g.reshape(n, self.shape[0], -1) @ col.T).reshape(n, -1)
        flat = g.reshape(n, -1)
        if self.sketch:  # out of place: differentiable under create_graph
            where, signs = self.sketched(flat)
            return flat.new_zeros((n, self.spec.dim)).index_add(1, where, flat * signs)
        out = flat.new_empty((n, self.spec.dim))
        for rows, block in self.dense_blocks(flat):
            out[:, rows] = flat @ block.T
        return out

    def matrix(self) -> Tensor:
        """The whole block ``P_p`` ``[k, numel]`` in float64 (for tests and small parameters)."""
        if self.kron:
            return torch.kron(*self.factors())
        if self.sketch:
            where, signs = self.sketched()
            found = torch.zeros(self.spec.dim, self.numel, dtype=torch.float64)
            found[where, torch.arange(self.numel)] = signs
            return found
        return torch.cat([block for _, block in self.dense_blocks()])
