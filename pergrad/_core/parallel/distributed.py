"""Several processes: ``DistributedDataParallel`` and FSDP2 (``torch.distributed.fsdp.fully_shard``).

In both, each rank runs the whole model (FSDP2: each layer with its parameters all-gathered for its
forward and backward) on its OWN samples. So every per-sample quantity -- ``g_i``, its norms, the
clipping factors, ``sum_i c_i g_i`` -- is local: computing it needs no communication at all. What
crosses the wire is what crosses it without pergrad: each gradient once, as DDP's all-reduce or
FSDP2's reduce-scatter carries it. Only where that communication happens differs.

DDP (``DataParallel``). DDP's reducer copies each parameter's ``.grad`` into a flat bucket when its
``AccumulateGrad`` has run and all-reduces a bucket once all its parameters are in, during the
backward; a callback it queues at the end waits for every bucket and writes ``.grad`` back. pergrad's
part of ``.grad`` is known only at the end of the backward (a clipping factor needs every layer's
per-sample norm). pergrad registers DDP's communication hook:

- a bucket holding only parameters whose ``.grad`` is autograd's is all-reduced at once, as DDP would
  (divided by the world size, summed): the usual overlap with the rest of the backward;
- a bucket holding a parameter whose ``.grad`` pergrad may write (``Engine.may_write``: the same
  buckets on every rank, so every rank issues the same collectives in the same order) is held back.
  pergrad's end-of-backward work runs in a callback queued before DDP's (by pergrad's first hook of
  the backward: at the latest, its pre-hook of the first ``AccumulateGrad``, whose post-hook is
  where DDP queues its own), writes each reduction into the parameter's place in its bucket -- where ``.grad``
  would get it -- and then all-reduces the held-back buckets. DDP's callback finds them done.

So every gradient is all-reduced exactly once, in DDP's buckets: the bytes of plain DDP, no
collective per parameter. Detached weights (``detach.py``) are *touched*: their ``AccumulateGrad``
still runs, with a zero, so the reducer sees every parameter. With ``accumulate="samples"`` each
parameter's place in a bucket is multiplied by ``size x`` the samples its local running mean holds
over their total on every rank (one all-reduce of one number per parameter per backward) before the
bucket is averaged over ranks, so ``.grad`` is the mean over every sample of every rank, whatever the
batch sizes.

"All-reduced" above is DDP's reduction of a bucket, the mean over ranks: the user's own
communication hook where there is one (``fp16_compress_hook``, PowerSGD, ...), which so gets every
bucket with the transformed gradients in it, and whose result is what lands in ``.grad``. DDP's reducer
takes one hook, for good: a hook the user registered before pergrad saw the DDP model is taken off by
giving the model a new reducer (as DDP builds one when unpickled), and pergrad's calls it; one
registered later goes to pergrad's (``register_comm_hook`` of that DDP model is pergrad's from then on,
and stays so after ``remove()``: DDP keeps pergrad's hook, which then reduces with the user's).
Built-in hooks, registered in C++, leave no trace pergrad could call: refused.

The DDP model is the wrapped model (``PerSampleModule(DDP(net))``), or is found at its first
forward, before the first backward that needs it, when DDP was applied after wrapping, to the wrapped
model or to a parent of it (``PerSampleModule(net)``, then ``DDP(net)`` or ``DDP(parent)``: the order
Lightning's DDP strategy imposes): DDP's forward records itself as the running one while it calls the
module it holds, and the wrapped model's forward pre-hook looks there (``running_ddp``). Parameters of
the parent outside the wrapped model keep DDP's own reduction.

FSDP2 (``Sharded``). Parameters are ``DTensor`` shards; for a layer's forward and backward FSDP2 puts
unsharded parameters (plain tensors) in the layer, and after the layer's backward reduce-scatters
their gradients into the shards' ``.grad``. pergrad keys everything by the sharded parameters
(``canonical``), hooks the unsharded ones' ``AccumulateGrad`` (created at the first all-gather) and,
for parameters pergrad writes, drops autograd's unsharded gradient there, so FSDP2 sends nothing for
them. At the end of the backward pergrad reduce-scatters its full-size reductions itself, several
parameters per collective, in FSDP2's layout (dim 0 chunked over the ranks, padded), and writes each
rank's shard into ``.grad``: the bytes FSDP2 would have sent for them. Transformed weights run
detached (``detach.py``), so autograd computes no unsharded weight gradient for them at all.
Under ``set_requires_gradient_sync(False)`` the reductions are kept (added up, as FSDP2 keeps its
unsharded gradients) and sent with the next synchronised backward's. Every rank sends the same
reduce-scatters, with zeros for what its own backward did not produce (an empty batch, an error
raised after the collectives), so that no rank waits for another. The full-size reductions of the
transformed parameters live from the end of the backward to their reduce-scatter: one gradient of
their size per rank, on top of FSDP2's sharded memory.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from pergrad._core.backward.state import Backward
from pergrad._core.parallel.world import Host, World
from pergrad._core.shortcuts.followed import eager_hook
from pergrad.errors import PergradError

REDUCE_SCATTER_BYTES = 25 * 2**20  # the most of pergrad's gradients one FSDP2 reduce-scatter carries


def world_for(model: nn.Module, engine: Host, accumulate: str) -> World | None:
    """The world ``model`` runs in: DDP, FSDP2 or one process (None)."""
    if isinstance(model, DistributedDataParallel):
        return DataParallel(model, engine)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no FSDP2 module exists unless it is imported
    if fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules()):
        if accumulate == "samples":
            raise ValueError(
                "accumulate='samples' is not supported for FSDP2 (fully_shard) models yet: use "
                "accumulate='backward' with reduction='sum' (.grad is then the sum over every rank's samples; "
                "divide it by their total count), or DistributedDataParallel"
            )
        return Sharded(model, engine)
    return None


# -- DistributedDataParallel ---------------------------------------------------------------------


def _average(bucket: dist.GradBucket, group: Any, size: int) -> torch.futures.Future[Tensor]:
    """DDP's own reduction of a bucket: the mean over ranks."""
    buffer = bucket.buffer().div_(size)
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


