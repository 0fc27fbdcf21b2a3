"""Per-sample gradients of HuggingFace ``transformers`` layers, registered by qualified class name.

pergrad does not import ``transformers`` (an optional package): the rules below are registered
for the fully qualified names of its classes and read nothing but the layer's attributes
(``weight``, ``bias``, ``variance_epsilon`` or ``eps``), so they apply to a model that holds such a
layer and cost nothing otherwise. Each name is registered for the exact class, like every rule.

The RMSNorm-like layers of ``transformers`` compute in float32 whatever the input's dtype and cast
back. Each rule below replicates its forward op for op (float32 statistics, where the cast happens,
the dtype the weight's gradient is formed and summed in), so that in float64 its ``g_i`` equals
autograd's per-sample gradient to round-off (and in float32 where the forward computes in float32).
A class is listed under a rule only after its forward in transformers 5.23 was read and found to be
exactly that rule's form (``tests/test_hf_rules.py`` checks the source of each against the form).
Another class with the same forward is one line away::

    pergrad.register_rule("transformers.models.foo.modeling_foo.FooRMSNorm")(pergrad.rules.llama_rms_norm)

``transformers``' hub kernels (``kernelize()``, the ``kernels`` package) replace these forwards by
fused kernels; the rules still compute the Python forward's gradient, which the first backward's
check (``verify=True``) compares with autograd's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..registry import FusedRule, default_registry
from .linear import (
    linear_dots,
    linear_moments,
    linear_sq_norms,
    linear_summed,
    outer_sums,
    position_sums,
    trainable,
)
from .norm import affine_grads


def _classes(*names: str) -> tuple[str, ...]:
    """``"llama.LlamaRMSNorm"`` -> ``"transformers.models.llama.modeling_llama.LlamaRMSNorm"``."""
    out = []
    for name in names:
        family, cls = name.split(".")
        out.append(f"transformers.models.{family}.modeling_{family}.{cls}")
    return tuple(out)


CONV1D = "transformers.pytorch_utils.Conv1D"

# ``weight * x_hat.to(input_dtype)`` (``LlamaRMSNorm``; ``Llama4TextRMSNorm`` as ``_norm(x.float()).type_as(x) * weight``)
LLAMA_RMS_NORMS = _classes(
    "llama.LlamaRMSNorm",
    "llama4.Llama4TextRMSNorm",
    "mistral.MistralRMSNorm",
    "mixtral.MixtralRMSNorm",
    "ministral.MinistralRMSNorm",
    "qwen2.Qwen2RMSNorm",
    "qwen2_moe.Qwen2MoeRMSNorm",
    "qwen2_vl.Qwen2VLRMSNorm",
    "qwen2_5_vl.Qwen2_5_VLRMSNorm",
    "qwen3.Qwen3RMSNorm",
    "qwen3_moe.Qwen3MoeRMSNorm",
    "qwen3_vl.Qwen3VLTextRMSNorm",
    "phi3.Phi3RMSNorm",
    "granite.GraniteRMSNorm",
    "granitemoe.GraniteMoeRMSNorm",
    "deepseek_v2.DeepseekV2RMSNorm",
    "deepseek_v3.DeepseekV3RMSNorm",
    "smollm3.SmolLM3RMSNorm",
    "glm.GlmRMSNorm",
    "glm4.Glm4RMSNorm",
    "olmoe.OlmoeRMSNorm",
    "jamba.JambaRMSNorm",
    "bamba.BambaRMSNorm",
    "zamba2.Zamba2RMSNorm",
    "mamba.MambaRMSNorm",
    "mamba2.Mamba2RMSNorm",
    "mllama.MllamaTextRMSNorm",
    "idefics3.Idefics3RMSNorm",
    "pixtral.PixtralRMSNorm",
    "falcon_h1.FalconH1RMSNorm",
    "exaone4.Exaone4RMSNorm",
    "ernie4_5.Ernie4_5RMSNorm",
    "apertus.ApertusRMSNorm",
    "arcee.ArceeRMSNorm",
    "seed_oss.SeedOssRMSNorm",
)
# ``(weight * x_hat).to(input_dtype)``
OLMO2_RMS_NORMS = _classes(
    "olmo2.Olmo2RMSNorm",
    "olmo3.Olmo3RMSNorm",
    "flex_olmo.FlexOlmoRMSNorm",
    "gpt_oss.GptOssRMSNorm",
)
# ``(x_hat * (1 + weight.float())).type_as(x)``, ``(x_hat * weight.float()).type_as(x)`` or
# ``(weight.to(float32) * x_hat).to(input_dtype)``: the weight's gradient is formed in float32
GEMMA_RMS_NORMS = _classes(
    "gemma.GemmaRMSNorm",
    "gemma2.Gemma2RMSNorm",
    "gemma3.Gemma3RMSNorm",
    "recurrent_gemma.RecurrentGemmaRMSNorm",
    "t5gemma.T5GemmaRMSNorm",
    "vaultgemma.VaultGemmaRMSNorm",
    "qwen3_next.Qwen3NextRMSNorm",
    "qwen3_5.Qwen3_5RMSNorm",
    "qwen3_5_moe.Qwen3_5MoeRMSNorm",
    "moshi.MoshiRMSNorm",
    "helium.HeliumRMSNorm",
    "nemotron_h.NemotronHRMSNorm",
)
# as Gemma's with ``weight.float()``, but ``x_hat = x * pow(mean(x^2) + eps, -0.5)``
GEMMA3N_RMS_NORMS = _classes(
    "gemma3n.Gemma3nRMSNorm",
    "gemma4.Gemma4RMSNorm",
)
# ``weight * (x * rsqrt(mean(x.float()^2) + eps))``, cast to a half-precision weight's dtype first
T5_LAYER_NORMS = _classes(
    "t5.T5LayerNorm",
    "mt5.MT5LayerNorm",
    "umt5.UMT5LayerNorm",
    "longt5.LongT5LayerNorm",
    "switch_transformers.SwitchTransformersLayerNorm",
    "pix2struct.Pix2StructLayerNorm",
    "udop.UdopLayerNorm",
    "pop2piano.Pop2PianoLayerNorm",
)


# -- Conv1D: a Linear with its weight stored transposed ------------------------------------------


@default_registry.register(CONV1D)
def conv1d(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """GPT-2's projection ``y = a W + b``, W of shape ``[nx, nf]``: ``g_i(W) = sum_s a_is d_is^T``,
    ``g_i(b) = sum_s d_is`` (the Linear's gradients, transposed).

    Index conventions: n sample, s shared positions (all dims between batch and features),
    i input features (nx), o output features (nf). a: [n, s, i], d: [n, s, o] -> W: [n, i, o].
    """
    out: dict[str, Tensor] = {}
    if trainable(layer, "weight"):
        out["weight"] = outer_sums(a, d)  # nsi,nso->nio
    if trainable(layer, "bias"):
        out["bias"] = position_sums(d)
    return out


CONV1D_FUSED = FusedRule(
    linear_sq_norms,  # ||g_i||_F is the same for a weight and its transpose
    partial(linear_summed, transposed=True),
    partial(linear_dots, transposed=True),
    bilinear=True,
    moments=partial(linear_moments, transposed=True),
)
default_registry.register_fused((CONV1D,), CONV1D_FUSED)


# -- RMSNorm-like layers: y = w * x_hat, in the dtypes of each family's forward -------------------


def _weight_dtype(layer: nn.Module) -> torch.dtype:
    weight = layer.weight
    assert isinstance(weight, Tensor)
    return weight.dtype


def _eps(layer: nn.Module) -> Any:
    """The layer's epsilon: ``variance_epsilon`` (Llama, OLMo, T5 families) or ``eps`` (Gemma's, Llama4's)."""
    eps = getattr(layer, "variance_epsilon", None)
    return layer.eps if eps is None else eps


def _rms_float32(a: Tensor, eps: Any) -> Tensor:
    """``x_hat = x * rsqrt(mean_f(x^2) + eps)`` over the last dim with ``x = a.to(float32)``, op for op
    as the forwards compute it. a: [n, *s, f] -> float32 [n, *s, f]."""
    x = a.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _weight_grad(layer: nn.Module, x_hat: Tensor, d: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """``g_i(w) = sum_s d_is * x_hat_is`` (elementwise), formed and summed in ``dtype`` as autograd
    does for the forward, returned in the weight's dtype.

    Index conventions: n sample, s shared positions (every dim between the batch and the normalised
    last one, e.g. tokens and heads), f features. x_hat, d: [n, *s, f] -> [n, f].
    """
    if not trainable(layer, "weight"):
        return {}
    shared = tuple(range(1, d.dim() - 1))
    grads = affine_grads(layer, x_hat.to(dtype), d.to(dtype), shared)
    return {"weight": grads["weight"].to(_weight_dtype(layer))}


@default_registry.register(*LLAMA_RMS_NORMS)
def llama_rms_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = w * x_hat.to(a.dtype)``, ``x_hat`` in float32 (``LlamaRMSNorm`` and the classes of the
    same forward): ``g_i(w) = sum_s d_is * x_hat_is.to(a.dtype)``, in the output's dtype
    ``promote(w, a)``. Index conventions: a, d: [n, *s, f]; s summed (see ``_weight_grad``)."""
    x_hat = _rms_float32(a, _eps(layer)).to(a.dtype)
    return _weight_grad(layer, x_hat, d, torch.promote_types(_weight_dtype(layer), a.dtype))


@default_registry.register(*OLMO2_RMS_NORMS)
def olmo2_rms_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = (w * x_hat).to(a.dtype)``, ``x_hat`` in float32 (``Olmo2RMSNorm``): the output gradient is
    cast back to ``promote(w, float32)``, so ``g_i(w) = sum_s d_is * x_hat_is`` in that dtype.
    Index conventions: a, d: [n, *s, f]; s summed (see ``_weight_grad``)."""
    x_hat = _rms_float32(a, _eps(layer))
    return _weight_grad(layer, x_hat, d, torch.promote_types(_weight_dtype(layer), torch.float32))


@default_registry.register(*GEMMA_RMS_NORMS)
def gemma_rms_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = (x_hat * (1 + w.float())).type_as(a)`` (``GemmaRMSNorm``; ``MoshiRMSNorm`` has ``w.float()``,
    ``HeliumRMSNorm`` ``(w.to(float32) * x_hat).to(a.dtype)``): the weight enters as float32, so its
    gradient is formed and summed in float32 whatever the weight's dtype, then cast to it:
    ``g_i(w) = sum_s float32(d_is) * x_hat_is`` (the 1 of ``1 + w`` has no gradient).
    Index conventions: a, d: [n, *s, f]; s summed (see ``_weight_grad``)."""
    return _weight_grad(layer, _rms_float32(a, _eps(layer)), d, torch.float32)


@default_registry.register(*GEMMA3N_RMS_NORMS)
def gemma3n_rms_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = (x_hat * w.float()).type_as(a)`` with ``x_hat = x * pow(mean(x^2) + eps, -0.5)``,
    ``x = a.float()`` (``Gemma3nRMSNorm``, with ``with_scale=True``; without it there is no weight):
    ``g_i(w) = sum_s float32(d_is) * x_hat_is``, in float32 as Gemma's.
    Index conventions: a, d: [n, *s, f]; s summed (see ``_weight_grad``)."""
    x = a.float()
    x_hat = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + _eps(layer), -0.5)
    return _weight_grad(layer, x_hat, d, torch.float32)


@default_registry.register(*T5_LAYER_NORMS)
def t5_layer_norm(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    """``y = w * x_hat`` with ``x_hat = a * rsqrt(mean(a.float()^2) + eps)`` (only the variance in
    float32; ``x_hat`` in ``promote(a, float32)``, cast to a float16/bfloat16 weight's dtype):
    ``g_i(w) = sum_s d_is * x_hat_is`` in the output's dtype. No mean is subtracted, no bias.
    Index conventions: a, d: [n, *s, f]; s summed (see ``_weight_grad``)."""
    weight_dtype = _weight_dtype(layer)
    x_hat = a * torch.rsqrt(a.to(torch.float32).pow(2).mean(-1, keepdim=True) + _eps(layer))
    if weight_dtype in (torch.float16, torch.bfloat16):
        x_hat = x_hat.to(weight_dtype)
    return _weight_grad(layer, x_hat, d, torch.promote_types(weight_dtype, x_hat.dtype))
