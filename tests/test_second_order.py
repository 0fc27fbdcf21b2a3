"""Differentiating through per-sample gradients: after ``loss.backward(create_graph=True)``, penalties
built from ``grad_sample``, from the per-sample norms, and from the transformed ``.grad`` have the
gradient torch.func's double differentiation gives, in float64, on every step."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad
from torch.nn.utils import parametrizations, parametrize, prune

from pergrad import PerSampleModule, SecondOrderError, default_registry, transforms

Params = dict[str, Tensor]


class Seq(nn.Module):
    """A layer on [B, T, D] followed by a head on the flattened positions."""

    def __init__(self, layer: nn.Module, positions: int, width: int) -> None:
        super().__init__()
        self.layer, self.head = layer, nn.Linear(positions * width, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer(x)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(torch.tanh(h).flatten(1))


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=True)[0]  # (the math path: torch.func differentiates it twice)


class Tokens(nn.Module):
    def __init__(self, positions: int) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 3), nn.Linear(3 * positions, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x)).flatten(1))


class Tied(nn.Module):
    """An embedding whose weight is also the head's (a tied language-model head), over T positions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(7, 3), nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(x))).mean(1)[:, :2]


class Reused(nn.Module):
    """One Linear called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))).mean(1))


def _model(family: str, t: int) -> tuple[nn.Module, Callable[[int], Tensor]]:
    """A model of ``family`` with ``t`` positions per sample, and a maker of its input batches."""
    if family == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        return model, lambda b: torch.randn(b, 4)
    if family == "linear_seq":
        return Seq(nn.Linear(3, 3), t, 3), lambda b: torch.randn(b, t, 3)
    if family == "conv1d":
        model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * t, 2))
        return model, lambda b: torch.randn(b, 2, t)
    if family == "conv2d":
        model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(2 * t, 2))
        return model, lambda b: torch.randn(b, 2, 1, t)
    if family == "conv_transpose":
        model = nn.Sequential(nn.ConvTranspose1d(2, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * t, 2))
        return model, lambda b: torch.randn(b, 2, t)
    if family == "layer_norm":
        return Seq(nn.LayerNorm(3), t, 3), lambda b: torch.randn(b, t, 3)
    if family == "group_norm":
        model = nn.Sequential(nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * t, 2))
        return model, lambda b: torch.randn(b, 4, t)
    if family == "embedding":
        return Tokens(t), lambda b: torch.randint(0, 7, (b, t))
    if family == "attention":
        return Seq(Attention(4), t, 4), lambda b: torch.randn(b, t, 4)
    if family == "rms_norm":
        return Seq(nn.RMSNorm(3), t, 3), lambda b: torch.randn(b, t, 3)
    if family == "batch_norm_eval":
        model = nn.Sequential(nn.BatchNorm1d(2).eval(), nn.Tanh(), nn.Flatten(), nn.Linear(2 * t, 2))
        return model, lambda b: torch.randn(b, 2, t)
    if family == "hf_conv1d":
        from transformers.pytorch_utils import Conv1D

        return Seq(Conv1D(3, 3), t, 3), lambda b: torch.randn(b, t, 3)
    if family == "tied":
        return Tied(), lambda b: torch.randint(0, 7, (b, t))
    if family == "reused":
        return Reused(), lambda b: torch.randn(b, t, 3)
    if family in ("rnn", "lstm", "gru"):
        cell = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[family]
        return Seq(cell(3, 3, batch_first=True), t, 3), lambda b: torch.randn(b, t, 3)
    raise AssertionError(family)


FAMILIES = [
    "mlp",
    "linear_seq",
    "conv1d",
    "conv2d",
    "conv_transpose",
    "layer_norm",
    "group_norm",
    "embedding",
    "attention",
    "rnn",
    "lstm",
    "gru",
    "tied",
    "reused",
    "rms_norm",
    "batch_norm_eval",
    "hf_conv1d",
]  # fmt: skip  (parametrized layers: PARAMETRIZED; nn.EmbeddingBag: BAGS, against an equivalent model)


def _sample_loss(model: nn.Module) -> Callable[[Params, Tensor, Tensor], Tensor]:
    def f(params: Params, xi: Tensor, yi: Tensor) -> Tensor:
        return (functional_call(model, params, (xi.unsqueeze(0),)) - yi.unsqueeze(0)).pow(2).sum()

    return f


def reference(model: nn.Module, x: Tensor, y: Tensor, penalty: Callable[[Params], Tensor]) -> Params:
    """``d penalty(g_1..g_B) / d theta`` by torch.func: ``grad`` of a function of ``vmap(grad(f_i))``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    one = grad(_sample_loss(model))

    def per_sample(ps: Params) -> Params:  # a loop, not vmap: torch.func cannot vmap the fused RNN kernels
        found = [one(ps, x[i], y[i]) for i in range(x.shape[0])]
        return {k: torch.stack([g[k] for g in found]) for k in ps}

    return grad(lambda ps: penalty(per_sample(ps)))(params)


