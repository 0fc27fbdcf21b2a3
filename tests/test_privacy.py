"""pergrad.privacy: Poisson sampling, DP-SGD's clipping and noise, and the accountant.

Every step's ``.grad`` is checked against ``(sum_i clip_C(g_i) + noise) / E[B]`` with the per-sample
gradients from torch.func (float64), over several steps with changing batch sizes, an empty batch and
gradient accumulation; the noise against its distribution and against the generator it is drawn from;
the accountant against dp_accounting called directly and Opacus's RDP accountant.
"""

from __future__ import annotations

import ast
import copy
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from pergrad import PerSampleModule, transforms
from pergrad.errors import PrivacyError
from pergrad.privacy import DPSGD, PoissonBatchSampler, collate_with_empty, epsilon_of, noise_multiplier_for
from tests.reference import clipped, reference_grad_sample
from tests.test_distributed import Pool

ROOT = Path(__file__).resolve().parents[1]

# -- the sampler -----------------------------------------------------------------------------------


def sampler(n: int, q: float, steps: int, seed: int = 0, **kwargs: Any) -> PoissonBatchSampler:
    return PoissonBatchSampler(n, q, steps=steps, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_every_index_joins_with_probability_q_independently() -> None:
    n, q, steps = 50, 0.2, 4000
    batches = list(sampler(n, q, steps))
    assert len(batches) == steps
    counts = torch.zeros(n)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    for b in batches:
        assert b == sorted(set(b)) and all(0 <= i < n for i in b)  # no index twice in a batch
        counts[b] += 1
    # each frequency ~ q, std sqrt(q (1-q) / steps) = 0.0063: 5 std
    assert (counts / steps - q).abs().max() < 5 * math.sqrt(q * (1 - q) / steps)
    # batch size ~ Binomial(n, q): mean 10, variance 8 (the std of the variance's estimate is ~0.2)
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    assert abs(sizes.var().item() / (n * q * (1 - q)) - 1) < 0.12
    # independence of two indices: P(both) = q^2
    both = sum(1 for b in batches if 0 in b and 1 in b) / steps
    assert abs(both - q * q) < 5 * math.sqrt(q * q / steps)


def test_empty_batches_come_with_their_probability_and_the_loader_hands_them_out() -> None:
    n, q, steps = 5, 0.2, 4000
    batches = list(sampler(n, q, steps))
    empty = sum(1 for b in batches if not b) / steps
    p = (1 - q) ** n  # 0.328
    assert abs(empty - p) < 5 * math.sqrt(p * (1 - p) / steps)
    data = TensorDataset(torch.randn(n, 3, 2), torch.arange(n))
    loader = DataLoader(data, batch_sampler=sampler(n, q, 20), collate_fn=collate_with_empty(data))
    shapes = [(x.shape, y.shape, y.dtype) for x, y in loader]
    assert len(shapes) == 20
    assert (torch.Size([0, 3, 2]), torch.Size([0]), torch.long) in shapes  # an empty batch, shaped
    for (x_shape, y_shape, _), batch in zip(shapes, sampler(n, q, 20)):
        assert x_shape == (len(batch), 3, 2) and y_shape == (len(batch),)


def test_collate_with_empty_keeps_dicts_and_the_users_collate() -> None:
    rows = [{"input_ids": torch.arange(4) + i, "label": i} for i in range(3)]
    collate = collate_with_empty(rows)
    empty = collate([])
    assert empty["input_ids"].shape == (0, 4) and empty["label"].shape == (0,)
    assert torch.equal(collate(rows[:2])["label"], torch.tensor([0, 1]))
    calls = []
    own = collate_with_empty(rows, lambda b: calls.append(len(b)) or {"n": torch.tensor([len(b)])})
    assert own([])["n"].shape == (0,) and calls == [1]


def test_the_ranks_share_one_draw() -> None:
    n, q, steps, world = 30, 0.3, 6, 3
    whole = list(sampler(n, q, steps))
    shares = [list(sampler(n, q, steps, num_replicas=world, rank=r)) for r in range(world)]
    assert all(len(s) == steps for s in shares)
    for step, batch in enumerate(whole):
        parts = [shares[r][step] for r in range(world)]
        assert sorted(i for part in parts for i in part) == batch  # together: the one Poisson sample
        for r, part in enumerate(parts):
            assert all(i % world == r for i in part)


def test_micro_batches_split_one_draw() -> None:
    whole = list(sampler(40, 0.25, 5))
    split = list(sampler(40, 0.25, 5, micro_batches=3))
    assert len(split) == 15 == len(sampler(40, 0.25, 5, micro_batches=3))
    for step, batch in enumerate(whole):
        parts = split[3 * step : 3 * step + 3]
        assert [i for part in parts for i in part] == batch
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_the_generator_decides_the_batches() -> None:
    assert list(sampler(40, 0.25, 5, seed=3)) == list(sampler(40, 0.25, 5, seed=3))
    assert list(sampler(40, 0.25, 5, seed=3)) != list(sampler(40, 0.25, 5, seed=4))
    s = sampler(40, 0.25, 5)
    assert list(s) != list(s)  # a second pass continues the generator: new draws
    assert len(PoissonBatchSampler(40, 0.25)) == 4  # round(1 / q) steps by default


@pytest.mark.parametrize("stop", [0, 3, 5])
def test_a_resumed_sampler_continues_where_it_was_saved(stop: int) -> None:
    uninterrupted = sampler(40, 0.25, 5, micro_batches=2)
    first, second = list(uninterrupted), list(uninterrupted)
    interrupted = sampler(40, 0.25, 5, micro_batches=2)
    it = iter(interrupted)
    seen = [next(it) for _ in range(2 * stop)]  # every micro-batch of `stop` steps
    state = copy.deepcopy(interrupted.state_dict())
    resumed = sampler(40, 0.25, 5, seed=99, micro_batches=2)  # another seed: the state decides
    resumed.load_state_dict(state)
    rest = list(resumed)
    if stop == 5:  # the pass was complete: a new pass
        assert seen == first and rest == second
    else:
        assert seen + rest == first
        assert list(resumed) == second


def test_sampler_arguments_are_checked() -> None:
    with pytest.raises(PrivacyError, match=r"num_replicas=2\) without a generator, outside torch.distributed"):
        list(PoissonBatchSampler(10, 0.1, num_replicas=2, rank=1))
    with pytest.raises(ValueError, match=r"sample_rate must be in \(0, 1\]"):
        PoissonBatchSampler(10, 0.0)
    with pytest.raises(ValueError, match=r"need 0 <= rank < num_replicas"):
        PoissonBatchSampler(10, 0.1, num_replicas=2, rank=2)


# -- clipping and noise in one process -------------------------------------------------------------


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


N = 24
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(2))
# per optimizer step, its micro-batches: one batch, two micro-batches, an empty step, a micro-batch and an
# empty one, one sample
STEPS = [[[0, 1, 2, 3, 4]], [[5, 6], [7, 8, 9, 10, 11]], [], [[12, 13, 14], []], [[15]]]
C, Q = 0.6, 1 / 6  # E[B] = 4; C about the median per-sample norm
EXPECTED = Q * N


