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
import torch.nn.functional as F
from reference import assert_close
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

import pergrad
from pergrad import (
    BatchMixingError,
    HookStateError,
    PerSampleModule,
    TokenLossWarning,
    UnsupportedLayerError,
    transforms,
)
from pergrad._core.capture.hooks import owners

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


# -- item 5: two losses of one forward, backwarded separately ------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("transform", ["none", "scale"])
def test_accumulate_samples_counts_the_samples_of_one_forward_once(keep: bool, transform: str) -> None:
    """``accumulate="samples"``, two micro-batches per step, each forward backwarded twice (two losses):
    ``.grad`` is the mean over the step's samples of ``T(g1_i + g2_i)`` (T linear: no transform, or
    fixed per-sample weights, which run the weights detached from the second step)."""
    torch.manual_seed(0)
    model = mlp()
    sizes = (3, 5) if transform == "none" else (4, 4)
    weights = torch.rand(4, dtype=torch.float64) + 0.5
    psm = PerSampleModule(model, accumulate="samples", keep_grad_sample=keep)
    if transform == "scale":
        psm.register_transform(model, transforms.scale(weights))
    for step in range(3):
        reference = copy.deepcopy(model)
        psm.zero_grad()
        total: dict[str, Tensor] = {}
        for size in sizes:
            x = torch.randn(size, 3, dtype=torch.float64)
            out = psm(x)
            squares(out).mean().backward(retain_graph=True)
            sines(out).mean().backward()
            for n, g in per_sample(reference, x, squares, sines).items():
                w = weights.view(-1, *([1] * (g.dim() - 1))) if transform == "scale" else 1.0
                total[n] = total.get(n, 0) + (w * g).sum(0)
        assert_grads(model, {n: t / sum(sizes) for n, t in total.items()}, f"step {step}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("accumulate", ["backward", "samples"])
def test_a_second_backward_of_one_forward_into_a_clipped_grad_is_refused(keep: bool, accumulate: str) -> None:
    """``T(g1_i) + T(g2_i)`` is not ``T(g1_i + g2_i)``: refused at the second backward's first arrival, with
    ``.grad`` as the first left it. Cleared between the two (each backward a step of its own), the second
    gives the clipped mean of its own ``g2_i``."""
    torch.manual_seed(1)
    model = mlp()
    psm = PerSampleModule(model, keep_grad_sample=keep, accumulate=accumulate)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    for step in range(3):
        reference = copy.deepcopy(model)
        x = torch.randn(6, 3, dtype=torch.float64)
        psm.zero_grad()
        out = psm(x)
        squares(out).mean().backward(retain_graph=True)
        first = {n: g.mean(0) for n, g in clip(per_sample(reference, x, squares)).items()}
        assert_grads(model, first, f"step {step}, first")
        with pytest.raises(
            HookStateError,
            match=r"a second backward through the same forward \(retain_graph=True\) reaches \['0.weight', "
            r"'0.bias', '2.weight', '2.bias'\].*the whole model is not additive.*\(\(loss1 \+ loss2\).backward\(\)\)",
        ):
            sines(out).mean().backward(retain_graph=True)
        assert_grads(model, first, f"step {step}, after the refusal")
        psm.zero_grad()
        sines(out).mean().backward()
        second = {n: g.mean(0) for n, g in clip(per_sample(reference, x, sines)).items()}
        assert_grads(model, second, f"step {step}, second after zero_grad")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head1, self.head2 = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head1(h), self.head2(h)


@pytest.mark.parametrize("accumulate", ["backward", "samples"])
def test_a_second_backward_that_misses_the_clipped_parameters_is_exact(accumulate: str) -> None:
    """The other side: the clip covers ``head1``, which the second loss does not reach; the trunk gets
    autograd's sum of both losses' gradients, counted once per sample."""
    torch.manual_seed(2)
    model = TwoHeads().double()
    psm = PerSampleModule(model, accumulate=accumulate)
    psm.register_transform(model.head1, transforms.clip_norm(BOUND))
    for step in range(3):
        reference = copy.deepcopy(model)
        x = torch.randn(5, 3, dtype=torch.float64)
        psm.zero_grad()
        o1, o2 = psm(x)
        squares(o1).mean().backward(retain_graph=True)
        sines(o2).mean().backward()
        g = per_sample(reference, x, lambda o: squares(o[0]), lambda o: sines(o[1]))
        expected = {n: t.mean(0) for n, t in g.items()}
        # (the second loss does not reach head1: its g_i are the first loss's)
        expected.update({n: t.mean(0) for n, t in clip({n: g[n] for n in ("head1.weight", "head1.bias")}).items()})
        assert_grads(model, expected, f"step {step}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


# -- item 11: norms after two backward passes of one forward --------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_per_sample_norms_are_the_last_backwards_both_ways(keep: bool) -> None:
    """``per_sample_norms()`` holds the norms of the last backward's own ``g_i`` with ``keep_grad_sample``
    True or False; ``grad_sample`` (True) is the sum over the forward's backward passes."""
    torch.manual_seed(3)
    model = mlp()
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=not keep)
    for step in range(3):
        reference = copy.deepcopy(model)
        x = torch.randn(6, 3, dtype=torch.float64)
        psm.zero_grad()
        out = psm(x)
        squares(out).mean().backward(retain_graph=True)
        sines(out).mean().backward()
        expected = norms_of(per_sample(reference, x, sines))
        found = psm.per_sample_norms()
        for n in expected:
            assert_close(found[n], expected[n], f"step {step}, {n}")
        if keep:
            both = per_sample(reference, x, squares, sines)
            for n, p in model.named_parameters():
                assert_close(p.grad_sample, both[n], f"step {step}, grad_sample {n}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


# -- item 8: random draws in layers whose forward pergrad runs again ------------------------------------


def encoder() -> nn.Module:
    torch.manual_seed(4)
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).double()  # dropout=0.1


def test_attention_dropout_is_refused_in_the_forward_naming_the_layer_and_the_fix() -> None:
    model = encoder()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    with pytest.raises(
        UnsupportedLayerError,
        match=r"layer 'self_attn' \(MultiheadAttention\): it draws a dropout mask on its attention weights "
        r"\(dropout=0.1\) in training mode.*set model.get_submodule\('self_attn'\).dropout = 0.0",
    ):
        psm(torch.randn(3, 4, 8, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())
    psm.remove()


@pytest.mark.parametrize("keep", [True, False])
def test_the_fix_trains_with_the_other_dropouts_exactly(keep: bool) -> None:
    """``self_attn.dropout = 0``: the layer's other dropouts (``nn.Dropout`` modules between hooked layers)
    draw their masks in the forward, and the per-sample gradients are those of that forward (the
    reference: the same masks, drawn from the same seed, each sample's loss through the batched graph)."""
    model = encoder()
    model.self_attn.dropout = 0.0
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    for step in range(3):
        reference = copy.deepcopy(model)
        x = torch.randn(3, 4, 8, dtype=torch.float64)
        torch.manual_seed(100 + step)
        out = reference(x)
        params = dict(reference.named_parameters())
        rows = [torch.autograd.grad(squares(out)[i], list(params.values()), retain_graph=True) for i in range(3)]
        g = {n: torch.stack([row[k] for row in rows]) for k, n in enumerate(params)}
        psm.zero_grad()
        torch.manual_seed(100 + step)
        squares(psm(x)).mean().backward()
        assert_grads(model, {n: t.mean(0) for n, t in clip(g).items()}, f"step {step}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    model.eval()  # the attention's dropout back on: eval mode draws nothing
    model.self_attn.dropout = 0.1
    psm(torch.randn(3, 4, 8, dtype=torch.float64)).sum().backward()
    psm.remove()


class Custom(nn.Module):
    """Raw parameters and a dropout inside: computed by the fallback as one unit."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.functional = functional
        self.drop = nn.Dropout(0.0 if functional else 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.w.T
        return F.dropout(h, 0.5, self.training) if self.functional else self.drop(h)


def test_a_dropout_module_inside_a_fallback_module_is_refused_in_the_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Custom(functional=False), nn.Linear(4, 2)).double()
    psm = PerSampleModule(model, fallback=True)
    with pytest.raises(
        UnsupportedLayerError,
        match=r"layer '1' \(Custom\): its submodule '1.drop' \(Dropout\) draws a dropout mask \(p=0.5\).*"
        r"model.get_submodule\('1.drop'\).p = 0.0",
    ):
        psm(torch.randn(4, 3, dtype=torch.float64))
    model[1].drop.p = 0.0  # the fix it names
    torch.manual_seed(5)
    for step in range(2):
        reference = copy.deepcopy(model)
        x = torch.randn(4, 3, dtype=torch.float64)
        psm.zero_grad()
        squares(psm(x)).mean().backward()
        assert_grads(model, {n: g.mean(0) for n, g in per_sample(reference, x, squares).items()}, f"step {step}")
    psm.remove()


@pytest.mark.parametrize("before", ["none", "accumulated"])
def test_a_functional_dropout_raises_in_the_backward_and_leaves_grad_as_it_was(before: str) -> None:
    """``F.dropout`` inside a fallback module is only seen when the fallback runs: the backward raises,
    naming the layer and the cause, and no ``.grad`` keeps autograd's unclipped sum: a ``.grad`` that was
    None is None again, a clipped one from an earlier micro-batch is unchanged."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(3, 3), Custom(functional=True), nn.Linear(4, 2)).double()
    psm = PerSampleModule(model, fallback=True)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    x = torch.randn(4, 3, dtype=torch.float64)
    if before == "accumulated":  # a first micro-batch in eval mode: F.dropout draws nothing
        model.eval()
        squares(psm(x)).mean().backward()
        model.train()
    held = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedLayerError, match=r"layer '1' \(Custom\): the forward of this Custom draws random"):
        squares(psm(x)).mean().backward()
    for n, p in model.named_parameters():
        if held[n] is None:
            assert p.grad is None, n
        else:
            assert_close(p.grad, held[n], n)
    psm.remove()


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


def test_a_shallow_copy_of_the_wrapper_shares_its_state() -> None:
    """``copy.copy`` is the same wrapper under a second name (not a second wrapper of the model, which
    ``__reduce__`` would build and the model's hooks refuse)."""
    psm = PerSampleModule(mlp())
    shallow = copy.copy(psm)
    assert shallow is not psm and shallow.module is psm.module and vars(shallow) == vars(psm)
    shallow.remove()
    assert not owners(psm.module)


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


# -- BatchNorm -> GroupNorm ----------------------------------------------------------------------------


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3)
        self.bn2 = nn.BatchNorm2d(6, eps=1e-3)
        self.bn3 = nn.BatchNorm3d(2, affine=False)
        self.shared = nn.BatchNorm1d(5)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 5), self.shared)])
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn2(self.conv(x)))  # [B, 6, 3, 3]
        h = h + self.bn3(h.reshape(h.shape[0], 2, 3, 3, 3)).reshape(h.shape)
        h = self.blocks[0](h.mean((2, 3)))
        return self.head(self.shared(h))


