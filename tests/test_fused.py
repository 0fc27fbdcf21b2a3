"""keep_grad_sample=False: norms, scaling transforms and statistics without building g_i, checked
against the same quantities computed from torch.func's per-sample gradients."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import pergrad
from pergrad import PergradError, PerSampleModule, transforms
from pergrad.rules.linear import gram_is_cheaper
from tests.reference import assert_close, reference_grad_sample, run_pergrad
from tests.test_hooks import Twice
from tests.test_rules import Head, families, make_input


def flat_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()


def times(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return g * c.view(-1, *([1] * (g.dim() - 1)))


def expected_statistics(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The statistics straight from their definitions on per-sample gradients."""
    b = next(iter(ref.values())).shape[0]
    flat = torch.cat([g.flatten(1) for g in ref.values()], 1)  # [B, P]
    g = flat.mean(0)
    g2 = g.square().sum()
    p = flat @ g
    trace = {"trace_variance": (flat.square().mean(0) - g.square()).sum()}
    if b < 2:  # the tests' sample variances (over B - 1) are undefined for one sample: pergrad reports NaN
        nan = torch.tensor(float("nan"), dtype=flat.dtype)
        return trace | dict.fromkeys(("norm_test", "inner_product_test", "orthogonality_test"), nan)
    return trace | {
        "norm_test": ((flat - g).square().sum() / (b - 1) / (b * g2)).sqrt(),
        "inner_product_test": (((p - g2).square().sum() / (b - 1)) / (b * g2.square())).sqrt(),
        "orthogonality_test": (((flat - (p / g2).unsqueeze(1) * g).square().sum() / (b - 1)) / (b * g2)).sqrt(),
    }


def check_statistics(stats: pergrad.statistics.Statistics, ref: dict[str, torch.Tensor]) -> None:
    for name, g in ref.items():
        s = stats.params[name]
        assert_close(s.mean, g.mean(0), f"mean {name}")
        assert_close(s.second_moment, g.square().mean(0), f"second moment {name}")
        assert_close(s.variance, g.square().mean(0) - g.mean(0).square(), f"variance {name}")
    assert_close(stats.sq_norms, flat_norms(ref).square(), "sq_norms")
    expected = expected_statistics(ref)
    mean_sq = torch.cat([g.mean(0).flatten() for g in ref.values()]).square().sum()
    if mean_sq <= 1e-20 * flat_norms(ref).square().mean():
        # the mean gradient is zero up to round-off: the three tests divide by it and are meaningless
        expected = {"trace_variance": expected["trace_variance"]}
    # the tests divide by the squared mean: the round-off of sum_i ||g_i||^2 grows by ||g_i||^2 / ||mean||^2
    # (7e7 for a mean of 3e-4 beside per-sample gradients of norm 2.6: an RMSNorm over one feature)
    conditioning = float(flat_norms(ref).square().mean() / mean_sq) if mean_sq > 0 else 0.0
    for key, value in expected.items():
        # compare squares: a test near 0 is the sqrt of a cancellation, which magnifies round-off
        atol = 1e-9 if key == "trace_variance" else max(1e-9, 1e-13 * conditioning)
        torch.testing.assert_close(
            getattr(stats, key).square(), value.square(), rtol=1e-7, atol=atol, equal_nan=True, msg=key
        )


