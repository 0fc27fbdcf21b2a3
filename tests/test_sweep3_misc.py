"""Issue 39's sweep, part three: several backward passes of one forward, dropout in layers pergrad runs
again, copies and pickles of the wrapper, a lazy root, ``nn.LinearCrossEntropyLoss`` with an
``ignore_index`` outside the classes, and ``fix_batchnorm``. Every number against a one-sample-at-a-time
autograd loop on a separate copy of the model, float64, on several steps."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from reference import assert_close
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from pergrad import (
    PergradError,
    PerSampleModule,
    TokenLossWarning,
    transforms,
)
from pergrad.hooks import owners

Loss = Callable[[Tensor], Tensor]  # the model's output -> each sample's own loss, [B]
BOUND = 0.3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def squares(out: Tensor) -> Tensor:
    return out.pow(2).flatten(1).sum(1)


def sines(out: Tensor) -> Tensor:
    return out.sin().flatten(1).sum(1)


def per_sample(model: nn.Module, x: Tensor, *losses: Loss) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: each sample's gradient of its own ``sum_k losses[k]``, one sample at a time."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i : i + 1])
        found = torch.autograd.grad(sum(loss(out).sum() for loss in losses), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(found, params.values(), strict=True)])
    return {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(params)}


def clip(grads: dict[str, Tensor], bound: float = BOUND) -> dict[str, Tensor]:
    """Each sample's ``min(1, C / ||g_i||) g_i``, the norm over every entry of ``grads`` together."""
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: g * factor.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}


def norms_of(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: g.flatten(1).norm(dim=1) for n, g in grads.items()}


def assert_grads(model: nn.Module, expected: dict[str, Tensor], what: str) -> None:
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{what}: {n} has no .grad"
        assert_close(p.grad, expected[n], f"{what}: {n}")


# -- item 10: copies and pickles -----------------------------------------------------------------------


def step_and_check(psm: PerSampleModule, x: Tensor, what: str) -> None:
    """One clipped step of ``psm`` (clip over its whole model) against the reference on a copy."""
    model = psm.module
    reference = copy.deepcopy(model)
    psm.zero_grad()
    squares(psm(x)).mean().backward()
    assert_grads(model, {n: g.mean(0) for n, g in clip(per_sample(reference, x, squares)).items()}, what)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def clipped_wrapper() -> PerSampleModule:
    torch.manual_seed(7)
    model = mlp()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    psm.register_projection(model[0], dim=4, seed=3)
    return psm


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_the_wrapper_is_a_new_wrapper_on_a_copy_of_the_model(how: str) -> None:
    psm = clipped_wrapper()
    x = torch.randn(5, 3, dtype=torch.float64)
    step_and_check(psm, x, "before copying")
    if how == "deepcopy":
        other = copy.deepcopy(psm)
    elif how == "pickle":
        other = pickle.loads(pickle.dumps(psm))
    else:
        buffer = io.BytesIO()
        torch.save(psm, buffer)
        buffer.seek(0)
        other = torch.load(buffer, weights_only=False)
    assert isinstance(other, PerSampleModule) and other.module is not psm.module
    assert list(other.registered_transforms()) == ["the whole model"]
    for (n, p), q in zip(psm.module.named_parameters(), other.module.parameters(), strict=True):
        assert p is not q and torch.equal(p, q), n
    for step in range(3):
        x = torch.randn(5, 3, dtype=torch.float64)
        step_and_check(other, x, f"copy, step {step}")
        step_and_check(psm, x, f"original, step {step}")
        assert_close(other.per_sample_projections()["0"], psm.per_sample_projections()["0"], "projections")
    other.remove()
    assert owners(psm.module) and not owners(other.module)
    step_and_check(psm, x, "original after removing the copy")
    psm.remove()


def test_copies_of_the_wrapped_model_are_unwrapped_and_train_as_plain_autograd() -> None:
    psm = clipped_wrapper()
    model = psm.module
    step_and_check(psm, torch.randn(5, 3, dtype=torch.float64), "first")
    averaged = AveragedModel(model)
    for step in range(3):
        copied = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
        for other in (copied, loaded, averaged.module):
            assert not owners(other)
        x = torch.randn(5, 3, dtype=torch.float64)
        plain = mlp()
        plain.load_state_dict(model.state_dict())
        squares(plain(x)).mean().backward()
        for other in (copied, loaded):
            squares(other(x)).mean().backward()
            for (n, p), q in zip(other.named_parameters(), plain.parameters(), strict=True):
                assert_close(p.grad, q.grad, f"step {step}, {n}")
        step_and_check(psm, x, f"the wrapped model, step {step}")
        averaged.update_parameters(model)
    assert int(averaged.n_averaged) == 3
    psm.remove()


