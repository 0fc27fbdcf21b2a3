"""Per-sample gradients of ``nn.Embedding``: row ``idx`` of the weight receives the output gradient."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pergrad._core.memory.layout import new_buffer

from ..errors import UnsupportedLayerError
from ..registry import FusedRule, LayerCall, default_registry


@default_registry.register(nn.Embedding)
def embedding(layer: nn.Module, idx: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``g_i(W)[v] = sum_{t : idx_it = v} d_it``; the ``padding_idx`` row stays zero, as in autograd.

    Index conventions: n sample, t token positions (all dims after the batch), v vocabulary row,
    e embedding features. idx: [n, t], d: [n, t, e]. Computed as one ``index_add`` into the
    flattened ``[n * v, e]`` result.
    """
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    n, (vocab, dim) = idx.shape[0], layer.weight.shape
    flat_rows = (idx.reshape(n, -1) + torch.arange(n, device=idx.device).unsqueeze(1) * vocab).reshape(-1)
    out = new_buffer((n, vocab, dim), d).zero_()
    out.view(n * vocab, dim).index_add_(0, flat_rows, d.reshape(-1, dim))
    if layer.padding_idx is not None:
        out[:, layer.padding_idx] = 0
    return {"weight": out}


# -- fused: g_i has one nonzero row per distinct token of sample i ------------------------------------


