"""Adversarial tests of lean forwards (``pergrad._core.shortcuts.followed``): models and loops a user writes, each
run over several steps (lean from the third forward of a kind), every step's clipped ``.grad`` (and, where asked,
``grad_sample`` and the per-sample norms) checked against a one-sample-at-a-time autograd loop on a copy."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pergrad import PerSampleModule, transforms
from pergrad.errors import BatchSizeError
from tests.reference import assert_close, clipped_mean

pytestmark = pytest.mark.usefixtures("float64")
BOUND = 0.5
UNMATCHED = r"took a path the forwards pergrad followed with arguments of the same shapes did not take"
FOLLOWED = bool(os.environ.get("ATTACK_LEAN_FOLLOWED"))  # check the references against the old behaviour

Batch = tuple[tuple[Any, ...], dict[str, Any], Tensor]  # the model's arguments, keywords, and the labels
Loss = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Tensor], Tensor]


def ce(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], y: Tensor) -> Tensor:
    return F.cross_entropy(model(*args, **kwargs), y)


def sample(v: Any, i: int, b: int, dim: int) -> Any:
    """Sample ``i`` of ``v`` where ``v`` is a tensor with the batch (size ``b``) on ``dim``, else ``v``."""
    if isinstance(v, Tensor) and v.dim() > dim and v.shape[dim] == b:
        return v.narrow(dim, i, 1)
    return v


def one_at_a_time(model: nn.Module, batch: Batch, loss: Loss, dim: int = 0) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: each sample's gradient of its own loss, by autograd on a copy of ``model``."""
    ref = copy.deepcopy(model)
    args, kwargs, y = batch
    b = y.shape[0]
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    grads: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(b):
        one_args = tuple(sample(a, i, b, dim) for a in args)
        one_kwargs = {k: sample(v, i, b, dim) for k, v in kwargs.items()}
        found = torch.autograd.grad(
            loss(ref, one_args, one_kwargs, y[i : i + 1]), list(params.values()), allow_unused=True
        )
        for n, g in zip(params, found, strict=True):
            grads[n].append(torch.zeros_like(params[n]) if g is None else g)
    return {n: torch.stack(gs) for n, gs in grads.items()}


def wrapped(model: nn.Module, **options: Any) -> PerSampleModule:
    psm = PerSampleModule(model, **{"keep_grad_sample": False, "lean_forwards": not FOLLOWED, **options})
    psm.register_transform(model, transforms.clip_norm(BOUND))
    return psm


def step(
    psm: PerSampleModule,
    model: nn.Module,
    batch: Batch,
    what: str,
    loss: Loss = ce,
    dim: int = 0,
    call: nn.Module | None = None,
    norms: bool = False,
) -> bool:
    """One clipped step checked against the reference, then SGD; whether its forward ran lean."""
    expected = one_at_a_time(model, batch, loss, dim)
    mean = clipped_mean(expected, BOUND)
    model.zero_grad(set_to_none=True)
    args, kwargs, y = batch
    loss(psm if call is None else call, args, kwargs, y).backward()
    lean = psm._hooks.followed.lean
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            assert not expected[n].any(), f"{what}: no .grad of {n}"
            continue
        assert_close(p.grad, mean[n], f"{what}: .grad of {n}")
        if getattr(psm.options, "keep_grad_sample", False) and hasattr(p, "grad_sample"):
            assert_close(p.grad_sample, expected[n], f"{what}: grad_sample of {n}")
    if norms:
        found = psm.per_sample_norms()
        for n in expected:
            if n in found:
                assert_close(found[n], expected[n].flatten(1).norm(dim=1), f"{what}: norm of {n}")
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    return lean


def run(
    model: nn.Module,
    batches: Callable[[int], Batch],
    steps: int = 7,
    *,
    psm: PerSampleModule | None = None,
    before: Callable[[int], None] | None = None,
    loss: Loss = ce,
    dim: int = 0,
    norms: bool = False,
    **options: Any,
) -> list[bool]:
    """``steps`` checked steps; which of them ran lean."""
    psm = wrapped(model, **options) if psm is None else psm
    leans = []
    for k in range(steps):
        if before is not None:
            before(k)
        leans.append(step(psm, model, batches(k), f"step {k}", loss, dim, norms=norms))
    return leans


def flat(b: int, d: int = 4) -> Callable[[int], Batch]:
    """Batches ``x [B, D]``, ``y [B]``."""

    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(b, d, generator=g),), {}, torch.randint(0, 3, (b,), generator=g)

    return make


