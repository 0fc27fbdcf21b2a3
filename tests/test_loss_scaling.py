"""Loss scaling (``grad_scaler=``): transforms see the samples' own gradients, ``.grad`` stays in the
scaler's units, an overflow reaches ``.grad``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample

B = 6


def small_model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)  # the LayerNorm has no fused rule: its g_i are built even without grad_sample
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def batches(
    steps: int, dtype: torch.dtype = torch.float64, positions: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """With 16 positions per sample, pergrad writes the Linear weights' .grad itself from the
    second step on when grad_sample is built (or statistics tracked), transform or not."""
    torch.manual_seed(1)
    shape = (B,) if positions is None else (B, positions)
    return [(torch.randn(*shape, 4, dtype=dtype), torch.randn(*shape, 3, dtype=dtype)) for _ in range(steps)]


def sample_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.to(y.dtype) - y).pow(2).flatten(1).sum(1)


TARGETS: dict[str, Callable[[nn.Module], Any]] = {
    "root": lambda model: model,
    "module": lambda model: model[3],
    "parameter": lambda model: "0.weight",  # the others keep autograd's own gradient
}


def make_transform(kind: str) -> Any:
    if kind == "clip":
        return transforms.clip_norm(0.5)
    if kind == "normalize":
        return transforms.normalize()
    if kind == "scale":
        return transforms.scale(torch.linspace(0.0, 2.0, B, dtype=torch.float64))
    if kind == "user":  # not homogeneous: tanh(S g) / S is not tanh(g)
        return lambda g: {k: torch.tanh(3 * v) for k, v in g.items()} if isinstance(g, dict) else torch.tanh(3 * g)
    assert kind == "square"
    return transforms.square()


def run(
    psm: PerSampleModule,
    x: torch.Tensor,
    y: torch.Tensor,
    scaler: Any = None,
    autocast: torch.dtype | None = None,
    loss_reduction: str = "mean",
) -> None:
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = psm(x)
    losses = sample_losses(out, y)
    loss = losses.mean() if loss_reduction == "mean" else losses.sum()
    (loss if scaler is None else scaler.scale(loss)).backward()


def flat_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()


# -- (a) a scaled run equals the unscaled one ----------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("where", list(TARGETS))
@pytest.mark.parametrize("kind", ["clip", "normalize", "scale", "user"])
def test_scaled_steps_equal_unscaled_steps_in_float64(keep: bool, where: str, kind: str) -> None:
    """Several SGD steps with ``scaler.scale(loss).backward(); scaler.unscale_(opt)`` while the scale
    grows every step (growth_interval=1) and is once set lower by hand:
    .grad after unscale_, grad_sample and the norms equal the unscaled run's, and so do the weights."""
    plain, scaled = small_model(), small_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaled_opt = torch.optim.SGD(scaled.parameters(), lr=0.1)
    scales = []
    with (
        PerSampleModule(plain, keep_grad_sample=keep, track_norms=True) as ref,
        PerSampleModule(scaled, keep_grad_sample=keep, track_norms=True, grad_scaler=scaler) as psm,
    ):
        ref.register_transform(TARGETS[where](plain), make_transform(kind))
        psm.register_transform(TARGETS[where](scaled), make_transform(kind))
        for step, (x, y) in enumerate(batches(4, positions=16)):
            if step == 2:
                scaler.update(new_scale=2.0**5)
            plain_opt.zero_grad()
            scaled_opt.zero_grad()
            run(ref, x, y)
            run(psm, x, y, scaler)
            scales.append(scaler.get_scale())
            norms, expected_norms = psm.per_sample_norms(), ref.per_sample_norms()
            assert set(norms) == set(expected_norms) == {n for n, _ in plain.named_parameters()}
            for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
                assert_close(q.grad / scales[-1], p.grad, f"{name} step {step}")  # the scaler's units
                assert_close(norms[name], expected_norms[name], f"{name} norms step {step}")
                if keep:
                    assert_close(q.grad_sample, p.grad_sample, f"{name} grad_sample step {step}")
            assert psm.dropped_samples() == {}
            scaler.unscale_(scaled_opt)
            for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
                # unscale_ multiplies by 1/S rounded to float32: exact for the powers of 2
                assert_close(q.grad, p.grad, f"{name} unscaled, step {step}")
            plain_opt.step()
            scaler.step(scaled_opt)
            scaler.update()
    assert scales == [2.0**10, 2.0**11, 2.0**5, 2.0**6]
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        assert_close(q, p, name)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16])
def test_scaled_autocast_steps_match_float32(keep: bool, autocast: torch.dtype) -> None:
    """float32 model, float16/bfloat16 autocast on CPU, clipping at the root, a module and a parameter:
    within 3% (relative norm) of the float32 run without autocast or scaling, with a scale of 2**8
    and more (without the fix .grad is that many times too small; 2**16 overflows float16 here)."""
    plain, scaled = small_model(torch.float32), small_model(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    with (
        PerSampleModule(plain, keep_grad_sample=keep, track_norms=True) as ref,
        PerSampleModule(scaled, keep_grad_sample=keep, track_norms=True, grad_scaler=scaler) as psm,
    ):
        for wrapper, model in ((ref, plain), (psm, scaled)):
            wrapper.register_transform(model[0], transforms.clip_norm(0.5))
            wrapper.register_transform("3.weight", transforms.clip_norm(0.3))
        optimizer = torch.optim.SGD(scaled.parameters(), lr=0.0)  # the weights stay: compare every step alike
        for step, (x, y) in enumerate(batches(3, torch.float32)):
            plain.zero_grad()
            optimizer.zero_grad()
            run(ref, x, y)
            run(psm, x, y, scaler, autocast=autocast)
            assert scaler.get_scale() == 2.0 ** (8 + step)
            scaler.unscale_(optimizer)
            for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
                assert q.grad is not None and q.grad.dtype == torch.float32
                assert (q.grad - p.grad).norm() <= 3e-2 * p.grad.norm(), f"{name} step {step}"
                expected = ref.per_sample_norms()[name]
                assert (psm.per_sample_norms()[name] - expected).norm() <= 3e-2 * expected.norm(), name
                if keep:
                    assert (q.grad_sample - p.grad_sample).norm() <= 3e-2 * p.grad_sample.norm(), name
            scaler.step(optimizer)
            scaler.update()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["clip", "square"])