def token_rows(layer: nn.Embedding, idx: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """idx ``[n, t]`` and d ``[n, t, e]`` with padding tokens' gradients zeroed (their row gets none)."""
    n, dim = idx.shape[0], layer.weight.shape[1]
    idx, d = idx.reshape(n, -1), d.reshape(n, -1, dim)
    if layer.padding_idx is not None:
        d = d.masked_fill((idx == layer.padding_idx % layer.num_embeddings).unsqueeze(2), 0)
    return idx, d


def embedding_sq_norms(layer: nn.Module, idx: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``||g_i||^2 = sum_{t,s} [idx_t = idx_s] (d_t . d_s)``: tokens that share a row add up first.

    Index conventions: n sample, t and s token positions, e embedding features.
    """
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    idx, d = token_rows(layer, idx, d)
    same_row = idx.unsqueeze(2) == idx.unsqueeze(1)  # [n, t, s]
    return {"weight": (torch.bmm(d, d.transpose(1, 2)) * same_row).sum((1, 2))}


def embedding_summed(layer: nn.Module, idx: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i``: every token's gradient added into its row."""
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    idx, d = token_rows(layer, idx, d)
    out = d.new_zeros(layer.weight.shape)
    out.index_add_(0, idx.reshape(-1), d.reshape(-1, d.shape[2]))
    return {"weight": out}


def embedding_dots(layer: nn.Module, idx: Tensor, d: Tensor, other: dict[str, Tensor]) -> dict[str, Tensor]:
    """``<g_i, G> = sum_t d_it . G[idx_it]`` (padding tokens contribute nothing)."""
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    idx, d = token_rows(layer, idx, d)
    return {"weight": (other["weight"][idx] * d).sum((1, 2))}


def embedding_sum_squares(layer: nn.Module, idx: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i^2``: each sample's rows are built only for the tokens it holds (one row per distinct
    (sample, token) pair), squared, then added into their rows.

    The pairs are found by sorting the ``n * t`` keys ``sample * vocab + token``: a key that differs
    from the one before starts a pair. There are at most ``n * t`` pairs, so the rows are that many
    (those past the last pair stay 0 and add 0 to row 0): no shape depends on the values, so on an
    accelerator the host does not wait for them (``unique`` would).
    """
    assert isinstance(layer, nn.Embedding)
    if not layer.weight.requires_grad:
        return {}
    idx, d = token_rows(layer, idx, d)
    vocab, dim = layer.num_embeddings, d.shape[2]
    keys = (idx + torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) * vocab).reshape(-1)
    keys, order = torch.sort(keys)
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    slot = starts.cumsum(0) - 1  # the pair of each (sorted) token
    rows = d.new_zeros(keys.shape[0], dim).index_add_(0, slot, d.reshape(-1, dim)[order])
    row_of_pair = torch.zeros_like(keys).scatter_(0, slot, keys % vocab)
    out = d.new_zeros(layer.weight.shape).index_add_(0, row_of_pair, rows.square())
    return {"weight": out}


EMBEDDING_FUSED = FusedRule(embedding_sq_norms, embedding_summed, embedding_dots, embedding_sum_squares)
default_registry.register_fused((nn.Embedding,), EMBEDDING_FUSED)


def _bags(layer: nn.EmbeddingBag, call: LayerCall) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """Entries as (bag, row, per-sample weight or None) and the number of bags, for a 2-D input
    ``[B, L]`` or a 1-D input with ``offsets`` (``include_last_offset`` too)."""
    names = ("input", "offsets", "per_sample_weights")
    given = dict(zip(names, call.args, strict=False)) | {k: v for k, v in call.kwargs.items() if k in names}
    idx, offsets, weights = given["input"], given.get("offsets"), given.get("per_sample_weights")
    if idx.dim() == 2:
        bags = idx.shape[0]
        bag = torch.arange(bags, device=idx.device).repeat_interleave(idx.shape[1])
    else:
        assert offsets is not None, "a 1-D input to nn.EmbeddingBag comes with offsets"
        starts = offsets[:-1] if layer.include_last_offset else offsets
        bags = starts.shape[0]
        bag = torch.searchsorted(starts, torch.arange(idx.shape[0], device=idx.device), right=True) - 1
    return bag, idx.reshape(-1), None if weights is None else weights.reshape(-1), bags


@default_registry.register(nn.EmbeddingBag, all_inputs=True)
def embedding_bag(layer: nn.Module, call: LayerCall, d: Tensor) -> dict[str, Tensor]:
    """Bag b's gradient puts ``w_j d_b`` (sum), ``d_b / |b|`` (mean, ``|b|`` counting non-padding
    entries) or, per feature, ``d_b`` at the row that gave the maximum (max) into row ``idx_j``
    of every entry j of the bag; the ``padding_idx`` row stays zero.

    Index conventions: n bag (= sample), j entry, v row, e feature. d: [n, e].
    """
    assert isinstance(layer, nn.EmbeddingBag)
    if layer.scale_grad_by_freq or layer.sparse:
        raise UnsupportedLayerError(
            "nn.EmbeddingBag with scale_grad_by_freq=True or sparse=True has no per-sample gradient in pergrad; "
            "construct it with both False"
        )
    if not layer.weight.requires_grad:
        return {}
    bag, rows, weights, n = _bags(layer, call)
    vocab, dim = layer.weight.shape
    keep = torch.ones_like(rows, dtype=torch.bool) if layer.padding_idx is None else rows != layer.padding_idx
    if layer.mode == "max":
        values = layer.weight.detach()[rows].masked_fill(~keep.unsqueeze(1), float("-inf"))  # [j, e]
        best = torch.full((n, dim), float("-inf"), dtype=values.dtype, device=values.device)
        best = best.scatter_reduce(0, bag.unsqueeze(1).expand_as(values), values, "amax")
        winner = (values == best[bag]) & keep.unsqueeze(1)
        contrib = d[bag] * _first_per_group(winner, bag, n).to(d.dtype)
    else:
        scale = keep.to(d.dtype) if weights is None else weights * keep
        if layer.mode == "mean":
            count = torch.zeros(n, dtype=d.dtype, device=d.device).index_add_(0, bag, keep.to(d.dtype))
            scale = scale / count.clamp(min=1)[bag]
        contrib = d[bag] * scale.unsqueeze(1)
    out = new_buffer((n, vocab, dim), d).zero_()
    out.view(n * vocab, dim).index_add_(0, bag * vocab + rows, contrib)
    return {"weight": out}


def _first_per_group(winner: Tensor, group: Tensor, groups: int) -> Tensor:
    """``winner`` [j, e] keeping only the first True per (group, feature), in entry order."""
    rank = torch.zeros_like(winner, dtype=torch.long)
    running = torch.zeros((groups, winner.shape[1]), dtype=torch.long, device=winner.device)
    for j in range(winner.shape[0]):  # entries in order: count the winners seen so far in the bag
        rank[j] = running[group[j]]
        running[group[j]] += winner[j].long()
    return (winner & (rank == 0)).to(torch.get_default_dtype())
