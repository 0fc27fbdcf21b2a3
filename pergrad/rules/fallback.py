"""The generic fallback: per-sample gradients of any module's own parameters with torch.func.

Used for modules without a rule when the wrapper is built with ``fallback=True``. For each sample
it re-runs the module's forward on that sample's inputs (``_own_forward``) and pulls the
sample's output gradient back to the module's own parameters (``vjp``), vectorised over the batch
with ``vmap``. Exact for any forward, at the cost of one more forward and backward of the module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap
from torch.nn.utils.stateless import _reparametrize_module  # (torch is pinned: a private name)

from pergrad._core.memory.layout import recorded

from ..errors import BatchMixingError, PergradError, UnsupportedLayerError
from ..registry import LayerCall, OutputGrads, default_registry, output_tensors


def _own_forward(layer: nn.Module, params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``layer.forward(*args, **kwargs)`` with ``params`` in place of its parameters: ``functional_call``
    without the layer's own forward hooks and pre-hooks, nor those registered for every module. What they
    did in the real call is outside the layer: its kept input is the one its pre-hooks handed the forward,
    its output gradient is caught on its forward's own output."""
    with _reparametrize_module(layer, params, tie_weights=True):
        return layer.forward(*args, **kwargs)


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
    """The first tensor a module returns has the batch on the wrapper's batch dim (the batch size is
    its size there); the others are handed over as returned (None), and ``fallback`` finds where
    each holds the batch from its shape for one sample alone (``h_n``-like states ``[layers, B, H]``
    of a module whose inputs are batch-first, a statistic of the whole batch without one)."""
    return (batch_dim, *(None for _ in output_tensors(output)[1:]))


