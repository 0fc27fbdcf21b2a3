"""Inputs and parameters shared by the batch (``pergrad._core.shortcuts.shared``): position ids without a batch dim
or with a batch dim of 1, relative-position buckets, raw parameters broadcast into activations.
Exact against torch.func over steps whose length equals the batch size on some steps (where a
shared input looks batched) and crosses the 16-position threshold from which weights run detached.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import BatchSizeError, PerSampleModule, SharedInputError, UnsupportedLayerError, transforms
from tests.reference import assert_close, reference_grad_sample
from tests.test_fused import check_statistics

STEPS = [(3, 5), (4, 4), (2, 17), (5, 5), (3, 16), (1, 3)]  # (batch, length): T == B twice
SQUARE = [(4, 4), (17, 17), (5, 5), (16, 16), (3, 3)]  # T == B on every step, on both sides of 16
MODES = [(True, None, False), (False, 0.5, False), (True, 0.5, False), (False, None, True)]  # keep, clip, stats


Reference = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    dict[str, torch.Tensor],
]


def one_at_a_time(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: [B, *p.shape]}`` by plain autograd on each sample alone (batch first): for models
    whose forward writes into tensors, which torch.func's vmap cannot batch."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum")


def squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).sum()


def expected(ref: dict[str, torch.Tensor], clip: float | None) -> dict[str, torch.Tensor]:
    if clip is None:
        return {k: g.mean(0) for k, g in ref.items()}
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (clip / norms).clamp(max=1)
    return {k: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for k, g in ref.items()}


def run(
    model: nn.Module,
    batch: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    keep: bool,
    clip: float | None,
    stats: bool,
    batch_first: bool = True,
    steps: list[tuple[int, int]] = STEPS,
    reference: Reference | None = None,
) -> None:
    """Several steps of (batch, length) ``steps``, every step's ``grad_sample``, ``.grad`` and norms
    against ``reference`` (torch.func on each sample's own loss unless given) in float64."""
    plain = copy.deepcopy(model)  # for a reference that runs the model itself
    gen = torch.Generator().manual_seed(0)
    dim = 0 if batch_first else 1
    with PerSampleModule(
        model, keep_grad_sample=keep, track_norms=True, track_statistics=stats, batch_first=batch_first
    ) as psm:
        if clip is not None:
            psm.register_transform(model, transforms.clip_norm(clip))
        for step, (b, t) in enumerate(steps):
            x, y = batch(b, t, gen)
            if reference is None:
                ref = reference_grad_sample(model, x, y, loss=loss, batch_dim=dim)
            else:
                ref = reference(plain, x, y, loss)
            want = expected(ref, clip)
            psm.zero_grad()
            (loss(psm(x), y) / b).backward()
            norms = psm.per_sample_norms()
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}): {name}"
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
                assert_close(p.grad, want[name], f".grad of {what}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")
            if stats and b > 1:
                check_statistics(psm.statistics(), ref)


def ids(
    vocab: int, batch_first: bool = True
) -> Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def batch(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (b, t) if batch_first else (t, b)
        return torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen)

    return batch


