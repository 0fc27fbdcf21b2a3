"""nn.RNN / nn.GRU / nn.LSTM as they are, against per-sample autograd loops; a bidirectional LSTM
classifier wrapped unmodified (torch.func cannot vmap these layers, so the reference is a loop)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, UnsupportedLayerError, transforms
from tests.reference import assert_close, clipped_mean
from tests.test_fused import check_statistics


class Classifier(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], layers: int, bidirectional: bool, batch_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.rnn = cell(4, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)
        self.batch_first = batch_first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.rnn(self.emb(idx))[0]
        if self.batch_first:
            return self.head(out.mean(1))
        return self.head(out.mean(0, keepdim=True)).squeeze(0)  # keep the batch on dim 1 for the head


def per_sample_loop(
    model: nn.Module, idx: torch.Tensor, target: torch.Tensor, batch_dim: int
) -> dict[str, torch.Tensor]:
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(target.shape[0]):
        model.zero_grad()
        (model(idx.narrow(batch_dim, i, 1)) - target[i : i + 1]).pow(2).sum().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


@pytest.mark.parametrize(
    ("cell", "layers", "bidirectional", "batch_first"),
    [(nn.RNN, 1, False, True), (nn.GRU, 2, False, False), (nn.LSTM, 2, True, True), (nn.LSTM, 1, True, False)],
)
def test_recurrent_layers_match_per_sample_autograd(
    cell: type[nn.RNNBase], layers: int, bidirectional: bool, batch_first: bool
) -> None:
    torch.manual_seed(layers)
    model = Classifier(cell, layers, bidirectional, batch_first).double()
    idx = torch.randint(0, 11, (4, 6) if batch_first else (6, 4))
    target = torch.randn(4, 3, dtype=torch.float64)
    expected = per_sample_loop(model, idx, target, 0 if batch_first else 1)
    with PerSampleModule(model, loss_reduction="sum", batch_first=batch_first) as psm:
        psm.register_transform(model.rnn, transforms.clip_norm(0.5))
        (psm(idx) - target).pow(2).sum().backward()
        for n, p in model.named_parameters():
            assert_close(p.grad_sample, expected[n], n)
        rnn = {n: g for n, g in expected.items() if n.startswith("rnn.")}
        norms = torch.stack([g.flatten(1).square().sum(1) for g in rnn.values()]).sum(0).sqrt()
        factor = (0.5 / norms).clamp(max=1)
        for n, g in rnn.items():
            assert_close(model.get_parameter(n).grad, (g * factor.view(-1, *([1] * (g.dim() - 1)))).sum(0), n)


def test_recurrent_dropout_in_training_is_a_clear_error() -> None:
    """Refused in the forward (nothing is written); in eval mode the same model runs."""
    model = Classifier(nn.LSTM, 2, False, True)
    model.rnn.dropout = 0.5
    with PerSampleModule(model) as psm:
        with pytest.raises(
            UnsupportedLayerError,
            match=r"layer 'rnn' \(LSTM\): it draws a dropout mask between its layers \(dropout=0.5\) in training mode.*"
            r"model.get_submodule\('rnn'\).dropout = 0.0",
        ):
            psm(torch.randint(0, 11, (2, 3)))
        assert all(p.grad is None for p in model.parameters())
        model.eval()
        psm(torch.randint(0, 11, (2, 3))).sum().backward()


class PackedClassifier(nn.Module):
    """Variable-length sequences packed (unsorted) into a bidirectional LSTM; mean over valid steps."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.rnn = nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(10, 3)

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(idx), lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=idx.shape[1])
        mask = (torch.arange(idx.shape[1]) < lengths.unsqueeze(1)).unsqueeze(2)
        return self.head((out * mask).sum(1) / lengths.unsqueeze(1))


