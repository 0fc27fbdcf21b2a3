"""Influence scores between test and train features, read from a store in chunks.

With ``phi_c(z)`` the features of sample ``z`` at checkpoint ``c``, ``w_c`` a weight per checkpoint
(TracIn: the learning rate of that checkpoint; default 1) and ``M_c`` a preconditioner::

    score(test_j, train_i) = sum_c w_c * phi_c(test_j)^T M_c phi_c(train_i)
    self_influence(train_i) = sum_c w_c * phi_c(train_i)^T M_c phi_c(train_i)

Preconditioners:

- ``"identity"``: ``M_c = I``: TracIn (over checkpoints), gradient similarity (one checkpoint).
- ``"gram"``: the Gram of the loss gradients (TRAK's preconditioner without its model output and ``Q``:
  ``"trak"``), ``M_c = (Phi_c^T Phi_c + lambda_c I)^{-1}`` with ``Phi_c`` the ``[n, k]`` train
  features of checkpoint ``c``; ``Phi_c^T Phi_c`` is ``[k, k]``, accumulated chunk by chunk in float64;
  ``lambda_c = damping * trace(Phi_c^T Phi_c) / k`` (the damping is relative to the mean eigenvalue, so it
  does not depend on the features' scale; default ``damping=1e-3``). Build it once with :func:`gram` and
  pass it to several calls, or pass ``"gram"`` to build it from the whole store on each call (from every
  train sample, also where ``indices=`` scores a subset: a shard or a candidate set is scored as part of the
  whole training set).

- :class:`KroneckerFactored`: LoGra / EK-FAC-style, block-diagonal over the feature columns of each
  Kronecker-projected weight (one projection target per weight, features concatenated: see
  :func:`feature_columns`), ``M_c = (S_row ⊗ S_col + lambda I)^{-1}`` on each block from the factors the
  backward summed (``psm.projected_factors()``), applied through the factors' eigenbases; the identity
  on the other columns (biases, dense blocks). :func:`ekfac` replaces the eigenvalue products by the
  train features' second moments in that basis (a pass over the store).

Test features are applied the preconditioner once (``q_j = M_c phi_c(test_j)``, ``[m, k]``), then each
chunk of train features gives a ``[m, chunk]`` block of scores: the full ``[m, n]`` matrix is built only by
:func:`scores`; :func:`top_k` and :func:`self_influence` keep ``O(m * (k + chunk))``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from .errors import MissingFeaturesError, ScoreArgumentError

T = TypeVar("T")

DEFAULT_CHUNK = 4096


class FeatureSource(Protocol):
    """What scoring reads from a store (a :class:`~pergrad.attribution.FeatureStore` is one)."""

    @property
    def n(self) -> int: ...

    @property
    def k(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def checkpoints(self) -> tuple[str, ...]: ...

    def chunks(
        self, size: int, checkpoint: str | int | None = None, indices: Tensor | Sequence[int] | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]: ...


class Preconditioner:
    """``M_c``, one symmetric positive (semi)definite ``[k, k]`` matrix per checkpoint, applied to rows."""

    def apply(self, checkpoint: int, features: Tensor) -> Tensor:
        """``features @ M_c`` for ``features`` ``[m, k]`` (``M_c`` is symmetric)."""
        raise NotImplementedError

    def check(self, source: FeatureSource) -> None:
        """Raise :class:`ScoreArgumentError` when this preconditioner does not fit ``source``."""

    def columns(self, indices: Tensor) -> Tensor | None:
        """A factor of each train sample's scores (``[len(indices)]``: TRAK's out-to-loss term), or None (1)."""
        return None


class Identity(Preconditioner):
    """``M_c = I``: TracIn / gradient similarity."""

    def apply(self, checkpoint: int, features: Tensor) -> Tensor:
        return features


class Gram(Preconditioner):
    """``M_c = (Phi_c^T Phi_c + lambda_c I)^{-1}``, kept as the Cholesky factor of ``Phi_c^T Phi_c +
    lambda_c I`` (float64) for each checkpoint. Build it with :func:`gram`."""

    def __init__(self, factors: Sequence[Tensor], damping: Sequence[float]) -> None:
        self.factors = list(factors)
        self.damping = list(damping)  # the absolute lambda_c of each checkpoint

    def apply(self, checkpoint: int, features: Tensor) -> Tensor:
        factor = self.factors[checkpoint]
        solved = torch.cholesky_solve(features.to(torch.float64).T, factor).T
        return solved.to(features.dtype)

    def matrix(self, checkpoint: int = 0) -> Tensor:
        """``M_c`` as a dense ``[k, k]`` float64 matrix."""
        return torch.cholesky_inverse(self.factors[checkpoint])

    def check(self, source: FeatureSource) -> None:
        if len(self.factors) != len(source.checkpoints) or self.factors[0].shape[0] != source.k:
            raise ScoreArgumentError(
                f"the Gram preconditioner was built for {len(self.factors)} checkpoint(s) of k="
                f"{self.factors[0].shape[0]} features, the store has {len(source.checkpoints)} of k={source.k}: "
                "build it from this store with gram(store)."
            )


class TRAK(Gram):
    """TRAK (Park et al. 2023): the Gram preconditioner of the features of the model output (the margin),
    and each train sample's score multiplied by its out-to-loss term averaged over the checkpoints,
    ``Q_i = (1/C) sum_c Q_c(i)``. Build it with :func:`trak`."""

    def __init__(self, factors: Sequence[Tensor], damping: Sequence[float], out_to_loss: Tensor) -> None:
        super().__init__(factors, damping)
        self.out_to_loss = out_to_loss  # [n] float64

    def check(self, source: FeatureSource) -> None:
        super().check(source)
        if self.out_to_loss.numel() != source.n:
            raise ScoreArgumentError(
                f"the TRAK preconditioner was built for {self.out_to_loss.numel()} train samples, the store has "
                f"{source.n}: build it from this store with trak(store)."
            )

    def columns(self, indices: Tensor) -> Tensor:
        return self.out_to_loss[indices]


def trak(store: FeatureSource, damping: float = 1e-3, *, chunk: int = DEFAULT_CHUNK, progress: bool = False) -> TRAK:
    """TRAK's estimator over the whole store: :func:`gram` of every checkpoint (``damping`` relative to the mean
    eigenvalue; traker's default is 0), and the out-to-loss terms the store keeps (``out_to_loss=True``)
    averaged over checkpoints. With the features ``phi_c`` of the model output (:func:`margin`,
    :func:`lm_margin`), ``score(z, i) = Q_i sum_c w_c phi_c(z)^T (Phi_c^T Phi_c + lambda_c I)^{-1} phi_c(i)``
    (traker averages over checkpoints: ``w_c = 1/C``; the default ``w_c = 1`` is ``C`` times that)."""
    reader = getattr(store, "out_to_loss", None)
    if reader is None or not getattr(getattr(store, "spec", None), "out_to_loss", False):
        raise ScoreArgumentError(
            "TRAK needs the out-to-loss term of every train sample: write the features of the model output "
            "(margin(logits, y)) into a FeatureStore created with output='margin', out_to_loss=True, passing "
            "write(..., out_to_loss=q); preconditioner='gram' is the Gram route without it."
        )
    q = torch.stack([reader(c) for c in range(len(store.checkpoints))]).mean(0)
    g = gram(store, damping, chunk=chunk, progress=progress)
    return TRAK(g.factors, g.damping, q)


def gram(
    store: FeatureSource,
    damping: float = 1e-3,
    *,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    progress: bool = False,
) -> Gram:
    """The Gram preconditioner of ``store``, one pass per checkpoint: ``M_c = (Phi_c^T Phi_c + lambda_c
    I)^{-1}``, ``lambda_c = damping * trace(Phi_c^T Phi_c) / k``, ``Phi_c`` every train sample's features.

    ``indices``: the Gram of these rows only, a different matrix (a model trained on that subset); scoring a
    subset of the training set (``scores(..., indices=)``) wants the whole store's, the default."""
    if damping < 0:
        raise ScoreArgumentError(f"gram: damping={damping} must be >= 0 (relative to the mean eigenvalue).")
    factors, lambdas = [], []
    for c, name in enumerate(store.checkpoints):
        total = torch.zeros(store.k, store.k, dtype=torch.float64)
        for _, features in _progress(store.chunks(chunk, c, indices), _count(store, chunk, indices), progress, "gram"):
            x = features.to(torch.float64)
            total += x.T @ x
        lam = damping * float(total.diagonal().sum()) / store.k
        total.diagonal().add_(lam)
        factor, info = torch.linalg.cholesky_ex(total)
        if int(info) != 0:
            raise ScoreArgumentError(
                f"gram: Phi^T Phi + lambda I of checkpoint {name!r} is singular (lambda={lam:g}; the features "
                "span fewer than k directions): pass a positive damping, e.g. gram(store, damping=1e-3)."
            )
        factors.append(factor)
        lambdas.append(lam)
    return Gram(factors, lambdas)


