"""Issue 39, part three, where the batch is: ``torch.compile`` with inputs shared by the batch,
models that move the batch to another dim inside (sequence-first layers in a batch-first model),
and TorchScript between layers.

Every step is checked against plain autograd on each sample alone, run on a copy of the model, in
float64, with ``clip_norm(C)`` on the whole model (C: the first step's median per-sample norm) and
``keep_grad_sample`` both ways, over steps with ``T == B`` and ``T != B`` on both sides of 16
positions (where weights start running detached).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import BatchMixingError, BatchSizeError, PerSampleModule, transforms
from pergrad._core.capture.dims import LOST, folded
from pergrad._core.shortcuts.shared import Provenance
from tests.reference import assert_close, clipped_mean

STEPS = [(4, 4), (3, 5), (17, 17), (2, 15), (16, 16), (3, 17)]  # (batch, length): T == B on half of them

Batch = Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def tokens(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 9, (b, t), generator=gen), torch.randint(0, 9, (b, t), generator=gen)


def features(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, t, 4, generator=gen, dtype=torch.float64)
    return x, torch.randn(b, 3, generator=gen, dtype=torch.float64)


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum")


def squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum()


def one_at_a_time(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss, dim: int = 0
) -> dict[str, torch.Tensor]:
    """``{name: [B, *p.shape]}``: plain autograd on each sample's own loss, one sample at a time (the
    batch of ``x`` on ``dim``, of ``y`` on dim 0)."""
    params = dict(model.named_parameters())
    rows = []
    for i in range(y.shape[0]):
        out = model(x.narrow(dim, i, 1))
        grads = torch.autograd.grad(loss(out, y[i : i + 1]), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def run(
    make: Callable[[], nn.Module],
    batch: Batch,
    loss: Loss,
    wrap: Callable[[PerSampleModule], Callable[[torch.Tensor], torch.Tensor]] | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    steps: list[tuple[int, int]] = STEPS,
) -> None:
    """Several steps through the wrapper (called through ``wrap(psm)``; ``prepare`` changes the model
    after the reference copy is made): every step's ``grad_sample``, clipped ``.grad`` and norms
    against ``one_at_a_time`` on the copy, with and without ``keep_grad_sample``."""
    for keep in (True, False):
        torch.manual_seed(0)
        model = make().double()
        plain = copy.deepcopy(model)
        if prepare is not None:
            prepare(model)
        gen = torch.Generator().manual_seed(1)
        with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
            forward = psm if wrap is None else wrap(psm)
            bound = None
            for step, (b, t) in enumerate(steps):
                x, y = batch(b, t, gen)
                ref = one_at_a_time(plain, x, y, loss)
                norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
                if bound is None:
                    bound = float(norms.median())
                    psm.register_transform(model, transforms.clip_norm(bound))
                want = clipped_mean(ref, bound)
                psm.zero_grad()
                (loss(forward(x), y) / b).backward()
                found = psm.per_sample_norms()
                for name, p in model.named_parameters():
                    what = f"keep={keep}, step {step} (B={b}, T={t}): {name}"
                    if keep:
                        assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
                    assert_close(p.grad, want[name], f".grad of {what}")
                    assert_close(found[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")


# -- torch.compile with inputs shared by the batch ------------------------------------------------


class Positions(nn.Module):
    """``pos(torch.arange(T))``: a position embedding whose input is shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(9, 5), nn.Embedding(24, 5), nn.Linear(5, 9)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tok(idx) + self.pos(torch.arange(idx.shape[1]))))