@pytest.mark.parametrize("keep", [True, False])
def test_packed_sequences_match_per_sample_autograd(keep: bool) -> None:
    torch.manual_seed(5)
    model = PackedClassifier().double()
    lengths = torch.tensor([3, 6, 1, 4])
    idx = torch.randint(0, 11, (4, 6))
    target = torch.randn(4, 3, dtype=torch.float64)
    expected: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(4):
        model.zero_grad()
        n = int(lengths[i])
        (model(idx[i : i + 1, :n], lengths[i : i + 1]) - target[i : i + 1]).pow(2).sum().backward()
        for name, p in model.named_parameters():
            expected[name].append(p.grad.clone())
    model.zero_grad()
    with PerSampleModule(model, loss_reduction="sum", keep_grad_sample=keep, track_norms=True) as psm:
        psm.register_transform(model, transforms.clip_norm(0.7))
        (psm(idx, lengths) - target).pow(2).sum().backward()
        stacked = {name: torch.stack(g) for name, g in expected.items()}
        norms = torch.stack([g.flatten(1).square().sum(1) for g in stacked.values()]).sum(0).sqrt()
        factor = (0.7 / norms).clamp(max=1)
        for name, p in model.named_parameters():
            if keep:
                assert_close(p.grad_sample, stacked[name], name)
            assert_close(psm.per_sample_norms()[name], stacked[name].flatten(1).norm(dim=1), name)
            assert_close(p.grad, (stacked[name] * factor.view(-1, *([1] * (p.dim())))).sum(0), name)


class Reader(nn.Module):
    """Embedding -> Linear -> a recurrent layer -> a head on what ``reads`` names: the output sequence
    (a Linear at each step, then the mean over each sample's valid steps), ``h_n`` or ``c_n`` (every
    layer and direction), or several of them. The input padded, or packed with ``enforce_sorted``
    (``"sorted"``) or not (``"unsorted"``). The initial state: none, ``"given"`` (the caller's),
    or ``"computed"`` by Linear layers from the sample's mean input. The Linear layers see the
    sequence's positions (16 or more: detached from the second step on)."""

    def __init__(
        self,
        cell: type[nn.RNNBase],
        layers: int,
        bidirectional: bool,
        batch_first: bool,
        packing: str,
        reads: str,
        proj_size: int = 0,
        initial: str = "none",
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.inp = nn.Linear(4, 4)
        extra = {"proj_size": proj_size} if proj_size else {}
        self.rnn = cell(4, 3, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, **extra)
        directions = 2 if bidirectional else 1
        out = proj_size or 3
        states = layers * directions
        self.reads, self.batch_first, self.packing, self.initial = reads.split("+"), batch_first, packing, initial
        if "output" in self.reads:
            self.step = nn.Linear(out * directions, 3)
        if initial == "computed":
            self.h0 = nn.Linear(4, states * out)
            self.c0 = nn.Linear(4, states * 3) if cell is nn.LSTM else None
        width = {"output": 3, "h_n": states * out, "c_n": states * 3}
        self.head = nn.Linear(sum(width[r] for r in self.reads), 2)
        self.states, self.out = states, out

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor, h0: Any = None) -> torch.Tensor:
        time = 1 if self.batch_first else 0
        x = torch.tanh(self.inp(self.emb(idx)))
        if self.initial == "computed":  # [states, B, H] from each sample's mean input
            mean = x.mean(time, keepdim=not self.batch_first)  # the batch on the wrapper's batch dim
            batch = idx.shape[1 - time]
            h0 = self.h0(mean).reshape(batch, self.states, self.out).transpose(0, 1).contiguous()
            if self.c0 is not None:
                h0 = (h0, self.c0(mean).reshape(batch, self.states, 3).transpose(0, 1).contiguous())
        if self.packing != "padded":
            sort = self.packing == "sorted"
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=sort)
        out, state = self.rnn(x, h0)
        h_n, c_n = state if isinstance(state, tuple) else (state, None)
        if self.packing != "padded":
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=self.batch_first, total_length=idx.shape[time])
        features = []
        for read in self.reads:
            if read == "output":
                mask = torch.arange(idx.shape[time]).unsqueeze(1) < lengths  # [T, B]
                mask = (mask.T if self.batch_first else mask).unsqueeze(2)
                features.append((torch.tanh(self.step(out)) * mask).sum(time) / lengths.unsqueeze(1))
            else:
                features.append((h_n if read == "h_n" else c_n).permute(1, 0, 2).flatten(1))
        f = torch.cat(features, 1)
        return self.head(f) if self.batch_first else self.head(f.unsqueeze(0)).squeeze(0)  # batch on dim 1