def lean(leans: list[bool]) -> None:
    """Some step ran lean (the test would not reach what it attacks otherwise)."""
    assert FOLLOWED or any(leans), leans


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def seq(b: int, t: int, d: int = 4, classes: int = 3) -> Callable[[int], Batch]:
    """Batches ``x [B, T, D]``, ``y [B]``, new values each step."""

    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(b, t, d, generator=g),), {}, torch.randint(0, classes, (b,), generator=g)

    return make


# -- data-dependent branches --------------------------------------------------------------------------------------


class ValueBranch(nn.Module):
    """A layer more where the batch's mean is positive (a branch on the values of ``x``)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        if x.mean() > 0:
            h = h + self.b(h)
        return self.head(h).mean(1)


@pytest.mark.parametrize("t", [4, 5])
def test_branch_on_the_values_of_x(t: int) -> None:
    def make(k: int) -> Batch:
        (x,), _, y = seq(4, t)(k)
        return (x + (1.0 if k in (3, 5, 8) else -1.0),), {}, y  # the branch taken from step 3 on, now and then

    lean(run(ValueBranch(), make, 10))


class PerSampleWhere(nn.Module):
    """Each sample through one of two layers, chosen by the sign of its features (``torch.where``)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        pick = x.sum(-1, keepdim=True) > 0
        h = torch.where(pick, self.a(x), self.b(x))
        return self.head(h.relu()).sum(1)


@pytest.mark.parametrize("t", [4, 5])
def test_torch_where_per_sample(t: int) -> None:
    lean(run(PerSampleWhere(), seq(4, t), 7))


class SoftMoE(nn.Module):
    """Top-1 routing per token: every expert runs, the router's weight zeroed where it did not win."""

    def __init__(self, d: int = 4, experts: int = 3) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.router(x).softmax(-1)
        top = gate.argmax(-1, keepdim=True)
        gate = gate * F.one_hot(top.squeeze(-1), gate.shape[-1]).to(gate.dtype)
        h = x
        for e, expert in enumerate(self.experts):
            if bool((top == e).any()):  # an expert no token chose is not run (a data-dependent set of calls)
                h = h + gate[..., e : e + 1] * expert(x)
        return self.head(h).mean(1)


@pytest.mark.parametrize("t", [4, 5])
def test_moe_routing_skips_unchosen_experts(t: int) -> None:
    lean(run(SoftMoE(), seq(4, t, 4), 10))


class Adaptive(nn.Module):
    """A block applied ``self.n`` times (a number of calls that changes between steps, as with a depth drawn
    from the data)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp, self.block, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.n = 2

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for _ in range(self.n):
            h = torch.tanh(self.block(h)) * 0.5
        return self.head(h).mean(1)


@pytest.mark.parametrize("t", [4, 5])
def test_layer_called_a_data_dependent_number_of_times(t: int) -> None:
    model = Adaptive()

    def before(k: int) -> None:
        model.n = [2, 2, 2, 3, 1, 0, 2, 4, 2][k]

    lean(run(model, seq(4, t), 9, before=before))


class InPlace(nn.Module):
    """In-place ops on activations (``relu_``, ``mul_``, a masked fill from the input) between layers."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x) + 0.0
        h.mul_(2.0)
        h.masked_fill_(x < -1.0, 0.0)
        h = self.b(h)
        h.mul_(0.5)  # in place on a layer's output
        h = h + x
        out = self.head(h)
        return out.mean(1) if out.dim() == 3 else out


@pytest.mark.parametrize("t", [4, 5])
def test_in_place_ops_on_activations(t: int) -> None:
    run(InPlace(), seq(4, t), 7)  # (in place on a Linear's output [B, T, D], a view: its kind stays followed)
    lean(run(InPlace(), flat(t), 7))


class Dropped(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a, self.drop, self.head = nn.Linear(d, d), nn.Dropout(0.5), nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.drop(torch.tanh(self.a(x)))).mean(1)


def test_eval_mode_forwards_with_grad_between_training_forwards_without() -> None:
    """Attribution-style: eval-mode forwards with grad (dropout off) checked, and between them training-mode
    forwards without grad (dropout on) of the same shapes; lean from the third eval forward."""
    model = Dropped()
    psm = wrapped(model)
    model.eval()
    found = []
    for k in range(8):
        model.train()
        with torch.no_grad():
            psm(seq(4, 4)(k + 100)[0][0])
        model.eval()
        found.append(step(psm, model, seq(4, 4)(k), f"step {k}"))
    lean(found)


