"""``pergrad.privacy.audit``: silent on correct models over several steps, and each check raising on a fault
injected where it looks (a wrong rule, a forward hook mixing samples, a dropped regulariser, a fused
reduction writing a wrong ``.grad``, DP-SGD noise missing, repeated or of another size, a clipping
bound exceeded)."""

from __future__ import annotations

import copy
import gc
import io
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pergrad
from pergrad import PerSampleModule, transforms
from pergrad._core.backward.sources import Fused, Materialized
from pergrad.errors import BatchMixingError
from pergrad.privacy.audit import Audit, AuditError, chi2_quantiles, select_sample
from tests.test_architecture import GRAPH

Batch = tuple[Tensor, Tensor]
ROOT = Path(__file__).resolve().parents[1]


def loss_mean(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def loss_sum(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


class Pooled(nn.Module):
    """A transformer block on ``[B, T, 8]``, mean-pooled over positions, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x).mean(1))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def conv() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    )


def inputs(kind: str, size: int, length: int = 5, dtype: torch.dtype = torch.float64) -> Batch:
    shape = {"mlp": (size, 6), "conv": (size, 2, 5, 5), "block": (size, length, 8)}[kind]
    return torch.randn(*shape, dtype=dtype), torch.randint(0, 3, (size,))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "conv": conv, "block": Pooled}


def train(
    psm: PerSampleModule,
    audit: Audit,
    batches: Iterator[list[Batch]],
    loss_fn: Callable[[nn.Module, Batch], Tensor] = loss_mean,
    steps: int = 4,
    scale: float = 1.0,
) -> None:
    """``steps`` optimizer steps, one backward per batch of each step (its loss times ``scale``)."""
    optimizer = torch.optim.SGD(psm.module.parameters(), lr=0.1)
    for _ in range(steps):
        step = next(batches)
        for batch in step:
            (loss_fn(psm, batch) * scale).backward()
        audit.check(*step)
        optimizer.step()
        optimizer.zero_grad()


def one_per_step(kind: str, sizes: tuple[int, ...] = (5, 7, 6, 5), length: int = 5) -> Iterator[list[Batch]]:
    for size in sizes * 4:
        yield [inputs(kind, size, length)]


# -- silent where pergrad is right -----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize(("kind", "length"), [("mlp", 5), ("conv", 5), ("block", 15), ("block", 16), ("block", 17)])
def test_silent_on_correct_models_every_step(kind: str, length: int, keep: bool) -> None:
    torch.manual_seed(0)
    model = MODELS[kind]().double()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    target = model.block if kind == "block" else model
    psm.register_transform(target, transforms.clip_norm(0.5))  # weights run detached from the second step
    with psm, Audit(psm, loss_mean, every=1, samples=3) as audit:
        train(psm, audit, one_per_step(kind, length=length))
        assert audit.audited == 4
        head = model.head if kind == "block" else model[-1]
        assert hasattr(head.weight, "grad_sample") == keep  # held for the audit, not stored on the parameters


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_reductions(loss_reduction: str, reduction: str) -> None:
    torch.manual_seed(1)
    model = mlp().double()
    psm = PerSampleModule(model, loss_reduction=loss_reduction, reduction=reduction, keep_grad_sample=False)
    psm.register_transform(model[2], transforms.clip_norm(0.3))  # model[0] untransformed: autograd's .grad
    loss_fn = loss_mean if loss_reduction == "mean" else loss_sum
    with psm, Audit(psm, loss_fn, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), loss_fn)
        assert audit.audited == 4


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize(("reduction", "accumulate"), [("mean", "backward"), ("sum", "backward"), ("mean", "samples")])
def test_micro_batches(reduction: str, accumulate: str, keep: bool) -> None:
    """Three backward passes per optimizer step, of different sizes, each loss divided by 3 (``loss_scale``);
    with ``accumulate="samples"`` the loss is not divided (``.grad`` is the mean over every sample)."""
    torch.manual_seed(2)
    model = Pooled().double()
    scale = 1.0 if accumulate == "samples" else 1 / 3
    psm = PerSampleModule(model, reduction=reduction, accumulate=accumulate, keep_grad_sample=keep, loss_scale=scale)
    psm.register_transform(model.block, transforms.clip_norm(0.5))

    def steps() -> Iterator[list[Batch]]:
        while True:
            yield [inputs("block", size, length) for size, length in ((3, 16), (5, 17), (4, 15))]

    with psm, Audit(psm, loss_mean, every=2, samples=5) as audit:
        train(psm, audit, steps(), steps=5, scale=scale)
        assert audit.audited == 3  # steps 0, 2, 4


def test_float32_and_a_user_transform() -> None:
    """Default tolerances in float32 (no false alarm over several steps) and a transform that is no ``Scaling``."""
    torch.manual_seed(3)
    model = Pooled()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model.head, lambda g: {k: v.clamp(-0.1, 0.1) for k, v in g.items()})
    batches = ([(torch.randn(6, 16, 8), torch.randint(0, 3, (6,)))] for _ in range(8))
    with psm, Audit(psm, loss_mean, every=1) as audit:
        train(psm, audit, batches, steps=8)
        assert audit.audited == 8


def test_bfloat16_autocast() -> None:
    """The recomputation runs under the autocast of the step's forward, to bfloat16's tolerance."""
    torch.manual_seed(4)
    model = mlp()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(1.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with psm, Audit(psm, loss_mean, every=1) as audit:
        for _ in range(3):
            batch = inputs("mlp", 8, dtype=torch.float32)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_mean(psm, batch)
            loss.backward()
            audit.check(batch)
            optimizer.step()
            optimizer.zero_grad()
        assert audit.audited == 3


def test_the_training_run_is_the_same_with_and_without_the_audit() -> None:
    """The audit changes nothing: the same parameters after the same steps, the global generator untouched."""
    torch.manual_seed(5)
    models = [mlp().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    batches = [inputs("mlp", 6) for _ in range(4)]
    for model, audited in zip(models, (True, False), strict=True):
        psm = PerSampleModule(model, keep_grad_sample=False)
        psm.register_transform(model, transforms.clip_norm(0.2))
        audit = Audit(psm, loss_mean, every=1) if audited else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for batch in batches:
            loss_mean(psm, batch).backward()
            if audit is not None:
                state = torch.get_rng_state()
                audit.check(batch)
                assert torch.equal(state, torch.get_rng_state())
                assert audit._holder.held == []  # nothing held after a check
            optimizer.step()
            optimizer.zero_grad()
        psm.remove()
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(p, q)


def test_only_due_steps_are_audited() -> None:
    torch.manual_seed(6)
    model = mlp().double()
    psm = PerSampleModule(model)
    seen = []
    with psm, Audit(psm, loss_mean, every=3) as audit:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(7):
            seen.append(audit.due)
            batch = inputs("mlp", 4)
            loss_mean(psm, batch).backward()
            audit.check(batch)
            optimizer.step()
            optimizer.zero_grad()
        assert seen == [True, False, False, True, False, False, True]
        assert audit.audited == 3 and audit.steps == 7


def test_select_sample() -> None:
    x, mask, shared = torch.randn(4, 3), torch.ones(4, 3), torch.arange(3)
    one = select_sample({"x": x, "parts": (mask, shared), "name": "a"}, 2)
    assert torch.equal(one["x"], x[2:3]) and torch.equal(one["parts"][0], mask[2:3])
    assert one["parts"][1] is shared and one["name"] == "a"


# -- each check raises on its fault ----------------------------------------------------------------------------------


def permuting_registry() -> pergrad.RuleRegistry:
    """Linear's rule with the samples' gradients rotated by one: their sum is right (pergrad's own first-backward
    check passes), each sample's is another's."""
    registry = pergrad.default_registry.copy()

    @registry.register(nn.Linear, overwrite=True)
    def rotated(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
        return {k: v.roll(1, 0) for k, v in pergrad.rules.linear(layer, a, d).items()}

    return registry


@pytest.mark.parametrize("keep", [True, False])
def test_a_wrong_rule_is_caught_and_the_fix_it_names_works(keep: bool) -> None:
    torch.manual_seed(7)
    model = mlp().double()
    psm = PerSampleModule(model, rules=permuting_registry(), keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(10.0))  # clips nothing: .grad is right, g_i are not
    audit = Audit(psm, loss_mean, every=1)
    batch = inputs("mlp", 5)
    loss_mean(psm, batch).backward()  # pergrad's own check (verify) passes: the sums are right
    message = r"step 0: the per-sample gradient of parameter '[02]\.(weight|bias)' \(of '[02]', Linear\) for sample"
    with pytest.raises(AuditError, match=message) as raised:
        audit.check(batch)
    assert "'torch.nn.modules.linear.Linear', overwrite=True, all_inputs=True, subtree=True" in str(raised.value)
    psm.remove()
    audit.close()
    model.zero_grad()
    fix = pergrad.default_registry.copy()  # the fix the message names
    fix.register("torch.nn.modules.linear.Linear", overwrite=True, all_inputs=True, subtree=True)(
        pergrad.rules.fallback
    )
    psm = PerSampleModule(model, rules=fix, keep_grad_sample=keep)
    with psm, Audit(psm, loss_mean, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), steps=2)
        assert audit.audited == 2


def test_a_rule_wrong_after_the_first_step_is_caught_at_the_next_due_step() -> None:
    torch.manual_seed(8)
    calls = []
    registry = pergrad.default_registry.copy()

    @registry.register(nn.Conv2d, overwrite=True)
    def late(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
        calls.append(1)
        out = pergrad.rules.conv(layer, a, d)
        return out if len(calls) == 1 else {k: v * 1.001 for k, v in out.items()}

    model = conv().double()
    psm = PerSampleModule(model, rules=registry)
    with psm, Audit(psm, loss_mean, every=2) as audit:
        train(psm, audit, one_per_step("conv"), steps=2)  # step 0 audited, step 1 not
        with pytest.raises(AuditError, match=r"step 2: the per-sample gradients of parameter '0\.(weight|bias)'"):
            train(psm, audit, one_per_step("conv"), steps=1)


def test_a_forward_hook_mixing_samples_is_caught() -> None:
    """A hook adding the batch's mean to a layer's output, registered after the first step and computed where
    pergrad does not follow the forward (rebuilt from a Python list: pergrad's forward refuses a mean it sees, and its own check looks
    at the first backward only): the audit catches the coupling."""
    torch.manual_seed(9)
    model = mlp().double()
    psm = PerSampleModule(model)

    def couple(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        return out + 0.5 * torch.tensor(out.detach().mean(0, keepdim=True).tolist(), dtype=out.dtype)

    with psm, Audit(psm, loss_mean, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), steps=1)
        model[0].register_forward_hook(couple)
        with pytest.raises(AuditError, match=r"step 1: the per-sample gradients? of parameter .* couples the samples"):
            train(psm, audit, one_per_step("mlp"), steps=1)


def test_a_forward_hook_mixing_samples_is_refused_by_a_followed_forward() -> None:
    """The same hook with forwards followed (the default): the next forward is refused at the layer after it, before
    any gradient is written."""
    torch.manual_seed(9)
    model = mlp().double()
    psm = PerSampleModule(model)
    with psm, Audit(psm, loss_mean, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), steps=1)
        model[0].register_forward_hook(lambda module, args, out: out + 0.5 * out.mean(0, keepdim=True))
        with pytest.raises(BatchMixingError, match=r"layer '2' \(Linear\) .* after the op mean reordered or mixed"):
            train(psm, audit, one_per_step("mlp"), steps=1)


def test_a_dropped_regulariser_is_caught() -> None:
    """A regulariser added to the loss after the first step (pergrad checks the first backward only): pergrad's
    per-sample gradients leave it out, autograd's batch gradient has it."""
    torch.manual_seed(10)
    model = mlp().double()
    psm = PerSampleModule(model)
    regularise = [False]

    def loss_fn(m: nn.Module, batch: Batch) -> Tensor:
        penalty = sum(p.square().sum() for p in m.parameters()) if regularise[0] else 0.0
        return loss_mean(m, batch) + 0.01 * penalty

    with psm, Audit(psm, loss_fn, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), loss_fn, steps=1)
        regularise[0] = True
        with pytest.raises(AuditError, match=r"do not add up to autograd.s gradient .*\(a regulariser"):
            train(psm, audit, one_per_step("mlp"), loss_fn, steps=1)


def test_a_loss_fn_of_another_reduction_is_caught() -> None:
    torch.manual_seed(11)
    model = mlp().double()
    psm = PerSampleModule(model)
    audit = Audit(psm, loss_sum, every=1)
    with psm, audit, pytest.raises(AuditError, match=r"a mean where the wrapper says 'sum', or the reverse"):
        train(psm, audit, one_per_step("mlp"), loss_mean, steps=1)


@pytest.mark.parametrize(("keep", "source"), [(True, Materialized), (False, Fused)])
def test_a_wrong_reduction_into_grad_is_caught(monkeypatch: pytest.MonkeyPatch, keep: bool, source: type) -> None:
    """The reduction of the clipped gradients off by 0.1% (a fused path's bug): the per-sample gradients are right,
    ``.grad`` is not."""
    torch.manual_seed(12)
    summed = source.summed

    def off(self: Any, params: Any, weights: Tensor, drop: Tensor | None = None) -> dict[nn.Parameter, Tensor]:
        return {p: g * 1.001 for p, g in summed(self, params, weights, drop).items()}

    model = mlp().double()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(0.1))
    with psm, Audit(psm, loss_mean, every=1) as audit:
        train(psm, audit, one_per_step("mlp"), steps=2)
        monkeypatch.setattr(source, "summed", off)
        with pytest.raises(AuditError, match=r"step 2: over the step, \.grad of parameter '[02]\.(weight|bias)'"):
            train(psm, audit, one_per_step("mlp"), steps=1)


