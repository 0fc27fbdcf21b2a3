"""The wrapper's API: transforms and targets, reductions, removal, and the errors it raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pergrad
from pergrad import (
    BatchMixingError,
    BatchSizeError,
    PerSampleModule,
    SharedInputError,
    TargetError,
    TransformError,
    UnsupportedLayerError,
    transforms,
)
from tests.reference import assert_close, reference_grad_sample, run_pergrad


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def batch(b: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, generator=gen, dtype=torch.float64), torch.randn(b, 3, generator=gen, dtype=torch.float64)


def times(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return g * factor.view(-1, *([1] * (g.dim() - 1)))


def norms_of(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def expected_clip(grads: dict[str, torch.Tensor], c: float) -> dict[str, torch.Tensor]:
    factor = (c / norms_of(grads)).clamp(max=1)
    return {k: times(g, factor) for k, g in grads.items()}


CASES: list[tuple[str, object, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]] = [
    ("clip root", "", lambda g: expected_clip(g, 0.3)),
    ("clip module", "2", lambda g: expected_clip(g, 0.3)),
    ("normalize root", "", lambda g: {k: times(v, 1 / (norms_of(g) + 1e-6)) for k, v in g.items()}),
    ("square param", "0.weight", lambda g: {k: v.square() for k, v in g.items()}),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize(("label", "target", "expect"), CASES, ids=[c[0] for c in CASES])
def test_builtin_transforms(
    label: str, target: str, expect: Callable[..., dict[str, torch.Tensor]], loss_reduction: str, reduction: str
) -> None:
    model, (x, y) = mlp(), batch()
    ref = reference_grad_sample(model, x, y)
    transform = {
        "clip": transforms.clip_norm(0.3),
        "normalize": transforms.normalize(1e-6),
        "square": transforms.square(),
    }[label.split()[0]]
    covered = [n for n in ref if n == target or n.startswith(target)]
    expected = dict(ref)
    expected.update(expect({n: ref[n] for n in covered}))
    with PerSampleModule(model, loss_reduction=loss_reduction, reduction=reduction) as psm:
        psm.register_transform(target, transform)
        run_pergrad(psm, x, y, loss_reduction)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], name)  # before T
            want = expected[name].mean(0) if reduction == "mean" else expected[name].sum(0)
            assert_close(p.grad, want, name)


def test_scale_by_per_sample_weights() -> None:
    model, (x, y) = mlp(), batch()
    ref = reference_grad_sample(model, x, y)
    w = torch.linspace(0, 2, 6, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.scale(w))
        run_pergrad(psm, x, y)
        for name, p in model.named_parameters():
            assert_close(p.grad, times(ref[name], w).mean(0), name)


def test_scale_with_wrong_number_of_weights() -> None:
    model, (x, y) = mlp(), batch()
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.scale(torch.ones(4)))
        with pytest.raises(TransformError, match=r"scale has 4 weights but the batch has 6 samples"):
            run_pergrad(psm, x, y)


def test_user_transforms_one_sample_and_batched() -> None:
    model, (x, y) = mlp(), batch()
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model) as psm:
        psm.register_transform(model[2].weight, lambda g: g.sign())
        psm.register_transform("0", lambda g: {k: v * v.norm() for k, v in g.items()})
        psm.register_transform("2.bias", lambda g: g.clamp(-0.1, 0.1), batched=True)
        run_pergrad(psm, x, y)
        assert_close(model[2].weight.grad, ref["2.weight"].sign().mean(0))
        assert_close(model[2].bias.grad, ref["2.bias"].clamp(-0.1, 0.1).mean(0))
        for k in ("weight", "bias"):
            per_sample = ref[f"0.{k}"]
            norm = per_sample.flatten(1).norm(dim=1)
            assert_close(getattr(model[0], k).grad, times(per_sample, norm).mean(0))


def test_identity_with_other_reduction_scales_autograd() -> None:
    model, (x, y) = mlp(), batch()
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model, loss_reduction="mean", reduction="sum") as psm:
        run_pergrad(psm, x, y, "mean")
        for name, p in model.named_parameters():
            assert_close(p.grad, ref[name].sum(0), name)


@pytest.mark.parametrize(
    ("fn", "batched", "error"),
    [
        (
            lambda g: g[:1],
            False,
            r"parameter '2.weight' changed the shape of '2.weight': got \(6, 1, 5\), expected \(6, 3, 5\)",
        ),
        (lambda g: 3.0, True, r"parameter '2.weight' returned float; a parameter transform must return a tensor"),
        (lambda g: g if g.sum() > 0 else -g, False, r"parameter '2.weight' raised .*vmap.*batched=True"),
    ],
)
def test_bad_transforms(fn: Callable[..., object], batched: bool, error: str) -> None:
    model, (x, y) = mlp(), batch()
    with PerSampleModule(model) as psm:
        psm.register_transform("2.weight", fn, batched=batched)
        with pytest.raises(TransformError, match=error):
            run_pergrad(psm, x, y)


def test_module_transform_must_keep_its_keys() -> None:
    model, (x, y) = mlp(), batch()
    with PerSampleModule(model) as psm:
        psm.register_transform("0", lambda g: {"weight": g["weight"]})
        with pytest.raises(
            TransformError, match=r"module '0' returned keys \['weight'\], expected \['bias', 'weight'\]"
        ):
            run_pergrad(psm, x, y)


def test_targets_errors() -> None:
    model = mlp()
    with PerSampleModule(model) as psm:
        with pytest.raises(TargetError, match=r"no module or parameter named 'nope'"):
            psm.register_transform("nope", transforms.square())
        with pytest.raises(TargetError, match=r"not part of the wrapped model"):
            psm.register_transform(nn.Linear(2, 2), transforms.square())
        with pytest.raises(TargetError, match=r"module '1' has no trainable parameters"):
            psm.register_transform("1", transforms.square())
        psm.register_transform("0", transforms.clip_norm(1.0))
        with pytest.raises(TargetError, match=r"the whole model overlaps module '0'.*\['0.bias', '0.weight'\]"):
            psm.register_transform(model, transforms.clip_norm(1.0))
        with pytest.raises(TransformError, match=r"must be callable"):
            psm.register_transform("2", 3)  # type: ignore[arg-type]
    with pytest.raises(TransformError, match=r"max_norm > 0"):
        transforms.clip_norm(0)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class MyLinear(nn.Linear):
    pass


@pytest.mark.parametrize(
    ("model", "error"),
    [
        (
            nn.Sequential(nn.Linear(3, 3), nn.PReLU()),
            r"layer '1' \(torch.nn.modules.activation.PReLU\) has trainable parameters \['weight'\] but no per-sample rule.*register_rule\(PReLU\).*Supported types: .*Linear",
        ),
        (
            nn.Sequential(MyLinear(3, 3)),
            r"layer '0' .*MyLinear.*subclasses Linear and keeps its forward.*register the parent's rule: "
            r"pergrad.register_rule\(MyLinear\)\(pergrad.rules.linear\)\. Or pass fallback=True",
        ),
        (
            nn.Embedding(4, 2, scale_grad_by_freq=True),
            r"^the root module \(nn.Embedding\) has scale_grad_by_freq=True",
        ),
        (nn.PReLU(), r"^the root module \(torch.nn.modules.activation.PReLU\) has trainable .*register_rule\(PReLU\)"),
        (nn.Embedding(4, 2, sparse=True), r"sparse=True.*sparse=False"),
    ],
)
def test_unsupported_layers_fail_at_wrap_time(model: nn.Module, error: str) -> None:
    with pytest.raises((UnsupportedLayerError, BatchMixingError), match=error):
        PerSampleModule(model)


class CustomLinear(nn.Module):
    """A raw weight used as a matrix by F.linear: not a broadcast, so not split per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MyGroupNorm(nn.GroupNorm):
    pass