def test_micro_batches_and_reductions_under_a_scaler(
    keep: bool, loss_reduction: str, reduction: str, kind: str
) -> None:
    """accumulate="samples" over micro-batches of 2, 1 and 3 samples, every pair of reductions, a
    norm-based and a general transform: .grad / S is the unscaled run's."""
    plain, scaled = small_model(), small_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    optimizer = torch.optim.SGD(scaled.parameters(), lr=0.1)
    options = dict(keep_grad_sample=keep, loss_reduction=loss_reduction, reduction=reduction, accumulate="samples")
    with (
        PerSampleModule(plain, **options) as ref,  # type: ignore[arg-type]
        PerSampleModule(scaled, grad_scaler=scaler, **options) as psm,  # type: ignore[arg-type]
    ):
        ref.register_transform(plain, make_transform(kind))
        psm.register_transform(scaled, make_transform(kind))
        ((x, y),) = batches(1)
        for chunk in (slice(0, 2), slice(2, 3), slice(3, 6)):
            run(ref, x[chunk], y[chunk], loss_reduction=loss_reduction)
            run(psm, x[chunk], y[chunk], scaler, loss_reduction=loss_reduction)
        scaler.unscale_(optimizer)
        for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
            assert_close(q.grad, p.grad, name)


@pytest.mark.parametrize("keep", [True, False])
def test_statistics_and_activation_grads_are_unscaled(keep: bool) -> None:
    plain, scaled = small_model(), small_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    options = dict(keep_grad_sample=keep, track_statistics=True, keep_activation_grads=True)
    with (
        PerSampleModule(plain, **options) as ref,  # type: ignore[arg-type]
        PerSampleModule(scaled, grad_scaler=scaler, **options) as psm,  # type: ignore[arg-type]
    ):
        ref.register_transform(plain[0], transforms.clip_norm(0.5))
        psm.register_transform(scaled[0], transforms.clip_norm(0.5))
        for step, (x, y) in enumerate(batches(2, positions=16)):  # the second with detached weights
            plain.zero_grad()
            scaled.zero_grad()
            run(ref, x.requires_grad_(), y)
            run(psm, x.detach().requires_grad_(), y, scaler)
            expected, got = ref.statistics(), psm.statistics()
            for field in ("sq_norms", "grad_sq_norm", "trace_variance", "norm_test", "inner_product_test"):
                assert_close(getattr(got, field), getattr(expected, field), f"{field} step {step}")
            for name, stats in expected.params.items():
                assert_close(got.params[name].mean, stats.mean, name)
                assert_close(got.params[name].second_moment, stats.second_moment, name)
            activations = psm.activation_grads()
            assert set(activations) == set(ref.activation_grads()) and "input" in activations
            for name, d in ref.activation_grads().items():
                assert_close(activations[name], d, name)
            for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
                assert_close(q.grad / 2.0**14, p.grad, f"{name} step {step}")  # .grad in the scaler's units