def test_grad_written_between_backward_and_check_is_caught() -> None:
    torch.manual_seed(13)
    model = mlp().double()
    with PerSampleModule(model) as psm, Audit(psm, loss_mean, every=1) as audit:
        batch = inputs("mlp", 5)
        loss_mean(psm, batch).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        with pytest.raises(AuditError, match=r"something else wrote \.grad during the step"):
            audit.check(batch)


def test_a_random_transform_is_caught() -> None:
    torch.manual_seed(14)
    model = mlp().double()
    psm = PerSampleModule(model)
    psm.register_transform(model[2], lambda g: {k: v + 0.01 * torch.randn_like(v) for k, v in g.items()}, batched=True)
    audit = Audit(psm, loss_mean, every=1)
    with psm, audit, pytest.raises(AuditError, match=r"a transform that is not a fixed function"):
        train(psm, audit, one_per_step("mlp"), steps=1)


# -- what it refuses -------------------------------------------------------------------------------------------------


def test_refusals() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Linear(8, 3)).double()
    with PerSampleModule(model) as psm, Audit(psm, loss_mean) as audit:
        batch = inputs("mlp", 4)
        loss_mean(psm, batch).backward()
        with pytest.raises(AuditError, match=r"random \(1 \(Dropout\) in training mode\)"):
            audit.check(batch)
    with PerSampleModule(mlp(), grad_scaler=2.0) as psm, pytest.raises(AuditError, match="grad_scaler"):
        Audit(psm, loss_mean)
    with PerSampleModule(mlp(), batch_first=False) as psm, pytest.raises(AuditError, match="tell the audit"):
        Audit(psm, loss_mean)
    with pytest.raises(AuditError, match="needs the PerSampleModule"):
        Audit(mlp(), loss_mean)  # type: ignore[arg-type]


