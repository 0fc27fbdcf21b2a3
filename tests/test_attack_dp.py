"""Adversarial cases against pergrad.privacy (DP-SGD), written as users write their loops.

Each case is a test: it passes where the DP layer is exact (every step against an independent reference: the
clipped sum computed one sample at a time by plain autograd on a float64 copy of the model) or refuses with an
error naming the cause; it fails where a step got through un-noised, doubly clipped or unaccounted, or where
the privacy reported is not the privacy the training got. The failure message says what happened and how large
the error is.
"""

from __future__ import annotations

import copy
import math
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from pergrad import PergradError, PerSampleModule
from pergrad.privacy import DPSGD, PoissonBatchSampler, collate_with_empty, epsilon_of, make_private
from pergrad.privacy.errors import PrivacyError
from tests.test_distributed import Pool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _torch_seed_of_its_own() -> None:
    """torch's global seed, set apart from the small seeds the samplers here take: a sampler seeded like
    torch's default generator is refused, and which seed an earlier test left must not decide a test."""
    torch.manual_seed(987654321)


N = 24
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))
C = 1.5  # per-sample norms here are 1.26 to 2.48: the clipping bites on some samples only
Q = 0.25
EB = Q * N  # the expected batch size, 6
REFUSED = (PrivacyError, PergradError)


def make_model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(987654321)  # (not a seed the samplers here use: a sampler seeded like torch is refused)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def seeded(seed: int = 1, q: float = Q, steps: int = 6, **kwargs: Any) -> PoissonBatchSampler:
    return PoissonBatchSampler(N, q, steps=steps, generator=torch.Generator().manual_seed(seed), **kwargs)


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def loop_clipped_sum(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    bound: float = C,
    loss: Callable[[Tensor, Tensor], Tensor] = ce,
) -> tuple[dict[str, Tensor], list[float]]:
    """``sum_i clip_C(g_i)`` over the rows of ``x``, one sample at a time, plain autograd on a float64 copy of
    ``model`` (its trainable parameters; the norm over all of them together), and every sample's norm."""
    ref = copy.deepcopy(model).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(x.shape[0]):
        out = ref(x[i : i + 1].double())
        grads = torch.autograd.grad(loss(out, y[i : i + 1]), list(params.values()))
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
        norms.append(norm)
        factor = min(1.0, bound / norm)
        for n, g in zip(params, grads, strict=True):
            total[n] += g * factor
    return total, norms


def max_error(model: nn.Module, expected: dict[str, Tensor], scale: float = EB) -> float:
    """The largest deviation of ``.grad`` from ``expected / scale`` over the trainable parameters."""
    worst = 0.0
    for n, p in model.named_parameters():
        if p.requires_grad:
            got = torch.zeros_like(p) if p.grad is None else p.grad
            worst = max(worst, float((got.double() - expected[n].double() / scale).abs().max()))
    return worst


def flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.detach().double().flatten() for p in model.parameters() if p.grad is not None])


def _auc(scores: Tensor, members: Tensor) -> float:
    ranks = scores.argsort().argsort().double() + 1
    n1, n0 = int(members.sum()), int((~members).sum())
    return float((ranks[members].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


# == 1. dtype moves after wrapping ===================================================================


def test_double_after_wrapping_every_step_exact() -> None:
    """A float32 model wrapped and given a DPSGD, then ``model.double()`` (a notebook cell later): every step
    is the clipped sum over the draw / E[B] in float64, and the noise is float64 with std sigma C / E[B]."""
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    batches = seeded(3, steps=5)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    model.double()
    sizes = []
    for step, rows in enumerate(batches):
        sizes.append(len(rows))
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        ce(psm(X[rows]), Y[rows]).backward()
        dp.add_noise()
        assert all(p.grad is None or p.grad.dtype == torch.float64 for p in model.parameters())
        assert max_error(model, expected) < 1e-12, f"step {step}: .grad off by {max_error(model, expected):.3g}"
        opt.step()
        opt.zero_grad()
    assert dp.steps == 5 and max(sizes) > 1
    dp.remove()
    psm.remove()


# == 2. steps that get through without the noise ======================================================


def test_manual_parameter_update_without_optimizer_step_is_refused() -> None:
    """Forgotten noise: a notebook loop that updates the parameters by hand (``p -= lr * p.grad``) instead of
    ``optimizer.step()``. No noise goes in, no step is counted, ``epsilon()`` says 0: must be refused."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(REFUSED):
        for rows in batches:
            ce(psm(X[rows]), Y[rows]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
            model.zero_grad()
        moved = max(float((p - s).abs().max()) for p, s in zip(model.parameters(), start))
        raise AssertionError(
            f"6 un-noised updates went through (the parameters moved by up to {moved:.3g}); dp.steps = {dp.steps}, "
            f"dp.epsilon(1e-5) = {dp.epsilon(1e-5)}"
        )
    dp.remove()
    psm.remove()


def test_optimizer_recreated_after_dpsgd_is_refused() -> None:
    """A notebook re-runs the optimizer cell (``optimizer = Adam(model.parameters())``) after DPSGD was made:
    the new optimizer is not hooked. Its steps must not go through un-noised."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(REFUSED):
        for rows in batches:
            ce(psm(X[rows]), Y[rows]).backward()
            opt.step()
            opt.zero_grad()
        raise AssertionError(f"6 Adam steps on un-noised clipped sums; dp.steps = {dp.steps}, epsilon 0")
    dp.remove()
    psm.remove()


def test_second_optimizer_stepping_before_the_noise_is_refused() -> None:
    """Two optimizers for one model (body with one learning rate, head with another: a common recipe), DPSGD on
    the body's. The head's optimizer steps first: it moves the head with the clipped sum WITHOUT the noise (the
    noise only goes in at the body's step)."""
    model, shadow = make_model(), make_model()
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=1.0)
    batches = seeded(4, steps=4)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, body, batches, max_grad_norm=C, noise_multiplier=5.0)
    try:
        for rows in batches:
            expected, _ = loop_clipped_sum(shadow, X[rows], Y[rows])
            before = model[2].weight.detach().clone()
            ce(psm(X[rows]), Y[rows]).backward()
            head.step()  # before the noise
            moved = (before - model[2].weight.detach()) / 1.0
            error = float((moved - expected["2.weight"] / EB).abs().max())
            body.step()
            body.zero_grad()
            head.zero_grad()
            with torch.no_grad():
                shadow.load_state_dict(model.state_dict())
            assert error > 1e-3, (
                f"the head was stepped with the noiseless clipped sum (equal to it within {error:.2g}; the noise "
                f"std is {5.0 * C / EB:.2g}); {dp.steps} steps counted as private"
            )
    except REFUSED:
        pass
    finally:
        dp.remove()
        psm.remove()


