"""A feature store on disk: one ``[n, k]`` row of features per training sample, per checkpoint.

Layout of a store directory (everything is a standard ``.npy`` file or JSON, readable without pergrad)::

    spec.json                 what the features are: model, targets, k, kind, the projection seed of each
                              checkpoint, output, dtype, n, tokens, checkpoints, world_size (the sharding);
                              written once, checked on reopen
    features.c{c}.r{r}.npy    [rows of rank r, k] features of checkpoint number c written by rank r
                              ([rows, tokens, k] in a per-token store)
    out_to_loss.c{c}.r{r}.npy [rows of rank r] float64: each sample's out-to-loss term (TRAK's Q), in a store
                              opened with out_to_loss=True
    written.c{c}.r{r}.npy     [rows of rank r] bool: which of those rows are written (saved on flush/close)

Projections: each checkpoint's features are projected with a seed of its own, ``seeds[c] = seed + 100_000 *
c`` (TRAK's ensemble needs independent projections per model: traker draws ``seed + 1e5 * model_id``), or
those passed as ``seeds=``. ``store.projection(checkpoint)`` gives the ``register_projection`` arguments of a
checkpoint, and :meth:`FeatureStore.write_from` writes a wrapper's features after checking that it projects
with them: a store never mixes features of several projections in one checkpoint, nor (``projection``, the
version of ``pergrad.attribution.projectors``) features of another pergrad's projection.

Why ``numpy.lib.format.open_memmap``: a ``.npy`` file is a 128-byte header and the raw array, so it is
memory-mapped without copies, read one slice at a time (the store never loads a whole file), written in
place by sample index (which makes writes resumable), and opened by anything that reads numpy
(``numpy.load(..., mmap_mode="r")``) without pergrad. A chunked array store (zarr, HDF5) would add a
dependency and compression nobody needs for dense float features.

Sharding: with ``world_size = w``, rank ``r`` owns the samples ``i`` with ``i % w == r`` (the order
``DistributedSampler(shuffle=False)`` hands them out) and stores sample ``i`` at row ``i // w`` of its own
file; it never writes another rank's file. Readers see the union, rows by global sample index.

Resuming: ``written`` is saved (after the features are flushed, by an atomic rename) on ``flush()`` and
``close()``; rows written after the last flush count as missing after a crash and are written again.
Reading a row that is not written and flushed raises :class:`MissingFeaturesError`, never zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from pergrad.attribution.projectors import VERSION as PROJECTION_VERSION

from .errors import MissingFeaturesError, StoreIndexError, StoreSpecError

SPEC_FILE = "spec.json"
# 2: a projection seed per checkpoint (seeds), output, out_to_loss, tokens, float16
FORMAT_VERSION = 2
DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
SEED_STRIDE = 100_000  # seeds[c] = seed + SEED_STRIDE * c


def checkpoint_seeds(seed: int, count: int) -> tuple[int, ...]:
    """The projection seed of each of ``count`` checkpoints: ``seed + 100_000 * c`` (independent projections,
    as TRAK's ensemble needs; traker's ``seed + 1e5 * model_id``)."""
    return tuple(seed + SEED_STRIDE * c for c in range(count))


def numpy() -> Any:
    """The numpy module, or an ImportError naming the extra that installs it."""
    try:
        import numpy as np
    except ImportError as err:
        raise ImportError(
            "pergrad.attribution stores features with numpy: install it with pip install 'pergrad[attribution]' "
            "(in a clone of pergrad: pip install -e '.[attribution]')"
        ) from err
    return np


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """What the features of a store are. Two stores with equal specs hold comparable features."""

    n: int
    k: int
    dtype: str = "float32"
    checkpoints: tuple[str, ...] = ("final",)
    world_size: int = 1
    model: str = ""
    targets: tuple[str, ...] = ()
    seed: int | None = None  # the seed the checkpoints' seeds were derived from (None: given as seeds)
    seeds: tuple[int, ...] = ()  # the projection seed of each checkpoint (empty: features from elsewhere)
    kind: str = ""
    output: str = ""  # what the features are gradients of: "loss", "margin", "lm-margin", ... ("": not said)
    out_to_loss: bool = False  # each row has an out-to-loss term (TRAK's Q)
    tokens: int = 0  # features per token, [n, tokens, k] (0: one row [k] per sample)
    projection: int = 0  # pergrad.attribution.projectors.VERSION of the features, where kind says they are pergrad's
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for field in ("checkpoints", "targets", "seeds"):
            out[field] = list(getattr(self, field))
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoreSpec:
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls)}
        if data.get("format_version") != FORMAT_VERSION:  # read only as far as the version check
            data = {name: value for name, value in data.items() if name in names and name != "seeds"}
        for field in ("checkpoints", "targets", "seeds"):
            if field in data:
                data[field] = tuple(data[field])
        return cls(**data)

    def rows(self, rank: int) -> int:
        """How many samples rank ``rank`` owns: those with ``i % world_size == rank``."""
        return max(0, (self.n - rank + self.world_size - 1) // self.world_size)


def _check_spec(path: Path, spec: StoreSpec) -> None:
    where = f"feature store {str(path)!r}"
    if spec.n < 1 or spec.k < 1:
        raise StoreSpecError(f"{where}: n={spec.n} and k={spec.k} must be positive (n samples, k features each).")
    if spec.dtype not in DTYPES:
        raise StoreSpecError(
            f"{where}: dtype {spec.dtype!r} is not stored; pass dtype=torch.float16, torch.float32 or torch.float64 (numpy has no bfloat16)."
        )
    if not spec.checkpoints or len(set(spec.checkpoints)) != len(spec.checkpoints):
        raise StoreSpecError(
            f"{where}: checkpoints {list(spec.checkpoints)} must be distinct names, at least one; "
            "pass e.g. checkpoints=['epoch1', 'epoch2']."
        )
    if spec.world_size < 1:
        raise StoreSpecError(f"{where}: world_size={spec.world_size} must be at least 1.")
    if spec.seeds and len(spec.seeds) != len(spec.checkpoints):
        raise StoreSpecError(
            f"{where}: seeds {list(spec.seeds)} for checkpoints {list(spec.checkpoints)}: give one projection seed "
            "per checkpoint, or seed= alone (checkpoint c then projects with seed + 100_000 * c)."
        )
    if spec.tokens < 0:
        raise StoreSpecError(f"{where}: tokens={spec.tokens} must be >= 0 (0: one row of k features per sample).")


class FeatureStore:
    """Features ``[n, k]`` per checkpoint, on disk, written by sample index, read in chunks.

    Open one with :meth:`FeatureStore.open`; use it as a context manager (or call :meth:`close`) so that
    what was written is flushed.
    """

    def __init__(self, path: Path, spec: StoreSpec, rank: int, readonly: bool) -> None:
        self.path = path
        self.spec = spec
        self.rank = rank
        self.readonly = readonly
        self._own: dict[int, Any] = {}  # checkpoint number -> this rank's features memmap
        self._written: dict[int, Tensor] = {}  # checkpoint number -> this rank's written rows, bool
        self._q: dict[int, Any] = {}  # checkpoint number -> this rank's out-to-loss terms memmap
        self._closed = False
        if not readonly:
            np = numpy()
            rows = spec.rows(rank)
            shape = (rows, *self._row_shape())
            for c in range(len(spec.checkpoints)):
                features, written = self._files(c, rank)
                if features.exists():
                    mapped = np.lib.format.open_memmap(features, mode="r+")
                    if mapped.shape != shape or str(mapped.dtype) != spec.dtype:
                        raise StoreSpecError(
                            f"feature store {str(path)!r}: {features.name} holds {mapped.dtype} {list(mapped.shape)}, "
                            f"the spec says {spec.dtype} {list(shape)}: the directory was changed by hand; "
                            "delete it and write the features again."
                        )
                    done = (
                        torch.from_numpy(np.load(written)) if written.exists() else torch.zeros(rows, dtype=torch.bool)
                    )
                else:
                    mapped = np.lib.format.open_memmap(features, mode="w+", dtype=spec.dtype, shape=shape)
                    done = torch.zeros(rows, dtype=torch.bool)
                self._own[c] = mapped
                self._written[c] = done.clone()
                if spec.out_to_loss:
                    q = self._q_file(c, rank)
                    mode = "r+" if q.exists() else "w+"
                    self._q[c] = np.lib.format.open_memmap(q, mode=mode, dtype="float64", shape=(rows,))

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        n: int | None = None,
        k: int | None = None,
        dtype: torch.dtype | str | None = None,
        checkpoints: Sequence[str] | None = None,
        model: str | None = None,
        targets: Sequence[str] | None = None,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        kind: str | None = None,
        output: str | None = None,
        out_to_loss: bool | None = None,
        tokens: int | None = None,
        rank: int = 0,
        world_size: int | None = None,
        readonly: bool = False,
    ) -> FeatureStore:
        """Open the store in directory ``path``, creating it if it has no ``spec.json`` yet.

        Creating needs ``n`` (samples) and ``k`` (features per sample); the other fields default to
        ``dtype=float32`` (``float16`` halves the disk, as traker stores; scores compute in float32 at
        least), ``checkpoints=("final",)``, ``world_size=1``. ``kind`` (``"kron"``, ``"dense"``,
        ``"sjlt"``) says the features are pergrad's projections: each checkpoint ``c`` then projects with
        its own seed, ``seed + 100_000 * c`` (``seed`` defaults to 0), or ``seeds[c]`` (one per
        checkpoint); :meth:`projection` gives them to ``register_projection``. ``output`` names what the
        features are gradients of (``"loss"``, TRAK's ``"margin"`` or ``"lm-margin"``); ``out_to_loss=True``
        keeps one more number per row and checkpoint, TRAK's ``Q`` (``write(..., out_to_loss=)``;
        ``preconditioner="trak"`` reads it). ``tokens=T`` stores ``[T, k]`` features per sample (per-token
        projections, ``register_projection(per_token=True)``): the per-sample features are their sum over
        tokens, and :func:`~pergrad.attribution.token_scores` reads them per token.

        Reopening checks every field passed against ``spec.json`` and raises :class:`StoreSpecError` naming
        the first that differs; fields left ``None`` are taken from disk. ``rank`` selects the shard this
        object writes (``0 <= rank < world_size``); ``readonly=True`` opens an existing store for reading only.
        """
        root = Path(path)
        if seed is not None and seeds is not None:
            raise StoreSpecError(
                f"feature store {str(root)!r}: pass seed= (checkpoint c projects with seed + 100_000 * c) or seeds= "
                "(one per checkpoint), not both."
            )
        given: dict[str, Any] = {
            "n": n,
            "k": k,
            "dtype": _dtype_name(dtype) if dtype is not None else None,
            "checkpoints": tuple(str(c) for c in checkpoints) if checkpoints is not None else None,
            "world_size": world_size,
            "model": model,
            "targets": tuple(targets) if targets is not None else None,
            "seed": seed,
            "seeds": tuple(int(s) for s in seeds) if seeds is not None else None,
            "kind": kind,
            "output": output,
            "out_to_loss": out_to_loss,
            "tokens": tokens,
        }
        spec_path = root / SPEC_FILE
        if spec_path.exists():
            spec = _read_spec(root, spec_path)
            _compare(root, spec, given)
        elif readonly:
            raise StoreSpecError(
                f"feature store {str(root)!r} has no {SPEC_FILE}: nothing was written there; check the path, or "
                "open it with readonly=False and n=, k= to create it."
            )
        else:
            if n is None or k is None:
                raise StoreSpecError(
                    f"feature store {str(root)!r} does not exist yet: creating it needs n= (samples) and k= "
                    "(features per sample)."
                )
            fields = {name: value for name, value in given.items() if value is not None}
            names = fields.get("checkpoints", StoreSpec.checkpoints)
            if seeds is None and (seed is not None or kind):
                fields["seed"] = 0 if seed is None else seed
                fields["seeds"] = checkpoint_seeds(fields["seed"], len(names))
            spec = StoreSpec(**fields, projection=PROJECTION_VERSION if kind else 0)
            _check_spec(root, spec)
            root.mkdir(parents=True, exist_ok=True)
            if not _create_once(spec_path, json.dumps(spec.to_json(), indent=2) + "\n"):
                # another rank created it first: it must agree with ours
                spec = _read_spec(root, spec_path)
                _compare(root, spec, given)
        if spec.kind and spec.projection != PROJECTION_VERSION:
            raise StoreSpecError(
                f"feature store {str(root)!r} holds kind={spec.kind!r} features of pergrad's projection version "
                f"{spec.projection}; this pergrad draws version {PROJECTION_VERSION} (pergrad.attribution.projectors.VERSION), "
                "whose features do not match them: write the features again into a new path."
            )
        if not 0 <= rank < spec.world_size:
            raise StoreSpecError(
                f"feature store {str(root)!r}: rank={rank} is not in range for world_size={spec.world_size}; "
                "pass the process's rank (torch.distributed.get_rank())."
            )
        return cls(root, spec, rank, readonly)

    # ------------------------------------------------------------------ what it holds

    @property
    def n(self) -> int:
        """Number of samples (rows, by global sample index)."""
        return self.spec.n

    @property
    def k(self) -> int:
        """Features per sample."""
        return self.spec.k

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype; reads return tensors of this dtype."""
        return DTYPES[self.spec.dtype]

    @property
    def checkpoints(self) -> tuple[str, ...]:
        """Checkpoint names, in the order scores weigh them."""
        return self.spec.checkpoints

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def tokens(self) -> int:
        """Tokens per sample of a per-token store (features ``[n, tokens, k]``); 0 for one row per sample."""
        return self.spec.tokens

    def seed(self, checkpoint: str | int | None = None) -> int:
        """The projection seed of ``checkpoint``'s features (``seeds[c]``)."""
        c = self.checkpoint_index(checkpoint)
        if not self.spec.seeds:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} records no projection seeds (it was opened without kind= or "
                "seed=: features from elsewhere); create it with kind= (and seed= or seeds=) to project into it."
            )
        return self.spec.seeds[c]

    def projection(self, checkpoint: str | int | None = None) -> dict[str, Any]:
        """The ``register_projection`` arguments of ``checkpoint``'s features, ``{"dim": k, "kind": kind,
        "seed": seeds[c]}`` (and ``per_token=True`` in a per-token store)::

            psm.register_projection(model, **store.projection("epoch3"))
        """
        if not self.spec.kind:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} records no kind: its features are not pergrad's projections "
                "(create it with kind='kron', 'dense' or 'sjlt' to project into it)."
            )
        out: dict[str, Any] = {"dim": self.spec.k, "kind": self.spec.kind, "seed": self.seed(checkpoint)}
        if self.spec.tokens:
            out["per_token"] = True
        return out

    def checkpoint_index(self, checkpoint: str | int | None) -> int:
        """The number of a checkpoint given by name or number; ``None`` when the store has only one."""
        names = self.spec.checkpoints
        if checkpoint is None:
            if len(names) == 1:
                return 0
            raise StoreSpecError(
                f"feature store {str(self.path)!r} has checkpoints {list(names)}: pass checkpoint= (a name or number)."
            )
        if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            if 0 <= checkpoint < len(names):
                return checkpoint
        elif checkpoint in names:
            return names.index(checkpoint)
        raise StoreSpecError(
            f"feature store {str(self.path)!r} has no checkpoint {checkpoint!r}; it has {list(names)} "
            "(pass a name or a number below the count)."
        )

    def owns(self, indices: Tensor | Sequence[int]) -> Tensor:
        """Bool mask: which global sample ``indices`` this rank writes (``i % world_size == rank``).
        Use it to drop the samples ``DistributedSampler`` repeats to pad the last batch."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        return idx % self.spec.world_size == self.rank

    # ------------------------------------------------------------------ writing

    def write(
        self,
        indices: Tensor | Sequence[int],
        features: Tensor,
        checkpoint: str | int | None = None,
        *,
        out_to_loss: Tensor | None = None,
    ) -> None:
        """Write ``features[j]`` as the row of sample ``indices[j]`` (global sample indices this rank owns).

        ``features``: ``[len(indices), k]``, or ``[len(indices), T, k]`` in a per-token store (``T`` at most
        the store's ``tokens``; the tokens past ``T`` are zeros: padding). ``out_to_loss``: ``[len(indices)]``,
        each sample's out-to-loss term, in a store opened with ``out_to_loss=True`` (and only there).
        Features are cast to the store's dtype; rewriting a row replaces it. The rows count as written on
        disk after the next :meth:`flush` or :meth:`close`.
        """
        self._check_writable()
        c = self.checkpoint_index(checkpoint)
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        where = f"feature store {str(self.path)!r}"
        tokens = self.spec.tokens
        if tokens:
            fits = features.dim() == 3 and features.shape[0] == idx.numel() and features.shape[2] == self.spec.k
            if not fits or features.shape[1] > tokens:
                raise StoreIndexError(
                    f"{where}: write got features of shape {list(features.shape)} for {idx.numel()} indices; this "
                    f"per-token store takes [len(indices), T, k] = [{idx.numel()}, T <= {tokens}, {self.spec.k}] "
                    "(register_projection(per_token=True); pad or cut the sequences to the store's tokens)."
                )
        elif features.dim() != 2 or features.shape != (idx.numel(), self.spec.k):
            per_token = " (per-token features: open the store with tokens=T)" if features.dim() == 3 else ""
            raise StoreIndexError(
                f"{where}: write got features of shape {list(features.shape)} for {idx.numel()} indices; it takes "
                f"[len(indices), k] = [{idx.numel()}, {self.spec.k}] (one row of k features per sample){per_token}."
            )
        if self.spec.out_to_loss and (out_to_loss is None or out_to_loss.reshape(-1).shape != idx.shape):
            got = "none" if out_to_loss is None else f"shape {list(out_to_loss.shape)}"
            raise StoreIndexError(
                f"{where} keeps each sample's out-to-loss term (out_to_loss=True): write got {got}; pass "
                f"out_to_loss= [len(indices)] = [{idx.numel()}] (e.g. the second value of margin(logits, y))."
            )
        if not self.spec.out_to_loss and out_to_loss is not None:
            raise StoreIndexError(
                f"{where} was opened without out_to_loss=True: it keeps no out-to-loss terms; create it with "
                "out_to_loss=True (TRAK) or leave out_to_loss= out of write."
            )
        self._check_range(idx, "write")
        foreign = idx[~self.owns(idx)]
        if foreign.numel():
            raise StoreIndexError(
                f"{where}: rank {self.rank} of {self.spec.world_size} writes the samples i with "
                f"i % {self.spec.world_size} == {self.rank}, got {foreign[:5].tolist()}"
                f"{' ...' if foreign.numel() > 5 else ''}: iterate with DistributedSampler(shuffle=False), and drop "
                "the samples it repeats to pad the last batch with mask = store.owns(indices)."
            )
        if torch.unique(idx).numel() != idx.numel():
            raise StoreIndexError(f"{where}: write got repeated indices; pass each sample once.")
        local = (idx // self.spec.world_size).numpy()
        values = features.detach().to(device="cpu", dtype=self.dtype).numpy()
        if tokens and features.shape[1] < tokens:
            self._own[c][local, features.shape[1] :] = 0
            self._own[c][local, : features.shape[1]] = values
        else:
            self._own[c][local] = values
        if out_to_loss is not None:
            self._q[c][local] = out_to_loss.detach().reshape(-1).to(device="cpu", dtype=torch.float64).numpy()
        self._written[c][torch.from_numpy(local)] = True

    def write_from(
        self,
        psm: Any,
        indices: Tensor | Sequence[int],
        checkpoint: str | int | None = None,
        *,
        target: str = "",
        out_to_loss: Tensor | None = None,
    ) -> None:
        """Write the features of the last backward of ``psm`` (a ``PerSampleModule``),
        ``psm.per_sample_projections()[target]``, after checking that ``target`` projects as this
        checkpoint's features do (``k``, ``kind`` and the checkpoint's seed: :meth:`projection`)."""
        c = self.checkpoint_index(checkpoint)
        wanted = self.projection(c)
        specs = psm.projection_specs()
        if target not in specs:
            raise StoreSpecError(
                f"feature store {str(self.path)!r}: the wrapper has no projection of target {target!r} (it has "
                f"{sorted(specs)}): register it with psm.register_projection({target or 'model'!r}, "
                f"**store.projection({self.spec.checkpoints[c]!r})), or pass target=."
            )
        spec = specs[target]
        got = {"dim": spec.dim, "kind": spec.kind, "seed": spec.seed}
        for field in ("dim", "kind", "seed"):
            if got[field] != wanted[field]:
                raise StoreSpecError(
                    f"feature store {str(self.path)!r}, checkpoint {self.spec.checkpoints[c]!r}: the projection of "
                    f"{target!r} has {field}={got[field]!r}, this checkpoint's features {field}={wanted[field]!r}: "
                    "features of another projection cannot be mixed into it. Register the target with "
                    f"psm.register_projection(..., **store.projection({self.spec.checkpoints[c]!r}))."
                )
        self.write(indices, psm.per_sample_projections()[target], c, out_to_loss=out_to_loss)

    def flush(self) -> None:
        """Flush the features written so far to disk, then record their rows as written."""
        self._check_writable()
        np = numpy()
        for c, mapped in self._own.items():
            mapped.flush()
            if c in self._q:
                self._q[c].flush()
            _, written = self._files(c, self.rank)
            tmp = written.with_name(written.name + f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, self._written[c].numpy())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, written)

    def close(self) -> None:
        """Flush (when writable) and release this rank's files: the store stays readable (from disk), no
        longer writable. Closing twice does nothing."""
        if self._closed:
            return
        if not self.readonly:
            self.flush()
        self._own.clear()
        self._written.clear()
        self._q.clear()
        self._closed = True

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ reading

    def written(self, checkpoint: str | int | None = None) -> Tensor:
        """Bool ``[n]`` by global sample index: rows written (this rank's rows as written so far, other
        ranks' as last flushed). ``checkpoint=None`` with several checkpoints: written in all of them."""
        numbers = range(len(self.spec.checkpoints)) if checkpoint is None else [self.checkpoint_index(checkpoint)]
        out = torch.ones(self.spec.n, dtype=torch.bool)
        for c in numbers:
            out &= self._written_union(c)
        return out

    def missing(self, checkpoint: str | int | None = None, *, own: bool = False) -> Tensor:
        """Global indices of the samples not written yet (in any checkpoint when ``checkpoint=None``);
        ``own=True``: only those this rank writes (what a restarted rank has left to do)."""
        todo = ~self.written(checkpoint)
        if own:
            todo &= self.owns(torch.arange(self.spec.n))
        return torch.nonzero(todo).reshape(-1)

    def read(
        self, indices: Tensor | Sequence[int], checkpoint: str | int | None = None, *, per_token: bool = False
    ) -> Tensor:
        """Features ``[len(indices), k]`` of the given global sample indices (every one written); in a
        per-token store their sums over tokens, or with ``per_token=True`` ``[len(indices), tokens, k]``."""
        c = self.checkpoint_index(checkpoint)
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        self._check_range(idx, "read")
        self._check_tokens(per_token)
        return self._rows(self._gather(c, idx, self._written_union(c)), per_token)

    def chunks(
        self,
        size: int,
        checkpoint: str | int | None = None,
        indices: Tensor | Sequence[int] | None = None,
        *,
        per_token: bool = False,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield ``(indices [c], features [c, k])`` for ``size`` samples at a time (``c <= size``), in order
        of global index (or of ``indices``, a subset), reading only those rows from disk. In a per-token
        store the features are each sample's sum over tokens, or with ``per_token=True`` ``[c, tokens, k]``."""
        if size < 1:
            raise StoreIndexError(f"feature store {str(self.path)!r}: chunk size {size} must be at least 1.")
        c = self.checkpoint_index(checkpoint)
        self._check_tokens(per_token)
        written = self._written_union(c)
        if indices is None:
            if not bool(written.all()):
                self._raise_missing(torch.nonzero(~written).reshape(-1), c)
            for start in range(0, self.spec.n, size):
                idx = torch.arange(start, min(start + size, self.spec.n))
                yield idx, self._rows(self._gather(c, idx, written), per_token)
        else:
            subset = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
            self._check_range(subset, "read")
            if not bool(written[subset].all()):
                self._raise_missing(subset[~written[subset]], c)
            for start in range(0, subset.numel(), size):
                idx = subset[start : start + size]
                yield idx, self._rows(self._gather(c, idx, written), per_token)

    def out_to_loss(self, checkpoint: str | int | None = None, indices: Tensor | Sequence[int] | None = None) -> Tensor:
        """Each sample's out-to-loss term at ``checkpoint`` (float64 ``[n]``, or ``[len(indices)]``), as
        written with ``write(..., out_to_loss=)`` in a store opened with ``out_to_loss=True``."""
        if not self.spec.out_to_loss:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} keeps no out-to-loss terms: it was created without "
                "out_to_loss=True (TRAK's Q): write the features of the model output (e.g. margin(logits, y)) into "
                "a store created with output='margin', out_to_loss=True."
            )
        c = self.checkpoint_index(checkpoint)
        idx = torch.arange(self.spec.n) if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        self._check_range(idx, "read")
        written = self._written_union(c)
        if not bool(written[idx].all()):
            self._raise_missing(idx[~written[idx]], c)
        np = numpy()
        w = self.spec.world_size
        out = torch.empty(idx.numel(), dtype=torch.float64)
        for r in torch.unique(idx % w).tolist():
            mine = torch.nonzero(idx % w == r).reshape(-1)
            q = self._q[c] if r == self.rank and c in self._q else np.load(self._q_file(c, r), mmap_mode="r")
            out[mine] = torch.from_numpy(np.asarray(q[(idx[mine] // w).numpy()], dtype=np.float64))
        return out

    # ------------------------------------------------------------------ internals

    def _files(self, c: int, rank: int) -> tuple[Path, Path]:
        return self.path / f"features.c{c}.r{rank}.npy", self.path / f"written.c{c}.r{rank}.npy"

    def _q_file(self, c: int, rank: int) -> Path:
        return self.path / f"out_to_loss.c{c}.r{rank}.npy"

    def _row_shape(self) -> tuple[int, ...]:
        return (self.spec.tokens, self.spec.k) if self.spec.tokens else (self.spec.k,)

    def _check_tokens(self, per_token: bool) -> None:
        if per_token and not self.spec.tokens:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} holds one row of features per sample, not per token: create it "
                "with tokens=T and write register_projection(per_token=True) features to read them per token."
            )

    def _rows(self, features: Tensor, per_token: bool) -> Tensor:
        """Rows as read: per-token rows summed over tokens (in float64, then in the store's dtype) unless
        ``per_token``."""
        if not self.spec.tokens or per_token:
            return features
        return features.sum(1, dtype=torch.float64).to(self.dtype)

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} is closed: open it again with FeatureStore.open to write."
            )
        if self.readonly:
            raise StoreSpecError(
                f"feature store {str(self.path)!r} was opened readonly=True: open it with readonly=False to write."
            )

    def _check_range(self, idx: Tensor, what: str) -> None:
        bad = idx[(idx < 0) | (idx >= self.spec.n)]
        if bad.numel():
            raise StoreIndexError(
                f"feature store {str(self.path)!r}: {what} got sample indices {bad[:5].tolist()} outside "
                f"[0, n={self.spec.n}); pass global sample indices (dataset positions)."
            )

    def _written_union(self, c: int) -> Tensor:
        """Written rows of checkpoint ``c`` by global index: own shard from memory, others from disk."""
        np = numpy()
        w = self.spec.world_size
        out = torch.zeros(self.spec.n, dtype=torch.bool)
        for r in range(w):
            if r == self.rank and c in self._written:
                out[r::w] = self._written[c]
                continue
            features, written = self._files(c, r)
            if features.exists() and written.exists():
                out[r::w] = torch.from_numpy(np.load(written))
        return out

    def _shard(self, c: int, r: int) -> Any:
        if r == self.rank and c in self._own:
            return self._own[c]
        features, _ = self._files(c, r)
        return numpy().load(features, mmap_mode="r")

    def _gather(self, c: int, idx: Tensor, written: Tensor) -> Tensor:
        if not bool(written[idx].all()):
            self._raise_missing(idx[~written[idx]], c)
        np = numpy()
        w = self.spec.world_size
        out = torch.empty(idx.numel(), *self._row_shape(), dtype=self.dtype)
        shard_of = idx % w
        for r in torch.unique(shard_of).tolist():
            mine = torch.nonzero(shard_of == r).reshape(-1)
            local = (idx[mine] // w).numpy()
            lo, hi = int(local.min()), int(local.max()) + 1
            shard = self._shard(c, r)
            if hi - lo == local.size and bool((np.diff(local) == 1).all()):
                rows = np.array(shard[lo:hi])  # a contiguous slice: one read
            else:
                rows = np.asarray(shard[local])
            out[mine] = torch.from_numpy(rows)
        return out

    def _raise_missing(self, missing: Tensor, c: int) -> None:
        raise MissingFeaturesError(
            f"feature store {str(self.path)!r}, checkpoint {self.spec.checkpoints[c]!r}: {missing.numel()} of the "
            f"samples asked for are not written (and flushed) yet, e.g. {missing[:5].tolist()}: write them "
            "(store.missing() lists them) and flush or close the writing store, or pass indices= to use a subset.",
            missing.tolist(),
        )


def _dtype_name(dtype: torch.dtype | str) -> str:
    for name, value in DTYPES.items():
        if dtype in (value, name):
            return name
    raise StoreSpecError(
        f"feature store dtype {dtype!r} is not stored; pass dtype=torch.float16, torch.float32 or torch.float64 (numpy has no bfloat16)."
    )


def _read_spec(root: Path, spec_path: Path) -> StoreSpec:
    """The spec on disk, refused when written in another format."""
    spec = StoreSpec.from_json(json.loads(spec_path.read_text()))
    if spec.format_version != FORMAT_VERSION:
        raise StoreSpecError(
            f"feature store {str(root)!r} has format_version {spec.format_version}; this pergrad reads "
            f"{FORMAT_VERSION} (2 records a projection seed per checkpoint: version 1 stores recorded one seed, "
            "whatever each checkpoint was projected with): write the features again with this version."
        )
    return spec


def _compare(root: Path, spec: StoreSpec, given: dict[str, Any]) -> None:
    for field, value in given.items():
        if value is not None and value != getattr(spec, field):
            raise StoreSpecError(
                f"feature store {str(root)!r} was written with {field}={getattr(spec, field)!r}, this call asks for "
                f"{field}={value!r}: open it with {field}={getattr(spec, field)!r} (or leave {field} out) to read or "
                f"resume it, or use a new path to store features with {field}={value!r}."
            )


def _create_once(path: Path, text: str) -> bool:
    """Write ``path`` unless it exists, atomically (ranks may race): True when this call created it."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return True
