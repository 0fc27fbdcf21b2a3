"""Keeping Opacus: ``PerSampleModule(model, keep_grad_sample=True)`` computes ``p.grad_sample`` and
Opacus's ``make_private(..., grad_sample_mode="no_op")`` keeps its DPOptimizer (clipping, noise),
Poisson DPDataLoader, BatchMemoryManager and accountant.

Every step's ``.grad`` after Opacus's ``pre_step`` and the parameters after its step are checked
against torch.func's per-sample gradients clipped as Opacus clips (``C / (||g_i|| + 1e-6)``, at most
1), summed and divided by the expected batch size, and against Opacus's own hooks mode on a copy, in
float64; what would drop or mix pergrad's numbers is refused with ``OpacusRouteError``."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from transformers.pytorch_utils import Conv1D

from pergrad import HookStateError, OpacusRouteError, PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample

CLIP, LR, N = 0.7, 0.3, 24


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


class Tokens(nn.Module):
    """17 positions per sample: pergrad builds the projection's grad_sample and, from the second backward
    on, runs its weight detached (the shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(self.emb(ids))).mean(1))


def tokens() -> nn.Module:
    torch.manual_seed(0)
    return Tokens().double()


class Exotic(nn.Module):
    """A layer Opacus 1.6 gets wrong (an Embedding's padding row gets per-sample gradients) and one it has
    no grad sampler for (HF's Conv1D: its functorch fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.conv, self.norm, self.head = Conv1D(8, 8), nn.RMSNorm(8), nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.conv(self.emb(ids)))).mean(1))


def exotic() -> nn.Module:
    torch.manual_seed(0)
    model = Exotic().double()
    with torch.no_grad():
        model.conv.weight.normal_(0, 0.5)
        model.conv.bias.normal_()  # the padding rows reach the RMSNorm as tanh(bias), not as zeros
    return model


def dataset(kind: str) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = (
        torch.randn(N, 6, generator=gen, dtype=torch.float64)
        if kind == "vectors"
        else torch.randint(0, 11, (N, 17), generator=gen)
    )
    return TensorDataset(x, torch.randint(0, 3, (N,), generator=gen))


def private(
    model: nn.Module,
    mode: str,
    kind: str,
    batch_size: int,
    noise: float = 0.0,
    loss_reduction: str = "mean",
    **kwargs: object,
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader, PrivacyEngine]:
    """``make_private`` on ``model`` with the same Poisson draws (and noise) for every mode."""
    loader = DataLoader(dataset(kind), batch_size=batch_size, generator=torch.Generator().manual_seed(5))
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # secure RNG off: the draws are seeded on purpose
        wrapped, optimizer, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=loader,
            noise_multiplier=noise,
            max_grad_norm=CLIP,
            loss_reduction=loss_reduction,
            noise_generator=torch.Generator().manual_seed(9),
            grad_sample_mode=mode,
            **kwargs,
        )
    return wrapped, optimizer, loader, engine


def loss_of(out: Tensor, y: Tensor, loss_reduction: str) -> Tensor:
    return F.cross_entropy(out, y, reduction=loss_reduction)


class Reference:
    """The same training run from torch.func: each step's ``(1/E[B]) sum_i clip(g_i)`` (``sum_i`` for a
    sum loss) as Opacus clips, and SGD on it."""

    def __init__(self, make: Callable[[], nn.Module], expected: int, loss_reduction: str) -> None:
        self.model, self.expected, self.loss_reduction = make(), expected, loss_reduction

    def grads(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        params = dict(self.model.named_parameters())
        if len(x) == 0:
            return {n: torch.zeros_like(p) for n, p in params.items()}
        ref = reference_grad_sample(self.model, x, y, lambda out, t: F.cross_entropy(out, t, reduction="sum"))
        norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
        factor = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        scale = self.expected if self.loss_reduction == "mean" else 1
        return {n: torch.einsum("i,i...->...", factor, g) / scale for n, g in ref.items()}

    def step(self, grads: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p -= LR * grads[n]


def check(model: nn.Module, want: dict[str, Tensor], what: str) -> None:
    """Every parameter's ``.grad`` against the reference's."""
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n], f"{n}.grad at {what}")


def steps(loader: DataLoader, count: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    """``count`` Poisson batches, over as many epochs as it takes."""
    step = 0
    while step < count:
        for x, y in loader:
            if step == count:
                return
            yield step, x, y
            step += 1


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize(("make", "kind"), [(mlp, "vectors"), (tokens, "tokens")], ids=["mlp", "tokens"])
def test_no_op_route_equals_opacus_hooks_and_the_reference(
    make: Callable[[], nn.Module], kind: str, loss_reduction: str
) -> None:
    model, copy = make(), make()
    psm = PerSampleModule(model, loss_reduction=loss_reduction)
    wrapped, optimizer, loader, _ = private(model, "no_op", kind, 2, loss_reduction=loss_reduction)
    theirs, their_optimizer, their_loader, _ = private(copy, "hooks", kind, 2, loss_reduction=loss_reduction)
    reference = Reference(make, optimizer.expected_batch_size, loss_reduction)
    sizes = []
    for (step, x, y), (_, x2, _) in zip(steps(loader, 14), steps(their_loader, 14)):
        assert torch.equal(x, x2)
        sizes.append(len(x))
        for opt, net, inputs in ((optimizer, wrapped, x), (their_optimizer, theirs, x2)):
            opt.zero_grad()
            loss_of(net(inputs), y, loss_reduction).backward()
            opt.step()
        want = reference.grads(x, y)
        check(model, want, f"step {step}")
        check(copy, want, f"step {step} (Opacus hooks)")
        reference.step(want)
        for (n, p), q in zip(model.named_parameters(), reference.model.parameters()):
            assert_close(p, q, f"{n} after step {step}")
    assert 0 in sizes and len(set(sizes)) >= 4, sizes  # Poisson batches of varying size, an empty one among them
    psm.remove()


def test_layers_opacus_gets_wrong_are_exact_through_the_no_op_route() -> None:
    model, copy = exotic(), exotic()
    PerSampleModule(model)
    wrapped, optimizer, loader, _ = private(model, "no_op", "tokens", 6)
    theirs, their_optimizer, their_loader, _ = private(copy, "hooks", "tokens", 6)
    reference = Reference(exotic, optimizer.expected_batch_size, "mean")
    for (step, x, y), (_, x2, _) in zip(steps(loader, 5), steps(their_loader, 5)):
        x[:, -3:] = x2[:, -3:] = 0  # padding at the end of every row
        for opt, net, inputs in ((optimizer, wrapped, x), (their_optimizer, theirs, x2)):
            opt.zero_grad()
            loss_of(net(inputs), y, "mean").backward()
            opt.step()
        want = reference.grads(x, y)
        check(model, want, f"step {step}")
        assert torch.all(model.emb.weight.grad[0] == 0)  # the padding row
        if step == 0:  # the premise: Opacus's own hooks clip norms that count the padding row
            assert copy.emb.weight.grad[0].abs().max() > 0
            assert not torch.allclose(copy.head.weight.grad, want["head.weight"])
        reference.step(want)


def test_batch_memory_manager_virtual_steps_and_the_accountant() -> None:
    """Logical Poisson batches split into physical ones of 3 (the optimizer skips the steps between),
    with noise: the same draws and noise as Opacus's hooks mode, and the same epsilon."""
    model, copy = mlp(), mlp()
    PerSampleModule(model)
    wrapped, optimizer, loader, engine = private(model, "no_op", "vectors", 8, noise=1.3)
    theirs, their_optimizer, their_loader, their_engine = private(copy, "hooks", "vectors", 8, noise=1.3)
    with (
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical,
        BatchMemoryManager(data_loader=their_loader, max_physical_batch_size=3, optimizer=their_optimizer) as same,
    ):
        taken = 0
        for (x, y), (x2, _) in zip(physical, same):
            assert torch.equal(x, x2)
            for opt, net in ((optimizer, wrapped), (their_optimizer, theirs)):
                opt.zero_grad()
                loss_of(net(x), y, "mean").backward()
                opt.step()
            if not optimizer._is_last_step_skipped:  # a logical batch is over: .grad holds its noisy mean
                taken += 1
                for (n, p), q in zip(model.named_parameters(), copy.parameters()):
                    assert_close(p.grad, q.grad, f"{n}.grad at logical step {taken}")
                    assert_close(p, q, f"{n} after logical step {taken}")
    assert taken == len(loader) and len(engine.accountant.history) == 1
    assert engine.accountant.history == [(1.3, 1 / len(loader), taken)]
    assert isinstance(engine.accountant, PRVAccountant)  # make_private's default
    by_hand = PRVAccountant()
    by_hand.history = [(1.3, 1 / len(loader), taken)]
    epsilon = engine.get_epsilon(delta=1e-5)
    assert epsilon == their_engine.get_epsilon(delta=1e-5) == by_hand.get_epsilon(delta=1e-5)
    assert 0 < epsilon < float("inf")