def test_lbfgs_every_gradient_evaluation_is_noised_or_refused() -> None:
    """LBFGS(max_iter=4) calls the closure (a forward and backward of the batch) up to 5 times per step; the
    noise goes in after the first call only. Every later evaluation's .grad is the noiseless clipped sum, and
    LBFGS moves the parameters with it. Must be refused (or every evaluation noised and counted)."""
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    batches = seeded(1, steps=3)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    firsts: list[bool] = []  # per closure call: the step's first (noised after it) or a re-evaluation
    exact: list[bool] = []  # .grad at the end of the call equals the noiseless clipped sum / E[B]
    try:
        for rows in batches:
            calls = [0]

            def closure(rows: list[int] = rows, calls: list[int] = calls) -> Tensor:
                opt.zero_grad()
                loss = ce(psm(X[rows]), Y[rows])
                loss.backward()
                expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
                firsts.append(calls[0] == 0)
                calls[0] += 1
                exact.append(max_error(model, expected) < 1e-12)
                return loss

            opt.step(closure)
    except REFUSED:
        return
    finally:
        dp.remove()
        psm.remove()
    later = [e for f, e in zip(firsts, exact, strict=True) if not f]
    raise AssertionError(
        f"not refused: {len(firsts)} gradient evaluations in {dp.steps} counted steps; LBFGS moved with "
        f"{len(later)} re-evaluations after the noise, {sum(later)} of them exactly the noiseless clipped sum "
        "(within 1e-12)"
    )


def test_backward_after_add_noise_is_refused() -> None:
    """``dp.add_noise()`` early (to log ``.grad``), then one more backward before ``optimizer.step()``: the
    step's update holds a second, noiseless clipped sum of the same draw (sensitivity 2C, half of it
    noiseless). Must be refused."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1, steps=3)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    try:
        with pytest.raises(REFUSED):
            for rows in batches:
                ce(psm(X[rows]), Y[rows]).backward()
                dp.add_noise()
                ce(psm(X[rows]), Y[rows]).backward()  # the same draw again, after the noise
                opt.step()
                opt.zero_grad()
            raise AssertionError(f"3 steps each with a second noiseless backward of its draw; dp.steps = {dp.steps}")
    finally:
        dp.remove()
        psm.remove()


# == 3. the sampling the accountant assumes ===========================================================


def test_sampler_rate_changed_after_dpsgd_is_refused() -> None:
    """``sampler.sample_rate`` raised after DPSGD was made (a batch-size schedule, a notebook tweak): the
    batches are drawn at 0.9 while the accountant counts 0.25. Must be refused."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    batches.sample_rate = 0.9
    sizes = []
    try:
        with pytest.raises(REFUSED):
            for rows in batches:
                sizes.append(len(rows))
                ce(psm(X[rows]), Y[rows]).backward()
                opt.step()
                opt.zero_grad()
            raise AssertionError(
                f"batches of {sizes} (rate 0.9: mean {0.9 * N:.1f}) trained, accounted at q = {dp.sample_rate}: "
                f"epsilon reported {dp.epsilon(1e-5):.3g}, at the rate drawn {epsilon_of(1.0, 0.9, dp.steps, 1e-5):.3g}"
            )
    finally:
        dp.remove()
        psm.remove()


def _equal_share_seed() -> int:
    """A seed whose first two draws have the same, non-zero size."""
    for seed in range(1000):
        sizes = [len(b) for b in seeded(seed, steps=3)]
        if sizes[0] == sizes[1] > 0:
            return seed
    raise AssertionError("no seed")


def test_prefetching_loader_same_draw_twice_is_refused() -> None:
    """A loop that takes two optimizer steps on each batch (local steps), with ``num_workers=1``: the loader has
    drawn the next draws ahead, so a share is waiting when the second step on the SAME batch checks its count.
    Where the next draw has the same size, the second step passes: one draw trained in two steps, accounted as
    two independent Poisson draws."""
    seed = _equal_share_seed()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(seed, steps=3)
    data = TensorDataset(X, Y)
    loader = DataLoader(data, batch_sampler=batches, collate_fn=collate_with_empty(data), num_workers=1)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    try:
        with pytest.raises(REFUSED):
            for x, y in loader:
                for _ in range(2):
                    ce(psm(x), y).backward()
                    opt.step()
                    opt.zero_grad()
                break
            raise AssertionError(f"one draw of {len(x)} samples trained in 2 steps; {dp.steps} steps accounted")
    finally:
        dp.remove()
        psm.remove()


