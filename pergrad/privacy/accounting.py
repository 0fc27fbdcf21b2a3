"""The privacy spent: Google's ``dp_accounting`` on DP-SGD's Poisson-sampled Gaussian steps
(``pip install 'pergrad[dp]'``, or in a clone ``pip install -e '.[dp]'``; imported only when called)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ModuleNotFoundError as err:
        if err.name != "dp_accounting":
            raise
        raise ModuleNotFoundError(
            "pergrad.privacy's accountant is Google's dp_accounting: pip install 'pergrad[dp]' "
            "(in a clone of pergrad: pip install -e '.[dp]')",
            name="dp_accounting",
        ) from err
    return dp_accounting


class _OrderLeftOut(logging.Filter):
    """Drops the warning ``dp_accounting``'s RDP accountant logs (through absl) for each fractional order whose
    series does not converge (``_compute_log_a_frac failed to converge ... Excluding this order``): that order is
    left out of the minimum over orders, so the epsilon stays an upper bound, only a looser one, and the line says
    nothing a user can act on. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("failed to converge" in message and "Excluding this order" in message)


@contextlib.contextmanager
def _orders_left_out_quietly() -> Iterator[None]:
    """``_OrderLeftOut`` on absl's logger while pergrad calls the accountant."""
    logger, quiet = logging.getLogger("absl"), _OrderLeftOut()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _event(dp_accounting: Any, noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def _accountant(dp_accounting: Any, accountant: str) -> Any:
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _check_accounting(sample_rate: float, steps: int, delta: float) -> None:
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def epsilon_of(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """The epsilon at ``delta`` of ``steps`` DP-SGD steps: ``steps`` compositions of a Poisson-sampled
    (rate ``sample_rate``) Gaussian mechanism with noise multiplier ``noise_multiplier`` (noise std over
    sensitivity), add-or-remove-one neighbours, from Google's ``dp_accounting``: its RDP accountant
    (``"rdp"``) or its tighter, slower privacy-loss-distribution accountant (``"pld"``). 0 for no
    step, ``inf`` for no noise."""
    _check_accounting(sample_rate, steps, delta)
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
    dp_accounting = _dp_accounting()
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = _event(dp_accounting, noise_multiplier, sample_rate, steps)
    with _orders_left_out_quietly():
        return float(_accountant(dp_accounting, accountant).compose(event).get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier whose ``steps`` DP-SGD steps at ``sample_rate`` spend at most
    ``target_epsilon`` at ``delta`` (``epsilon_of`` of it is <= ``target_epsilon``; found by
    ``dp_accounting.calibrate_dp_mechanism`` to 1e-6)."""
    _check_accounting(sample_rate, steps, delta)
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    if steps == 0:
        return 0.0
    dp_accounting = _dp_accounting()
    with _orders_left_out_quietly():
        sigma = dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(dp_accounting, accountant),
            lambda s: _event(dp_accounting, s, sample_rate, steps),
            target_epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
        )
    return float(sigma)
