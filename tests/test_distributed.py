"""Several processes on CPU (gloo): DistributedDataParallel and FSDP2 (``fully_shard``).

Every rank's ``.grad`` must be exactly what one process computes from ALL ranks' samples, on every
step, and what crosses the wire must be what plain DDP / FSDP2 send. The processes are started once
per world size (``Pool``: starting a process that imports torch costs seconds, a case a fraction of
one) and run one case after another; a case that fails restarts them for the next.
"""

from __future__ import annotations

import contextlib
import queue
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from pergrad import PerSampleModule, transforms
from pergrad.errors import PergradError
from tests.reference import counting, reference_grad_sample

# -- the processes ---------------------------------------------------------------------------------


def _serve(rank: int, world: int, init_file: str, inbox: Any, outbox: Any) -> None:
    dist.init_process_group(
        # generous: on a loaded machine the last process may need a minute or more to import torch
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    torch.set_num_threads(1)
    try:
        while (task := inbox.get()) is not None:
            fn, args = task
            try:
                outbox.put((rank, True, fn(rank, world, *args)))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Pool:
    """``world`` processes in one gloo group, running ``fn(rank, world, *args)`` on each."""

    def __init__(self, world: int, directory: Path) -> None:
        self.world, self.directory, self.started = world, directory, 0
        self.procs: list[Any] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.started += 1
        init = self.directory / f"init{self.started}"
        self.inboxes = [ctx.SimpleQueue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.world, str(init), self.inboxes[r], self.outbox), daemon=True)
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300) -> list[Any]:
        if not self.procs:
            self._start()
            timeout += 300  # the processes start and meet first
        for inbox in self.inboxes:
            inbox.put((fn, args))
        results: list[Any] = [None] * self.world
        errors = []
        try:
            for _ in range(self.world):
                rank, ok, value = self.outbox.get(timeout=timeout)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    timeout = 90  # the others may wait in a collective until gloo gives up
        except queue.Empty:
            errors.append(f"no answer within {timeout} s")
        if errors:
            self.close()
            raise AssertionError("\n".join(errors))
        return results

    def close(self) -> None:
        for p in self.procs:
            p.terminate() if p.is_alive() else None
            p.join(5)
        self.procs = []


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(2, tmp_path_factory.mktemp("world2"))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(3, tmp_path_factory.mktemp("world3"))
    yield pool
    pool.close()


# -- one case: the model, the batches, the transforms -----------------------------------------------


@dataclass(frozen=True)
class Case:
    kind: str  # "ddp" or "fsdp"
    target: str  # "root", "module", "param" or "none" (see ``targets``)
    keep: bool = False  # keep_grad_sample
    loss_reduction: str = "mean"
    reduction: str = "mean"
    accumulate: str = "backward"
    # per step, per rank: the sizes of the micro-batches (one backward each) that rank runs
    sizes: tuple[tuple[int, ...], ...] = ((3,), (3,))
    steps: int = 3
    no_sync: bool = False  # every backward but the last of a step without communication: DDP's no_sync(),
    # FSDP2's set_requires_gradient_sync(False)
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel's options
    shard: str = "layers"  # FSDP2: fully_shard on each layer and the root, or on the root only
    raw: bool = False  # end the model with a module of the user's that uses its parameter directly
    # DDP: "wrap-ddp" PerSampleModule(DDP(net)); "ddp-net" PerSampleModule(net) then DDP(net);
    # "ddp-parent" PerSampleModule(net) then DDP(a parent of net), as Lightning's DDP strategy does
    order: str = "wrap-ddp"
    hook: str = ""  # a communication hook of the user's: "allreduce", "fp16" or "powersgd"
    hook_first: bool = True  # registered before pergrad sees the DDP model (else right after wrapping)


class Gate(nn.Module):
    """A raw parameter (``pergrad.rules.raw``): ``y = x * gamma``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


def make_model(raw: bool = False) -> nn.Sequential:
    """5 rows per weight: uneven shards over 2 or 3 ranks; a Linear without bias (detached with a probe)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5, bias=False), nn.Tanh(), nn.Linear(5, 3)]
    return nn.Sequential(*layers, *([Gate(3)] if raw else [])).double()