def test_hand_accumulation_of_two_draws_is_refused() -> None:
    """Gradient accumulation by hand over a sampler of ``micro_batches=1``: two draws per optimizer step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(2, steps=6)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    try:
        with pytest.raises(PrivacyError, match=r"one optimizer step per draw"):
            for k, rows in enumerate(batches):
                (ce(psm(X[rows]), Y[rows]) / 2).backward()
                if k % 2 == 1:
                    opt.step()
                    opt.zero_grad()
    finally:
        dp.remove()
        psm.remove()


def test_shared_sampler_between_two_dpsgds_names_the_cause() -> None:
    """Two models trained on the same Poisson batches (an ensemble), each with its DPSGD, one sampler. The second
    DPSGD finds no draw waiting (the first took it). A refusal is right; its message must name the cause (the
    sampler feeds two DPSGDs), not tell the user to use the loader they already use."""
    a, b = make_model(), make_model()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    batches = seeded(1, steps=3)
    psm_a, psm_b = PerSampleModule(a, keep_grad_sample=False), PerSampleModule(b, keep_grad_sample=False)
    dp_a = DPSGD(psm_a, opt_a, batches, max_grad_norm=C, noise_multiplier=1.0)
    try:
        dp_b = DPSGD(psm_b, opt_b, batches, max_grad_norm=C, noise_multiplier=1.0)
    except REFUSED as err:
        assert re.search(r"another DPSGD|two DPSGD|already", str(err)), str(err)
        return
    try:
        with pytest.raises(REFUSED) as info:
            for rows in batches:
                ce(psm_a(X[rows]), Y[rows]).backward()
                ce(psm_b(X[rows]), Y[rows]).backward()
                opt_a.step()
                opt_b.step()
                opt_a.zero_grad()
                opt_b.zero_grad()
        message = str(info.value)
        assert re.search(r"another DPSGD|two DPSGD|shared|already", message), (
            f"the refusal names another cause: {message}"
        )
    finally:
        dp_a.remove()
        dp_b.remove()
        psm_a.remove()
        psm_b.remove()


def test_gan_discriminator_with_fake_batches_names_the_cause() -> None:
    """DP-GAN as in Opacus's example: a private discriminator D (DPSGD on its optimizer) trained on a real
    Poisson batch and a fake batch, and G trained through D. The fake batch's samples are clipped along (no
    private data in them). Exact, or refused with a message that names the real cause (a backward of samples
    that are not from the draw) and a fix that works."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    gen = nn.Sequential(nn.Linear(2, 4)).double()
    opt_d, opt_g = torch.optim.SGD(disc.parameters(), lr=0.1), torch.optim.SGD(gen.parameters(), lr=0.1)
    batches = seeded(1, steps=3)
    psm = PerSampleModule(disc, keep_grad_sample=False)
    dp = DPSGD(psm, opt_d, batches, max_grad_norm=C, noise_multiplier=1.0)
    try:
        with pytest.raises(REFUSED) as info:
            for rows in batches:
                ones = torch.ones(len(rows), 1, dtype=torch.float64)
                opt_d.zero_grad()
                fake = gen(torch.randn(len(rows), 2, dtype=torch.float64)).detach()
                F.binary_cross_entropy_with_logits(psm(X[rows]), ones).backward()
                F.binary_cross_entropy_with_logits(psm(fake), 0 * ones).backward()
                opt_d.step()
                opt_g.zero_grad()
                F.binary_cross_entropy_with_logits(
                    psm(gen(torch.randn(len(rows), 2, dtype=torch.float64))), ones
                ).backward()
                opt_g.step()
        message = str(info.value)
        assert re.search(r"stand_in|not from the draw|not drawn|generated|fake|other samples", message), (
            f"refused, but the message names another cause and a fix that does not apply: {message[:300]}"
        )
    finally:
        dp.remove()
        psm.remove()


def test_two_models_two_dpsgds_independent_noise() -> None:
    """Two models, each with its own sampler and DPSGD (entropy-seeded): their noises are independent of each
    other (correlation within 7 standard errors of 0 over 40 steps x 51 coordinates: a false alarm 3e-12; 5
    of them were 5.7e-7; 500 runs with 1 and 2 threads: worst 3.2 of them) and every step
    counted. (The same generator twice gives a correlation of 1.)"""
    runs = []
    for _ in range(2):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        batches = PoissonBatchSampler(N, 0.02, steps=40)  # mostly empty draws: the noise alone
        with PerSampleModule(model, keep_grad_sample=False) as psm:
            dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
            noise = []
            for rows in batches:
                if rows:
                    ce(psm(X[rows]), Y[rows]).backward()
                before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
                dp.add_noise()
                noise.append(torch.cat([(p.grad - b).flatten() for p, b in zip(model.parameters(), before)]))  # type: ignore[operator]
                opt.step()
                opt.zero_grad()
            assert dp.steps == 40
            dp.remove()
        runs.append(torch.cat(noise))
    a, b = runs
    rho = float((a @ b) / (a.norm() * b.norm()))
    assert abs(rho) < 7 / math.sqrt(a.numel()), rho


# == 4. randomness: independent of the batch choice and of any seed of the user's =====================