def test_fix_batchnorm_replaces_every_batch_norm_and_trains_exactly() -> None:
    torch.manual_seed(11)
    model = Norms().double()
    with torch.no_grad():
        model.bn2.weight.uniform_(0.5, 1.5)
        model.bn2.bias.uniform_(-1, 1)
    bn2 = model.bn2
    psm = PerSampleModule(model)
    with pytest.raises(BatchMixingError, match=r"layer 'bn2' \(BatchNorm2d\).*pergrad.fix_batchnorm\(model\)"):
        psm(torch.randn(4, 2, 5, 5, dtype=torch.float64))
    psm.remove()
    assert pergrad.fix_batchnorm(model) is model
    assert isinstance(model.bn2, nn.GroupNorm) and (model.bn2.num_groups, model.bn2.num_channels) == (6, 6)
    assert model.bn2.eps == 1e-3 and torch.equal(model.bn2.weight, bn2.weight) and torch.equal(model.bn2.bias, bn2.bias)
    assert model.bn2.weight.dtype == torch.float64 and model.bn2.training
    assert isinstance(model.bn3, nn.GroupNorm) and not model.bn3.affine and model.bn3.num_groups == 2
    assert model.shared is model.blocks[0][1] and isinstance(model.shared, nn.GroupNorm)  # one, where it sat twice
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    for step in range(3):
        reference = copy.deepcopy(model)
        x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
        psm.zero_grad()
        squares(psm(x)).mean().backward()
        assert_grads(model, {n: g.mean(0) for n, g in clip(per_sample(reference, x, squares)).items()}, f"step {step}")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    psm.remove()