# -- sequence-first, recurrent, attention ------------------------------------------------------------------------


class SeqFirstLSTM(nn.Module):
    def __init__(self, d: int = 4, batch_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.inp = nn.Linear(d, d)
        self.rnn = nn.LSTM(d, d, batch_first=batch_first)
        self.head = nn.Linear(d, 3)
        self.batch_first = batch_first

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(torch.tanh(self.inp(x)))
        return self.head(out).mean(1 if self.batch_first else 0)


@pytest.mark.parametrize("t", [4, 5])
def test_sequence_first_wrapper_lstm(t: int) -> None:
    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(t, 4, 4, generator=g),), {}, torch.randint(0, 3, (4,), generator=g)

    lean(run(SeqFirstLSTM(), make, 7, dim=1, batch_first=False))


@pytest.mark.parametrize("t", [4, 5])
def test_batch_first_gru_after_a_user_transpose(t: int) -> None:
    """``x [B, T, D]``, a GRU built sequence-first, the user transposes before and after it."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.inp, self.rnn, self.head = nn.Linear(4, 4), nn.GRU(4, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            out, _ = self.rnn(self.inp(x).transpose(0, 1))
            return self.head(out.transpose(0, 1).mean(1))

    run(M(), seq(4, t), 7)


class Attention(nn.Module):
    def __init__(self, d: int = 4, batch_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.inp = nn.Linear(d, d)
        self.mha = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.head = nn.Linear(d, 3)
        self.batch_first = batch_first

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out, _ = self.mha(h, h, h, key_padding_mask=pad, need_weights=False)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out.masked_fill(pad.unsqueeze(-1), 0.0).sum(1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("t", [4, 5])
def test_multihead_attention_with_padding_that_changes(batch_first: bool, t: int) -> None:
    def make(k: int) -> Batch:
        g = gen(k)
        pad = torch.zeros(4, t, dtype=torch.bool)
        if k % 2:  # padding in some steps only
            pad[1, -2:] = True
            pad[3, -1:] = True
        return (torch.randn(4, t, 4, generator=g), pad), {}, torch.randint(0, 3, (4,), generator=g)

    run(Attention(batch_first=batch_first), make, 8)


# -- layers of the first call: convolutions, embeddings ----------------------------------------------------------


@pytest.mark.parametrize("t", [4, 5])
def test_conv1d_on_channels_then_time_with_t_equal_b(t: int) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(9)
            self.conv, self.head = nn.Conv1d(3, 4, 3, padding=1), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(F.relu(self.conv(x)).mean(-1))

    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(4, 3, t, generator=g),), {}, torch.randint(0, 3, (4,), generator=g)

    lean(run(M(), make, 7))


@pytest.mark.parametrize("t", [4, 5])
def test_embedding_with_padding_idx(t: int) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(10)
            self.emb, self.head = nn.Embedding(7, 4, padding_idx=0), nn.Linear(4, 3)

        def forward(self, ids: Tensor) -> Tensor:
            return self.head(self.emb(ids).sum(1))

    def make(k: int) -> Batch:
        g = gen(k)
        ids = torch.randint(0, 7, (4, t), generator=g)
        ids[:, -1] = 0
        return (ids,), {}, torch.randint(0, 3, (4,), generator=g)

    lean(run(M(), make, 7))


# -- what the signature of a call does not see ------------------------------------------------------------------


def scan(h: Tensor, dim: int, inner: int = 40) -> Tensor:
    """A smoothing over time (``dim``) written step by step: many autograd nodes, and no layer, between layers."""
    s = torch.zeros_like(h.select(dim, 0))
    steps = []
    for k in range(h.shape[dim]):
        for _ in range(inner):
            s = s * 0.9 + h.select(dim, k) * 0.1
        steps.append(s)
    return torch.stack(steps, dim)


class DeepChain(nn.Module):
    """Smoothings over time between the layers; with ``time_major`` (switched on by the user once the forwards
    run lean) the middle layer runs time-major (``[T, B, D]``: with T == B the shape and strides of ``[B, T, D]``),
    the transposes hidden from the signature's path by the smoothings' many nodes."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.time_major = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.time_major:
            h = h.transpose(0, 1)
        out = self.b(scan(h, 0 if self.time_major else 1))
        if self.time_major:
            out = out.transpose(0, 1)
        return self.head(scan(out, 1)).mean(1)