# -- (b) an overflow reaches .grad: the scaler skips the step and lowers its scale -----------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("kind", ["clip", "user-clamp", "zero-weight"])
def test_an_overflow_in_one_sample_skips_the_step_and_lowers_the_scale(keep: bool, kind: str) -> None:
    """One sample's output is large enough that its scaled output gradient overflows float16: the
    norm-based transform must not leave it out (as it would without a scaler), a transform that
    clamps must not hide it, a weight of 0 must not cancel it."""
    model = small_model(torch.float32)
    ((x, y),) = batches(1, torch.float32)
    y[2] *= 1e4  # sample 2's output gradient, times 2**16, is past float16's 65504
    transform = {
        "clip": transforms.clip_norm(0.5),
        "user-clamp": lambda grads: {k: g.clamp(-1, 1) for k, g in grads.items()},
        "zero-weight": transforms.scale(torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])),
    }[kind]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=scaler) as psm:
        psm.register_transform(model, transform)
        run(psm, x, y, scaler, autocast=torch.float16)
        for name, p in model.named_parameters():  # the whole target: sample 2's g_i overflowed in each
            assert not torch.isfinite(p.grad).all(), name
        assert psm.dropped_samples() == {}
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2.0**15
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model.zero_grad()
    with PerSampleModule(model, keep_grad_sample=keep) as psm:  # the overflow is the scaler's: unscaled, all finite
        psm.register_transform(model, transform)
        run(psm, x, y, autocast=torch.float16)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("keep", [True, False])
def test_an_overflow_shows_in_the_norms_of_that_sample_only(keep: bool) -> None:
    model = small_model(torch.float32)
    ((x, y),) = batches(1, torch.float32)
    y[2] *= 1e4
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=scaler) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        run(psm, x, y, scaler, autocast=torch.float16)
        norms = psm.per_sample_norms()
        assert set(norms) == {n for n, _ in model.named_parameters()}
        for name, n in norms.items():
            assert torch.isfinite(n[[0, 1, 3, 4, 5]]).all(), name
        assert not torch.isfinite(torch.stack(list(norms.values()))[:, 2]).all()


# -- (c) without a scaler (or with one that does not scale), nothing changes ---------------------


def disabled_scaler() -> Any:
    return torch.amp.GradScaler("cpu", enabled=False)


def unused_scaler() -> Any:
    return torch.amp.GradScaler("cpu")  # no scale() yet: the backward is not scaled


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("make", [lambda: None, disabled_scaler, unused_scaler, lambda: lambda: None])
def test_without_loss_scaling_a_poisoned_sample_is_still_left_out(keep: bool, make: Callable[[], Any]) -> None:
    model = small_model()
    ((x, y),) = batches(1)
    clean = [i for i in range(B) if i != 2]
    ref = reference_grad_sample(model, x[clean], y[clean], lambda out, t: (out - t).pow(2).sum())
    factor = (0.5 / flat_norms(ref)).clamp(max=1)
    x[2, 1] = float("nan")
    grad_scaler = make()
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=grad_scaler) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        # the disabled scaler's scale() leaves the loss alone; the unused one is not called
        run(psm, x, y, grad_scaler if make is disabled_scaler else None)
        assert psm.dropped_samples()["the whole model"].tolist() == [2]
        for name, p in model.named_parameters():
            scaled = ref[name] * factor.view(-1, *([1] * (ref[name].dim() - 1)))
            assert_close(p.grad, scaled.sum(0) / B, name)