def test_wrong_batches_are_refused() -> None:
    model = mlp().double()
    with PerSampleModule(model) as psm:
        audit = Audit(psm, loss_mean, every=1)
        first, second = inputs("mlp", 4), inputs("mlp", 5)
        loss_mean(psm, first).backward()
        loss_mean(psm, second).backward()
        with pytest.raises(AuditError, match=r"ran 2 backward pass\(es\) but check got 1 batch"):
            audit.check(first)
        loss_mean(psm, first).backward()
        with pytest.raises(AuditError, match="got a batch of 5 samples for backward pass 1, which saw 4"):
            audit.check(second)
        with pytest.raises(AuditError, match="no backward pass ran since the last check"):
            audit.check(first)
        loss_mean(psm, first).backward()
        with pytest.raises(AuditError, match="must return the loss as a one-element tensor"):
            audit.loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")
            audit.check(first)
        audit.close()


def test_accumulate_samples_needs_grad_cleared() -> None:
    model = mlp().double()
    with PerSampleModule(model, accumulate="samples") as psm, Audit(psm, loss_mean, every=1) as audit:
        batch = inputs("mlp", 4)
        loss_mean(psm, batch).backward()
        audit.check(batch)  # .grad None at the first forward
        loss_mean(psm, batch).backward()  # not cleared
        with pytest.raises(AuditError, match=r"accumulate='samples' the audit needs \.grad cleared"):
            audit.check(batch)


