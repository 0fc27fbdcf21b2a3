"""Projected forms of ``nn.Embedding``: the Kronecker features of ``g_i(W) = sum_t onehot(idx_it) d_it^T``,
``P_row`` of a one-hot row being a column lookup."""

from __future__ import annotations

from torch import Tensor, nn

from pergrad.attribution.projectors import Projector, add_kron_features, kron_token_features
from pergrad.rules.embedding import token_rows


def embedding_project(
    layer: nn.Module, idx: Tensor, d: Tensor, projectors: dict[str, Projector], total: Tensor, scale: float
) -> bool:
    """``total += scale P vec(g_i)``, ``P vec(g_i) = sum_t P_row[:, idx_it] (P_col d_it)^T`` from the factors
    (``embedding_factors``): ``P_row`` of a one-hot row is a column lookup (``P_row [p, vocab]``, ``P_col
    [q, e]``); padding tokens contribute nothing. False, adding nothing, if the block is dense (``g_i``
    must be built)."""
    factors = embedding_factors(layer, idx, d, projectors)
    if factors is None:
        return False
    for u, v in factors.values():
        add_kron_features(total, u, v, scale)
    return True


def embedding_factors(
    layer: nn.Module, idx: Tensor, d: Tensor, projectors: dict[str, Projector]
) -> dict[str, tuple[Tensor, Tensor]] | None:
    """The weight's Kronecker factors at every token: ``u_it = P_row[:, idx_it]`` ``[n, t, p]`` and
    ``v_it = P_col d_it`` ``[n, t, q]``, both 0 at padding tokens (they contribute nothing);
    ``embedding_project``'s features are ``vec(sum_t u_it v_it^T)``. None if the block is dense."""
    assert isinstance(layer, nn.Embedding)
    weight = projectors.get("weight")
    if weight is None:
        return {}
    if not weight.kron:
        return None
    idx, d = token_rows(layer, idx, d)
    row, col = weight.factors(d)
    u = row.T[idx]
    if layer.padding_idx is not None:
        u = u.masked_fill((idx == layer.padding_idx % layer.num_embeddings).unsqueeze(2), 0)
    return {"weight": (u, d @ col.T)}


def embedding_project_tokens(
    layer: nn.Module, idx: Tensor, d: Tensor, projectors: dict[str, Projector]
) -> dict[str, Tensor] | None:
    """``P_row[:, idx_it] (P_col d_it)^T`` per token ``t`` (zero for a padding token). None unless the
    input is ``[n, t]`` and the block Kronecker.

    Index conventions: n sample, t tokens, e embedding features, p and q projected features.
    """
    if idx.dim() != 2 and "weight" in projectors:
        return None
    factors = embedding_factors(layer, idx, d, projectors)
    return None if factors is None else {name: kron_token_features(u, v) for name, (u, v) in factors.items()}
