"""Activation checkpointing, reentrant or not: every step's ``.grad`` (root clipping) and
``grad_sample`` exact against torch.func.

Reentrant checkpointing recomputes a segment inside the backward and backwards it in a nested
graph task of its own; that nested backward is part of the outer one (one set of per-sample
gradients, one clipping over every layer), not a backward pass of its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pergrad import BatchSizeError, HookStateError, PerSampleModule, SecondOrderError, SharedInputError, transforms
from tests.reference import assert_close, clipped_mean, reference_grad_sample

CLIP = 0.5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.outer(torch.tanh(self.inner(h)))


class Net(nn.Module):
    """Linear -> two checkpointed residual blocks -> Linear, on ``[B, D]`` or ``[B, T, D]`` inputs."""

    def __init__(self, reentrant: bool | None, whole: bool = False) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(5, 6), nn.ModuleList([Block(6), Block(6)]), nn.Linear(6, 3)
        self.reentrant, self.whole = reentrant, whole

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None or self.whole else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.out(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole:  # nothing hooked runs before the recomputation, in the outer backward
            assert self.reentrant is not None
            return checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.body(x)


# (batch, positions): on [B, D] and on [B, T, D] on both sides of the 16 positions from which
# layers that build g_i run their weight detached
SHAPES = [(5, None), (3, 4), (6, None), (2, 17), (4, 16), (3, 15)]


@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "whole-model"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("keep", [True, False], ids=["grad_sample", "fused"])
def test_checkpointed_model_is_exact_on_every_step(reentrant: bool, whole: bool, keep: bool) -> None:
    torch.manual_seed(0)
    model = Net(reentrant, whole).double()
    plain = Net(None).double()
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=True)
    psm.register_transform(model, transforms.clip_norm(CLIP))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for b, t in SHAPES:
        plain.load_state_dict(model.state_dict())
        shape = (b, 5) if t is None else (b, t, 5)
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=reentrant)  # reentrant: an input needing grad
        y = torch.randn(*shape[:-1], 3, dtype=torch.float64)
        ref = reference_grad_sample(plain, x.detach(), y)
        expected = clipped_mean(ref, CLIP)
        opt.zero_grad()
        ((psm(x) - y) ** 2).flatten(1).sum(1).mean().backward()
        norms = psm.per_sample_norms()
        for name, p in model.named_parameters():
            assert_close(p.grad, expected[name], f".grad of {name} at B={b} T={t}")
            assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {name} at B={b} T={t}")
            if keep:
                assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at B={b} T={t}")
        opt.step()
    psm.remove()


class Positions(nn.Module):
    """Position embeddings without a batch dim (``wpe(torch.arange(T))``) added inside a segment
    (``inside``) or before it; the segment checkpointed (reentrant or not) or run plainly (``reentrant=None``),
    then a head outside it."""

    def __init__(self, reentrant: bool | None, inside: bool = True) -> None:
        super().__init__()
        self.reentrant, self.inside = reentrant, inside
        self.inp, self.wpe, self.mlp = nn.Linear(5, 6), nn.Embedding(24, 6), nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def positions(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.wpe(torch.arange(h.shape[1]))

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mlp(self.positions(h) if self.inside else h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inside else self.positions(self.inp(x))
        out = self.segment(h) if self.reentrant is None else checkpoint(self.segment, h, use_reentrant=self.reentrant)
        return self.head(out)


def test_positions_inside_a_checkpointed_segment() -> None:
    """Non-reentrant: exact on every step, on both sides of 16 positions (the recomputation is a
    forward pergrad follows). Reentrant: the segment is computed again inside the backward, where
    pergrad cannot tell the positions from the batch: refused, saying what to change."""
    torch.manual_seed(0)
    model = Positions(reentrant=False).double()
    plain = Positions(None).double()
    with PerSampleModule(model, keep_grad_sample=True) as psm:
        psm.register_transform(model, transforms.clip_norm(CLIP))
        for b, t in [(3, 4), (2, 17), (4, 16), (1, 5)]:
            plain.load_state_dict(model.state_dict())
            x, y = torch.randn(b, t, 5, dtype=torch.float64), torch.randn(b, t, 3, dtype=torch.float64)
            ref = reference_grad_sample(plain, x, y)
            psm.zero_grad()
            ((psm(x) - y) ** 2).flatten(1).sum(1).mean().backward()
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at B={b} T={t}")
                assert_close(p.grad, clipped_mean(ref, CLIP)[name], f".grad of {name} at B={b} T={t}")
    refused = Positions(reentrant=True).double()
    with PerSampleModule(refused) as psm:
        out = psm(torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True))
        with pytest.raises(
            SharedInputError,
            match=r"layer 'mlp' \(Linear\), computed again inside the backward, took its input \(shape \(3, 4, 6\)\) "
            r"for one shared by the batch.*checkpoint this segment with use_reentrant=False",
        ):
            out.sum().backward()
        assert [n for n, p in refused.named_parameters() if p.grad is not None] == []  # (none left half-written)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hf_gradient_checkpointing_is_exact(reentrant: bool) -> None:
    """HF's ``gradient_checkpointing_enable`` on a tiny BERT (it checkpoints each layer in training mode;
    dropout off so that one sample alone computes what it does in the batch)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).double().train()
    plain = transformers.BertForSequenceClassification(config).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # what HF does for reentrant checkpointing of frozen embeddings
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(CLIP))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for b, t in [(3, 5), (4, 4), (2, 7)]:
        plain.load_state_dict(model.state_dict())
        ids, labels = torch.randint(1, 30, (b, t)), torch.randint(0, 3, (b,))
        losses = torch.nn.functional.cross_entropy(plain(input_ids=ids).logits, labels, reduction="none")
        params = dict(plain.named_parameters())
        rows = [torch.autograd.grad(f, list(params.values()), retain_graph=True, allow_unused=True) for f in losses]
        ref = {
            n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(params.items())
        }
        expected = clipped_mean(ref, CLIP)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(psm(input_ids=ids).logits, labels).backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                assert not expected[name].any(), name
                continue
            assert_close(p.grad, expected[name], f".grad of {name} at B={b} T={t}")
        opt.step()
    psm.remove()