@pytest.mark.parametrize("t", [4, 5])
def test_a_transpose_deeper_than_the_signature_looks(t: int) -> None:
    """T == B: the time-major input of ``b`` has the batch-major one's shape and strides, and its autograd path
    differs from the record's only past ``PATH`` nodes; it must not be taken for batched on dim 0 (T != B: the
    shape differs, refused once then followed)."""
    model = DeepChain()

    def before(k: int) -> None:
        model.time_major = k >= 4

    assert not any(run(model, seq(4, t), 7, before=before))  # (paths longer than ``PATH``: followed)


class TimeMajor(nn.Module):
    """``x [B, T, D]`` standardized inside the forward (no autograd history); with ``time_major`` (a user's switch)
    the whole model runs time-major after a ``transpose(0, 1).contiguous()`` of it: every layer's input then has
    the batch on dim 1, with T == B the shape and strides of the batch-major one."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.a, self.head = nn.Linear(d, d), nn.Linear(d, 3)
        self.time_major = False

    def forward(self, x: Tensor) -> Tensor:
        h = (x - x.mean(-1, keepdim=True)) * 2.0
        if self.time_major:
            h = h.transpose(0, 1).contiguous()
        out = self.head(torch.tanh(self.a(h)))
        return out.mean(0 if self.time_major else 1)


@pytest.mark.parametrize("t", [4, 5])
def test_a_transpose_of_an_input_without_autograd_history(t: int) -> None:
    """The first layer's input has no autograd path: its signature is its shape and strides alone. With T == B a
    time-major forward must not be taken for a batch-major one (T != B: another shape, refused once)."""
    model = TimeMajor(d=3)

    def before(k: int) -> None:
        model.time_major = k >= 4

    if t == 4:
        assert not any(run(model, seq(4, t, 3), 7, before=before))  # (T == B: followed)
        return
    psm = wrapped(model)
    run(model, seq(4, t, 3), 4, psm=psm)
    model.time_major = True
    if not FOLLOWED:
        with pytest.raises(BatchSizeError, match=UNMATCHED):
            F.cross_entropy(psm(seq(4, t, 3)(4)[0][0]), seq(4, t, 3)(4)[2]).backward()
    run(model, seq(4, t, 3), 7, psm=psm)


# -- HuggingFace: attention masks that change between steps -------------------------------------------------------


def hf_family(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(13)
    if family == "bert":
        config = transformers.BertConfig(
            vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            max_position_embeddings=16, num_labels=3,
        )  # fmt: skip
        return transformers.BertForSequenceClassification(config).double().eval()
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=16, max_position_embeddings=16, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForSequenceClassification(config).double().eval()


def hf_loss(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], y: Tensor) -> Tensor:
    return F.cross_entropy(model(*args, **kwargs).logits, y)


HF_FALSE_ERROR = pytest.mark.xfail(
    strict=True,
    raises=BatchSizeError,
    reason="false error: the first padded batch after lean forwards takes HF's other mask path (SDPA with a mask in "
    "place of is_causal), new to the records; at T == B o_proj's input [B, T, D] has the batch's size on two dims "
    "and is computed by ops other than elementwise ones, so the lean forward cannot answer it and raises "
    "BatchSizeError (every forward followed, as before lean forwards, is exact)",
)


@pytest.mark.parametrize(
    ("family", "t"),
    [("bert", 4), ("bert", 5), pytest.param("llama", 4, marks=HF_FALSE_ERROR), ("llama", 5)],
)
def test_hf_attention_mask_with_and_without_padding(family: str, t: int) -> None:
    """Dynamic padding: some batches padded (right, last token 0), others not; HF's mask code branches on the
    mask's values (SDPA's ``is_causal`` where nothing is padded). Float32 inside Llama's rotary: the one-sample
    loop agrees to float32 round-off, so the rotary-free BERT is the exact one."""
    model = hf_family(family)

    def make(k: int) -> Batch:
        g = gen(k)
        ids = torch.randint(1, 40, (4, t), generator=g)
        mask = torch.ones(4, t, dtype=torch.long)
        if k in (3, 5, 6):
            mask[1, -1] = mask[2, -2:] = 0
            ids[mask == 0] = 0
        return (), {"input_ids": ids, "attention_mask": mask}, torch.randint(0, 3, (4,), generator=g)

    if family == "llama":
        pytest.importorskip("transformers")
    global assert_close
    exact = assert_close
    if family == "llama":

        def loose(actual: Tensor, expected: Tensor, what: str = "") -> None:
            scale = float(expected.abs().max()) + 1e-30
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")

        assert_close = loose
    try:
        run(model, make, 8, loss=hf_loss)
    finally:
        assert_close = exact


# -- compile, checkpointing, options ------------------------------------------------------------------------------


class Blocks(nn.Module):
    def __init__(self, d: int = 4, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(14)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(2))
        self.head = nn.Linear(d, 3)
        self.checkpointed = checkpointed

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + (checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h))
        out = self.head(h)
        return out.mean(1) if out.dim() == 3 else out


@pytest.mark.parametrize("t", [4, 5])
def test_non_reentrant_checkpointing(t: int) -> None:
    """(Its kind stays followed; exact.)"""
    run(Blocks(checkpointed=True), seq(4, t), 7)


@pytest.mark.parametrize("t", [4, 5])
def test_compiled_model(t: int) -> None:
    torch._dynamo.reset()
    model = Blocks()
    psm = wrapped(model)
    compiled = torch.compile(psm, backend="eager")
    found = []
    try:
        for k in range(6):
            found.append(step(psm, model, seq(4, t)(k), f"step {k}", call=compiled))
    finally:
        torch._dynamo.reset()
    lean(found)


@pytest.mark.parametrize("t", [4, 5])
def test_grad_sample_and_norms_kept(t: int) -> None:
    lean(run(Blocks(), seq(4, t), 7, norms=True, keep_grad_sample=True, track_norms=True))


def test_micro_batches_accumulated_by_samples() -> None:
    """Two micro-batches per step (``accumulate="samples"``), of sizes 4 and 3 (two kinds), then ``.grad``."""
    model = Blocks()
    psm = wrapped(model, accumulate="samples")
    found = []
    for k in range(7):
        first, second = seq(4, 4)(k), seq(3, 4)(k + 50)
        whole = (torch.cat([first[0][0], second[0][0]]),), {}, torch.cat([first[2], second[2]])
        mean = clipped_mean(one_at_a_time(model, whole, ce), BOUND)
        model.zero_grad(set_to_none=True)
        for part in (first, second):
            ce(psm, *part[:2], part[2]).backward()
            found.append(psm._hooks.followed.lean)
        for n, p in model.named_parameters():
            assert p.grad is not None
            assert_close(p.grad, mean[n], f"step {k}: .grad of {n}")
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]
    lean(found)


def test_micro_batches_with_loss_scale() -> None:
    """Two micro-batches per step (sizes 4 and 4, then 4 and 3), each loss divided by 2 (``loss_scale=0.5``)."""
    model = Blocks()
    psm = wrapped(model, loss_scale=0.5)
    found = []
    for k in range(7):
        parts = [seq(4, 4)(k), seq(4 if k < 4 else 3, 4)(k + 50)]
        means = [clipped_mean(one_at_a_time(model, part, ce), BOUND) for part in parts]
        model.zero_grad(set_to_none=True)
        for part in parts:
            (ce(psm, *part[:2], part[2]) * 0.5).backward()
            found.append(psm._hooks.followed.lean)
        for n, p in model.named_parameters():
            assert p.grad is not None
            assert_close(p.grad, (means[0][n] + means[1][n]) / 2, f"step {k}: .grad of {n}")
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]
    lean(found)


def test_two_models_alternating() -> None:
    models = [Blocks(), InPlace()]
    psms = [wrapped(m) for m in models]
    found = []
    for k in range(12):
        m, p = models[k % 2], psms[k % 2]
        found.append(step(p, m, seq(4, 4)(k), f"step {k}"))
    lean(found)


def test_wrapper_deepcopied_mid_run() -> None:
    """A deepcopy of the wrapper (and its model) once the forwards run lean: both go on exact."""
    model = Blocks()
    psm = wrapped(model)
    run(model, seq(4, 4), 4, psm=psm)
    twin = copy.deepcopy(psm)
    lean(run(twin.module, seq(4, 4), 5, psm=twin))
    lean(run(model, seq(4, 4), 5, psm=psm))


def test_removed_and_wrapped_again() -> None:
    model = Blocks()
    psm = wrapped(model)
    run(model, seq(4, 4), 4, psm=psm)
    psm.remove()
    model.blocks[0][1] = nn.ReLU()  # another path in the model wrapped again
    lean(run(model, seq(4, 4), 6))


def test_model_to_float32_and_back_mid_run() -> None:
    """``model.float()`` for some steps (not checked: float32), then ``model.double()`` again: exact."""
    model = Blocks()
    psm = wrapped(model)
    run(model, seq(4, 4), 4, psm=psm)
    model.float()
    for k in range(3):
        (x,), _, y = seq(4, 4)(k)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(psm(x.float()), y).backward()
    model.double()
    lean(run(model, seq(4, 4), 5, psm=psm))


@pytest.mark.parametrize("t", [4, 5])
def test_user_pre_hook_added_midway(t: int) -> None:
    """A forward pre-hook that rescales a layer's input, and one that gives it the other block's output, added
    once the forwards run lean; removed later."""
    model = Blocks()
    handles: list[Any] = []

    def before(k: int) -> None:
        if k == 3:
            handles.append(model.blocks[1][0].register_forward_pre_hook(lambda m, a: (a[0] * 2.0,)))
        if k == 5:
            handles.append(model.head.register_forward_pre_hook(lambda m, a: (torch.relu(a[0]),)))
        if k == 7:
            for h in handles:
                h.remove()

    lean(run(model, seq(4, t), 10, before=before))


class TwoViews(nn.Module):
    """Contrastive-style: one encoder on two views of each sample in one forward (each layer called twice), the
    loss of sample ``i`` from its own two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = Blocks()

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.enc(x1) + self.enc(x2).tanh()


