"""Hooks in real models: in-place ops, user hooks, reuse, tying, freezing, modes, several backwards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pergrad
from pergrad import HookStateError, PerSampleModule
from tests.reference import assert_close, reference_grad_sample, run_pergrad


@pytest.fixture(autouse=True)
def float64() -> object:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def check_against_reference(model: nn.Module, x: torch.Tensor, loss_reduction: str = "mean") -> None:
    with torch.no_grad():
        target = torch.randn_like(model(x))
    expected = reference_grad_sample(model, x, target)
    with PerSampleModule(model, loss_reduction=loss_reduction) as psm:
        model.zero_grad()
        run_pergrad(psm, x, target, loss_reduction)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert trainable
        for name, p in trainable:
            assert_close(p.grad_sample, expected[name], name)
            reduce = expected[name].mean(0) if loss_reduction == "mean" else expected[name].sum(0)
            assert_close(p.grad, reduce, name)


class ResidualBlock(nn.Module):
    """conv -> ReLU(inplace) -> conv, then ``out += identity`` and an in-place ReLU."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.norm = nn.GroupNorm(1, ch, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += x
        return self.relu(out)


def test_inplace_relu_and_residual_add() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), ResidualBlock(3), nn.Flatten(), nn.Linear(3 * 25, 2))
    check_against_reference(model, torch.randn(4, 2, 5, 5))


def test_inplace_on_linear_output() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3), nn.Tanh())
    check_against_reference(model, torch.randn(6, 4), "sum")


class Twice(nn.Module):
    """One Linear called twice in a forward, and an input/output embedding with a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = torch.tanh(self.lin(torch.tanh(self.lin(h))))
        return self.head(h)


def test_module_called_twice_and_tied_weights() -> None:
    torch.manual_seed(2)
    check_against_reference(Twice(), torch.randint(0, 7, (3, 5)))


def test_frozen_parameters_get_no_grad_sample() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    check_against_reference(model, torch.randn(5, 3))
    assert not hasattr(model[0].weight, "grad_sample")


def test_eval_mode_and_dropout() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Tanh(), nn.Linear(4, 2)).eval()
    check_against_reference(model, torch.randn(5, 3))


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_batch_size_one(loss_reduction: str) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    check_against_reference(model, torch.randn(1, 3), loss_reduction)


def test_batch_second_layout() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Embedding(9, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    x = torch.randint(0, 9, (5, 3))  # [T, B]
    with torch.no_grad():
        target = torch.randn_like(model(x))
    expected = reference_grad_sample(model, x, target, batch_dim=1)
    with PerSampleModule(model, batch_first=False) as psm:
        run_pergrad(psm, x, target, batch_dim=1)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, expected[name], name)


class Rescale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_user_backward_hooks_are_respected() -> None:
    """A full backward hook on a parent that rescales grad_input, and a tensor hook the user adds on a
    layer output: per-sample gradients follow exactly what autograd propagates (checked against a loop
    of one-sample backward passes with the same hooks)."""
    torch.manual_seed(7)
    model = Rescale()
    model.out.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 3.0,))

    def flip(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: g * -2.0)

    model.inner[0].register_forward_hook(flip)
    x, target = torch.randn(4, 3), torch.randn(4, 2)
    expected = {n: [] for n, _ in model.named_parameters()}
    for i in range(4):
        model.zero_grad()
        (model(x[i : i + 1]) - target[i : i + 1]).pow(2).sum().backward()
        for n, p in model.named_parameters():
            expected[n].append(p.grad.clone())
    model.zero_grad()
    with PerSampleModule(model, loss_reduction="sum") as psm:
        run_pergrad(psm, x, target, "sum")
        for n, p in model.named_parameters():
            assert_close(p.grad_sample, torch.stack(expected[n]), n)


def test_retain_graph_twice_adds_like_autograd() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with PerSampleModule(model) as psm:
        loss = psm(x).pow(2).mean()
        loss.backward(retain_graph=True)
        once = {n: (p.grad.clone(), p.grad_sample.clone()) for n, p in model.named_parameters()}
        loss.backward()
        for n, p in model.named_parameters():
            assert_close(p.grad, 2 * once[n][0], n)
            assert_close(p.grad_sample, 2 * once[n][1], n)


def test_micro_batches_accumulate_grad_and_replace_grad_sample() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x1, x2 = torch.randn(5, 3), torch.randn(2, 3)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    plain.load_state_dict(model.state_dict())
    plain(x1).pow(2).mean().backward()
    plain(x2).pow(2).mean().backward()
    with PerSampleModule(model) as psm:
        psm(x1).pow(2).mean().backward()
        psm(x2).pow(2).mean().backward()
        for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert_close(p.grad, q.grad, n)
            assert p.grad_sample.shape[0] == 2


def test_no_grad_forward_keeps_nothing_and_next_step_is_exact() -> None:
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with PerSampleModule(model) as psm:
        with torch.no_grad():
            psm(torch.randn(8, 3))
        assert psm._engine.backwards.current is None
    check_against_reference(model, torch.randn(5, 3))


def test_inputs_are_freed_after_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    refs = []
    with PerSampleModule(model) as psm:
        for _ in range(100):
            x = torch.randn(8, 3)
            refs.append(weakref.ref(x))
            psm(x).pow(2).mean().backward()
            del x
        gc.collect()
        assert sum(r() is not None for r in refs) == 0
        assert psm._engine.backwards.current is None


def test_two_forwards_one_backward_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with PerSampleModule(model) as psm:
        loss = psm(torch.randn(4, 3)).sum() + psm(torch.randn(4, 3)).sum()
        with pytest.raises(HookStateError, match=r"two different forward calls.*concatenate the batches"):
            loss.backward()
    model.zero_grad()
    check_against_reference(model, torch.randn(3, 3))


def test_loss_from_a_forward_before_wrapping_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    loss = model(torch.randn(4, 3)).sum()
    with (
        PerSampleModule(model),
        pytest.raises(
            HookStateError, match=r"parameter '0\.(weight|bias)' received a gradient.*forward run before wrapping"
        ),
    ):
        loss.backward()


def test_autograd_grad_leaves_grad_untouched() -> None:
    """torch.autograd.grad does not accumulate into .grad; neither does pergrad."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3, requires_grad=True)
    with PerSampleModule(model) as psm:
        psm.register_transform(model, lambda g: {k: v * 0 for k, v in g.items()})
        (gx,) = torch.autograd.grad(psm(x).pow(2).sum(), x)
        (expected,) = torch.autograd.grad(model(x).pow(2).sum(), x)
        assert_close(gx, expected)
        assert model[0].weight.grad is None