class KroneckerPair(Protocol):
    """Kronecker factors of one block (``psm.projected_factors()``'s values are): ``row`` ``[r_row, r_row]``
    and ``col`` ``[r_col, r_col]``, symmetric positive semidefinite."""

    @property
    def row(self) -> Tensor: ...

    @property
    def col(self) -> Tensor: ...


Blocks = Mapping[range, KroneckerPair | tuple[Tensor, Tensor]]  # columns -> factors


class _Block:
    """One block's eigenbases ``U_row``, ``U_col``, its curvature in that basis ``[r_row, r_col]`` and
    its absolute damping."""

    def __init__(self, columns: range, row: Tensor, col: Tensor) -> None:
        self.start, self.stop = columns.start, columns.stop
        row_values, self.row = torch.linalg.eigh(row)
        col_values, self.col = torch.linalg.eigh(col)
        self.curvature = row_values.clamp(min=0).outer(col_values.clamp(min=0))  # lambda_row ⊗ lambda_col
        self.damping = 0.0

    def rotate(self, x: Tensor) -> Tensor:
        """``U_row^T X U_col`` for each row of ``x`` ``[m, r_row * r_col]`` -> ``[m, r_row, r_col]``."""
        return self.row.T @ x.reshape(x.shape[0], self.row.shape[0], self.col.shape[0]) @ self.col