def sample_of(h0: Any, i: int) -> Any:
    """Sample i of an initial state (states on dim 1), or of the LSTM's pair."""
    if h0 is None:
        return None
    return tuple(h.narrow(1, i, 1) for h in h0) if isinstance(h0, tuple) else h0.narrow(1, i, 1)


def each_sample_alone(
    model: nn.Module, idx: torch.Tensor, lengths: torch.Tensor, target: torch.Tensor, batch_dim: int, h0: Any = None
) -> dict[str, torch.Tensor]:
    """``d f_i / d p`` with each sample run through the model alone, ``f_i = ||model(x_i) - t_i||^2``
    (from the initial state ``h0``'s values: nothing accumulates in its ``.grad``)."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    values = None if h0 is None else tuple(h.detach() for h in h0) if isinstance(h0, tuple) else h0.detach()
    for i in range(target.shape[0]):
        model.zero_grad()
        out = model(idx.narrow(batch_dim, i, 1), lengths[i : i + 1], sample_of(values, i))
        (out - target[i : i + 1]).pow(2).sum().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


# every pair of (cell, layers, bidirectional, batch_first, packing) values, every read per cell
READERS = [
    (nn.RNN, 1, False, True, "padded", "h_n"),
    (nn.RNN, 2, True, False, "unsorted", "output"),
    (nn.RNN, 2, False, True, "sorted", "output+h_n"),
    (nn.GRU, 2, True, True, "unsorted", "h_n"),
    (nn.GRU, 1, False, False, "padded", "output"),
    (nn.GRU, 1, True, False, "sorted", "output+h_n"),
    (nn.LSTM, 1, True, False, "unsorted", "h_n"),
    (nn.LSTM, 2, False, True, "padded", "output"),
    (nn.LSTM, 2, True, True, "padded", "output+h_n"),
    (nn.LSTM, 2, False, False, "sorted", "c_n"),
    (nn.LSTM, 1, True, True, "unsorted", "output+h_n+c_n"),
    (nn.LSTM, 2, True, False, "sorted", "h_n+c_n"),
]
# (batch size, padded length) of each step: the batch and the lengths change; 17 positions make the
# Linear layers run detached (`pergrad._core.shortcuts.detach.MANY`)
STEPS = [(3, 5), (4, 17), (2, 7)]


def batch_for(step: int, batch_first: bool, sorted_lengths: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, lengths (one of them the padded length) and targets of a step of ``STEPS``."""
    batch, length = STEPS[step]
    generator = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[step % batch] = length
    if sorted_lengths:
        lengths = lengths.sort(descending=True).values
    idx = torch.randint(0, 11, (batch, length) if batch_first else (length, batch), generator=generator)
    return idx, lengths, torch.randn(batch, 2, dtype=torch.float64, generator=generator)


def check_steps(initial: Reader, psm_options: dict[str, Any], given: str = "none") -> None:
    """Three steps of SGD on root-clipped gradients: materialised, then fused with statistics, against
    each sample run through the model alone. ``given``: the caller's initial state, ``"constant"``
    or ``"requires_grad"`` (its ``.grad`` is then checked against autograd's)."""
    batch_dim = 0 if initial.batch_first else 1
    for keep in (True, False):
        model, reference = copy.deepcopy(initial), copy.deepcopy(initial)
        options = {"keep_grad_sample": keep, "track_norms": True, "track_statistics": not keep, **psm_options}
        with PerSampleModule(model, batch_first=initial.batch_first, **options) as psm:
            psm.register_transform(model, transforms.clip_norm(0.5))
            for step in range(len(STEPS)):
                idx, lengths, target = batch_for(step, initial.batch_first, initial.packing == "sorted")
                h0 = None
                if given != "none":
                    shape = (initial.states, len(lengths), initial.out)
                    h0 = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
                    if isinstance(initial.rnn, nn.LSTM):
                        h0 = (h0, torch.randn(*shape[:2], 3, dtype=torch.float64) / 2)
                    h0 = h0 if given != "requires_grad" else tree_requires_grad(h0)
                expected = each_sample_alone(reference, idx, lengths, target, batch_dim, h0)
                ((psm(idx, lengths, h0) - target).pow(2).sum() / len(lengths)).backward()
                clipped = clipped_mean(expected, 0.5)
                for n, p in model.named_parameters():
                    if keep:
                        assert_close(p.grad_sample, expected[n], f"step {step} {n}")
                    assert_close(psm.per_sample_norms()[n], expected[n].flatten(1).norm(dim=1), f"step {step} {n}")
                    assert_close(p.grad, clipped[n], f"step {step} {n}")
                if not keep:
                    check_statistics(psm.statistics(), expected)
                if given == "requires_grad":
                    states = h0 if isinstance(h0, tuple) else (h0,)
                    wanted = torch.autograd.grad(
                        (reference(idx, lengths, h0) - target).pow(2).sum() / len(lengths), states
                    )
                    for state, g in zip(states, wanted, strict=True):
                        assert_close(state.grad, g, f"step {step} d loss / d h0")
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.5 * p.grad
                psm.zero_grad()
                reference.load_state_dict(model.state_dict())