def test_the_core_does_not_import_the_audit() -> None:
    features = ("pergrad.privacy",)  # DP-SGD's privacy audit builds on it
    users = [name for name, deps in GRAPH.items() if "pergrad.privacy.audit" in deps and name != "pergrad"]
    assert [name for name in users if not name.startswith(features)] == []
    assert "pergrad.module" in GRAPH["pergrad.privacy.audit"]


# -- DP-SGD ----------------------------------------------------------------------------------------------------------

C, SIGMA, EXPECTED = 1.0, 0.8, 8.0


def private_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 10))  # 2074 coordinates of noise


def private_batch(size: int) -> Batch:
    return torch.randn(size, 32, dtype=torch.float64), torch.randint(0, 10, (size,))


def dp_steps(
    model: nn.Module,
    audit: Audit,
    psm: PerSampleModule,
    steps: int,
    noise: Callable[[Tensor, torch.Generator], Tensor] | None = None,
    claimed_bound: float = C,
    micro: int = 1,
    sizes: tuple[int, ...] = (7, 9, 8, 6),
    generator: torch.Generator | None = None,
    params: list[nn.Parameter] | None = None,
) -> None:
    """Hand-written DP-SGD steps: ``.grad = (sum_i clip_C(g_i) + N(0, sigma^2 C^2)) / E[B]`` from the wrapper's
    ``clip_norm`` with ``reduction="sum"`` and the loss divided by ``E[B]`` (``loss_scale``), the noise added by
    hand after the step's backward passes."""
    std = SIGMA * C / EXPECTED
    noise = noise or (lambda p, gen: torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    generator = generator or torch.Generator().manual_seed(1)
    params = params or [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batches = [private_batch(sizes[(step + k) % len(sizes)]) for k in range(micro)]
        for batch in batches:
            (loss_sum(psm, batch) / EXPECTED).backward()
        before = [None if p.grad is None else p.grad.detach().clone() for p in params] if audit.due else None
        for p in params:
            added = noise(p, generator)
            p.grad = added if p.grad is None else p.grad + added
        audit.check_private(
            *batches,
            max_grad_norm=claimed_bound,
            noise_std=std,
            expected_batch_size=EXPECTED,
            params=params,
            grad_before_noise=before,
        )
        optimizer.step()
        optimizer.zero_grad()


def private(keep: bool = True, bound: float = C) -> tuple[nn.Module, PerSampleModule, Audit]:
    torch.manual_seed(20)
    model = private_model().double()
    psm = PerSampleModule(model, loss_reduction="sum", reduction="sum", loss_scale=1 / EXPECTED, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(bound))
    return model, psm, Audit(psm, loss_sum, every=1)


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("keep", [True, False])
def test_a_private_step_passes(keep: bool, micro: int) -> None:
    model, psm, audit = private(keep)
    with psm, audit:
        dp_steps(model, audit, psm, steps=4, micro=micro)
        assert audit.audited == 4


def test_an_empty_private_step_checks_the_noise() -> None:
    model, psm, audit = private()
    params = list(model.parameters())
    with psm, audit:
        empty = private_batch(0)
        before = [None for _ in params]
        for p in params:
            p.grad = torch.zeros_like(p)  # no noise added
        with pytest.raises(AuditError, match="the noise was not added"):
            audit.check_private(
                empty,
                max_grad_norm=C,
                noise_std=SIGMA * C / EXPECTED,
                expected_batch_size=EXPECTED,
                params=params,
                grad_before_noise=before,
            )


@pytest.mark.parametrize(
    ("factor", "message"),
    [
        (0.0, "the noise was not added"),
        (2**0.5, "the noise has another standard deviation"),  # added twice
        (EXPECTED / 12, "the noise has another standard deviation"),  # divided by a drawn batch size of 12
    ],
)
def test_wrong_noise_is_caught(factor: float, message: str) -> None:
    model, psm, audit = private()
    std = SIGMA * C / EXPECTED
    with psm, audit, pytest.raises(AuditError, match=message):
        dp_steps(model, audit, psm, 1, noise=lambda p, gen: torch.randn(p.shape, generator=gen) * std * factor)


def chi2_lower_tail(n: int, x: float) -> float:
    """``P(chi2_n < x)`` for ``x < n`` in float64 without gammainc: ``y^a e^-y / Gamma(a + 1) sum_k y^k / (a+1)_k``
    (``a = n/2``, ``y = x/2``), its log prefactor by Stirling's series about ``y = a(1 + d)`` (no cancellation)."""
    a, y = n / 2, x / 2
    d = y / a - 1
    log_prefactor = a * (math.log1p(d) - d) - 0.5 * math.log(2 * math.pi * a) - 1 / (12 * a) + 1 / (360 * a**3)
    total, term, k = 0.0, 1.0, 0
    while term > 1e-17 * total or k == 0:
        total, k = total + term, k + 1
        term *= y / (a + k)
    return math.exp(log_prefactor) * total


def test_the_noise_bounds_are_the_chi_square_quantiles() -> None:
    """``chi2_quantiles(n)``: ``P(chi2_n < q_lo) = P(chi2_n > q_hi) = 1e-9`` for every ``n``: torch's own gammainc at
    the bisected ones, a series in float64 at Wilson-Hilferty's (``n > 10^6``, where gammainc's lower tail drifts)."""
    for n in (1, 2, 5, 43, 100, 1000, 10**5, 10**6):
        q_lo, q_hi = chi2_quantiles(n)
        a = torch.tensor(n / 2, dtype=torch.float64)
        assert float(torch.special.gammainc(a, torch.tensor(q_lo / 2, dtype=torch.float64))) == pytest.approx(1e-9)
        assert float(torch.special.gammaincc(a, torch.tensor(q_hi / 2, dtype=torch.float64))) == pytest.approx(1e-9)
    for n in (1000, 10**6, 10**6 + 1, 10**7, 10**9):
        assert chi2_lower_tail(n, chi2_quantiles(n)[0]) == pytest.approx(1e-9, rel=1e-4)


def test_the_noise_bounds_match_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for n in (1, 2, 5, 43, 100, 1000, 10**5, 10**6, 10**6 + 1, 10**7):
        q_lo, q_hi = chi2_quantiles(n)
        assert q_lo == pytest.approx(stats.chi2.ppf(1e-9, n), rel=1e-6)
        assert q_hi == pytest.approx(stats.chi2.isf(1e-9, n), rel=1e-6)


def test_the_old_normal_margin_false_alarmed_on_small_models() -> None:
    """The rms check's bound was ``rms^2 <= noise_std^2 (1 + 6 sqrt(2/n))``, chi-square's 6 standard deviations as if
    normal: at 43 coordinates its tail is 2.9e-6, not 1e-9. The exact quantile is above it; on 4 million seeded
    draws of chi2_43 the old bound is crossed 11 times (11.7 expected), the new bounds never (0.008 expected)."""
    n = 43
    q_lo, q_hi = chi2_quantiles(n)
    old = n * (1 + 6 * math.sqrt(2 / n))
    assert q_hi > 1.25 * old
    a = torch.tensor(n / 2, dtype=torch.float64)
    assert float(torch.special.gammaincc(a, torch.tensor(old / 2, dtype=torch.float64))) == pytest.approx(
        2.927e-6, rel=1e-3
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        draws = torch.distributions.Chi2(torch.tensor(float(n), dtype=torch.float64)).sample((4_000_000,))
    assert int((draws > old).sum()) >= 5
    assert int(((draws < q_lo) | (draws > q_hi)).sum()) == 0


@pytest.mark.parametrize(
    ("squared", "passes"),
    [
        (1.192, True),  # rms^2 / noise_std^2 within chi2's 1e-9 quantiles / 2074 (1.1976), above the old 1.1863
        (1.21, False),
        (0.83, True),
        (0.82, False),  # below the lower quantile / 2074 (0.8248), above the old 0.8137
    ],
)
def test_the_noise_std_is_checked_at_the_chi_square_quantiles(squared: float, passes: bool) -> None:
    model, psm, audit = private()
    std = SIGMA * C / EXPECTED

    def exact(p: Tensor, gen: torch.Generator) -> Tensor:  # centred, rms exactly sqrt(squared) std
        z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        z = z - z.mean()
        return z * (std * math.sqrt(squared) / float(z.square().mean().sqrt()))

    with psm, audit:
        if passes:
            dp_steps(model, audit, psm, 1, noise=exact)
        else:
            with pytest.raises(AuditError, match=r"the noise has another standard deviation.*chi-square quantiles"):
                dp_steps(model, audit, psm, 1, noise=exact)


def test_repeated_noise_is_caught() -> None:
    model, psm, audit = private()
    std = SIGMA * C / EXPECTED

    def reseeded(p: Tensor, gen: torch.Generator) -> Tensor:
        if p is next(model.parameters()):
            gen.manual_seed(3)  # at every step: the same noise
        return torch.randn(p.shape, generator=gen, dtype=p.dtype) * std

    with psm, audit:
        dp_steps(model, audit, psm, 1, noise=reseeded)
        with pytest.raises(AuditError, match="this step's noise correlates with the last audited step's"):
            dp_steps(model, audit, psm, 1, noise=reseeded)


def test_an_exceeded_bound_is_caught() -> None:
    model, psm, audit = private(bound=2 * C)  # clips at 2C where the step says C
    with (
        psm,
        audit,
        pytest.raises(AuditError, match=r"contribution to the clipped sum has norm .* above max_grad_norm"),
    ):
        dp_steps(model, audit, psm, 1)


def test_a_wrong_clipping_is_caught() -> None:
    model, psm, audit = private(bound=C / 4)  # within C, but not clip_C
    with psm, audit, pytest.raises(AuditError, match=r"clipped contribution to parameter .* is not clip_C"):
        dp_steps(model, audit, psm, 1)


def test_an_unclipped_parameter_is_caught() -> None:
    torch.manual_seed(21)
    model = private_model().double()
    psm = PerSampleModule(model, loss_reduction="sum", reduction="sum", loss_scale=1 / EXPECTED)
    psm.register_transform(model[2], transforms.clip_norm(C))
    audit = Audit(psm, loss_sum, every=1)
    with psm, audit, pytest.raises(AuditError, match=r"\['0\.weight', '0\.bias'\] received gradients but are not"):
        dp_steps(model, audit, psm, 1, params=list(model[2].parameters()))


def test_dpsgd_runs_the_privacy_audit_at_its_noise() -> None:
    """``DPSGD.audit``: the wiring of ``check_private`` into the step's noise (its clipping, its noise)."""
    from pergrad.privacy import DPSGD, PoissonBatchSampler

    torch.manual_seed(22)
    model = private_model().double()
    psm = PerSampleModule(model, keep_grad_sample=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = PoissonBatchSampler(100, EXPECTED / 100, steps=5, generator=torch.Generator().manual_seed(1))
    # seeded noise: the audit's noise checks (false alarms of 2e-9 each, about 6e-9 per audited step) would
    # false-alarm on about 2e-8 of runs of the OS's noise
    generator = torch.Generator().manual_seed(5)
    dp = DPSGD(psm, optimizer, sampler, max_grad_norm=C, noise_multiplier=SIGMA, generator=generator)
    with psm:
        audit = dp.audit(loss_mean, every=2)
        for rows in sampler:
            batch = private_batch(len(rows))
            loss_mean(psm, batch).backward()
            audit.check(batch)
            optimizer.step()
            optimizer.zero_grad()
        assert audit.audited == 3
        dp.remove()


def test_the_copy_runs_no_pergrad_hook() -> None:
    """A deepcopy of a wrapped model holds no grad_sample and its backward reaches no holder."""
    model = mlp().double()
    with PerSampleModule(model) as psm:
        holder = psm.hold_per_sample()
        holder.armed = True
        batch = inputs("mlp", 3)
        loss_mean(psm, batch).backward()
        replica = copy.deepcopy(model)
        assert not hasattr(replica[0].weight, "grad_sample") and replica[0].weight.grad is None
        loss_mean(replica, batch).backward()
        assert len(holder.take()) == 1
        holder.close()


def test_a_model_with_an_audit_pickles_and_copies_without_it() -> None:
    model = mlp().double()
    with PerSampleModule(model) as psm, Audit(psm, loss_mean) as audit:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
            before = audit._before
            other(inputs("mlp", 3)[0])  # its hook does nothing: the audit saw no forward
            assert audit._before is before
        model(inputs("mlp", 3)[0])
        assert audit._before is not before


def test_a_holder_let_go_of_holds_nothing() -> None:
    model = mlp().double()
    with PerSampleModule(model) as psm:
        holder = psm.hold_per_sample()
        holder.armed = True
        del holder
        gc.collect()
        loss_mean(psm, inputs("mlp", 3)).backward()
        assert len(psm._engine.holding.holders) == 0


def test_the_cost_benchmark_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "audit.py"), "--quick"], capture_output=True, text=True, timeout=3600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "every=100:" in done.stdout


def test_a_due_step_leaves_no_memory_behind() -> None:
    """The per-sample gradients a due step builds (``keep_grad_sample=False``) are not the buffer pool's: after it,
    the pool holds what it holds in a run without an audit."""
    held = []
    for every in (3, None):
        torch.manual_seed(23)
        model = mlp().double()
        psm = PerSampleModule(model, keep_grad_sample=False)
        psm.register_transform(model, transforms.clip_norm(0.5))
        audit = Audit(psm, loss_mean, every=every) if every else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sizes = []
        for _ in range(6):
            batch = inputs("mlp", 16)
            loss_mean(psm, batch).backward()
            if audit is not None:
                audit.check(batch)
            optimizer.step()
            optimizer.zero_grad()
            sizes.append(psm._engine.pool.held_bytes)
        held.append(sizes)
        assert audit is None or audit.audited == 2
        psm.remove()
    assert held[0][3:] == held[1][3:]  # after the due step 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("keep", [True, False])
def test_on_cuda(keep: bool, dtype: torch.dtype) -> None:
    """A transformer block and a DP-SGD step on a GPU: silent over several steps, and a wrong rule caught."""
    torch.manual_seed(24)
    model = Pooled().to("cuda", dtype)
    psm = PerSampleModule(model, keep_grad_sample=keep, loss_scale=1 / 2)
    psm.register_transform(model.block, transforms.clip_norm(0.5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with psm, Audit(psm, loss_mean, every=2) as audit:
        for _ in range(5):
            micro = [
                (torch.randn(size, 16, 8, device="cuda", dtype=dtype), torch.randint(0, 3, (size,), device="cuda"))
                for size in (5, 7)
            ]
            for batch in micro:
                (loss_mean(psm, batch) / 2).backward()
            audit.check(*micro)
            optimizer.step()
            optimizer.zero_grad()
        assert audit.audited == 3
    model = private_model().to("cuda", dtype)
    psm = PerSampleModule(model, loss_reduction="sum", reduction="sum", loss_scale=1 / EXPECTED, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(C))
    std = SIGMA * C / EXPECTED
    generator = torch.Generator("cuda").manual_seed(0)
    with psm, Audit(psm, loss_sum, every=1) as audit:
        for step in range(3):
            batch = private_batch(7 + step)
            batch = (batch[0].to("cuda", dtype), batch[1].to("cuda"))
            (loss_sum(psm, batch) / EXPECTED).backward()
            params = list(model.parameters())
            before = [None if p.grad is None else p.grad.detach().clone() for p in params]
            for p in params:
                p.grad = p.grad + torch.randn(p.shape, generator=generator, device="cuda", dtype=dtype) * std
            audit.check_private(
                batch,
                max_grad_norm=C,
                noise_std=std,
                expected_batch_size=EXPECTED,
                params=params,
                grad_before_noise=before,
            )
            optimizer.zero_grad()
            model.zero_grad()
        assert audit.audited == 3
    model = mlp().to("cuda", dtype)
    psm = PerSampleModule(model, rules=permuting_registry(), keep_grad_sample=keep)
    with psm, Audit(psm, loss_mean, every=1) as audit:
        batch = (torch.randn(5, 6, device="cuda", dtype=dtype), torch.randint(0, 3, (5,), device="cuda"))
        loss_mean(psm, batch).backward()
        with pytest.raises(AuditError, match="the per-sample gradient of parameter"):
            audit.check(batch)


def test_check_private_without_grad_before_noise_on_a_due_step() -> None:
    model, psm, audit = private()
    params = list(model.parameters())
    with psm, audit:
        batch = private_batch(5)
        (loss_sum(psm, batch) / EXPECTED).backward()
        kwargs: dict[str, Any] = {"max_grad_norm": C, "noise_std": 0.0, "expected_batch_size": EXPECTED}
        with pytest.raises(AuditError, match=r"step 0: check_private needs grad_before_noise on a due step"):
            audit.check_private(batch, params=params, grad_before_noise=None, **kwargs)
        model.zero_grad()
        dp_steps(model, audit, psm, 2)  # the next steps are audited as usual
        assert audit.steps == 3 and audit.audited == 2
