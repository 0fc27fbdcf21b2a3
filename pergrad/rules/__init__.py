"""Per-sample gradient rules, one file per layer family. Importing this package registers them
in ``pergrad.registry.default_registry``."""

from .conv import conv, conv_transpose
from .embedding import embedding
from .linear import linear
from .norm import batch_norm_eval, group_norm, instance_norm, layer_norm, rms_norm

__all__ = [
    "batch_norm_eval",
    "conv",
    "conv_transpose",
    "embedding",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "linear",
    "rms_norm",
]