class _CommHook:
    """DDP's communication hook, registered once per DDP model (DDP takes one, for good): the wrapper
    that currently owns the model handles the buckets; without one (``psm.remove()``) each bucket gets
    DDP's reduction, ``reduce``. The user's own hook (``ddp.register_comm_hook``, before or after
    wrapping) is that reduction: it gets every bucket, pergrad's held-back ones once they hold the
    transformed gradients."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.world: DataParallel | None = None
        self.user: tuple[Callable[[Any, dist.GradBucket], torch.futures.Future[Tensor]], Any] | None = None
        self.fn = lambda state, bucket: self(bucket)  # what DDP registers (DDP reads its __qualname__)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        world = self.world
        if world is None or world.engine.closed:
            return self.reduce(bucket)
        return world.on_bucket(bucket)

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """The mean over ranks of the bucket, as DDP computes it: the user's hook, or an all-reduce."""
        if self.user is not None:
            hook, state = self.user
            return hook(state, bucket)
        return _average(bucket, self.group, self.size)

    def register_user_hook(
        self, ddp: DistributedDataParallel, state: Any, hook: Callable[..., torch.futures.Future[Tensor]]
    ) -> None:
        """``ddp.register_comm_hook(state, hook)`` once pergrad's hook is registered: ``hook`` becomes
        the reduction of every bucket (DDP's own checks of ``hook`` first)."""
        if self.user is not None:
            raise PergradError(
                f"this DistributedDataParallel model has a communication hook already ({_qualname(self.user[0])}); "
                "DDP takes one. Register one hook."
            )
        DistributedDataParallel._check_comm_hook(ddp, hook)
        self.user = (hook, state)
        ddp._comm_hooks.append((hook, state))


def _qualname(hook: Any) -> str:
    return getattr(hook, "__qualname__", type(hook).__name__)