def sq_norms(g: Params) -> Tensor:
    """``||g_i||^2`` over every parameter: [B]."""
    return torch.stack([t.flatten(1).square().sum(1) for t in g.values()]).sum(0)


def clipped_mean(g: Params, bound: float) -> Params:
    factor = (bound / sq_norms(g).sqrt()).clamp(max=1)
    return {k: (t * factor.view(-1, *([1] * (t.dim() - 1)))).mean(0) for k, t in g.items()}


def close(actual: dict[str, Tensor | None], expected: Params, what: str) -> None:
    for name, want in expected.items():
        got = actual[name]
        assert got is not None, f"{what}: no gradient for {name}"
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10, msg=lambda m, n=name: f"{what} {n}: {m}")


def _setup(family: str, t: int, seed: int = 0) -> tuple[nn.Module, Callable[[int], Tensor]]:
    torch.manual_seed(seed)
    model, inputs = _model(family, t)
    tokens = family in ("embedding", "tied")
    return model.double(), lambda b: inputs(b) if tokens else inputs(b).double()


STEPS = 3  # the shortcuts of later backward passes start at the second


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; each module's own mode back after it."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes.items():
            m.train(training)


def check_steps(
    what: str,
    model: nn.Module,
    inputs: Callable[[int], Tensor],
    psm: PerSampleModule,
    expected_of: Callable[[Params], Tensor],
    got_of: Callable[[], Tensor],
    lr: float = 0.0,
    reference_model: nn.Module | None = None,
) -> None:
    """On ``STEPS`` steps with growing batches: after ``loss.backward(create_graph=True)`` through
    ``psm``, the parameters' gradient of ``got_of()`` is torch.func's gradient of ``expected_of`` of
    the per-sample gradients; then an SGD step of ``lr`` on ``.grad`` (none for 0).

    torch.func differentiates ``reference_model`` (default ``model``: the same function of the same
    parameters, by the same names), after pergrad's step and in eval mode: it sees the state pergrad's
    forward used (spectral norm's power iteration advances ``u``, ``v`` in a forward in train mode, and
    not again in eval mode)."""
    params = dict(model.named_parameters())
    for step in range(STEPS):
        b = 4 + step
        x, y = inputs(b), torch.randn(b, 2, dtype=torch.float64)
        for p in params.values():
            p.grad = None
        ((psm(x) - y).pow(2).sum() / b).backward(create_graph=True)
        got = torch.autograd.grad(got_of(), list(params.values()))
        with evaluating(model if reference_model is None else reference_model) as ref:
            expected = reference(ref, x, y, expected_of)
        close(dict(zip(params, got)), expected, f"{what}, step {step}")
        if lr:
            with torch.no_grad():
                for p in params.values():
                    p -= lr * p.grad  # type: ignore[operator]


def grad_penalty(model: nn.Module) -> Tensor:
    """``sum_p ||p.grad||^2``."""
    return sum(p.grad.square().sum() for p in model.parameters())  # type: ignore[union-attr,return-value]


