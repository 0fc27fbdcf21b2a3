"""No host syncs in a training step: from the second backward on (the first one checks the
per-sample gradients against autograd's, which reads numbers on the host), pergrad's forward and
backward queue device work only, so on a GPU the host never waits for the device inside a step.

On a GPU, every ``.item()``, ``float(t)``, ``bool(t)`` (``if t.any():``), ``t.tolist()`` and every
op whose output shape depends on the data (``nonzero``, ``masked_select``, boolean indexing,
``unique``) waits for all queued work. The CPU has no queue to wait on, so here such calls are
caught where they are made: ``SyncCounter`` (a dispatch mode) records every ATen op that reads a
tensor's value on the host or sizes its output by it, and ``Tensor.tolist``/``numpy`` are patched
(they read memory without an ATen op on the CPU). The same step of the plain model (no pergrad)
records nothing (the control below), so whatever the counter finds in a pergrad step is pergrad's.
The results are checked against torch.func in float64 at every step, a NaN sample included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from pergrad import PerSampleModule, transforms
from pergrad._core.memory import layout
from tests.reference import reference_grad_sample

aten = torch.ops.aten

# ops that read a value on the host (tagged ``data_dependent_output``: _local_scalar_dense, item)
# or return a Python bool from tensor data
_READS = {aten.is_nonzero, aten.equal, aten.allclose}
# ops with a data-dependent output shape besides those tagged ``dynamic_output_shape``
_SIZED = {aten.nonzero_numpy, aten.unique_dim_consecutive, aten.masked_scatter}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _flagged(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    packet = func.overloadpacket
    if packet in _INDEXING:  # integer indices have a static shape; boolean masks do not
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
        return True
    return packet in _READS or packet in _SIZED


class SyncCounter(TorchDispatchMode):
    """Records every op that would make the host wait for a GPU (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _flagged(func, args, kwargs):
            self.found.append(str(func))
        return func(*args, **kwargs)


@contextmanager
def counting_syncs() -> Iterator[list[str]]:
    """Record host syncs inside the block into the list it yields."""
    counter = SyncCounter()
    saved = {name: getattr(Tensor, name) for name in ("tolist", "numpy", "__array__")}

    def patched(name: str) -> Callable[..., Any]:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.found.append(f"Tensor.{name}")
            return saved[name](self, *args, **kwargs)

        return read

    try:
        for name in saved:
            setattr(Tensor, name, patched(name))
        with counter:
            yield counter.found
    finally:
        for name, fn in saved.items():
            setattr(Tensor, name, fn)


def test_the_counter_sees_every_kind_of_sync() -> None:
    t = torch.randn(6)
    for sync in (
        lambda: t.sum().item(),
        lambda: float(t.sum()),
        lambda: bool(t.any()),
        lambda: 1 if t.isfinite().all() else 0,
        lambda: int(t.argmax()),
        lambda: t.tolist(),
        lambda: t.numpy(),
        lambda: t.nonzero(),
        lambda: t[t > 0],
        lambda: t.masked_select(t > 0),
        lambda: torch.unique(t),
        lambda: torch.allclose(t, t),
        lambda: torch.equal(t, t),
        lambda: t.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1])),
    ):
        with counting_syncs() as found:
            sync()
        assert found, "a host sync went unnoticed"
    with counting_syncs() as found:  # and nothing else is flagged
        (t * torch.where(t > 0, t, 0).sum()).masked_fill(t < 0, 0)[torch.tensor([0, 2])].sort()
    assert found == []


# -- models: each takes a batch of B samples, returns [B, 5] ---------------------------------------------


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))


class ConvNet(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
            nn.Flatten(), nn.Linear(4 * 3 * 3, 5),
        )  # fmt: skip


class Sequence(nn.Module):
    """Embedding + Linear + LayerNorm on T = 17 >= 16 positions: the Linears run detached from step 2."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb, self.up, self.norm = nn.Embedding(vocab, dim), nn.Linear(dim, 2 * dim), nn.LayerNorm(2 * dim)
        self.head = nn.Linear(2 * dim, 5)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.up(self.emb(idx)))).mean(1))


class Positions(Sequence):
    """The positions ``wpe(torch.arange(T))`` are shared by the batch (``pergrad._core.shortcuts.shared``)."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__(vocab, dim)
        self.wpe = nn.Embedding(24, dim)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.norm(torch.tanh(self.up(h))).mean(1))


