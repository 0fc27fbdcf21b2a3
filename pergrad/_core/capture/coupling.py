"""Forward computations that couple the samples of a batch, seen in the autograd graph.

Normalising with statistics of the whole batch makes each sample's output depend on every other
sample, so per-sample gradients are undefined through it. ``nn.BatchNorm*`` in training mode is refused
by a forward pre-hook (``hooks.py``); the functional form, ``F.batch_norm(..., training=True)``, leaves
a ``NativeBatchNormBackward0`` node whose saved ``training`` flag is set and whose input has more than
one row in its batch dim (``F.instance_norm`` runs batch norm on a ``[1, B*C, ...]`` view: each
sample alone, allowed). Statistics written out by hand (``(h - h.mean(0)) / h.std(0)``) leave nothing
in the graph that tells them from a loss's mean; a followed forward refuses them where they reach a hooked
layer (``pergrad._core.capture.dims.MIXED``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from pergrad.errors import BatchMixingError

_BATCH_NORM_NODES = ("NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0")


def batch_statistics_shape(outputs: Iterable[Tensor]) -> tuple[int, ...] | None:
    """The input shape of a batch norm in training mode over more than one sample in the graph that
    computed ``outputs``, or None (one walk over the graph's nodes)."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if type(node).__name__ in _BATCH_NORM_NODES and getattr(node, "_saved_training", False):
            saved = getattr(node, "_saved_input", None)
            if isinstance(saved, Tensor) and saved.dim() > 0 and saved.shape[0] > 1:
                return tuple(saved.shape)
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return None


def refuse_batch_statistics(outputs: Iterable[Tensor]) -> None:
    """Raise ``BatchMixingError`` where the graph of ``outputs`` normalises with batch statistics."""
    shape = batch_statistics_shape(outputs)
    if shape is not None:
        raise BatchMixingError(
            f"the model's forward normalises with statistics of the whole batch (a batch norm in training mode, "
            f"e.g. F.batch_norm(..., training=True), on an input of shape {shape}): each sample's output depends on "
            "every other sample, so per-sample gradients are undefined. Use training=False with running statistics, "
            "or a per-sample normalisation (nn.GroupNorm, nn.LayerNorm, F.instance_norm; pergrad.fix_batchnorm(model) "
            "replaces nn.BatchNorm modules by nn.GroupNorm)."
        )
