"""The DP examples: the accountant of dp_sgd.py."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rdp_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    """dp_accounting called directly, as its documentation does it."""
    dp_accounting = pytest.importorskip("dp_accounting")
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def gaussian_mechanism_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of ONE Gaussian mechanism (sensitivity 1, noise sigma), no sampling.

    Balle & Wang (2018), Theorem 8: delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma).
    """
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma) - delta

    return float(brentq(excess, 0.0, 100.0))


@pytest.mark.parametrize("name", ["dp_sgd"])
def test_epsilon_falls_as_sigma_grows(name: str) -> None:
    pytest.importorskip("dp_accounting")
    epsilon = load(name).epsilon
    values = [epsilon(sigma, 0.05, 60, 1e-5) for sigma in (0.7, 1.0, 2.0, 4.0)]
    assert all(0 < v < math.inf for v in values)
    assert all(a > b for a, b in itertools.pairwise(values))
    assert epsilon(0.0, 0.05, 60, 1e-5) == math.inf  # no noise, no privacy
    assert epsilon(1.0, 0.05, 60, 1e-5) == pytest.approx(rdp_epsilon(1.0, 0.05, 60, 1e-5), rel=1e-9)


@pytest.mark.parametrize("name", ["dp_sgd"])
@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_epsilon_of_one_unsampled_step_is_the_gaussian_mechanisms(name: str, sigma: float) -> None:
    """An independent check of the event the examples build: rate 1, one step is one Gaussian mechanism."""
    pytest.importorskip("dp_accounting")
    epsilon = load(name).epsilon
    exact = gaussian_mechanism_epsilon(sigma, 1e-5)
    assert epsilon(sigma, 1.0, 1, 1e-5, "pld") == pytest.approx(exact, rel=0.02)  # PLD is tight
    assert exact <= epsilon(sigma, 1.0, 1, 1e-5, "rdp") < 1.5 * exact  # RDP is an upper bound


def test_dp_sgd_reports_what_dp_accounting_says() -> None:
    pytest.importorskip("dp_accounting")
    example = load("dp_sgd")
    result = example.main(["--epochs", "1", "--sigma", "1.0"])
    assert result["steps"] == 20  # 1 epoch of int(1 / 0.05) steps
    assert result["epsilon"] == pytest.approx(rdp_epsilon(1.0, 0.05, 20, 1e-5), rel=1e-9)
    more_noise = example.main(["--epochs", "1", "--sigma", "2.0", "--delta", "1e-6"])
    assert more_noise["epsilon"] == pytest.approx(rdp_epsilon(2.0, 0.05, 20, 1e-6), rel=1e-9)
    assert result["accuracy"] > 0.7  # chance is 1/3


def test_dp_sgd_trains_without_dp_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting raises ModuleNotFoundError
    result = load("dp_sgd").main(["--epochs", "1"])
    assert math.isnan(result["epsilon"]) and result["accuracy"] > 0.7