# -- other ways to give the loss scale -----------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("how", ["number", "tensor", "callable"])
def test_the_loss_scale_as_a_number_a_tensor_or_a_callable(keep: bool, how: str) -> None:
    plain, scaled = small_model(), small_model()
    scale = torch.tensor(8.0, dtype=torch.float64)
    grad_scaler = {"number": 8, "tensor": scale, "callable": lambda: scale}[how]
    with (
        PerSampleModule(plain, keep_grad_sample=keep) as ref,
        PerSampleModule(scaled, keep_grad_sample=keep, grad_scaler=grad_scaler) as psm,
    ):
        ref.register_transform(plain, transforms.clip_norm(0.5))
        psm.register_transform(scaled, transforms.clip_norm(0.5))
        for step, (x, y) in enumerate(batches(2)):
            plain.zero_grad()
            scaled.zero_grad()
            run(ref, x, y)
            (sample_losses(psm(x), y).mean() * float(scale)).backward()
            for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
                assert_close(q.grad / float(scale), p.grad, f"{name} step {step}")
            if how != "number":
                scale.fill_(24.0)  # read again at the next backward


@pytest.mark.parametrize(
    ("grad_scaler", "error", "match"),
    [
        ("1024", TypeError, r"grad_scaler must be a torch\.amp\.GradScaler.*got str"),
        (True, TypeError, r"grad_scaler must be a torch\.amp\.GradScaler.*got bool"),
        (0.0, ValueError, r"grad_scaler: the loss scale must be a finite number > 0, got 0\.0"),
        (float("inf"), ValueError, r"finite number > 0, got inf"),
        (torch.ones(2), TypeError, r"one-element floating-point tensor, got shape \(2,\)"),
        (torch.tensor(4), TypeError, r"one-element floating-point tensor, got shape \(\) and dtype torch\.int64"),
    ],
)
def test_an_unusable_grad_scaler_is_an_error_when_wrapping(grad_scaler: Any, error: type, match: str) -> None:
    model = small_model()
    with pytest.raises(error, match=match):
        PerSampleModule(model, grad_scaler=grad_scaler)
    PerSampleModule(model).remove()  # nothing was left installed


def test_a_callable_returning_something_else_is_an_error_at_the_backward() -> None:
    model = small_model()
    ((x, y),) = batches(1)
    with (
        PerSampleModule(model, grad_scaler=lambda: "8") as psm,
        pytest.raises(TypeError, match=r"the grad_scaler callable gave str"),
    ):
        run(psm, x, y)


# -- a transform of your own that mixes a NaN into finite gradients ------------------------------


class TwoHeads(nn.Module):
    """Sample 2's first head can fail while the second head's gradients stay finite."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head1, self.head2 = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return torch.cat([self.head1(h), self.head2(h)], 1)


def flat_clip(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DP-SGD's clipping written for one sample: it mixes every parameter's gradient."""
    norm = torch.stack([v.square().sum() for v in g.values()]).sum().sqrt()
    return {k: v * (0.5 / norm).clamp(max=1) for k, v in g.items()}


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_user_transform_that_mixes_a_nan_into_finite_parameters(keep: bool, scaled: bool) -> None:
    """Sample 2's gradients of the trunk and the first head are NaN or Inf, of the second head
    finite; the transform's output is NaN for all of them. That is no error of the transform (it
    was not given finite values): the NaN reaches .grad, and under a scaler the step is skipped."""
    torch.manual_seed(0)
    model = TwoHeads() if scaled else TwoHeads().double()
    ((x, y),) = batches(1, torch.float32 if scaled else torch.float64)
    if scaled:
        y[2, :2] *= 1e4  # past float16 once scaled by 2**16
    else:
        y[2, 0] = float("nan")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaled else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=scaler) as psm:
        psm.register_transform(model, flat_clip)
        run(psm, x, y, scaler, autocast=torch.float16 if scaled else None)
        if keep:
            assert torch.isfinite(model.head2.weight.grad_sample[2]).all()
        for name, p in model.named_parameters():
            assert not torch.isfinite(p.grad).all(), name
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            assert scaler.get_scale() == 2.0**15
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# -- whole loops: an overflow step, scale changes, shared inputs, raw parameters, fallback --------


