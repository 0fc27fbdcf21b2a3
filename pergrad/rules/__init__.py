"""Per-sample gradient rules, one file per layer family. Importing this package registers them
in ``pergrad.registry.default_registry``."""

from .conv import conv, conv_transpose
from .embedding import embedding, embedding_bag
from .fallback import fallback
from .linear import linear
from .norm import batch_norm_eval, group_norm, instance_norm, layer_norm, rms_norm
from .recurrent import recurrent

__all__ = [
    "batch_norm_eval",
    "conv",
    "conv_transpose",
    "embedding",
    "embedding_bag",
    "fallback",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "linear",
    "recurrent",
    "rms_norm",
]
