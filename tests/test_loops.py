"""Whole training loops, random ones: pergrad-driven Adam ends exactly where the same loop driven
by reference per-sample gradients (torch.func, float64) ends.

Each example draws a model (an MLP, or a token model with shared position embeddings, a LayerNorm
and a tied head), a transform (none, root clipping, one module clipped), fused or materialised,
and a run of steps: Poisson batch sizes including 0 and 1, sequence lengths on both sides of the
16 positions from which weights run detached, eval forwards under ``no_grad`` between steps, a
``state_dict`` round trip of model and optimizer mid-run (through ``torch.save``), and ``zero_grad``
with and without ``set_to_none``. Parameters are compared after every step, so the step where a
loop goes wrong is the one reported.
"""

from __future__ import annotations

import copy
import io
import os
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample

LOOP_EXAMPLES = {"ci": 16, "dev": 6, "long": 200}[os.environ.get("HYPOTHESIS_PROFILE", "dev")]
CLIP = 0.3


class TokenModel(nn.Module):
    def __init__(self, vocab: int = 7, dim: int = 5) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(24, dim)
        self.mlp, self.norm = nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.norm(torch.tanh(self.mlp(h))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))


@dataclass(frozen=True)
class Step:
    batch: int
    length: int
    eval_after: bool
    set_to_none: bool
    round_trip_after: bool


def make_batch(family: str, step: Step, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if family == "mlp":
        x = torch.randn(step.batch, 4, generator=gen, dtype=torch.float64)
        return x, torch.randn(step.batch, 3, generator=gen, dtype=torch.float64)
    x = torch.randint(0, 7, (step.batch, step.length), generator=gen)
    return x, torch.randn(step.batch, step.length, 7, generator=gen, dtype=torch.float64)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, target: str | None) -> dict[str, torch.Tensor]:
    """``(1/B) sum_i T(g_i)`` with ``T`` clipping the parameters under ``target`` (0 for B = 0)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if x.shape[0] == 0:
        return {n: torch.zeros_like(p) for n, p in params.items()}
    ref = reference_grad_sample(model, x, y, loss=loss_fn)
    if target is not None:
        covered = [n for n in ref if target == "" or n.startswith(target + ".")]
        norms = torch.stack([ref[n].flatten(1).square().sum(1) for n in covered]).sum(0).sqrt()
        factor = (CLIP / norms).clamp(max=1)
        for n in covered:
            ref[n] = ref[n] * factor.view(-1, *[1] * (ref[n].dim() - 1))
    return {n: g.mean(0) for n, g in ref.items()}


def round_trip(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])


@st.composite
def loops(draw: st.DrawFn) -> tuple[str, str | None, bool, list[Step]]:
    family = draw(st.sampled_from(["mlp", "tokens"]))
    target = draw(st.sampled_from([None, "", "mlp" if family == "tokens" else "2"]))
    keep = draw(st.booleans())
    steps = []
    for _ in range(draw(st.integers(6, 10))):
        batch = draw(st.sampled_from([0, 1, 2, 3, 4, 5]))  # a Poisson sample of expected size 3
        length = draw(st.sampled_from([1, 2, 15, 16, 17, 20]))
        steps.append(Step(batch, length, draw(st.booleans()), draw(st.booleans()), draw(st.booleans())))
    return family, target, keep, steps


@settings(max_examples=LOOP_EXAMPLES)
@given(loop=loops(), seed=st.integers(0, 2**16))
def test_random_training_loops_end_where_the_reference_loop_ends(
    loop: tuple[str, str | None, bool, list[Step]], seed: int
) -> None:
    family, target, keep, steps = loop
    torch.manual_seed(seed)
    model = (mlp() if family == "mlp" else TokenModel()).double()
    ref_model = copy.deepcopy(model)
    if family == "tokens":  # deepcopy keeps the tie; check it
        assert ref_model.head.weight is ref_model.wte.weight
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        if target is not None:
            psm.register_transform(target or model, transforms.clip_norm(CLIP))
        for k, step in enumerate(steps):
            x, y = make_batch(family, step, gen)
            want = reference_grads(ref_model, x, y, target)
            for n, p in ref_model.named_parameters():
                p.grad = want[n].clone()
            ref_opt.step()
            ref_opt.zero_grad()

            opt.zero_grad(set_to_none=step.set_to_none)
            (loss_fn(psm(x), y) / max(step.batch, 1)).backward()
            opt.step()
            for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
                assert_close(p.detach(), q.detach(), f"step {k} ({step}) of {family}, target {target!r}: {n}")
            if step.eval_after:
                model.eval()
                with torch.no_grad():
                    psm(make_batch(family, Step(2, step.length + 1, False, False, False), gen)[0])
                model.train()
            if step.round_trip_after:
                round_trip(model, opt)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
