"""Per-sample gradients of ``nn.Linear``: ``y = a W^T + b``.

The helpers below also serve layers that store the same weight transposed (``y = a W + b``, W of
shape ``[in, out]``, as ``transformers``' ``Conv1D``): ``transposed=True`` gives their layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pergrad._core.memory.layout import new_buffer, owned, recorded, rows

from ..registry import FusedRule, Moments, default_registry


@default_registry.register(nn.Linear)
def linear(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``g_i(W) = sum_s d_is a_is^T``, ``g_i(b) = sum_s d_is``.

    Index conventions: n sample, s shared positions (all dims between batch and features),
    i input features, o output features. a: [n, s, i], d: [n, s, o].
    """
    assert isinstance(layer, nn.Linear)
    out: dict[str, Tensor] = {}
    if layer.weight.requires_grad:
        out["weight"] = outer_sums(d, a)  # [n, o, i]
    if layer.bias is not None and layer.bias.requires_grad:
        out["bias"] = position_sums(d)
    return out


def outer_sums(left: Tensor, right: Tensor) -> Tensor:
    """``sum_s left_is right_is^T`` per sample, into a new buffer.

    Index conventions: n sample, s shared positions, l and r features. left: [n, *s, l],
    right: [n, *s, r] -> [n, l, r]. ``outer_sums(d, a)`` is a Linear's weight gradient,
    ``outer_sums(a, d)`` the one of a weight stored transposed.
    """
    if recorded():
        return torch.einsum("n...l,n...r->nlr", left, right)
    result = new_buffer((left.shape[0], left.shape[-1], right.shape[-1]), left)
    if left.dim() == 2:
        # one position per sample: an outer product, written once, nothing summed
        return torch.mul(left.unsqueeze(2), right.unsqueeze(1), out=result)
    return torch.bmm(rows(left).transpose(1, 2), rows(right), out=result)  # nsl,nsr->nlr


def position_sums(d: Tensor) -> Tensor:
    """``sum_s d_is``: a bias's per-sample gradient. d: [n, *s, o] -> [n, o] (a copy for [n, o])."""
    return owned(d.clone() if d.dim() == 2 else rows(d).sum(1))


# -- fused: quantities of g_i = sum_s d_is a_is^T without building g_i -------------------------------


def gram_is_cheaper(shared: int, fan_in: int, fan_out: int) -> bool:
    """``||g_i||^2 = sum_{s,t} (a_s.a_t)(d_s.d_t)`` costs s^2 (i+o) per sample; building ``g_i``
    costs s i o. Take the Gram form when it is the cheaper one."""
    return shared * (fan_in + fan_out) <= fan_in * fan_out


def _sq_norms(t: Tensor) -> Tensor:
    """``||t_i||^2`` per sample, read in one pass (no squared temporary)."""
    return torch.linalg.vector_norm(t if t.dim() == 2 else t.reshape(t.shape[0], -1), dim=1).square()


def outer_sq_norms(a: Tensor, d: Tensor) -> Tensor:
    """``||sum_s d_s a_s^T||_F^2`` per sample. Index conventions: a: [n, s, i], d: [n, s, o] -> [n]."""
    if a.shape[1] == 1:
        return _sq_norms(a) * _sq_norms(d)
    if gram_is_cheaper(a.shape[1], a.shape[2], d.shape[2]):
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
    return torch.bmm(d.transpose(1, 2), a).square().sum((1, 2))


def trainable(layer: nn.Module, name: str) -> bool:
    """Whether ``layer`` holds a parameter ``name`` that requires grad (read from ``_parameters``, as autograd's
    hooks and ``HookedLayer.trainable`` read it: a parametrized weight is no parameter of the layer's)."""
    p = layer._parameters.get(name)
    return isinstance(p, nn.Parameter) and p.requires_grad


def linear_sq_norms(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``||g_i(W)||^2`` (outer-product or Gram form, by shape) and ``||g_i(b)||^2 = ||sum_s d_is||^2``."""
    out = {}
    if d.dim() == 2:  # one position per sample: ||g_i(W)||^2 = ||a_i||^2 ||d_i||^2, and ||d_i||^2 is the bias's
        d_sq = _sq_norms(d)
        if trainable(layer, "weight"):
            out["weight"] = _sq_norms(a) * d_sq
        if trainable(layer, "bias"):
            out["bias"] = d_sq
        return out
    if trainable(layer, "weight"):
        out["weight"] = outer_sq_norms(rows(a), rows(d))
    if trainable(layer, "bias"):
        out["bias"] = _sq_norms(rows(d).sum(1))
    return out


def linear_summed(layer: nn.Module, a: Tensor, d: Tensor, *, transposed: bool = False) -> dict[str, Tensor]:
    """``sum_i g_i(W) = D^T A`` over every sample and position: one matmul, no per-sample tensor
    (``A^T D`` for a weight stored transposed)."""
    out = {}
    d2, a2 = d.reshape(-1, d.shape[-1]), a.reshape(-1, a.shape[-1])
    if trainable(layer, "weight"):
        out["weight"] = a2.T @ d2 if transposed else d2.T @ a2
    if trainable(layer, "bias"):
        out["bias"] = d2.sum(0)
    return out


def linear_dots(
    layer: nn.Module, a: Tensor, d: Tensor, other: dict[str, Tensor], *, transposed: bool = False
) -> dict[str, Tensor]:
    """``<g_i(W), G> = sum_s d_is^T G a_is`` and ``<g_i(b), h> = (sum_s d_is) . h`` (``G`` stored
    ``[in, out]`` with ``transposed=True``: ``sum_s a_is^T G d_is``)."""
    out = {}
    if trainable(layer, "weight"):
        g_t = other["weight"] if transposed else other["weight"].T  # [i, o] either way
        out["weight"] = (rows(a) @ g_t * rows(d)).sum((1, 2))
    if trainable(layer, "bias"):
        out["bias"] = rows(d).sum(1) @ other["bias"]
    return out


def linear_moments(
    layer: nn.Module, a: Tensor, d: Tensor, other: dict[str, Tensor] | None, *, transposed: bool = False
) -> Moments | None:
    """Norms, sums of squares and inner products of a Linear on ``[B, D]`` with ``a^2`` and ``d^2``
    computed once: ``||g_i(W)||^2 = |a_i^2| |d_i^2|``, ``sum_i g_i(W)^2 = (d^2)^T (a^2)``,
    ``<g_i(W), G> = d_i . (G a_i)`` (no inner products for ``other=None``); the bias's from ``d``
    alone. None for more positions. With
    ``transposed=True`` (weight stored ``[in, out]``): ``(a^2)^T (d^2)`` and ``d_i . (G^T a_i)``."""
    if a.dim() != 2:
        return None
    norms, squares, dots = {}, {}, {}
    d2 = d.square()
    if trainable(layer, "weight"):
        a2 = a.square()
        norms["weight"] = a2.sum(1) * d2.sum(1)
        squares["weight"] = a2.T @ d2 if transposed else d2.T @ a2
        if other is not None:
            g_t = other["weight"] if transposed else other["weight"].T  # [i, o] either way
            dots["weight"] = torch.linalg.vecdot(a @ g_t, d)
    if trainable(layer, "bias"):
        norms["bias"], squares["bias"] = d2.sum(1), d2.sum(0)
        if other is not None:
            dots["bias"] = d @ other["bias"]
    return norms, squares, dots


LINEAR_FUSED = FusedRule(linear_sq_norms, linear_summed, linear_dots, bilinear=True, moments=linear_moments)
default_registry.register_fused((nn.Linear,), LINEAR_FUSED)