def loss_of(out: Tensor, y: Tensor, reduction: str) -> Tensor:
    return F.cross_entropy(out, y, reduction=reduction)


def reference_sum(model: nn.Module, rows: list[int], target: list[str] | None = None) -> dict[str, Tensor]:
    """``sum_i clip_C(g_i)`` over ``rows`` (the norm over the ``target`` parameters), from torch.func."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not rows:
        return {n: torch.zeros_like(p) for n, p in model.named_parameters() if n in names}
    ref = reference_grad_sample(model, X[rows], Y[rows], lambda o, t: F.cross_entropy(o, t))
    ref = {n: g for n, g in ref.items() if target is None or n in target}
    return {n: g.sum(0) for n, g in clipped(ref, C).items()}


SETTINGS = {
    "mean": dict(),
    "sum": dict(loss_reduction="sum", reduction="sum"),
    "mean-of-sum": dict(loss_reduction="sum", reduction="mean"),
    "fused": dict(keep_grad_sample=False),
    "loss_scale": dict(loss_scale=0.5),  # the loss of each micro-batch is halved, and pergrad told so
    "loss_scale_tensor": dict(loss_scale=torch.tensor(0.25, dtype=torch.float64), reduction="sum"),
    "loss_scale_later": dict(loss_scale=1 / 3),  # set as psm.loss_scale after DPSGD (as Lightning's callback does)
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_grad_is_the_sum_of_clipped_gradients_over_the_expected_batch(setting: str) -> None:
    """sigma = 0: every step's .grad, and the parameters after SGD, are ``sum_i clip(g_i) / E[B]`` over the
    step's samples (every micro-batch), whatever the batch sizes (an empty one included)."""
    options: dict[str, Any] = dict(SETTINGS[setting])
    model, reference = make_model(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scale = options.get("loss_scale")
    factor = 1.0 if scale is None else float(scale)
    loss_reduction = options.get("loss_reduction", "mean")
    later = options.pop("loss_scale") if setting == "loss_scale_later" else None
    with PerSampleModule(model, **options) as psm:
        dp = DPSGD(psm, max_grad_norm=C, noise_multiplier=0.0, sample_rate=Q, num_samples=N)
        if later is not None:
            psm.loss_scale = later
        for step, micro in enumerate(STEPS):
            optimizer.zero_grad()
            for rows in micro:  # an empty micro-batch too (its "mean" loss is nan; pergrad adds 0)
                (factor * loss_of(psm(X[rows]), Y[rows], loss_reduction)).backward()
            dp.add_noise()
            expected = reference_sum(reference, [i for rows in micro for i in rows])
            for name, p in model.named_parameters():
                assert p.grad is not None
                torch.testing.assert_close(p.grad, expected[name] / EXPECTED, rtol=1e-10, atol=1e-13)
            optimizer.step()
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    p.sub_(0.5 * expected[name] / EXPECTED)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13, msg=f"step {step}: {name}")
        assert dp.steps == len(STEPS)