class BatchNormAct2d(nn.BatchNorm2d):
    """As timm's: a BatchNorm followed by an activation, in one forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class LayerNorm2d(nn.LayerNorm):
    """As timm's: a LayerNorm over the channels of an image, which permutes them last and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Act(LayerNorm2d):  # forward overridden by its parent, not by itself
    pass


def test_subclass_advice_names_the_parent_rule_and_it_works() -> None:
    """The advice names the real rule with the options it is registered with; following it
    literally gives exact per-sample gradients."""
    model = nn.Sequential(nn.Conv2d(2, 4, 1), MyGroupNorm(2, 4)).double()
    advice = (
        r"layer '1' \(\S*MyGroupNorm\) has trainable parameters \['weight', 'bias'\] but no per-sample "
        r"rule: it subclasses GroupNorm and keeps its forward; rules apply to their exact type only .* register the "
        r"parent's rule: pergrad.register_rule\(MyGroupNorm, batch_dim_fixed=True\)\(pergrad.rules.group_norm\)\. "
        r"Or pass fallback=True"
    )
    with pytest.raises(UnsupportedLayerError, match=advice):
        PerSampleModule(model)
    registry = pergrad.default_registry.copy()
    pergrad.register_rule(MyGroupNorm, batch_dim_fixed=True, registry=registry)(pergrad.rules.group_norm)
    x, y = torch.randn(4, 2, 3, 3, dtype=torch.float64), torch.randn(4, 4, 3, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model, rules=registry) as psm:
        for _ in range(2):
            psm.zero_grad()
            run_pergrad(psm, x, y)
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], name)