@pytest.mark.parametrize("t", [15, 17])  # both sides of detach.MANY
@pytest.mark.parametrize("family", FAMILIES)
def test_grad_sample_is_differentiable(family: str, t: int) -> None:
    """``mean_i ||g_i||^2`` from ``grad_sample`` (the per-sample gradient penalty)."""
    model, inputs = _setup(family, t)
    psm = PerSampleModule(model)
    params = dict(model.named_parameters())

    def penalty() -> Tensor:
        return sq_norms({n: p.grad_sample for n, p in params.items()}).mean()  # type: ignore[attr-defined]

    check_steps(family, model, inputs, psm, lambda g: sq_norms(g).mean(), penalty, lr=0.05)


@pytest.mark.parametrize("t", [15, 17])
@pytest.mark.parametrize("family", ["mlp", "linear_seq", "conv1d", "conv_transpose", "layer_norm", "embedding"])
def test_norms_are_differentiable_without_grad_sample(family: str, t: int) -> None:
    """``per_sample_norms()`` with ``keep_grad_sample=False``: the fused (outer-product, Gram) forms."""
    model, inputs = _setup(family, t)
    psm = PerSampleModule(model, keep_grad_sample=False, track_norms=True)

    def penalty() -> Tensor:
        return torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()

    check_steps(family, model, inputs, psm, lambda g: sq_norms(g).mean(), penalty, lr=0.05)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("t", [15, 17])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("embedding", "tied")])  # float inputs
def test_the_penalty_is_differentiable_in_the_inputs(family: str, t: int, keep_grad_sample: bool) -> None:
    """``d/dx mean_i ||g_i||^2``: the per-sample gradients carry the graph back to the model's input too."""
    model, inputs = _setup(family, t)
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample, track_norms=not keep_grad_sample)
    params = dict(model.named_parameters())
    f = _sample_loss(model)
    for step in range(STEPS):
        b = 4 + step
        x, y = inputs(b), torch.randn(b, 2, dtype=torch.float64)
        frozen = {k: p.detach() for k, p in params.items()}

        def penalty_of(xs: Tensor, y: Tensor = y, frozen: Params = frozen, b: int = b) -> Tensor:
            found = [grad(f)(frozen, xs[i], y[i]) for i in range(b)]
            return sq_norms({k: torch.stack([g[k] for g in found]) for k in frozen}).mean()

        expected = grad(penalty_of)(x)
        x.requires_grad_(True)
        for p in params.values():
            p.grad = None
        ((psm(x) - y).pow(2).sum() / b).backward(create_graph=True)
        if keep_grad_sample:
            penalty = sq_norms({n: p.grad_sample for n, p in params.items()}).mean()  # type: ignore[attr-defined]
        else:
            penalty = torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()
        (got,) = torch.autograd.grad(penalty, x)
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10, msg=lambda m, s=step: f"step {s}: {m}")
        with torch.no_grad():
            for p in params.values():
                p -= 0.05 * p.grad  # type: ignore[operator]


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("t", [15, 17])
@pytest.mark.parametrize("family", ["mlp", "linear_seq", "conv1d", "embedding"])
def test_the_clipped_grad_is_differentiable(family: str, t: int, keep_grad_sample: bool) -> None:
    """``||(1/B) sum_i clip(g_i)||^2``: differentiating through per-sample clipping."""
    model, inputs = _setup(family, t)
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample)
    psm.register_transform(model, transforms.clip_norm(0.3))

    def expected(g: Params) -> Tensor:
        return sq_norms({k: v[None] for k, v in clipped_mean(g, 0.3).items()}).sum()

    check_steps(family, model, inputs, psm, expected, lambda: grad_penalty(model), lr=0.01)


def test_a_detached_weight_is_refused_with_the_fix() -> None:
    """A forward that ran a weight detached (after plain backward passes) cannot be differentiated
    through it: a clear error, never a silently constant penalty."""
    model, inputs = _setup("conv1d", 17)
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(1.0))
    for _ in range(2):
        x, y = inputs(4), torch.randn(4, 2, dtype=torch.float64)
        ((psm(x) - y).pow(2).sum() / 4).backward()
    x = inputs(4)
    with pytest.raises(SecondOrderError, match=r"ran its weight detached.*detach_transformed=False"):
        ((psm(x) - y).pow(2).sum() / 4).backward(create_graph=True)
    # from then on nothing runs detached: the next create_graph backward works
    ((psm(x) - y).pow(2).sum() / 4).backward(create_graph=True)
    assert all(p.grad is not None and p.grad.requires_grad for p in model.parameters())