def _builtin_refused(comm_hook_type: Any) -> None:
    raise PergradError(
        f"a built-in DDP communication hook ({comm_hook_type}) cannot be combined with pergrad's, which carries the "
        "transformed gradients in DDP's buckets: register its Python equivalent with ddp.register_comm_hook "
        "(torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook or fp16_compress_hook), which "
        "pergrad composes with its own."
    )


def _rebuild_reducer(ddp: DistributedDataParallel, in_forward: bool) -> None:
    """Give ``ddp`` a new reducer, without the communication hook the user registered on the old one
    (a reducer takes one hook, for good), as DDP builds it when it is unpickled. ``in_forward``: DDP's
    forward is running and prepared the old reducer for it; prepare the new one alike."""
    try:
        ddp._remove_autograd_hooks()  # the old reducer's, on every parameter's AccumulateGrad
        parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(parameters)
        ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    except AttributeError as err:
        raise PergradError(
            f"this torch's DistributedDataParallel differs from the one pergrad was written for ({err}), so pergrad "
            "cannot take over the communication hook registered before wrapping. Register the hook after wrapping "
            "(PerSampleModule(ddp), then ddp.register_comm_hook(...)): pergrad composes with it."
        ) from err
    if in_forward and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        ddp.reducer.prepare_for_forward()