@pytest.mark.parametrize(
    ("layer", "parent", "where"),
    [
        (BatchNormAct2d(4), "BatchNorm2d", "BatchNormAct2d"),
        (LayerNorm2d(4), "LayerNorm", "LayerNorm2d"),
        (Act(4), "LayerNorm", "LayerNorm2d"),
    ],
)
def test_subclass_that_overrides_forward_is_not_advised_the_parent_rule(
    layer: nn.Module, parent: str, where: str
) -> None:
    with pytest.raises(
        UnsupportedLayerError,
        match=rf"it subclasses {parent}, but {where} overrides forward, so the {parent} rule does not compute its "
        rf"gradients: pass fallback=True to compute it with torch.func \(exact, slower\), or write a rule for it "
        rf"with @pergrad.register_rule\({type(layer).__name__}\)\. Supported",
    ) as info:
        PerSampleModule(nn.Sequential(nn.Conv2d(2, 4, 1), layer))
    assert "register the parent's rule" not in str(info.value) and "pergrad.rules." not in str(info.value)


def test_scalar_raw_parameter_with_clipping() -> None:
    """A 0-dim raw parameter's per-sample gradients are ``[B]``: norms and sums handle them."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Scale()).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, y)
    norms = torch.stack([g.reshape(5, -1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (0.5 / norms).clamp(max=1)
    for keep_grad_sample in (True, False):
        model.zero_grad()
        with PerSampleModule(model, keep_grad_sample=keep_grad_sample) as psm:
            psm.register_transform(model, pergrad.transforms.clip_norm(0.5))
            run_pergrad(psm, x, y)
        for name, p in model.named_parameters():
            g = ref[name]
            assert_close(p.grad, (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0), name)


def test_raw_parameters_of_custom_modules() -> None:
    """A custom module's own parameters are tracked to where they meet the batch: exact where that
    is a broadcast (``x * self.scale``), a clear error in the forward where it is not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Custom()).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model) as psm:
        run_pergrad(psm, x, y)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], name)
    with (
        PerSampleModule(nn.Sequential(CustomLinear()).double()) as psm,
        pytest.raises(
            SharedInputError,
            match=r"parameter 'weight' of layer '0' \(CustomLinear\) is shared by the batch.*meets the batch in "
            r"linear.*register_rule.*fallback=True",
        ),
    ):
        psm(x)