def test_unseeded_generator_has_a_public_seed_and_is_refused() -> None:
    """``torch.Generator()`` without ``manual_seed`` has torch's fixed default seed 67280421310721, the same in
    every process: noise or batches drawn from it are public. After ``torch.manual_seed(42)`` (any script),
    DPSGD takes it for the noise and PoissonBatchSampler for the batches."""
    torch.manual_seed(42)
    public = torch.Generator().initial_seed()
    problems = []
    model = make_model()  # (seeds torch with 0: torch.initial_seed() is 0 from here)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        try:
            dp = DPSGD(
                psm, opt, PoissonBatchSampler(N, Q), max_grad_norm=C, noise_multiplier=1.0, generator=torch.Generator()
            )
            problems.append(f"DPSGD noise from torch.Generator() (seed {public}) accepted")
            dp.remove()
        except REFUSED:
            pass
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        try:
            batches = PoissonBatchSampler(N, Q, generator=torch.Generator())
            dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
            replay = torch.rand(N, generator=torch.Generator(), dtype=torch.float64) < Q
            drawn = next(iter(batches))
            if drawn == replay.nonzero().flatten().tolist():
                problems.append(f"sampler on torch.Generator() accepted: anyone replays its batches ({drawn})")
            dp.remove()
        except REFUSED:
            pass
    assert not problems, "; ".join(problems)