def test_cross_entropy_mean_matches_autograd_and_torch_func() -> None:
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    expected = reference_grad_sample(model, x, y, loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    plain = [g.clone() for g in torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))]
    with PerSampleModule(model) as psm:
        F.cross_entropy(psm(x), y).backward()
        for (n, p), g in zip(model.named_parameters(), plain, strict=True):
            assert_close(p.grad_sample, expected[n], n)
            assert_close(p.grad, g, n)


class SeqInplace(nn.Module):
    """Linear on [B, T, D] returns a reshaping view; relu_ on it rewrites the view's history."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu_(self.a(x))
        out = self.b(h)
        out += h[..., :2]
        return out


def test_inplace_on_a_view_output() -> None:
    torch.manual_seed(13)
    check_against_reference(SeqInplace(), torch.randn(4, 5, 3))


class FunctionalTie(nn.Module):
    """A parent that uses its embedding's weight directly: pergrad cannot see that use."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.emb(idx), self.emb.weight)


@pytest.mark.parametrize("keep", [True, False])
def test_a_gradient_part_no_layer_produced_is_refused(keep: bool) -> None:
    idx = torch.randint(0, 6, (4, 5))
    with (
        PerSampleModule(FunctionalTie(), keep_grad_sample=keep) as psm,
        pytest.raises(HookStateError, match=r"'emb.weight'.*no hooked layer's output produced.*F.linear"),
    ):
        psm(idx).pow(2).sum().backward()
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        loss = psm(x).pow(2).mean() + 0.1 * model[0].weight.pow(2).sum()  # weight decay in the loss
        with pytest.raises(HookStateError, match=r"'0.weight'.*regulariser such as weight decay"):
            loss.backward()
    with PerSampleModule(model, keep_grad_sample=keep, verify=False) as psm:
        (psm(x).pow(2).mean() + 0.1 * model[0].weight.pow(2).sum()).backward()  # the user opted out


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.w, torch.tanh(x * self.w)


def test_a_gradient_through_an_output_the_rule_does_not_take_names_the_layer_and_the_cause() -> None:
    """A rule registered without output_dims takes the first tensor the layer returns: a loss on the
    second one is refused with that cause, not blamed on a forward run before wrapping."""
    rules = pergrad.registry.default_registry.copy()

    @rules.register(Pair, all_inputs=True)
    def pair(layer: nn.Module, call: pergrad.registry.LayerCall, d: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"w": d * call.args[0]}

    model = nn.Sequential(Pair())
    with PerSampleModule(model, rules=rules) as psm:
        psm(torch.randn(4, 3))[0].sum().backward()  # the first output: taken
        loss = psm(torch.randn(4, 3))[1].sum()
        with pytest.raises(
            HookStateError,
            match=r"parameter '0\.w' received a gradient .* caught no gradient on the first tensor returned by "
            r"layer '0' \(Pair\) .* an output of the layer that its rule does not take",
        ):
            loss.backward()