def tree_requires_grad(h0: Any) -> Any:
    return tuple(h.requires_grad_() for h in h0) if isinstance(h0, tuple) else h0.requires_grad_()


@pytest.mark.parametrize(("cell", "layers", "bidirectional", "batch_first", "packing", "reads"), READERS)
def test_classifiers_reading_the_final_state_match_each_sample_alone(
    cell: type[nn.RNNBase], layers: int, bidirectional: bool, batch_first: bool, packing: str, reads: str
) -> None:
    """Issue 12: a head on h_n (c_n) raised a HookStateError."""
    torch.manual_seed(layers + 2 * bidirectional + 4 * batch_first + 8 * len(packing))
    check_steps(Reader(cell, layers, bidirectional, batch_first, packing, reads).double(), {})


@pytest.mark.parametrize(
    ("batch_first", "packing", "reads"),
    [(True, "unsorted", "output+h_n+c_n"), (False, "padded", "h_n"), (False, "sorted", "output+c_n")],
)
def test_lstm_with_projections_matches_each_sample_alone(batch_first: bool, packing: str, reads: str) -> None:
    """``proj_size``: h_n and the output sequence have the projected size, c_n the hidden size."""
    torch.manual_seed(3)
    check_steps(Reader(nn.LSTM, 2, True, batch_first, packing, reads, proj_size=2).double(), {})


@pytest.mark.parametrize(
    ("cell", "batch_first", "packing", "initial"),
    [
        (nn.GRU, True, "unsorted", "constant"),
        (nn.LSTM, False, "sorted", "requires_grad"),
        (nn.RNN, False, "padded", "requires_grad"),
        (nn.LSTM, True, "padded", "computed"),
        (nn.GRU, False, "unsorted", "computed"),
    ],
)
def test_an_initial_state_matches_each_sample_alone(
    cell: type[nn.RNNBase], batch_first: bool, packing: str, initial: str
) -> None:
    """An initial state ``[layers * directions, B, H]`` (batch on dim 1 in any layout): the caller's,
    requiring grad or not (its ``.grad`` stays autograd's), or computed by hooked layers."""
    torch.manual_seed(6)
    model = Reader(
        cell, 2, True, batch_first, packing, "output+h_n", initial="computed" if initial == "computed" else "none"
    )
    check_steps(model.double(), {}, given="none" if initial == "computed" else initial)


def test_activation_grads_of_every_output() -> None:
    """``"rnn"`` is d f_i / d output, ``"rnn[1]"`` d f_i / d h_n and ``"rnn[2]"`` d f_i / d c_n, batch first."""
    torch.manual_seed(1)
    model = Reader(nn.LSTM, 2, True, False, "padded", "output+h_n+c_n").double()
    idx, lengths = torch.randint(0, 11, (5, 3)), torch.tensor([5, 2, 4])
    target = torch.randn(3, 2, dtype=torch.float64)
    kept: list[torch.Tensor] = []

    def retain(module: nn.Module, args: object, output: tuple[torch.Tensor, tuple[torch.Tensor, ...]]) -> None:
        kept.extend([output[0], *output[1]])
        for t in kept:
            t.retain_grad()

    handle = model.rnn.register_forward_hook(retain)
    with PerSampleModule(model, batch_first=False, keep_activation_grads=True) as psm:
        ((psm(idx, lengths) - target).pow(2).sum() / 3).backward()
        got = psm.activation_grads()
    handle.remove()
    for key, t in zip(("rnn", "rnn[1]", "rnn[2]"), kept, strict=True):
        assert t.grad is not None
        assert_close(got[key], t.grad.movedim(1, 0) * 3, key)


