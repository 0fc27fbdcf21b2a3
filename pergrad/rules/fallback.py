"""The generic fallback: per-sample gradients of any module's own parameters with torch.func.

Used for modules without a rule when the wrapper is built with ``fallback=True``. For each sample
it re-runs the module's forward on that sample's inputs (``functional_call``) and pulls the
sample's output gradient back to the module's own parameters (``vjp``), vectorised over the batch
with ``vmap``. Exact for any forward, at the cost of one more forward and backward of the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from ..errors import UnsupportedLayerError
from ..registry import LayerCall, default_registry


def _first_tensor(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    return next(o for o in out if isinstance(o, Tensor))


def fallback(layer: nn.Module, call: LayerCall, d: Tensor) -> dict[str, Tensor]:
    """``g_i = J_theta(f)(x_i)^T d_i`` for every trainable parameter theta of the module and its
    submodules (the module is one opaque unit: its children are not hooked on their own).

    Arguments that are tensors with the batch size on the batch dim are split per sample; every
    other argument (masks without a batch dim, flags, buffers) is shared by all samples. Only the
    module's first tensor output is differentiated: gradients reaching its other outputs are not
    seen (the wrapper's first-backward check reports it if they matter).
    """
    own = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}
    if not own:
        return {}
    batch, dim = d.shape[0], call.batch_dim

    def batched(x: Any) -> bool:
        return isinstance(x, Tensor) and x.dim() > dim and x.shape[dim] == batch

    arg_dims = tuple(dim if batched(x) else None for x in call.args)
    kwarg_dims = {k: dim if batched(v) else None for k, v in call.kwargs.items()}

    def one(params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], d_i: Tensor) -> dict[str, Tensor]:
        def unsqueeze(x: Any, in_dim: int | None) -> Any:
            return x.unsqueeze(dim) if in_dim is not None else x

        args = tuple(unsqueeze(x, i) for x, i in zip(args, arg_dims, strict=True))
        kwargs = {k: unsqueeze(v, kwarg_dims[k]) for k, v in kwargs.items()}

        def forward(p: dict[str, Tensor]) -> Tensor:
            return _first_tensor(functional_call(layer, p, args, kwargs))

        pulled = vjp(forward, params)
        out, pull = pulled[0], pulled[1]
        return pull(d_i.unsqueeze(dim).reshape(out.shape))[0]

    try:
        with torch.enable_grad():
            return vmap(one, in_dims=(None, arg_dims, kwarg_dims, 0))(own, call.args, call.kwargs, d)
    except Exception as err:  # torch.func cannot run every forward (nn.LSTM, data-dependent control flow)
        raise UnsupportedLayerError(
            f"the torch.func fallback could not compute per-sample gradients of a {type(layer).__name__} "
            f"({type(err).__name__}: {str(err)[:200]}). Register a rule for it with "
            f"@pergrad.register_rule({type(layer).__name__})."
        ) from err


# nn.MultiheadAttention uses out_proj's weight without calling out_proj, and its own projection
# weights inside one fused function: the exact per-sample gradient of the whole unit comes from
# torch.func, so it is supported as it is, without fallback=True.
default_registry.register(nn.MultiheadAttention, all_inputs=True, subtree=True)(fallback)
