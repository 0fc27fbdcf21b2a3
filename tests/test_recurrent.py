"""nn.RNN / nn.GRU / nn.LSTM as they are, against per-sample autograd loops; a bidirectional LSTM
classifier wrapped unmodified (torch.func cannot vmap these layers, so the reference is a loop)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, UnsupportedLayerError, transforms
from tests.reference import assert_close


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
    model = Classifier(nn.LSTM, 2, False, True)
    model.rnn.dropout = 0.5
    with PerSampleModule(model) as psm:
        loss = psm(torch.randint(0, 11, (2, 3))).sum()
        with pytest.raises(UnsupportedLayerError, match=r"dropout=0.5 .* Use dropout=0 or eval\(\)"):
            loss.backward()


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
    """Embedding -> a recurrent layer -> a linear head on what ``reads`` names: the output sequence
    (mean over each sample's valid steps), ``h_n`` or ``c_n`` (every layer and direction), or several
    of them; the input padded or packed (unsorted lengths)."""

    def __init__(
        self, cell: type[nn.RNNBase], layers: int, bidirectional: bool, batch_first: bool, packed: bool, reads: str
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.rnn = cell(4, 3, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        directions = 2 if bidirectional else 1
        width = {"output": 3 * directions, "h_n": 3 * layers * directions, "c_n": 3 * layers * directions}
        self.reads, self.batch_first, self.packed = reads.split("+"), batch_first, packed
        self.head = nn.Linear(sum(width[r] for r in self.reads), 2)

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        time = 1 if self.batch_first else 0
        x = self.emb(idx)
        if self.packed:
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=False)
        out, state = self.rnn(x)
        h_n, c_n = state if isinstance(state, tuple) else (state, None)
        if self.packed:
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=self.batch_first, total_length=idx.shape[time])
        features = []
        for read in self.reads:
            if read == "output":
                mask = torch.arange(idx.shape[time]).unsqueeze(1) < lengths  # [T, B]
                mask = (mask.T if self.batch_first else mask).unsqueeze(2)
                features.append((out * mask).sum(time) / lengths.unsqueeze(1))
            else:
                features.append((h_n if read == "h_n" else c_n).permute(1, 0, 2).flatten(1))
        f = torch.cat(features, 1)
        return self.head(f) if self.batch_first else self.head(f.unsqueeze(0)).squeeze(0)  # batch on dim 1


def each_sample_alone(
    model: nn.Module, idx: torch.Tensor, lengths: torch.Tensor, target: torch.Tensor, batch_dim: int
) -> dict[str, torch.Tensor]:
    """``d f_i / d p`` with each sample run through the model alone, ``f_i = ||model(x_i) - t_i||^2``."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(target.shape[0]):
        model.zero_grad()
        (model(idx.narrow(batch_dim, i, 1), lengths[i : i + 1]) - target[i : i + 1]).pow(2).sum().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


def clipped_mean(grads: dict[str, torch.Tensor], bound: float) -> dict[str, torch.Tensor]:
    """``(1/B) sum_i g_i min(1, C / ||g_i||)``, the norm over every parameter (flat clipping)."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for n, g in grads.items()}


# every pair of (cell, layers, bidirectional, batch_first, packed) values, and every read per cell
READERS = [
    (nn.RNN, 1, False, True, False, "h_n"),
    (nn.RNN, 2, True, False, True, "output"),
    (nn.RNN, 2, False, True, True, "output+h_n"),
    (nn.GRU, 2, True, True, True, "h_n"),
    (nn.GRU, 1, False, False, False, "output"),
    (nn.GRU, 1, True, False, True, "output+h_n"),
    (nn.LSTM, 1, True, False, True, "h_n"),
    (nn.LSTM, 2, False, True, False, "output"),
    (nn.LSTM, 2, True, True, False, "output+h_n"),
    (nn.LSTM, 2, False, False, True, "c_n"),
    (nn.LSTM, 1, True, True, True, "output+h_n+c_n"),
    (nn.LSTM, 2, True, False, False, "h_n+c_n"),
]


@pytest.mark.parametrize(("cell", "layers", "bidirectional", "batch_first", "packed", "reads"), READERS)
def test_classifiers_reading_the_final_state_match_each_sample_alone(
    cell: type[nn.RNNBase], layers: int, bidirectional: bool, batch_first: bool, packed: bool, reads: str
) -> None:
    """Issue 12: a head on h_n (c_n) raised a HookStateError. Two steps of SGD on root-clipped
    gradients, materialised and fused, against each sample run through the model alone."""
    torch.manual_seed(layers + 2 * bidirectional + 4 * batch_first + 8 * packed)
    initial = Reader(cell, layers, bidirectional, batch_first, packed, reads).double()
    batch_dim = 0 if batch_first else 1
    for keep in (True, False):
        model, reference = copy.deepcopy(initial), copy.deepcopy(initial)
        with PerSampleModule(model, batch_first=batch_first, keep_grad_sample=keep, track_norms=True) as psm:
            psm.register_transform(model, transforms.clip_norm(0.5))
            for step in range(2):
                generator = torch.Generator().manual_seed(step)
                lengths = torch.tensor([5, 2, 4]) if step == 0 else torch.tensor([1, 5, 3])
                idx = torch.randint(0, 11, (3, 5) if batch_first else (5, 3), generator=generator)
                target = torch.randn(3, 2, dtype=torch.float64, generator=generator)
                expected = each_sample_alone(reference, idx, lengths, target, batch_dim)
                ((psm(idx, lengths) - target).pow(2).sum() / 3).backward()
                clipped = clipped_mean(expected, 0.5)
                for n, p in model.named_parameters():
                    if keep:
                        assert_close(p.grad_sample, expected[n], f"step {step} {n}")
                    assert_close(psm.per_sample_norms()[n], expected[n].flatten(1).norm(dim=1), f"step {step} {n}")
                    assert_close(p.grad, clipped[n], f"step {step} {n}")
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.5 * p.grad
                psm.zero_grad()
                reference.load_state_dict(model.state_dict())


def test_activation_grads_of_every_output() -> None:
    """``"rnn"`` is d f_i / d output, ``"rnn[1]"`` d f_i / d h_n and ``"rnn[2]"`` d f_i / d c_n, batch first."""
    torch.manual_seed(1)
    model = Reader(nn.LSTM, 2, True, False, False, "output+h_n+c_n").double()
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

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
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