def test_frozen_unsupported_layer_is_fine_and_registered_subclass_works() -> None:
    model = nn.Sequential(MyLinear(3, 3), nn.PReLU()).double()
    model[1].requires_grad_(False)
    registry = pergrad.default_registry.copy()
    registry.register(MyLinear)(pergrad.rules.linear)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model, rules=registry) as psm:
        run_pergrad(psm, x, y)
        assert_close(model[0].weight.grad_sample, ref["0.weight"])
    assert MyLinear not in pergrad.default_registry
    with pytest.raises(ValueError, match=r"already registered.*overwrite=True"):
        registry.register(MyLinear)(pergrad.rules.linear)


def test_frozen_batchnorm_in_train_mode_fails_in_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].requires_grad_(False)
    with PerSampleModule(model) as psm:
        with pytest.raises(BatchMixingError, match=r"layer '1' \(BatchNorm1d\).*training mode.*eval mode"):
            psm(torch.randn(4, 3))
        psm.eval()
        psm(torch.randn(4, 3)).sum().backward()
        assert model[0].weight.grad_sample.shape == (4, 3, 3)


class Folds(nn.Module):
    """Folds the sequence into the batch before its second Linear: per-sample gradients are undefined."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(-1, 3))


def test_inconsistent_batch_sizes() -> None:
    with (
        PerSampleModule(Folds()) as psm,
        pytest.raises(
            BatchSizeError,
            match=r"layer 'b' \(Linear\) got input of shape \(10, 3\) computed from the batch, but the model was "
            r"called with a batch of 2 samples on dim 0: keep the batch on its own dim",
        ),
    ):
        psm(torch.randn(2, 5, 3))


def test_unbatched_input() -> None:
    with (
        PerSampleModule(nn.Linear(3, 2), batch_first=False) as psm,
        pytest.raises(BatchSizeError, match=r"no batch dim 1"),
    ):
        psm(torch.randn(3))


def test_remove_leaves_the_model_as_it_was() -> None:
    model, (x, y) = mlp(), batch()
    keys = list(model.state_dict())
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(0.1))
    run_pergrad(psm, x, y)
    assert list(psm.state_dict()) == keys
    psm.remove()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    model.zero_grad()
    run_pergrad(model, x, y)  # plain autograd again: no clipping, no grad_sample
    ref = reference_grad_sample(model, x, y)
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name].mean(0), name)
        assert not hasattr(p, "grad_sample")
    assert list(model.state_dict()) == keys


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"loss_reduction must be 'mean' or 'sum', got 'avg'"):
        PerSampleModule(mlp(), loss_reduction="avg")
    with pytest.raises(TypeError, match=r"wraps an nn.Module"):
        PerSampleModule(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_batchnorm_in_eval_mode_matches_torch_func(dims: int) -> None:
    torch.manual_seed(dims)
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](3)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1](2, 3, 1)
    model = nn.Sequential(conv, bn, nn.Tanh()).double()
    x = torch.randn(4, 2, *([3] * dims), dtype=torch.float64)
    model(x)  # one training-mode forward fills the running statistics
    with torch.no_grad():
        bn.weight.normal_(), bn.bias.normal_()
    model.eval()
    target = torch.randn_like(model(x))
    ref = reference_grad_sample(model, x, target)
    with PerSampleModule(model) as psm:
        run_pergrad(psm, x, target)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], name)
        psm.train()
        with pytest.raises(BatchMixingError, match=r"layer '1' \(BatchNorm\dd\).*training mode"):
            psm(x)


def test_batchnorm_without_running_statistics_fails_in_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False)).eval()
    with PerSampleModule(model) as psm, pytest.raises(BatchMixingError, match=r"track_running_stats=False"):
        psm(torch.randn(4, 3))
