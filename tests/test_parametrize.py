"""Layers parametrized with ``torch.nn.utils.parametrize`` (weight_norm, spectral_norm, orthogonal,
a user's own parametrization): per-sample gradients of the ORIGINAL tensors, checked against a
per-sample autograd loop in float64 over several optimizer steps, materialised and fused."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize, prune

from pergrad import HookStateError, PerSampleModule, UnsupportedLayerError, transforms
from tests.reference import assert_close

B = 5


class Gain(nn.Module):
    """A user parametrization with a trainable parameter of its own: ``W = gain * X``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.gain * x


class LowRank(nn.Module):
    """A user parametrization from two tensors: ``W = U @ V`` (``right_inverse`` returns both)."""

    def forward(self, u: Tensor, v: Tensor) -> Tensor:
        return u @ v

    def right_inverse(self, w: Tensor) -> tuple[Tensor, Tensor]:
        return w[:, :2].clone(), torch.linalg.pinv(w[:, :2]) @ w


class Symmetric(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _linear_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _conv_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3), nn.Flatten(), nn.Linear(27, 2)
    ).double()


PARAMETRIZE: dict[str, Callable[[nn.Module], object]] = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": lambda m: parametrizations.spectral_norm(m, n_power_iterations=2),
    "orthogonal": parametrizations.orthogonal,
    "gain": lambda m: parametrize.register_parametrization(m, "weight", Gain()),
    "low_rank": lambda m: parametrize.register_parametrization(m, "weight", LowRank()),
    "bias_and_weight": lambda m: (
        parametrize.register_parametrization(m, "bias", Gain()),
        parametrizations.weight_norm(m),
    ),
}


def build(kind: str, conv: bool) -> nn.Module:
    """A model whose first layer is parametrized (its others plain, so detaching has candidates)."""
    model = _conv_model() if conv else _linear_model()
    if kind == "orthogonal" and not conv:
        PARAMETRIZE[kind](model[2])  # [3, 4]: a non-square orthogonal weight
    PARAMETRIZE[kind](model[0])
    return model


def batch(conv: bool, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (B, 2, 5, 5) if conv else (B, 4)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(B, 2, generator=g, dtype=torch.float64)


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).pow(2).sum()