@pytest.mark.parametrize("t", [4, 5])
def test_two_views_per_forward(t: int) -> None:
    def make(k: int) -> Batch:
        (x,), _, y = seq(4, t)(k)
        return (x, x.flip(1) * 0.5), {}, y

    lean(run(TwoViews(), make, 7))


class LSTMWithState(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(15)
        self.rnn, self.head = nn.LSTM(d, d, batch_first=True), nn.Linear(d, 3)
        self.h0 = nn.Linear(d, 2 * d)

    def forward(self, x: Tensor) -> Tensor:
        h0, c0 = self.h0(x.mean(1)).chunk(2, -1)  # each sample's own initial state, [1, B, D]
        out, _ = self.rnn(x, (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous()))
        return self.head(out.mean(1))


@pytest.mark.parametrize("t", [4, 5])
def test_batch_first_lstm_with_an_initial_state_from_the_batch(t: int) -> None:
    run(LSTMWithState(), seq(4, t), 7)


class LSTMState(nn.Module):
    """A two-layer LSTM; with ``use_state`` (switched on once the forwards run lean) a layer more on its final
    hidden state ``h_n [layers, B, H]``, whose batch is on dim 1 (with B == layers, dim 0 has the batch's size)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(16)
        self.rnn = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.head, self.proj = nn.Linear(d, 3), nn.Linear(d, 3)
        self.use_state = False

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _) = self.rnn(x)
        y = self.head(out.mean(1))
        if self.use_state:
            y = y + self.proj(torch.tanh(h)).sum(0)
        return y


@pytest.mark.parametrize("b", [2, 3])  # B == layers, and not
def test_a_new_layer_on_a_recurrent_layers_final_state(b: int) -> None:
    """The unmatched call's input is an elementwise function of an output of a layer call, an output whose batch
    is on dim 1: it must not be answered as batched on dim 0."""
    model = LSTMState()

    def before(k: int) -> None:
        model.use_state = k >= 4

    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(b, 3, 4, generator=g),), {}, torch.randint(0, 3, (b,), generator=g)

    psm = wrapped(model)
    found = run(model, make, 4, psm=psm)
    model.use_state = True
    try:
        found += run(model, lambda k: make(k + 4), 4, psm=psm)
    except BatchSizeError:
        found += run(model, lambda k: make(k + 4), 4, psm=psm)  # (refused once, then followed: exact)
    lean(found)


class OutOrState(nn.Module):
    """A two-layer LSTM whose pooled features come from its outputs ``[B, T, H]`` or, with ``from_state`` (the
    user's switch), from its final states ``[layers, B, H]``: with layers == T == B the same shape and strides."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        torch.manual_seed(17)
        self.rnn, self.proj = nn.LSTM(d, d, num_layers=2, batch_first=True), nn.Linear(d, 3)
        self.from_state = False

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _) = self.rnn(x)
        return self.proj(torch.tanh(h if self.from_state else out)).sum(0 if self.from_state else 1)


def test_a_layer_on_a_recurrent_layers_state_in_place_of_its_output() -> None:
    """The record's input came from the LSTM's output (batch on dim 0), the lean one's from its final state (batch
    on dim 1), with equal shapes: the path names the output's batch dim, so the call does not match."""
    model = OutOrState()

    def before(k: int) -> None:
        model.from_state = k >= 4

    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randn(2, 2, 4, generator=g),), {}, torch.randint(0, 3, (2,), generator=g)

    psm = wrapped(model)
    found = run(model, make, 4, psm=psm)
    model.from_state = True
    try:
        found += run(model, lambda k: make(k + 4), 4, psm=psm)
    except BatchSizeError:
        found += run(model, lambda k: make(k + 4), 4, psm=psm)  # (refused once, then followed: exact)
    lean(found)