class KroneckerFactored(Preconditioner):
    """``M_c``: on each block of columns ``[start, stop)`` of a Kronecker-projected weight's features
    (``r_row * r_col`` wide, flattened row-major as ``per_sample_projections()`` gives them),
    ``(S_row ⊗ S_col + lambda I)^{-1}``; the identity on every other column.

    ``blocks``: ``{range(start, stop): factors}`` (a ``Factors`` of ``psm.projected_factors()``, or a
    ``(row, col)`` pair) for a store with one checkpoint, or one such mapping per checkpoint.
    ``damping`` is relative to each block's mean curvature eigenvalue (``trace(S_row) trace(S_col) /
    (r_row r_col)``; for :func:`ekfac`, the mean of its eigenvalues), so it does not depend on the
    features' scale. With ``S_row = U_row diag(l_row) U_row^T`` (and ``S_col`` alike), a block ``X``
    (``[r_row, r_col]``) becomes ``U_row ((U_row^T X U_col) / (l_row l_col^T + lambda)) U_col^T``.
    """

    def __init__(self, blocks: Blocks | Sequence[Blocks], damping: float = 1e-3) -> None:
        if damping < 0:
            raise ScoreArgumentError(
                f"KroneckerFactored: damping={damping} must be >= 0 (relative to the mean eigenvalue)."
            )
        per_checkpoint = [blocks] if isinstance(blocks, Mapping) else list(blocks)
        self.blocks = [_blocks(b) for b in per_checkpoint]
        self.relative_damping = damping
        for c in range(len(self.blocks)):
            self._damp(c)

    def _damp(self, checkpoint: int) -> None:
        for block in self.blocks[checkpoint]:
            mean = float(block.curvature.mean())
            if mean <= 0:
                raise ScoreArgumentError(
                    f"KroneckerFactored: the block of columns {block.start}:{block.stop} (checkpoint {checkpoint}) "
                    "has zero curvature (factors of a weight no backward reached?): leave it out of the blocks "
                    "(its columns then take the identity)."
                )
            block.damping = self.relative_damping * mean

    def apply(self, checkpoint: int, features: Tensor) -> Tensor:
        out = features.to(torch.float64, copy=True)
        for block in self.blocks[checkpoint]:
            x = block.rotate(out[:, block.start : block.stop]) / (block.curvature + block.damping)
            out[:, block.start : block.stop] = (block.row @ x @ block.col.T).flatten(1)
        return out.to(features.dtype)

    def check(self, source: FeatureSource) -> None:
        if len(self.blocks) != len(source.checkpoints):
            raise ScoreArgumentError(
                f"the Kronecker-factored preconditioner has factors for {len(self.blocks)} checkpoint(s), the store "
                f"has {len(source.checkpoints)} ({list(source.checkpoints)}): pass one mapping of blocks per checkpoint."
            )
        stop = max((b.stop for blocks in self.blocks for b in blocks), default=0)
        if stop > source.k:
            raise ScoreArgumentError(
                f"the Kronecker-factored preconditioner has a block up to column {stop}, the store has k={source.k} "
                "features: give the columns of each weight's features in the store's order (feature_columns)."
            )


