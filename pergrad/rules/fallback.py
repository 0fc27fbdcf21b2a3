"""The generic fallback: per-sample gradients of any module's own parameters with torch.func.

Used for modules without a rule when the wrapper is built with ``fallback=True``. For each sample
it re-runs the module's forward on that sample's inputs (``functional_call``) and pulls the
sample's output gradient back to the module's own parameters (``vjp``), vectorised over the batch
with ``vmap``. Exact for any forward, at the cost of one more forward and backward of the module.
"""

from __future__ import annotations

import inspect
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


def fallback(
    layer: nn.Module, call: LayerCall, d: Tensor, known_dims: dict[str, int | None] | None = None
) -> dict[str, Tensor]:
    """``g_i = J_theta(f)(x_i)^T d_i`` for every trainable parameter theta of the module and its
    submodules (the module is one opaque unit: its children are not hooked on their own).

    Arguments that are tensors with the batch size on the batch dim (or, failing that, on dim 0)
    are split per sample; every other argument (masks without a batch dim, flags) is shared by all
    samples. Where a shared tensor happens to have the batch size on that dim, it is split too:
    the first-backward check reports the mismatch if it changes the gradient. Only the
    module's first tensor output is differentiated: gradients reaching its other outputs are not
    seen (the wrapper's first-backward check reports it if they matter).
    """
    own = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}
    if not own:
        return {}
    batch, dim = d.shape[0], call.batch_dim

    def batch_dim_of(x: Any) -> int | None:
        """The wrapper's batch dim if it holds the batch, else dim 0 if that does (masks such as
        MultiheadAttention's key_padding_mask are batch-first in any layout), else shared."""
        if not isinstance(x, Tensor):
            return None
        for candidate in (dim, 0):
            if x.dim() > candidate and x.shape[candidate] == batch:
                return candidate
        return None

    names = list(inspect.signature(layer.forward).parameters)
    known = known_dims or {}

    def dim_of(name: str | None, x: Any) -> int | None:
        return known[name] if name in known and isinstance(x, Tensor) else batch_dim_of(x)

    arg_dims = tuple(dim_of(names[i] if i < len(names) else None, x) for i, x in enumerate(call.args))
    kwarg_dims = {k: dim_of(k, v) for k, v in call.kwargs.items()}

    def one(params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], d_i: Tensor) -> dict[str, Tensor]:
        def unsqueeze(x: Any, in_dim: int | None) -> Any:
            return x.unsqueeze(in_dim) if in_dim is not None else x

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
def multihead_attention(layer: nn.Module, call: LayerCall, d: Tensor) -> dict[str, Tensor]:
    """The fallback, told that ``key_padding_mask`` is batch-first in any layout and that a 2-D
    ``attn_mask`` is shared by all samples (a 3-D one holds ``B * num_heads`` masks: not split)."""
    attn_mask = call.kwargs.get("attn_mask", call.args[5] if len(call.args) > 5 else None)
    if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
        raise UnsupportedLayerError(
            "nn.MultiheadAttention with a 3-D attn_mask ([B * num_heads, L, S]) is not split per sample by "
            "pergrad; pass a 2-D attn_mask and a key_padding_mask instead"
        )
    return fallback(layer, call, d, {"key_padding_mask": 0, "attn_mask": None})


default_registry.register(nn.MultiheadAttention, all_inputs=True, subtree=True)(multihead_attention)
