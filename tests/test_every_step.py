"""Exact on every step, whatever reaches a parameter (issue 11).

The first backward is checked against autograd and runs every shortcut off; these tests run
several steps with batch sizes and sequence lengths that change on both sides of the 16-position
threshold from which layers run with their weights detached, and compare every step's numbers
with torch.func.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, TargetError, transforms
from tests.reference import assert_close, reference_grad_sample
from tests.test_fused import check_statistics

STEPS = [(3, 8), (4, 16), (2, 40), (5, 17), (3, 1), (4, 24)]  # (batch, positions): both sides of 16


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each sample's own loss: the sum over its tokens."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")


def expected_grads(ref: dict[str, torch.Tensor], clip: float | None) -> dict[str, torch.Tensor]:
    if clip is None:
        return {k: g.mean(0) for k, g in ref.items()}
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (clip / norms).clamp(max=1)
    return {k: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for k, g in ref.items()}


def run_steps(
    model: nn.Module,
    batch: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    keep: bool,
    clip: float | None = None,
    stats: bool = False,
) -> None:
    """Several steps through the wrapper, each checked against torch.func: ``.grad``, ``grad_sample``,
    the norms and (``stats``) the statistics."""
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True, track_statistics=stats) as psm:
        if clip is not None:
            psm.register_transform(model, transforms.clip_norm(clip))
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            ref = reference_grad_sample(model, x, y, loss=loss)
            expected = expected_grads(ref, clip)
            psm.zero_grad()
            (loss(psm(x), y) / b).backward()
            norms = psm.per_sample_norms()
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}, T={t}): {name}"
                assert_close(p.grad, expected[name], f".grad of {what}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"grad_sample of {what}")
            if stats:
                check_statistics(psm.statistics(), ref)


class TiedLM(nn.Module):
    """GPT-2's shape in small: token embedding, a block, and an LM head tied to the embedding."""

    def __init__(self, vocab: int = 11, dim: int = 6, head_bias: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(idx))))


def tokens(vocab: int) -> Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    def batch(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, vocab, (b, t), generator=gen)
        return x, torch.randint(0, vocab, (b, t), generator=gen)

    return batch


@pytest.mark.parametrize("head_bias", [False, True])
@pytest.mark.parametrize(
    ("keep", "clip", "stats"),
    [(True, None, False), (True, 0.5, False), (False, 0.5, False), (True, None, True), (False, None, True)],
)
def test_tied_lm_head_on_every_step(head_bias: bool, keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(0)
    model = TiedLM(head_bias=head_bias).double()
    run_steps(model, tokens(11), token_loss, keep=keep, clip=clip, stats=stats)


class TwoLengths(nn.Module):
    """One Linear applied to every position of a sequence and to the sequence's mean."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4, bias=bias)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_position = torch.tanh(self.shared(x))  # [B, T, 4]: T positions per sample
        pooled = self.shared(x.mean(1))  # [B, 4]: one position per sample
        return self.head(per_position.mean(1) + pooled)


def floats(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, t, 4, generator=gen, dtype=torch.float64), torch.randn(b, 3, generator=gen).double()


def squared(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("keep", "clip", "stats"), [(True, None, False), (False, 0.5, False), (False, None, True)])
def test_a_layer_called_at_two_lengths_on_every_step(bias: bool, keep: bool, clip: float | None, stats: bool) -> None:
    torch.manual_seed(1)
    model = TwoLengths(bias).double()
    run_steps(model, floats, squared, keep=keep, clip=clip, stats=stats)


class Tokens(nn.Module):
    """A Linear on every position (detached from the second step on when T >= 16) and a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.conv = nn.Conv1d(5, 3, 3, padding=1)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).transpose(1, 2).contiguous()  # [B, 5, T] (vmap needs it contiguous)
        return self.head(torch.tanh(self.conv(h)).mean(2))


@pytest.mark.parametrize("keep", [True, False])
def test_tensor_hooks_on_parameters_fire_on_every_step(keep: bool) -> None:
    """Gradient logging (``p.register_hook``) sees autograd's gradient of every step."""
    torch.manual_seed(2)
    model = Tokens().double()
    seen: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: seen[name].append(g.clone()))
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        for step, (b, t) in enumerate(STEPS):
            x, y = floats(b, t, gen)
            ref = reference_grad_sample(model, x, y, loss=squared)
            psm.zero_grad()
            (squared(psm(x), y) / b).backward()
            for name, p in model.named_parameters():
                assert len(seen[name]) == step + 1, f"step {step}: the hook on {name} did not fire"
                assert_close(seen[name][-1], ref[name].mean(0), f"step {step}: hooked gradient of {name}")
                assert_close(p.grad, ref[name].mean(0), f"step {step}: .grad of {name}")


