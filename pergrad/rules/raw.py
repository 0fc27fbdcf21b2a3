"""Per-sample gradients of a module's raw parameters (ViT's ``cls_token`` and position embeddings,
timm's ``pos_embed``, a ``LayerScale`` gamma): parameters a module uses directly in its forward
rather than through a layer with a rule.

Such a parameter is shared by the batch; ``pergrad._core.shortcuts.shared`` tracks it through the module's forward
to where it meets the batch in a broadcasting op, and the per-sample gradient caught there,
``g_i = d f_i / d p``, arrives here whole: the rule is the identity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import FusedRule, RuleSpec


def raw_parameter(layer: nn.Module, name: str, d: Tensor) -> dict[str, Tensor]:
    """``g_i(p) = d_i``: the gradient caught where the parameter meets the batch, ``[B, *p.shape]``."""
    return {name: d}


def _sq_norms(layer: nn.Module, name: str, d: Tensor) -> dict[str, Tensor]:
    return {name: torch.linalg.vector_norm(d.reshape(d.shape[0], -1), dim=1).square()}


def _summed(layer: nn.Module, name: str, d: Tensor) -> dict[str, Tensor]:
    return {name: d.sum(0)}


def _dots(layer: nn.Module, name: str, d: Tensor, other: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: d.reshape(d.shape[0], -1) @ other[name].flatten()}


RAW = RuleSpec(raw_parameter, raw=True, fused=FusedRule(_sq_norms, _summed, _dots))