def model_and_batch(
    layer: nn.Module, shape: tuple[int, ...], seed: int
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = Head(layer)
    x = make_input(layer, shape, seed)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    return model, x, target


@pytest.mark.parametrize("family", sorted(families))
@given(data=st.data(), seed=st.integers(0, 2**16), max_norm=st.floats(0.05, 5.0))
def test_fused_norms_clipping_statistics(family: str, data: st.DataObject, seed: int, max_norm: float) -> None:
    torch.manual_seed(seed)
    layer, shape = data.draw(families[family])
    model, x, target = model_and_batch(layer, shape, seed)
    ref = reference_grad_sample(model, x, target)
    factor = (max_norm / flat_norms(ref)).clamp(max=1)
    with PerSampleModule(model, keep_grad_sample=False, track_statistics=True) as psm:
        psm.register_transform(model, transforms.clip_norm(max_norm))
        run_pergrad(psm, x, target)
        norms = psm.per_sample_norms()
        for name, p in model.named_parameters():
            assert not hasattr(p, "grad_sample")
            assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norm {name}")
            assert_close(p.grad, times(ref[name], factor).mean(0), f"clipped grad {name}")
        check_statistics(psm.statistics(), ref)  # (one sample: the tests are NaN, see expected_statistics)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_targets_at_three_levels_and_shared_parameters(keep: bool, reduction: str) -> None:
    """A module target, a parameter target and the rest of the model; tied and reused layers."""
    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randint(0, 7, (5, 4))
    target = torch.randn(5, 4, 7, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    w = torch.ones(5, dtype=torch.float64)
    with PerSampleModule(model, keep_grad_sample=keep, reduction=reduction, track_norms=True) as psm:
        psm.register_transform("lin", transforms.clip_norm(0.2))
        psm.register_transform("emb.weight", transforms.normalize(1e-3))
        run_pergrad(psm, x, target)
        lin = {k: ref[f"lin.{k}"] for k in ("weight", "bias")}
        expected = {
            "lin.weight": times(lin["weight"], (0.2 / flat_norms(lin)).clamp(max=1)),
            "lin.bias": times(lin["bias"], (0.2 / flat_norms(lin)).clamp(max=1)),
            "emb.weight": times(ref["emb.weight"], 1 / (ref["emb.weight"].flatten(1).norm(dim=1) + 1e-3)),
        }
        for name, p in model.named_parameters():
            want = expected[name].mean(0) if reduction == "mean" else expected[name].sum(0)
            assert_close(p.grad, want, name)
            assert_close(psm.per_sample_norms()[name], ref[name].flatten(1).norm(dim=1), name)
        with pytest.raises(pergrad.TargetError, match=r"module 'head' overlaps parameter 'emb.weight'"):
            psm.register_transform(model.head, transforms.scale(w))  # head.weight is emb.weight


def test_scale_and_square_fused() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, target = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    w = torch.linspace(0, 1, 5, dtype=torch.float64)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        psm.register_transform("0", transforms.scale(w))
        psm.register_transform("2", transforms.square())
        run_pergrad(psm, x, target)
        for k in ("weight", "bias"):
            assert_close(getattr(model[0], k).grad, times(ref[f"0.{k}"], w).mean(0))
            assert_close(getattr(model[2], k).grad, ref[f"2.{k}"].square().mean(0))


def spy_registry(calls: list[str]) -> pergrad.RuleRegistry:
    """The default rules, with the per-sample (materialising) Linear rule counting its calls."""
    registry = pergrad.default_registry.copy()
    spec = registry.lookup(nn.Linear(1, 1))
    assert spec is not None and spec.fused is not None

    def counting(layer: nn.Module, a: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(type(layer).__name__)
        return pergrad.rules.linear(layer, a, d)

    registry.register(nn.Linear, overwrite=True)(counting)
    registry.register_fused((nn.Linear,), spec.fused)
    return registry


@pytest.mark.parametrize("shape", [(6, 8), (6, 2, 8), (6, 40, 8)], ids=["2d", "gram", "outer"])
def test_fused_mode_never_builds_per_sample_gradients(shape: tuple[int, ...]) -> None:
    calls: list[str] = []
    model = nn.Sequential(nn.Linear(8, 9), nn.ReLU(), nn.Linear(9, 3)).double()
    x, target = torch.randn(shape, dtype=torch.float64), torch.randn(*shape[:-1], 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    with PerSampleModule(model, keep_grad_sample=False, track_statistics=True, rules=spy_registry(calls)) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        run_pergrad(psm, x, target)
        # only the elementwise sum of squares (statistics) builds g_i, and only with positions > 1
        assert (calls == []) if len(shape) == 2 else (calls == ["Linear", "Linear"])
        factor = (0.5 / flat_norms(ref)).clamp(max=1)
        for name, p in model.named_parameters():
            assert_close(p.grad, times(ref[name], factor).mean(0), name)
        check_statistics(psm.statistics(), ref)
    with PerSampleModule(model, keep_grad_sample=False, rules=spy_registry(calls := [])) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        run_pergrad(psm, x, target)
        assert calls == []


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("stats", [False, True])
def test_a_layer_without_fused_rule_is_built_once_per_backward(monkeypatch: pytest.MonkeyPatch, stats: bool) -> None:
    """Clipping needs the norms and then the weighted sum of a layer without a fused rule
    (MultiheadAttention): both read the one build, so fused is never costlier than materialising."""
    calls: list[str] = []
    module = sys.modules["pergrad.rules.fallback"]
    original = module.fallback

    def counting(layer: nn.Module, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        calls.append(type(layer).__name__)
        return original(layer, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "fallback", counting)
    torch.manual_seed(0)
    model = Attention().double()
    x, target = torch.randn(4, 5, 8, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    with PerSampleModule(model, keep_grad_sample=False, track_statistics=stats) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for _ in range(2):
            calls.clear()
            psm.zero_grad()
            run_pergrad(psm, x, target)
            assert calls == ["MultiheadAttention"]
            factor = (0.5 / flat_norms(ref)).clamp(max=1)
            for name, p in model.named_parameters():
                assert_close(p.grad, times(ref[name], factor).mean(0), name)


def test_both_norm_forms_are_used() -> None:
    assert gram_is_cheaper(2, 8, 9) and not gram_is_cheaper(40, 8, 9)


def test_statistics_keep_mode_and_cabs() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)).double()
    x, target = torch.randn(6, 2, 4, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    with PerSampleModule(model) as psm:
        with pytest.raises(PergradError, match=r"run a backward first"):
            psm.statistics()
        loss = run_pergrad(psm, x, target).item()
        stats = psm.statistics()
        check_statistics(stats, ref)
        expected = round(0.1 * float(stats.trace_variance) / loss)
        assert stats.cabs_batch_size(0.1, loss, low=1, high=10**9) == max(expected, 1)
        assert stats.cabs_batch_size(1e-9, loss) == 16
        with pytest.raises(ValueError, match=r"positive loss"):
            stats.cabs_batch_size(0.1, 0.0)


def test_norms_need_tracking_without_grad_sample() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        psm(torch.randn(4, 3)).sum().backward()
        with pytest.raises(PergradError, match=r"track_norms=True"):
            psm.per_sample_norms()


def norms_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).double()
    return model, torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)


@pytest.mark.parametrize("keep", [True, False])
def test_norms_of_what_was_clipped_without_track_norms(keep: bool) -> None:
    """The norms the backward computed for clipping and normalising are there without track_norms,
    as they were BEFORE the transform; another parameter's is an error that names the fix."""
    model, x, y = norms_model()
    ref = reference_grad_sample(model, x, y)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model[0], transforms.clip_norm(0.1))
        psm.register_transform("3.weight", transforms.normalize())
        run_pergrad(psm, x, y)
        norms = psm.per_sample_norms()
        transformed = {"0.weight", "0.bias", "3.weight"}
        assert set(norms) == ({n for n, _ in model.named_parameters()} if keep else transformed)
        for name in transformed:
            assert_close(norms[name], ref[name].flatten(1).norm(dim=1), name)
        # every sample was changed by its transform: clipped (norm > 0.1), normalised (norm != 1)
        assert flat_norms({k: ref[k] for k in ("0.weight", "0.bias")}).min() > 0.1
        assert (ref["3.weight"].flatten(1).norm(dim=1) - 1).abs().min() > 0.1
        if not keep:
            with pytest.raises(
                pergrad.NormNotComputedError, match=r"no per-sample norm of parameter '3\.bias'.*pass track_norms=True"
            ):
                norms["3.bias"]
            assert norms.get("3.bias") is None
        with pytest.raises(KeyError, match=r"'3\.nope' is not a trainable parameter.*'0\.weight'"):
            norms["3.nope"]


def test_norms_without_grad_sample_need_a_norm_based_transform_or_track_norms() -> None:
    model, x, y = norms_model()
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        psm.register_transform(model, transforms.clip_norm(0.1))
        with pytest.raises(PergradError, match=r"after a backward that computed norms.*track_norms=True"):
            psm.per_sample_norms()  # no backward yet
        run_pergrad(psm, x, y)
        assert len(psm.per_sample_norms()) == 6
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        psm.register_transform(model, transforms.scale(torch.ones(6, dtype=torch.float64)))  # needs no norms
        run_pergrad(psm, x, y)
        with pytest.raises(PergradError, match=r"norm-based transform \(clip_norm, normalize\).*track_norms=True"):
            psm.per_sample_norms()


@pytest.mark.parametrize("keep", [True, False])
def test_transformed_grad_accumulates_over_micro_batches(keep: bool) -> None:
    """The first backward stores T's reduction in an empty .grad; the second adds to it."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    batches = [(torch.randn(b, 4, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)) for b in (5, 3)]
    expected: dict[str, torch.Tensor] = {}
    for x, target in batches:
        ref = reference_grad_sample(model, x, target)
        factor = (0.3 / flat_norms(ref)).clamp(max=1)
        for name, g in ref.items():
            expected[name] = expected.get(name, 0) + times(g, factor).mean(0)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model, transforms.clip_norm(0.3))
        for x, target in batches:
            run_pergrad(psm, x, target)
        for name, p in model.named_parameters():
            assert_close(p.grad, expected[name], name)


@pytest.mark.parametrize("detach", [False, True])
def test_output_gradients_no_one_reads_are_not_kept_to_the_end(detach: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With only the head clipped, the other layers' output gradients are not needed at the end of
    the backward: pergrad lets them go at once instead of holding every layer's ``d`` until the end. The
    first backward's check reads them all, each as its parameters' ``AccumulateGrad`` runs, and lets them go
    then. ``.grad`` stays exact on every step."""
    from pergrad._core.backward import sources

    seen: list[list[str]] = []
    init = sources.Fused.__init__

    def recording(self: sources.Fused, calls: list[sources.Call], *args: object) -> None:
        seen.append([call.layer.name for call in calls])
        init(self, calls, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sources.Fused, "__init__", recording)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    psm = PerSampleModule(model, keep_grad_sample=False, detach_transformed=detach)
    psm.register_transform("4", transforms.clip_norm(0.2))
    steps: list[list[list[str]]] = []
    for step, b in enumerate([4, 6, 3]):
        seen.clear()
        x, y = torch.randn(b, 5, dtype=torch.float64), torch.randint(0, 3, (b,))
        ref = reference_grad_sample(model, x, y, loss=nn.functional.cross_entropy)
        psm.zero_grad()
        nn.functional.cross_entropy(psm(x), y).backward()
        norms = ref["4.weight"].flatten(1).square().sum(1) + ref["4.bias"].square().sum(1)  # squared
        factors = (0.2 / norms.sqrt()).clamp(max=1.0)
        for name, p in model.named_parameters():
            g = ref[name] * factors.view(-1, *[1] * (ref[name].dim() - 1)) if name.startswith("4.") else ref[name]
            assert_close(p.grad, g.mean(0), f"step {step}: .grad of {name}")
        steps.append(list(seen))
    assert steps[0][-1] == ["4"]  # the end of the first backward: only what a consumer reads
    assert {name for calls in steps[0][:-1] for name in calls} == {"4", "2", "0"}  # its check read every layer
    assert steps[1:] == [[["4"]], [["4"]]]