class Parametrized(nn.Module):
    """Weight norm (a parametrization) on the first layer, the embedding tied to the output layer."""

    def __init__(self, d: int = 4, vocab: int = 6) -> None:
        super().__init__()
        torch.manual_seed(18)
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.utils.parametrizations.weight_norm(nn.Linear(d, d))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mid(self.emb(ids)))).mean(1)


@pytest.mark.parametrize("t", [4, 5])
def test_weight_norm_and_tied_embeddings(t: int) -> None:
    def make(k: int) -> Batch:
        g = gen(k)
        return (torch.randint(0, 6, (4, t), generator=g),), {}, torch.randint(0, 6, (4,), generator=g)

    run(Parametrized(), make, 7, norms=True, keep_grad_sample=True, track_norms=True)


@pytest.mark.parametrize("t", [4, 5])
def test_inputs_cut_from_batches_padded_to_other_widths(t: int) -> None:
    """The loop cuts each batch to its longest sample (``x[:, :T]`` of a batch padded to another width each step):
    the model's argument has the same shape every step and other strides (a view)."""

    def make(k: int) -> Batch:
        g = gen(k)
        width = t + (2 if k in (4, 6) else 0)  # wider batches from step 4 on, now and then
        return (torch.randn(4, width, 4, generator=g)[:, :t],), {}, torch.randint(0, 3, (4,), generator=g)

    lean(run(Blocks(), make, 9))