def test_sampler_on_torch_default_generator_is_refused() -> None:
    """``PoissonBatchSampler(generator=torch.default_generator)``: the batches follow ``torch.manual_seed`` (a
    public seed) and every other random op of the script. DPSGD refuses that generator for its noise; for the
    batches it must refuse it too."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        try:
            batches = PoissonBatchSampler(N, Q, generator=torch.default_generator)
            dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
        except REFUSED:
            return
        torch.manual_seed(123)
        drawn = next(iter(batches))
        torch.manual_seed(123)
        replay = (torch.rand(N, dtype=torch.float64) < Q).nonzero().flatten().tolist()
        dp.remove()
        assert drawn != replay, f"the batch {drawn} is replayed from torch.manual_seed(123)"


def test_secure_mode_noise_is_independent_of_the_draw() -> None:
    """Secure mode: e_i (a one-hot Linear of 2000 inputs, C = 1, not clipped), ``E[B] .grad[i] = 1{i drawn} +
    sigma z_i``; the AUC of ``-|z_i|`` telling drawn samples from the others is at chance (4 steps x 2000, AUC std
    about 0.011: within 0.075, 6.6 of them at the fewest drawn samples seen, a false alarm under 1e-10), and the
    std of z is sigma within 7 standard errors (3e-12). Were 0.06 and 5 of them: 2.5e-8 and 5.7e-7 a run. 500
    runs with 1 and 2 threads: AUC 0.471 to 0.529, median 0.500; std worst 3.0 standard errors."""
    n, q = 2000, 0.1
    scores, members, zs = [], [], []
    for _ in range(4):
        model = nn.Linear(n, 1, bias=False).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        batches = PoissonBatchSampler(n, q, steps=1, secure_mode=True)
        with PerSampleModule(model, loss_reduction="sum", reduction="sum", keep_grad_sample=False) as psm:
            dp = DPSGD(psm, opt, batches, max_grad_norm=1.0, noise_multiplier=1.0)
            (rows,) = list(batches)
            psm(torch.eye(n, dtype=torch.float64)[rows]).sum().backward()
            dp.add_noise()
            assert model.weight.grad is not None
            drawn = torch.zeros(n, dtype=torch.bool)
            drawn[rows] = True
            z = model.weight.grad[0] * (q * n) - drawn.double()
            zs.append(z)
            scores.append(-z.abs())
            members.append(drawn)
            dp.remove()
    assert abs(_auc(torch.cat(scores), torch.cat(members)) - 0.5) < 0.075
    z = torch.cat(zs)
    assert abs(float(z.std()) - 1) < 7 / math.sqrt(2 * z.numel())


# == 5. what a checkpoint leaks =====================================================================


def test_pickled_model_carries_no_per_sample_gradients() -> None:
    """``torch.save(model)`` / ``copy.deepcopy(model)`` (EMA, ``AveragedModel``) after a DP-SGD step with the
    wrapper's default ``keep_grad_sample=True``: the checkpoint must not hold any sample's own gradient (raw,
    unclipped, noiseless: each training sample's gradient in the clear)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1, steps=2)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    rows = next(iter(batches))
    ce(psm(X[rows]), Y[rows]).backward()
    opt.step()
    saved = pickle.loads(pickle.dumps(model))
    dp.remove()
    psm.remove()
    leaked = {n: tuple(p.grad_sample.shape) for n, p in saved.named_parameters() if hasattr(p, "grad_sample")}
    assert not leaked, f"the pickled model holds per-sample gradients of the {len(rows)} samples of the step: {leaked}"


def test_pickled_model_per_sample_gradients_are_the_raw_ones() -> None:
    """Companion of the previous case, measuring the leak: the pickled ``grad_sample`` is each sample's own
    UNclipped gradient (equal to the one-sample autograd loop to 1e-12), whatever C."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1, steps=2)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=0.01, noise_multiplier=1.0)
    rows = next(iter(batches))
    reference = copy.deepcopy(model)
    ce(psm(X[rows]), Y[rows]).backward()
    opt.step()
    saved = pickle.loads(pickle.dumps(model))
    dp.remove()
    psm.remove()
    if not hasattr(saved[0].weight, "grad_sample"):
        return
    i = rows[0]
    (raw,) = torch.autograd.grad(ce(reference(X[i : i + 1]), Y[i : i + 1]), [reference[0].weight])
    leaked = saved[0].weight.grad_sample[0]
    assert not torch.allclose(leaked, raw, atol=1e-12), (
        f"sample {i}'s raw gradient (norm {float(raw.norm()):.3g}, C = 0.01) is in the pickled model"
    )


# == 6. exact cases: eval batches, zero_grad, unfreezing, schedulers, layers =============================


def test_eval_batches_between_forward_and_backward_exact() -> None:
    """Eval batches in the middle of the loop: a validation forward under no_grad between the training forward
    and its backward, and one with gradients on (no backward) between steps. Every step exact; steps counted."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    batches = seeded(5, steps=5)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    for step, rows in enumerate(batches):
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        out = psm(X[rows])
        with torch.no_grad():
            psm(X[:7])  # validation in between
        ce(out, Y[rows]).backward()
        dp.add_noise()
        assert max_error(model, expected) < 1e-12, f"step {step}: off by {max_error(model, expected):.3g}"
        opt.step()
        opt.zero_grad()
        psm(X[10:13]).sum()  # a forward with gradients on, no backward (a metric computed carelessly)
    assert dp.steps == 5
    dp.remove()
    psm.remove()


def test_zero_grad_set_to_none_false_exact() -> None:
    """``zero_grad(set_to_none=False)``: .grad stays allocated as zeros; every step (an empty draw included)
    exact and noised once."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    batches = seeded(0, q=0.1, steps=8)  # sizes [0, 2, 2, 2, 1, 4, 2, 2]
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    sizes = []
    for step, rows in enumerate(batches):
        sizes.append(len(rows))
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        ce(psm(X[rows]), Y[rows]).backward()
        dp.add_noise()
        assert max_error(model, expected, Q * 0 + 0.1 * N) < 1e-12, f"step {step}"
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert 0 in sizes and max(sizes) > 1, sizes
    dp.remove()
    psm.remove()


def test_unfrozen_layer_param_group_added_later_and_scheduler_exact() -> None:
    """Fine-tuning as users do it: the first layer frozen at the start (the optimizer over the head, a StepLR),
    unfrozen after 2 steps and added as a new param group. From then on the flat clipping covers both layers:
    every step exact against the one-sample loop over the trainable parameters of that step."""
    model = make_model()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    batches = seeded(6, steps=6)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    for step, rows in enumerate(batches):
        if step == 2:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.1})
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        ce(psm(X[rows]), Y[rows]).backward()
        dp.add_noise()
        assert max_error(model, expected) < 1e-12, f"step {step}: off by {max_error(model, expected):.3g}"
        opt.step()
        sched.step()
        opt.zero_grad()
    assert dp.steps == 6
    dp.remove()
    psm.remove()


def test_regulariser_on_a_clipped_parameter_is_refused_later_too() -> None:
    """Two plain steps, then an L2 term on a weight added to the loss (data-independent here; a data-dependent
    functional use would be unclipped): refused at that backward, .grad not half-written."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(2, steps=4)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    it = iter(batches)
    for _ in range(2):
        rows = next(it)
        ce(psm(X[rows]), Y[rows]).backward()
        opt.step()
        opt.zero_grad()
    rows = next(it)
    x = X[rows]
    with pytest.raises(REFUSED, match=r"no hooked layer's output produced"):
        (ce(psm(x), Y[rows]) + (x @ model[0].weight.T).pow(2).mean()).backward()
    dp.remove()
    psm.remove()


def test_transform_registered_after_dpsgd_and_unfreezing_outside_the_target_are_refused() -> None:
    """A second clipping registered on a layer after DPSGD (double clipping) is refused at registration; a layer
    outside ``target="0"`` unfrozen mid-training and added to the optimizer is refused at the step, before any
    parameter moves."""
    from pergrad import transforms

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(psm, opt, seeded(1), max_grad_norm=C, noise_multiplier=1.0)
        with pytest.raises(REFUSED, match=r"overlaps the whole model"):
            psm.register_transform(model[0], transforms.clip_norm(0.1))
        dp.remove()
    model = make_model()
    model[2].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    batches = seeded(1)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0, target="0")
        it = iter(batches)
        rows = next(it)
        ce(psm(X[rows]), Y[rows]).backward()
        opt.step()
        opt.zero_grad()
        model[2].requires_grad_(True)
        opt.add_param_group({"params": list(model[2].parameters())})
        rows = next(it)
        ce(psm(X[rows]), Y[rows]).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(PrivacyError, match=r"\['2.weight', '2.bias'\] are trainable too"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        dp.remove()


def test_batchnorm_in_training_mode_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(1, q=0.5, steps=2)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    rows = next(iter(batches))
    with pytest.raises(REFUSED, match=r"BatchNorm1d.*GroupNorm"):
        ce(psm(X[rows]), Y[rows]).backward()
    dp.remove()
    psm.remove()


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        seq = torch.stack([x, x.flip(-1), x.roll(1, -1)], 1)
        return self.head(self.attn(seq, seq, seq)[0].mean(1))


def test_multihead_attention_every_step_exact() -> None:
    torch.manual_seed(0)
    model = Attention().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    batches = seeded(3, steps=4)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    for step, rows in enumerate(batches):
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        ce(psm(X[rows]), Y[rows]).backward()
        dp.add_noise()
        assert max_error(model, expected) < 1e-12, f"step {step}: off by {max_error(model, expected):.3g}"
        opt.step()
        opt.zero_grad()
    dp.remove()
    psm.remove()


def test_torch_compile_of_the_wrapper_every_step_exact() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    batches = seeded(3, steps=3)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    compiled = torch.compile(psm)
    for step, rows in enumerate(batches):
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        ce(compiled(X[rows]), Y[rows]).backward()
        dp.add_noise()
        assert max_error(model, expected) < 1e-12, f"step {step}: off by {max_error(model, expected):.3g}"
        opt.step()
        opt.zero_grad()
    assert dp.steps == 3
    dp.remove()
    psm.remove()


# == 7. losses ==================================================================================


def test_sum_loss_with_loss_reduction_left_mean_is_refused_by_the_privacy_audit() -> None:
    """``F.cross_entropy(..., reduction="sum")`` with the wrapper's ``loss_reduction`` left "mean": pergrad
    cannot see the loss, takes each g_i B times too large and clips ``B g_i`` (each contribution still at most
    C: the sensitivity holds, the numbers do not). Documented, and refused at the first step by the privacy
    audit (``dp.audit``), before the parameters move."""
    from pergrad.privacy.audit import AuditError

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = seeded(7, q=0.5, steps=4)
    psm = PerSampleModule(model, keep_grad_sample=False)
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=1.0)
    audit = dp.audit(lambda m, b: F.cross_entropy(m(b[0]), b[1]), every=10)
    try:
        for rows in batches:
            assert rows
            F.cross_entropy(psm(X[rows]), Y[rows], reduction="sum").backward()
            audit.check((X[rows], Y[rows]))
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(AuditError):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            break
    finally:
        dp.remove()
        psm.remove()