def test_a_module_target_clips_its_own_parameters_together() -> None:
    model, reference = make_model(), make_model()
    for m in (model, reference):
        m[2].requires_grad_(False)  # outside the target: frozen
    with PerSampleModule(model) as psm:
        dp = DPSGD(psm, max_grad_norm=C, noise_multiplier=0.0, sample_rate=Q, expected_batch_size=EXPECTED, target="0")
        for micro in STEPS:
            model.zero_grad()
            for rows in micro:
                if rows:
                    loss_of(psm(X[rows]), Y[rows], "mean").backward()
            dp.add_noise()
            expected = reference_sum(reference, [i for rows in micro for i in rows], ["0.weight", "0.bias"])
            for name in ("0.weight", "0.bias"):
                grad = model.get_parameter(name).grad
                assert grad is not None
                torch.testing.assert_close(grad, expected[name] / EXPECTED, rtol=1e-10, atol=1e-13)
            assert model[2].weight.grad is None


def noisy_run(seed: int, steps: list[list[list[int]]], sigma: float = 1.5) -> list[dict[str, Tensor]]:
    """``.grad`` minus ``sum_i clip(g_i) / E[B]`` at each step: the noise added."""
    model, reference = make_model(), make_model()
    out = []
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        generator = torch.Generator().manual_seed(seed)
        dp = DPSGD(psm, C, sigma, Q, num_samples=N, generator=generator)
        for micro in steps:
            model.zero_grad()
            for rows in micro:
                if rows:
                    loss_of(psm(X[rows]), Y[rows], "mean").backward()
            dp.add_noise()
            expected = reference_sum(reference, [i for rows in micro for i in rows])
            out.append({n: p.grad - expected[n] / EXPECTED for n, p in model.named_parameters()})  # type: ignore[operator]
    return out


def test_noise_is_added_once_per_step_from_the_generator() -> None:
    """The noise of each step is exactly ``sigma C / E[B]`` times the next standard normals of the generator,
    one draw per parameter in order: once per step, however many micro-batches (or none) it had."""
    sigma = 1.5
    noises = noisy_run(7, STEPS, sigma)
    generator = torch.Generator().manual_seed(7)
    model = make_model()
    for noise in noises:
        for name, p in model.named_parameters():
            draw = torch.randn(p.shape, generator=generator, dtype=torch.float64) * (sigma * C / EXPECTED)
            torch.testing.assert_close(noise[name], draw, rtol=1e-9, atol=1e-12)