class Holder(nn.Module):
    """A module keeping the wrapper of its network as a plain attribute (as a LightningModule may)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.psm = PerSampleModule(self.net)
        self.psm.register_transform(self.net[2], transforms.clip_norm(BOUND))


def test_a_module_holding_a_wrapper_copies_with_a_wrapper_on_its_copied_network() -> None:
    torch.manual_seed(8)
    holder = Holder()
    copied = copy.deepcopy(holder)
    assert copied.psm.module is copied.net and copied.net is not holder.net
    for step in range(2):
        reference = copy.deepcopy(copied.net)
        x = torch.randn(4, 3, dtype=torch.float64)
        copied.psm.zero_grad()
        squares(copied.psm(x)).mean().backward()
        g = per_sample(reference, x, squares)
        expected = {n: t.mean(0) for n, t in g.items()}
        expected.update({n: t.mean(0) for n, t in clip({n: g[n] for n in ("2.weight", "2.bias")}).items()})
        assert_grads(copied.net, expected, f"step {step}")
    copied.psm.remove()
    holder.psm.remove()


def test_a_shallow_copy_of_the_wrapper_is_refused() -> None:
    psm = PerSampleModule(mlp())
    with pytest.raises(PergradError, match=r"copy.copy\(psm\) would be a second wrapper of the same model"):
        copy.copy(psm)
    psm.remove()


# -- item 12: a lazy root, nn.LinearCrossEntropyLoss with ignore_index outside the classes --------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_lazy_module_as_the_root(kind: str, keep: bool) -> None:
    """The root materialises in its own forward pre-hook (before pergrad's): bound in that call, exact
    from the first step, the transform registered before the first forward included."""
    torch.manual_seed(9)
    model = (nn.LazyLinear(3) if kind == "linear" else nn.LazyConv2d(2, 3)).double()
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    shape = (4, 5) if kind == "linear" else (4, 1, 5, 5)
    for step in range(3):
        x = torch.randn(*shape, dtype=torch.float64)
        if step == 0:  # the reference is made after the first forward materialised the parameters
            psm.zero_grad()
            out = psm(x)
            reference = copy.deepcopy(model)
            squares(out).mean().backward()
        else:
            reference = copy.deepcopy(model)
            psm.zero_grad()
            squares(psm(x)).mean().backward()
        assert_grads(model, {n: g.mean(0) for n, g in clip(per_sample(reference, x, squares)).items()}, f"step {step}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_with_class_weights_and_an_ignore_index_outside_the_classes(reduction: str) -> None:
    """PyTorch's module_db case: ``weight=``, ``ignore_index = C + 5`` present in the targets."""
    torch.manual_seed(10)
    classes, batch = 4, 6
    module = nn.LinearCrossEntropyLoss(5, classes, reduction=reduction, dtype=torch.float64)
    module.weight = torch.rand(classes, dtype=torch.float64) + 0.5
    module.ignore_index = classes + 5
    psm = PerSampleModule(module, loss_reduction="mean" if reduction == "mean" else "sum")
    for step in range(3):
        x = torch.randn(batch, 5, dtype=torch.float64)
        t = torch.randint(0, classes, (batch,))
        t[step] = classes + 5
        reference = copy.deepcopy(module)
        reference.reduction = "sum"
        params = dict(reference.named_parameters())
        rows = [torch.autograd.grad(reference(x[i : i + 1], t[i : i + 1]), list(params.values())) for i in range(batch)]
        g = {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(params)}
        counted = t != classes + 5
        if reduction == "mean":  # B times each sample's share of the batch's weighted mean
            g = {n: v * batch / module.weight[t[counted]].sum() for n, v in g.items()}
        psm.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TokenLossWarning)  # the samples count differently
            out = psm(x, t)
            (out.sum() if reduction == "none" else out).backward()
        for n, p in module.named_parameters():
            assert_close(p.grad_sample, g[n], f"step {step}, {n}")
    psm.remove()