class Twice(nn.Module):
    """One GRU over two sequences of each sample: h_n of both and the second's output are read."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.rnn = nn.GRU(4, 3, num_layers=2, batch_first=True)
        self.head = nn.Linear(9, 2)

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor, h0: None = None) -> torch.Tensor:
        _, h_a = self.rnn(self.emb(idx[..., 0]))
        out_b, h_b = self.rnn(self.emb(idx[..., 1]))
        return self.head(torch.cat([h_a[-1], h_b[0], out_b.mean(1)], 1))


def test_a_layer_called_twice_sums_every_output_of_both_calls() -> None:
    torch.manual_seed(2)
    model = Twice().double()
    idx, lengths = torch.randint(0, 11, (3, 5, 2)), torch.tensor([5, 5, 5])
    target = torch.randn(3, 2, dtype=torch.float64)
    expected = each_sample_alone(model, idx, lengths, target, 0)
    with PerSampleModule(model, loss_reduction="sum") as psm:
        (psm(idx, lengths) - target).pow(2).sum().backward()
        for n, p in model.named_parameters():
            assert_close(p.grad_sample, expected[n], n)


class PackedInput(nn.Module):
    """A PackedSequence as the model's input: an LSTM on it, a Linear on its last ``h_n``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 5, num_layers=2, batch_first=True), nn.Linear(5, 2)

    def forward(self, packed: nn.utils.rnn.PackedSequence) -> torch.Tensor:
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


@pytest.mark.parametrize("keep", [True, False])
def test_a_packed_sequence_given_to_the_model(keep: bool) -> None:
    """The batch of a PackedSequence is its ``batch_sizes[0]`` (not its number of rows); exact over
    steps of changing batch sizes, each sample against autograd on its own sequence."""
    torch.manual_seed(11)
    model = PackedInput().double()
    reference = copy.deepcopy(model)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step, size in enumerate((4, 2, 5, 1)):
            gen = torch.Generator().manual_seed(step)
            lengths = torch.randint(1, 7, (size,), generator=gen)
            x = torch.randn(size, 6, 3, generator=gen, dtype=torch.float64)
            target = torch.randn(size, 2, generator=gen, dtype=torch.float64)
            expected: dict[str, list[torch.Tensor]] = {n: [] for n, _ in reference.named_parameters()}
            for i in range(size):
                reference.zero_grad()
                alone = nn.utils.rnn.pack_padded_sequence(x[i : i + 1], lengths[i : i + 1], batch_first=True)
                (reference(alone) - target[i : i + 1]).pow(2).sum().backward()
                for name, p in reference.named_parameters():
                    expected[name].append(p.grad.clone())
            stacked = {name: torch.stack(g) for name, g in expected.items()}
            model.zero_grad()
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            ((psm(packed) - target).pow(2).sum() / size).backward()
            norms = torch.stack([g.flatten(1).square().sum(1) for g in stacked.values()]).sum(0).sqrt()
            factor = (0.5 / norms).clamp(max=1)
            for name, p in model.named_parameters():
                what = f"step {step} (B={size}) {name}"
                if keep:
                    assert_close(p.grad_sample, stacked[name], what)
                assert_close(psm.per_sample_norms()[name], stacked[name].flatten(1).norm(dim=1), what)
                assert_close(p.grad, (stacked[name] * factor.view(-1, *([1] * p.dim()))).mean(0), what)
            assert (model.head.weight in psm._engine.detacher.current) == (step > 0)
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    p -= 0.1 * p.grad
                    q.copy_(p)