def test_batch_memory_manager_against_the_reference() -> None:
    model = mlp()
    PerSampleModule(model)
    wrapped, optimizer, loader, _ = private(model, "no_op", "vectors", 8)
    reference = Reference(mlp, optimizer.expected_batch_size, "mean")
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        for x, y in physical:
            xs, ys = [*xs, x], [*ys, y]
            optimizer.zero_grad()
            loss_of(wrapped(x), y, "mean").backward()
            optimizer.step()
            if optimizer._is_last_step_skipped:
                continue
            want = reference.grads(torch.cat(xs), torch.cat(ys))
            check(model, want, f"{len(xs)} physical batches")
            reference.step(want)
            xs, ys = [], []


def test_a_pergrad_transform_with_opacus_clipping_is_refused() -> None:
    model = mlp()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(0.1))  # Opacus would clip grad_sample at CLIP instead
    wrapped, _, loader, _ = private(model, "no_op", "vectors", 8)
    x, y = next(iter(loader))
    with pytest.raises(OpacusRouteError, match=r"'0.weight' is stepped by Opacus's DPOptimizer.*transform registered "
                       r"for the whole model: it would be dropped\. Remove the transform"):  # fmt: skip
        loss_of(wrapped(x), y, "mean").backward()


def test_keep_grad_sample_false_is_refused() -> None:
    model = mlp()
    PerSampleModule(model, keep_grad_sample=False)
    wrapped, _, loader, _ = private(model, "no_op", "vectors", 8)
    x, y = next(iter(loader))
    with pytest.raises(
        OpacusRouteError, match=r"keep_grad_sample=False, so there is none\. Pass keep_grad_sample=True"
    ):
        loss_of(wrapped(x), y, "mean").backward()