class Positions(nn.Module):
    """Position ids from the attention mask where a batch is padded (``mask.cumsum(1) - 1``, each sample's own),
    else ``arange(T)`` expanded over the batch (shared): a data-dependent branch of the user's."""

    def __init__(self, d: int = 4, vocab: int = 7) -> None:
        super().__init__()
        torch.manual_seed(19)
        self.tok, self.pos, self.head = nn.Embedding(vocab, d), nn.Embedding(8, d), nn.Linear(d, 3)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        if bool((mask == 0).any()):
            pos = (mask.cumsum(1) - 1).clamp(min=0)
        else:
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        h = (self.tok(ids) + self.pos(pos)) * mask.unsqueeze(-1)
        return self.head(torch.tanh(h).sum(1))


@pytest.mark.parametrize(
    "t",
    [
        4,  # (T == B: position ids computed without autograd history, [B, T]: the kind stays followed)
        pytest.param(
            5,
            marks=pytest.mark.xfail(
                strict=True,
                raises=BatchSizeError,
                reason="false error: the first batch without padding after lean forwards looks positions up with "
                "arange(T).expand(B, T), a branch new to the records (stride 0); shared, without autograd history, "
                "it cannot be answered without following and the lean forward raises BatchSizeError (every forward "
                "followed is exact)",
            ),
        ),
    ],
)
def test_position_ids_from_the_mask_or_shared(t: int) -> None:
    """Padded batches first (the kind runs lean on batched position ids), then one without padding (shared ones)."""

    def make(k: int) -> Batch:
        g = gen(k)
        ids = torch.randint(1, 7, (4, t), generator=g)
        mask = torch.ones(4, t, dtype=torch.long)
        if k not in (4, 6):
            mask[1, -1] = mask[3, -2:] = 0
        return (ids, mask), {}, torch.randint(0, 3, (4,), generator=g)

    found = run(Positions(), make, 8)
    assert FOLLOWED or not any(found)
