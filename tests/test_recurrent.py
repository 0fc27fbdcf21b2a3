"""nn.RNN / nn.GRU / nn.LSTM as they are, against per-sample autograd loops; a bidirectional LSTM
classifier wrapped unmodified (torch.func cannot vmap these layers, so the reference is a loop)."""

from __future__ import annotations

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