def clipped_mean(ref: dict[str, torch.Tensor], bound: float) -> dict[str, torch.Tensor]:
    """``(1/B) sum_i min(1, C/||g_i||) g_i`` for every parameter, ``||g_i||`` over all of them."""
    factor = (bound / flat_norms(ref)).clamp(max=1)
    return {k: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for k, g in ref.items()}


@pytest.mark.parametrize("keep", [True, False])
def test_a_loop_with_an_overflow_step_and_scale_changes_equals_the_reference(keep: bool) -> None:
    """Ten SGD-with-momentum steps, batch sizes 1 to 6, 16 positions on some steps (detached
    weights), root clip_norm(0.5): the scaler grows its scale every two steps, one step overflows
    (sample 1's target is Inf: the scaler must see it, skip the step and halve its scale) and the
    scale is once set by hand. After each step the weights equal those of the same loop driven by
    per-sample autograd gradients (float64), which skips the overflow step."""
    model, reference = small_model(), small_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    sizes, overflow_step, manual_step = [3, 6, 1, 4, 5, 2, 6, 1, 3, 4], 4, 7
    scales = []
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=scaler) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step, b in enumerate(sizes):
            shape = (b, 16) if step % 3 == 1 else (b,)
            x = torch.randn(*shape, 4, generator=gen, dtype=torch.float64)
            y = torch.randn(*shape, 3, generator=gen, dtype=torch.float64)
            if step == overflow_step:
                y[1] = float("inf")
            if step == manual_step:
                scaler.update(new_scale=2.0**3)
            optimizer.zero_grad()
            run(psm, x, y, scaler)
            scale = scaler.get_scale()
            scales.append(scale)
            assert psm.dropped_samples() == {}
            before = [p.detach().clone() for p in model.parameters()]
            if step == overflow_step:
                for name, p in model.named_parameters():
                    assert not torch.isfinite(p.grad).all(), name
            else:
                ref = reference_grad_sample(reference, x, y, lambda out, t: (out - t).pow(2).sum())
                want = clipped_mean(ref, 0.5)
                for (name, p), q in zip(reference.named_parameters(), model.parameters()):
                    assert_close(q.grad / scale, want[name], f"{name} step {step}")
                    assert_close(psm.per_sample_norms()[name], ref[name].flatten(1).norm(dim=1), name)
                    if keep:
                        assert_close(q.grad_sample, ref[name], f"grad_sample of {name} step {step}")
                    p.grad = want[name]
                ref_optimizer.step()
            scaler.step(optimizer)
            scaler.update()
            if step == overflow_step:
                assert scaler.get_scale() == scale / 2
                assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            for (name, p), q in zip(reference.named_parameters(), model.parameters()):
                assert_close(q, p, f"{name} after step {step}")
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12, 2.0**11, 2.0**11, 2.0**3, 2.0**3, 2.0**4]


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("which", ["shared positions", "raw parameters", "fallback"])
def test_shared_inputs_raw_parameters_and_fallback_under_a_scaler(keep: bool, which: str) -> None:
    """Position embeddings of ``arange(T)`` (no batch dim), ViT-style raw parameters, and the
    torch.func fallback: their per-sample gradients arrive by other paths than a layer's output;
    under a changing scale they equal per-sample autograd's, clipped at the root."""
    from tests.test_shared import STEPS, NanoGPT, RawParameters, floats, ids, squared, token_loss

    torch.manual_seed(6)
    model = (NanoGPT() if which == "shared positions" else RawParameters()).double()
    batch = ids(9) if which == "shared positions" else floats(4, 3)
    loss = token_loss if which == "shared positions" else squared
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9)
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, grad_scaler=scaler, fallback=which == "fallback") as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step, (b, t) in enumerate(STEPS):
            x, y = batch(b, t, gen)
            want = clipped_mean(reference_grad_sample(model, x, y, loss=loss), 0.5)
            psm.zero_grad()
            scaler.scale(loss(psm(x), y) / b).backward()
            assert scaler.get_scale() == 2.0 ** (9 + step)
            for name, p in model.named_parameters():
                assert_close(p.grad / 2.0 ** (9 + step), want[name], f"{name} step {step}")
            scaler.update(new_scale=2.0 ** (10 + step))