def running_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` model whose forward is running and calls ``model`` (``model`` or
    a parent of it was put in DDP after wrapping, as Lightning's DDP strategy does), or None."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or not any(m is model for m in ddp.module.modules()):
        return None
    return cast(DistributedDataParallel, ddp)


def _bucket_params(bucket: dist.GradBucket) -> list[nn.Parameter]:
    return cast(list[nn.Parameter], bucket.parameters())


class _Held:
    """A bucket held back until pergrad has written its part, and the future DDP waits on."""

    def __init__(self, bucket: dist.GradBucket) -> None:
        self.bucket = bucket
        self.params = _bucket_params(bucket)
        self.views: list[Tensor] = bucket.gradients()  # each parameter's place in bucket.buffer()
        self.future: torch.futures.Future[Tensor] = torch.futures.Future()


class DataParallel(World):
    """A ``DistributedDataParallel`` model: pergrad's part of ``.grad`` travels in DDP's buckets.

    ``late``: DDP was applied after wrapping (to the wrapped model or a parent of it), and its
    forward is running: pergrad found it there, before the first backward that needs it."""

    finish_early = True
    detaches = True
    touches = True

    def __init__(self, ddp: DistributedDataParallel, engine: Host, late: bool = False) -> None:
        if getattr(ddp, "static_graph", False):
            raise PergradError(
                "DistributedDataParallel(static_graph=True) is not supported: its first backward all-reduces "
                "every bucket in a callback that runs before pergrad's part of .grad is known. Construct the DDP "
                "model without static_graph (pergrad keeps every parameter in the graph, so DDP needs neither "
                "static_graph nor find_unused_parameters for it)."
            )
        self.ddp, self.engine, self.late = ddp, engine, late
        self.group = ddp.process_group
        self.size = dist.get_world_size(self.group)
        self._state: Backward | None = None  # the backward the buckets below belong to
        self._held: list[_Held] = []
        self._slots: dict[nn.Parameter, Tensor] = {}
        self._local: dict[nn.Parameter, float] = {}  # accumulate="samples": this rank's samples per .grad
        self._total: dict[nn.Parameter, float] = {}  # and every rank's
        self.hook: _CommHook | None = None

    def install(self) -> None:
        ddp = self.ddp
        hook = ddp.__dict__.get("_pergrad_comm_hook")
        if hook is None:
            hook = _CommHook(self.group, self.size)
            user = list(ddp._comm_hooks)
            if user:  # the user's hook holds the reducer: a new one takes pergrad's, which calls the user's
                _rebuild_reducer(ddp, in_forward=self.late)
            try:
                ddp.register_comm_hook(None, hook.fn)
            except RuntimeError as err:  # a built-in hook, registered in C++, leaves no trace in Python
                raise PergradError(
                    f"pergrad could not register its DDP communication hook ({err}): a built-in hook "
                    "(ddp._register_builtin_comm_hook) is registered. Register its Python equivalent with "
                    "ddp.register_comm_hook instead (torch.distributed.algorithms.ddp_comm_hooks.default_hooks), "
                    "which pergrad composes with its own."
                ) from err
            if user:
                hook.user = user[0]
            # later hooks of the user's compose with pergrad's too (DDP's reducer would refuse them)
            ddp.__dict__["register_comm_hook"] = functools.partial(hook.register_user_hook, ddp)
            ddp.__dict__["_register_builtin_comm_hook"] = _builtin_refused
            ddp.__dict__["_pergrad_comm_hook"] = hook
        if hook.world is not None and hook.world is not self and not hook.world.engine.closed:
            raise PergradError(
                "this DistributedDataParallel model holds two models wrapped by PerSampleModule; pergrad carries "
                "the transformed gradients of one in DDP's buckets. Wrap one module that holds both (or the DDP "
                "model itself) in one PerSampleModule."
            )
        hook.world, self.hook = self, hook

    def close(self) -> None:
        if self.hook is not None and self.hook.world is self:
            self.hook.world = None

    def contribution(self, reduced: Tensor) -> Tensor:
        # DDP averages over ranks; a sum over every rank's samples is the average of size x each sum
        return reduced * self.size if self.engine.options.reduction == "sum" else reduced

    def slot(self, param: nn.Parameter, state: Backward) -> Tensor | None:
        return self._slots.get(param) if state is self._state else None

    def samples(self, param: nn.Parameter, local: float, state: Backward) -> float:
        if state is self._state and param in self._total:  # this backward all-reduced: every rank's share
            return self._total[param] / self.size
        return local

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """DDP's bucket is ready (every ``AccumulateGrad`` of its parameters ran)."""
        engine = self.engine
        state = engine.backward_state()
        if state is not self._state:  # the first bucket of this backward
            self._state, self._held, self._slots = state, [], {}
            if engine.options.running_mean:
                self._count(state)
        if any(engine.may_write(p) for p in _bucket_params(bucket)):
            held = _Held(bucket)
            self._held.append(held)
            self._slots.update(zip(held.params, held.views))
            return held.future
        return self._reduce(bucket, _bucket_params(bucket), bucket.gradients())

    def flush(self, state: Backward, failed: bool) -> None:
        """pergrad wrote its part into the held-back buckets: reduce them, in DDP's order."""
        held, self._held, self._slots = self._held, [], {}
        for h in held:
            try:
                done = self._reduce(h.bucket, h.params, h.views)
            except Exception as err:  # DDP's callback waits on the future: never leave it pending
                h.future.set_exception(err)  # type: ignore[arg-type]  # (torch's stub is wrong)
                continue
            done.add_done_callback(functools.partial(_relay, future=h.future))

    def _reduce(
        self, bucket: dist.GradBucket, params: list[nn.Parameter], views: list[Tensor]
    ) -> torch.futures.Future[Tensor]:
        """DDP's reduction of the bucket (the mean over ranks: the user's hook, if any). Running means:
        ``sum_r n_r R_r / sum_r n_r`` (``n_r`` the samples rank r's mean ``R_r`` holds) is the mean over
        ranks of ``R_r`` times ``size n_r / sum_r n_r``; a parameter outside the wrapped model keeps DDP's mean."""
        assert self.hook is not None
        if self.engine.options.running_mean:
            for p, view in zip(params, views):
                total = self._total.get(p)
                if total is not None:
                    view.mul_(self.size * self._local[p] / total) if total else view.zero_()
        return self.hook.reduce(bucket)

    def _count(self, state: Backward) -> None:
        """How many samples each parameter's ``.grad`` will average on this rank and on all (one
        all-reduce of one number per parameter), before the first bucket is sent."""
        engine = self.engine
        params = list(engine.param_names)  # the same order on every rank
        local = [
            (state.written.prior[p] if p in state.written.prior else engine.samples_in_grad(p))
            + engine.new_samples(p, state)
            for p in params
        ]
        total = torch.tensor(local, dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        self._local = dict(zip(params, local))
        self._total = dict(zip(params, total.tolist()))


def _relay(done: torch.futures.Future[Any], future: torch.futures.Future[Tensor]) -> None:
    try:
        future.set_result(done.value())
    except Exception as err:
        future.set_exception(err)  # type: ignore[arg-type]


# -- FSDP2 ---------------------------------------------------------------------------------------


class Sharded(World):
    """A model sharded with FSDP2's ``fully_shard``: pergrad reduce-scatters its part itself."""

    detaches = True  # a detached weight gets no unsharded gradient: FSDP2 sends nothing for it

    def __init__(self, model: nn.Module, engine: Host) -> None:
        from torch.distributed.tensor import DTensor, Shard

        self.model, self.engine = model, engine
        meshes = set()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                where = "not a DTensor" if not isinstance(p, DTensor) else f"placements {tuple(p.placements)}"
                raise PergradError(
                    f"parameter {name!r} is {where}: pergrad supports FSDP2 models whose every trainable parameter "
                    "is sharded by fully_shard on dim 0 over a 1-D mesh (no HSDP, tensor parallelism or "
                    "shard_placement_fn)."
                )
            meshes.add(p.device_mesh)
        if len(meshes) > 1:
            raise PergradError("pergrad supports FSDP2 models sharded over one device mesh")
        mesh = next(iter(meshes), None)
        self.group = None if mesh is None else mesh.get_group()
        self.size = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        self._canonical: dict[nn.Parameter, nn.Parameter] = {}
        self._hooked: dict[nn.Parameter, list[Any]] = {}  # unsharded parameter -> its hooks and node
        self._pending: dict[nn.Parameter, Tensor] = {}
        self._forward: RemovableHandle | None = None

    def install(self) -> None:
        # after each forward every used group was all-gathered once: its unsharded parameters exist
        self._forward = self.model.register_forward_hook(lambda module, args, output: self._refresh())
        self._refresh()

    def close(self) -> None:
        if self._forward is not None:
            self._forward.remove()
        for handles in self._hooked.values():
            for handle in handles[:-1]:
                handle.remove()
        self._hooked.clear()

    def canonical(self, param: nn.Parameter) -> nn.Parameter:
        found = self._canonical.get(param)
        if found is None:
            self._refresh()
            found = self._canonical.setdefault(param, param)
        return found

    def _param_groups(self) -> Iterator[Any]:
        """FSDP2's parameter groups (one per ``fully_shard`` call with parameters of its own)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                yield from module._get_fsdp_state()._fsdp_param_groups

    def _fsdp_params(self) -> Iterator[Any]:
        """FSDP2's record of each sharded parameter (``sharded_param``, ``_unsharded_param``)."""
        for group in self._param_groups():
            yield from group.fsdp_params

    def _refresh(self) -> None:
        """Map each unsharded parameter FSDP2 has made to its shard, and hook its ``AccumulateGrad``."""
        try:
            records = [(fp.sharded_param, getattr(fp, "_unsharded_param", None)) for fp in self._fsdp_params()]
        except AttributeError as err:
            raise PergradError(
                f"this torch's FSDP2 internals differ from those pergrad was written for: {err}"
            ) from err
        for sharded, unsharded in records:
            self._canonical[sharded] = sharded
            if unsharded is not None and unsharded not in self._hooked:
                self._canonical[unsharded] = sharded
                if unsharded.requires_grad and sharded in self.engine.param_names:
                    self._hook(unsharded, sharded)

    def _hook(self, unsharded: nn.Parameter, sharded: nn.Parameter) -> None:
        engine = self.engine
        node = get_gradient_edge(unsharded).node  # held: autograd caches it weakly

        @eager_hook
        def before(grads: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
            new = engine.on_accumulate(sharded, grads[0])
            return None if new is None else (new,)

        @eager_hook
        def after(p: Tensor) -> None:
            if not engine.closed and sharded in engine.transformed:
                p.grad = None  # pergrad sends this gradient: FSDP2 skips a parameter without one

        self._hooked[unsharded] = [
            node.register_prehook(before),
            unsharded.register_post_accumulate_grad_hook(after),
            node,
        ]

    def take(self, param: nn.Parameter, reduced: Tensor, state: Backward) -> bool:
        # a backward under set_requires_gradient_sync(False) left its part here: add, as FSDP2 does
        previous = self._pending.get(param)
        self._pending[param] = reduced if previous is None else previous + reduced
        return True

    def _syncing(self) -> bool:
        """Whether FSDP2 reduce-scatters this backward's gradients (``set_requires_gradient_sync``)."""
        flags = {group.reduce_grads for group in self._param_groups()}
        if len(flags) > 1:
            raise PergradError(
                "some of this FSDP2 model's modules reduce their gradients in this backward and some do not "
                "(set_requires_gradient_sync(False) on part of the model): pergrad reduces the transformed "
                "gradients of the whole model together. Call set_requires_gradient_sync on the root module."
            )
        return flags != {False}

    def flush(self, state: Backward, failed: bool) -> None:
        """Reduce-scatter pergrad's part of ``.grad`` into the shards. Every rank sends the same
        collectives, also when its own end-of-backward work failed (then with zeros for what is
        missing), so that no rank waits for another; the error is raised afterwards."""
        if not self._syncing():
            return  # set_requires_gradient_sync(False): kept in _pending, added at the next synced backward
        pending, self._pending = self._pending, {}
        # the transformed parameters this backward reached (on every rank alike: FSDP2 needs that too),
        # in the wrapper's order, at most REDUCE_SCATTER_BYTES per collective
        params = [
            p
            for p in self.engine.param_names
            if p in self.engine.transformed and (p in state.autograd.reached or p in pending)
        ]
        chunk: list[nn.Parameter] = []
        size = 0
        for p in params:
            if chunk and (size >= REDUCE_SCATTER_BYTES or (p.dtype, p.device) != (chunk[0].dtype, chunk[0].device)):
                self._reduce_scatter(chunk, pending, state)
                chunk, size = [], 0
            chunk.append(p)
            size += p.numel() * p.element_size()
        if chunk:
            self._reduce_scatter(chunk, pending, state)

    def _reduce_scatter(self, params: list[nn.Parameter], grads: dict[nn.Parameter, Tensor], state: Backward) -> None:
        """One reduce-scatter of the full gradients of ``params`` into this rank's shards, laid out as
        FSDP2 lays out its own: rank r's part holds rows [r*c, (r+1)*c) of each gradient's dim 0 (c =
        ceil(dim0 / world size)), zero-padded to c rows. ``.grad`` gets the sum over ranks
        (``reduction="sum"``) or the mean over ranks of each rank's mean (``"mean"``, as FSDP2 averages)."""
        from torch.distributed.tensor import DTensor

        world = self.size
        parts = []
        for p in params:
            rows = math.ceil(p.shape[0] / world)
            g = grads.get(p)
            g = torch.zeros(p.shape, dtype=p.dtype, device=p.device) if g is None else g.to(p.dtype)
            g = torch.nn.functional.pad(g.reshape(p.shape[0], -1), (0, 0, 0, rows * world - p.shape[0]))
            parts.append(g.reshape(world, -1))
        flat = torch.cat(parts, dim=1)
        out = flat.new_empty(flat.shape[1])
        dist.reduce_scatter_single(out, flat.view(-1), op=dist.ReduceOp.SUM, group=self.group)
        if self.engine.options.reduction == "mean":
            out.div_(world)
        offset = 0
        for p, part in zip(params, parts):
            local_shape = p.to_local().shape  # type: ignore[attr-defined]
            local = out[offset : offset + local_shape.numel()].view(local_shape)
            offset += part.shape[1]
            shard = DTensor.from_local(
                local,
                p.device_mesh,  # type: ignore[attr-defined]
                p.placements,  # type: ignore[attr-defined]
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            if p.grad is None or p in state.autograd.overwrite:
                p.grad = shard
            else:
                p.grad.add_(shard)