def test_statistics_are_differentiable() -> None:
    """``statistics().trace_variance`` (``(1/B) sum_i ||g_i||^2 - ||g||^2``) without building g_i."""
    model, inputs = _setup("linear_seq", 17)
    psm = PerSampleModule(model, keep_grad_sample=False, track_statistics={"trace_variance"})

    def trace_variance(g: Params) -> Tensor:
        mean = {k: v.mean(0, keepdim=True) for k, v in g.items()}
        return sq_norms(g).mean() - sq_norms(mean).sum()

    check_steps("trace_variance", model, inputs, psm, trace_variance, lambda: psm.statistics().trace_variance)


def test_a_user_transform_is_differentiated_through() -> None:
    """A transform written for one sample (vectorised by pergrad) carries the graph into ``.grad``."""
    model, inputs = _setup("mlp", 1)
    psm = PerSampleModule(model)
    psm.register_transform(model[0].weight, lambda g: g / (1 + g.square().sum()))

    def objective(g: Params) -> Tensor:
        w = g["0.weight"]
        t = w / (1 + w.flatten(1).square().sum(1)).view(-1, 1, 1)
        return t.mean(0).square().sum() + sum(v.mean(0).square().sum() for k, v in g.items() if k != "0.weight")

    check_steps("a user transform", model, inputs, psm, objective, lambda: grad_penalty(model))


def test_a_transform_that_leaves_the_graph_is_refused() -> None:
    model, inputs = _setup("mlp", 1)
    psm = PerSampleModule(model)
    psm.register_transform(model[0].weight, lambda g: g.detach() * 2)
    x, y = inputs(4), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(
        SecondOrderError, match=r"transform registered for parameter '0.weight' returned .* no autograd"
    ):
        ((psm(x) - y).pow(2).sum() / 4).backward(create_graph=True)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


def test_a_rule_that_leaves_the_graph_is_refused() -> None:
    registry = default_registry.copy()

    @registry.register(Scale)
    def scale_rule(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
        return {"w": (a * d).detach()}  # [n, 3]: right values, off the graph

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Scale(), nn.Tanh(), nn.Linear(3, 2)).double()
    psm = PerSampleModule(model, rules=registry)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ((psm(x) - y).pow(2).sum() / 4).backward()  # first order: fine
    with pytest.raises(SecondOrderError, match=r"rule .*scale_rule for layer '1' \(Scale\) returned 'w' with no"):
        ((psm(x) - y).pow(2).sum() / 4).backward(create_graph=True)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("family", ["mlp", "linear_seq", "conv1d"])
