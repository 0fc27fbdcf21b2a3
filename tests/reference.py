"""The reference every rule is checked against: torch.func on each sample's own loss."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap


def squared_error(out: Tensor, target: Tensor) -> Tensor:
    """A per-sample loss that works for any output shape: ``f_i = sum (out_i - t_i)^2``."""
    return (out - target).pow(2).sum()


def reference_grad_sample(
    model: nn.Module,
    x: Tensor,
    target: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor] = squared_error,
    batch_dim: int = 0,
) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: ``d f_i / d p`` for every trainable parameter, via vmap(grad)."""
    model = _without_buffer_updates(model)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def f(params: dict[str, Tensor], xi: Tensor, ti: Tensor) -> Tensor:
        out = functional_call(model, (params, frozen, buffers), (xi.unsqueeze(batch_dim),))
        return loss(out, ti.unsqueeze(batch_dim))

    try:
        return vmap(grad(f), in_dims=(None, batch_dim, batch_dim))(params, x, target)
    except RuntimeError as err:  # a kernel without a batching rule for these shapes (conv1d on length 1),
        # or none that works (nn.LSTM's and nn.GRU's fused kernels under vmap): one sample at a time
        if "must be contiguous" not in str(err) and "doesn't match the broadcast shape" not in str(err):
            raise
    grads = [grad(f)(params, x.select(batch_dim, i), target.select(batch_dim, i)) for i in range(x.shape[batch_dim])]
    return {k: torch.stack([g[k] for g in grads]) for k in params}


def clipped(ref: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    """Each sample's ``min(1, C / ||g_i||) g_i``, ``[B, *p.shape]``, the norm over every parameter of
    ``ref`` together (flat clipping, what ``transforms.clip_norm`` on the whole model computes)."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: g * factor.view(-1, *([1] * (g.dim() - 1))) for n, g in ref.items()}


def clipped_mean(ref: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    """``(1/B) sum_i min(1, C / ||g_i||) g_i`` for every parameter of ``ref`` (see ``clipped``)."""
    return {n: g.mean(0) for n, g in clipped(ref, bound).items()}


def _without_buffer_updates(model: nn.Module) -> nn.Module:
    """A copy whose training-mode instance norms do not update running statistics (vmap cannot
    write into unbatched buffers); their outputs use each sample's own statistics either way."""
    if not any(isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training:
            m.track_running_stats, m.running_mean, m.running_var = False, None, None
    return model


def run_pergrad(psm, x: Tensor, target: Tensor, loss_reduction: str = "mean", batch_dim: int = 0) -> Tensor:
    """One forward/backward through the wrapper with the batch loss matching ``loss_reduction``."""
    total = (psm(x) - target).pow(2).sum()
    loss_value = total / x.shape[batch_dim] if loss_reduction == "mean" else total
    loss_value.backward()
    return loss_value


def assert_close(actual: Tensor, expected: Tensor, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")


def held_bytes(psm: object) -> int:
    """Bytes of tensor memory that pergrad's own structures keep alive: everything reachable from
    the wrapper (its engine, hooks, pool, kept state) and every parameter's ``grad_sample``, counted
    once per storage; the model's own parameters, buffers and ``.grad`` are the user's, not counted.

    Found by walking containers, pergrad's objects, bound methods and pergrad's closures, so it
    counts whatever a structure holds, not what the pool says it holds."""
    model: nn.Module = psm.module  # type: ignore[attr-defined]
    users = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    users |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[object] = [vars(psm), *(vars(p) for p in model.parameters())]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in users:
                storages[storage.data_ptr()] = storage.nbytes()
            stack.extend(vars(obj).values())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif inspect.ismethod(obj):
            stack.append(obj.__self__)
        elif getattr(obj, "__module__", None) is not None and str(obj.__module__).startswith("pergrad"):
            if inspect.isfunction(obj):
                stack.extend(inspect.getclosurevars(obj).nonlocals.values())
            elif not isinstance(obj, type):
                stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
                stack.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))
    return sum(storages.values())


COLLECTIVES = {  # the argument holding the whole tensor a collective reduces, gathers or broadcasts
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "reduce_scatter": "input_list",
    "all_gather_single": "output_tensor",
    "all_gather_into_tensor": "output_tensor",
    "all_gather": "tensor_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "barrier": "",
}


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Every collective issued through ``torch.distributed`` (DDP's buckets go through the
    communication hook, FSDP2 and pergrad call these functions): how many, and the bytes of the
    whole tensor each reduces (all-reduce, reduce-scatter) or gathers (all-gather). Used by
    tests/test_distributed.py and benchmarks/distributed.py."""
    import torch.distributed as dist

    seen = {"bytes": 0, "calls": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            found = signature.bind(*args, **kwargs).arguments.get(COLLECTIVES[name], [])
            seen["bytes"] += sum(t.numel() * t.element_size() for t in (found if isinstance(found, list) else [found]))
            seen["calls"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
