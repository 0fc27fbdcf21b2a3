"""``track_statistics={names}``: only the statistics asked for are computed, each exact on every step
of a loop, the others raise when read, and the cheap ones cost no matrix work beyond the backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import pergrad
from pergrad import PerSampleModule, StatisticNotTrackedError
from pergrad.statistics import NAMES, requested
from tests.reference import assert_close, reference_grad_sample, run_pergrad
from tests.test_fused import expected_statistics, model_and_batch, spy_registry
from tests.test_rules import families

SUBSETS = [
    {"trace_variance"},
    {"norm_test", "cabs_batch_size"},
    {"inner_product_test"},
    {"orthogonality_test", "trace_variance"},
    {"second_moment"},
    {"snr", "inner_product_test"},
]


def check_subset(stats: pergrad.statistics.Statistics, ref: dict[str, torch.Tensor], names: set[str]) -> None:
    """The statistics every subset gets are exact; the others are exact where asked for, else raise."""
    expected = expected_statistics(ref)
    flat = torch.cat([g.flatten(1) for g in ref.values()], 1)
    assert_close(stats.sq_norms, flat.square().sum(1), "sq_norms")
    torch.testing.assert_close(stats.trace_variance, expected["trace_variance"], rtol=1e-7, atol=1e-9)
    for name, g in ref.items():
        assert_close(stats.params[name].mean, g.mean(0), f"mean {name}")
    if names & {"second_moment", "variance", "snr"}:
        for name, g in ref.items():
            assert_close(stats.params[name].second_moment, g.square().mean(0), f"second moment {name}")
            assert_close(stats.params[name].variance, g.square().mean(0) - g.mean(0).square(), f"variance {name}")
    else:
        with pytest.raises(
            StatisticNotTrackedError, match=r"statistics\(\)\.params\[\.\.\.\]\.second_moment was not computed"
        ):
            _ = next(iter(stats.params.values())).variance
    mean_sq = torch.cat([g.mean(0).flatten() for g in ref.values()]).square().sum()
    meaningful = mean_sq > 1e-20 * flat.square().sum(1).mean()  # else the tests divide by round-off
    if meaningful:
        torch.testing.assert_close(stats.norm_test.square(), expected["norm_test"].square(), rtol=1e-7, atol=1e-9)
    if names & {"inner_product_test", "orthogonality_test"}:
        if meaningful:
            for key in ("inner_product_test", "orthogonality_test"):
                torch.testing.assert_close(getattr(stats, key).square(), expected[key].square(), rtol=1e-7, atol=1e-9)
    else:
        with pytest.raises(
            StatisticNotTrackedError, match=r"inner_product_test was not computed.*track_statistics=True"
        ):
            _ = stats.inner_product_test


@pytest.mark.parametrize("family", sorted(families))
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), names=st.sampled_from(SUBSETS), keep=st.booleans())
def test_each_subset_is_exact_on_every_step(
    family: str, data: st.DataObject, seed: int, names: set[str], keep: bool
) -> None:
    """Three steps (the first verifies; weights may run detached from the second), each checked."""
    torch.manual_seed(seed)
    layer, shape = data.draw(families[family])
    model, _, _ = model_and_batch(layer, shape, seed)
    with PerSampleModule(model, keep_grad_sample=keep, track_statistics=names) as psm:
        for step in range(3):
            _, x, target = model_and_batch(layer, (max(2, shape[0] + step - 1), *shape[1:]), seed + step)
            ref = reference_grad_sample(model, x, target)
            psm.zero_grad()
            run_pergrad(psm, x, target)
            check_subset(psm.statistics(), ref, names)


def test_trace_variance_alone_costs_no_matrix_work() -> None:
    """On an mlp the per-sample norms and the means come with the backward (outer-product norms,
    autograd's mean): ``{"trace_variance"}`` counts exactly the plain step's matrix FLOPs, where
    every statistic (second moments, inner products with the mean) counts more."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 30), nn.ReLU(), nn.Linear(30, 4))
    x, y = torch.randn(16, 20), torch.randn(16, 4)

    def counted(step: object) -> int:
        for _ in range(2):  # the first backward verifies; the shortcuts start after it
            step()  # type: ignore[operator]
        with FlopCounterMode(display=False) as counter:
            step()  # type: ignore[operator]
        return counter.get_total_flops()

    def plain() -> None:
        model.zero_grad()
        ((model(x) - y) ** 2).sum().backward()

    base = counted(plain)
    for names, more in (
        (True, True),
        ({"second_moment"}, True),
        ({"inner_product_test"}, True),
        ({"trace_variance"}, False),
    ):
        with PerSampleModule(model, keep_grad_sample=False, track_statistics=names) as psm:

            def step(psm: PerSampleModule = psm) -> None:
                psm.zero_grad()
                ((psm(x) - y) ** 2).sum().backward()
                psm.statistics()

            assert (counted(step) > base) if more else (counted(step) == base), names


@pytest.mark.parametrize("shape", [(6, 8), (6, 2, 8), (6, 40, 8)], ids=["2d", "gram", "outer"])
def test_statistics_without_second_moments_never_build(shape: tuple[int, ...]) -> None:
    """Only the elementwise second moment of a layer at many positions builds ``g_i``."""
    model = nn.Sequential(nn.Linear(8, 9), nn.ReLU(), nn.Linear(9, 3)).double()
    x, target = torch.randn(shape, dtype=torch.float64), torch.randn(*shape[:-1], 3, dtype=torch.float64)
    ref = reference_grad_sample(model, x, target)
    for names in ({"trace_variance"}, {"inner_product_test", "norm_test"}):
        calls: list[str] = []
        with PerSampleModule(model, keep_grad_sample=False, track_statistics=names, rules=spy_registry(calls)) as psm:
            for _ in range(2):
                psm.zero_grad()
                run_pergrad(psm, x, target)
                check_subset(psm.statistics(), ref, names)
        assert calls == [], names


def test_names_are_checked() -> None:
    assert requested(True) == frozenset(NAMES) and requested(False) == frozenset()
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"unknown statistic\(s\) \['trace'\]; choose from \['mean'"):
        PerSampleModule(model, track_statistics={"trace"})
    with pytest.raises(TypeError, match=r"True or a collection of names, e.g. \{'snr'\}"):
        PerSampleModule(model, track_statistics="snr")
    with PerSampleModule(model, keep_grad_sample=False, track_statistics=[]) as psm:
        psm(torch.randn(4, 3)).sum().backward()
        with pytest.raises(pergrad.PergradError, match=r"run a backward first|grad_sample"):
            psm.statistics()