def test_the_noise_has_mean_zero_and_std_sigma_c_over_the_expected_batch() -> None:
    """Empirical moments of the noise over 300 steps x 51 parameters (15,300 draws), seeded: the mean within 5
    standard errors of 0, the std within 5 standard errors (std / sqrt(2n), 3%) of sigma C / E[B]."""
    sigma = 2.0
    steps = ([[]] * 9 + [[[0, 1, 2]]]) * 30  # empty steps and steps with a batch
    draws = torch.cat([t.flatten() for noise in noisy_run(11, steps, sigma) for t in noise.values()])
    std = sigma * C / EXPECTED
    n = draws.numel()
    assert n == 300 * 51
    assert abs(draws.mean().item()) < 5 * std / math.sqrt(n)
    assert abs(draws.std().item() / std - 1) < 5 / math.sqrt(2 * n)


@pytest.mark.parametrize("generator", ["seeded", "none"])
def test_resuming_gives_the_same_noise_and_counts_the_steps(generator: str) -> None:
    def run(split: bool) -> tuple[list[Tensor], int]:
        model = make_model()
        grads = []
        with PerSampleModule(model) as psm:
            dp = DPSGD(psm, C, 1.0, Q, num_samples=N, generator=torch.Generator().manual_seed(3))
            for step, micro in enumerate(STEPS):
                if split and step == 2:  # a new wrapper and DPSGD from the saved state
                    state = copy.deepcopy(dp.state_dict())
                    psm.remove()
                    psm = PerSampleModule(model)
                    other = torch.Generator().manual_seed(99) if generator == "seeded" else None
                    dp = DPSGD(psm, C, 1.0, Q, num_samples=N, generator=other)
                    dp.load_state_dict(state)
                model.zero_grad()
                for rows in micro:
                    if rows:
                        loss_of(psm(X[rows]), Y[rows], "mean").backward()
                dp.add_noise()
                grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
            psm.remove()
            return grads, dp.steps

    (whole, steps), (resumed, resumed_steps) = run(False), run(True)
    assert steps == resumed_steps == len(STEPS)
    for a, b in zip(whole, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_epsilon_is_the_accountants_for_the_steps_taken() -> None:
    model = make_model()
    with PerSampleModule(model) as psm:
        dp = DPSGD(psm, C, 1.1, Q, num_samples=N)
        assert dp.epsilon(1e-5) == 0.0
        for _ in range(3):
            dp.add_noise()
        assert dp.epsilon(1e-5) == epsilon_of(1.1, Q, 3, 1e-5)
        dp.load_state_dict({"steps": 40})
        assert dp.steps == 40 and dp.epsilon(1e-5) == epsilon_of(1.1, Q, 40, 1e-5)


# -- what is refused -------------------------------------------------------------------------------


def test_refused_settings_say_what_to_do() -> None:
    model = make_model()
    with pytest.raises(PrivacyError, match=r"needs the PerSampleModule wrapping the model, got Sequential"):
        DPSGD(model, C, 1.0, Q, num_samples=N)  # type: ignore[arg-type]
    scaled = r"grad_scaler= \(fp16 loss scaling\).*Train in bfloat16"
    with PerSampleModule(model, grad_scaler=2.0) as psm, pytest.raises(PrivacyError, match=scaled):
        DPSGD(psm, C, 1.0, Q, num_samples=N)
    samples = r"accumulate='samples' with reduction='mean'.*accumulate='backward'"
    with PerSampleModule(model, accumulate="samples") as psm, pytest.raises(PrivacyError, match=samples):
        DPSGD(psm, C, 1.0, Q, num_samples=N)
    with PerSampleModule(model) as psm:
        with pytest.raises(PrivacyError, match=r"exactly one of expected_batch_size=sample_rate \* N or num_samples=N"):
            DPSGD(psm, C, 1.0, Q)
        with pytest.raises(PrivacyError, match=r"exactly one of"):
            DPSGD(psm, C, 1.0, Q, expected_batch_size=4.0, num_samples=N)
        with pytest.raises(PrivacyError, match=r"\['2.weight', '2.bias'\] are trainable too.*requires_grad_\(False\)"):
            DPSGD(psm, C, 1.0, Q, num_samples=N, target=model[0])
        with pytest.raises(PrivacyError, match=r"target is a module .*not a parameter"):
            DPSGD(psm, C, 1.0, Q, num_samples=N, target=model[0].weight)  # type: ignore[arg-type]
        with pytest.raises(PrivacyError, match=r"target 'nope' is not a module of the wrapped Sequential"):
            DPSGD(psm, C, 1.0, Q, num_samples=N, target="nope")
        psm.register_transform(model[2], transforms.clip_norm(1.0))
        with pytest.raises(PrivacyError, match=r"cannot clip the whole model: .*overlaps module '2'.*only transform"):
            DPSGD(psm, C, 1.0, Q, num_samples=N)
    with PerSampleModule(model) as psm:
        dp = DPSGD(psm, C, 1.0, Q, num_samples=N)
        with pytest.raises(PrivacyError, match=r"saved DP-SGD state has noise_multiplier=2.0, this DPSGD 1.0"):
            dp.load_state_dict({"steps": 3, "noise_multiplier": 2.0})


# -- several processes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    pool = Pool(2, tmp_path_factory.mktemp("privacy2"))
    yield pool
    pool.close()


DDP_STEPS = 4
DDP_N, DDP_Q = 16, 0.25  # E[B] = 4; some ranks' shares are empty


def ddp_run(rank: int, world: int, sigma: float, steps: int) -> list[dict[str, Any]]:
    """DP-SGD under DDP: per step, the global batch and this rank's .grad before and after the noise."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    psm = PerSampleModule(ddp, reduction="sum", keep_grad_sample=False)
    dp = DPSGD(psm, C, sigma, DDP_Q, num_samples=DDP_N)  # generator=None: seeded from rank 0
    batches = PoissonBatchSampler(DDP_N, DDP_Q, steps=steps, num_replicas=world, rank=rank)  # seeded from rank 0
    out = []
    for rows in [*batches, []]:  # and a step whose global batch is empty
        ddp.zero_grad()
        x, y = X[rows], Y[rows]
        loss_of(psm(x), y, "sum").backward()  # every rank runs its backward, an empty share too
        before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        dp.add_noise()
        out.append(
            {
                "rows": rows,
                "before": before,
                "after": [p.grad.clone() for p in model.parameters()],  # type: ignore[union-attr]
            }
        )
    psm.remove()
    return out


def test_ddp_every_rank_ends_with_the_same_grad_and_the_noise_once(pool2: Pool) -> None:
    ranks = pool2.run(ddp_run, 0.0, DDP_STEPS)
    reference = make_model()
    names = [n for n, _ in reference.named_parameters()]
    sizes = []
    for step in range(DDP_STEPS + 1):
        rows = sorted(ranks[0][step]["rows"] + ranks[1][step]["rows"])
        assert all(i % 2 == r for r in range(2) for i in ranks[r][step]["rows"])
        sizes.append([len(ranks[r][step]["rows"]) for r in range(2)])
        expected = reference_sum(reference, rows)  # over the global batch
        for r in range(2):
            for name, grad in zip(names, ranks[r][step]["after"]):
                torch.testing.assert_close(grad, expected[name] / (DDP_Q * DDP_N), rtol=1e-10, atol=1e-13)
    assert [0, 0] in sizes and any(0 in s and s != [0, 0] for s in sizes)  # an empty step, an empty share

    sigma = 1.5
    ranks = pool2.run(ddp_run, sigma, 40)
    noise = []
    for step in range(41):
        for a, b in zip(ranks[0][step]["after"], ranks[1][step]["after"]):
            assert torch.equal(a, b)  # every rank: the same .grad, noise included
        noise += [(a - b).flatten() for a, b in zip(ranks[0][step]["after"], ranks[0][step]["before"])]
    draws = torch.cat(noise)  # 41 steps x 51 parameters
    std = sigma * C / (DDP_Q * DDP_N)
    assert abs(draws.std().item() / std - 1) < 5 / math.sqrt(2 * draws.numel())  # the noise once, not twice
    assert abs(draws.mean().item()) < 5 * std / math.sqrt(draws.numel())


def ddp_refusals(rank: int, world: int, what: str) -> str:
    model = make_model()
    try:
        if what == "mean":
            DPSGD(PerSampleModule(DistributedDataParallel(model)), C, 1.0, DDP_Q, num_samples=DDP_N)
        elif what == "generators":
            psm = PerSampleModule(DistributedDataParallel(model), reduction="sum")
            dp = DPSGD(psm, C, 1.0, DDP_Q, num_samples=DDP_N, generator=torch.Generator().manual_seed(rank))
            dp.add_noise()
        elif what == "sampler":
            own = torch.Generator().manual_seed(rank)
            list(PoissonBatchSampler(DDP_N, DDP_Q, generator=own, num_replicas=world, rank=rank))
    except PrivacyError as err:
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("mean", r"under torch.distributed, DPSGD needs the wrapper's reduction='sum'"),
        ("generators", r"noise generators differ between ranks.*the same SEED on every rank"),
        ("sampler", r"PoissonBatchSampler's generators differ between ranks.*the same SEED on every rank"),
    ],
)
def test_ddp_refusals(pool2: Pool, what: str, match: str) -> None:
    for message in pool2.run(ddp_refusals, what):
        assert re.search(match, message), message


# -- the accountant --------------------------------------------------------------------------------

CASES = [(1.0, 0.01, 1000), (0.8, 0.05, 200), (2.0, 0.1, 50), (1.3, 0.004, 5000)]


@pytest.mark.parametrize(("sigma", "q", "steps"), CASES)
def test_epsilon_is_dp_accountings_and_opacus_agrees(sigma: float, q: float, steps: int) -> None:
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    delta = 1e-5
    direct = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    assert epsilon_of(sigma, q, steps, delta) == pytest.approx(direct, rel=1e-12)
    pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)
    assert epsilon_of(sigma, q, steps, delta, "pld") == pytest.approx(pld, rel=1e-12)
    assert pld <= direct  # PLD is the tighter bound

    from opacus.accountants import RDPAccountant

    opacus = RDPAccountant()
    for _ in range(steps):
        opacus.step(noise_multiplier=sigma, sample_rate=q)
    assert epsilon_of(sigma, q, steps, delta) == pytest.approx(opacus.get_epsilon(delta), rel=0.01)


@pytest.mark.parametrize(
    ("target", "q", "steps", "accountant"),
    [(1.0, 0.01, 1000, "rdp"), (3.0, 0.05, 300, "rdp"), (8.0, 0.2, 100, "rdp"), (3.0, 0.05, 300, "pld")],
)
def test_noise_multiplier_for_round_trips(target: float, q: float, steps: int, accountant: str) -> None:
    sigma = noise_multiplier_for(target, 1e-5, q, steps, accountant)
    assert 0 < sigma < 50
    assert target * (1 - 1e-3) < epsilon_of(sigma, q, steps, 1e-5, accountant) <= target
    assert epsilon_of(sigma * 0.99, q, steps, 1e-5, accountant) > target  # the smallest such sigma (to 1%)


def test_no_noise_no_privacy_no_step_no_cost() -> None:
    assert epsilon_of(0.0, 0.1, 10, 1e-5) == math.inf
    assert epsilon_of(1.0, 0.1, 0, 1e-5) == 0.0


def test_without_dp_accounting_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'pergrad\[dp\]'") as info:
        epsilon_of(1.0, 0.1, 10, 1e-5)
    assert info.value.name == "dp_accounting"


def test_pergrad_does_not_import_privacy_nor_its_accountant() -> None:
    code = (
        "import sys, pergrad; assert 'pergrad.privacy' not in sys.modules, 'pergrad imports pergrad.privacy'; "
        "import pergrad.privacy; assert 'dp_accounting' not in sys.modules, 'pergrad.privacy imports dp_accounting'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for path in (ROOT / "pergrad").rglob("*.py"):
        if path.name in ("privacy.py", "lightning.py", "hf.py"):  # the framework integrations build on it
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            assert not any("privacy" in name for name in names), f"{path} imports pergrad.privacy"