class Fourier(nn.Module):
    """A Linear on Fourier features built inside the forward, ``sin(arange(T)[:, None] * f)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fourier, self.out = nn.Linear(4, 4), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(6, dtype=x.dtype) / 6)
        waves = torch.sin(torch.arange(x.shape[1], dtype=x.dtype)[:, None] * freqs)  # [T, 6]
        return self.out(torch.tanh(self.inp(x) + self.fourier(waves))).mean(1)


@pytest.fixture
def dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("dynamo")
@pytest.mark.parametrize(("make", "batch", "loss"), [(Positions, tokens, token_loss), (Fourier, features, squared)])
def test_compiled_model_with_inputs_shared_by_the_batch(
    make: Callable[[], nn.Module], batch: Batch, loss: Loss
) -> None:
    """The compiled model's forward runs eagerly under pergrad's tracking: exact from step 0."""
    run(make, batch, loss, wrap=lambda psm: torch.compile(psm, backend="aot_eager"))


@pytest.mark.usefixtures("dynamo")
def test_compiled_model_with_inductor() -> None:
    run(Positions, tokens, token_loss, wrap=lambda psm: torch.compile(psm, backend="inductor"), steps=STEPS[:3])


class CompiledInside(nn.Module):
    """A block compiled on its own (``module.compile()``) after a shared position embedding, and
    Fourier features from a function compiled (and run once) before the model was wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.fourier = nn.Embedding(24, 4), nn.Linear(6, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = x + self.pos(torch.arange(t)) + self.fourier(fourier_features(t, x.dtype))
        return self.block(h).mean(1)


@torch.compile(backend="aot_eager")
def fourier_features(t: int, dtype: torch.dtype) -> torch.Tensor:
    freqs = torch.exp(-torch.arange(6, dtype=dtype) / 6)
    return torch.sin(torch.arange(t, dtype=dtype)[:, None] * freqs)


@pytest.mark.usefixtures("dynamo")
def test_compiled_submodules_and_functions_inside_the_model() -> None:
    fourier_features(4, torch.float64)  # compiled code cached without pergrad's tracking

    def compile_block(model: nn.Module) -> None:
        assert isinstance(model, CompiledInside)
        model.block.compile(backend="aot_eager")

    run(CompiledInside, features, squared, prepare=compile_block)


# -- the batch moved to another dim inside the model ------------------------------------------------


class TransposedLinear(nn.Module):
    """Plain Linears on ``[T, B, D]``: ``x.transpose(0, 1)`` inside a batch-first model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x.transpose(0, 1)))).transpose(0, 1).mean(1)


class SequenceFirstEncoder(nn.Module):
    """``nn.TransformerEncoderLayer(batch_first=False)`` on the transposed batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x).transpose(0, 1)).transpose(0, 1)).mean(1)


class SequenceFirstLSTM(nn.Module):
    """``nn.LSTM`` (default ``batch_first=False``) and a bidirectional GRU on the transposed batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru, self.out = nn.LSTM(4, 5), nn.GRU(5, 3, bidirectional=True), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x.transpose(0, 1))
        h, last = self.gru(h)
        return self.out(h.mean(0)) + last.sum(0).sum(-1, keepdim=True)


class MovedAttention(nn.Module):
    """``nn.MultiheadAttention(batch_first=False)`` on ``x.movedim(1, 0)``, read back through ``.mT``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.att, self.out = nn.Linear(4, 8), nn.MultiheadAttention(8, 2), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).movedim(1, 0)
        a, _ = self.att(h, h, h, need_weights=False)
        return self.out(a.mT.permute(2, 0, 1)).mean(1)


class EinsumTranspose(nn.Module):
    """The batch moved by ``einsum`` and a hand-written recurrence over ``[T, B, D]`` slices."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rec, self.out = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 5, dtype=x.dtype)
        for x_t in torch.einsum("btd->tbd", self.inp(x)):
            h = torch.tanh(x_t + self.rec(h))
        return self.out(h)


class FoldedBetweenLayers(nn.Module):
    """The batch folded into the rows and unfolded again between layers (``x.view(-1, D)``, then
    ``.view(B, T, D)``), and ``h.mean(1)`` pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = F.gelu(self.a(x).reshape(-1, 6)).view(b, t, 6)
        return self.b(h).mean(1)


class SequenceFirstPositions(nn.Module):
    """A position embedding shared by the batch, added to the transposed batch ``[T, B, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(9, 6), nn.Embedding(24, 6)
        self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 9)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx).transpose(0, 1) + self.pos(torch.arange(idx.shape[1])).unsqueeze(1)
        return self.head(torch.tanh(self.lin(h))).transpose(0, 1)


@pytest.mark.parametrize(
    ("make", "batch", "loss"),
    [
        (TransposedLinear, features, squared),
        (SequenceFirstEncoder, features, squared),
        (SequenceFirstLSTM, features, squared),
        (MovedAttention, features, squared),
        (EinsumTranspose, features, squared),
        (FoldedBetweenLayers, features, squared),
        (SequenceFirstPositions, tokens, token_loss),
    ],
)
def test_the_batch_moved_inside_the_model(make: Callable[[], nn.Module], batch: Batch, loss: Loss) -> None:
    run(make, batch, loss)


@pytest.mark.usefixtures("dynamo")
def test_the_batch_moved_inside_a_compiled_model() -> None:
    run(SequenceFirstEncoder, features, squared, wrap=lambda psm: torch.compile(psm, backend="aot_eager"))


class BatchFirstInside(nn.Module):
    """A sequence-first model (``batch_first=False`` wrapper) with a batch-first LSTM inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, B, D]
        return self.out(self.lstm(x.transpose(0, 1))[0].mean(1))


