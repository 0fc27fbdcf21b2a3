"""Indexing the batch with an arange the forward made reads no values (no host sync on a GPU), and only such an
arange: one written into since, one not starting at 0 or stepping 1, a view laid out otherwise, or one made in
an earlier forward is checked by its values as before (``dims._counts_in_order``, ``Provenance``'s ``_count``).

Each model is float64, run several steps with a batch size that changes, against each loss term's gradient by
plain autograd through the whole batch forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from pergrad import PerSampleModule
from pergrad._core.capture import dims
from pergrad.errors import BatchMixingError

pytestmark = pytest.mark.usefixtures("float64")

REORDERED = "reordered or mixed the samples along the batch dim"
D = 3


class Indexed(nn.Module):
    """``head(pick(body(x)))``: ``pick`` indexes the batch of ``body``'s output."""

    def __init__(self, pick: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.body, self.head, self.pick = nn.Linear(D, D), nn.Linear(D, 2), pick
        self.cache: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pick(self, torch.tanh(self.body(x))))


def value_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the calls that read an index's values to tell its order (``torch.equal``, ``Tensor.eq``)."""
    count = [0]
    for owner, name in ((torch, "equal"), (Tensor, "eq")):
        original = getattr(owner, name)

        def counted(*args: object, original: Callable[..., object] = original) -> object:
            count[0] += 1
            return original(*args)

        monkeypatch.setattr(owner, name, counted)
    return count


def run(pick: Callable[[nn.Module, Tensor], Tensor], sizes: tuple[int, ...] = (4, 6, 4)) -> float:
    """The largest error of ``grad_sample`` over the steps, one per batch size."""
    torch.manual_seed(0)
    model = Indexed(pick)
    psm = PerSampleModule(model, loss_reduction="sum")
    worst = 0.0
    for b in sizes:
        x, y = torch.randn(b, D), torch.randn(b, 2)
        out = model(x)
        expect = []
        for i in range(b):
            fi = (out[i] - y[i]).pow(2).sum()
            expect.append(torch.autograd.grad(fi, [model.body.weight, model.head.weight], retain_graph=True))
        model.zero_grad()
        (psm(x) - y).pow(2).sum().backward()
        for j, p in enumerate((model.body.weight, model.head.weight)):
            worst = max(worst, float((p.grad_sample - torch.stack([e[j] for e in expect])).abs().max()))
    return worst


HELD = {
    "mask-style [arange(B)[:, None], arange(D)]": lambda m, h: h[
        torch.arange(h.shape[0])[:, None], torch.arange(h.shape[1])[None, :]
    ],
    "h[arange(B)]": lambda m, h: h[torch.arange(h.shape[0])],
    "h[arange(0, B)]": lambda m, h: h[torch.arange(0, h.shape[0])],
    "h[arange(0, B, 1), :]": lambda m, h: h[torch.arange(0, h.shape[0], 1), :],
    "index_select(0, arange(B))": lambda m, h: h.index_select(0, torch.arange(h.shape[0])),
    "gather(0, arange(B)[:, None].expand(B, D))": lambda m, h: h.gather(
        0, torch.arange(h.shape[0])[:, None].expand(-1, h.shape[1])
    ),
    "h[arange(B, dtype=int32)]": lambda m, h: h[torch.arange(h.shape[0], dtype=torch.int32)],
    "h[arange(2 * B)[:B]]": lambda m, h: h[torch.arange(2 * h.shape[0])[: h.shape[0]]],
}


@pytest.mark.parametrize("pick", HELD.values(), ids=HELD.keys())
def test_an_arange_of_the_forward_indexes_in_order_with_no_values_read(pick, monkeypatch):
    reads = value_reads(monkeypatch)
    assert run(pick) < 1e-12
    assert reads[0] == 0