def train(
    model: nn.Module, *, wrap: bool, clip: float | None, in_backward: bool, detach: bool = True, keep: bool = True
) -> dict[str, torch.Tensor]:
    """SGD over STEPS, stepping either after backward or from post-accumulate-grad hooks (the
    optimizer-in-backward pattern); the parameters at the end."""
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    if in_backward:
        for p in model.parameters():

            def step(p: torch.Tensor) -> None:
                optimizers[p].step()
                optimizers[p].zero_grad()

            p.register_post_accumulate_grad_hook(step)
    gen = torch.Generator().manual_seed(0)
    psm = PerSampleModule(model, keep_grad_sample=keep, detach_transformed=detach) if wrap else None
    if psm is not None and clip is not None:
        psm.register_transform(model, transforms.clip_norm(clip))
    for b, t in STEPS:
        x, y = floats(b, t, gen)
        (squared(model(x), y) / b).backward()
        if not in_backward:
            for opt in optimizers.values():
                opt.step()
                opt.zero_grad()
    if psm is not None:
        psm.remove()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("clip", "detach", "keep"), [(None, True, True), (0.3, True, False), (0.3, False, True)])
def test_an_optimizer_stepped_from_post_accumulate_grad_hooks(clip: float | None, detach: bool, keep: bool) -> None:
    """The hooks run once ``.grad`` is final: the run equals stepping after each backward."""
    torch.manual_seed(3)
    start = Tokens().double().state_dict()

    def fresh() -> nn.Module:
        model = Tokens().double()
        model.load_state_dict(start)
        return model

    expected = train(fresh(), wrap=True, clip=clip, in_backward=False, detach=detach, keep=keep)
    if clip is None:  # without a transform, also what plain autograd gives
        plain = train(fresh(), wrap=False, clip=None, in_backward=False)
        for name, value in plain.items():
            assert_close(expected[name], value, f"pergrad vs plain autograd: {name}")
    actual = train(fresh(), wrap=True, clip=clip, in_backward=True, detach=detach, keep=keep)
    for name, value in expected.items():
        assert_close(actual[name], value, f"stepped in backward: {name}")


def clipped_step(psm: PerSampleModule, model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float) -> None:
    """One step through the wrapper, checked against torch.func on the model as it is now."""
    ref = reference_grad_sample(model, x, y, loss=squared)
    expected = expected_grads(ref, clip)
    psm.zero_grad()
    (squared(psm(x), y) / x.shape[0]).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None and not hasattr(p, "grad_sample"), name
            continue
        assert_close(p.grad_sample, ref[name], f"grad_sample of {name}")
        assert_close(p.grad, expected[name], f".grad of {name}")


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_parameters_replaced_after_wrapping_are_followed() -> None:
    """``load_state_dict(assign=True)``, a module swapped in, ``requires_grad`` switched: the wrapper
    follows the model as it is at each forward, transforms (registered by object or name) included."""
    torch.manual_seed(4)
    model = mlp()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.clip_norm(0.01))
        for b in (4, 5):
            x, y = torch.randn(b, 4, generator=gen).double(), torch.randn(b, 3, generator=gen).double()
            clipped_step(psm, model, x, y, clip=0.01)
        old = list(model.parameters())
        model.load_state_dict(mlp().state_dict(), assign=True)  # new Parameter objects
        assert all(p is not q for p, q in zip(model.parameters(), old, strict=True))
        x, y = torch.randn(4, 4, generator=gen).double(), torch.randn(4, 3, generator=gen).double()
        for _ in range(3):
            clipped_step(psm, model, x, y, clip=0.01)
        assert not any(hasattr(p, "grad_sample") for p in old)
        model[2] = nn.Linear(6, 3).double()  # a module swapped in
        clipped_step(psm, model, x, y, clip=0.01)
        model[0].requires_grad_(False)  # frozen after wrapping: out of the clipped norm
        clipped_step(psm, model, x, y, clip=0.01)
        clipped_step(psm, model, x, y, clip=0.01)
        model[0].requires_grad_(True)  # and trainable again
        clipped_step(psm, model, x, y, clip=0.01)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_a_parameter_target_follows_its_name_and_a_replaced_module_target_is_refused() -> None:
    torch.manual_seed(5)
    model = mlp()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        psm.register_transform(model[2].weight, lambda g: 2 * g)
        model.load_state_dict(mlp().state_dict(), assign=True)
        ref = reference_grad_sample(model, x, y, loss=squared)
        (squared(psm(x), y) / 4).backward()
        assert_close(model[2].weight.grad, 2 * ref["2.weight"].mean(0), "doubled after reloading")
        assert_close(model[2].bias.grad, ref["2.bias"].mean(0), "not covered")
    model = mlp()
    with PerSampleModule(model) as psm:
        psm.register_transform(model[2], transforms.clip_norm(1.0))
        model[2] = nn.Linear(6, 3).double()
        with pytest.raises(TargetError, match=r"Linear is not part of the wrapped model.*register the transform"):
            psm(x)


class RootToken(nn.Module):
    """A raw parameter on the root (ViT's cls_token) next to hooked children."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        return self.head(self.norm(torch.tanh(self.lin(h)))[:, 0])


@pytest.mark.parametrize("verify", [True, False])
def test_fallback_with_parameters_on_the_root_counts_each_sample_once(verify: bool) -> None:
    torch.manual_seed(6)
    model = RootToken().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, fallback=True, verify=verify) as psm:
        for b, t in STEPS[:3]:
            x, y = floats(b, t, gen)
            ref = reference_grad_sample(model, x, y, loss=squared)
            psm.zero_grad()
            (squared(psm(x), y) / b).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"grad_sample of {name}")
                assert_close(p.grad, ref[name].mean(0), f".grad of {name}")