def loop_reference(model: nn.Module, x: Tensor, target: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: each sample's own gradient by one autograd backward per sample, of a
    copy of the model in eval mode, which evaluates spectral norm with the u, v of the training
    forward that just ran (training mode would run its power iteration once per sample)."""
    return per_sample_loop(copy.deepcopy(model).eval(), x, target)


def per_sample_loop(ref: nn.Module, x: Tensor, target: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: one autograd backward of ``ref`` per sample."""
    grads: dict[str, list[Tensor]] = {}
    for i in range(x.shape[0]):
        ref.zero_grad()
        loss_of(ref(x[i : i + 1]), target[i : i + 1]).backward()
        for name, p in ref.named_parameters():
            if p.requires_grad:
                grads.setdefault(name, []).append(p.grad.clone() if p.grad is not None else torch.zeros_like(p))
    return {name: torch.stack(g) for name, g in grads.items()}


def clipped_mean(ref: dict[str, Tensor], max_norm: float, size: int = B) -> dict[str, Tensor]:
    norms = torch.stack([g.reshape(size, -1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
    factor = (max_norm / norms).clamp(max=1)
    return {name: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for name, g in ref.items()}


def sgd(model: nn.Module, lr: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
@pytest.mark.parametrize("kind", sorted(PARAMETRIZE))
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_parametrized_layers_are_exact(kind: str, conv: bool, keep_grad_sample: bool) -> None:
    """Root clipping sees the gradients of the original tensors; ``grad_sample`` sits on them. The
    plain layers' weights run detached from the second step on; the parametrized ones never do."""
    torch.manual_seed(0)
    model = build(kind, conv)
    names_before = list(model.state_dict())
    max_norm = 0.7
    with PerSampleModule(model, keep_grad_sample=keep_grad_sample, track_norms=True) as psm:
        psm.register_transform(model, transforms.clip_norm(max_norm))
        originals = {n for n in dict(model.named_parameters()) if "parametrizations" in n}
        assert originals
        for step in range(3):
            x, target = batch(conv, step)
            model.zero_grad()
            (loss_of(psm(x), target) / B).backward()
            ref = loop_reference(model, x, target)
            assert set(ref) == set(dict(model.named_parameters()))
            expected = clipped_mean(ref, max_norm)
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step} {name}.grad")
                if keep_grad_sample:
                    assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
                else:
                    assert not hasattr(p, "grad_sample")
            norms = psm.per_sample_norms()
            for name in originals:
                assert_close(norms[name], ref[name].reshape(B, -1).norm(dim=1), f"step {step} norm {name}")
            detached = psm._engine.detacher.current
            if step > 0:
                assert model[-1].weight in detached  # the plain last layer: detached
            assert not any(p in detached for n, p in model.named_parameters() if n.startswith("0."))
            sgd(model)
    assert list(model.state_dict()) == names_before


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
def test_spectral_norm_power_iteration_runs_once_per_forward(conv: bool) -> None:
    """Trained with pergrad or with plain autograd, spectral norm's u and v and every parameter
    follow the same path: pergrad's pull-back reuses the forward's u, v and runs no iteration."""
    torch.manual_seed(1)
    model = build("spectral_norm", conv)
    plain = copy.deepcopy(model)
    with PerSampleModule(model) as psm:
        for step in range(3):
            x, target = batch(conv, step)
            for m, run in ((model, psm), (plain, plain)):
                m.zero_grad()
                (loss_of(run(x), target) / B).backward()
                sgd(m)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert_close(a, b, name)


class Scaled(nn.Module):
    """A custom module (a raw parameter, so ``fallback=True`` computes it as one unit) around a
    spectral-normed Linear: the fallback runs the subtree again, but not its parametrization."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.lin = nn.Linear(4, 3).double()
        parametrizations.spectral_norm(self.lin, n_power_iterations=1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class Attention(nn.Module):
    """nn.MultiheadAttention (computed as one unit by torch.func) with a spectral-normed out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True).double()
        parametrizations.spectral_norm(self.attn.out_proj, n_power_iterations=1)
        self.head = nn.Linear(4, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch.func on attention
@pytest.mark.parametrize(
    ("make", "fallback", "shape", "out"),
    [(lambda: nn.Sequential(Scaled(), nn.Linear(3, 2).double()), True, (B, 4), 2), (Attention, False, (B, 3, 4), 2)],
    ids=["fallback", "multihead_attention"],
)
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_parametrized_submodule_of_a_module_computed_as_one_unit(
    make: Callable[[], nn.Module], fallback: bool, shape: tuple[int, ...], out: int, keep_grad_sample: bool
) -> None:
    """Exact, and spectral norm's u, v follow plain training: torch.func reruns the unit's forward
    with the tensors the forward computed, not with another power iteration."""
    torch.manual_seed(6)
    model = make()
    plain = copy.deepcopy(model)
    with PerSampleModule(model, fallback=fallback, keep_grad_sample=keep_grad_sample) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, target = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(B, out, generator=g)
            model.zero_grad()
            (loss_of(psm(x), target.double()) / B).backward()
            ref = loop_reference(model, x, target.double())
            expected = clipped_mean(ref, 0.5)
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step} {name}.grad")
                if keep_grad_sample:
                    assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            plain(x)  # a training forward: one power iteration, as in pergrad's forward
            clipped = clipped_mean(loop_reference(plain, x, target.double()), 0.5)  # with plain's own u, v
            for name, q in plain.named_parameters():
                q.grad = clipped[name]
            sgd(model)
            sgd(plain)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert_close(a, b, name)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        parametrizations.weight_norm(self.lin)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("cached", [False, True])
def test_layer_called_twice_with_and_without_the_parametrization_cache(cached: bool) -> None:
    torch.manual_seed(2)
    model = Twice()
    x, target = torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        for _ in range(2):
            model.zero_grad()
            if cached:
                with parametrize.cached():
                    out = psm(x)
            else:
                out = psm(x)
            (loss_of(out, target) / B).backward()
            ref = loop_reference(model, x, target)
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], name)
            sgd(model)


def test_parametrization_applied_after_wrapping_and_removal_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(3)
    model = _linear_model()
    x, target = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    psm = PerSampleModule(model)
    parametrizations.weight_norm(model[2])  # rebound at the next forward
    (loss_of(psm(x), target) / B).backward()
    ref = loop_reference(model, x, target)
    for name, p in model.named_parameters():
        assert_close(p.grad_sample, ref[name], name)
    keys = list(model.state_dict())
    psm.remove()
    assert list(model.state_dict()) == keys
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    parametrize.remove_parametrizations(model[2], "weight")
    assert type(model[2]) is nn.Linear


def test_parametrized_layer_without_a_rule_and_with_the_fallback() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 3), nn.PReLU(3)).double()
    parametrize.register_parametrization(model[1], "weight", Gain())
    with pytest.raises(
        UnsupportedLayerError,
        match=r"layer '1' \(torch.nn.modules.activation.PReLU, parametrized\) has trainable parameters "
        r"\['parametrizations.weight.original', 'parametrizations.weight.0.gain'\] but no per-sample "
        r"rule: .*register_rule\(PReLU\).*fallback=True",
    ):
        PerSampleModule(model)
    x, target = torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    with PerSampleModule(model, fallback=True) as psm:
        for _ in range(2):
            model.zero_grad()
            (loss_of(psm(x), target) / B).backward()
            ref = loop_reference(model, x, target)
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], name)
            sgd(model)