class NanoGPT(nn.Module):
    """``wpe(torch.arange(T))``: position ids without a batch dim; the wte head tied."""

    def __init__(self, vocab: int = 9, dim: int = 6, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(24, dim)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1] if self.batch_first else idx.shape[0]
        pos = self.wpe(torch.arange(t))  # [T, D]
        h = self.wte(idx) + (pos if self.batch_first else pos.unsqueeze(1))
        return self.head(torch.tanh(self.mlp(self.norm(h))))


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_positions_without_a_batch_dim(keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(0)
    run(NanoGPT().double(), ids(9), token_loss, keep, clip, stats)


def test_positions_without_a_batch_dim_sequence_first() -> None:
    torch.manual_seed(1)
    run(NanoGPT(batch_first=False).double(), ids(9, batch_first=False), token_loss, True, 0.5, False, batch_first=False)


class BufferPositions(nn.Module):
    """HuggingFace's ``position_ids`` buffer ``[1, T]``, added in place, then a Linear on the shared
    positions' embedding alone (a layer whose input is derived from a shared output)."""

    def __init__(self, vocab: int = 9, dim: int = 5) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(24).expand(1, -1))
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(24, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        pos = self.pos(self.position_ids[:, : idx.shape[1]])  # [1, T, D]
        h += pos
        h = h * torch.sigmoid(self.mix(pos))  # shared -> Linear (shared) -> meets the batch in *
        return self.head(h)


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_positions_with_a_batch_dim_of_one(keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(2)
    run(BufferPositions().double(), ids(9), token_loss, keep, clip, stats)


class KeywordPositions(nn.Module):
    """Token and position ids as keywords; the position ids ``[1, T]`` (one row for every sample)."""

    def __init__(self, vocab: int = 9, dim: int = 6) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(vocab, dim), nn.Embedding(24, dim), nn.Linear(dim, vocab)

    def forward(
        self, ids: torch.Tensor, pos_ids: torch.Tensor | None = None, mix: torch.Tensor | None = None
    ) -> torch.Tensor:
        pos_ids = torch.arange(ids.shape[1]).unsqueeze(0) if pos_ids is None else pos_ids
        h = self.tok(ids) + self.pos(pos_ids)
        return self.head(torch.tanh(h if mix is None else mix @ h))  # mix: [T, T], the same for every sample


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_a_call_with_keywords_only_takes_the_batch_from_every_argument(
    keep: bool, clip: float | None, stats: bool
) -> None:
    """``model(pos_ids=..., ids=...)``: the position ids come first but broadcast (size 1); the batch
    is the size of ``ids``. Exact over steps of changing sizes (T == B on some)."""
    torch.manual_seed(3)
    model = KeywordPositions().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True, track_statistics=stats) as psm:
        if clip is not None:
            psm.register_transform(model, transforms.clip_norm(clip))
        for step, (b, t) in enumerate(STEPS):
            x, y = ids(9)(b, t, gen)
            ref = reference_grad_sample(model, x, y, loss=token_loss)  # called positionally, one sample at a time
            want = expected(ref, clip)
            psm.zero_grad()
            (token_loss(psm(pos_ids=torch.arange(t).unsqueeze(0), ids=x), y) / b).backward()
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}): {name}"
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
                assert_close(p.grad, want[name], f".grad of {what}")
                assert_close(psm.per_sample_norms()[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")
            if stats and b > 1:
                check_statistics(psm.statistics(), ref)


def test_keywords_that_disagree_on_the_batch_are_refused() -> None:
    model = KeywordPositions().double()
    x, mix = torch.randint(0, 9, (3, 5)), torch.rand(5, 5, dtype=torch.float64)
    with (
        PerSampleModule(model) as psm,
        pytest.raises(
            BatchSizeError,
            match=r"tensors that disagree on the batch size \(their sizes on dim 0: 'mix' \(5\), 'ids' \(3\)\).*"
            r"Pass the batched input as the model's first positional argument",
        ),
    ):
        psm(mix=mix, ids=x)
    params = dict(model.named_parameters())
    want = [
        torch.autograd.grad(token_loss(model(x[i : i + 1], mix=mix), x[i : i + 1]), list(params.values()))
        for i in range(3)
    ]
    with PerSampleModule(model, loss_reduction="sum") as psm:  # the fix: the input positionally
        token_loss(psm(x, mix=mix), x).backward()
        for i in range(3):
            for (name, p), g in zip(params.items(), want[i], strict=True):
                assert_close(p.grad_sample[i], g, f"sample {i} {name}")


class Buckets(nn.Module):
    """T5's relative-position bias: buckets ``[T, T]`` -> Embedding -> permute -> ``[1, H, T, T]``,
    added to every sample's attention scores."""

    def __init__(self, dim: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.bias = nn.Embedding(7, heads)
        self.qk = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]).clamp(-3, 3) + 3  # [T, T]
        bias = self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, T, T]
        q, k = self.qk(x).view(b, t, 2, self.heads, d // self.heads).unbind(2)
        scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(2, 3) + bias  # [B, H, T, T]
        v = x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(mixed).mean(1)


def floats(width: int, out: int) -> Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def batch(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(b, t, width, generator=gen, dtype=torch.float64)
        return x, torch.randn(b, out, generator=gen, dtype=torch.float64)

    return batch


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_relative_position_buckets(keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(3)
    run(Buckets().double(), floats(4, 3), squared, keep, clip, stats)


class RawParameters(nn.Module):
    """ViT/timm's raw parameters: a cls token expanded to the batch, position embeddings added (a
    slice of them, used at two places), a LayerScale gamma, and a gate built from two raw
    parameters before it meets the batch."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 24, dim))
        self.gamma = nn.Parameter(torch.randn(dim))
        self.gate_a, self.gate_b = nn.Parameter(torch.randn(dim)), nn.Parameter(torch.randn(dim))
        self.lin = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = self.pos_embed[:, : t + 1]
        h = torch.cat([self.cls_token.expand(b, -1, -1), x], 1) + pos
        h = h + self.gamma * torch.tanh(self.lin(h))
        h = h * torch.sigmoid(self.gate_a * self.gate_b) + 0.1 * pos
        return self.head(h[:, 0] + h[:, 1:].mean(1))


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_raw_parameters(keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(4)
    run(RawParameters().double(), floats(4, 3), squared, keep, clip, stats)


class Conditional(nn.Module):
    """An embedding of labels computed inside the model (integer, not one of the model's inputs,
    one per sample): it may look shared, and turns out batched where it meets the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = nn.Embedding(4, 3)
        self.inp = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        label = x.mean(1).argmax(-1)  # [B]
        return self.head(torch.tanh(self.inp(x.mean(1))) * self.classes(label))


def test_a_per_sample_input_computed_inside_the_model_is_batched() -> None:
    torch.manual_seed(5)
    run(Conditional().double(), floats(3, 2), squared, True, 0.5, False)


class LoraEmbedding(nn.Module):
    """As peft's LoRA on an embedding: ``base(ids) + F.embedding(ids, A.T) @ B.T * scale``, A and B
    held in a ParameterDict and a ParameterList (nested in a ModuleDict), never called themselves."""

    def __init__(self, vocab: int = 10, dim: int = 4, rank: int = 2, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.base = nn.Embedding(vocab, dim, padding_idx=0)
        self.lora_embedding_a = nn.ParameterDict({"default": nn.Parameter(torch.randn(rank, vocab))})
        self.adapters = nn.ModuleDict({"b": nn.ParameterList([nn.Parameter(torch.randn(dim, rank))])})
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_embedding_a["default"].T, self.adapters["b"][0].T
        after_a = F.embedding(idx, a, padding_idx=self.base.padding_idx)
        return self.head(torch.tanh(self.base(idx) + (after_a @ b) * 0.5))


@pytest.mark.parametrize(("keep", "clip", "stats"), MODES)
def test_parameters_in_parameter_dicts_looked_up_by_f_embedding(keep: bool, clip: float | None, stats: bool) -> None:
    """Raw parameters of the module that reads them from a ParameterDict/ParameterList; a shared
    weight looked up by batched ids in F.embedding (rows at padding_idx: no gradient, as autograd)."""
    torch.manual_seed(6)
    run(LoraEmbedding().double(), ids(10), token_loss, keep, clip, stats)


def test_shared_weight_of_f_embedding_sequence_first() -> None:
    torch.manual_seed(7)
    model = LoraEmbedding(batch_first=False).double()
    run(model, ids(10, batch_first=False), token_loss, True, 0.5, False, batch_first=False)


class MatrixParameter(nn.Module):
    """A raw matrix on the right of a matmul whose left operand has the batch as its rows ``[B, D]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x).mean(1)) @ self.w


def test_raw_matrix_times_the_batch_as_rows() -> None:
    torch.manual_seed(8)
    run(MatrixParameter().double(), floats(4, 3), squared, True, 0.5, False)


class Unmet(nn.Module):
    """A shared output that reaches the loss without meeting the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(8, 3)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() + self.pos(torch.arange(5)).sum()


class SharedAsWeight(nn.Module):
    """A shared output used as a weight matrix (not broadcast): cannot be split per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 3)
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.lin(x), self.table(torch.arange(3)))


def test_shared_tensors_that_cannot_be_split_are_clear_errors() -> None:
    x = torch.randn(4, 3)
    with PerSampleModule(Unmet()) as psm:
        loss = psm(x)
        with pytest.raises(SharedInputError, match=r"output of layer 'pos' \(Embedding\) is shared by the batch.*"
                           r"reached the loss without meeting the batch"):  # fmt: skip
            loss.backward()
    with (
        PerSampleModule(SharedAsWeight()) as psm,
        pytest.raises(SharedInputError, match=r"layer 'table' \(Embedding\) is shared by the batch.*meets the batch "
                      r"in linear.*register_rule.*fallback=True"),
    ):  # fmt: skip
        psm(x)
    model = LoraEmbedding()
    model.forward = lambda idx: F.embedding(idx, model.lora_embedding_a["default"].T, max_norm=1.0)  # type: ignore[method-assign]
    with (
        PerSampleModule(model) as psm,
        pytest.raises(SharedInputError, match=r"parameter 'default' of layer 'lora_embedding_a' \(ParameterDict\) is "
                      r"shared by the batch and looked up by F.embedding with max_norm or scale_grad_by_freq"),
    ):  # fmt: skip
        psm(torch.randint(0, 10, (3, 4)))


def test_parameters_of_a_parameter_dict_that_no_module_calls() -> None:
    with pytest.raises(UnsupportedLayerError, match=r"^layer 'b' \(ParameterList\) holds trainable parameters "
                       r"\['0'\], but no module of the model that is called encloses it"):  # fmt: skip
        PerSampleModule(nn.ModuleDict({"b": nn.ParameterList([nn.Parameter(torch.randn(2))])}))


# -- tensors built inside the forward: whether they carry the batch follows from where they came from


class ShiftedLabels(nn.Module):
    """A decoder trained on its labels alone, as encoder-decoders are: its input ids are the labels
    shifted right inside the forward (``how``), plus a learned ``pos(torch.arange(T))`` and a
    segment embedding of ``torch.zeros(B, T)`` (built with the batch, the same for every sample)."""

    def __init__(self, how: str, vocab: int = 9, dim: int = 6) -> None:
        super().__init__()
        self.how = how
        self.tok, self.pos, self.seg = nn.Embedding(vocab, dim), nn.Embedding(24, dim), nn.Embedding(2, dim)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        b, t = labels.shape
        if self.how == "assign":  # T5's _shift_right
            dec = labels.new_zeros(labels.shape)
            dec[..., 1:] = labels[..., :-1].clone()
        elif self.how == "cat":
            dec = torch.cat([labels.new_zeros(b, 1), labels[:, :-1]], 1)
        elif self.how == "masked_fill":
            dec = labels.roll(1, 1).masked_fill(torch.arange(t) == 0, 0)
        else:  # clone, then in place
            dec = labels.clone()
            dec[:, 1:] = labels[:, :-1]
            dec[:, 0] = 0
        h = self.tok(dec) + self.pos(torch.arange(t)) + self.seg(torch.zeros(b, t, dtype=torch.long))
        return self.head(torch.tanh(self.mlp(self.norm(h))))


@pytest.mark.parametrize("how", ["assign", "cat", "masked_fill", "clone"])
@pytest.mark.parametrize("steps", [SQUARE, STEPS], ids=["square", "mixed"])
def test_decoder_inputs_shifted_inside_the_forward(how: str, steps: list[tuple[int, int]]) -> None:
    torch.manual_seed(10)
    for keep, clip, stats in MODES[:2]:
        run(ShiftedLabels(how).double(), ids(9), token_loss, keep, clip, stats, steps=steps, reference=one_at_a_time)


class Sinusoidal(nn.Module):
    """Fourier features computed on the fly, ``sin(arange(T)[:, None] * freqs)`` (a float tensor
    created inside the forward, not a buffer), through a Linear, added to every sample."""

    def __init__(self, dim: int = 4, features: int = 6) -> None:
        super().__init__()
        self.features = features
        self.inp, self.fourier, self.out = nn.Linear(dim, dim), nn.Linear(features, dim), nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        freqs = torch.exp(-torch.arange(self.features, dtype=x.dtype) / self.features)
        waves = torch.sin(torch.arange(t, dtype=x.dtype)[:, None] * freqs)  # [T, F]
        return self.out(torch.tanh(self.inp(x) + self.fourier(waves))).mean(1)


@pytest.mark.parametrize("steps", [SQUARE, STEPS], ids=["square", "mixed"])
def test_float_features_computed_inside_the_forward(steps: list[tuple[int, int]]) -> None:
    torch.manual_seed(11)
    for keep, clip, stats in MODES:
        run(Sinusoidal().double(), floats(4, 3), squared, keep, clip, stats, steps=steps)


class Combined(nn.Module):
    """Shared tensors combined with a plain length-T tensor (a buffer's rows ``table[:T]``) before
    they meet the batch: ``pos(arange(T)) + table[:T]``, and a raw ``[1, D]`` parameter + the table."""

    def __init__(self, vocab: int = 9, dim: int = 5) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(24, dim))
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(24, dim)
        self.offset = nn.Parameter(torch.randn(1, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        rows = self.table[:t]
        h = self.tok(idx) + (self.pos(torch.arange(t)) + rows)
        h = h * torch.sigmoid(self.offset + rows)
        return self.head(h)


@pytest.mark.parametrize("steps", [SQUARE, STEPS], ids=["square", "mixed"])
def test_shared_tensors_combined_with_a_buffer_before_the_batch(steps: list[tuple[int, int]]) -> None:
    torch.manual_seed(12)
    for keep, clip, stats in MODES:
        run(Combined().double(), ids(9), token_loss, keep, clip, stats, steps=steps)


class BeforeTheBatch(nn.Module):
    """Shared tensors broadcast along the batch-sized dim of one that may carry the batch before
    either meets the batch: a segment embedding of ``torch.zeros(B, T)`` (one row per sample) plus
    ``pos(arange(T))`` and a raw ``[1, D]`` parameter; the raw parameter plus ``pos2(arange(T))``
    (positions, which later broadcast over the batch)."""

    def __init__(self, vocab: int = 9, dim: int = 5) -> None:
        super().__init__()
        self.tok, self.seg = nn.Embedding(vocab, dim), nn.Embedding(2, dim)
        self.pos, self.pos2 = nn.Embedding(24, dim), nn.Embedding(24, dim)
        self.offset = nn.Parameter(torch.randn(1, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        positions = torch.arange(t)
        h = (self.seg(torch.zeros(b, t, dtype=torch.long)) + self.pos(positions) + self.offset) + self.tok(idx)
        h = h * torch.sigmoid(self.offset + self.pos2(positions))
        return self.head(h)


@pytest.mark.parametrize("steps", [SQUARE, STEPS], ids=["square", "mixed"])
def test_shared_tensors_combined_before_the_batch(steps: list[tuple[int, int]]) -> None:
    torch.manual_seed(13)
    for keep, clip, stats in MODES:
        run(BeforeTheBatch().double(), ids(9), token_loss, keep, clip, stats, steps=steps)


class Undecided(nn.Module):
    """A layer input created inside the forward with the batch size on its batch dim, whose output
    never meets a tensor computed from the model's inputs in a broadcasting op (``how``: reaches
    the loss alone; meets the batch in einsum, or in the matmul that says the same)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.seg = nn.Embedding(2, 3) if how == "alone" else nn.Identity()
        self.pos, self.lin = nn.Embedding(24, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.how == "alone":
            return self.lin(x).sum() + self.seg(torch.zeros(b, t, dtype=torch.long)).sum()
        h, pos = self.lin(x), self.pos(torch.arange(t))
        scores = torch.einsum("btd,sd->bts", h, pos) if self.how == "einsum" else h @ pos.mT
        return (scores.softmax(-1) @ h).mean(1)


def test_inputs_created_inside_the_forward_that_cannot_be_decided_are_clear_errors() -> None:
    x = torch.randn(4, 4, 3)
    with PerSampleModule(Undecided("alone")) as psm:
        loss = psm(x)
        with pytest.raises(SharedInputError, match=r"^layer 'seg' \(Embedding\) got an input of shape \(4, 4\) created "
                           r"inside the forward.*reached the loss without.*pass it to the model as an argument"):  # fmt: skip
            loss.backward()
    with (
        PerSampleModule(Undecided("einsum")) as psm,
        pytest.raises(SharedInputError, match=r"^layer 'pos' \(Embedding\) got an input created inside the forward.*"
                      r"meets the batch in einsum.*h @ pos.mT"),
    ):  # fmt: skip
        psm(x)
    torch.manual_seed(14)
    run(Undecided("matmul").double(), floats(3, 3), squared, True, 0.5, False, steps=SQUARE)  # the fix it names


class Offsets(nn.Module):
    """Two raw ``[1, D]`` parameters, each added with rows of a buffer to the activations ``[B, T, D]``:
    at B = T = 1 the explicit expansion to the batch is the identity, so both parameters' gradients come
    from the one gradient of the sum that autograd hands both branches."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.w0, self.w1 = nn.Parameter(torch.randn(1, dim)), nn.Parameter(torch.randn(1, dim))
        self.register_buffer("table", torch.randn(8, dim))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = x + (self.w0 + self.table[:t])
        h = h + (self.w1 + self.table[:t])
        return self.head(h)


@pytest.mark.parametrize("grad_scaler", [None, 256.0])
@pytest.mark.parametrize("clear", ["zero", "accumulate"])
def test_parameters_met_at_a_batch_of_one_get_a_grad_of_their_own(grad_scaler: float | None, clear: str) -> None:
    """Each parameter's ``.grad`` is its own tensor, also where pergrad's expansion of a raw parameter to a
    batch of one passes the gradient on unchanged: ``.grad`` zeroed in place or accumulated over steps
    holds every step's sum for each parameter alone (autograd, which makes ``.grad`` of the gradient it
    receives, would otherwise add one parameter's gradient into the other's)."""
    torch.manual_seed(0)
    model = Offsets().double()
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    scale = 1.0 if grad_scaler is None else grad_scaler
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with PerSampleModule(model, keep_grad_sample=False, track_norms=True, grad_scaler=grad_scaler) as psm:
        for step, (b, t) in enumerate([(1, 1), (1, 1), (1, 1), (3, 2), (1, 1)]):
            x, y = torch.randn(b, t, 3, generator=gen, dtype=torch.float64), torch.randn(b, t, 2, generator=gen)
            ref = one_at_a_time(plain, x, y.double(), squared)
            if clear == "zero":
                psm.zero_grad(set_to_none=False)
                want = {n: torch.zeros_like(g) for n, g in want.items()}
            want = {n: want[n] + ref[n].mean(0) * scale for n in want}
            (squared(psm(x), y.double()) / b * scale).backward()
            norms = psm.per_sample_norms()
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}): {name}"
                assert_close(p.grad, want[name], f".grad of {what}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")
        w0, w1 = model.w0.grad, model.w1.grad
        assert w0 is not None and w1 is not None
        assert w0.untyped_storage().data_ptr() != w1.untyped_storage().data_ptr()