class Offset(nn.Module):
    """A raw parameter broadcast over the batch (a module of the user's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 6))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.weight


class WithOffset(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp, self.offset, self.out, self.reentrant = nn.Linear(5, 6), Offset(), nn.Linear(6, 3), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.offset(h) if self.reentrant is None else checkpoint(self.offset, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_raw_parameter_in_a_checkpointed_segment(reentrant: bool) -> None:
    """Exact without reentrancy; refused with the fix under it (the recomputation runs outside the
    model's forward, where pergrad cannot follow which tensors carry the batch)."""
    torch.manual_seed(0)
    model, plain = WithOffset(reentrant).double(), WithOffset(None).double()
    psm = PerSampleModule(model)
    for b in (3, 4, 2):
        plain.load_state_dict(model.state_dict())
        x, y = torch.randn(b, 5, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)
        loss = ((psm(x) - y) ** 2).sum(1).mean()
        if reentrant:
            with pytest.raises(HookStateError, match="checkpoint this segment with use_reentrant=False"):
                loss.backward()
            return
        model.zero_grad()
        loss.backward()
        ref = reference_grad_sample(plain, x, y)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at B={b}")


class Biasless(nn.Module):
    """Two Linears without a bias on ``[B, T, D]`` in a segment under non-reentrant checkpointing (switched
    on by ``checkpointed``), and a head: after the segment, or (``whole``) inside it, then ``tanh``. A Linear
    without a bias that runs detached takes pergrad's zero as its bias (``addmm`` on a flattened view): its
    recomputation must run detached too, as run attached it saves tensors of other shapes. The segment ends
    in ``tanh``, whose saved output is unpacked (so the segment recomputed) before the output gradient of
    the layer under it arrives: ``whole``, before any of pergrad's hooks in the backward."""

    def __init__(self, whole: bool) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(5, 6, bias=False), nn.Linear(6, 4, bias=False)
        self.head = nn.Linear(4, 3)
        self.checkpointed, self.whole = True, whole

    def segment(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.outer(torch.tanh(self.inner(x))))
        return torch.tanh(self.head(h)) if self.whole else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.segment, x, use_reentrant=False) if self.checkpointed else self.segment(x)
        return h if self.whole else self.head(h)


def biasless_pair(whole: bool) -> tuple[Biasless, Biasless]:
    """The checkpointed model and a plain copy for torch.func (which takes no saved-tensor hooks)."""
    model = Biasless(whole).double()
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    return model, plain


@pytest.mark.parametrize("keep", [True, False], ids=["grad_sample", "fused"])
def test_checkpointing_switched_on_after_the_first_step_is_exact(keep: bool) -> None:
    """Checkpointing switched on from the second step (as ``gradient_checkpointing_enable()`` mid-run), the
    segment's weights run detached (clipped) and are recomputed detached: each ordinary backward starts in
    the recomputation, whose grad mode (on) is not the backward's, and is exact on every step, its weights
    detached on the next ones (not taken for a ``create_graph=True`` backward)."""
    torch.manual_seed(2)
    model, plain = biasless_pair(whole=True)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model, transforms.clip_norm(CLIP))
        for step, (b, t) in enumerate([(3, 4), (4, 3), (2, 17), (3, 16), (4, 2)]):
            model.checkpointed = step > 0
            plain.load_state_dict(model.state_dict())
            x = torch.randn(b, t, 5, dtype=torch.float64)
            y = torch.randn(b, t, 3, dtype=torch.float64)
            psm.zero_grad()
            ((psm(x) - y) ** 2).flatten(1).sum(1).mean().backward()
            ref = reference_grad_sample(plain, x, y)
            expected = clipped_mean(ref, CLIP)
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f".grad of {name} at step {step}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at step {step}")
            if step > 0:
                assert psm.module.inner.weight in psm._engine.detacher.current, f"step {step}: ran attached"