def test_make_private_micro_batches_accountant_matches_dp_accounting() -> None:
    """``make_private(micro_batches=2, accountant="pld")``, the loop stops after 5 of 8 steps (early stop): the
    epsilon is dp_accounting's PLD for exactly the 5 steps taken, every step the clipped sum of both
    micro-batches of one draw."""
    import dp_accounting

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    private = make_private(
        model,
        opt,
        TensorDataset(X, Y),
        target_epsilon=4.0,
        delta=1e-5,
        epochs=2,
        max_grad_norm=C,
        expected_batch_size=6,
        micro_batches=2,
        accountant="pld",
    )
    taken = 0
    micro: list[tuple[Tensor, Tensor]] = []
    for _epoch in range(2):
        for x, y in private.loader:
            ce(private.psm(x), y).backward()
            micro.append((x, y))
            if len(micro) < 2:
                continue
            xs, ys = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
            expected, _ = loop_clipped_sum(model, xs, ys)
            assert max_error(model, expected) < 1e-12  # before the noise
            opt.step()
            opt.zero_grad()
            micro = []
            taken += 1
            if taken == 5:
                break
        if taken == 5:
            break
    assert private.dp.steps == 5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(private.noise_multiplier)), 5
    )
    direct = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    assert private.epsilon() == pytest.approx(direct, rel=1e-12)
    private.dp.remove()
    private.psm.remove()