def test_a_batch_first_layer_in_a_sequence_first_model() -> None:
    torch.manual_seed(2)
    model = BatchFirstInside().double()
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with PerSampleModule(model, batch_first=False) as psm:
        for b, t in STEPS:
            x, y = torch.randn(t, b, 4, generator=gen, dtype=torch.float64), torch.randn(b, 3, generator=gen)
            ref = one_at_a_time(plain, x, y.double(), squared, dim=1)
            psm.zero_grad()
            (squared(psm(x), y.double()) / b).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"B={b}, T={t}: {name}")


# -- what is refused, and the fix each message names ------------------------------------------------


class ConvOnMovedBatch(nn.Module):
    def __init__(self, back: bool) -> None:
        super().__init__()
        self.back, self.lin, self.conv = back, nn.Linear(4, 4), nn.Conv1d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, 4]
        h = self.lin(x).transpose(0, 1)  # [T, B, 4]
        h = h.movedim(1, 0) if self.back else h  # the fix: the batch back on dim 0
        return self.conv(h.transpose(-1, -2)).mean((-1, -2)).unsqueeze(1).expand(-1, 3)


class LayoutMismatch(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.LSTM(4, 3, batch_first=True) if kind == "lstm" else nn.MultiheadAttention(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "lstm":
            return self.layer(x.transpose(0, 1))[0].sum(0)[:, :3]
        return self.layer(x, x, x)[0].mean(1)[:, :3]


class Strided(nn.Module):
    """The batch moved by ``as_strided``, which pergrad does not follow."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).contiguous()
        b, t, d = h.shape
        return self.b(h.as_strided((t, b, d), (d, t * d, 1))).mean(0)


def refused(model: nn.Module, x: torch.Tensor, error: type[Exception], match: str) -> None:
    with PerSampleModule(model) as psm, pytest.raises(error, match=match):
        psm(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_layer_with_a_fixed_layout_on_a_moved_batch_is_refused() -> None:
    match = (
        r"^layer 'conv' \(Conv1d\) takes the batch on dim 0 of its input, but the model's forward moved it to dim 2 "
        r"\(input shape \(4, 4, 4\), e\.g\. by x\.transpose\(0, 1\)\).*\(x\.movedim\(2, 0\)\)"
    )
    refused(ConvOnMovedBatch(back=False).double(), torch.randn(4, 4, 4, dtype=torch.float64), BatchSizeError, match)
    run(lambda: ConvOnMovedBatch(back=True), features, squared, steps=STEPS[:4])  # the fix


@pytest.mark.parametrize(("b", "t"), [(4, 4), (3, 5)])
def test_a_layer_whose_own_layout_takes_another_dim_for_the_batch_is_refused(b: int, t: int) -> None:
    x = torch.randn(b, t, 4, dtype=torch.float64)
    lstm = r"^layer 'layer' \(LSTM\) has batch_first=True, so it takes dim 0 of its input for the batch, but the "
    refused(LayoutMismatch("lstm").double(), x, BatchMixingError, lstm + r"model's forward gives it the batch on dim 1")
    attention = r"^layer 'layer' \(MultiheadAttention\) has batch_first=False.*batch on dim 0.*batch_first=True"
    refused(LayoutMismatch("attention").double(), x, BatchMixingError, attention)


def test_a_batch_moved_by_an_op_pergrad_does_not_follow() -> None:
    square = (
        r"^layer 'b' \(Linear\) got an input of shape \(4, 4, 4\).*lost track of where the batch is in it at the op "
    )
    refused(Strided().double(), torch.randn(4, 4, 4, dtype=torch.float64), BatchSizeError, square + "as_strided")
    other = r"^layer 'b' \(Linear\) got input of shape \(5, 3, 4\).*lost track of the batch at the op as_strided"
    refused(Strided().double(), torch.randn(3, 5, 4, dtype=torch.float64), BatchSizeError, other)


@torch.jit.script
def scripted(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


def plain_python(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


class Activation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2.0


class BetweenLayers(nn.Module):
    """An activation between two Linears: a TorchScript function or module, or plain Python (the fix)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.act: Callable[[torch.Tensor], torch.Tensor] = plain_python
        if how == "function":
            self.act = scripted
        elif how == "module":
            self.act = torch.jit.script(Activation())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x))).mean(1)