class Masked(Sequence):
    """A padding mask read as HuggingFace's mask code reads it: indexed by aranges the forward makes
    (``mask[arange(B)[:, None], arange(T)[None]]``), which keep each sample in its row with no value read."""

    def forward(self, idx: Tensor) -> Tensor:
        mask = (idx != 0).to(self.up.weight.dtype)
        rows = mask[torch.arange(idx.shape[0])[:, None], torch.arange(idx.shape[1])[None, :]]
        return self.head(self.norm(torch.tanh(self.up(self.emb(idx))) * rows[..., None]).mean(1))


def _images(b: int, gen: torch.Generator) -> Tensor:
    return torch.randn(b, 3, 7, 7, generator=gen, dtype=torch.float64)


def _vectors(b: int, gen: torch.Generator) -> Tensor:
    return torch.randn(b, 6, generator=gen, dtype=torch.float64)


def _ids(b: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, 11, (b, 17), generator=gen)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], Tensor]]] = {
    "mlp": (MLP, _vectors),
    "conv": (ConvNet, _images),
    "sequence": (Sequence, _ids),
    "positions": (Positions, _ids),
    "masked": (Masked, _ids),
}

# mode -> (PerSampleModule options, where a transform goes ("" root, a module or parameter name), transform)
MODES: dict[str, tuple[dict[str, Any], str | None, Callable[[], transforms.Transform] | None]] = {
    "grad_sample": ({"keep_grad_sample": True}, None, None),
    "grad_sample+clip": ({"keep_grad_sample": True}, "", lambda: transforms.clip_norm(0.5)),
    "clip_root": ({"keep_grad_sample": False}, "", lambda: transforms.clip_norm(0.5)),
    "clip_module": ({"keep_grad_sample": False}, "head", lambda: transforms.clip_norm(0.3)),
    "clip_parameter": ({"keep_grad_sample": False}, "head.weight", lambda: transforms.clip_norm(0.3)),
    "normalize": ({"keep_grad_sample": False}, "", lambda: transforms.normalize()),
    "norms": ({"keep_grad_sample": False, "track_norms": True}, None, None),
    "statistics": ({"keep_grad_sample": False, "track_statistics": True}, None, None),
    "statistics_by_name": (
        {"keep_grad_sample": False, "track_statistics": {"trace_variance", "inner_product_test"}},
        None,
        None,
    ),
}
_HEADS = {"mlp": "4", "conv": "5"}  # the last Linear, where the sequence models call it head

STEPS = [3, 4, 4, 2, 5]  # batch sizes; from step 2 on, no syncs
POISONED = 3  # at this step, sample 1's loss is multiplied by NaN: its gradient is NaN


def weighted_loss(out: Tensor, y: Tensor) -> Tensor:
    """``sum_i w_i CE(out_i, c_i)`` for ``y = [c, w]``: a weight of NaN makes sample i's gradient NaN."""
    return (F.cross_entropy(out, y[:, 0].long(), reduction="none") * y[:, 1]).sum()


def assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _expected(
    ref: dict[str, Tensor], target: str | None, transform: transforms.Transform | None, names: list[str]
) -> dict[str, Tensor]:
    """``.grad`` as ``(1/B) sum_i T(g_i)`` over the samples with a finite gradient over the target
    (every sample, for parameters no transform covers)."""
    if transform is None or target is None:
        return {k: g.mean(0) for k, g in ref.items()}
    covered = [k for k in names if target == "" or k == target or k.startswith(f"{target}.")]
    norms = torch.stack([ref[k].flatten(1).square().sum(1) for k in covered]).sum(0).sqrt()
    assert isinstance(transform, transforms.Scaling)
    factors = transform.factors(norms, norms.shape[0], norms)
    keep = torch.isfinite(norms)
    out = {k: g.mean(0) for k, g in ref.items()}
    for k in covered:
        g = ref[k][keep] * factors[keep].view(-1, *([1] * (ref[k].dim() - 1)))
        out[k] = g.sum(0) / norms.shape[0]
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("workload", list(MODELS))
def test_no_host_syncs_after_the_first_backward(workload: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU, pergrad reads a dropped-sample mask to skip a copy when no sample is dropped (a
    # read that waits for nothing there); take the accelerator's path, which never reads it.
    monkeypatch.setattr(layout, "READ_FREELY", frozenset())
    build, inputs = MODELS[workload]
    options, target, make = MODES[mode]
    torch.manual_seed(0)
    model = build().double()
    if target is not None and target.startswith("head") and workload in _HEADS:
        target = target.replace("head", _HEADS[workload])
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    psm = PerSampleModule(model, **options)
    transform = make() if make is not None else None
    if transform is not None:
        assert target is not None
        psm.register_transform(target, transform)
    syncs = {}
    for step, b in enumerate(STEPS):
        x = inputs(b, gen)
        weights = torch.ones(b, dtype=torch.float64)
        if step == POISONED:
            weights[1] = float("nan")
        y = torch.stack([torch.randint(0, 5, (b,), generator=gen).double(), weights], 1)  # class, loss weight
        ref = reference_grad_sample(model, x, y, loss=weighted_loss)
        with counting_syncs() as found:
            psm.zero_grad()
            (weighted_loss(psm(x), y) / b).backward()
            norms = psm.per_sample_norms() if options.get("track_norms") else None
            stats = psm.statistics() if options.get("track_statistics") else None
        if step > 0 and found:
            syncs[step] = found
        want = _expected(ref, target, transform, names)
        for name, p in model.named_parameters():
            what = f"step {step}, {name}"
            assert_close(p.grad, want[name], f".grad at {what}")
            if options.get("keep_grad_sample"):
                assert_close(p.grad_sample, ref[name], f"grad_sample at {what}")
            if norms is not None:
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms at {what}")
            if stats is not None:
                assert_close(stats.params[name].mean, ref[name].mean(0), f"mean at {what}")
                if "second_moment" in stats.tracked:
                    assert_close(
                        stats.params[name].second_moment, ref[name].square().mean(0), f"second moment at {what}"
                    )
        if transform is not None and step == POISONED:
            kind = "module" if target in dict(model.named_modules()) else "parameter"
            label = "the whole model" if target == "" else f"{kind} {target!r}"
            assert {k: v.tolist() for k, v in psm.dropped_samples().items()} == {label: [1]}
    psm.remove()
    assert syncs == {}, f"host syncs in the steps of {workload}, {mode}"


@pytest.mark.parametrize("workload", list(MODELS))
def test_the_plain_step_has_no_syncs(workload: str) -> None:
    """The control: the same steps without pergrad record nothing, so the model and the loss are
    sync-free and everything the counter finds in a pergrad step is pergrad's own."""
    build, inputs = MODELS[workload]
    torch.manual_seed(0)
    model = build().double()
    gen = torch.Generator().manual_seed(1)
    for b in STEPS:
        x, y = inputs(b, gen), torch.randint(0, 5, (b,), generator=gen)
        with counting_syncs() as found:
            model.zero_grad()
            (F.cross_entropy(model(x), y, reduction="none").sum() / b).backward()
        assert found == []


@pytest.mark.parametrize("mode", ["grad_sample+clip", "clip_root", "statistics"])
@pytest.mark.parametrize("workload", ["mlp", "sequence"])
def test_no_host_syncs_under_loss_scaling(workload: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``grad_scaler=``, the scale is read as a tensor and an overflow is passed on to ``.grad``
    on the device: the steps stay sync-free (the scaler's own ``unscale_``/``step`` read its
    found-inf flag, as without pergrad, and are not counted)."""
    monkeypatch.setattr(layout, "READ_FREELY", frozenset())
    build, inputs = MODELS[workload]
    options, target, make = MODES[mode]
    torch.manual_seed(0)
    model = build().double()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    psm = PerSampleModule(model, grad_scaler=scaler, **options)
    transform = make() if make is not None else None
    if transform is not None:
        assert target is not None
        psm.register_transform(target, transform)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    syncs = {}
    for step, b in enumerate(STEPS):
        x = inputs(b, gen)
        y = torch.stack([torch.randint(0, 5, (b,), generator=gen).double(), torch.ones(b, dtype=torch.float64)], 1)
        ref = reference_grad_sample(model, x, y, loss=weighted_loss)
        with counting_syncs() as found:
            psm.zero_grad()
            scaler.scale(weighted_loss(psm(x), y) / b).backward()
            stats = psm.statistics() if options.get("track_statistics") else None
        if step > 0 and found:
            syncs[step] = found
        want = _expected(ref, target, transform, names)
        for name, p in model.named_parameters():
            assert_close(p.grad / 256.0, want[name], f".grad / scale at step {step}, {name}")
            if stats is not None:
                assert_close(stats.params[name].second_moment, ref[name].square().mean(0), f"second moment, {name}")
    psm.remove()
    assert syncs == {}, f"host syncs in the loss-scaled steps of {workload}, {mode}"