class ReadsTwice(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight) + nn.functional.linear(x, self.weight.tanh())


def test_weight_computed_twice_in_one_call_is_refused() -> None:
    from pergrad import RuleRegistry, default_registry, rules

    registry: RuleRegistry = default_registry.copy()
    registry.register(ReadsTwice)(rules.linear)
    layer = ReadsTwice(3, 3, bias=False).double()
    parametrize.register_parametrization(layer, "weight", Symmetric())
    with (
        PerSampleModule(nn.Sequential(layer), rules=registry) as psm,
        pytest.raises(HookStateError, match=r"layer '0' \(ParametrizedReadsTwice\) computed its parametrized "),
    ):
        psm(torch.randn(B, 3, dtype=torch.float64))


class Positions(nn.Module):
    """Token and position embeddings, the position one weight-normed and called on ``arange(T)``
    (an input shared by the batch), under a spectral-normed head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(7, 4), nn.Embedding(6, 4), nn.Linear(4, 2)
        parametrizations.weight_norm(self.pos)
        parametrizations.spectral_norm(self.out)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))).sum(1)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_parametrized_layer_on_an_input_shared_by_the_batch(keep_grad_sample: bool) -> None:
    torch.manual_seed(5)
    model = Positions().double()
    with PerSampleModule(model, keep_grad_sample=keep_grad_sample) as psm:
        psm.register_transform(model, transforms.clip_norm(0.3))
        for step, length in enumerate((B, 3, B)):  # as many positions as samples on two steps
            g = torch.Generator().manual_seed(step)
            ids, target = torch.randint(0, 7, (B, length), generator=g), torch.randn(B, 2, dtype=torch.float64)
            model.zero_grad()
            (loss_of(psm(ids), target) / B).backward()
            ref = loop_reference(model, ids, target)
            expected = clipped_mean(ref, 0.3)
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step} {name}.grad")
                if keep_grad_sample:
                    assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            sgd(model)


# -- torch's hook-based reparametrizations: prune, the legacy weight_norm and spectral_norm ---------


def _prune_l1(m: nn.Module) -> None:
    prune.l1_unstructured(m, "weight", amount=0.4)


def _prune_twice_and_bias(m: nn.Module) -> None:
    """Two prunings of the weight (a PruningContainer), one of the bias."""
    prune.random_structured(m, "weight", amount=1, dim=0)
    prune.l1_unstructured(m, "weight", amount=0.3)
    prune.random_unstructured(m, "bias", amount=0.4)


HOOKED: dict[str, Callable[[nn.Module], object]] = {
    "prune": _prune_l1,
    "prune_twice_and_bias": _prune_twice_and_bias,
    "legacy_weight_norm": nn.utils.weight_norm,
    "legacy_spectral_norm": lambda m: nn.utils.spectral_norm(m, n_power_iterations=2),
}


def build_hooked(kind: str, conv: bool) -> nn.Module:
    """A model whose first layer is reparametrized by a forward pre-hook, the same for every call
    with the same seed (so a fresh build holds the same reparametrization for ``load_state_dict``)."""
    torch.manual_seed(7)
    model = _conv_model() if conv else _linear_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy weight_norm is deprecated
        HOOKED[kind](model[0])
    return model


def hooked_reference(kind: str, conv: bool, model: nn.Module, x: Tensor, target: Tensor) -> dict[str, Tensor]:
    """``loop_reference`` on a fresh build holding ``model``'s state (the legacy hooks keep a
    non-leaf tensor on the module, which ``copy.deepcopy`` refuses)."""
    ref = build_hooked(kind, conv)
    ref.load_state_dict(model.state_dict())
    return per_sample_loop(ref.eval(), x, target)  # spectral norm: the u, v of the forward that just ran


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
@pytest.mark.parametrize("kind", sorted(HOOKED))
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_hook_based_reparametrizations_are_exact(kind: str, conv: bool, keep_grad_sample: bool) -> None:
    """Per-sample gradients of the parameters the hook computes the weight from (``weight_orig``:
    ``mask * g_i(weight)``; ``weight_g``, ``weight_v``), over several steps and batch sizes, under
    root clipping; the plain last layer runs detached from the second step on."""
    model = build_hooked(kind, conv)
    max_norm = 0.7
    with PerSampleModule(model, keep_grad_sample=keep_grad_sample, track_norms=True) as psm:
        psm.register_transform(model, transforms.clip_norm(max_norm))
        for step, size in enumerate((5, 3, 6, 1)):
            x, target = batch(conv, step)
            x, target = torch.cat([x, x.flip(0)])[:size], torch.cat([target, -target])[:size]
            model.zero_grad()
            (loss_of(psm(x), target) / size).backward()
            ref = hooked_reference(kind, conv, model, x, target)
            assert set(ref) == set(dict(model.named_parameters()))
            expected = clipped_mean(ref, max_norm, size)
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step} {name}.grad")
                if keep_grad_sample:
                    assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
                assert_close(psm.per_sample_norms()[name], ref[name].flatten(1).norm(dim=1), f"step {step} {name}")
            if step > 0:
                assert model[-1].weight in psm._engine.detacher.current
            sgd(model)


def test_hook_based_reparametrization_inside_a_module_computed_as_one_unit() -> None:
    """``fallback=True`` reruns the custom module with the weight its Linear's hook computed in the
    forward (no second power iteration), and pulls back to ``weight_orig``."""

    def make() -> nn.Module:
        torch.manual_seed(8)
        model = nn.Sequential(Scaled(), nn.Linear(3, 2).double())
        parametrize.remove_parametrizations(model[0].lin, "weight")
        nn.utils.spectral_norm(model[0].lin, n_power_iterations=1)
        return model

    model = make()
    with PerSampleModule(model, fallback=True) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for step, size in enumerate((4, 2, 5)):
            g = torch.Generator().manual_seed(step)
            x, target = torch.randn(size, 4, generator=g, dtype=torch.float64), torch.randn(size, 2, generator=g)
            model.zero_grad()
            (loss_of(psm(x), target.double()) / size).backward()
            twin = make()
            twin.load_state_dict(model.state_dict())
            ref = per_sample_loop(twin.eval(), x, target.double())
            assert "0.lin.weight_orig" in ref
            expected = clipped_mean(ref, 0.5, size)
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"step {step} {name}")
                assert_close(p.grad, expected[name], f"step {step} {name}.grad")
            sgd(model)


def test_reparametrization_applied_after_wrapping_and_removed_again() -> None:
    """Pruning after wrapping is picked up at the next forward; ``prune.remove`` too."""
    torch.manual_seed(9)
    model = _linear_model()
    x, target = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        for step in range(4):
            if step == 1:
                prune.l1_unstructured(model[2], "weight", amount=0.5)
            if step == 3:
                prune.remove(model[2], "weight")
            model.zero_grad()
            (loss_of(psm(x), target) / B).backward()
            twin = _linear_model()  # holding model's state (deepcopy refuses the pruned weight)
            if step in (1, 2):
                prune.identity(twin[2], "weight")
            twin.load_state_dict(model.state_dict())
            ref = per_sample_loop(twin.eval(), x, target)
            assert ("2.weight_orig" in ref) == (step in (1, 2))
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"step {step} {name}")
            sgd(model)


def test_a_reparametrization_of_a_reparametrized_tensor_is_refused_at_wrap() -> None:
    model = _linear_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        nn.utils.weight_norm(model[2])
    prune.l1_unstructured(model[2], "weight_v", amount=0.5)  # weight from weight_v, weight_v from weight_v_orig
    with pytest.raises(
        UnsupportedLayerError,
        match=r"layer '2' \(Linear\): WeightNorm computes its 'weight' from 'weight_v', which is not a parameter "
        r"of the layer but reparametrized itself; .* torch.nn.utils.prune.remove",
    ):
        PerSampleModule(model)
    prune.remove(model[2], "weight_v")
    PerSampleModule(model).remove()
