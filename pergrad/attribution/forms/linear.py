"""Projected forms of ``nn.Linear`` (and of a weight stored transposed, HF ``Conv1D``: ``transposed=True``):
the Kronecker features of ``g_i(W) = sum_s d_is a_is^T`` from ``P_row d_is`` and ``P_col a_is``."""

from __future__ import annotations

from torch import Tensor, nn

from pergrad._core.memory.layout import rows
from pergrad.attribution.projectors import Projector, add_kron_features, kron_token_features


def linear_project(
    layer: nn.Module,
    a: Tensor,
    d: Tensor,
    projectors: dict[str, Projector],
    total: Tensor,
    scale: float,
    *,
    transposed: bool = False,
) -> bool:
    """``total += scale P vec(g_i)``: the weight's Kronecker block as ``sum_s (P_row d_is)(P_col a_is)^T``
    from its factors (``linear_factors``; with ``transposed=True``, a weight stored ``[in, out]``: ``sum_s
    (P_row a_is)(P_col d_is)^T``); the bias's block applied to ``sum_s d_is``. False, adding nothing, if
    the weight's block is dense (``g_i`` must be built)."""
    factors = linear_factors(layer, a, d, projectors, transposed=transposed)
    if factors is None:
        return False
    for u, v in factors.values():
        add_kron_features(total, u, v, scale)
    if "bias" in projectors:
        projectors["bias"].apply(d if d.dim() == 2 else rows(d).sum(1), total, scale)
    return True


def linear_factors(
    layer: nn.Module, a: Tensor, d: Tensor, projectors: dict[str, Projector], *, transposed: bool = False
) -> dict[str, tuple[Tensor, Tensor]] | None:
    """The weight's Kronecker factors ``u_is = P_row d_is``, ``v_is = P_col a_is`` (``[n, s, p]``,
    ``[n, s, q]``; with ``transposed=True``, ``P_row a_is`` and ``P_col d_is``): ``linear_project``'s
    features are ``vec(sum_s u_is v_is^T)``. None if the weight's block is dense."""
    weight = projectors.get("weight")
    if weight is None:
        return {}
    if not weight.kron:
        return None
    row, col = weight.factors(d)
    left, right = (a, d) if transposed else (d, a)
    return {"weight": (rows(left) @ row.T, rows(right) @ col.T)}


def linear_project_tokens(
    layer: nn.Module, a: Tensor, d: Tensor, projectors: dict[str, Projector], *, transposed: bool = False
) -> dict[str, Tensor] | None:
    """``P vec(d_it a_it^T)`` per token ``t``: ``(P_row d_it)(P_col a_it)^T`` flattened (with
    ``transposed=True``: ``(P_row a_it)(P_col d_it)^T``), and the bias's block applied to each ``d_it``.
    None unless the input is ``[n, t, i]`` and the weight's block Kronecker.

    Index conventions: n sample, t tokens, i and o features, p and q projected features.
    a: [n, t, i], d: [n, t, o] -> [n, t, p * q].
    """
    factors = linear_factors(layer, a, d, projectors, transposed=transposed) if a.dim() == 3 else None
    if factors is None:
        return None
    out = {name: kron_token_features(u, v) for name, (u, v) in factors.items()}
    if "bias" in projectors:
        n, t = d.shape[:2]
        out["bias"] = projectors["bias"].apply(d.reshape(n * t, -1)).view(n, t, -1)
    return out