class ScriptedResidual(nn.Module):
    """A TorchScript function whose output is added to the batch before the next layer: exact."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + scripted(h)).mean(1)


@pytest.mark.parametrize("how", ["function", "module"])
@pytest.mark.parametrize(("b", "t"), [(4, 4), (3, 5)])
def test_torchscript_between_layers_is_refused_with_its_cause(how: str, b: int, t: int) -> None:
    match = (
        rf"^layer 'b' \(Linear\) got an input of shape \({b}, {t}, 6\) computed by code whose ops pergrad does not "
        r"see run \(TorchScript: a torch\.jit\.script or torch\.jit\.trace function or module.*Call the plain Python "
        "function or module instead"
    )
    refused(BetweenLayers(how).double(), torch.randn(b, t, 4, dtype=torch.float64), BatchSizeError, match)


def test_torchscript_fixed_or_combined_with_the_batch_is_exact() -> None:
    run(lambda: BetweenLayers("python"), features, squared, steps=STEPS[:4])
    run(ScriptedResidual, features, squared, steps=STEPS[:4])


# -- where Provenance puts the batch, op by op ---------------------------------------------------------

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(1, 2, 0),
    "movedim": lambda x: torch.movedim(x, 0, -1),
    "swapaxes": lambda x: x.swapaxes(1, 0),
    "mT": lambda x: x.transpose(0, 2).mT,
    "T": lambda x: x.flatten(1).T,
    "view": lambda x: x.view(x.shape[0], -1),
    "flatten and unflatten": lambda x: x.flatten(0, 1).unflatten(0, x.shape[:2]),
    "folded, elementwise, unfolded": lambda x: (x.transpose(0, 1).reshape(-1, x.shape[2]) * 2).view(
        x.shape[1], x.shape[0], -1
    ),
    "slice": lambda x: x[:, 1:],
    "index": lambda x: x[None, :, 0],
    "ellipsis": lambda x: x[..., 0].transpose(0, 1),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "einsum": lambda x: torch.einsum("btd->dtb", x),
    "sum": lambda x: x.sum(1),
    "mean keepdim": lambda x: x.transpose(0, 2).mean(0, keepdim=True),
    "stack": lambda x: torch.stack([x, x], 1),
    "unbind": lambda x: x.transpose(0, 1).unbind(0)[0],
    "max": lambda x: x.transpose(0, 1).max(0).values,
    "broadcast": lambda x: x.transpose(0, 1)[:, :, None] + torch.ones(2, 1),
    "matmul": lambda x: x.transpose(0, 1) @ torch.ones(x.shape[2], 2),
    "advanced, on the batch": lambda x: x[
        torch.arange(x.shape[0])[:, None, None], torch.arange(x.shape[1])[None, None]
    ],
    "advanced, on positions": lambda x: x.transpose(0, 1)[torch.tensor([[0], [2]])],
    "advanced, apart": lambda x: x.transpose(0, 1)[[0, 1], :, torch.tensor([1, 0])],
    "rows expanded over positions": lambda x: x[
        torch.arange(x.shape[0])[:, None].expand(-1, x.shape[1]), torch.arange(x.shape[1]).expand(x.shape[0], -1)
    ],
    "last token of each sample": lambda x: x[torch.arange(x.shape[0]), torch.full((x.shape[0],), x.shape[1] - 1)],
    "a mask on positions": lambda x: x.transpose(1, 2)[:, :, torch.arange(x.shape[1]) % 3 == 0],
}


def tracked(op: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int, int]) -> tuple[int, tuple[int, ...]]:
    x = torch.randn(shape)
    with Provenance([(x, 0)], [], shape[0]) as found:
        y = op(x)
    return found.where(y), tuple(y.shape)


@pytest.mark.parametrize("name", list(OPS))
def test_the_batch_dim_is_followed_through_ops(name: str) -> None:
    """With sizes that tell the dims apart, where the batch went is the one dim of its size; with
    ``T == B`` (and ``D == B``), pergrad puts it on the same dim."""
    dim, shape = tracked(OPS[name], (3, 5, 7))
    assert shape.count(3) == 1 and dim == shape.index(3), (dim, shape)
    assert tracked(OPS[name], (4, 4, 4))[0] == dim
    assert tracked(OPS[name], (4, 4, 7))[0] == dim


def test_a_fold_that_is_not_undone_is_not_a_dim() -> None:
    assert folded(tracked(lambda x: x.reshape(-1), (3, 5, 7))[0])
    assert tracked(lambda x: x[0], (4, 4, 4))[0] == LOST  # one sample picked out
    assert tracked(lambda x: x.sum(0), (4, 4, 4))[0] == LOST
    assert tracked(lambda x: x[torch.tensor([True, False, True, True])], (4, 4, 4))[0] == LOST  # folded by a mask
    assert tracked(lambda x: x[torch.tensor(1), :, torch.tensor([0, 1])], (4, 4, 4))[0] == LOST  # a 0-dim int selects
    rows = torch.arange(4)[:, None].expand(4, 4).clone()  # samples on two dims at once, as far as shapes tell;
    assert tracked(lambda x: x[rows, rows.T], (4, 4, 4))[0] == 0  # the values tell: row i of x in row i
    assert tracked(lambda x: x[rows.T, rows], (4, 4, 4))[0] == 1  # (x[j, i]: the batch moved to dim 1)


def _index_item(kind: str, size: int, width: int, gen: torch.Generator, rows: bool) -> object:
    """An index item of ``kind`` for a dim of ``size``; a tensor of rank ``width`` varying along one dim
    (``rows``: ``arange(size)`` there, the samples in order)."""
    if kind == "slice":
        return slice(None)
    if kind == "int":
        return int(torch.randint(size, (), generator=gen))
    if kind == "0-dim":
        return torch.randint(size, (), generator=gen)
    if kind == "list":
        return list(range(size)) if rows else torch.randint(size, (size,), generator=gen).tolist()
    if kind == "mask":
        mask = torch.rand(size, generator=gen) < 0.6
        mask[0] = True
        return mask
    shape = [1] * width
    shape[int(torch.randint(width, (), generator=gen))] = size
    return torch.arange(size).view(shape) if rows else torch.randint(size, tuple(shape), generator=gen)


@pytest.mark.parametrize("seed", range(4))
def test_advanced_indexing_puts_the_batch_where_torch_does(seed: int) -> None:
    """Random indexes (slices, ints, ``None``, ``...``, lists, masks, 0-dim tensors and index tensors) on a
    tensor whose dims all have the batch's size, the batch on any of them: the dim ``Provenance`` names
    holds sample i's values (i) at its i-th entry, the batch indexed by ``arange(B)`` along one dim where an
    index picks from it; LOST only where an int or a mask does."""
    gen = torch.Generator().manual_seed(seed)
    b, checked = 4, 0
    kinds = ["slice", "int", "0-dim", "tensor", "list", "mask", "tensor"]
    for _ in range(80):
        rank = int(torch.randint(2, 5, (), generator=gen))
        k = int(torch.randint(rank, (), generator=gen))
        x = torch.arange(b).double().view(*[-1 if d == k else 1 for d in range(rank)]).expand(*[b] * rank)
        width = int(torch.randint(1, 3, (), generator=gen))
        picked = [kinds[int(torch.randint(len(kinds), (), generator=gen))] for _ in range(rank)]
        if not {"tensor", "list", "mask"} & set(picked):
            picked[int(torch.randint(rank, (), generator=gen))] = "tensor"
        items: list[object] = [_index_item(kind, b, width, gen, d == k) for d, kind in enumerate(picked)]
        for _ in range(int(torch.randint(3, (), generator=gen))):
            new = None if torch.rand((), generator=gen) < 0.7 else torch.tensor(True)  # (a dim of 1)
            items.insert(int(torch.randint(len(items) + 1, (), generator=gen)), new)
        if items[-1] == slice(None) and torch.rand((), generator=gen) < 0.5:
            items[-1] = ...
        index = tuple(items)
        try:
            x[index]
        except IndexError:  # (a mask's count that the other index tensors do not broadcast with)
            continue
        with Provenance([(x, k)], [], b) as found:
            result = x[index]
        at = found.where(result)
        if at == LOST:
            assert picked[k] in ("int", "0-dim", "mask"), (index, k)
            continue
        checked += 1
        rows = torch.arange(b).double().view(*[-1 if d == at else 1 for d in range(result.dim())])
        assert result.shape[at] == b and torch.equal(result, rows.expand_as(result)), (index, k, at)
    assert checked > 20