def _blocks(blocks: Blocks) -> list[_Block]:
    """Each block's eigenbases, checked: columns as wide as the factors, in order, not overlapping."""
    out: list[_Block] = []
    for columns, factors in sorted(blocks.items(), key=lambda item: item[0].start):
        row, col = factors if isinstance(factors, tuple) else (factors.row, factors.col)
        row, col = row.detach().to("cpu", torch.float64), col.detach().to("cpu", torch.float64)
        start, stop = columns.start, columns.stop
        square = row.dim() == col.dim() == 2 and row.shape[0] == row.shape[1] and col.shape[0] == col.shape[1]
        if (
            not isinstance(columns, range)
            or columns.step != 1
            or not square
            or len(columns) != row.shape[0] * col.shape[0]
        ):
            raise ScoreArgumentError(
                f"KroneckerFactored: the block {columns} with factors of shapes {list(row.shape)}, {list(col.shape)}: "
                "give range(start, start + r_row * r_col) -> factors [r_row, r_row], [r_col, r_col] (feature_columns)."
            )
        if out and start < out[-1].stop:
            raise ScoreArgumentError(
                f"KroneckerFactored: the blocks {out[-1].start}:{out[-1].stop} and {start}:{stop} overlap: give each "
                "weight's columns once."
            )
        out.append(_Block(columns, row, col))
    return out


def feature_columns(features: Mapping[str, Tensor | int]) -> dict[str, range]:
    """The columns of each target's features in their concatenation ``torch.cat(list(features.values()), 1)``
    (``features``: ``psm.per_sample_projections()``, or each target's dim), for :class:`KroneckerFactored`::

        columns = feature_columns(psm.per_sample_projections())
        blocks = {columns[name]: f for name, f in psm.projected_factors().items()}
    """
    out, start = {}, 0
    for name, value in features.items():
        width = value if isinstance(value, int) else value.shape[-1]
        out[name] = range(start, start + width)
        start += width
    return out


def ekfac(
    store: FeatureSource,
    blocks: Blocks | Sequence[Blocks],
    damping: float = 1e-3,
    *,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    progress: bool = False,
) -> KroneckerFactored:
    """EK-FAC: :class:`KroneckerFactored` with each block's eigenvalue products ``l_row l_col^T``
    replaced by the mean square of the store's train features (its rows ``indices`` if given) in the
    factors' eigenbasis, ``(1/n) sum_i (U_row^T X_i U_col)^2``, one pass per checkpoint."""
    m = KroneckerFactored(blocks, damping)
    m.check(store)
    for c in range(len(store.checkpoints)):
        sums = [torch.zeros_like(b.curvature) for b in m.blocks[c]]
        count = 0
        for _, features in _progress(store.chunks(chunk, c, indices), _count(store, chunk, indices), progress, "ekfac"):
            x = features.to(torch.float64)
            count += x.shape[0]
            for total, block in zip(sums, m.blocks[c]):
                total += block.rotate(x[:, block.start : block.stop]).square().sum(0)
        for total, block in zip(sums, m.blocks[c]):
            block.curvature = total / max(count, 1)
        m._damp(c)
    return m