@pytest.mark.parametrize("poisson", [True, False])
def test_two_backwards_before_a_step_are_refused(poisson: bool) -> None:
    """pergrad keeps the last forward's grad_sample: the optimizer would clip the second micro-batch only
    (Opacus's hooks mode raises with Poisson sampling and keeps both without)."""
    model = mlp()
    PerSampleModule(model)
    wrapped, optimizer, loader, _ = private(model, "no_op", "vectors", 8, poisson_sampling=poisson)
    batches = iter(loader)
    optimizer.zero_grad()
    x, y = next(batches)
    loss_of(wrapped(x), y, "mean").backward()
    x, y = next(batches)
    with pytest.raises(
        OpacusRouteError, match=r"still holds the grad_sample of an earlier forward.*BatchMemoryManager"
    ):
        loss_of(wrapped(x), y, "mean").backward()


def test_a_step_without_zero_grad_is_refused() -> None:
    model = mlp()
    PerSampleModule(model)
    wrapped, optimizer, loader, _ = private(model, "no_op", "vectors", 8)
    batches = iter(loader)
    x, y = next(batches)
    loss_of(wrapped(x), y, "mean").backward()
    optimizer.step()
    x, y = next(batches)
    with pytest.raises(OpacusRouteError, match=r"Call optimizer.step\(\) and optimizer.zero_grad\(\) after every"):
        loss_of(wrapped(x), y, "mean").backward()


def test_a_root_layer_needs_wrap_model_false() -> None:
    """Opacus's GradSampleModule calls the root module's forward past its hooks: refused with the fix,
    which is exact."""
    torch.manual_seed(0)
    model, copy = nn.Linear(6, 3).double(), nn.Linear(6, 3).double()
    copy.load_state_dict(model.state_dict())
    PerSampleModule(model)
    wrapped, optimizer, loader, _ = private(model, "no_op", "vectors", 8)
    x, y = next(iter(loader))
    with pytest.raises(HookStateError, match=r"root module's own hooks run only when it is called.*wrap_model=False"):
        loss_of(wrapped(x), y, "mean").backward()

    _, optimizer, loader, _ = private(copy, "no_op", "vectors", 8, wrap_model=False)
    PerSampleModule(copy)
    reference = Reference(lambda: nn.Linear(6, 3).double(), optimizer.expected_batch_size, "mean")
    reference.model.load_state_dict(copy.state_dict())
    for step, x, y in steps(loader, 4):
        optimizer.zero_grad()
        loss_of(copy(x), y, "mean").backward()
        optimizer.step()
        want = reference.grads(x, y)
        check(copy, want, f"step {step}")
        reference.step(want)