class Parent(nn.Module):
    """What Lightning puts in DDP: a module holding the user's ``net`` (a LightningModule)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def user_hook(name: str) -> tuple[Any, Callable[..., Any]]:
    """A communication hook of the user's and its state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        # rank 5 >= every weight's smaller dim, always compressed (from its 3rd step): exact to round-off
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=5, start_powerSGD_iter=2, min_compression_rate=0
        )
        return state, powerSGD_hook.powerSGD_hook
    return None, {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[name]


def targets(model: nn.Module, root: nn.Module, name: str) -> list[tuple[Any, transforms.Transform]]:
    """``model``: the Sequential (maybe sharded); ``root``: what the user wraps (the DDP model)."""
    return {
        "root": [(root, transforms.clip_norm(0.3))],
        "clip": [(root, transforms.clip_norm(4.0))],  # about the median per-sample norm
        "module": [(model[2], transforms.normalize(1e-6))],
        "param": [(model[0].weight, transforms.clip_norm(0.2)), (model[4], transforms.square())],
        "none": [],
    }[name]


def batches(case: Case, world: int) -> list[list[list[tuple[Tensor, Tensor]]]]:
    """Per step, per rank, its micro-batches ``(x, target)``; the same on every process."""
    gen = torch.Generator().manual_seed(1)
    out = []
    assert len(case.sizes) == world, "one tuple of micro-batch sizes per rank"
    for _ in range(case.steps):
        out.append(
            [
                [
                    (torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen).double())
                    for n in rank_sizes
                ]
                for rank_sizes in case.sizes
            ]
        )
    return out