def test_core_dpsgd_with_a_hf_models_labels_loss_is_refused() -> None:
    """A real HuggingFace GPT-2 in the user's own loop under the core DPSGD, trained on its own ``labels=``
    loss (a mean over the batch's labelled tokens), rows of different lengths padded with -100: each sample's
    share depends on the others' lengths. Refused before .grad is written."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=23, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = PoissonBatchSampler(6, 1.0, steps=2, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(3, 23, (6, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 3:] = -100
    labels[2, 5:] = -100
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        dp = DPSGD(psm, opt, batches, max_grad_norm=1.0, noise_multiplier=1.0)
        rows = next(iter(batches))
        with pytest.warns(Warning), pytest.raises(PrivacyError, match=r"labels= loss"):
            psm(input_ids=ids[rows], labels=labels[rows]).loss.backward()
        assert all(p.grad is None for p in model.parameters())
        dp.remove()


# == 8. two processes (gloo) =========================================================================


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(2, tmp_path_factory.mktemp("attack2"))
    yield pool
    pool.close()


def ddp_misconfigured_sampler(rank: int, world: int, how: str) -> dict[str, Any]:
    """DDP, sigma = 0, a sampler built without its rank: ``how == "replicas"``: ``PoissonBatchSampler(N, q)``
    (num_replicas left 1; without a generator both ranks get rank 0's seed, so the same draw); ``how ==
    "rank"``: ``num_replicas=2, rank=0`` on every rank. Returns each step's rows and .grad, or the refusal."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    psm = PerSampleModule(ddp, reduction="sum", keep_grad_sample=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    if how == "replicas":
        batches = PoissonBatchSampler(N, Q, steps=4)
    else:
        batches = PoissonBatchSampler(N, Q, steps=4, num_replicas=world, rank=0)
    steps = []
    try:
        dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
        for rows in batches:
            ce(psm(X[rows]), Y[rows]).backward()
            dp.add_noise()
            steps.append({"rows": rows, "grad": {n: p.grad.clone() for n, p in model.named_parameters()}})  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
        dp.remove()
    except PrivacyError as err:
        return {"refused": str(err)}
    finally:
        psm.remove()
    return {"steps": steps}


@pytest.mark.parametrize("how", ["replicas", "rank"])
def test_ddp_sampler_without_its_rank_is_refused(pool2: Pool, how: str) -> None:
    """Under DDP a core user builds ``PoissonBatchSampler(len(data), q)`` as in one process (or passes the same
    rank everywhere): every rank trains on the same samples, DDP sums the ranks, and each such sample is in the
    step twice (sensitivity 2C against noise calibrated for C). Must be refused."""
    ranks = pool2.run(ddp_misconfigured_sampler, how)
    if all("refused" in r for r in ranks):
        return
    reference = make_model()
    worst = 0.0
    for k, (zero, one) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"])):
        assert zero["rows"] == one["rows"]  # the same samples on both ranks
        rows = zero["rows"]
        if not rows:
            continue
        expected, _ = loop_clipped_sum(reference, X[rows], Y[rows])
        got = zero["grad"]["0.weight"]
        worst = max(worst, float(got.norm() / (expected["0.weight"] / EB).norm()))
        del k
    raise AssertionError(
        f"not refused: both ranks trained on the same draw; .grad is {worst:.3f} x the clipped sum over the draw "
        "(each sample counted once per rank: sensitivity 2C, the noise calibrated for C)"
    )


def ddp_no_sync(rank: int, world: int) -> list[dict[str, Any]]:
    """DDP, 2 micro-batches per step, the first in ``ddp.no_sync()`` (the standard DDP accumulation idiom)."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    psm = PerSampleModule(ddp, reduction="sum", keep_grad_sample=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    batches = PoissonBatchSampler(
        N, Q, steps=4, num_replicas=world, rank=rank, micro_batches=2, generator=torch.Generator().manual_seed(5)
    )
    dp = DPSGD(psm, opt, batches, max_grad_norm=C, noise_multiplier=0.0)
    out: list[dict[str, Any]] = []
    micro: list[list[int]] = []
    for rows in batches:
        micro.append(rows)
        if len(micro) == 1:
            with ddp.no_sync():
                ce(psm(X[rows]), Y[rows]).backward()
            continue
        ce(psm(X[rows]), Y[rows]).backward()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        dp.add_noise()
        out.append({"micro": micro, "params": params, "grad": {n: p.grad.clone() for n, p in model.named_parameters()}})  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        micro = []
    dp.remove()
    psm.remove()
    return out


def test_ddp_no_sync_accumulation_every_step_exact(pool2: Pool) -> None:
    ranks = pool2.run(ddp_no_sync)
    for k, (zero, one) in enumerate(zip(*ranks)):
        rows = sorted(i for r in (zero, one) for m in r["micro"] for i in m)
        model = make_model()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(zero["params"][n])
        expected, _ = loop_clipped_sum(model, X[rows], Y[rows])
        for name in expected:
            for r, record in enumerate((zero, one)):
                err = float((record["grad"][name] - expected[name] / EB).abs().max())
                assert err < 1e-12, f"step {k} rank {r} {name}: off by {err:.3g} (rows {rows})"


# == 9. Lightning ==================================================================================


def _lightning() -> Any:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    return pl


def _pl_trainer(tmp_path: Path, **kwargs: Any) -> Any:
    pl = _lightning()
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        max_epochs=1,
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def _poisson_module(optimizer: str = "sgd", skip_empty: bool = False, seed: int = 5, q: float = Q) -> Any:
    pl = _lightning()
    from pergrad.integrations.lightning import poisson_loader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.records: list[dict[str, Any]] = []
            self.micro: list[tuple[Tensor, Tensor]] = []

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
            x, y = batch
            if skip_empty and len(x) == 0:
                return None
            self.micro.append((x.clone(), y.clone()))
            return ce(self.model(x), y)

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.records.append(
                {
                    "params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                    "grad": {n: p.grad.detach().clone() for n, p in self.model.named_parameters()},  # type: ignore[union-attr]
                    "micro": self.micro,
                }
            )
            self.micro = []

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(seed)
            return poisson_loader(TensorDataset(X, Y), q, trainer=self.trainer, generator=generator)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if optimizer == "lbfgs":
                return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
            return torch.optim.SGD(self.parameters(), lr=0.3)

    return Module()


def test_lightning_lbfgs_is_exact_or_refused_naming_the_cause(tmp_path: Path) -> None:
    """``configure_optimizers`` returns LBFGS (Lightning calls it with a closure, re-evaluated within a step).
    Every evaluation after the first is a noiseless clipped sum the optimizer moves with: refused, with a
    message naming the closure's re-evaluation (not 'add_noise() called twice', which the user never did)."""
    from pergrad.integrations.lightning import DPSGD as DPSGDCallback

    net = _poisson_module("lbfgs")
    callback = DPSGDCallback("model", max_grad_norm=C, noise_multiplier=1.0, delta=1e-5)
    try:
        _pl_trainer(tmp_path, callbacks=[callback]).fit(net)
    except REFUSED as err:
        assert re.search(r"LBFGS|closure|evaluat", str(err)), f"refused with another cause: {str(err)[:250]}"
        return
    raise AssertionError(f"LBFGS under DP-SGD ran through: {callback.dp.steps if callback.dp else 0} steps")


def test_lightning_training_step_returning_none_on_an_empty_batch(tmp_path: Path) -> None:
    """``training_step`` returns None on an empty Poisson batch (Lightning then skips the step): the empty
    draw is neither noised nor counted. Exact accounting or a refusal that names the skipped step."""
    from pergrad.integrations.lightning import DPSGD as DPSGDCallback

    net = _poisson_module(skip_empty=True, seed=0, q=0.05)
    callback = DPSGDCallback("model", max_grad_norm=C, noise_multiplier=1.0, delta=1e-5)
    sizes = [len(b) for b in PoissonBatchSampler(N, 0.05, generator=torch.Generator().manual_seed(0))]
    assert 0 in sizes and max(sizes) > 0, sizes  # the first epoch's draws (the second's continue the stream)
    try:
        _pl_trainer(tmp_path, callbacks=[callback], max_epochs=2).fit(net)
    except REFUSED as err:
        assert re.search(r"None|skipped|empty", str(err)), f"refused with another cause: {str(err)[:300]}"
        return
    assert callback.dp is not None
    assert callback.dp.steps == 2 * len(sizes), (
        f"{callback.dp.steps} steps counted for 2 epochs of {len(sizes)} draws (sizes {sizes}): the empty draws' "
        "steps were skipped, unnoised and unaccounted, without an error"
    )


def test_lightning_mid_epoch_resume_continues_exactly(tmp_path: Path) -> None:
    """Seeded batches and noise, a checkpoint every 2 optimizer steps (mid-epoch: an epoch is 4 steps). A run
    resumed from the checkpoint of step 2 takes exactly the uninterrupted run's steps 3 to 8, noise included,
    and counts 8 steps."""
    pl = _lightning()
    from pergrad.integrations.lightning import DPSGD as DPSGDCallback

    def run(root: Path, ckpt: Path | None) -> tuple[Any, Any]:
        net = _poisson_module(seed=9)
        callback = DPSGDCallback(
            "model", max_grad_norm=C, noise_multiplier=1.0, delta=1e-5, generator=torch.Generator().manual_seed(77)
        )
        saver = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_train_steps=2, filename="{step}")
        fit = _pl_trainer(root, callbacks=[callback, saver], max_epochs=2, enable_checkpointing=True)
        fit.fit(net, ckpt_path=ckpt)
        return net, callback

    whole, whole_cb = run(tmp_path / "whole", None)
    resumed, resumed_cb = run(tmp_path / "resumed", tmp_path / "whole" / "step=2.ckpt")
    assert whole_cb.dp.steps == 8 and resumed_cb.dp.steps == 8, (whole_cb.dp.steps, resumed_cb.dp.steps)
    assert len(resumed.records) == 6, len(resumed.records)
    for t, (a, b) in enumerate(zip(whole.records[2:], resumed.records)):
        for n in a["grad"]:
            assert torch.equal(a["params"][n], b["params"][n]), f"step {t + 2}: parameters differ"
            assert torch.equal(a["grad"][n], b["grad"][n]), f"step {t + 2}: .grad differs"