class Backbone(nn.Module):
    """Token embeddings, with ``positions`` position embeddings (``pos(arange(T))``: shared by the
    batch), then a Linear."""

    def __init__(self, positions: bool) -> None:
        super().__init__()
        self.tok, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)
        self.pos = nn.Embedding(8, 4) if positions else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(ids.shape[1]))
        return torch.tanh(self.mix(h)).mean(1)


class TwoStage(nn.Module):
    def __init__(self, positions: bool) -> None:
        super().__init__()
        self.backbone, self.head = Backbone(positions), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(ids))


class Stages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


@pytest.mark.parametrize("keep", [True, False], ids=["materialised", "fused"])
def test_submodules_called_directly_after_calls_of_the_model(keep: bool) -> None:
    """``model.backbone(x)`` then ``model.head(h)``, after calls of the model with other batch sizes
    or after the previous step's direct calls (of the same size): each direct forward reads its
    batch from its first layer's call, and its backward replaces ``grad_sample``. Exact at every step."""
    torch.manual_seed(12)
    model = Stages().double()
    gen = torch.Generator().manual_seed(0)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        psm.register_transform(model, pergrad.transforms.clip_norm(0.6))
        steps = [(5, "forward"), (3, "none"), (3, "none"), (2, "backward"), (4, "none"), (6, "forward")]
        for step, (b, model_call) in enumerate(steps):
            if model_call == "backward":  # a call of the model with another batch size, backpropagated
                model.zero_grad()
                psm(torch.randn(7, 3, generator=gen, dtype=torch.float64)).pow(2).sum().backward()
            elif model_call == "forward":  # one that is not
                psm(torch.randn(4, 3, generator=gen, dtype=torch.float64))
            x, target = torch.randn(b, 3, generator=gen, dtype=torch.float64), torch.randn(b, 3, generator=gen)
            model.zero_grad()
            out = model.head(model.backbone(x))
            ((out - target).pow(2).sum() / b).backward()
            ref = reference_grad_sample(model, x, target.double())  # (after: it calls the model)
            norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
            factor = (0.6 / norms).clamp(max=1)
            for name, p in model.named_parameters():
                what = f"step {step} (B={b}) {name}"
                if keep:
                    assert_close(p.grad_sample, ref[name], what)
                assert_close(psm.per_sample_norms()[name], ref[name].flatten(1).norm(dim=1), what)
                assert_close(p.grad, (ref[name] * factor.view(-1, *([1] * p.dim()))).mean(0), what)
            assert (model.head.weight in psm._engine.detacher.current) == (step > 0)


def test_a_layer_called_directly_twice_in_one_backward_is_an_error() -> None:
    """Its second direct call starts a forward of its own: the samples of the two are not known to be
    the same, so one backward through both is refused (not summed per sample)."""
    model = TwoStage(positions=False).double()
    with PerSampleModule(model) as psm:
        h = model.backbone(torch.randint(0, 7, (3, 2)))
        loss = model.head(h).sum() + model.head(h.flip(0)).sum()
        with pytest.raises(HookStateError, match=r"two different forward calls.*called directly.*wrap the module"):
            loss.backward()
        model.zero_grad()
        ids = torch.randint(0, 7, (3, 2))
        psm(ids).pow(2).sum().backward()  # through the model: fine again
        assert model.head.weight.grad_sample.shape == (3, 3, 4)


def test_a_layer_called_directly_on_an_input_shared_by_the_batch_is_refused() -> None:
    """The position embedding's input is shared by the batch: which tensors carry the batch is
    followed through the model's forward only. The fix the message gives works."""
    torch.manual_seed(13)
    model = TwoStage(positions=True).double()
    ids = torch.randint(0, 7, (3, 4))
    with (
        PerSampleModule(model) as psm,
        pytest.raises(
            pergrad.SharedInputError,
            match=r"layer 'backbone.pos' \(Embedding\) was called on an input shared by the batch \(shape \(4,\)\) "
            r"outside a call of the wrapped model .* wrap the module you call \(PerSampleModule\(model.backbone\)\)",
        ),
    ):
        psm(ids)  # through the model: fine
        model.head(model.backbone(ids))
    ref = reference_grad_sample(model.backbone, ids, torch.zeros(3, 4, dtype=torch.float64))
    with PerSampleModule(model.backbone) as psm:
        for step in range(3):
            model.zero_grad()
            model.backbone(ids).pow(2).sum().div(3).backward()
            for name, p in model.backbone.named_parameters():
                assert_close(p.grad_sample, ref[name], f"step {step} {name}")
