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
  ``r_row * r_col = k`` (``k`` a square or twice a square: ``splittable``), the factor pair of ``k`` that
  compresses both sides alike, ``r_row / r_col`` nearest ``R / (C * prod(rest))`` (``kron_ranks``): a
  ``[256, 32]`` LM head at ``k = 128`` gets ``32 x 4``, a square weight ``r x r`` or ``r x 2r``. A
  layer with a Kronecker rule (``pergrad.attribution.forms``) computes it
  from its input and output gradient without building ``g_i``. A one-dim parameter (bias, norm
  weight) gets a CountSketch (Charikar et al. 2002): coordinate ``j`` is added, with a random sign
  ``s_j``, to one feature ``h_j`` (``P[h_j, j] = s_j``): inner products are unbiased, with about the
  variance of a Gaussian block's, at the cost of one pass over ``g_i`` rather than ``k`` (a dense
  ``[k, 512]`` block per bias cost as much as the layer's weight gradient).
- ``"dense"``: one Rademacher ``[k, numel]`` block per parameter (entries ``±1/sqrt(k)``, Achlioptas
  2003: the Johnson-Lindenstrauss guarantee of a Gaussian block), applied to the built ``g_i``.
- ``"sjlt"``: a CountSketch of every parameter (a sparse JL transform with one nonzero per column):
  one pass over the built ``g_i``, no ``k`` factor at all.

Gaussian entries have variance ``1/r_row`` and ``1/r_col`` for the two Kronecker factors, so
``E[P^T P] = I`` and inner products are preserved in expectation (Johnson-Lindenstrauss). They are
drawn on the CPU in float64 by a ``torch.Generator`` seeded from a SHA-256 of the key, then cast;
signs and buckets are integers drawn the same way: the same on every device, thread count, process and
restart. Kronecker factors (``r`` rows of one side of the weight: small beside the weight itself), and
sketches and dense blocks of at most ``CACHED`` elements, are kept by the ``Projector`` once drawn, and so
are their copies on the parameters' device (a copy to a GPU at every backward waits for the GPU). Larger
dense blocks are drawn again at each backward, ``CHUNK`` elements at a time (as ``int8`` signs: 40x cheaper
than Gaussians), so the whole block is never held, unless the target's ``Budget``
(``register_projection(cache_mb=...)``) has room to keep them.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import Tensor

KINDS = ("kron", "dense", "sjlt")
# the definition of P: what (seed, name, shape, kind) draws. Raised whenever that changes, so a feature store
# written with an older P (its spec records the version) is refused rather than scored against new features.
# 2: dense blocks Rademacher by columns, a Kronecker block's larger rank on the narrower side.
# 3: a Kronecker block's ranks in the proportion of its sides (kron_ranks).
VERSION = 3
CHUNK = 1 << 22  # elements of a dense block drawn at once
CACHED = 1 << 20  # blocks up to this many elements are drawn once per Projector, then kept