def test_the_penalty_backward_is_autograds(family: str, keep_grad_sample: bool) -> None:
    """``loss.backward(create_graph=True)`` then ``(lam * penalty).backward()``: the second backward runs
    through pergrad's layers again, but it differentiates the penalty, not per-sample losses: pergrad
    stays out (``.grad`` += autograd's d penalty; ``grad_sample`` and the clipped part untouched)."""
    model, inputs = _setup(family, 17)
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample, track_norms=True)
    psm.register_transform(model, transforms.clip_norm(0.3))
    names = dict(model.named_parameters())
    lam = 0.1
    for step in range(STEPS):
        b = 4 + step
        x, y = inputs(b), torch.randn(b, 2, dtype=torch.float64)
        penalty_grad = reference(model, x, y, lambda g: sq_norms(g).mean())
        params = {k: p.detach() for k, p in names.items()}
        one = grad(_sample_loss(model))
        per_sample = [one(params, x[i], y[i]) for i in range(b)]
        g = {k: torch.stack([s[k] for s in per_sample]) for k in names}
        for p in names.values():
            p.grad = None
        ((psm(x) - y).pow(2).sum() / b).backward(create_graph=True)
        norms = psm.per_sample_norms()
        penalty = torch.stack([n.square() for n in norms.values()]).sum(0).mean()
        assert all(bool((n > 0).all()) for n in norms.values())  # (a norm of 0: sqrt has no derivative)
        first = {k: p.grad.detach().clone() for k, p in names.items()}  # type: ignore[union-attr]
        kept = {k: p.grad_sample.detach().clone() for k, p in names.items()} if keep_grad_sample else {}
        (lam * penalty).backward()
        for k, p in names.items():
            want = clipped_mean(g, 0.3)[k] + lam * penalty_grad[k]
            torch.testing.assert_close(first[k], clipped_mean(g, 0.3)[k], rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(
                p.grad, want, rtol=1e-8, atol=1e-10, msg=lambda m, k=k, s=step: f"step {s} {k}: {m}"
            )
            if keep_grad_sample:
                torch.testing.assert_close(p.grad_sample, kept[k], rtol=0, atol=0)  # type: ignore[attr-defined]
        with torch.no_grad():
            for p in names.values():
                p -= 0.01 * p.grad  # type: ignore[operator]


# -- parametrized layers: torch.func's reference runs the parametrizations inside functional_call --------


class ScaleBy(nn.Module):
    """A user parametrization with a parameter of its own: ``W = base * scale`` (one scale per row)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.6, 1.4, rows).unsqueeze(1))

    def forward(self, base: Tensor) -> Tensor:
        return base * self.scale


class OutProj(nn.Module):
    """nn.MultiheadAttention (the fallback: torch.func reruns it) with a weight-normed out_proj."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        parametrizations.weight_norm(self.attn.out_proj)
        self.head = nn.Linear(4 * positions, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.attn(x, x, x, need_weights=True)[0]).flatten(1))


def _parametrized_model(family: str, t: int) -> tuple[nn.Module, Callable[[int], Tensor]]:
    """A model of ``t`` positions per sample whose first layer is parametrized as ``family`` says."""
    seq = lambda b: torch.randn(b, t, 3)  # noqa: E731
    linear = nn.Linear(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy weight_norm is deprecated
        if family == "weight_norm":
            return Seq(parametrizations.weight_norm(linear), t, 3), seq
        if family == "weight_norm_conv1d":
            conv = parametrizations.weight_norm(nn.Conv1d(2, 2, 3, padding=1))
            return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(2 * t, 2)), lambda b: torch.randn(b, 2, t)
        if family == "orthogonal":
            return Seq(parametrizations.orthogonal(linear), t, 3), seq
        if family == "user":
            parametrize.register_parametrization(linear, "weight", ScaleBy(3))
            return Seq(linear, t, 3), seq
        if family == "spectral_norm":
            return Seq(parametrizations.spectral_norm(linear, n_power_iterations=2), t, 3), seq
        if family == "legacy_weight_norm":
            return Seq(nn.utils.weight_norm(linear), t, 3), seq
        if family == "legacy_spectral_norm":
            return Seq(nn.utils.spectral_norm(linear, n_power_iterations=2), t, 3), seq
        if family == "prune":
            return Seq(prune.l1_unstructured(linear, "weight", amount=0.3), t, 3), seq
    if family == "attention_out_proj":
        return OutProj(t), lambda b: torch.randn(b, t, 4)
    raise AssertionError(family)


PARAMETRIZED = [
    "weight_norm",
    "weight_norm_conv1d",
    "orthogonal",
    "user",
    "spectral_norm",
    "legacy_weight_norm",
    "legacy_spectral_norm",
    "prune",
    "attention_out_proj",
]  # fmt: skip  (spectral norm in train mode: check_steps' reference runs in eval mode, on the forward's u, v)