def _sample_dim(shape: tuple[int, ...], alone: tuple[int, ...], batch: int, preferred: tuple[int, ...]) -> int | None:
    """The dim of an output of shape ``shape`` (for the batch) that holds one slice per sample: the
    one whose size is ``batch`` there and 1 in the output's shape ``alone`` for one sample run alone,
    every other dim equal. Unique for ``batch > 1``; for a batch of one, the first of ``preferred``
    that fits (all give the same slice)."""
    if len(shape) != len(alone):
        return None
    fits = [
        j
        for j in range(len(shape))
        if shape[j] == batch and alone[j] == 1 and shape[:j] + shape[j + 1 :] == alone[:j] + alone[j + 1 :]
    ]
    return min(fits, key=lambda j: (preferred.index(j) if j in preferred else len(preferred), j), default=None)


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
    the first-backward check reports the mismatch if it changes the gradient.

    ``d_k,i`` is the slice of output k's gradient on the dim where the output of the whole batch has
    size B and the output of sample i run alone (inside the ``vmap``) has size 1, every other dim
    equal (``_sample_dim``): exact wherever the batch is (``[layers, B, H]`` states with batch-first
    inputs), and an error for an output without such a dim that receives a gradient (a statistic of
    the whole batch). ``call.output_dims`` says where the engine put each batch (dim 0) or that it
    handed the gradient over as returned (None); a dim given there must be the one found. A bare
    tensor ``d`` is the gradient of the first tensor output alone (a rule registered without
    ``output_dims``).
    """
    # create_graph=True: g_i differentiable, so the parameters stay in the outer graph
    own = {n: p if recorded() else p.detach() for n, p in layer.named_parameters() if p.requires_grad}
    if not own:
        return {}
    grads, out_dims = ((d,), (call.batch_dim,)) if isinstance(d, Tensor) else (d, call.output_dims)
    arrived = [(k, g, out_dims[k]) for k, g in enumerate(grads) if g is not None]
    present = [k for k, _, _ in arrived]
    # each gradient as the module returned it; its batch dim is found per sample inside vmap
    full = tuple(_returned(g, out_dim) for _, g, out_dim in arrived)
    given = tuple(out_dim for _, _, out_dim in arrived)
    batch = next((g.shape[0] for _, g, out_dim in arrived if out_dim is not None), call.batch_size)
    if batch is None:
        raise TypeError("fallback: LayerCall.batch_size is needed when no output has a batch dim")
    dim = call.batch_dim

    def batch_dim_of(x: Any) -> int | None:
        return _found_dim(x, dim, batch)

    names = list(inspect.signature(layer.forward).parameters)
    known = known_dims or {}

    def dim_of(name: str | None, x: Any) -> int | None:
        return known[name] if name in known and isinstance(x, Tensor) else batch_dim_of(x)

    arg_dims = tuple(dim_of(names[i] if i < len(names) else None, x) for i, x in enumerate(call.args))
    kwarg_dims = {k: dim_of(k, v) for k, v in call.kwargs.items()}

    def one(
        params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], sample: Tensor
    ) -> dict[str, Tensor]:
        def unsqueeze(x: Any, in_dim: int | None) -> Any:
            return x.unsqueeze(in_dim) if in_dim is not None else x

        args = tuple(unsqueeze(x, i) for x, i in zip(args, arg_dims, strict=True))
        kwargs = {k: unsqueeze(v, kwarg_dims[k]) for k, v in kwargs.items()}

        def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
            outputs = output_tensors(_own_forward(layer, p, args, kwargs))
            return tuple(outputs[k] for k in present)

        pulled = vjp(forward, params)
        outs, pull = pulled[0], pulled[1]
        cotangents = []
        for k, g, o, promised in zip(present, full, outs, given, strict=True):
            shape, alone = tuple(g.shape), tuple(o.shape)
            found = _sample_dim(shape, alone, batch, (dim, 0) if promised is None else (promised,))
            if found is None or (promised is not None and found != promised):
                raise BatchMixingError(
                    f"output {k} of a {type(layer).__name__} has shape {shape} for the batch of {batch} samples but "
                    f"{alone} for one sample run alone: "
                    + (
                        f"its batch is not on dim {promised}, where its rule's output_dims put it"
                        if found is not None
                        else "no dim holds one slice per sample, yet it received a gradient. It does not belong to "
                        "one sample (a statistic of the whole batch, such as an auxiliary loss averaged over it), so "
                        "per-sample gradients through it are undefined. Compute such a term per sample, or keep it "
                        "out of the loss"
                    )
                )
            cotangents.append(g.index_select(found, sample.unsqueeze(0)))
        return pull(tuple(cotangents))[0]

    index = torch.arange(batch, device=full[0].device)
    try:
        with torch.enable_grad():
            return vmap(one, in_dims=(None, arg_dims, kwarg_dims, 0))(own, call.args, call.kwargs, index)
    except PergradError:
        raise
    except Exception as err:  # torch.func cannot run every forward (nn.LSTM, data-dependent control flow)
        if "randomness" in str(err):  # vmap refuses a random draw: the re-run would not draw the forward's
            raise UnsupportedLayerError(
                f"the forward of this {type(layer).__name__} draws random numbers (dropout in training mode, "
                "F.dropout, torch.rand, ...): the torch.func fallback computes its per-sample gradients by running "
                "that forward again for each sample, which would draw new ones, not those of the forward that ran, "
                "so the gradients would not be this forward's. Turn the draw off while training with pergrad "
                "(dropout p=0, or eval mode), move it out of the module (a dropout applied to the module's output, "
                "between hooked layers, is fine), or register a rule for the module."
            ) from err
        raise UnsupportedLayerError(
            f"the torch.func fallback could not compute per-sample gradients of a {type(layer).__name__} "
            f"({type(err).__name__}: {str(err)[:200]}). Register a rule for it with "
            f"@pergrad.register_rule({type(layer).__name__})."
        ) from err


#: the rules that compute a layer's per-sample gradients by running its forward again, in the backward
RERUNNING: set[Callable[..., Any]] = set()

_RANDOM = (nn.modules.dropout._DropoutNd, nn.MultiheadAttention, nn.RNNBase, nn.RReLU)


def random_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``layer`` (name ``""``) and its submodules whose forward may draw random numbers (dropout, RReLU)."""
    return [(name, m) for name, m in layer.named_modules() if isinstance(m, _RANDOM)]


def drawing(module: nn.Module) -> tuple[str, str] | None:
    """What a module of ``random_modules`` draws at random in its forward now, and the attribute that
    turns it off; None where it draws nothing (eval mode, a probability of 0)."""
    if not module.training:
        return None
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return (f"a dropout mask (p={module.p})", "p") if module.p > 0 else None
    if isinstance(module, nn.MultiheadAttention):
        return (
            (f"a dropout mask on its attention weights (dropout={module.dropout})", "dropout")
            if module.dropout > 0
            else None
        )
    if isinstance(module, nn.RNNBase):
        between = module.dropout > 0 and module.num_layers > 1
        return (f"a dropout mask between its layers (dropout={module.dropout})", "dropout") if between else None
    if isinstance(module, nn.RReLU):
        return ("a random slope per element (RReLU)", "") if module.lower != module.upper else None
    return None


def _returned(g: Tensor, batch_dim: int | None) -> Tensor:
    """An output's gradient in the layout the module returned it (the engine moved a known batch dim to 0)."""
    return g if batch_dim is None else g.movedim(0, batch_dim)


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
RERUNNING.update((fallback, multihead_attention))