def iter_scores(
    test_features: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    store: FeatureSource,
    *,
    preconditioner: str | Preconditioner = "identity",
    weights: Sequence[float] | Mapping[str, float] | None = None,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    progress: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(train indices [c], scores [m, c])`` chunk by chunk, ``c <= chunk``, summed over checkpoints.

    ``test_features``: ``[m, k]`` (a store with one checkpoint), ``[C, m, k]``, or one ``[m, k]`` per
    checkpoint (a sequence in the store's order, or a mapping by checkpoint name). ``weights``: one per
    checkpoint (default 1). ``indices``: score against these train samples only (``"gram"`` is still built
    from every train sample: the scores are the columns ``indices`` of the whole store's).
    """
    queries = _queries(test_features, store)
    w = _weights(weights, store)
    m = _resolve(preconditioner, store, chunk, indices, progress)
    yield from _score_blocks(queries, store, m, w, chunk, indices, progress)


def _score_blocks(
    queries: list[Tensor],
    store: FeatureSource,
    m: Preconditioner,
    w: list[float],
    chunk: int,
    indices: Tensor | Sequence[int] | None,
    progress: bool,
    per_token: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """:func:`iter_scores`' blocks ``(train indices [c], scores [m, c])`` from checked queries and a resolved
    preconditioner; ``per_token``: ``[m, c, tokens]``, each train sample's tokens apart (:func:`token_scores`)."""
    dtype = _compute_dtype(queries[0].dtype, store.dtype)
    # w_c M_c phi_c(test): applied once, on the test side
    q = [m.apply(c, queries[c].to(dtype)) * w[c] for c in range(len(queries))]
    reader: Any = store  # per_token=True: a per-token FeatureStore's chunks
    streams = [
        reader.chunks(chunk, c, indices, per_token=True) if per_token else store.chunks(chunk, c, indices)
        for c in range(len(queries))
    ]
    desc = "token scores" if per_token else "scores"
    for parts in _progress(zip(*streams), _count(store, chunk, indices), progress, desc):
        idx = parts[0][0]
        block = _block(q[0], parts[0][1].to(dtype), per_token)
        for c in range(1, len(parts)):
            block += _block(q[c], parts[c][1].to(dtype), per_token)
        columns = m.columns(idx)
        if columns is not None:
            block = block * columns.to(dtype).reshape(-1, *(1,) * (block.dim() - 2))
        yield idx, block


def _block(q: Tensor, features: Tensor, per_token: bool) -> Tensor:
    """``q [m, k]`` against a chunk of train features: ``[c, k]`` -> ``[m, c]``, ``[c, tokens, k]`` -> ``[m, c,
    tokens]``."""
    return torch.einsum("mk,ntk->mnt", q, features) if per_token else q @ features.T


def _batches(
    queries: list[Tensor],
    store: FeatureSource,
    m: Preconditioner,
    weights: Sequence[float] | Mapping[str, float] | None,
    chunk: int,
    indices: Tensor | Sequence[int] | None,
    batch_size: int | None,
    progress: bool,
    per_token: bool = False,
) -> Iterator[tuple[slice, Iterator[tuple[Tensor, Tensor]]]]:
    """The queries ``batch_size`` at a time (all at once when None): each batch's rows and its score blocks
    (:func:`_score_blocks`, one pass over the store per batch, the preconditioner ``m`` resolved once)."""
    w = _weights(weights, store)
    for rows in _query_batches(queries[0].shape[0], batch_size):
        yield rows, _score_blocks([q[rows] for q in queries], store, m, w, chunk, indices, progress, per_token)


def _assemble(batches: Iterator[tuple[slice, Iterator[tuple[Tensor, Tensor]]]], m: int, count: int) -> Tensor:
    """The ``[m, count, ...]`` scores from each batch's blocks (the result is the only ``[m, count]`` held)."""
    out: Tensor | None = None
    for rows, blocks in batches:
        column = 0
        for _, block in blocks:
            if out is None:
                out = block.new_empty((m, count, *block.shape[2:]))
            out[rows, column : column + block.shape[1]] = block
            column += block.shape[1]
    assert out is not None
    return out


def scores(
    test_features: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    store: FeatureSource,
    *,
    preconditioner: str | Preconditioner = "identity",
    weights: Sequence[float] | Mapping[str, float] | None = None,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> Tensor:
    """The ``[m, n]`` scores (``[m, len(indices)]`` with ``indices``), computed chunk by chunk; only the
    result is ``[m, n]``: use :func:`top_k` when it does not fit in memory. ``batch_size``: score the queries
    this many at a time (each batch one pass over the store; the preconditioner built once), so that what is
    held besides the result is ``O(batch_size * (k + chunk))``; the same numbers as one batch."""
    queries = _queries(test_features, store)
    m = _resolve(preconditioner, store, chunk, indices, progress)
    batches = _batches(queries, store, m, weights, chunk, indices, batch_size, progress)
    return _assemble(batches, queries[0].shape[0], store.n if indices is None else len(indices))


def _query_batches(m: int, batch_size: int | None) -> list[slice]:
    """The rows of each batch of ``m`` queries (one batch when ``batch_size`` is None)."""
    if batch_size is None:
        return [slice(0, m)]
    if batch_size < 1:
        raise ScoreArgumentError(f"batch_size={batch_size}: pass a positive number of queries per batch, or None.")
    return [slice(start, min(m, start + batch_size)) for start in range(0, max(m, 1), batch_size)]


def top_k(
    test_features: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    store: FeatureSource,
    k: int,
    *,
    largest: bool = True,
    preconditioner: str | Preconditioner = "identity",
    weights: Sequence[float] | Mapping[str, float] | None = None,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> tuple[Tensor, Tensor]:
    """The ``k`` highest (``largest=False``: lowest) scores of each test sample and their train sample
    indices, ``([m, k], [m, k])``, sorted, merged chunk by chunk (never the ``[m, n]`` matrix).
    ``batch_size``: the queries this many at a time (each batch one pass over the store; the preconditioner
    built once): ``O(batch_size * (k + chunk))`` held besides the result, the same result as one batch.

    Ties are broken toward the smaller train index, so the result does not depend on the chunk size
    (``torch.topk`` leaves the order of ties unspecified: its values agree, its indices may not).
    """
    count = store.n if indices is None else len(indices)
    if not 1 <= k <= count:
        raise ScoreArgumentError(f"top_k: k={k} must be between 1 and the number of train samples scored ({count}).")
    queries = _queries(test_features, store)
    m = _resolve(preconditioner, store, chunk, indices, progress)
    found = []
    for _, blocks in _batches(queries, store, m, weights, chunk, indices, batch_size, progress):
        best_values: Tensor | None = None
        best_indices: Tensor | None = None
        for idx, block in blocks:
            values, where = _block_top(block, idx.expand(block.shape[0], -1), k, largest)
            if best_values is not None and best_indices is not None:
                values, where = torch.cat([best_values, values], 1), torch.cat([best_indices, where], 1)
            best_values, best_indices = _ordered_top(values, where, k, largest)
        assert best_values is not None and best_indices is not None
        found.append((best_values, best_indices))
    return torch.cat([v for v, _ in found]), torch.cat([i for _, i in found])


def _ordered_top(values: Tensor, where: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    """The ``k`` best of each row, sorted, ties toward the smaller index: a stable sort by index, then a
    stable sort by value."""
    by_index = torch.argsort(where, dim=1, stable=True)
    values, where = values.gather(1, by_index), where.gather(1, by_index)
    by_value = torch.argsort(values, dim=1, descending=largest, stable=True)[:, :k]
    return values.gather(1, by_value), where.gather(1, by_value)


def _block_top(block: Tensor, where: Tensor, k: int, largest: bool) -> tuple[Tensor, Tensor]:
    """The ``k`` best entries of each row of a score block (unsorted), with ``_ordered_top``'s ties: a
    ``torch.topk`` (no sort of the block), except in rows where it may have cut a tie at its k-th value
    (that value occurs in the row more often than among those kept): those rows are sorted."""
    if k >= block.shape[1]:
        return block, where
    values, pos = torch.topk(block, k, dim=1, largest=largest, sorted=False)
    chosen = where.gather(1, pos)
    edge = values.min(1, keepdim=True).values if largest else values.max(1, keepdim=True).values
    cut = (block == edge).sum(1) > (values == edge).sum(1)
    if bool(cut.any()):
        rows = cut.nonzero().squeeze(1)
        values[rows], chosen[rows] = _ordered_top(block[rows], where[rows], k, largest)
    return values, chosen


def self_influence(
    store: FeatureSource,
    preconditioner: str | Preconditioner = "identity",
    *,
    weights: Sequence[float] | Mapping[str, float] | None = None,
    chunk: int = DEFAULT_CHUNK,
    indices: Tensor | Sequence[int] | None = None,
    progress: bool = False,
) -> Tensor:
    """``[n]`` (``[len(indices)]``): ``sum_c w_c phi_c(i)^T M_c phi_c(i)`` for each train sample ``i``, the
    diagonal of the train x train scores, chunk by chunk: high values flag outliers and mislabelled samples."""
    w = _weights(weights, store)
    m = _resolve(preconditioner, store, chunk, indices, progress)
    out = []
    streams = [store.chunks(chunk, c, indices) for c in range(len(store.checkpoints))]
    for parts in _progress(zip(*streams), _count(store, chunk, indices), progress, "self-influence"):
        dtype = _compute_dtype(parts[0][1].dtype)
        total = torch.zeros(parts[0][1].shape[0], dtype=dtype)
        for c, (_, features) in enumerate(parts):
            x = features.to(dtype)
            total += w[c] * (m.apply(c, x) * x).sum(1)
        columns = m.columns(parts[0][0])
        out.append(total if columns is None else total * columns.to(dtype))
    return torch.cat(out)


def token_scores(
    test_features: Tensor | Sequence[Tensor] | Mapping[str, Tensor],
    store: Any,
    *,
    preconditioner: str | Preconditioner = "identity",
    weights: Sequence[float] | Mapping[str, float] | None = None,
    chunk: int = 256,
    indices: Tensor | Sequence[int] | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> Tensor:
    """Per-token scores ``[m, n, tokens]`` (``[m, len(indices), tokens]``) of a per-token store (``tokens=T``,
    features of ``register_projection(per_token=True)``): ``sum_c w_c phi_c(test_j)^T M_c phi_c(i, t)``, the
    share of train sample ``i``'s score that its token ``t``'s term of the gradient carries (they sum over
    ``t`` to :func:`scores`; kronfluence's per-token scores). The preconditioner is built from the per-sample
    features (their sums over tokens) of the whole store, as for :func:`scores`. ``batch_size``: score the
    queries this many at a time (each batch one pass over the store; the preconditioner built once), so that
    what is held besides the result is ``O(batch_size * (k + chunk * tokens))``; the same numbers as one
    batch."""
    if not getattr(store, "tokens", 0):
        raise ScoreArgumentError(
            "token_scores needs a per-token store: create it with FeatureStore.open(..., tokens=T) and write the "
            "[B, T, k] features of register_projection(..., per_token=True)."
        )
    queries = _queries(test_features, store)
    m = _resolve(preconditioner, store, DEFAULT_CHUNK, indices, progress)
    batches = _batches(queries, store, m, weights, chunk, indices, batch_size, progress, per_token=True)
    return _assemble(batches, queries[0].shape[0], store.n if indices is None else len(indices))


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype scores are computed in: the widest of ``dtypes``, float32 at least (float16 features are
    stored, not multiplied, in float16)."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def _resolve(
    preconditioner: str | Preconditioner,
    store: FeatureSource,
    chunk: int,
    indices: Tensor | Sequence[int] | None,
    progress: bool,
) -> Preconditioner:
    if isinstance(preconditioner, Preconditioner):
        preconditioner.check(store)
        return preconditioner
    if preconditioner == "identity":
        return Identity()
    if preconditioner == "trak":
        try:
            return trak(store, chunk=chunk, progress=progress)
        except MissingFeaturesError as err:
            raise MissingFeaturesError(
                f"preconditioner='trak' is built from the whole store (every train sample), also where indices= "
                f"scores a subset, and {len(err.missing) or 'some'} of the store's samples are not written (and "
                "flushed) yet: write them first (store.missing() lists them).",
                err.missing,
            ) from err
    if preconditioner == "gram":
        # the Gram of the whole training set, whatever subset is scored: a subset's Gram preconditions
        # with another matrix (its scores are off by the ratio of the two, and its rankings differ)
        try:
            return gram(store, chunk=chunk, progress=progress)
        except MissingFeaturesError as err:
            shown = f", e.g. {err.missing[:5]}" if err.missing else ""
            raise MissingFeaturesError(
                "preconditioner='gram' is the Gram matrix of the whole store (every train sample), also where "
                f"indices= scores a subset, and {len(err.missing) or 'some'} of the store's samples are not written "
                f"(and flushed) yet{shown}: write them first (store.missing() lists them), or, to precondition with "
                "the Gram of the rows written only (another matrix), pass preconditioner=gram(store, indices=...).",
                err.missing,
            ) from err
    raise ScoreArgumentError(
        f"preconditioner={preconditioner!r} is not known: pass 'identity', 'gram', 'trak', or a Preconditioner "
        "(e.g. gram(store, damping=...))."
    )


def _queries(test_features: Tensor | Sequence[Tensor] | Mapping[str, Tensor], store: FeatureSource) -> list[Tensor]:
    names = store.checkpoints
    if isinstance(test_features, Mapping):
        if set(test_features) != set(names):
            raise ScoreArgumentError(
                f"test features are given for checkpoints {sorted(test_features)}, the store has {list(names)}: "
                "pass one [m, k] tensor for each of the store's checkpoints."
            )
        queries = [test_features[name] for name in names]
    elif isinstance(test_features, Tensor) and test_features.dim() == 2:
        queries = [test_features]
    elif isinstance(test_features, Tensor) and test_features.dim() == 3:
        queries = list(test_features.unbind(0))
    elif isinstance(test_features, Tensor):
        queries = []
    else:
        queries = list(test_features)
    if len(queries) != len(names):
        raise ScoreArgumentError(
            f"test features for {len(queries)} checkpoint(s), the store has {len(names)} ({list(names)}): pass "
            "[m, k] for one checkpoint, [C, m, k] or one [m, k] per checkpoint."
        )
    shape = queries[0].shape
    for q in queries:
        if q.dim() != 2 or q.shape[1] != store.k or q.shape != shape:
            raise ScoreArgumentError(
                f"test features of shape {list(q.shape)}: each checkpoint's must be [m, k] with k={store.k} "
                "(the store's) and the same m: compute them with the same projection (seed, k) as the store's."
            )
        if q.is_floating_point() is False:
            raise ScoreArgumentError(f"test features have dtype {q.dtype}: pass floating-point features.")
    return [q.detach().cpu() for q in queries]


def _weights(weights: Sequence[float] | Mapping[str, float] | None, store: FeatureSource) -> list[float]:
    names = store.checkpoints
    if weights is None:
        return [1.0] * len(names)
    if isinstance(weights, Mapping):
        if set(weights) != set(names):
            raise ScoreArgumentError(
                f"weights are given for checkpoints {sorted(weights)}, the store has {list(names)}: give one each."
            )
        return [float(weights[name]) for name in names]
    out = [float(x) for x in weights]
    if len(out) != len(names):
        raise ScoreArgumentError(
            f"{len(out)} weights for the store's {len(names)} checkpoints {list(names)}: give one per checkpoint."
        )
    return out


def _count(store: FeatureSource, chunk: int, indices: Tensor | Sequence[int] | None) -> int:
    return math.ceil((store.n if indices is None else len(indices)) / chunk)


def _progress(items: Iterable[T], total: int, enabled: bool, desc: str) -> Iterable[T]:
    """``items`` with a tqdm progress bar when ``enabled`` and tqdm is installed (a warning otherwise)."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warnings.warn(
            "progress=True needs tqdm: install it with pip install 'pergrad[attribution]' (in a clone of pergrad: "
            "pip install -e '.[attribution]'); scoring goes on without a progress bar.",
            stacklevel=3,
        )
        return items
    bar: Any = tqdm(items, total=total, desc=desc, unit="chunk")
    return bar