def _setup_parametrized(family: str, t: int) -> tuple[nn.Module, Callable[[int], Tensor]]:
    torch.manual_seed(0)
    model, inputs = _parametrized_model(family, t)
    return model.double(), lambda b: inputs(b).double()


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch.func on attention
@pytest.mark.parametrize("t", [15, 17])  # both sides of detach.MANY
@pytest.mark.parametrize("family", PARAMETRIZED)
def test_parametrized_grad_sample_is_differentiable(family: str, t: int) -> None:
    """``mean_i ||g_i||^2`` from the original tensors' ``grad_sample``: ``J_P(theta)^T g_i(W)`` is
    differentiated in ``theta`` through ``J_P`` and through ``g_i(W)``."""
    model, inputs = _setup_parametrized(family, t)
    psm = PerSampleModule(model)
    params = dict(model.named_parameters())

    def penalty() -> Tensor:
        return sq_norms({n: p.grad_sample for n, p in params.items()}).mean()  # type: ignore[attr-defined]

    check_steps(family, model, inputs, psm, lambda g: sq_norms(g).mean(), penalty, lr=0.05)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("t", [15, 17])
@pytest.mark.parametrize("family", PARAMETRIZED)
def test_parametrized_norms_are_differentiable_without_grad_sample(family: str, t: int) -> None:
    """``per_sample_norms()`` with ``keep_grad_sample=False``."""
    model, inputs = _setup_parametrized(family, t)
    psm = PerSampleModule(model, keep_grad_sample=False, track_norms=True)

    def penalty() -> Tensor:
        return torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()

    check_steps(family, model, inputs, psm, lambda g: sq_norms(g).mean(), penalty, lr=0.05)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("t", [15, 17])
@pytest.mark.parametrize("family", PARAMETRIZED)
def test_parametrized_clipped_grad_is_differentiable(family: str, t: int, keep_grad_sample: bool) -> None:
    """``||(1/B) sum_i clip(g_i)||^2`` over the original tensors."""
    model, inputs = _setup_parametrized(family, t)
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample)
    psm.register_transform(model, transforms.clip_norm(0.3))

    def expected(g: Params) -> Tensor:
        return sq_norms({k: v[None] for k, v in clipped_mean(g, 0.3).items()}).sum()

    check_steps(family, model, inputs, psm, expected, lambda: grad_penalty(model), lr=0.01)


