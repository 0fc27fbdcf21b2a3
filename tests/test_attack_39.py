"""An adversarial review of issue 39's fixes ("never silently wrong, part three"): cases researchers
would write, combining what the fixes covered one at a time (torch.compile, a batch moved inside the
model, forward hooks, penalties, checkpointing, moves and copies, HF and timm-like models).

Every step is checked against an independent reference: plain autograd on each sample's own loss,
one sample at a time, on a ``copy.deepcopy`` of the model as it is at that step (the user's hooks
copied with it), in float64; ``clip_norm`` at the step's median per-sample norm where a transform is
registered, ``keep_grad_sample`` both ways where it matters, an optimizer step between steps. A case
passes when it is exact or refused with an error naming the real cause; a failing case is a finding.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pergrad import (
    BatchMixingError,
    BatchSizeError,
    PerSampleModule,
    SecondOrderError,
    UnsupportedLayerError,
    transforms,
)

Losses = Callable[[nn.Module, Tensor, Tensor, int], Tensor]  # (model, x, y, step) -> each sample's loss, [b]
Batch = Callable[[int], tuple[Tensor, Tensor]]  # step -> (x, y)

MIXED = [(4, 4), (3, 5), (16, 16), (2, 15), (17, 17), (3, 17), (1, 1)]  # (batch, length): T == B on half


pytestmark = pytest.mark.usefixtures("float64")  # conftest.py: float64 the default dtype in every test


@pytest.fixture
def dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def close(actual: Tensor | None, expected: Tensor, what: str) -> None:
    if actual is None:
        assert not expected.abs().max() > 0, f"{what}: None, expected nonzero (max {expected.abs().max():.3g})"
        return
    torch.testing.assert_close(actual.double(), expected, rtol=1e-8, atol=1e-10, msg=lambda m: f"{what}: {m}")


def reference(model: nn.Module, losses: Losses, x: Tensor, y: Tensor, step: int, dim: int = 0) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: each sample's own loss through a deep copy of the model, alone."""
    for m in model.modules():  # a graph kept from the last forward (features for a penalty) is not copied
        if getattr(m, "features", None) is not None:
            m.features = None
    copied = copy.deepcopy(model)
    named = [(n, p) for n, p in copied.named_parameters() if p.requires_grad]
    rows: dict[str, list[Tensor]] = {n: [] for n, _ in named}
    for i in range(y.shape[0]):
        for _, p in named:
            p.grad = None
        losses(copied, x.narrow(dim, i, 1), y[i : i + 1], step).sum().backward()  # reentrant checkpoints too
        for n, p in named:
            rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
    return {n: torch.stack(g) for n, g in rows.items()}


def norms_of(ref: dict[str, Tensor]) -> Tensor:
    return torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()