@pytest.mark.parametrize("second", ["torch.autograd.grad of the input", "backward(create_graph=True)"])
@pytest.mark.parametrize("keep", [True, False], ids=["grad_sample", "fused"])
def test_a_create_graph_backward_recomputes_a_segment_as_its_forward_ran(second: str, keep: bool) -> None:
    """A backward with ``create_graph=True`` through a forward whose segment's weights ran detached (the second
    step, clipped) reaches the head first (not transformed: attached), then recomputes the segment detached, as
    its forward ran (no weight runs detached in the forwards after it): refused with the ``SecondOrderError``
    that names the detached weight, not torch's error about recomputed tensors; .grad untouched, and the steps
    after it exact."""
    torch.manual_seed(1)
    model, plain = biasless_pair(whole=False)
    segment = [n for n, _ in model.named_parameters() if not n.startswith("head")]
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model.inner, transforms.clip_norm(CLIP))
        psm.register_transform(model.outer, transforms.clip_norm(CLIP))
        for step, (b, t) in enumerate([(3, 4), (4, 3), (2, 5), (3, 17)]):
            plain.load_state_dict(model.state_dict())
            x = torch.randn(b, t, 5, dtype=torch.float64, requires_grad=step == 1)
            y = torch.randn(b, t, 3, dtype=torch.float64)
            psm.zero_grad()
            loss = ((psm(x) - y) ** 2).flatten(1).sum(1).mean()
            if step == 1:
                with pytest.raises(
                    SecondOrderError, match=r"create_graph=True\) reached layer '(inner|outer)'.*detached"
                ):
                    if second == "backward(create_graph=True)":
                        loss.backward(create_graph=True)
                    else:
                        torch.autograd.grad(loss, x, create_graph=True)
                assert [n for n, p in model.named_parameters() if p.grad is not None] == []
                continue
            loss.backward()
            ref = reference_grad_sample(plain, x.detach(), y)
            expected = {n: g.mean(0) for n, g in ref.items()}
            expected.update({n: clipped_mean({n: ref[n]}, CLIP)[n] for n in segment})
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f".grad of {name} at step {step}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at step {step}")


class SeqFirstSegment(nn.Module):
    """A checkpointed segment that takes the batch-first ``[B, T, D]`` to sequence-first ``[T, B, D]`` and runs
    ``mid`` on it (``twice``: ``mid`` also runs outside the segment, on ``[B, T, D]``; ``reentrant=None``: not
    checkpointed)."""

    def __init__(self, reentrant: bool | None, twice: bool) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.reentrant, self.twice = reentrant, twice

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(h.transpose(0, 1))).transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.twice:
            h = torch.tanh(self.mid(h))
        if self.reentrant is None:  # (torch.func's reference: no checkpoint)
            return self.out(self.segment(h)).mean(1)
        return self.out(checkpoint(self.segment, h, use_reentrant=self.reentrant)).mean(1)


@pytest.mark.parametrize("twice", [False, True], ids=["in the segment", "also outside"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_batch_moved_inside_a_checkpointed_segment(reentrant: bool, twice: bool) -> None:
    """The recomputation does not run under the tracking of the forward's ops: each layer computed again takes
    the batch dim its calls in the forward had. Exact at ``T == B`` and not; a layer called with the batch on
    two dims, whose input shape cannot tell which (``T == B``), is refused naming the cause and the fix."""
    torch.manual_seed(0)
    model = SeqFirstSegment(reentrant, twice).double()
    plain = SeqFirstSegment(None, twice).double()
    psm = PerSampleModule(model, keep_grad_sample=True)
    psm.register_transform(model, transforms.clip_norm(CLIP))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for b, t in [(4, 4), (3, 5), (16, 16), (2, 17)]:
        plain.load_state_dict(model.state_dict())
        x, y = torch.randn(b, t, 5, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)
        ref = reference_grad_sample(plain, x, y)
        opt.zero_grad()
        loss = ((psm(x) - y) ** 2).sum(1).mean()
        if twice and t == b:
            with pytest.raises(
                BatchSizeError,
                match=r"layer 'mid' \(Linear\) is computed again inside the backward \(activation checkpointing\).*"
                r"had the batch on dims \[0, 1\], and this call's input \(shape \(\d+, \d+, 6\)\) has the batch's "
                r"size \d+ on dims \[0, 1\].*Call the layer with the batch on the same dim every time",
            ):
                loss.backward()
            assert [n for n, p in model.named_parameters() if p.grad is not None] == []
            continue
        loss.backward()
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"grad_sample of {name} at B={b} T={t}")
            assert_close(p.grad, clipped_mean(ref, CLIP)[name], f".grad of {name} at B={b} T={t}")
        opt.step()
