"""Mixed precision, devices and torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad import PerSampleModule, transforms


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 8), nn.LayerNorm(8), nn.Linear(8, 3)
    )


def grads_of(
    model: nn.Module, forward: object, x: torch.Tensor, autocast: bool = False
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    model.zero_grad()
    for p in model.parameters():
        p.__dict__.pop("grad_sample", None)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = forward(x)  # type: ignore[operator]
        out.pow(2).mean().backward()  # backward inside the autocast region too: the harder case
    return {n: (p.grad_sample.clone(), p.grad.clone()) for n, p in model.named_parameters()}


def test_autocast_bfloat16_on_cpu_is_close_to_float32() -> None:
    """Per-sample gradients come out in the parameters' dtype (float32), within 3% (relative
    Frobenius error, bfloat16 has 8 bits of mantissa) of the float32 result."""
    model = small_cnn()
    x = torch.randn(5, 2, 6, 6)
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        exact = grads_of(model, psm, x)
        low = grads_of(model, psm, x, autocast=True)
    for name, (gs, grad) in exact.items():
        assert low[name][0].dtype == torch.float32
        assert (low[name][0] - gs).norm() <= 3e-2 * gs.norm(), name
        assert (low[name][1] - grad).norm() <= 3e-2 * grad.norm(), name


def test_torch_compile_of_the_wrapped_model_is_exact() -> None:
    """Dynamo runs pergrad's hooked layers eagerly (graph breaks): results are exact."""
    model = small_cnn().double()
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.clip_norm(0.1))
        eager = grads_of(model, psm, x)
        compiled = grads_of(model, torch.compile(model, backend="eager"), x)
        for name, (gs, grad) in compiled.items():
            torch.testing.assert_close(gs, eager[name][0], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad, eager[name][1], rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stay_on_the_device() -> None:
    model = small_cnn().cuda()
    x = torch.randn(5, 2, 6, 6, device="cuda")
    with PerSampleModule(model, keep_grad_sample=False, track_statistics=True) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        psm(x).pow(2).mean().backward()
        assert all(p.grad.is_cuda for p in model.parameters())
        assert all(n.is_cuda for n in psm.per_sample_norms().values())
        assert psm.statistics().trace_variance.is_cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_autocast_float16_on_cuda_is_close_to_float32() -> None:
    model = small_cnn().cuda()
    x = torch.randn(5, 2, 6, 6, device="cuda")
    with PerSampleModule(model) as psm:
        exact = grads_of(model, psm, x)
        model.zero_grad()
        for p in model.parameters():
            p.__dict__.pop("grad_sample", None)
        with torch.autocast("cuda", dtype=torch.float16):
            out = psm(x)
        out.float().pow(2).mean().backward()
        for name, p in model.named_parameters():
            assert p.grad_sample.dtype == torch.float32 and p.grad_sample.is_cuda
            assert (p.grad_sample - exact[name][0]).norm() <= 3e-2 * exact[name][0].norm(), name


@pytest.mark.parametrize(
    "layer,shape",
    [
        (nn.GroupNorm(2, 8), (3, 8, 4, 4)),
        (nn.LayerNorm(8), (3, 5, 8)),
        (nn.InstanceNorm2d(8, affine=True), (3, 8, 4, 4)),
        (nn.RMSNorm(8), (3, 5, 8)),
    ],
    ids=["group", "layer", "instance", "rms"],
)
def test_a_norm_run_in_float32_on_a_bfloat16_input(layer: nn.Module, shape: tuple[int, ...]) -> None:
    """CUDA's autocast runs the norms in float32 on a bf16 input (a conv's output): ``a`` is bf16 and ``d``
    float32. The rule normalises in float32, as the layer did (it raised in a bmm of mixed dtypes)."""
    from pergrad.registry import default_registry

    torch.manual_seed(0)
    a, d = torch.randn(shape).bfloat16(), torch.randn(shape)
    got = default_registry.lookup(layer).fn(layer, a, d)  # type: ignore[union-attr]
    x_hat = _plain(layer)(a.float()).detach()
    summed = tuple(range(1, len(shape) - 1)) if isinstance(layer, nn.LayerNorm | nn.RMSNorm) else (2, 3)
    assert got["weight"].dtype == torch.float32
    torch.testing.assert_close(got["weight"], (d * x_hat).sum(summed), rtol=1e-5, atol=1e-5)


def _plain(layer: nn.Module) -> nn.Module:
    """A copy of a norm layer with unit weight and zero bias: its forward is ``x_hat``."""
    import copy

    plain = copy.deepcopy(layer)
    with torch.no_grad():
        plain.weight.fill_(1.0)
        if getattr(plain, "bias", None) is not None:
            plain.bias.zero_()
    return plain