def clipped_mean(ref: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    factor = (bound / norms_of(ref)).clamp(max=1)
    return {n: (g * factor.view(-1, *[1] * (g.dim() - 1))).mean(0) for n, g in ref.items()}


def check(
    psm: PerSampleModule,
    model: nn.Module,
    ref: dict[str, Tensor],
    expected: dict[str, Tensor],
    what: str,
    *,
    keep: bool,
    norms: bool = True,
) -> None:
    found = psm.per_sample_norms() if norms else {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        close(p.grad, expected[name], f".grad of {what}: {name}")
        if keep:
            close(getattr(p, "grad_sample", None), ref[name], f"grad_sample of {what}: {name}")
        if norms and (p.grad is not None or ref[name].abs().max() > 0):  # no norm of a parameter without a gradient
            close(found[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}: {name}")


def train(
    model: nn.Module,
    losses: Losses,
    batch: Batch,
    steps: int,
    *,
    keep: bool = True,
    clip: bool = True,
    forward: Callable[[PerSampleModule], nn.Module] | None = None,
    before: Callable[[int, PerSampleModule], None] | None = None,
    dim: int = 0,
    lr: float = 0.05,
    **options: object,
) -> PerSampleModule:
    """``steps`` training steps (an SGD update between them), each checked against ``reference``:
    ``.grad`` (clipped at the step's median per-sample norm where ``clip``), ``grad_sample`` and the
    per-sample norms. ``forward(psm)`` is what the loss calls (the model by default)."""
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=True, **options)  # type: ignore[arg-type]
    clipper = transforms.clip_norm(1.0)
    if clip:
        psm.register_transform(model, clipper)
    called = model if forward is None else forward(psm)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        if before is not None:
            before(step, psm)
        x, y = batch(step)
        ref = reference(model, losses, x, y, step, dim)
        clipper.max_norm = float(norms_of(ref).median())
        expected = clipped_mean(ref, clipper.max_norm) if clip else {n: g.mean(0) for n, g in ref.items()}
        opt.zero_grad()
        losses(called, x, y, step).mean().backward()
        check(psm, model, ref, expected, f"step {step} (x {tuple(x.shape)})", keep=keep)
        opt.step()
    return psm


def sequences(sizes: list[tuple[int, int]], features: int = 4, outputs: int = 3, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    made = [(torch.randn(b, t, features, generator=gen), torch.randn(b, outputs, generator=gen)) for b, t in sizes]
    return lambda step: made[step]


def token_batches(sizes: list[tuple[int, int]], vocab: int = 11, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    made = [
        (torch.randint(0, vocab, (b, t), generator=gen), torch.randint(0, vocab, (b, t), generator=gen))
        for b, t in sizes
    ]
    return lambda step: made[step]


def squared(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
    return (m(x) - y).pow(2).flatten(1).sum(1)


def token_loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
    logits = m(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").sum(1)


# -- torch.compile combined with a batch moved inside ------------------------------------------------


class SeqFirstLSTM(nn.Module):
    """Tokens plus ``pos(arange(T))`` (shared by the batch), transposed into a default ``nn.LSTM``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(11, 6), nn.Embedding(24, 6)
        self.lstm, self.head = nn.LSTM(6, 5), nn.Linear(5, 11)

    def forward(self, idx: Tensor) -> Tensor:
        h = (self.tok(idx) + self.pos(torch.arange(idx.shape[1]))).transpose(0, 1)  # [T, B, 6]
        return self.head(self.lstm(h)[0]).transpose(0, 1)


@pytest.mark.usefixtures("dynamo")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_sequence_first_lstm_with_shared_positions(backend: str) -> None:
    torch.manual_seed(0)
    model = SeqFirstLSTM()
    sizes = [(4, 4), (3, 5), (5, 5), (2, 3)]
    train(model, token_loss, token_batches(sizes), len(sizes), forward=lambda psm: torch.compile(psm, backend=backend))


class PaddedEncoder(nn.Module):
    """A sequence-first ``TransformerEncoderLayer`` with a ``src_key_padding_mask`` ``[B, T]`` and a
    causal mask, the batch moved by ``transpose`` (the mask keeps it on dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        lengths = (x[:, :, 0].detach().abs() * 0 + 1).sum(1).long() - (torch.arange(b) % 2)  # odd samples: one pad
        pad = torch.arange(t)[None, :] >= lengths[:, None]  # [B, T]
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.enc(self.inp(x).transpose(0, 1), src_mask=causal, src_key_padding_mask=pad)
        return self.out(h[0])  # the first position of each sample (never padded)


def test_sequence_first_encoder_with_padding_and_causal_masks() -> None:
    torch.manual_seed(1)
    train(PaddedEncoder(), squared, sequences(MIXED[:6]), 6)


@pytest.mark.usefixtures("dynamo")
def test_sequence_first_encoder_with_masks_compiled_inside_after_wrapping() -> None:
    torch.manual_seed(1)
    model = PaddedEncoder()

    def compile_inside(step: int, psm: PerSampleModule) -> None:
        if step == 1:
            model.enc.compile(backend="aot_eager")

    sizes = [(4, 4), (4, 4), (3, 5), (5, 5)]
    train(model, squared, sequences(sizes), len(sizes), before=compile_inside)


@pytest.mark.usefixtures("dynamo")
def test_compiled_with_fullgraph_is_exact_or_refused_naming_pergrad() -> None:
    torch.manual_seed(2)
    model = SeqFirstLSTM()
    sizes = [(4, 4), (3, 5)]
    try:
        train(
            model,
            token_loss,
            token_batches(sizes),
            len(sizes),
            forward=lambda psm: torch.compile(psm, backend="aot_eager", fullgraph=True),
        )
    except Exception as err:  # refused: the message must give the cause and a fix that works
        message = str(err)
        assert "reason: None" not in message, message[:600]
        assert "fullgraph" in message and "pergrad" in message, message[:600]


@pytest.mark.usefixtures("dynamo")
def test_compiled_with_dynamic_shapes_over_changing_batch_and_length() -> None:
    torch.manual_seed(3)
    model = SeqFirstLSTM()
    sizes = [(4, 4), (3, 5), (6, 6), (2, 7), (7, 7), (1, 1)]
    train(
        model,
        token_loss,
        token_batches(sizes),
        len(sizes),
        forward=lambda psm: torch.compile(psm.module, backend="aot_eager", dynamic=True),
    )


@pytest.mark.usefixtures("dynamo")
def test_compiled_with_reduce_overhead_mode() -> None:
    torch.manual_seed(4)
    model = PaddedEncoder()
    sizes = [(4, 4), (3, 5), (4, 4)]
    train(model, squared, sequences(sizes), len(sizes), forward=lambda psm: torch.compile(psm, mode="reduce-overhead"))


# -- the user's forward hooks: tuples, detached outputs, samples mixed ---------------------------------


class LSTMNet(nn.Module):
    """Linear, a batch-first LSTM whose output a hook may replace (a tuple), Linear on the last state."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lstm, self.out = nn.Linear(4, 5), nn.LSTM(5, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h, (last, _) = self.lstm(torch.tanh(self.inp(x)))
        return self.out(h.mean(1) + last[0])


SCALES = [1.0, 0.5, 2.0, 0.7, 1.3, 0.4]


@pytest.mark.parametrize("keep", [True, False])
def test_a_hook_replacing_an_lstm_output_tuple_with_a_rescaled_one(keep: bool) -> None:
    """``return (out * s, (h * s, c))``: a new tuple whose tensors are ops after the layer."""
    torch.manual_seed(5)
    model = LSTMNet()
    scale = {"s": 1.0}

    def rescale(m: nn.Module, args: object, out: tuple[Tensor, tuple[Tensor, Tensor]]) -> object:
        seq, (h, c) = out
        return seq * scale["s"], (h * scale["s"], c)

    model.lstm.register_forward_hook(rescale)
    sizes = [(4, 4), (3, 5), (4, 16), (3, 17), (5, 15), (4, 4)]

    def before(step: int, psm: PerSampleModule) -> None:
        scale["s"] = SCALES[step]

    train(model, squared, sequences(sizes), len(sizes), keep=keep, before=before)


@pytest.mark.parametrize("keep", [True, False])
def test_a_hook_detaching_a_layers_output_on_some_steps(keep: bool) -> None:
    """A hook that returns ``out.detach()`` on steps 2 and 3 (a frozen trunk for two steps): the layers
    below get no gradient on those steps, and their weights ran detached before and after."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    frozen = {"on": False}
    model[2].register_forward_hook(lambda m, a, out: out.detach() if frozen["on"] else None)
    sizes = [(4, 15), (3, 16), (4, 17), (3, 16), (5, 16), (4, 1)]

    def before(step: int, psm: PerSampleModule) -> None:
        frozen["on"] = step in (2, 3)

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        return (m(x).mean(1) if x.dim() == 3 else m(x)).sub(y).pow(2).sum(1)

    data = sequences([(b, t) for b, t in sizes])
    train(
        model,
        loss,
        lambda s: (data(s)[0][:, 0] if sizes[s][1] == 1 else data(s)[0], data(s)[1]),
        6,
        keep=keep,
        before=before,
    )


# -- stochastic depth that skips a block, penalties on features -------------------------------------------


class Residual(nn.Module):
    """Three pre-norm residual blocks on ``[B, T, D]``; ``skip`` names the blocks not called this step
    (stochastic depth deciding per batch, as many implementations do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)) for _ in range(3)
        )
        self.out = nn.Linear(6, 3)
        self.skip: set[int] = set()
        self.features: Tensor | None = None
        self.checkpointed: bool | None = None  # each block checkpointed: None (not), use_reentrant=False/True

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for k, block in enumerate(self.blocks):
            if k not in self.skip:
                if self.checkpointed is None:
                    h = h + block(h) / (1 - 0.3)
                else:
                    h = h + checkpoint(block, h, use_reentrant=self.checkpointed) / (1 - 0.3)
        self.features = h
        return self.out(h).mean(1)


SKIPS = [set(), {1}, {0, 2}, set(), {1}, {0, 1, 2}, set()]
POSITIONS = [(4, 15), (3, 16), (4, 17), (4, 4), (5, 16), (3, 17), (16, 16)]


@pytest.mark.parametrize("keep", [True, False])
def test_stochastic_depth_skipping_whole_blocks_on_some_steps(keep: bool) -> None:
    torch.manual_seed(8)
    model = Residual()

    def before(step: int, psm: PerSampleModule) -> None:
        model.skip = SKIPS[step]

    train(model, squared, sequences(POSITIONS), len(POSITIONS), keep=keep, before=before)


def feature_penalty(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
    """The squared error plus an L2 penalty on the last block's features, on odd steps only."""
    loss = (m(x) - y).pow(2).sum(1)
    model = m.module if isinstance(m, PerSampleModule) else m
    if step % 2:
        loss = loss + 0.1 * model.features.pow(2).flatten(1).sum(1)
    return loss


@pytest.mark.parametrize("keep", [True, False])
def test_a_penalty_on_intermediate_features_on_some_steps(keep: bool) -> None:
    torch.manual_seed(9)
    train(Residual(), feature_penalty, sequences(POSITIONS), len(POSITIONS), keep=keep)


def test_a_gradient_penalty_on_intermediate_features_on_a_later_step_is_refused() -> None:
    """``||d out / d h||^2`` for the features ``h`` (a Jacobian/smoothness penalty), added at step 2
    only, after the weights started running detached: refused before anything is written."""
    torch.manual_seed(10)
    model = Residual()

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        out = m(x)
        each = (out - y).pow(2).sum(1)
        if step == 2:
            feats = (m.module if isinstance(m, PerSampleModule) else m).features
            (g,) = torch.autograd.grad(out.sum(), feats, create_graph=True)
            each = each + 0.1 * g.pow(2).flatten(1).sum(1)
        return each

    batch = sequences(POSITIONS)
    psm = train(model, loss, batch, 2)
    x, y = batch(2)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(SecondOrderError, match=r"penalty|create_graph"):
        loss(model, x, y, 2).mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, before[n]), f"{n}: .grad written before the refusal"
    psm.remove()


# -- gradient checkpointing combined ---------------------------------------------------------------------


class CheckpointedSeqFirst(nn.Module):
    """A checkpointed segment on the transposed batch ``[T, B, D]``: a Linear, or a sequence-first
    encoder layer and a Linear."""

    def __init__(self, kind: str, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False) if kind == "encoder" else None
        self.mid, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def segment(self, h: Tensor) -> Tensor:
        h = h.transpose(0, 1)
        if self.enc is not None:
            h = self.enc(h)
        return torch.tanh(self.mid(h))  # [T, B, 8]

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.segment, self.inp(x), use_reentrant=self.reentrant)
        return self.out(h.transpose(0, 1)).mean(1)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["linear", "encoder"])
@pytest.mark.parametrize("keep", [True, False])
def test_checkpointed_sequence_first_segment(reentrant: bool, kind: str, keep: bool) -> None:
    """Steps with ``T == B`` first, then ``T != B``."""
    torch.manual_seed(11)
    sizes = [(4, 4), (5, 5), (16, 16), (3, 5), (2, 15), (3, 17)]
    train(CheckpointedSeqFirst(kind, reentrant), squared, sequences(sizes), len(sizes), keep=keep)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_with_a_rescaling_hook_and_stochastic_depth(reentrant: bool) -> None:
    torch.manual_seed(12)
    model = Residual()
    scale = {"s": 1.0}
    for block in model.blocks:
        block[1].register_forward_hook(lambda m, a, out: out * scale["s"])
    model.checkpointed = reentrant

    def before(step: int, psm: PerSampleModule) -> None:
        scale["s"], model.skip = SCALES[step % len(SCALES)], SKIPS[step]

    train(model, squared, sequences(POSITIONS), len(POSITIONS), before=before)


# -- evaluation batches, checkpoints, optimizers and EMA copies between steps --------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_validation_forwards_with_grad_on_between_steps(keep: bool) -> None:
    """A validation loss computed without ``torch.no_grad`` (never backpropagated), in eval mode and in
    train mode, on batches of other sizes (``T == B`` among them), before each training step's forward,
    and between its forward and its backward."""
    torch.manual_seed(13)
    model = SeqFirstLSTM()
    val = token_batches([(5, 5), (7, 3), (2, 2), (16, 16), (3, 9), (4, 4)], seed=7)
    sizes = [(4, 4), (3, 5), (16, 16), (2, 15), (5, 5), (3, 17)]
    data = token_batches(sizes)
    held: list[Tensor] = []

    def before(step: int, psm: PerSampleModule) -> None:
        model.eval()
        held.append(token_loss(model, *val(step), step).mean())  # kept alive, never backpropagated
        model.train()

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        out = token_loss(m, x, y, step)
        if isinstance(m, SeqFirstLSTM) and m is model:  # between the training forward and its backward
            held.append(token_loss(m, *val(len(sizes) - 1 - step), step).mean())
        return out

    train(model, loss, data, len(sizes), keep=keep, before=before)


@pytest.mark.parametrize("assign", [False, True])
def test_a_checkpoint_loaded_between_steps(assign: bool) -> None:
    """``torch.save(model.state_dict())`` at step 2, two more steps, then the checkpoint loaded back
    (``load_state_dict``, with ``assign=True`` or not; the optimizer rebuilt on the model's parameters),
    and the steps go on from it; weights run detached throughout."""
    torch.manual_seed(14)
    model = Residual()
    psm = PerSampleModule(model, track_norms=True)
    clipper = transforms.clip_norm(1.0)
    psm.register_transform(model, clipper)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = sequences(POSITIONS)
    saved = io.BytesIO()
    for step in range(len(POSITIONS)):
        if step == 2:
            torch.save(model.state_dict(), saved)
        if step == 4:
            saved.seek(0)
            model.load_state_dict(torch.load(saved), assign=assign)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = data(step)
        ref = reference(model, squared, x, y, step)
        clipper.max_norm = float(norms_of(ref).median())
        opt.zero_grad()
        squared(model, x, y, step).mean().backward()
        check(psm, model, ref, clipped_mean(ref, clipper.max_norm), f"step {step}", keep=True)
        opt.step()
    psm.remove()


def test_two_optimizers_one_accumulating_over_two_steps() -> None:
    """The trunk's optimizer steps every step; the head's every second step, on the sum of two steps'
    clipped means (its ``zero_grad`` every second step)."""
    torch.manual_seed(15)
    model = Residual()
    psm = PerSampleModule(model, track_norms=True)
    clipper = transforms.clip_norm(1.0)
    psm.register_transform(model, clipper)
    head = list(model.out.parameters())
    trunk = [p for n, p in model.named_parameters() if not n.startswith("out.")]
    opt_trunk, opt_head = torch.optim.SGD(trunk, lr=0.05), torch.optim.Adam(head, lr=0.01)
    data = sequences(POSITIONS)
    pending = {n: torch.zeros_like(p) for n, p in model.out.named_parameters()}
    for step in range(len(POSITIONS)):
        x, y = data(step)
        ref = reference(model, squared, x, y, step)
        clipper.max_norm = float(norms_of(ref).median())
        want = clipped_mean(ref, clipper.max_norm)
        opt_trunk.zero_grad()
        if step % 2 == 0:
            opt_head.zero_grad()
            pending = {n: torch.zeros_like(p) for n, p in model.out.named_parameters()}
        squared(model, x, y, step).mean().backward()
        for n in pending:
            pending[n] = pending[n] + want[f"out.{n}"]
            want[f"out.{n}"] = pending[n]
        check(psm, model, ref, want, f"step {step}", keep=True, norms=False)
        opt_trunk.step()
        if step % 2 == 1:
            opt_head.step()
    psm.remove()


def test_a_mean_teacher_ema_copy_in_the_loss() -> None:
    """``AveragedModel`` (EMA) of the wrapped model as a teacher: a consistency term against its output
    (no gradient into it) on every step, its parameters updated after each optimizer step; and a
    second EMA kept by hand, ``ema.load_state_dict(model.state_dict())`` then lerped."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(16)
    model = Residual()
    teacher = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    by_hand = copy.deepcopy(model)
    by_hand.load_state_dict(model.state_dict())

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        with torch.no_grad():
            target = teacher(x) + by_hand(x)
        out = m(x)
        return (out - y).pow(2).sum(1) + 0.5 * (out - target).pow(2).sum(1)

    def before(step: int, psm: PerSampleModule) -> None:
        if step:
            teacher.update_parameters(model)
            with torch.no_grad():
                for e, p in zip(by_hand.parameters(), model.parameters(), strict=True):
                    e.lerp_(p, 0.2)

    train(model, loss, sequences(POSITIONS), len(POSITIONS), before=before)


class Reverse(torch.autograd.Function):
    """The gradient reversal layer of domain-adversarial training (DANN)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, lam: float) -> Tensor:  # type: ignore[override]
        ctx.lam = lam  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return -ctx.lam * g, None  # type: ignore[attr-defined]


class DANN(nn.Module):
    """A feature extractor on the transposed batch (Linears on ``[T, B, D]``), a label head, and a
    domain head behind a gradient reversal layer; a straight-through rounding on the features."""

    def __init__(self) -> None:
        super().__init__()
        self.feat, self.label, self.domain = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.feat(x.transpose(0, 1)))  # [T, B, 6]
        h = h + (torch.round(h * 4) / 4 - h).detach()  # straight-through quantisation
        pooled = h.mean(0)
        return self.label(pooled) + self.domain(Reverse.apply(pooled, 0.7))


@pytest.mark.parametrize("keep", [True, False])
def test_gradient_reversal_and_straight_through_on_a_moved_batch(keep: bool) -> None:
    torch.manual_seed(17)
    sizes = [(4, 4), (3, 5), (16, 16), (2, 15), (17, 17), (3, 17)]
    train(DANN(), squared, sequences(sizes), len(sizes), keep=keep)


# -- HuggingFace models with their own position ids and masks -----------------------------------------

HF_SIZES = [(4, 4), (3, 5), (5, 5), (2, 7), (3, 3)]


def padded(sizes: list[tuple[int, int]], vocab: int, seed: int = 0) -> Batch:
    """Left-padded token batches: ``x = [ids | mask]`` on the last dim (``[B, T, 2]``), labels ``-100`` at the
    padding; sample ``i`` has ``i % 3`` pads."""
    gen = torch.Generator().manual_seed(seed)
    made = []
    for b, t in sizes:
        ids = torch.randint(1, vocab, (b, t), generator=gen)
        mask = torch.ones(b, t, dtype=torch.long)
        for i in range(b):
            mask[i, : min(i % 3, t - 1)] = 0
        labels = ids.masked_fill(mask == 0, -100)
        made.append((torch.stack([ids * mask, mask], -1), labels))
    return lambda step: made[step]


def gpt2_padded_loss(explicit: str) -> Losses:
    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        ids, mask = x[..., 0], x[..., 1]
        if explicit == "cumsum":  # generation-style position ids, each sample's own ([B, T])
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        else:  # one row expanded over the batch
            position_ids = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = m(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]
        each = F.cross_entropy(logits.transpose(1, 2), y[:, 1:], reduction="none", ignore_index=-100)
        return each.sum(1)

    return loss


@pytest.mark.parametrize("explicit", ["cumsum", "expanded arange"])
@pytest.mark.parametrize("keep", [True, False])
def test_gpt2_left_padded_with_its_own_position_ids(explicit: str, keep: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(18)
    config = transformers.GPT2Config(
        vocab_size=23, n_positions=16, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config).double()
    train(model, gpt2_padded_loss(explicit), padded(HF_SIZES, 23), len(HF_SIZES), keep=keep)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bert_with_padding_token_types_and_gradient_checkpointing(checkpointing: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(19)
    config = transformers.BertConfig(
        vocab_size=23, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).double()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = padded(HF_SIZES, 23, seed=3)

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        ids, mask = x[..., 0], x[..., 1]
        types = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids)
        logits = m(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        return F.cross_entropy(logits, y[:, -1] % 3, reduction="none")

    train(model, loss, data, len(HF_SIZES))


# -- timm-like modules with raw parameters -------------------------------------------------------------


class LayerScaleBlock(nn.Module):
    """Pre-norm attention and MLP, each branch times a LayerScale ``gamma`` (raw parameters), and a
    per-sample drop path (each sample's branch kept or dropped, decided by ``self.keep``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.gamma1 = nn.Parameter(torch.full((dim,), 0.5))
        self.gamma2 = nn.Parameter(torch.full((dim,), 0.3))
        self.keep: Tensor | None = None

    def drop(self, branch: Tensor) -> Tensor:
        return branch if self.keep is None else branch * self.keep.view(-1, 1, 1) / 0.75

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.gamma1 * self.proj(a))
        return x + self.drop(self.gamma2 * self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class TinyViT(nn.Module):
    """Patch embedding (Conv2d), ``cls_token`` expanded and concatenated, ``pos_embed`` added, blocks
    with LayerScale, a head on the class token."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, 8) * 0.1)
        self.blocks = nn.Sequential(LayerScaleBlock(8), LayerScaleBlock(8))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, img: Tensor) -> Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)  # [B, P, 8]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        x = x + self.pos_embed[:, : x.shape[1]]
        return self.head(self.norm(self.blocks(x))[:, 0])


@pytest.mark.parametrize("keep", [True, False])
def test_a_tiny_vit_with_layer_scale_and_per_sample_drop_path(keep: bool) -> None:
    """Images of 2x2..8x8 patches: P + 1 tokens equal to the batch on some steps (5 = 4 + 1, 17 = 16 + 1)."""
    torch.manual_seed(20)
    model = TinyViT()
    shapes = [(5, 4), (3, 4), (17, 8), (2, 2), (10, 6), (4, 2)]  # (batch, image side): tokens (side / 2)^2 + 1
    gen = torch.Generator().manual_seed(4)
    made = [(torch.randn(b, 3, s, s, generator=gen), torch.randn(b, 3, generator=gen)) for b, s in shapes]
    kept = torch.Generator().manual_seed(5)

    def before(step: int, psm: PerSampleModule) -> None:
        b = shapes[step][0]
        for block in model.blocks:
            block.keep = None if step == 0 else (torch.rand(b, generator=kept) < 0.75).double()

    def loss(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        return (m(x) - y).pow(2).sum(1)

    # the reference runs one sample at a time: each block's keep mask is read at that sample's row
    def per_sample_keep(m: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
        if m is model or x.shape[0] == shapes[step][0]:
            return loss(m, x, y, step)
        row = int(per_sample_keep.row)  # type: ignore[attr-defined]
        masks = [blk.keep for blk in m.blocks]
        for blk in m.blocks:
            blk.keep = None if blk.keep is None else blk.keep[row : row + 1]
        try:
            return loss(m, x, y, step)
        finally:
            for blk, k in zip(m.blocks, masks, strict=True):
                blk.keep = k
            per_sample_keep.row += 1  # type: ignore[attr-defined]

    def prepared(step: int, psm: PerSampleModule) -> None:
        before(step, psm)
        per_sample_keep.row = 0  # type: ignore[attr-defined]

    train(model, per_sample_keep, lambda s: made[s], len(shapes), keep=keep, before=prepared)


class MaskedAttention(nn.Module):
    """Attention whose padding mask is built as HuggingFace's ``masking_utils`` builds it:
    ``padding_mask[batch_idx, kv_idx]`` with index tensors (advanced indexing), the padding read from
    the input (feature 0 equal to 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.out = nn.Linear(4, 24), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        keep = x[:, :, 0] != 0  # [B, T]
        mask = keep[torch.arange(b)[:, None, None, None], torch.arange(t)[None, None, None, :]].expand(b, 1, t, t)
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 8)
        return self.out(torch.tanh(self.proj(a)))[:, -1]


def test_an_attention_mask_built_by_advanced_indexing() -> None:
    """What makes the HF cases above refused, in plain torch: exact before the batch was followed
    by dim (963e21b^), refused at ``T == B`` since ("lost track of where the batch is ... __getitem__")."""
    torch.manual_seed(21)
    sizes = [(3, 5), (4, 4), (5, 5), (2, 6), (16, 16)]
    data = sequences(sizes)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        x, y = data(step)
        x = x.clone()
        x[1::2, 0, 0] = 0  # odd samples: the first position is padding
        return x, y

    train(MaskedAttention(), squared, batch, len(sizes))


# -- micro-batches, moves, copies and compile with hooks, on a moved batch ------------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_accumulate_samples_over_micro_batches_of_a_sequence_first_lstm(keep: bool) -> None:
    """``accumulate="samples"``: micro-batches of 3, 5 and 5 samples (``T == B`` on two), each its own
    backward, ``.grad`` the clipped mean over all 13 samples; then a second window of 4 and 1."""
    torch.manual_seed(22)
    model = SeqFirstLSTM()
    psm = PerSampleModule(model, accumulate="samples", keep_grad_sample=keep, track_norms=True)
    clipper = transforms.clip_norm(1.0)
    psm.register_transform(model, clipper)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    windows = [[(3, 4), (5, 5), (5, 3)], [(4, 4), (1, 6)]]
    for w, sizes in enumerate(windows):
        data = token_batches(sizes, seed=w)
        refs = [reference(model, token_loss, *data(k), 0) for k in range(len(sizes))]
        ref = {n: torch.cat([r[n] for r in refs]) for n in refs[0]}
        clipper.max_norm = float(norms_of(ref).median())
        want = clipped_mean(ref, clipper.max_norm)
        opt.zero_grad()
        for k in range(len(sizes)):
            token_loss(model, *data(k), 0).mean().backward()
            if keep:
                for n, p in model.named_parameters():
                    close(p.grad_sample, refs[k][n], f"window {w}, micro-batch {k}: grad_sample of {n}")
        for n, p in model.named_parameters():
            close(p.grad, want[n], f"window {w}: .grad of {n}")
        opt.step()
    psm.remove()


def test_a_half_round_trip_and_a_float32_autocast_step_between_float64_steps() -> None:
    """``model.half().double()`` before step 2 (new parameters, rounded); at step 4 a float32 copy of the
    model under bfloat16 autocast runs a validation forward through the wrapper's model (never
    backpropagated), and ``model.float().double()`` before step 5."""
    torch.manual_seed(23)
    model = TransposedEncoder()

    def before(step: int, psm: PerSampleModule) -> None:
        if step == 2:
            model.half().double()
        if step == 4:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(3, 3, 4))
        if step == 5:
            model.float().double()

    # the optimizer would hold the replaced parameters: plain SGD by hand on the current ones
    sizes = [(4, 4), (3, 5), (16, 16), (2, 15), (5, 5), (3, 17)]
    psm = PerSampleModule(model, track_norms=True)
    clipper = transforms.clip_norm(1.0)
    psm.register_transform(model, clipper)
    data = sequences(sizes)
    for step in range(len(sizes)):
        before(step, psm)
        x, y = data(step)
        ref = reference(model, squared, x, y, step)
        clipper.max_norm = float(norms_of(ref).median())
        for p in model.parameters():
            p.grad = None
        squared(model, x, y, step).mean().backward()
        check(psm, model, ref, clipped_mean(ref, clipper.max_norm), f"step {step}", keep=True)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    psm.remove()


class TransposedEncoder(nn.Module):
    """Linear, a sequence-first ``TransformerEncoderLayer`` on ``x.transpose(0, 1)``, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.enc(self.inp(x).transpose(0, 1)).transpose(0, 1)).mean(1)


def test_a_deep_copy_of_the_wrapper_mid_training_trains_a_moved_batch_exactly() -> None:
    """After two steps, ``copy.deepcopy(psm)``: the copy's model trains on ``T == B`` batches exactly, and
    the original goes on exactly too."""
    torch.manual_seed(24)
    model = TransposedEncoder()
    sizes = [(4, 4), (3, 5)]
    psm = train(model, squared, sequences(sizes), 2)
    twin = copy.deepcopy(psm)
    twin_model = twin.module
    assert twin_model is not model
    data = sequences([(5, 5), (16, 16), (2, 3)], seed=9)
    for which, (w, m) in enumerate([(twin, twin_model), (psm, model)]):
        for step in range(3):
            x, y = data(step)
            ref = reference(m, squared, x, y, step)
            w.zero_grad()
            squared(m, x, y, step).mean().backward()
            bound = w.registered_transforms()
            assert bound, "the copy lost its transform"
            clip = next(iter(bound.values()))
            check(
                w, m, ref, clipped_mean(ref, clip.max_norm), f"{'copy' if which == 0 else 'original'} {step}", keep=True
            )


@pytest.mark.usefixtures("dynamo")
def test_compiled_model_with_a_rescaling_forward_hook_and_a_pre_hook() -> None:
    """A forward hook rescaling the encoder's output (a schedule) and a forward pre-hook scaling the
    head's input, registered after wrapping, the model compiled (aot_eager) on a moved batch."""
    torch.manual_seed(25)
    model = TransposedEncoder()
    scale = {"s": 1.0}
    model.enc.register_forward_hook(lambda m, a, out: out * scale["s"])
    model.out.register_forward_pre_hook(lambda m, args: (args[0] * (2.0 - scale["s"]),))

    def before(step: int, psm: PerSampleModule) -> None:
        scale["s"] = SCALES[step]

    sizes = [(4, 4), (3, 5), (5, 5), (2, 15), (16, 16), (3, 17)]
    train(
        model,
        squared,
        sequences(sizes),
        len(sizes),
        before=before,
        forward=lambda psm: torch.compile(model, backend="aot_eager"),
    )


@pytest.mark.usefixtures("dynamo")
def test_compiled_checkpointed_blocks() -> None:
    """Non-reentrant checkpointing of each block, the model compiled (aot_eager), blocks skipped."""
    torch.manual_seed(26)
    model = Residual()
    model.checkpointed = False

    def before(step: int, psm: PerSampleModule) -> None:
        model.skip = SKIPS[step]

    train(
        model,
        squared,
        sequences(POSITIONS),
        len(POSITIONS),
        before=before,
        forward=lambda psm: torch.compile(model, backend="aot_eager"),
    )


@pytest.mark.parametrize("frozen", ["pos_embed and cls_token", "a block's qkv weight"])
def test_freezing_parameters_of_a_model_with_raw_root_parameters_mid_training(frozen: str) -> None:
    """timm's ``model.pos_embed.requires_grad_(False)`` at step 2, the class token at step 3, both
    trainable again at step 4; or gradual unfreezing of a block's Linear (frozen at steps 2 and 3).
    The model is wrapped again at each change: the root's raw parameters must still be split."""
    torch.manual_seed(27)
    model = TinyViT()
    shapes = [(5, 4), (17, 8), (3, 4), (5, 4), (2, 6)]
    gen = torch.Generator().manual_seed(4)
    made = [(torch.randn(b, 3, s, s, generator=gen), torch.randn(b, 3, generator=gen)) for b, s in shapes]

    def before(step: int, psm: PerSampleModule) -> None:
        if frozen == "pos_embed and cls_token":
            model.pos_embed.requires_grad_(step not in (2, 3))
            model.cls_token.requires_grad_(step != 3)
        else:
            model.blocks[0].qkv.weight.requires_grad_(step not in (2, 3))
        for p in model.parameters():
            p.grad = None

    psm = PerSampleModule(model, track_norms=True)
    clipper = transforms.clip_norm(1.0)
    psm.register_transform(model, clipper)
    for step in range(len(shapes)):
        before(step, psm)
        x, y = made[step]
        ref = reference(model, squared, x, y, step)
        clipper.max_norm = float(norms_of(ref).median())
        squared(model, x, y, step).mean().backward()
        check(psm, model, ref, clipped_mean(ref, clipper.max_norm), f"step {step}", keep=True)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.05 * p.grad
    psm.remove()


# -- sequence-first layers with packed sequences and per-sample masks -----------------------------------


class PackedSeqFirst(nn.Module):
    """A batch-first model that packs its transposed batch (``pack_padded_sequence`` on ``[T, B, D]``,
    lengths read from the input, unsorted) into a default two-layer ``nn.LSTM`` and a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.lstm, self.gru, self.out = nn.LSTM(5, 5, num_layers=2), nn.GRU(5, 4), nn.Linear(9, 3)

    def forward(self, x: Tensor) -> Tensor:
        lengths = (x[:, :, 0] != 0).sum(1).cpu()  # [B]: padding has feature 0 equal to 0, at the end
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # [T, B, 5]
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, enforce_sorted=False)
        seq, (last, _) = self.lstm(packed)
        _, g = self.gru(seq)
        padded_out, _ = nn.utils.rnn.pad_packed_sequence(seq, total_length=x.shape[1])  # [T, B, 5]
        return self.out(torch.cat([last[-1] + padded_out.sum(0), g[0]], -1))


@pytest.mark.parametrize("keep", [True, False])
def test_packed_sequences_into_sequence_first_recurrent_layers(keep: bool) -> None:
    torch.manual_seed(28)
    sizes = [(4, 4), (3, 5), (5, 5), (2, 7), (6, 6)]
    data = sequences(sizes)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        x, y = data(step)
        x = x.clone()
        for i in range(x.shape[0]):
            x[i, x.shape[1] - (i % 3) :, 0] = 0  # sample i: i % 3 padded positions at the end
        return x, y

    train(PackedSeqFirst(), squared, batch, len(sizes), keep=keep)


class PerSampleMaskAttention(nn.Module):
    """A sequence-first ``nn.MultiheadAttention`` with a ``key_padding_mask`` ``[B, T]`` and an
    ``attn_mask``: 3-D ``[B * heads, T, T]`` (each sample's own window, from its input), or the 2-D
    causal one."""

    def __init__(self, per_sample: bool) -> None:
        super().__init__()
        self.per_sample = per_sample
        self.inp, self.att, self.out = nn.Linear(4, 8), nn.MultiheadAttention(8, 2), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        distance = torch.arange(t)[:, None] - torch.arange(t)[None, :]
        if self.per_sample:
            window = (x[:, 0, 1].detach() > 0).long() + 1  # [B]: each sample looks back 1 or 2 positions
            blocked = ((distance < 0) | (distance > window[:, None, None])).repeat_interleave(2, 0)
        else:
            blocked = distance < 0
        pad = x[:, :, 0] == 0  # [B, T]
        h = self.inp(x).transpose(0, 1)
        a, _ = self.att(h, h, h, attn_mask=blocked, key_padding_mask=pad, need_weights=False)
        return self.out(a[-1])


def test_sequence_first_attention_with_per_sample_masks() -> None:
    """The 3-D mask is refused naming the layer and the cause, ``.grad`` untouched; the 2-D mask with
    the key padding mask is exact at ``T == B``."""
    torch.manual_seed(29)
    sizes = [(4, 4), (3, 5), (5, 5), (16, 16), (2, 7)]
    data = sequences(sizes)

    def batch(step: int) -> tuple[Tensor, Tensor]:
        x, y = data(step)
        x = x.clone()
        x[1::2, 0, 0] = 0  # odd samples: the first key is padding
        return x, y

    model = PerSampleMaskAttention(per_sample=True)
    with PerSampleModule(model), pytest.raises(UnsupportedLayerError, match=r"'att' \(MultiheadAttention\).*3-D"):
        squared(model, *batch(0), 0).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    train(PerSampleMaskAttention(per_sample=False), squared, batch, len(sizes))


# -- the batch moved before the model's own forward, and folded into rows -------------------------------


class SeqFirstBody(nn.Module):
    """A model whose forward takes ``[T, B, D]``: Linear, a default ``nn.LSTM``, Linear on the mean."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.lstm, self.out = nn.Linear(4, 6), nn.LSTM(6, 5), nn.Linear(5, 3)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.lstm(torch.tanh(self.inp(h)))[0].mean(0))


@pytest.mark.parametrize("registered", ["before wrapping", "after wrapping"])
def test_a_root_pre_hook_that_transposes_a_batch_first_input(registered: str) -> None:
    """``model.register_forward_pre_hook(lambda m, a: (a[0].transpose(0, 1),))``: the loader's
    batch-first ``[B, T, D]`` handed to a sequence-first model, the wrapper told ``batch_first=True``
    (what the caller passes). Exact whichever order the hooks were registered in, or refused naming
    the pre-hook (not the LSTM's ``batch_first``, which is right)."""
    torch.manual_seed(30)
    model = SeqFirstBody()

    def transpose(m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
        return (args[0].transpose(0, 1),)

    if registered == "before wrapping":
        model.register_forward_pre_hook(transpose)

    def before(step: int, psm: PerSampleModule) -> None:
        if registered == "after wrapping" and step == 0:
            model.register_forward_pre_hook(transpose)

    sizes = [(3, 5), (4, 4), (5, 3), (16, 16)]
    try:
        train(model, squared, sequences(sizes), len(sizes), before=before)
    except BatchMixingError as err:
        assert "hook" in str(err), str(err)


class WordLanguageModel(nn.Module):
    """pytorch/examples' ``word_language_model``: ``[T, B]`` tokens, a two-layer LSTM, and the decoder
    on ``output.view(-1, H)`` (the batch folded into the rows at a layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(11, 6), nn.LSTM(6, 5, 2), nn.Linear(5, 11)

    def forward(self, tokens: Tensor) -> Tensor:
        output, _ = self.rnn(self.encoder(tokens))
        return self.decoder(output.view(-1, 5)).view(output.size(0), output.size(1), -1)


@pytest.mark.parametrize(("t", "b"), [(5, 3), (4, 4)])
def test_the_word_language_model_folding_the_batch_at_its_decoder_is_refused(t: int, b: int) -> None:
    torch.manual_seed(31)
    model = WordLanguageModel()
    x, y = torch.randint(0, 11, (t, b)), torch.randint(0, 11, (t, b))
    with (
        PerSampleModule(model, batch_first=False),
        pytest.raises(BatchSizeError, match=rf"^layer 'decoder' \(Linear\) got input of shape \({t * b}, 5\).*batch"),
    ):
        F.cross_entropy(model(x).view(-1, 11), y.view(-1)).backward()
    assert all(p.grad is None for p in model.parameters())