def _written_in_place(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i[:2] = torch.tensor([1, 0])
    return h[i]


def _written_through_data(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i.data[:2] = torch.tensor([1, 0])
    return h[i]


def _data_replaced(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i.data = torch.arange(h.shape[0]).flip(0)
    return h[i]


def _view_written(m: nn.Module, h: Tensor) -> Tensor:
    i = torch.arange(h.shape[0])
    i[:, None].detach()[0, 0] = 1
    return h.index_select(0, i)


def _cached_then_written(m: nn.Module, h: Tensor) -> Tensor:
    if m.cache is None or len(m.cache) != h.shape[0]:
        m.cache = torch.arange(h.shape[0])
    else:  # (written past the version counter, out of a forward that saw it made)
        m.cache.data.copy_(torch.arange(h.shape[0]).roll(1))
    return h[m.cache]


REFUSED = {
    "written in place": _written_in_place,
    "written through .data": _written_through_data,
    ".data replaced": _data_replaced,
    "a view written": _view_written,
    "made in an earlier forward, written since": _cached_then_written,
    "strided to repeat one row": lambda m, h: h[torch.arange(h.shape[0]).as_strided((h.shape[0],), (0,))],
    "one row expanded": lambda m, h: h[torch.zeros(1, dtype=torch.long).expand(h.shape[0])],
    "index_select of one row expanded": lambda m, h: h.index_select(0, torch.tensor([1]).expand(h.shape[0])),
    "one row of each pair, expanded": lambda m, h: h[torch.arange(0, h.shape[0], 2)[:, None].expand(-1, 2).reshape(-1)],
    "counting down": lambda m, h: h[torch.arange(h.shape[0] - 1, -1, -1)],
    "flipped": lambda m, h: h[torch.arange(h.shape[0]).flip(0)],
    "shifted view": lambda m, h: h[torch.arange(h.shape[0] + 1)[1:] % h.shape[0]],
    "gather with positions along dim 1": lambda m, h: h.gather(
        0, torch.arange(h.shape[1])[None, :].expand(h.shape[0], -1)
    ),
}


@pytest.mark.parametrize("pick", REFUSED.values(), ids=REFUSED.keys())
def test_an_arange_written_or_laid_out_otherwise_is_checked_by_its_values(pick):
    with pytest.raises(BatchMixingError, match=REORDERED):
        run(pick, sizes=(4, 4))


def test_an_arange_not_counted_is_read_and_held_where_in_order(monkeypatch):
    reads = value_reads(monkeypatch)
    assert run(lambda m, h: h[torch.arange(1, h.shape[0] + 1) - 1]) < 1e-12
    assert reads[0] > 0


def test_a_view_that_starts_past_the_arange_is_not_in_order_by_layout():
    arange = torch.arange(5)
    before = dims.counting(WeakTensorKeyDictionary())
    try:
        dims.counted(arange)
        assert dims._counts_in_order(arange[:4], 0, 4)
        assert not dims._counts_in_order(arange[1:], 0, 4)
        assert not dims._counts_in_order(arange[:4].flip(0), 0, 4)
        assert not dims._counts_in_order(arange[None, :4].expand(4, 4).contiguous(), 1, 4)
        dims.uncounted(arange[:2])
        assert not dims._counts_in_order(arange[:4], 0, 4)
    finally:
        dims.counting(before)


def test_a_padded_hf_batch_reads_no_index_values_in_its_forward(monkeypatch):
    """Llama's padding mask (``padding_mask[batch_arange[:, None, None, None], kv_idx]``) and its classifier's
    pooling (``logits[arange(B), last]``) index the batch with aranges of the forward: no value read (on a GPU, no
    host sync) in any step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, max_position_embeddings=16, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForSequenceClassification(config).double()
    psm = PerSampleModule(model)
    reads = value_reads(monkeypatch)
    for b in (4, 3, 4):
        ids = torch.randint(1, 40, (b, 6))
        mask = torch.ones(b, 6, dtype=torch.long)
        mask[1, -1] = mask[2, -2:] = 0
        ids[mask == 0] = 0
        logits = psm(input_ids=ids, attention_mask=mask).logits
        assert reads[0] == 0
        model.zero_grad()
        torch.nn.functional.cross_entropy(logits, torch.randint(0, 3, (b,))).backward()