def test_fix_batchnorm_groups_and_its_errors() -> None:
    model = nn.Sequential(nn.Linear(3, 48), nn.BatchNorm1d(48), nn.Linear(48, 12), nn.BatchNorm1d(12))
    assert [
        m.num_groups for m in pergrad.fix_batchnorm(copy.deepcopy(model)).modules() if isinstance(m, nn.GroupNorm)
    ] == [1, 1]
    assert [
        m.num_groups
        for m in pergrad.fix_batchnorm(copy.deepcopy(model), groups=4).modules()
        if isinstance(m, nn.GroupNorm)
    ] == [4, 4]
    halves = pergrad.fix_batchnorm(copy.deepcopy(model), groups=lambda c: c // 2)
    assert [m.num_groups for m in halves.modules() if isinstance(m, nn.GroupNorm)] == [24, 6]
    wide = pergrad.fix_batchnorm(nn.Sequential(nn.Conv2d(1, 48, 1), nn.BatchNorm2d(48), nn.BatchNorm3d(7)))
    assert [m.num_groups for m in wide.modules() if isinstance(m, nn.GroupNorm)] == [24, 7]
    with pytest.raises(ValueError, match=r"layer '3' \(BatchNorm1d\) has 12 channels, which 8 groups do not divide"):
        pergrad.fix_batchnorm(model, groups=8)
    assert isinstance(model[1], nn.BatchNorm1d)  # all or nothing
    root = pergrad.fix_batchnorm(nn.BatchNorm2d(3))
    assert isinstance(root, nn.GroupNorm) and root.num_groups == 3
    with pytest.raises(ValueError, match=r"the root module \(LazyBatchNorm1d\) is lazy"):
        pergrad.fix_batchnorm(nn.LazyBatchNorm1d())