class Positions(nn.Module):
    """Token embeddings plus weight-normed position embeddings of ``arange(T)`` (an input shared by the
    batch, ``pergrad._core.shortcuts.shared``), under a spectral-normed head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.out = nn.Embedding(7, 4), nn.Embedding(20, 4), nn.Linear(4, 2)
        parametrizations.weight_norm(self.pos)
        parametrizations.spectral_norm(self.out)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))).sum(1)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("t", [15, 17])
def test_a_parametrized_layer_on_an_input_shared_by_the_batch_is_differentiable(t: int, keep_grad_sample: bool) -> None:
    """The shared input's pull-back and the parametrization's, one after the other, both on the graph."""
    torch.manual_seed(5)
    model = Positions().double()
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample)
    psm.register_transform(model, transforms.clip_norm(0.3))

    def expected(g: Params) -> Tensor:
        return sq_norms({k: v[None] for k, v in clipped_mean(g, 0.3).items()}).sum()

    inputs = lambda b: torch.randint(0, 7, (b, t))  # noqa: E731
    check_steps("shared and parametrized", model, inputs, psm, expected, lambda: grad_penalty(model), lr=0.01)


class Cube(torch.autograd.Function):
    """``w^3``, with a backward that writes into a fresh tensor in place: autograd differentiates it,
    but it has no batching rule, so pergrad pulls the samples back one at a time (``parametrized._vjp``)."""

    @staticmethod
    def forward(w: Tensor) -> Tensor:
        return w * w * w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (w,) = ctx.saved_tensors
        return torch.zeros_like(w).add_(3 * w * w * g)


class Cubed(nn.Module):
    def forward(self, base: Tensor) -> Tensor:
        return Cube.apply(base)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_a_parametrization_pulled_back_one_sample_at_a_time_is_differentiable(keep_grad_sample: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    parametrize.register_parametrization(linear, "weight", Cubed())
    model = Seq(linear, 17, 3).double()
    psm = PerSampleModule(model, keep_grad_sample=keep_grad_sample)
    psm.register_transform(model, transforms.clip_norm(0.3))

    def expected(g: Params) -> Tensor:
        return sq_norms({k: v[None] for k, v in clipped_mean(g, 0.3).items()}).sum()

    inputs = lambda b: torch.randn(b, 17, 3, dtype=torch.float64)  # noqa: E731
    check_steps("a per-sample pull-back", model, inputs, psm, expected, lambda: grad_penalty(model), lr=0.01)


# -- nn.EmbeddingBag: torch has no derivative of _embedding_bag_backward, so torch.func differentiates an
# -- equivalent model: the same weight read by F.embedding, then each bag's sum, mean or max


class Bags(nn.Module):
    """An nn.EmbeddingBag over ``[B, L]`` tokens (one bag per sample) and a head. ``form``: the 2-D
    input, or the flattened 1-D input with ``offsets`` and ``per_sample_weights`` (mode sum)."""

    def __init__(self, mode: str, form: str, padding_idx: int | None) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(7, 3, mode=mode, padding_idx=padding_idx), nn.Linear(3, 2)
        self.form = form

    def forward(self, x: Tensor) -> Tensor:
        if self.form == "2d":
            h = self.bag(x)
        else:
            offsets = torch.arange(0, x.numel(), x.shape[1])
            h = self.bag(x.flatten(), offsets, per_sample_weights=entry_weights(x).flatten())
        return self.head(torch.tanh(h))


def entry_weights(x: Tensor) -> Tensor:
    """The per-sample weights of the weighted bags: a function of the tokens."""
    return 1 / (1 + x.to(torch.float64))


class Unbagged(nn.Module):
    """``Bags`` as F.embedding and a reduction over each bag: the same function of the same parameters
    (by the same names), which torch.func can differentiate twice."""

    def __init__(self, bags: Bags) -> None:
        super().__init__()
        self.bag, self.head, self.form = bags.bag, bags.head, bags.form

    def forward(self, x: Tensor) -> Tensor:
        bag = self.bag
        assert isinstance(bag, nn.EmbeddingBag)
        e = nn.functional.embedding(x, bag.weight)  # [B, L, e]
        keep = torch.ones_like(x, dtype=torch.bool) if bag.padding_idx is None else x != bag.padding_idx
        if bag.mode == "max":
            h = e.masked_fill(~keep.unsqueeze(2), float("-inf")).max(1).values
        else:
            w = keep.to(e.dtype) if self.form == "2d" else entry_weights(x) * keep
            h = (e * w.unsqueeze(2)).sum(1)
            if bag.mode == "mean":
                h = h / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(torch.tanh(h))


BAGS = {
    "sum": ("sum", "2d", None),
    "mean_padding": ("mean", "2d", 0),
    "max": ("max", "2d", None),
    "weighted_offsets": ("sum", "offsets", None),
}


@pytest.mark.parametrize("penalty", ["grad_sample", "norms", "clipped_materialised", "clipped_fused"])
@pytest.mark.parametrize("bags", sorted(BAGS))
def test_embedding_bag_is_differentiable(bags: str, penalty: str) -> None:
    """The per-sample gradient penalty from ``grad_sample`` or from ``per_sample_norms()``
    (``keep_grad_sample=False``), and the clipped ``.grad`` penalty, materialised and fused."""
    torch.manual_seed(0)
    model = Bags(*BAGS[bags]).double()
    params = dict(model.named_parameters())
    keep = penalty in ("grad_sample", "clipped_materialised")
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=not keep)

    def inputs(b: int) -> Tensor:
        return torch.randint(0, 7, (b, 5))

    if penalty.startswith("clipped"):
        psm.register_transform(model, transforms.clip_norm(0.3))

    def expected(g: Params) -> Tensor:
        if penalty.startswith("clipped"):
            return sq_norms({k: v[None] for k, v in clipped_mean(g, 0.3).items()}).sum()
        return sq_norms(g).mean()

    def got_of() -> Tensor:
        if penalty.startswith("clipped"):
            return grad_penalty(model)
        if penalty == "norms":
            return torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()
        return sq_norms({n: p.grad_sample for n, p in params.items()}).mean()  # type: ignore[attr-defined]

    check_steps(bags, model, inputs, psm, expected, got_of, lr=0.05, reference_model=Unbagged(model))
