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

from ..errors import BatchMixingError, UnsupportedLayerError
from ..registry import LayerCall, OutputGrads, default_registry, output_tensors


def _found_dim(x: Any, batch_dim: int, batch: int) -> int | None:
    """The wrapper's batch dim if ``x`` holds the batch there, else dim 0 if it does there (masks
    such as MultiheadAttention's key_padding_mask are batch-first in any layout), else None: shared."""
    if not isinstance(x, Tensor):
        return None
    for candidate in (batch_dim, 0):
        if x.dim() > candidate and x.shape[candidate] == batch:
            return candidate
    return None


def output_dims(layer: nn.Module, output: Any, batch_dim: int) -> tuple[int | None, ...]:
    """The batch dim of each tensor a module returns, found as for its inputs (``_found_dim``); the
    batch size is that of its first tensor on the wrapper's batch dim."""
    tensors = output_tensors(output)
    batch = tensors[0].shape[batch_dim]
    return tuple(_found_dim(t, batch_dim, batch) for t in tensors)


def fallback(
    layer: nn.Module,
    call: LayerCall,
    d: OutputGrads | Tensor,
    known_dims: dict[str, int | None] | None = None,
) -> dict[str, Tensor]:
    """``g_i = sum_k J_theta(f_k)(x_i)^T d_k,i`` for every trainable parameter theta of the module
    and its submodules (the module is one opaque unit: its children are not hooked on their own),
    over every tensor ``f_k`` the module returns that received a gradient (``output_tensors``: the
    attention weights of ``nn.MultiheadAttention`` beside its output, a custom module's tuple or
    dict): one ``vjp`` per sample of all of them.

    Arguments that are tensors with the batch size on the batch dim (or, failing that, on dim 0)
    are split per sample; every other argument (masks without a batch dim, flags) is shared by all
    samples. Where a shared tensor happens to have the batch size on that dim, it is split too:
    the first-backward check reports the mismatch if it changes the gradient. The outputs' batch
    dims are found the same way when the call is kept (``output_dims``, in ``call.output_dims``);
    an output without one that receives a gradient (a statistic of the whole batch) is an error.
    A bare tensor ``d`` is the gradient of the first tensor output alone (a rule registered without
    ``output_dims``).
    """
    own = {n: p.detach() for n, p in layer.named_parameters() if p.requires_grad}
    if not own:
        return {}
    grads, out_dims = ((d,), (call.batch_dim,)) if isinstance(d, Tensor) else (d, call.output_dims)
    present: list[tuple[int, int]] = []  # (output k, its batch dim) for the outputs with a gradient
    for k, (g, out_dim) in enumerate(zip(grads, out_dims, strict=True)):
        if g is not None and out_dim is None:
            raise BatchMixingError(
                f"output {k} of a {type(layer).__name__} (a tensor of shape {tuple(g.shape)}) has no batch "
                "dim but received a gradient: it does not belong to one sample (a statistic of the whole batch, "
                "such as an auxiliary loss averaged over it), so per-sample gradients through it are undefined. "
                "Compute such a term per sample, or keep it out of the loss"
            )
        if g is not None and out_dim is not None:
            present.append((k, out_dim))
    ds = tuple(g for g in grads if g is not None)
    batch, dim = ds[0].shape[0], call.batch_dim

    def batch_dim_of(x: Any) -> int | None:
        return _found_dim(x, dim, batch)

    names = list(inspect.signature(layer.forward).parameters)
    known = known_dims or {}

    def dim_of(name: str | None, x: Any) -> int | None:
        return known[name] if name in known and isinstance(x, Tensor) else batch_dim_of(x)

    arg_dims = tuple(dim_of(names[i] if i < len(names) else None, x) for i, x in enumerate(call.args))
    kwarg_dims = {k: dim_of(k, v) for k, v in call.kwargs.items()}

    def one(
        params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], d_i: tuple[Tensor, ...]
    ) -> dict[str, Tensor]:
        def unsqueeze(x: Any, in_dim: int | None) -> Any:
            return x.unsqueeze(in_dim) if in_dim is not None else x

        args = tuple(unsqueeze(x, i) for x, i in zip(args, arg_dims, strict=True))
        kwargs = {k: unsqueeze(v, kwarg_dims[k]) for k, v in kwargs.items()}

        def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
            outputs = output_tensors(functional_call(layer, p, args, kwargs))
            return tuple(outputs[k] for k, _ in present)

        pulled = vjp(forward, params)
        outs, pull = pulled[0], pulled[1]
        cotangents = tuple(
            g.unsqueeze(out_dim).reshape(o.shape) for (_, out_dim), g, o in zip(present, d_i, outs, strict=True)
        )
        return pull(cotangents)[0]

    try:
        with torch.enable_grad():
            return vmap(one, in_dims=(None, arg_dims, kwarg_dims, 0))(own, call.args, call.kwargs, ds)
    except Exception as err:  # torch.func cannot run every forward (nn.LSTM, data-dependent control flow)
        raise UnsupportedLayerError(
            f"the torch.func fallback could not compute per-sample gradients of a {type(layer).__name__} "
            f"({type(err).__name__}: {str(err)[:200]}). Register a rule for it with "
            f"@pergrad.register_rule({type(layer).__name__})."
        ) from err


# nn.MultiheadAttention uses out_proj's weight without calling out_proj, and its own projection
# weights inside one fused function: the exact per-sample gradient of the whole unit comes from
# torch.func, so it is supported as it is, without fallback=True.
def _attention_dims(layer: nn.Module, output: Any, batch_dim: int) -> tuple[int | None, ...]:
    """The attention output has the batch on the wrapper's batch dim; the attention weights
    (``need_weights=True``: ``[B, L, S]``, or ``[B, heads, L, S]``) on dim 0 in any layout."""
    return (batch_dim, 0)[: len(output_tensors(output))]


def multihead_attention(layer: nn.Module, call: LayerCall, d: OutputGrads | Tensor) -> dict[str, Tensor]:
    """The fallback, told that ``key_padding_mask`` is batch-first in any layout and that a 2-D
    ``attn_mask`` is shared by all samples (a 3-D one holds ``B * num_heads`` masks: not split)."""
    attn_mask = call.kwargs.get("attn_mask", call.args[5] if len(call.args) > 5 else None)
    if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:
        raise UnsupportedLayerError(
            "nn.MultiheadAttention with a 3-D attn_mask ([B * num_heads, L, S]) is not split per sample by "
            "pergrad; pass a 2-D attn_mask and a key_padding_mask instead"
        )
    return fallback(layer, call, d, {"key_padding_mask": 0, "attn_mask": None})


default_registry.register(nn.MultiheadAttention, all_inputs=True, subtree=True, output_dims=_attention_dims)(
    multihead_attention
)
