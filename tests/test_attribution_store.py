"""pergrad.attribution.FeatureStore: rows by sample index on disk, resumable, sharded by rank, read in chunks."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data.distributed import DistributedSampler

import pergrad.attribution.projectors
from pergrad import PergradError
from pergrad.attribution import FeatureStore, MissingFeaturesError, StoreIndexError, StoreSpecError

N, K = 23, 5


def features(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def write_in_batches(
    store: FeatureStore, phi: torch.Tensor, order: torch.Tensor, checkpoint: str | None = None
) -> None:
    """Write ``phi[order]`` in batches of changing sizes, as a loader with a last short batch would."""
    sizes, start = [4, 1, 7, 3], 0
    while start < order.numel():
        idx = order[start : start + sizes[start % len(sizes)]]
        store.write(idx, phi[idx], checkpoint=checkpoint)
        start += idx.numel()


def read_all(store: FeatureStore, size: int, checkpoint: str | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    parts = list(store.chunks(size, checkpoint))
    assert all(idx.numel() <= size for idx, _ in parts)
    return torch.cat([idx for idx, _ in parts]), torch.cat([chunk for _, chunk in parts])


@pytest.mark.parametrize("size", [1, 4, N, N + 10, 5])
def test_rows_written_in_any_order_read_back_in_chunks(tmp_path: Path, size: int) -> None:
    phi = features()
    with FeatureStore.open(tmp_path / "s", n=N, k=K, dtype=torch.float64) as store:
        write_in_batches(store, phi, torch.randperm(N, generator=torch.Generator().manual_seed(1)))
    reader = FeatureStore.open(tmp_path / "s", readonly=True)
    idx, got = read_all(reader, size)
    assert torch.equal(idx, torch.arange(N))
    assert torch.equal(got, phi)
    assert len(list(reader.chunks(size))) == -(-N // size)
    subset = torch.tensor([17, 2, 3, 22, 0])
    parts = list(reader.chunks(size, indices=subset))
    assert torch.equal(torch.cat([i for i, _ in parts]), subset)
    assert torch.equal(torch.cat([c for _, c in parts]), phi[subset])
    assert torch.equal(reader.read(subset), phi[subset])


def test_float32_by_default_and_readable_without_pergrad(tmp_path: Path) -> None:
    phi = features()
    with FeatureStore.open(tmp_path, n=N, k=K, seed=3, kind="kron", model="mlp", targets=["fc1", "fc2"]) as store:
        store.write(torch.arange(N), phi)
    assert store.dtype == torch.float32
    on_disk = np.load(tmp_path / "features.c0.r0.npy", mmap_mode="r")
    assert on_disk.dtype == np.float32 and on_disk.shape == (N, K)
    assert np.array_equal(on_disk, phi.float().numpy())
    assert np.load(tmp_path / "written.c0.r0.npy").all()
    spec = (tmp_path / "spec.json").read_text()
    for field in ('"k": 5', '"n": 23', '"seed": 3', '"kind": "kron"', '"model": "mlp"', '"fc2"', '"float32"'):
        assert field in spec


def test_resume_after_close_writes_only_what_is_missing(tmp_path: Path) -> None:
    phi = features()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(2))
    first, second = order[: N // 2], order[N // 2 :]
    spec = {"n": N, "k": K, "dtype": torch.float64, "seed": 7, "kind": "dense"}
    with FeatureStore.open(tmp_path / "resumed", **spec) as store:
        write_in_batches(store, phi, first)
    with FeatureStore.open(tmp_path / "resumed", **spec) as store:
        assert torch.equal(store.missing(), second.sort().values)
        with pytest.raises(MissingFeaturesError, match=r"12 of the samples asked for are not written"):
            next(store.chunks(4))
        write_in_batches(store, phi, store.missing())
        assert store.missing().numel() == 0
    with FeatureStore.open(tmp_path / "at_once", **spec) as store:
        store.write(torch.arange(N), phi)
    for name in ("features.c0.r0.npy", "written.c0.r0.npy"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "at_once" / name).read_bytes()


def test_rows_not_flushed_count_as_missing_for_readers(tmp_path: Path) -> None:
    phi = features()
    writer = FeatureStore.open(tmp_path, n=N, k=K, dtype=torch.float64)
    writer.write(torch.arange(10), phi[:10])
    writer.flush()
    writer.write(torch.arange(10, 15), phi[10:15])  # not flushed: a crash here loses them
    reader = FeatureStore.open(tmp_path, readonly=True)
    assert torch.equal(reader.missing(), torch.arange(10, N))
    assert torch.equal(writer.missing(), torch.arange(15, N))
    with pytest.raises(
        MissingFeaturesError, match=r"2 of the samples asked for are not written \(and flushed\) yet, e\.g\. \[10, 11\]"
    ):
        reader.read(torch.arange(12))
    assert torch.equal(reader.read(torch.arange(10)), phi[:10])
    writer.close()
    assert torch.equal(FeatureStore.open(tmp_path, readonly=True).missing(), torch.arange(15, N))


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("k", 6, "5"),
        ("n", 24, "23"),
        ("seed", 1, "0"),
        ("dtype", torch.float64, "'float32'"),
        ("kind", "sjlt", "'kron'"),
        ("model", "other", "'mlp'"),
        ("targets", ["fc1"], r"\('fc1', 'fc2'\)"),
        ("checkpoints", ["a"], r"\('e1', 'e2'\)"),
        ("world_size", 2, "1"),
    ],
)
def test_reopening_with_another_spec_names_the_field(tmp_path: Path, field: str, value: object, stored: str) -> None:
    spec: dict[str, object] = {
        "n": N,
        "k": K,
        "seed": 0,
        "kind": "kron",
        "model": "mlp",
        "targets": ["fc1", "fc2"],
        "checkpoints": ["e1", "e2"],
    }
    FeatureStore.open(tmp_path, **spec).close()  # type: ignore[arg-type]
    with pytest.raises(StoreSpecError, match=rf"was written with {field}={stored}, this call asks for {field}=.*"):
        FeatureStore.open(tmp_path, **{**spec, field: value})  # type: ignore[arg-type]
    FeatureStore.open(tmp_path, readonly=True).close()  # fields left out are read from disk


def test_features_of_another_projection_version_are_refused(tmp_path: Path) -> None:
    """A store of pergrad's features records the projection's version; one written by a pergrad that drew
    another P is refused (its features would not match new ones), a store of other features is not checked."""
    with FeatureStore.open(tmp_path / "ours", n=4, k=8, kind="kron", seed=1) as store:
        store.write(torch.arange(4), torch.ones(4, 8))
    spec_path = tmp_path / "ours" / "spec.json"
    spec = json.loads(spec_path.read_text())
    assert spec["projection"] == pergrad.attribution.projectors.VERSION
    spec["projection"] = pergrad.attribution.projectors.VERSION - 1
    spec_path.write_text(json.dumps(spec))
    with pytest.raises(
        StoreSpecError,
        match=rf"projection version {pergrad.attribution.projectors.VERSION - 1}; this pergrad draws version "
        rf"{pergrad.attribution.projectors.VERSION} .*write the features",
    ):
        FeatureStore.open(tmp_path / "ours", readonly=True)
    with FeatureStore.open(tmp_path / "theirs", n=4, k=8) as store:  # no kind: features from elsewhere
        store.write(torch.arange(4), torch.ones(4, 8))
    assert json.loads((tmp_path / "theirs" / "spec.json").read_text())["projection"] == 0
    FeatureStore.open(tmp_path / "theirs", readonly=True).close()


def test_opening_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreSpecError, match=r"does not exist yet: creating it needs n= \(samples\) and k="):
        FeatureStore.open(tmp_path / "new", k=4)
    with pytest.raises(StoreSpecError, match=r"has no spec\.json: nothing was written there"):
        FeatureStore.open(tmp_path / "new", readonly=True)
    with pytest.raises(StoreSpecError, match=r"dtype torch\.bfloat16 is not stored; pass dtype=torch\.float16"):
        FeatureStore.open(tmp_path / "new", n=3, k=4, dtype=torch.bfloat16)
    with pytest.raises(StoreSpecError, match=r"rank=2 is not in range for world_size=2"):
        FeatureStore.open(tmp_path / "new", n=3, k=4, world_size=2, rank=2)
    with FeatureStore.open(tmp_path / "s", n=N, k=K, checkpoints=["e1", "e2"]) as store:
        with pytest.raises(StoreSpecError, match=r"has checkpoints \['e1', 'e2'\]: pass checkpoint="):
            store.write([0], torch.zeros(1, K))
        with pytest.raises(StoreSpecError, match=r"has no checkpoint 'e3'"):
            store.write([0], torch.zeros(1, K), checkpoint="e3")
        with pytest.raises(StoreIndexError, match=r"takes \[len\(indices\), k\] = \[2, 5\]"):
            store.write([0, 1], torch.zeros(2, K + 1), checkpoint=0)
        with pytest.raises(StoreIndexError, match=r"sample indices \[23\] outside \[0, n=23\)"):
            store.write([1, 23], torch.zeros(2, K), checkpoint=0)
        with pytest.raises(StoreIndexError, match=r"repeated indices"):
            store.write([1, 1], torch.zeros(2, K), checkpoint=0)
    with pytest.raises(StoreSpecError, match=r"is closed: open it again with FeatureStore.open to write"):
        store.write([0], torch.zeros(1, K), checkpoint=0)
    with pytest.raises(StoreSpecError, match=r"opened readonly=True: open it with readonly=False to write"):
        FeatureStore.open(tmp_path / "s", readonly=True).write([0], torch.zeros(1, K), checkpoint=0)
    assert issubclass(StoreSpecError, PergradError)


def test_checkpoints_are_stored_apart(tmp_path: Path) -> None:
    phis = {"e1": features(seed=1), "e2": features(seed=2), "e3": features(seed=3)}
    with FeatureStore.open(tmp_path, n=N, k=K, dtype=torch.float64, checkpoints=list(phis)) as store:
        for name, phi in phis.items():
            write_in_batches(store, phi, torch.arange(N).flip(0), checkpoint=name)
            if name == "e1":
                assert torch.equal(store.missing(), torch.arange(N))  # missing in some checkpoint
                assert store.missing("e1").numel() == 0
    reader = FeatureStore.open(tmp_path, readonly=True)
    for number, (name, phi) in enumerate(phis.items()):
        assert torch.equal(read_all(reader, 6, name)[1], phi)
        assert torch.equal(read_all(reader, 6, number)[1], phi)


def test_two_ranks_write_their_own_shards_and_read_as_one(tmp_path: Path) -> None:
    n, world = 11, 2
    phi = features(n)
    stores = [
        FeatureStore.open(tmp_path, n=n, k=K, dtype=torch.float64, rank=rank, world_size=world) for rank in range(world)
    ]
    for rank, store in enumerate(stores):
        # what DistributedSampler(shuffle=False) hands each rank, padding repeats included
        given = torch.tensor(list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)))
        mask = store.owns(given)
        assert (rank == 1) == (not bool(mask.all()))  # rank 1 gets sample 0 again to pad its last batch
        foreign = given if rank == 1 else given[:-1] + 1
        with pytest.raises(StoreIndexError, match=rf"rank {rank} of 2 writes the samples i with i % 2 == {rank}, got"):
            store.write(foreign, phi[foreign])
        for batch in given.split(3):
            keep = batch[store.owns(batch)]
            store.write(keep, phi[keep])
    assert torch.equal(stores[0].missing(), torch.arange(1, n, 2))  # rank 1 has not flushed yet
    assert stores[1].missing(own=True).numel() == 0
    stores[1].close()
    assert stores[0].missing().numel() == 0
    stores[0].close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "features.c0.r0.npy",
        "features.c0.r1.npy",
        "spec.json",
        "written.c0.r0.npy",
        "written.c0.r1.npy",
    ]
    reader = FeatureStore.open(tmp_path, readonly=True)
    for size in (1, 3, 4, n, n + 1):
        idx, got = read_all(reader, size)
        assert torch.equal(idx, torch.arange(n)) and torch.equal(got, phi)
    subset = torch.tensor([9, 4, 5, 0])
    assert torch.equal(reader.read(subset), phi[subset])
    assert np.array_equal(np.load(tmp_path / "features.c0.r1.npy"), phi[1::2].numpy())


def _rank_writes(rank: int, world: int, path: str) -> None:
    # generous: on a loaded machine the last process may need a minute or more to import torch
    init = f"file://{path}.init"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        n, phi = 13, features(13)
        with FeatureStore.open(path, n=n, k=K, dtype=torch.float64, rank=rank, world_size=world) as store:
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
            for batch in torch.tensor(list(sampler)).split(2):
                keep = batch[store.owns(batch)]
                store.write(keep, phi[keep])
        dist.barrier()  # every shard flushed: each rank reads the union
        reader = FeatureStore.open(path, readonly=True)
        assert torch.equal(torch.cat([c for _, c in reader.chunks(5)]), phi)
    finally:
        dist.destroy_process_group()


def test_two_processes_write_shards_of_one_store(tmp_path: Path) -> None:
    mp.spawn(_rank_writes, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
    reader = FeatureStore.open(tmp_path / "store", readonly=True)
    assert reader.world_size == 2 and reader.missing().numel() == 0
    assert torch.equal(reader.read(torch.arange(13)), features(13))


def test_without_numpy_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(
        ImportError,
        match=r"pip install 'pergrad\[attribution\]' \(in a clone of pergrad: pip install -e '\.\[attribution\]'\)",
    ):
        FeatureStore.open(tmp_path, n=3, k=2)