def test_lightning_dpsgd_model_saved_mid_training_carries_no_per_sample_gradients(tmp_path: Path) -> None:
    """The Lightning DPSGD callback wraps with ``keep_grad_sample`` left True: a ``torch.save(self.model)`` (or
    a deep copy for EMA/SWA) at the end of an epoch, while fitting, must not hold the samples' own gradients."""
    from pergrad.integrations.lightning import DPSGD as DPSGDCallback

    net = _poisson_module(seed=3)
    leaks: list[list[str]] = []

    def save_model() -> None:
        saved = pickle.loads(pickle.dumps(net.model))
        leaks.append([n for n, p in saved.named_parameters() if hasattr(p, "grad_sample")])

    net.on_train_epoch_end = save_model
    callback = DPSGDCallback("model", max_grad_norm=C, noise_multiplier=1.0, delta=1e-5)
    _pl_trainer(tmp_path, callbacks=[callback]).fit(net)
    assert leaks and not any(leaks), f"the model saved during fit holds per-sample gradients of {leaks[0]}"


# == 10. HuggingFace ================================================================================


def test_hf_dpconfig_seed_equal_to_the_training_seed_is_refused(tmp_path: Path) -> None:
    """``DPConfig(seed=42)`` with ``TrainingArguments(seed=42)`` (the default seed, published with every
    config): the batches follow the public training seed. The docs say the batches are never seeded from
    ``TrainingArguments.seed``; this seeds them alike. Must be refused."""
    pytest.importorskip("transformers")
    from pergrad.integrations.hf import DPConfig, PerSampleTrainer
    from tests.test_hf_trainer import collate, dp_arguments, gpt2, lm_data

    args = dp_arguments(tmp_path, seed=42)
    privacy = DPConfig(max_grad_norm=20.0, noise_multiplier=1.0, delta=1e-5, seed=args.seed)
    try:
        trainer = PerSampleTrainer(
            model=gpt2(), args=args, train_dataset=lm_data(13), data_collator=collate, privacy=privacy
        )
    except REFUSED:
        return
    trainer.psm.remove()
    raise AssertionError("DPConfig(seed=TrainingArguments.seed) accepted: the batches are drawn from the public seed")


def test_hf_eval_between_steps_every_step_exact(tmp_path: Path) -> None:
    """``eval_strategy="steps", eval_steps=1``: an evaluation after every optimizer step. Every step's .grad is
    still the clipped sum over the step's draw / E[B] (sigma = 0), and 6 steps are counted."""
    pytest.importorskip("transformers")
    from pergrad.integrations.hf import DPConfig
    from tests.test_hf_trainer import LM_CLIP, dp_arguments, gpt2, lm_data, lm_sample, reference, run

    base = gpt2()
    privacy = DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=0.0, delta=1e-5, seed=5)
    args = dp_arguments(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3)
    recorder, trainer = run(
        copy.deepcopy(base), lm_data(13), tmp_path, args=args, privacy=privacy, eval_dataset=lm_data(5, seed=7)
    )
    assert trainer.dp is not None and trainer.dp.steps == 6
    assert any("eval_loss" in entry for entry in trainer.state.log_history)
    for k, step in enumerate(recorder.steps):
        n = sum(b["input_ids"].shape[0] for b in step["batches"])
        ref = reference(base, step, lm_sample, LM_CLIP) if n else None
        for name, got in step["grads"].items():
            want = torch.zeros_like(got) if ref is None else ref[name] * n / 2
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"step {k} {name}")


def test_hf_train_twice_continues_the_accounting_or_refuses(tmp_path: Path) -> None:
    """A notebook calls ``trainer.train()`` a second time to train on: the second run's steps must be noised
    and counted on (12 steps), or refused clearly."""
    pytest.importorskip("transformers")
    from pergrad.integrations.hf import DPConfig
    from tests.test_hf_trainer import LM_CLIP, dp_arguments, gpt2, lm_data, run

    privacy = DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=1.0, delta=1e-5)
    recorder, trainer = run(gpt2(), lm_data(13), tmp_path, args=dp_arguments(tmp_path), privacy=privacy)
    assert trainer.dp is not None and trainer.dp.steps == 6
    first_steps = len(recorder.steps)
    try:
        trainer.train()
    except REFUSED:
        return
    assert len(recorder.steps) == first_steps + 6
    assert trainer.dp.steps == 12, f"{trainer.dp.steps} steps counted after two train() calls of 6 steps each"
