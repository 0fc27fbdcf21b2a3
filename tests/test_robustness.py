"""Faults and misuse: every case is exact or a clear error, and leaves nothing behind."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
import weakref

import pytest
import torch
from torch import nn

from pergrad import PergradError, PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample, run_pergrad


def model_and_batch(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    return model, torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)


def assert_exact_step(psm: PerSampleModule, model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    ref = reference_grad_sample(model, x, target)
    model.zero_grad()
    run_pergrad(psm, x, target)
    for name, p in model.named_parameters():
        assert_close(p.grad_sample, ref[name], name)
        assert_close(p.grad, ref[name].mean(0), name)


def test_two_wrappers_on_one_model_is_an_error_and_rewrapping_works() -> None:
    model, x, target = model_and_batch()
    first = PerSampleModule(model)
    with pytest.raises(PergradError, match=r"already wrapped by a PerSampleModule.*\.remove\(\)"):
        PerSampleModule(model)
    with pytest.raises(PergradError, match=r"already wrapped"):
        PerSampleModule(model[0])
    first.remove()
    with PerSampleModule(model) as second:
        assert_exact_step(second, model, x, target)
    with PerSampleModule(model) as third:
        assert_exact_step(third, model, x, target)


def test_exception_in_the_middle_of_a_forward() -> None:
    model, x, target = model_and_batch()
    with PerSampleModule(model) as psm:
        with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied"):
            psm(torch.randn(5, 7, dtype=torch.float64))
        assert psm._engine.backwards.current is None
        assert_exact_step(psm, model, x, target)


def test_exception_in_the_middle_of_a_backward() -> None:
    model, x, target = model_and_batch()

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with PerSampleModule(model) as psm:
        failed_input = x.clone()
        kept = weakref.ref(failed_input)
        out = psm(failed_input)
        out.register_hook(explode)
        with pytest.raises(ValueError, match="boom"):
            (out - target).pow(2).sum().backward()
        del out, failed_input
        assert_exact_step(psm, model, x, target)
        assert psm._engine.backwards.current is None
        gc.collect()
        assert kept() is None  # nothing of the failed step is held: memory is back to baseline


def test_forward_twice_then_backward_of_the_second() -> None:
    model, x, target = model_and_batch()
    with PerSampleModule(model) as psm:
        psm(torch.randn(9, 4, dtype=torch.float64))  # discarded
        assert_exact_step(psm, model, x, target)


def test_backward_without_a_forward_through_the_model() -> None:
    model, _, _ = model_and_batch()
    with PerSampleModule(model):
        w = torch.ones(3, requires_grad=True)
        (w * 2).sum().backward()  # nothing of the model involved: nothing happens
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "state_dict"])
def test_copies_of_a_wrapped_model_carry_no_pergrad_state(how: str) -> None:
    model, x, target = model_and_batch()
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.clip_norm(0.01))
        run_pergrad(psm, x, target)
        if how == "deepcopy":
            copied = copy.deepcopy(model)
        elif how == "pickle":
            # pickle keeps attributes set on tensors, grad_sample too: drop them first (documented)
            assert hasattr(pickle.loads(pickle.dumps(model))[0].weight, "grad_sample")
            psm.zero_grad()
            copied = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            copied, _, _ = model_and_batch(seed=1)
            copied.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
        assert not any(hasattr(p, "grad_sample") for p in copied.parameters())
        copied.zero_grad()
        run_pergrad(copied, x, target)  # plain autograd: no clipping, no grad_sample, original untouched
        ref = reference_grad_sample(copied, x, target)
        for name, p in copied.named_parameters():
            assert_close(p.grad, ref[name].mean(0), name)
            assert not hasattr(p, "grad_sample")
        with PerSampleModule(copied) as again:  # a copy can be wrapped on its own
            assert_exact_step(again, copied, x, target)


def test_two_models_in_two_threads() -> None:
    results: dict[int, bool] = {}

    def work(seed: int) -> None:
        model, x, target = model_and_batch(seed)
        ref = reference_grad_sample(model, x, target)
        ok = True
        with PerSampleModule(model) as psm:
            for _ in range(20):
                model.zero_grad()
                run_pergrad(psm, x, target)
                ok &= all(
                    torch.allclose(p.grad_sample, ref[n], rtol=1e-9, atol=1e-10) for n, p in model.named_parameters()
                )
        results[seed] = ok

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1: True, 2: True}


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_poisoned_sample_is_reported_and_left_out_of_clipping(keep: bool, poison: float) -> None:
    model, x, target = model_and_batch()
    clean = [i for i in range(5) if i != 2]
    ref = reference_grad_sample(model, x[clean], target[clean])
    norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (0.5 / norms).clamp(max=1)
    x = x.clone()
    x[2, 1] = poison
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        run_pergrad(psm, x, target)
        assert psm.dropped_samples()["the whole model"].tolist() == [2]
        for name, p in model.named_parameters():
            assert not torch.isfinite(psm.per_sample_norms()[name][2])
            assert_close(psm.per_sample_norms()[name][clean], ref[name].flatten(1).norm(dim=1), name)
            scaled = ref[name] * factor.view(-1, *([1] * (ref[name].dim() - 1)))
            assert_close(p.grad, scaled.sum(0) / 5, name)  # mean over the full batch of 5
        model.zero_grad()
        run_pergrad(psm, x[clean], target[clean])
        assert psm.dropped_samples() == {}


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_empty_batch(keep: bool, loss_reduction: str) -> None:
    """Poisson sampling can draw no sample: .grad gets 0 added, grad_sample and norms are empty."""
    model, _, _ = model_and_batch()
    with PerSampleModule(model, keep_grad_sample=keep, loss_reduction=loss_reduction, track_norms=True) as psm:
        psm.register_transform("0", transforms.clip_norm(1.0))
        out = psm(torch.randn(0, 4, dtype=torch.float64))
        out.sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() == 0
            assert psm.per_sample_norms()[name].shape == (0,)
            if keep:
                assert p.grad_sample.shape == (0, *p.shape)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("transform", [None, "clip"])
def test_micro_batches_of_varying_size_give_the_full_batch_result(
    keep: bool, reduction: str, loss_reduction: str, transform: str | None
) -> None:
    model, _, _ = model_and_batch()
    x = torch.randn(9, 4, dtype=torch.float64)
    target = torch.randn(9, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    factor = torch.ones(9, dtype=torch.float64)
    if transform:
        norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
        factor = (0.4 / norms).clamp(max=1)
    with PerSampleModule(
        model, keep_grad_sample=keep, loss_reduction=loss_reduction, reduction=reduction, accumulate="samples"
    ) as psm:
        if transform:
            psm.register_transform(model, transforms.clip_norm(0.4))
        for step in range(2):  # the second round starts after zero_grad(set_to_none=False)
            for chunk in (slice(0, 4), slice(4, 5), slice(5, 9)):
                run_pergrad(psm, x[chunk], target[chunk], loss_reduction)
            for name, p in model.named_parameters():
                scaled = ref[name] * factor.view(-1, *([1] * (ref[name].dim() - 1)))
                assert_close(p.grad, scaled.mean(0) if reduction == "mean" else scaled.sum(0), f"{name} round {step}")
            model.zero_grad(set_to_none=False)


@pytest.mark.parametrize("keep", [True, False])
def test_reused_buffers_do_not_pile_up_over_steps(keep: bool) -> None:
    """Buffers kept for reuse are bounded by what one backward asks for: a step's per-sample tensors
    of a shape no rule allocates (bias sums) or transient ones must not accumulate over steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 20, 4, dtype=torch.float64), torch.randn(6, 20, 3, dtype=torch.float64)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        psm.register_transform(model[2], transforms.clip_norm(1.0))
        pooled = []
        for _ in range(8):
            psm.zero_grad()
            run_pergrad(psm, x, y)
            pooled.append(psm._engine.pool.held_bytes)
        assert pooled[2:] == [pooled[2]] * 6, pooled