def _plain(t: Tensor) -> Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _shard_model(model: nn.Module, how: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if how == "layers":
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_case(rank: int, world: int, case: Case) -> list[dict[str, Any]]:
    """Train ``case.steps`` steps; per step, every ``.grad`` (whole) and this rank's ``grad_sample``."""
    model = make_model(case.raw)
    options = dict(
        keep_grad_sample=case.keep,
        loss_reduction=case.loss_reduction,
        reduction=case.reduction,
        accumulate=case.accumulate,
    )
    hook = user_hook(case.hook) if case.hook else None
    calls: list[int] = []  # the buckets the user's hook reduced in this step
    if hook is not None:
        state, fn = hook

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # (DDP checks annotations: none)
            calls.append(bucket.index())
            return fn(state, bucket)

        hook = (state, counted)
    if case.kind == "ddp" and case.order == "wrap-ddp":
        root: nn.Module = DistributedDataParallel(model, **case.ddp)
        if hook is not None and case.hook_first:
            root.register_comm_hook(*hook)
        psm = PerSampleModule(root, **options)
        if hook is not None and not case.hook_first:
            root.register_comm_hook(*hook)
        wrapped = root
    elif case.kind == "ddp":  # DDP applied after wrapping: pergrad finds it at the first forward
        psm = PerSampleModule(model, **options)
        root = DistributedDataParallel(model if case.order == "ddp-net" else Parent(model), **case.ddp)
        if hook is not None and case.hook_first:  # (else after the first forward: see below)
            root.register_comm_hook(*hook)
        wrapped = model
    else:
        _shard_model(model, case.shard)
        root = wrapped = model
        psm = PerSampleModule(root, **options)
    call = root if case.order != "wrap-ddp" else psm
    for target, transform in targets(model, wrapped, case.target):
        psm.register_transform(target, transform)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step_batches in batches(case, world):
        mine = step_batches[rank]
        for i, (x, t) in enumerate(mine):
            sync = not case.no_sync or i == len(mine) - 1
            if case.kind == "fsdp":
                model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            with contextlib.nullcontext() if sync or case.kind == "fsdp" else root.no_sync():  # type: ignore[operator]
                loss = (call(x) - t).pow(2).sum()
                if hook is not None and not case.hook_first and case.order != "wrap-ddp" and not out and i == 0:
                    root.register_comm_hook(*hook)  # pergrad found the DDP model in that forward
                if case.kind == "fsdp" and case.shard == "layers":  # resharded after their forward
                    assert all(type(p).__name__ == "DTensor" for layer in model for p in layer.parameters())
                (loss / len(x) if case.loss_reduction == "mean" else loss).backward()
        grads = {n: _plain(p.grad) for n, p in model.named_parameters()}
        kept = {n: p.grad_sample.clone() for n, p in model.named_parameters() if hasattr(p, "grad_sample")}
        compressed = bool(getattr(hook[0], "p_memory_dict", None)) if hook is not None else False
        out.append({"grad": grads, "grad_sample": kept, "hook_calls": len(calls), "compressed": compressed})
        calls.clear()
        if case.target != "none" and not case.keep and len(out) > 1:  # after the first (checked) backward
            # the weights a transform covers ran detached: autograd computed no weight gradient for them
            assert psm._engine.detacher.current, "no weight ran detached"
        opt.step()
        opt.zero_grad()
    psm.remove()
    return out


def expected(case: Case, world: int) -> list[dict[str, Any]]:
    """One process, every rank's samples: per step the ``.grad`` pergrad must give on every rank, and
    each rank's per-sample gradients (of its last micro-batch)."""
    model = make_model(case.raw)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step_batches in batches(case, world):
        flat = [mb for rank_batches in step_batches for mb in rank_batches]
        x, t = torch.cat([mb[0] for mb in flat]), torch.cat([mb[1] for mb in flat])
        raw = reference_grad_sample(model, x, t)
        g = dict(raw)
        for target, transform in targets(model, model, case.target):
            names = (
                list(g)
                if target is model
                else [n for n, p in model.named_parameters() if p is target or any(p is q for q in target.parameters())]
                if isinstance(target, nn.Module)
                else [n for n, p in model.named_parameters() if p is target]
            )
            g.update(transform.apply({n: g[n] for n in names}))
        # a step's backward passes (the micro-batches) in order, each with the reduction over ranks
        reduce_all = case.accumulate == "samples" and case.reduction == "mean"
        grads = dict.fromkeys(g, 0.0)
        start = 0
        per_rank = [[len(mb[0]) for mb in rank_batches] for rank_batches in step_batches]
        rank_starts = [sum(sum(s) for s in per_rank[:r]) for r in range(world)]
        if reduce_all:
            grads = {n: v.mean(0) for n, v in g.items()}
        else:
            for i in range(len(per_rank[0])):
                for r in range(world):
                    start = rank_starts[r] + sum(per_rank[r][:i])
                    for n, v in g.items():
                        part = v[start : start + per_rank[r][i]]
                        # DDP and FSDP2 average over ranks: each rank's mean, or world x each rank's sum
                        grads[n] = grads[n] + (part.mean(0) / world if case.reduction == "mean" else part.sum(0))
        samples = []
        for r in range(world):
            start = rank_starts[r] + sum(per_rank[r][:-1])
            samples.append({n: v[start : start + per_rank[r][-1]] for n, v in raw.items()})
        out.append({"grad": grads, "grad_sample": samples})
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    return out


def check(pool: Pool, case: Case) -> None:
    results = pool.run(run_case, case)
    want = expected(case, pool.world)
    # fp16_compress_hook: each rank's gradient rounded to float16 (and the weights drift by as much)
    rtol, atol = (1e-2, 1e-4) if case.hook == "fp16" else (1e-7, 1e-10) if case.hook else (1e-9, 1e-12)
    for rank, steps in enumerate(results):
        for step, (got, exp) in enumerate(zip(steps, want)):
            for name, value in exp["grad"].items():
                torch.testing.assert_close(
                    got["grad"][name], value, rtol=rtol, atol=atol, msg=f"rank {rank} step {step} {name}"
                )
            if case.hook:  # the user's hook reduced the buckets; PowerSGD compressed from its 3rd step on
                assert got["hook_calls"] > 0, (rank, step)
                assert got["compressed"] == (case.hook == "powersgd" and step >= 2), (rank, step)
            if case.hook == "fp16":  # .grad is what the hook decompressed: float16 values
                assert all(torch.equal(v, v.half().double()) for v in got["grad"].values()), (rank, step)
            if case.keep:
                assert set(got["grad_sample"]) == set(exp["grad"])
                for name, value in exp["grad_sample"][rank].items():
                    torch.testing.assert_close(got["grad_sample"][name], value, rtol=1e-9, atol=1e-12)


DDP_CASES = [
    Case("ddp", "root"),
    Case("ddp", "root", keep=True, loss_reduction="sum", reduction="sum", sizes=((3,), (2,))),
    Case("ddp", "module", loss_reduction="mean", reduction="sum", sizes=((1,), (4,))),
    Case("ddp", "param", keep=True, loss_reduction="sum", reduction="mean"),
    Case("ddp", "none", keep=True),
    Case("ddp", "none", loss_reduction="mean", reduction="sum", sizes=((4,), (2,))),
    # accumulate="samples": .grad is the mean over every sample of every rank, whatever the sizes
    Case("ddp", "root", accumulate="samples", sizes=((2, 3), (3, 1)), no_sync=True),
    Case("ddp", "param", keep=True, accumulate="samples", sizes=((1, 2), (3, 2))),
    Case("ddp", "none", accumulate="samples", sizes=((2, 3), (1, 1)), no_sync=True),
    # .grad is a view of DDP's bucket; DDP looks for unused parameters after each forward
    Case("ddp", "root", ddp={"gradient_as_bucket_view": True, "find_unused_parameters": True}),
    # a bucket per parameter: those pergrad writes wait, the others go at once
    Case("ddp", "module", keep=True, ddp={"bucket_cap_mb": 1e-6}),
    # accumulate="backward" over several backward passes, synced each time or only at the last
    Case("ddp", "root", loss_reduction="sum", reduction="sum", sizes=((2, 1), (1, 3)), no_sync=True),
    Case("ddp", "module", sizes=((2, 2), (2, 2))),
    Case("ddp", "root", raw=True, keep=True),
    # an empty batch on one rank (Poisson sampling)
    Case("ddp", "root", keep=True, loss_reduction="sum", reduction="sum", sizes=((0,), (3,))),
    Case("ddp", "param", accumulate="samples", sizes=((0, 2), (3, 0))),
]


@pytest.mark.parametrize("case", DDP_CASES, ids=str)
def test_ddp_grad_is_the_reduction_over_all_ranks_samples(pool2: Pool, case: Case) -> None:
    check(pool2, case)


LATE_DDP_CASES = [
    # PerSampleModule(net), then DDP(net) or DDP(a parent of net): pergrad finds DDP at the first forward
    Case("ddp", "clip", order="ddp-net", sizes=((3, 2), (2, 4)), steps=4),
    Case("ddp", "clip", order="ddp-parent", sizes=((3,), (2,)), steps=4),
    Case("ddp", "clip", order="ddp-net", ddp={"find_unused_parameters": True}, loss_reduction="sum", reduction="sum"),
    Case("ddp", "clip", order="ddp-parent", ddp={"find_unused_parameters": True}, sizes=((2, 3), (4, 1))),
    Case("ddp", "module", order="ddp-parent", keep=True, accumulate="samples", sizes=((2, 3), (3, 1)), no_sync=True),
    Case("ddp", "param", order="ddp-net", keep=True, ddp={"bucket_cap_mb": 1e-6}, reduction="sum", sizes=((0,), (3,))),
]


@pytest.mark.parametrize("case", LATE_DDP_CASES, ids=str)
def test_ddp_applied_after_wrapping(pool2: Pool, case: Case) -> None:
    check(pool2, case)


class Shifted(nn.Module):
    """A parent with a parameter of its own, outside the wrapped ``net``: ``net(x) + offset``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.offset = nn.Parameter(torch.linspace(-1, 1, 3, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + self.offset


def parent_own_parameter(rank: int, world: int) -> list[float]:
    """``PerSampleModule(net, accumulate="samples")``, then ``DDP(parent)``, micro-batches of different
    sizes under ``no_sync``: net's ``.grad`` is the mean of ``clip(g_i)`` over every rank's samples,
    the parent's ``offset`` keeps DDP's mean over ranks of autograd's gradient (in the same bucket).
    Per step, the largest difference to a one-process reference on every rank's samples."""
    sizes = ((2, 3), (4, 1))
    model = Shifted(make_model())
    ref = Shifted(make_model())
    psm = PerSampleModule(model.net, accumulate="samples")
    psm.register_transform(model.net, transforms.clip_norm(4.0))
    ddp = DistributedDataParallel(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    gen = torch.Generator().manual_seed(1)
    diffs = []
    for step in range(3):
        data = [
            [(torch.randn(n, 4, generator=gen).double(), torch.randn(n, 3, generator=gen).double()) for n in s]
            for s in sizes
        ]
        for i, (x, t) in enumerate(data[rank]):
            with ddp.no_sync() if i < len(data[rank]) - 1 else contextlib.nullcontext():  # type: ignore[operator]
                ((ddp(x) - t).pow(2).sum() / len(x)).backward()
        flat = [mb for batches in data for mb in batches]
        g = reference_grad_sample(ref, torch.cat([mb[0] for mb in flat]), torch.cat([mb[1] for mb in flat]))
        net = [n for n in g if n.startswith("net.")]
        want = {n: v.mean(0) for n, v in transforms.clip_norm(4.0).apply({n: g[n] for n in net}).items()}
        means, start = [], 0  # autograd: each micro-batch's mean, added up per rank; DDP: the mean over ranks
        for batches in data:
            means.append(sum(g["offset"][start + sum(s) - n : start + sum(s)].mean(0) for n, s in _prefixes(batches)))
            start += sum(len(mb[0]) for mb in batches)
        want["offset"] = sum(means) / world
        diffs.append(max(float((p.grad - want[n]).abs().max()) for n, p in model.named_parameters()))
        if step > 0:
            assert psm._engine.detacher.current, "no weight ran detached"
        for n, p in ref.named_parameters():
            p.grad = want[n].clone()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    psm.remove()
    return diffs


def _prefixes(batches: list[tuple[Tensor, Tensor]]) -> list[tuple[int, list[int]]]:
    """Each micro-batch's size and the sizes up to and including it."""
    sizes = [len(mb[0]) for mb in batches]
    return [(n, sizes[: i + 1]) for i, n in enumerate(sizes)]


def test_ddp_of_a_parent_with_parameters_of_its_own(pool2: Pool) -> None:
    for diffs in pool2.run(parent_own_parameter):
        assert max(diffs) < 1e-12, diffs


HOOK_CASES = [
    # the user's communication hook gets DDP's buckets with pergrad's transformed gradients in them
    Case("ddp", "clip", hook="allreduce", sizes=((3, 2), (2, 4))),
    Case("ddp", "clip", hook="allreduce", hook_first=False, accumulate="samples", sizes=((2, 3), (3, 1))),
    Case("ddp", "clip", hook="fp16", hook_first=False, sizes=((3,), (2,))),
    Case("ddp", "clip", hook="powersgd", steps=4, sizes=((3,), (4,))),
    Case("ddp", "clip", hook="powersgd", hook_first=False, steps=4, loss_reduction="sum", reduction="sum"),
    Case("ddp", "clip", hook="fp16", order="ddp-parent", ddp={"find_unused_parameters": True}),
    Case("ddp", "clip", hook="allreduce", order="ddp-net", keep=True, sizes=((3,), (2,))),
    Case("ddp", "clip", hook="allreduce", order="ddp-net", hook_first=False, sizes=((2, 3), (3, 1)), no_sync=True),
]


@pytest.mark.parametrize("case", HOOK_CASES, ids=str)
def test_ddp_with_the_users_comm_hook(pool2: Pool, case: Case) -> None:
    check(pool2, case)


FSDP_CASES = [
    Case("fsdp", "root"),
    Case("fsdp", "root", keep=True, loss_reduction="sum", reduction="sum", sizes=((3,), (2,))),
    Case("fsdp", "module", loss_reduction="mean", reduction="sum", sizes=((1,), (4,))),
    Case("fsdp", "param", keep=True, loss_reduction="sum", reduction="mean"),
    Case("fsdp", "none", keep=True),
    Case("fsdp", "root", shard="root", loss_reduction="sum", reduction="sum", sizes=((2, 1), (1, 3))),
    Case("fsdp", "param", shard="root", keep=True, sizes=((2, 2), (2, 2))),
    Case("fsdp", "root", raw=True, keep=True),
    Case("fsdp", "root", keep=True, loss_reduction="sum", reduction="sum", sizes=((0,), (3,))),
    # set_requires_gradient_sync(False) for the first micro-batches: reduce-scattered at the last
    Case("fsdp", "root", sizes=((2, 1, 3), (1, 3, 2)), loss_reduction="sum", reduction="sum", no_sync=True),
    Case("fsdp", "module", keep=True, sizes=((2, 2), (2, 2)), no_sync=True),
    Case("fsdp", "root", raw=True, shard="root", loss_reduction="sum", reduction="sum"),
]


@pytest.mark.parametrize("case", FSDP_CASES, ids=str)
def test_fsdp2_grad_is_the_reduction_over_all_ranks_samples(pool2: Pool, case: Case) -> None:
    check(pool2, case)


@pytest.mark.parametrize(
    "case",
    [
        Case("fsdp", "root", keep=True, sizes=((2,), (2,), (2,))),
        Case("ddp", "param", accumulate="samples", sizes=((1, 2), (3, 1), (2, 2)), no_sync=True),
    ],
    ids=str,
)
def test_three_processes(pool3: Pool, case: Case) -> None:
    """Shards of 2, 2 and 1 rows; three ranks' running means."""
    check(pool3, case)


# -- what crosses the wire ------------------------------------------------------------------------


def _counting_allreduce(bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Plain DDP's reduction of a bucket (the mean over ranks), through ``dist.all_reduce``."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def traffic(rank: int, world: int, kind: str, setting: str, micro: int) -> list[dict[str, int]]:
    """Bytes and collectives per step (after the first), plain or with pergrad; a step is ``micro``
    backward passes, all but the last without communication (DDP's no_sync, FSDP2's
    set_requires_gradient_sync(False))."""
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if kind == "ddp":
        root: nn.Module = DistributedDataParallel(model)
    else:
        _shard_model(model, "layers")
        root = model
    run: Callable[[Tensor], Tensor] = root
    if setting == "plain" and kind == "ddp":
        root.register_comm_hook(None, lambda state, bucket: _counting_allreduce(bucket))  # type: ignore[operator]
    elif setting != "plain":
        keep, accumulate, target = {
            "clip": (False, "backward", root),
            "clip-keep": (True, "backward", root),
            "layer": (False, "backward", model[2]),
            "samples": (False, "samples", root),
        }[setting]
        psm = PerSampleModule(root, keep_grad_sample=keep, accumulate=accumulate)
        psm.register_transform(target, transforms.clip_norm(1.0))
        run = psm
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(3):
        with counting() as seen:
            for i in range(micro):
                sync = i == micro - 1
                if kind == "fsdp":
                    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
                with contextlib.nullcontext() if sync or kind == "fsdp" else root.no_sync():  # type: ignore[operator]
                    run(torch.randn(16, 8, generator=gen)).square().mean().backward()
            if kind == "ddp" and not root._comm_hooks:  # DDP's reducer all-reduced every bucket in C++
                seen["bytes"] += sum(p.numel() * p.element_size() for p in model.parameters())
                seen["calls"] += 1  # (at least)
        model.zero_grad()
        out.append(seen)
    return out[1:]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("micro", [1, 2])
def test_each_gradient_crosses_the_wire_once(pool2: Pool, kind: str, micro: int) -> None:
    """pergrad sends what plain DDP / FSDP2 send: 1.0x the bytes, no more collectives (one more of
    one number per parameter for ``accumulate="samples"``), on every step."""
    plain = pool2.run(traffic, kind, "plain", micro)[0]
    assert plain[0]["bytes"] >= 19_984, plain  # every gradient, float32 (and FSDP2's all-gathers)
    settings = ["clip", "clip-keep", "layer"] + (["samples"] if kind == "ddp" else [])
    for setting in settings:
        for rank, steps in enumerate(pool2.run(traffic, kind, setting, micro)):
            for seen, base in zip(steps, plain):
                extra = (6 * 8, 1) if setting == "samples" else (0, 0)  # a float64 count per parameter
                assert seen["bytes"] == base["bytes"] + extra[0], (setting, rank, seen, base)
                assert seen["calls"] <= base["calls"] + extra[1], (setting, rank, seen, base)


# -- what is refused ------------------------------------------------------------------------------


def refusals(rank: int, world: int, what: str) -> str:
    """The error ``what`` raises (the same on every rank)."""
    model = make_model()
    try:
        if what == "static_graph":
            PerSampleModule(DistributedDataParallel(model, static_graph=True))
        elif what == "static_graph_late":  # DDP applied after wrapping: found at its first forward
            psm = PerSampleModule(model)
            DistributedDataParallel(model, static_graph=True)(torch.randn(2, 4, dtype=torch.float64))
        elif what in ("builtin_before", "builtin_after"):
            ddp = DistributedDataParallel(model)
            if what == "builtin_before":
                ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
            psm = PerSampleModule(ddp)
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        elif what == "two_hooks":
            ddp = DistributedDataParallel(model)
            psm = PerSampleModule(ddp)
            for _ in range(2):
                ddp.register_comm_hook(*user_hook("allreduce"))
        elif what == "two_wrappers":  # two wrapped models under one DDP (found at its first forward)
            parent = nn.ModuleDict({"a": model, "b": make_model()})
            psm, _second = PerSampleModule(parent["a"]), PerSampleModule(parent["b"])
            ddp = DistributedDataParallel(Parent(parent))
            ddp.module.forward = lambda x: parent["a"](x) + parent["b"](x)  # type: ignore[method-assign]
            ddp(torch.randn(2, 4, dtype=torch.float64))
        elif what == "fsdp_samples":
            _shard_model(model, "layers")
            PerSampleModule(model, accumulate="samples")
        elif what == "fsdp_no_sync":
            _shard_model(model, "layers")
            psm = PerSampleModule(model)
            psm.register_transform(model, transforms.clip_norm(1.0))
            model[0].set_requires_gradient_sync(False)  # type: ignore[operator]
            psm(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    except (PergradError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("static_graph", r"PergradError: DistributedDataParallel\(static_graph=True\) is not supported"),
        ("static_graph_late", r"PergradError: DistributedDataParallel\(static_graph=True\) is not supported"),
        ("builtin_before", r"PergradError: pergrad could not register .*a built-in hook .*ddp.register_comm_hook"),
        ("builtin_after", r"PergradError: a built-in DDP communication hook .*register its Python equivalent"),
        ("two_hooks", r"PergradError: .*has a communication hook already \(allreduce_hook\); DDP takes one"),
        (
            "two_wrappers",
            r"PergradError: this DistributedDataParallel model holds two models wrapped by PerSampleModule",
        ),
        ("fsdp_samples", r"ValueError: accumulate='samples' is not supported for FSDP2"),
        (
            "fsdp_no_sync",
            r"PergradError: some of this FSDP2 model's modules reduce .*Call set_requires_gradient_sync on the root",
        ),
    ],
)
def test_refused_with_a_clear_error(pool2: Pool, what: str, match: str) -> None:
    for message in pool2.run(refusals, what):
        assert re.search(match, message), message


def one_rank_fails(rank: int, world: int, kind: str) -> list[str]:
    """Rank 1's transform raises at the end of a backward (a weight per sample, of 3, for its 2
    samples); rank 0's does not. Every rank takes part in every collective all the same: nobody
    waits forever, and the next step runs on both."""
    model = make_model()
    if kind == "ddp":
        root: nn.Module = DistributedDataParallel(model)
    else:
        _shard_model(model, "layers")
        root = model
    psm = PerSampleModule(root, keep_grad_sample=False)
    weights = transforms.scale(torch.ones(3, dtype=torch.float64))
    psm.register_transform(model[0], weights)
    psm.register_transform(model[4], transforms.clip_norm(1.0))
    seen = []
    for n in ([3, 3 - rank], [3, 3]):
        for size in n:
            try:
                psm(torch.ones(size, 4, dtype=torch.float64)).sum().backward()
                seen.append("ok")
            except Exception as err:
                seen.append(f"{type(err).__name__}: {err}")
            model.zero_grad()
    return seen


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_error_on_one_rank_does_not_hang_the_others(pool2: Pool, kind: str) -> None:
    rank0, rank1 = pool2.run(one_rank_fails, kind)
    assert rank0 == ["ok"] * 4
    assert rank1[0] == rank1[2] == rank1[3] == "ok"
    assert re.match(r"TransformError: scale has 3 weights but the batch has 2 samples", rank1[1]), rank1[1]


def rewrap(rank: int, world: int) -> list[float]:
    """Wrap a DDP model, remove the wrapper, train plainly, wrap again: after ``remove()`` DDP's
    buckets are averaged as DDP would (pergrad's communication hook stays, DDP keeps one for good),
    and the second wrapper carries its gradients again. Differences to the expected ``.grad``."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    reference = DistributedDataParallel(make_model())
    reference(x).square().sum().backward()
    model = make_model()
    ddp = DistributedDataParallel(model)
    out = []
    for wrapped in (True, False, True):
        psm = PerSampleModule(ddp, loss_reduction="sum") if wrapped else None
        if psm is not None:  # a clipping that changes nothing, so that pergrad holds DDP's buckets back
            psm.register_transform(ddp, transforms.clip_norm(1e9))
        (psm or ddp)(x).square().sum().backward()
        factor = world if wrapped else 1  # reduction="sum": the sum over ranks, DDP's mean otherwise
        for p, q in zip(model.parameters(), reference.module.parameters()):
            out.append(float((p.grad - q.grad * factor).abs().max()))
        model.zero_grad()
        if psm is not None:
            psm.remove()
    return out


def test_wrap_remove_wrap_again(pool2: Pool) -> None:
    for diffs in pool2.run(rewrap):
        assert max(diffs) < 1e-12, diffs