def split(k: int) -> tuple[int, int]:
    """``(r_row, r_col)`` with ``r_row * r_col = k``: ``(r, r)`` for ``k = r^2``, ``(r, 2r)`` for
    ``k = 2 r^2`` (every power of two); ``ValueError`` for any other ``k``."""
    for factor in (1, 2):
        r = math.isqrt(k // factor)
        if factor * r * r == k and r > 0:
            return r, factor * r
    raise ValueError(k)


@functools.lru_cache(maxsize=4096)
def kron_ranks(k: int, rows: int, cols: int) -> tuple[int, int]:
    """``(r_row, r_col)`` of a Kronecker block ``[rows, cols]``: the factor pair ``r_row * r_col = k`` whose
    ratio ``r_row / r_col`` is nearest ``rows / cols`` in log (both sides compressed by about the same
    factor); a tie goes to the pair cheaper to apply (``rows * r_row + cols * r_col``), then to the smaller
    ``r_row``. Exact integer arithmetic: the same pair everywhere.

    Why: with ``X = P_row g P_col^T``, the estimate ``<P vec(g), P vec(g')>`` of ``<g, g'>`` has, beside a
    dense projection's ``O(1/k)`` variance, a term ``~ |g g'^T|_F^2 / r_row`` and one ``~ |g^T g'|_F^2 / r_col``;
    for factors spread evenly over their sides these are ``~ |g|^2 |g'|^2 / (cols * r_row)`` and
    ``/ (rows * r_col)``, whose sum under ``r_row r_col = k`` is least at ``r_row / r_col = rows / cols``.
    The larger rank on the narrower side (version 2) made the wide side of an LM head (the vocabulary)
    the most compressed one, and its TRAK LDS 0.01-0.02 below a dense projection's."""
    split(k)  # a square or twice a square, as before
    pairs = [(r, k // r) for r in range(1, k + 1) if k % r == 0]

    def key(pair: tuple[int, int]) -> tuple[Fraction, int, int]:
        r_row, r_col = pair
        a, b = r_row * cols, r_col * rows  # r_row / r_col against rows / cols, as a ratio >= 1
        return Fraction(max(a, b), min(a, b)), rows * r_row + cols * r_col, r_row

    return min(pairs, key=key)


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


def add_kron_features(total: Tensor, u: Tensor, v: Tensor, alpha: float = 1.0) -> None:
    """Adds a Kronecker block's features, from its factors at every position (a rule's
    ``Forms.factors``), into ``total`` ``[n, p * q]`` (contiguous): ``total += alpha vec(sum_s u_is
    v_is^T)`` row-major, ``u [n, s, p]``, ``v [n, s, q]``, in place (no ``[n, p, q]`` temporary)."""
    n, p, q = u.shape[0], u.shape[2], v.shape[2]
    if u.dtype != total.dtype:  # (a target over parameters of several dtypes: summed in the first's)
        total.add_(torch.bmm(u.transpose(1, 2), v).flatten(1), alpha=alpha)
        return
    out = total.view(n, p, q)
    if u.shape[1] == 1:  # one position: an outer product, cheaper broadcast than as a bmm of inner size 1
        out.addcmul_(u.reshape(n, p, 1), v, value=alpha)
    else:
        out.baddbmm_(u.transpose(1, 2), v, alpha=alpha)  # nsp,nsq->npq


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
class Budget:
    """Bytes of large dense blocks the projectors of one target may keep rather than redraw."""

    limit: int = 0
    used: int = 0

    def take(self, block: Tensor) -> bool:
        """Whether ``block`` fits in what is left (then counted as used)."""
        size = block.numel() * block.element_size()
        if self.used + size > self.limit:
            return False
        self.used += size
        return True


@dataclass
class Projector:
    """The block ``P_p`` of one parameter, by its qualified name and shape."""

    spec: Spec
    name: str
    shape: tuple[int, ...]
    budget: Budget = field(default_factory=Budget, repr=False)
    _kept: dict[tuple[str, int], Tensor] = field(default_factory=dict, repr=False)  # float64 CPU blocks
    _cast: dict[tuple[str, int, torch.dtype, torch.device], Tensor] = field(default_factory=dict, repr=False)

    @property
    def kron(self) -> bool:
        """Whether ``P_p = P_row ⊗ P_col`` (else a sketch or dense)."""
        return self.spec.kind == "kron" and len(self.shape) >= 2

    @property
    def sketch(self) -> bool:
        """Whether ``P_p`` is a CountSketch (``kind="sjlt"``, or a one-dim parameter of a Kronecker projection)."""
        return self.spec.kind == "sjlt" or (self.spec.kind == "kron" and len(self.shape) < 2)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _key(self, part: str) -> tuple[object, ...]:
        return (self.name, self.shape, self.spec.kind, part)

    def _factor(self, part: str, rows: int, cols: int, scale: float) -> Tensor:
        """A float64 CPU Kronecker factor, drawn once and kept."""
        found = self._kept.get((part, 0))
        if found is None:
            found = self._kept[(part, 0)] = gaussian(rows, cols, self.spec.seed, *self._key(part), 0).mul_(scale)
        return found

    def _like(
        self, part: str, index: int, block: Tensor, like: Tensor, dtype: torch.dtype | None = None, keep: bool = True
    ) -> Tensor:
        """``block`` on ``like``'s device, in ``dtype`` (``like``'s when None), kept for later calls where ``keep``."""
        dtype = like.dtype if dtype is None else dtype
        if not keep:
            return block.to(like.device, dtype)
        key = (part, index, dtype, like.device)
        found = self._cast.get(key)
        if found is None:
            found = self._cast[key] = block.to(like.device, dtype)
        return found

    @property
    def ranks(self) -> tuple[int, int]:
        """``(r_row, r_col)`` of a Kronecker block: ``kron_ranks`` of its ``[R, C * prod(rest)]`` (``P_row`` of
        a ``[256, 32]`` weight gets 32 rows at ``k = 128``, ``P_col`` 4)."""
        return kron_ranks(self.spec.dim, self.shape[0], self.numel // self.shape[0])

    def factors(self, like: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``P_row [r_row, R]`` and ``P_col [r_col, C * prod(rest)]`` of a Kronecker block (``ranks``), in
        the dtype and on the device of ``like`` (float64 CPU without it)."""
        assert self.kron
        r_row, r_col = self.ranks
        rows, cols = self.shape[0], self.numel // self.shape[0]
        row = self._factor("row", r_row, rows, 1 / math.sqrt(r_row))
        col = self._factor("col", r_col, cols, 1 / math.sqrt(r_col))
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
        keep = self.numel <= CACHED
        return self._like("sketch", 0, where, like, torch.int64, keep), self._like("sketch", 1, signs, like, keep=keep)

    def dense_blocks(self, like: Tensor | None = None) -> Iterator[tuple[slice, Tensor]]:
        """The columns of a dense block ``[k, numel]``, ``CHUNK`` elements at a time: (columns, block
        ``[k, len(columns)]``), in the dtype and on the device of ``like`` (float64 CPU without it). By
        columns, so that projecting reads each coordinate of ``g_i`` once."""
        k, numel = self.spec.dim, self.numel
        step = max(1, CHUNK // k)
        for index, start in enumerate(range(0, numel, step)):
            stop = min(numel, start + step)
            yield slice(start, stop), self._signs(index, stop - start, like)

    def _signs(self, index: int, cols: int, like: Tensor | None) -> Tensor:
        """Columns ``[k, cols]`` of a dense block: ``±1/sqrt(k)`` from ``int8`` bits drawn on the CPU,
        then made in the wanted dtype on the wanted device (exact there: ``2c - c = c``)."""
        dtype, device = (torch.float64, torch.device("cpu")) if like is None else (like.dtype, like.device)
        key = ("dense", index, dtype, device)
        found = self._cast.get(key)
        if found is None:
            generator = _generator(self.spec.seed, *self._key("dense"), index)
            bits = torch.randint(0, 2, (self.spec.dim, cols), generator=generator, dtype=torch.int8)
            scale = 1 / math.sqrt(self.spec.dim)
            found = bits.to(device).to(dtype).mul_(2 * scale).sub_(scale)
            if found.numel() <= CACHED or self.budget.take(found):
                self._cast[key] = found
        return found

    def apply(self, g: Tensor, total: Tensor | None = None, alpha: float = 1.0) -> Tensor:
        """``alpha P_p vec(g_i)`` for built per-sample gradients ``g`` ``[B, *shape]`` -> ``[B, k]``, added
        into ``total`` (and returned) when given."""
        n = g.shape[0]
        if self.kron:
            row, col = self.factors(g)
            found = (row @ g.reshape(n, self.shape[0], -1) @ col.T).reshape(n, -1)
            if total is None:
                return found if alpha == 1 else found.mul_(alpha)
            return total.add_(found, alpha=alpha)
        flat = g.reshape(n, -1)
        out = flat.new_zeros((n, self.spec.dim)) if total is None else total
        if self.sketch:  # the signed copy of g_i made CHUNK entries at a time, not whole
            where, signs = self.sketched(flat)
            if alpha != 1:  # (index_add_'s own alpha costs a second pass over the signed copy)
                signs = signs * alpha
            step = max(1, CHUNK // max(1, n))
            for start in range(0, flat.shape[1], step):
                cols = slice(start, start + step)
                out.index_add_(1, where[cols], flat[:, cols] * signs[cols])
            return out
        for cols, block in self.dense_blocks(flat):
            out.addmm_(flat[:, cols], block.T, alpha=alpha)
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
        return torch.cat([block for _, block in self.dense_blocks()], dim=1)
