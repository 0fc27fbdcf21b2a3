"""Per-sample gradient rules, one file per layer family. Importing this package registers them
in ``pergrad.registry.default_registry`` (``hf``: HuggingFace ``transformers`` layers, by name,
without importing ``transformers``)."""

from .conv import conv, conv_transpose
from .embedding import embedding, embedding_bag
from .fallback import fallback
from .hf import conv1d, gemma3n_rms_norm, gemma_rms_norm, llama_rms_norm, olmo2_rms_norm, t5_layer_norm
from .linear import linear
from .loss import linear_cross_entropy
from .norm import batch_norm_eval, group_norm, instance_norm, layer_norm, rms_norm
from .recurrent import recurrent

__all__ = [
    "batch_norm_eval",
    "conv",
    "conv1d",
    "conv_transpose",
    "embedding",
    "embedding_bag",
    "fallback",
    "gemma3n_rms_norm",
    "gemma_rms_norm",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "llama_rms_norm",
    "olmo2_rms_norm",
    "recurrent",
    "rms_norm",
    "t5_layer_norm",
]
