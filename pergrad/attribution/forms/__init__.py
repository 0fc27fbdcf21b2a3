"""The projected forms of each layer family's fused rule: Kronecker features ``P vec(g_i)`` and their
factors computed from a call's ``(a, d)`` without building ``g_i``, one module per family (``linear``,
``conv``, ``embedding``), looked up by the ``FusedRule`` of the layer's rule (``forms_of``). A layer
whose rule has none is projected from its built ``g_i``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor, nn

from pergrad._core.capture.calls import HookedLayer
from pergrad.attribution.projectors import Projector
from pergrad.registry import FusedRule
from pergrad.rules.conv import CONV_FUSED, CONV_TRANSPOSE_FUSED
from pergrad.rules.embedding import EMBEDDING_FUSED
from pergrad.rules.hf import CONV1D_FUSED
from pergrad.rules.linear import LINEAR_FUSED

from .conv import conv_factors, conv_project, conv_transpose_project
from .embedding import embedding_factors, embedding_project, embedding_project_tokens
from .linear import linear_factors, linear_project, linear_project_tokens


@dataclass(frozen=True)
class Forms:
    """A layer's projected forms (same arguments as its fused rule, with the projectors by parameter name).

    - ``project(layer, a, d, projectors, total, scale) -> bool``: adds ``scale P_p vec(g_i)`` of each
      parameter name in ``projectors`` (``pergrad.attribution.projectors``) into ``total`` ``[B, k]`` (in
      place: the features of every layer of a target share one buffer), Kronecker blocks without building
      ``g_i``; False, adding nothing, where the layer has no such form for these projectors (a dense one:
      the caller builds ``g_i``).
    - ``factors(layer, a, d, projectors) -> {name: (u [B, S, r_row], v [B, S, r_col])} | None``: the
      projected factors of each Kronecker block, ``P_p vec(g_i) = vec(sum_s u_is v_is^T)`` (``S``: the
      positions the weight's gradient sums over), for Kronecker-factored curvature
      (``pergrad.attribution.factors``); None where the layer has no such form for these projectors.
    - ``project_tokens(layer, a, d, projectors) -> {name: [B, T, k]} | None``: the same, per token: the
      projection of each position's term of ``g_i`` (they sum over ``t`` to ``project``'s), for inputs with
      one token dim after the batch; None where the layer has no such form for these shapes.

    ``factors`` and ``project_tokens`` return entries only for parameters that require grad, as fresh tensors.
    """

    project: Callable[[nn.Module, Any, Tensor, dict[str, Projector], Tensor, float], bool]
    factors: Callable[[nn.Module, Any, Tensor, dict[str, Projector]], dict[str, tuple[Tensor, Tensor]] | None] | None
    project_tokens: Callable[[nn.Module, Any, Tensor, dict[str, Projector]], dict[str, Tensor] | None] | None = None


FORMS: dict[FusedRule, Forms] = {
    LINEAR_FUSED: Forms(linear_project, linear_factors, linear_project_tokens),
    CONV1D_FUSED: Forms(
        partial(linear_project, transposed=True),
        partial(linear_factors, transposed=True),
        partial(linear_project_tokens, transposed=True),
    ),
    CONV_FUSED: Forms(conv_project, conv_factors),
    CONV_TRANSPOSE_FUSED: Forms(conv_transpose_project, None),
    EMBEDDING_FUSED: Forms(embedding_project, embedding_factors, embedding_project_tokens),
}


def forms_of(layer: HookedLayer) -> Forms | None:
    """The projected forms of ``layer``'s rule, or None where it has none."""
    fused = layer.spec.fused
    return None if fused is None else FORMS.get(fused)
