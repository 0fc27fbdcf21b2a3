"""A feature store on disk: one ``[n, k]`` row of features per training sample, per checkpoint.

Layout of a store directory (everything is a standard ``.npy`` file or JSON, readable without pergrad)::

    spec.json                 what the features are: model, targets, k, seed, kind, dtype, n,
                              checkpoints, world_size (the sharding); written once, checked on reopen
    features.c{c}.r{r}.npy    [rows of rank r, k] features of checkpoint number c written by rank r
    written.c{c}.r{r}.npy     [rows of rank r] bool: which of those rows are written (saved on flush/close)

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

from ..projectors import VERSION as PROJECTION_VERSION
from .errors import MissingFeaturesError, StoreIndexError, StoreSpecError

SPEC_FILE = "spec.json"
FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "float64": torch.float64}


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
    seed: int | None = None
    kind: str = ""
    projection: int = 0  # pergrad.projectors.VERSION of the features, where kind says they are pergrad's
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["checkpoints"] = list(self.checkpoints)
        out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoreSpec:
        data = dict(data)
        data["checkpoints"] = tuple(data["checkpoints"])
        data["targets"] = tuple(data["targets"])
        return cls(**data)

    def rows(self, rank: int) -> int:
        """How many samples rank ``rank`` owns: those with ``i % world_size == rank``."""
        return max(0, (self.n - rank + self.world_size - 1) // self.world_size)


def _check_spec(path: Path, spec: StoreSpec) -> None:
    where = f"feature store {str(path)!r}"
    if spec.n < 1 or spec.k < 1:
        raise StoreSpecError(f"{where}: n={spec.n} and k={spec.k} must be positive (n samples, k features each).")
    if spec.dtype not in DTYPES:
        raise StoreSpecError(f"{where}: dtype {spec.dtype!r} is not stored; pass dtype=torch.float32 or torch.float64.")
    if not spec.checkpoints or len(set(spec.checkpoints)) != len(spec.checkpoints):
        raise StoreSpecError(
            f"{where}: checkpoints {list(spec.checkpoints)} must be distinct names, at least one; "
            "pass e.g. checkpoints=['epoch1', 'epoch2']."
        )
    if spec.world_size < 1:
        raise StoreSpecError(f"{where}: world_size={spec.world_size} must be at least 1.")


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
        self._closed = False
        if not readonly:
            np = numpy()
            rows = spec.rows(rank)
            for c in range(len(spec.checkpoints)):
                features, written = self._files(c, rank)
                if features.exists():
                    mapped = np.lib.format.open_memmap(features, mode="r+")
                    if mapped.shape != (rows, spec.k) or str(mapped.dtype) != spec.dtype:
                        raise StoreSpecError(
                            f"feature store {str(path)!r}: {features.name} holds {mapped.dtype} {list(mapped.shape)}, "
                            f"the spec says {spec.dtype} [{rows}, {spec.k}]: the directory was changed by hand; "
                            "delete it and write the features again."
                        )
                    done = (
                        torch.from_numpy(np.load(written)) if written.exists() else torch.zeros(rows, dtype=torch.bool)
                    )
                else:
                    mapped = np.lib.format.open_memmap(features, mode="w+", dtype=spec.dtype, shape=(rows, spec.k))
                    done = torch.zeros(rows, dtype=torch.bool)
                self._own[c] = mapped
                self._written[c] = done.clone()

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
        kind: str | None = None,
        rank: int = 0,
        world_size: int | None = None,
        readonly: bool = False,
    ) -> FeatureStore:
        """Open the store in directory ``path``, creating it if it has no ``spec.json`` yet.

        Creating needs ``n`` (samples) and ``k`` (features per sample); the other fields default to
        ``dtype=float32``, ``checkpoints=("final",)``, ``world_size=1``. Reopening checks every field
        passed against ``spec.json`` and raises :class:`StoreSpecError` naming the first that differs;
        fields left ``None`` are taken from disk. ``rank`` selects the shard this object writes
        (``0 <= rank < world_size``); ``readonly=True`` opens an existing store for reading only.
        """
        root = Path(path)
        given: dict[str, Any] = {
            "n": n,
            "k": k,
            "dtype": _dtype_name(dtype) if dtype is not None else None,
            "checkpoints": tuple(str(c) for c in checkpoints) if checkpoints is not None else None,
            "world_size": world_size,
            "model": model,
            "targets": tuple(targets) if targets is not None else None,
            "seed": seed,
            "kind": kind,
        }
        spec_path = root / SPEC_FILE
        if spec_path.exists():
            spec = StoreSpec.from_json(json.loads(spec_path.read_text()))
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
            spec = StoreSpec(
                **{name: value for name, value in given.items() if value is not None},
                projection=PROJECTION_VERSION if kind else 0,
            )
            _check_spec(root, spec)
            root.mkdir(parents=True, exist_ok=True)
            if not _create_once(spec_path, json.dumps(spec.to_json(), indent=2) + "\n"):
                # another rank created it first: it must agree with ours
                spec = StoreSpec.from_json(json.loads(spec_path.read_text()))
                _compare(root, spec, given)
        if spec.format_version != FORMAT_VERSION:
            raise StoreSpecError(
                f"feature store {str(root)!r} has format_version {spec.format_version}; this pergrad reads "
                f"{FORMAT_VERSION}: write the features again with this version."
            )
        if spec.kind and spec.projection != PROJECTION_VERSION:
            raise StoreSpecError(
                f"feature store {str(root)!r} holds kind={spec.kind!r} features of pergrad's projection version "
                f"{spec.projection}; this pergrad draws version {PROJECTION_VERSION} (pergrad.projectors.VERSION), "
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

    def write(self, indices: Tensor | Sequence[int], features: Tensor, checkpoint: str | int | None = None) -> None:
        """Write ``features[j]`` as the row of sample ``indices[j]`` (global sample indices this rank owns).

        Features are cast to the store's dtype; rewriting a row replaces it. The rows count as written on
        disk after the next :meth:`flush` or :meth:`close`.
        """
        self._check_writable()
        c = self.checkpoint_index(checkpoint)
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        where = f"feature store {str(self.path)!r}"
        if features.dim() != 2 or features.shape != (idx.numel(), self.spec.k):
            raise StoreIndexError(
                f"{where}: write got features of shape {list(features.shape)} for {idx.numel()} indices; it takes "
                f"[len(indices), k] = [{idx.numel()}, {self.spec.k}] (one row of k features per sample)."
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
        self._own[c][local] = values
        self._written[c][torch.from_numpy(local)] = True

    def flush(self) -> None:
        """Flush the features written so far to disk, then record their rows as written."""
        self._check_writable()
        np = numpy()
        for c, mapped in self._own.items():
            mapped.flush()
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

    def read(self, indices: Tensor | Sequence[int], checkpoint: str | int | None = None) -> Tensor:
        """Features ``[len(indices), k]`` of the given global sample indices (every one written)."""
        c = self.checkpoint_index(checkpoint)
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        self._check_range(idx, "read")
        return self._gather(c, idx, self._written_union(c))

    def chunks(
        self, size: int, checkpoint: str | int | None = None, indices: Tensor | Sequence[int] | None = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield ``(indices [c], features [c, k])`` for ``size`` samples at a time (``c <= size``), in order
        of global index (or of ``indices``, a subset), reading only those rows from disk."""
        if size < 1:
            raise StoreIndexError(f"feature store {str(self.path)!r}: chunk size {size} must be at least 1.")
        c = self.checkpoint_index(checkpoint)
        written = self._written_union(c)
        if indices is None:
            if not bool(written.all()):
                self._raise_missing(torch.nonzero(~written).reshape(-1), c)
            for start in range(0, self.spec.n, size):
                idx = torch.arange(start, min(start + size, self.spec.n))
                yield idx, self._gather(c, idx, written)
        else:
            subset = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
            self._check_range(subset, "read")
            if not bool(written[subset].all()):
                self._raise_missing(subset[~written[subset]], c)
            for start in range(0, subset.numel(), size):
                idx = subset[start : start + size]
                yield idx, self._gather(c, idx, written)

    # ------------------------------------------------------------------ internals

    def _files(self, c: int, rank: int) -> tuple[Path, Path]:
        return self.path / f"features.c{c}.r{rank}.npy", self.path / f"written.c{c}.r{rank}.npy"

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
        out = torch.empty(idx.numel(), self.spec.k, dtype=self.dtype)
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
            "(store.missing() lists them) and flush or close the writing store, or pass indices= to use a subset."
        )


def _dtype_name(dtype: torch.dtype | str) -> str:
    for name, value in DTYPES.items():
        if dtype in (value, name):
            return name
    raise StoreSpecError(f"feature store dtype {dtype!r} is not stored; pass dtype=torch.float32 or torch.float64.")


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
