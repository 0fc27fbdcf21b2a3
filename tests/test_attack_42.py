"""An adversarial review of issue 42 (the attribution feature moved out of the core: projected forms in
``pergrad/attribution/forms``, the projection and factor consumers made lazily by
``pergrad/attribution/tracking.py``): training loops, checkpoint loops, notebooks and LMs that project
while they train, register late, clip, copy, pickle, remove, and score.

References are independent of pergrad's projection code: each sample's gradient by plain autograd, one
sample at a time, on a plain copy of the model kept in step with the wrapped one; the projection as an
explicit matrix built from ``pergrad.attribution.projectors``' documented definition (``P_row ⊗ P_col`` of
seeded Gaussians for kron, the CountSketch / Rademacher matrix otherwise); scores, Grams, TRAK and EK-FAC
by naive float64 formulas. Every case runs several steps, in float64.
"""

from __future__ import annotations

import copy
import io
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PergradError, PerSampleModule, transforms
from pergrad.attribution.projectors import Projector, Spec, gaussian, kron_ranks
from pergrad.errors import ProjectionError, TargetError

Loss = Callable[[Tensor, Tensor], Tensor]  # (output of one or more samples, targets) -> summed loss
ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("float64")  # conftest.py: float64 the default dtype in every test


def close(actual: Tensor | None, expected: Tensor, what: str) -> None:
    assert actual is not None, f"{what}: None"
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-8, atol=1e-10, msg=lambda m: f"{what}: {m}")


def close_grads(model: nn.Module, expected: dict[str, Tensor], what: str) -> None:
    """Every parameter's ``.grad`` against ``expected[name]`` (a parameter missing from ``expected`` fails)."""
    for n, p in model.named_parameters():
        close(p.grad, expected[n], f"{what} {n}.grad")


def summed(g: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: sum_i g_i}``: the ``.grad`` of ``loss_reduction="sum"`` without a transform."""
    return {n: v.sum(0) for n, v in g.items()}


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


def sq(out: Tensor, y: Tensor) -> Tensor:
    return (out - y).pow(2).sum()


def plain(model: nn.Module) -> nn.Module:
    """A copy of ``model`` without any module hook (the wrapper's hooks are not copied with it)."""
    memo: dict[int, object] = {}
    for m in model.modules():
        for name, value in vars(m).items():
            if name.startswith("_") and "hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(model, memo)


def per_sample(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> dict[str, Tensor]:
    """``{name: [B, *shape]}`` by autograd, one sample at a time (zeros where a sample does not reach), on a
    plain copy of ``model``."""
    ref = plain(model)
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    out: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(ref(x[i : i + 1]), y[i : i + 1]), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), grads):
            out[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in out.items()}


def matrix(name: str, shape: tuple[int, ...], spec: Spec) -> Tensor:
    """``P_p`` ``[k, numel]`` from the documented definition (kron: ``P_row ⊗ P_col`` of seeded Gaussians)."""
    numel = math.prod(shape)
    if spec.kind == "kron" and len(shape) >= 2:
        rows, cols = shape[0], numel // shape[0]
        r_row, r_col = kron_ranks(spec.dim, rows, cols)
        row = gaussian(r_row, rows, spec.seed, name, shape, "kron", "row", 0) / math.sqrt(r_row)
        col = gaussian(r_col, cols, spec.seed, name, shape, "kron", "col", 0) / math.sqrt(r_col)
        return torch.kron(row, col)
    return Projector(spec, name, shape).matrix()  # CountSketch or Rademacher: checked against a unit vector below


def features(grads: dict[str, Tensor], names: list[str], spec: Spec) -> Tensor:
    """``sum_p P_p vec(g_i(p))`` ``[B, k]`` of the named parameters."""
    total = 0
    for n in names:
        g = grads[n]
        total = total + g.flatten(1) @ matrix(n, tuple(g.shape[1:]), spec).T
    return total  # type: ignore[return-value]


def clipped_sum(grads: dict[str, Tensor], bound: float) -> dict[str, Tensor]:
    norms = torch.stack([g.flatten(1).square().sum(1) for g in grads.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: (g * factor.view(-1, *([1] * (g.dim() - 1)))).sum(0) for n, g in grads.items()}


def mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=bias), nn.Tanh(), nn.Linear(8, 4))


def batches(steps: int, b: int = 5) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 6, generator=gen), torch.randint(0, 4, (b,), generator=gen)) for _ in range(steps)]


def train_step(psm: PerSampleModule, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, loss: Loss = ce) -> None:
    opt.zero_grad()
    loss(psm(x), y).backward()


# -- the projection's definition itself ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sjlt", "dense"])
def test_sketch_and_dense_matrices_are_what_unit_vectors_project_to(kind: str) -> None:
    spec = Spec(16, kind, 3)
    projector = Projector(spec, "w", (5, 3))
    m = projector.matrix()
    units = torch.eye(15).reshape(15, 5, 3)
    close(projector.apply(units).T, m, "P e_j")
    if kind == "sjlt":
        assert ((m != 0).sum(0) == 1).all() and set(m.unique().tolist()) <= {-1.0, 0.0, 1.0}
    else:
        close(m.abs(), torch.full_like(m, 1 / 4), "dense entries ±1/sqrt(k)")


# -- training loops that project ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_projection_registered_after_training_steps_with_clipping(bias: bool) -> None:
    """A notebook trains with clipping, then decides to project: the consumer is made late."""
    model = mlp(bias)
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_transform(model, transforms.clip_norm(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = Spec(16, "kron", 7)
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches(6)):
        if step == 3:
            psm.register_projection(model, dim=16, seed=7)
        ref.load_state_dict(model.state_dict())
        train_step(psm, opt, x, y)
        g = per_sample(ref, x, y, ce)
        expected = clipped_sum(g, 0.5)
        close_grads(model, expected, f"step {step}")
        if step >= 3:
            close(psm.per_sample_projections()[""], features(g, names, spec), f"step {step} features")
        opt.step()


@pytest.mark.parametrize("kind", ["kron", "sjlt", "dense"])
def test_projection_then_clipping_transform_both_exact_every_step(kind: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection("0", dim=8, kind=kind, seed=1)
    psm.register_projection("2.weight", dim=4, kind=kind, seed=2)
    psm.register_transform(model, transforms.clip_norm(0.3))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step, (x, y) in enumerate(batches(5)):
        ref.load_state_dict(model.state_dict())
        train_step(psm, opt, x, y)
        g = per_sample(ref, x, y, ce)
        expected = clipped_sum(g, 0.3)
        close_grads(model, expected, f"step {step}")
        found = psm.per_sample_projections()
        close(found["0"], features(g, ["0.weight", "0.bias"], Spec(8, kind, 1)), f"step {step} layer 0")
        close(found["2.weight"], features(g, ["2.weight"], Spec(4, kind, 2)), f"step {step} 2.weight")
        opt.step()


@pytest.mark.parametrize("keep", [True, False])
def test_gradless_projection_features_exact_and_no_wrong_grad(keep: bool) -> None:
    """An attribution pass (grads=False): features exact on every step; a .grad written is autograd's."""
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=keep)
    psm.register_projection(model, dim=32, seed=4, grads=False)
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches(4, b=16)):
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        close(psm.per_sample_projections()[""], features(g, names, Spec(32, "kron", 4)), f"step {step}")
        for n, p in model.named_parameters():
            if p.grad is not None:
                close(p.grad, g[n].sum(0), f"step {step} {n}.grad")
        if step >= 1:
            assert model[0].weight.grad is None and model[2].weight.grad is None, "weights should run detached"


def test_gradless_projection_beside_a_clipped_layer() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("0", dim=16, seed=0, grads=False)
    psm.register_transform("2", transforms.clip_norm(0.2))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.3)
    for step, (x, y) in enumerate(batches(5, b=17)):
        ref.load_state_dict(model.state_dict())
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(ref, x, y, ce)
        expected = clipped_sum({n: g[n] for n in ("2.weight", "2.bias")}, 0.2)
        close(model[2].weight.grad, expected["2.weight"], f"step {step} 2.weight.grad")
        close(model[2].bias.grad, expected["2.bias"], f"step {step} 2.bias.grad")
        close(psm.per_sample_projections()["0"], features(g, ["0.weight", "0.bias"], Spec(16)), f"step {step}")
        opt.step()


def test_gradless_projection_and_transform_on_the_same_layer_refused_both_orders() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("0", dim=16, grads=False)
    with pytest.raises(TargetError, match=r"grads=False leaves the \.grad of \['0\.bias', '0\.weight'\]"):
        psm.register_transform(model, transforms.clip_norm(1.0))
    other = mlp()
    psm2 = PerSampleModule(other, loss_reduction="sum")
    psm2.register_transform("0.weight", transforms.clip_norm(1.0))
    with pytest.raises(TargetError, match=r"Register that projection with grads=True"):
        psm2.register_projection(other, dim=16, grads=False)
    # the refused registrations left nothing behind: both wrappers train exactly
    for p2, (x, y) in zip([psm, psm2], batches(2)):
        model_ = p2.module
        model_.zero_grad()
        ce(p2(x), y).backward()
        g = per_sample(model_, x, y, ce)
        for n, p in model_.named_parameters():
            if p.grad is not None and n != "0.weight":
                close(p.grad, g[n].sum(0), n)


# -- per token, reused layers, tied weights ------------------------------------------------------------


class TokenMLP(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.up = nn.Linear(5, 7, bias=bias)
        self.head = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.up(x)))


@pytest.mark.parametrize(("b", "t"), [(15, 15), (3, 16), (2, 17), (16, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_per_token_features_of_each_tokens_own_loss(b: int, t: int, bias: bool) -> None:
    model = TokenMLP(bias)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("up", dim=8, seed=5, per_token=True)
    psm.register_projection("head", dim=8, seed=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    up = [n for n, _ in model.named_parameters() if n.startswith("up")]
    gen = torch.Generator().manual_seed(b * 100 + t)
    for step in range(3):
        x, y = torch.randn(b, t, 5, generator=gen), torch.randint(0, 3, (b, t), generator=gen)
        opt.zero_grad()
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        tokens = psm.per_sample_projections()["up"]
        assert tokens.shape == (b, t, 8)
        expected = torch.zeros(b, t, 8)
        for j in range(t):  # positions do not mix: token j's term is the gradient of its own loss
            gj = per_sample(model, x[:, j : j + 1], y[:, j : j + 1], ce)
            expected[:, j] = features(gj, up, Spec(8, "kron", 5))
        close(tokens, expected, f"step {step} per token")
        close(tokens.sum(1), features(g, up, Spec(8, "kron", 5)), f"step {step} summed")
        close(
            psm.per_sample_projections()["head"], features(g, ["head.weight", "head.bias"], Spec(8, "kron", 6)), "head"
        )
        close_grads(model, summed(g), f"step {step}")
        opt.step()


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 4, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


@pytest.mark.parametrize("shape", [(4, 6), (4, 4, 6), (3, 17, 6), (2, 16, 6)])
@pytest.mark.parametrize("grads", [True, False])
def test_layer_called_twice(shape: tuple[int, ...], grads: bool) -> None:
    model = Twice()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=18, seed=9, grads=grads)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(*shape, generator=gen)
        y = torch.randn(*shape[:-1], 4, generator=gen)
        opt.zero_grad(set_to_none=True)
        sq(psm(x), y).backward()
        g = per_sample(model, x, y, sq)
        close(psm.per_sample_projections()[""], features(g, names, Spec(18, "kron", 9)), f"step {step}")
        if grads:
            close_grads(model, summed(g), f"step {step}")
            opt.step()


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


@pytest.mark.parametrize(("b", "t"), [(4, 4), (2, 15), (3, 16), (2, 17)])
@pytest.mark.parametrize("kind", ["kron", "sjlt"])
def test_tied_lm_with_clipping(b: int, t: int, kind: str) -> None:
    model = TinyLM()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=32, kind=kind, seed=11)
    psm.register_projection("mix", dim=8, kind=kind, seed=12, per_token=kind == "kron")
    psm.register_transform(model, transforms.clip_norm(1.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(t)
    for step in range(4):
        x = torch.randint(0, 11, (b, t), generator=gen)
        y = torch.randint(0, 11, (b, t), generator=gen)
        ref.load_state_dict(model.state_dict())
        opt.zero_grad()
        ce(psm(x), y).backward()
        g = per_sample(ref, x, y, ce)
        expected = clipped_sum(g, 1.0)
        close_grads(model, expected, f"step {step}")
        found = psm.per_sample_projections()
        close(found[""], features(g, names, Spec(32, kind, 11)), f"step {step} whole model")
        mix = found["mix"].sum(1) if kind == "kron" else found["mix"]
        close(mix, features(g, ["mix.weight", "mix.bias"], Spec(8, kind, 12)), f"step {step} mix")
        opt.step()


# -- layers: conv, transposed conv, embedding, with and without bias -------------------------------------


def conv_case(name: str, bias: bool) -> tuple[nn.Module, Callable[[torch.Generator, int], Tensor], int]:
    torch.manual_seed(5)
    if name == "conv1d":
        return (
            nn.Sequential(nn.Conv1d(3, 4, 3, padding=1, bias=bias), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)),
            (lambda g, t: torch.randn(3, 3, t, generator=g)),
            2,
        )
    if name == "conv2d":
        return (
            nn.Sequential(nn.Conv2d(2, 3, 2, stride=2, groups=1, bias=bias), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)),
            (lambda g, t: torch.randn(3, 2, 4, t, generator=g)),
            2,
        )
    if name == "convT":
        return (
            nn.Sequential(
                nn.ConvTranspose2d(2, 4, 3, stride=2, groups=2, bias=bias), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)
            ),
            (lambda g, t: torch.randn(3, 2, 3, t, generator=g)),
            2,
        )
    return (
        nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 5, bias=bias), nn.Flatten(), nn.LazyLinear(2)),
        (lambda g, t: torch.randint(0, 9, (3, t), generator=g)),
        2,
    )


@pytest.mark.parametrize("layer", ["conv1d", "conv2d", "convT", "embedding"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("t", [15, 16, 17])
@pytest.mark.parametrize("kind", ["kron", "dense"])
def test_layers_projected_while_training(layer: str, bias: bool, t: int, kind: str) -> None:
    model, make, out = conv_case(layer, bias)
    gen = torch.Generator().manual_seed(t)
    model(make(gen, t))  # materialise the lazy head
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection("0", dim=8, kind=kind, seed=t)
    psm.register_projection(model, dim=18, kind=kind, seed=1, grads=True)
    psm.register_transform("3", transforms.clip_norm(0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    names = [n for n, _ in model.named_parameters()]
    first = [n for n in names if n.startswith("0.")]
    for step in range(3):
        x = make(gen, t)
        y = torch.randn(x.shape[0], out, generator=gen)
        opt.zero_grad()
        sq(psm(x), y).backward()
        g = per_sample(model, x, y, sq)
        found = psm.per_sample_projections()
        close(found["0"], features(g, first, Spec(8, kind, t)), f"step {step} layer 0")
        close(found[""], features(g, names, Spec(18, kind, 1)), f"step {step} model")
        head = clipped_sum({n: g[n] for n in ("3.weight", "3.bias")}, 0.1)
        close_grads(model, {**summed(g), **head}, f"step {step}")
        opt.step()


# -- copies, pickles, removal, dtype -------------------------------------------------------------------


def factors_reference(model: nn.Module, x: Tensor, y: Tensor, spec: Spec) -> tuple[Tensor, Tensor]:
    """Row and col factors of ``model[2].weight`` (a Linear on [B, F]): ``u_i = P_row d_i``, ``v_i = P_col a_i``."""
    a = torch.tanh(model[0](x)).detach().requires_grad_(False)
    out = model[2](a)
    d = torch.autograd.functional.jacobian(
        lambda o: torch.stack([ce(o[i : i + 1], y[i : i + 1]) for i in range(len(y))]).sum(), out
    )
    shape = tuple(model[2].weight.shape)
    r_row, r_col = kron_ranks(spec.dim, *shape)
    row = gaussian(r_row, shape[0], spec.seed, "2.weight", shape, "kron", "row", 0) / math.sqrt(r_row)
    col = gaussian(r_col, shape[1], spec.seed, "2.weight", shape, "kron", "col", 0) / math.sqrt(r_col)
    u, v = d @ row.T, a @ col.T
    return u.T @ u, v.T @ v


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_wrapper_with_projections_and_factors_keeps_training(how: str) -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_transform("0", transforms.clip_norm(0.4))
    psm.register_projection("2.weight", dim=8, seed=3)
    psm.register_projection("0", dim=8, seed=4, kind="sjlt")
    psm.track_projected_factors("2.weight")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(6)
    for x, y in data[:2]:
        train_step(psm, opt, x, y)
        opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(psm)
    else:
        buffer = io.BytesIO()
        torch.save(psm, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert twin.module is not model
    assert twin.projection_specs() == psm.projection_specs()
    opt2 = torch.optim.SGD(twin.module.parameters(), lr=0.1)
    row, col = torch.zeros(2, 2), torch.zeros(4, 4)
    for step, (x, y) in enumerate(data[2:]):
        for wrapper, optimizer in ((psm, opt), (twin, opt2)):
            net = wrapper.module
            ref = copy.deepcopy(mlp())
            ref.load_state_dict(net.state_dict())
            train_step(wrapper, optimizer, x, y)
            g = per_sample(ref, x, y, ce)
            expected = clipped_sum({n: g[n] for n in ("0.weight", "0.bias")}, 0.4)
            close_grads(net, {**summed(g), **expected}, f"{how} step {step}")
            found = wrapper.per_sample_projections()
            close(found["2.weight"], features(g, ["2.weight"], Spec(8, "kron", 3)), f"{how} step {step}")
            close(found["0"], features(g, ["0.weight", "0.bias"], Spec(8, "sjlt", 4)), f"{how} step {step} 0")
            if wrapper is twin:
                r, c = factors_reference(ref, x, y, Spec(8, "kron", 3))
                row, col = row + r, col + c
            optimizer.step()
        close(twin.module.state_dict()["0.weight"], model.state_dict()["0.weight"], "the twin trains alike")
    found = twin.projected_factors()["2.weight"]
    n = 5 * len(data[2:])
    close(found.row, row / n, "copy's row factor (from the copy's own backwards)")
    close(found.col, col / n, "copy's col factor")


def test_remove_after_projecting_leaves_the_model_as_it_was() -> None:
    model = mlp()
    plain = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection(model, dim=16, grads=False)
    psm.register_projection("2.weight", dim=4)
    psm.track_projected_factors("2.weight")
    for x, y in batches(3, b=17):
        ce(psm(x), y).backward()
    psm.remove()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks, type(m)
    for p in model.parameters():
        assert not hasattr(p, "grad_sample") and not p._backward_hooks if hasattr(p, "_backward_hooks") else True
    model.zero_grad(set_to_none=True)
    plain.load_state_dict(model.state_dict())
    for x, y in batches(2, b=16):
        model.zero_grad()
        plain.zero_grad()
        ce(model(x), y).backward()
        ce(plain(x), y).backward()
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            close(p.grad, q.grad, f"{n}.grad after remove")
            assert p.grad_fn is None and p.is_leaf
    assert type(model) is nn.Sequential and not hasattr(model, "_pergrad")


def test_per_token_on_a_flat_input_refused_in_the_backward_without_a_half_written_grad() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_transform(model, transforms.clip_norm(1.0))
    psm.register_projection("2.weight", dim=4, per_token=True)
    x, y = batches(1)[0]
    model.zero_grad(set_to_none=True)
    with pytest.raises(ProjectionError, match=r"layer '2' \(Linear\) was called on an input of shape \(5, 8\)"):
        ce(psm(x), y).backward()
    assert all(p.grad is None for p in model.parameters()), [
        n for n, p in model.named_parameters() if p.grad is not None
    ]


def test_double_after_registering() -> None:
    torch.set_default_dtype(torch.float32)
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=16, seed=2)
    psm.register_projection("0.weight", dim=8, seed=3, grads=False)
    x, y = batches(1)[0]
    ce(psm(x.float()), y).backward()
    assert psm.per_sample_projections()[""].dtype == torch.float32
    model.double()
    torch.set_default_dtype(torch.float64)
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(3, b=16)):
        opt.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        found = psm.per_sample_projections()
        assert found[""].dtype == torch.float64
        close(found[""], features(g, names, Spec(16, "kron", 2)), f"step {step}")
        close(found["0.weight"], features(g, ["0.weight"], Spec(8, "kron", 3)), f"step {step} 0.weight")
        opt.step()


# -- audit and statistics beside projections ----------------------------------------------------------


def test_audit_armed_mid_run_and_statistics_beside_projections() -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False, track_statistics=True)
    psm.register_projection(model, dim=16, seed=0, grads=True)
    psm.register_transform(model, transforms.clip_norm(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = None
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches(5, b=16)):
        if step == 2:
            holder = psm.hold_per_sample()
            holder.armed = True
        ref.load_state_dict(model.state_dict())
        train_step(psm, opt, x, y)
        g = per_sample(ref, x, y, ce)
        expected = clipped_sum(g, 0.5)
        close_grads(model, expected, f"step {step}")
        close(psm.per_sample_projections()[""], features(g, names, Spec(16)), f"step {step} features")
        norms = torch.stack([g[n].flatten(1).square().sum(1) for n in names]).sum(0)
        close(psm.statistics().sq_norms, norms, f"step {step} statistics")
        if holder is not None:
            (held,) = holder.take()
            by_name = {psm._engine.param_names[p]: v for p, v in held.grads.items()}
            for n in names:
                close(by_name[n], g[n], f"step {step} held {n}")
        opt.step()
    assert holder is not None
    holder.close()


# -- the store and the scores -------------------------------------------------------------------------


def naive_scores(
    q: list[Tensor], train: list[Tensor], pre: str, damping: float = 1e-3, qs: Tensor | None = None
) -> Tensor:
    total = torch.zeros(q[0].shape[0], train[0].shape[0])
    for qc, tc in zip(q, train):
        qc, tc = qc.double(), tc.double()
        if pre == "identity":
            total += qc @ tc.T
        else:
            h = tc.T @ tc
            h = h + damping * h.trace() / h.shape[0] * torch.eye(h.shape[0])
            total += qc @ torch.linalg.solve(h, tc.T)
    if pre == "trak":
        assert qs is not None
        total = total * qs
    return total


def checkpoint_store(
    tmp_path: Path, *, output: str | None = None
) -> tuple[object, dict[str, Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """Three checkpoints of a training run, each projected with the store's seed, in a store; the queries."""
    from pergrad.attribution import FeatureStore, margin

    torch.manual_seed(0)
    x, y = torch.randn(13, 6), torch.randint(0, 4, (13,))
    xq, yq = torch.randn(5, 6), torch.randint(0, 4, (5,))
    names = ["c0", "c1", "c2"]
    store = FeatureStore.open(
        tmp_path / "s",
        n=13,
        k=16,
        dtype=torch.float64,
        checkpoints=names,
        kind="kron",
        seed=3,
        output=output,
        out_to_loss=output is not None,
    )
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    queries, trains, allq = {}, [], []
    params = [n for n, _ in model.named_parameters()]
    for c, name in enumerate(names):
        for _ in range(3):
            opt.zero_grad()
            ce(model(x), y).backward()
            opt.step()
        net = copy.deepcopy(model)
        psm = PerSampleModule(net, loss_reduction="sum")
        psm.register_projection(net, **store.projection(name), grads=False)
        spec = Spec(16, "kron", 3 + 100_000 * c)
        for idx in torch.arange(13).split(4):
            out = psm(x[idx])
            if output:
                f, q = margin(out, y[idx])
                f.sum().backward()
                store.write_from(psm, idx, name, out_to_loss=q)
            else:
                ce(out, y[idx]).backward()
                store.write_from(psm, idx, name)
        if output:
            g = per_sample(net, x, y, lambda o, t: margin(o, t)[0].sum())
            with torch.no_grad():
                allq.append(margin(net(x), y)[1])
        else:
            g = per_sample(net, x, y, ce)
        trains.append(features(g, params, spec))
        out = psm(xq)
        ce(out, yq).backward()
        queries[name] = psm.per_sample_projections()[""]
        gq = per_sample(net, xq, yq, ce)
        close(queries[name], features(gq, params, spec), f"query features at {name}")
        psm.remove()
    store.flush()
    return store, queries, [queries[n] for n in names], trains, allq


@pytest.mark.parametrize("pre", ["identity", "gram", "trak"])
def test_checkpoint_loop_store_scores_top_k_batches_and_subsets(tmp_path: Path, pre: str) -> None:
    from pergrad.attribution import scores, top_k

    store, queries, q, train, allq = checkpoint_store(tmp_path, output="margin" if pre == "trak" else None)
    for c in range(3):
        close(store.read(range(13), c), train[c], f"stored features of checkpoint {c}")  # type: ignore[attr-defined]
    qs = torch.stack(allq).mean(0) if allq else None
    expected = naive_scores(q, train, pre, qs=qs)
    m = 5
    for batch_size in (None, 1, m, m + 1):
        found = scores(queries, store, preconditioner=pre, batch_size=batch_size)  # type: ignore[arg-type]
        close(found, expected, f"scores batch_size={batch_size}")
        subset = torch.tensor([12, 0, 5, 7])
        close(
            scores(queries, store, preconditioner=pre, batch_size=batch_size, indices=subset),
            expected[:, subset],
            f"scores indices batch_size={batch_size}",
        )  # type: ignore[arg-type]
        values, where = top_k(queries, store, 3, preconditioner=pre, batch_size=batch_size)  # type: ignore[arg-type]
        close(values, expected.topk(3, dim=1).values, f"top_k values batch_size={batch_size}")
        assert (where == expected.topk(3, dim=1).indices).all()
        values, where = top_k(queries, store, 2, preconditioner=pre, batch_size=batch_size, indices=subset)  # type: ignore[arg-type]
        best = expected[:, subset].topk(2, dim=1)
        close(values, best.values, "top_k on a subset")
        assert (where == subset[best.indices]).all(), "top_k on a subset gives dataset indices"


def test_store_refuses_a_checkpoints_features_of_another_seed(tmp_path: Path) -> None:
    from pergrad.attribution import FeatureStore, StoreSpecError

    store = FeatureStore.open(tmp_path / "s", n=4, k=16, checkpoints=["a", "b"], kind="kron", seed=1)
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, **store.projection("a"))
    x, y = batches(1, b=4)[0]
    ce(psm(x), y).backward()
    store.write_from(psm, torch.arange(4), "a")
    with pytest.raises(StoreSpecError, match=r"checkpoint 'b'.*seed=1, this checkpoint's features seed=100001"):
        store.write_from(psm, torch.arange(4), "b")
    assert not store.written("b").any()
    with pytest.raises(StoreSpecError, match="seed"):
        FeatureStore.open(tmp_path / "s", seed=2)


def test_token_scores_batches_and_subsets(tmp_path: Path) -> None:
    from pergrad.attribution import FeatureStore, scores, token_scores

    model = TokenMLP(True)
    store = FeatureStore.open(tmp_path / "t", n=9, k=8, tokens=6, dtype=torch.float64, kind="kron", seed=0)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("up", **store.projection(), grads=False)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 6, 5, generator=gen), torch.randint(0, 3, (9, 6), generator=gen)
    for idx in torch.arange(9).split(4):
        ce(psm(x[idx]), y[idx]).backward()
        store.write_from(psm, idx, target="up")
    store.flush()
    rows = store.read(range(9), per_token=True)
    ce(psm(x[:3]), y[:3]).backward()
    query = psm.per_sample_projections()["up"].sum(1)
    up = ["up.weight", "up.bias"]
    close(query, features(per_sample(model, x[:3], y[:3], ce), up, Spec(8, "kron", 0)), "query")
    expected = torch.einsum("mk,ntk->mnt", query, rows)
    for batch_size in (None, 1, 3, 4):
        close(token_scores(query, store, batch_size=batch_size), expected, f"token_scores batch_size={batch_size}")
        close(token_scores(query, store, batch_size=batch_size, indices=[8, 2]), expected[:, [8, 2]], "subset")
        close(scores(query, store, batch_size=batch_size), expected.sum(2), "scores of a per-token store")


def test_ekfac_against_a_naive_float64_formula(tmp_path: Path) -> None:
    from pergrad.attribution import FeatureStore, ekfac, feature_columns, scores

    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    weights = {"0.weight": 8, "2.weight": 4}
    for target, dim in weights.items():
        psm.register_projection(target, dim=dim, seed=1, grads=False)
    psm.track_projected_factors(*weights)
    store = FeatureStore.open(tmp_path / "e", n=20, k=12, dtype=torch.float64)
    x, y = torch.randn(20, 6), torch.randint(0, 4, (20,))
    for idx in torch.arange(20).split(7):
        ce(psm(x[idx]), y[idx]).backward()
        store.write(idx, torch.cat(list(psm.per_sample_projections().values()), 1))
    store.flush()
    columns = feature_columns(weights)
    found = psm.projected_factors()
    blocks = {columns[t]: f for t, f in found.items()}
    ce(psm(x[:3]), y[:3]).backward()
    query = torch.cat(list(psm.per_sample_projections().values()), 1)
    got = scores(query, store, preconditioner=ekfac(store, blocks, damping=0.1))
    train = store.read(range(20))
    expected_pre = query.clone()
    for name, cols in columns.items():
        row, col = found[name].row, found[name].col
        ur, uc = torch.linalg.eigh(row)[1], torch.linalg.eigh(col)[1]
        r, c = row.shape[0], col.shape[0]
        rotated_train = ur.T @ train[:, cols.start : cols.stop].reshape(-1, r, c) @ uc
        lam = rotated_train.square().mean(0)  # EK-FAC's eigenvalues: the train features' mean square
        damp = 0.1 * lam.mean()
        x_ = (ur.T @ query[:, cols.start : cols.stop].reshape(-1, r, c) @ uc) / (lam + damp)
        expected_pre[:, cols.start : cols.stop] = (ur @ x_ @ uc.T).flatten(1)
    close(got, expected_pre @ train.T, "EK-FAC scores")


# -- evaluation tools ---------------------------------------------------------------------------------


def naive_spearman(a: Tensor, b: Tensor) -> float:
    def rank(v: Tensor) -> Tensor:
        out = torch.empty(len(v))
        for i in range(len(v)):
            out[i] = (v < v[i]).sum() + ((v == v[i]).sum() + 1) / 2
        return out

    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def test_lds_and_loo_correlation_against_naive_spearman() -> None:
    from pergrad.attribution import lds, loo_correlation, subsets

    gen = torch.Generator().manual_seed(0)
    masks = subsets(10, 7, seed=1)
    assert masks.shape == (7, 10) and (masks.sum(1) == 5).all()
    s = torch.randn(3, 10, generator=gen)
    s[0, :2] = 0.5  # ties
    outputs = torch.randn(7, 3, generator=gen)
    got = lds(s, masks, outputs)
    for j in range(3):
        predicted = (masks.double() * s[j]).sum(1)
        assert got[j].item() == pytest.approx(naive_spearman(predicted, outputs[:, j]), abs=1e-12)
    full, without = torch.randn(3, generator=gen), torch.randn(10, 3, generator=gen)
    got = loo_correlation(s, full, without)
    for j in range(3):
        assert got[j].item() == pytest.approx(naive_spearman(s[j], without[:, j] - full[j]), abs=1e-12) or got[
            j
        ].item() == pytest.approx(naive_spearman(s[j], full[j] - without[:, j]), abs=1e-12)


# -- imports: the package attribute and the old paths ---------------------------------------------------


def run_python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_pergrad_attribution_without_importing_it() -> None:
    done = run_python(
        "import sys, pergrad\n"
        "assert 'pergrad.attribution' not in sys.modules\n"
        "from pergrad import PerSampleModule\n"
        "import torch\n"
        "m = torch.nn.Linear(3, 2)\n"
        "psm = PerSampleModule(m)\n"
        "psm(torch.randn(4, 3)).sum().backward()\n"
        "assert 'pergrad.attribution' not in sys.modules, 'a wrapper that projects nothing loaded attribution'\n"
        "s = pergrad.attribution.scores\n"
        "assert callable(s) and pergrad.attribution.top_k and pergrad.attribution.FeatureStore\n"
        "print('ok')"
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("pergrad.projectors", "pergrad.attribution.projectors"),
        ("pergrad.consumers.projection", "pergrad.attribution.projection"),
        ("pergrad.consumers.factors", "pergrad.attribution.factors"),
    ],
)
def test_old_paths_still_work_and_warn(old: str, new: str) -> None:
    done = run_python(f"import {old} as o\nimport {new} as n\nassert o is n\nprint(o.__name__)", "-W", "always")
    assert done.returncode == 0 and new in done.stdout, done.stderr
    assert f"DeprecationWarning: {old} moved to {new}" in done.stderr, done.stderr


# -- the model changes under a projection -------------------------------------------------------------


def test_freezing_and_unfreezing_a_layer_mid_run() -> None:
    """requires_grad switched mid-run: the wrapper binds again; the whole model's features are those of its
    trainable parameters at that step, and .grad is exact."""
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=16, seed=5)
    psm.register_projection("2", dim=8, seed=6, grads=False)
    psm.register_transform("0", transforms.clip_norm(0.3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(7, b=16)):
        if step == 2:
            model[0].weight.requires_grad_(False)
        if step == 4:
            model[0].weight.requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        found = psm.per_sample_projections()
        close(found[""], features(g, trainable, Spec(16, "kron", 5)), f"step {step} whole model")
        close(found["2"], features(g, ["2.weight", "2.bias"], Spec(8, "kron", 6)), f"step {step} layer 2")
        expected = clipped_sum({n: g[n] for n in trainable if n.startswith("0.")}, 0.3)
        for n, p in model.named_parameters():
            if n in expected:
                close(p.grad, expected[n], f"step {step} {n}.grad")
            elif n == "0.weight":
                assert p.grad is None, f"step {step}: a frozen weight got a .grad"
        opt.step()


def test_load_state_dict_assign_mid_run_keeps_projecting_by_name() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection("0.weight", dim=8, seed=1, grads=False)
    psm.register_projection(model, dim=16, kind="sjlt", seed=2)
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches(5, b=16)):
        if step in (2, 3):
            fresh = {k: v + 0.01 * (step + 1) for k, v in model.state_dict().items()}
            model.load_state_dict(fresh, assign=True)
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        found = psm.per_sample_projections()
        close(found["0.weight"], features(g, ["0.weight"], Spec(8, "kron", 1)), f"step {step} 0.weight")
        close(found[""], features(g, names, Spec(16, "sjlt", 2)), f"step {step} model")
        for n, p in model.named_parameters():
            if p.grad is not None:
                close(p.grad, g[n].sum(0), f"step {step} {n}.grad")


@pytest.mark.parametrize("as_name", [True, False])
def test_a_projected_module_swapped_out_mid_run(as_name: bool) -> None:
    """The projected layer is replaced by a new one: its features are the new layer's, or an error says why."""
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("2" if as_name else model[2], dim=8, seed=1)
    x, y = batches(1, b=4)[0]
    ce(psm(x), y).backward()
    torch.manual_seed(9)
    model[2] = nn.Linear(8, 4)
    for step, (x, y) in enumerate(batches(3, b=4)):
        model.zero_grad()
        try:
            out = psm(x)
        except TargetError as err:  # the fix the message gives works
            assert "Wrap the model again (psm.remove(); psm = PerSampleModule(model))" in str(err), str(err)
            psm.remove()
            psm = PerSampleModule(model, loss_reduction="sum")
            psm.register_projection("2" if as_name else model[2], dim=8, seed=1)
            out = psm(x)
        ce(out, y).backward()
        g = per_sample(model, x, y, ce)
        close(
            psm.per_sample_projections()["2"], features(g, ["2.weight", "2.bias"], Spec(8, "kron", 1)), f"step {step}"
        )


def test_lazy_model_projected_before_its_first_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 4))
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_transform("2", transforms.clip_norm(0.5))
    with pytest.raises(
        ProjectionError, match=r"the projection of the whole model: \['0.bias', '0.weight'\] belong to a lazy"
    ):
        psm.register_projection(model, dim=16, seed=3)
    with pytest.raises(ProjectionError, match=r"Run one forward of the model \(model\(example_batch\)\) before"):
        psm.register_projection("0.weight", dim=8, seed=4, grads=False)
    psm(batches(1)[0][0])  # the fix the message gives
    psm.register_projection(model, dim=16, seed=3)
    psm.register_projection("0.weight", dim=8, seed=4, grads=False)
    for step, (x, y) in enumerate(batches(4, b=16)):
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        names = [n for n, _ in model.named_parameters()]
        found = psm.per_sample_projections()
        close(found[""], features(g, names, Spec(16, "kron", 3)), f"step {step} model")
        close(found["0.weight"], features(g, ["0.weight"], Spec(8, "kron", 4)), f"step {step} 0.weight")
        expected = clipped_sum({n: g[n] for n in ("2.weight", "2.bias")}, 0.5)
        close(model[2].weight.grad, expected["2.weight"], f"step {step} 2.weight.grad")


@pytest.mark.parametrize("t", [1, 16, 17])
def test_factors_and_features_do_not_depend_on_loss_reduction(t: int) -> None:
    """loss_reduction="mean": features and factors are of each sample's own loss, as with "sum"."""
    found = {}
    for reduction in ("sum", "mean"):
        model = TokenMLP(True)
        psm = PerSampleModule(model, loss_reduction=reduction, keep_grad_sample=False)
        psm.register_projection("head.weight", dim=8, seed=2, grads=False)
        psm.register_projection("up.weight", dim=8, seed=3)
        psm.track_projected_factors("head.weight", "up.weight")
        gen = torch.Generator().manual_seed(0)
        feats = []
        for _ in range(3):
            x, y = torch.randn(5, t, 5, generator=gen), torch.randint(0, 3, (5, t), generator=gen)
            out = psm(x)
            loss = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction=reduction)
            if reduction == "mean":
                loss = loss * t  # pergrad's mean is over the batch: each sample's loss is its tokens' sum
            loss.backward()
            feats.append(psm.per_sample_projections())
        found[reduction] = (feats, psm.projected_factors())
    g = per_sample(TokenMLP(True), x, y, ce)
    close(found["sum"][0][-1]["up.weight"], features(g, ["up.weight"], Spec(8, "kron", 3)), "features")
    for a, b in zip(found["sum"][0], found["mean"][0]):
        for name in a:
            close(b[name], a[name], f"{name} features, mean against sum")
    for name, f in found["sum"][1].items():
        close(found["mean"][1][name].row, f.row, f"{name} row factor, mean against sum")
        close(found["mean"][1][name].col, f.col, f"{name} col factor, mean against sum")


@pytest.mark.parametrize("stats", [False, True])
def test_audit_armed_on_some_steps_of_a_projection_only_pass(stats: bool) -> None:
    """No transform, keep_grad_sample=False: projected as output gradients arrive (``take``); arming an
    audit on some steps, or tracking statistics, must not lose either."""
    model = TokenMLP(False)
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False, track_statistics=stats)
    psm.register_projection(model, dim=8, seed=1, grads=False)
    psm.register_projection("head", dim=8, seed=2, kind="dense")
    holder = psm.hold_per_sample()
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        holder.armed = step in (1, 3)
        x, y = torch.randn(4, 16, 5, generator=gen), torch.randint(0, 3, (4, 16), generator=gen)
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        found = psm.per_sample_projections()
        close(found[""], features(g, names, Spec(8, "kron", 1)), f"step {step} model")
        close(found["head"], features(g, ["head.weight", "head.bias"], Spec(8, "dense", 2)), f"step {step} head")
        held = holder.take()
        assert len(held) == (1 if holder.armed else 0), f"step {step}: {len(held)} records"
        if held:
            by_name = {psm._engine.param_names[p]: v for p, v in held[0].grads.items()}
            assert set(by_name) == set(names), f"step {step}: held {sorted(by_name)}"
            for n in names:
                close(by_name[n], g[n], f"step {step} held {n}")
        if stats:
            norms = torch.stack([g[n].flatten(1).square().sum(1) for n in names]).sum(0)
            close(psm.statistics().sq_norms, norms, f"step {step} statistics")
        assert all(p.grad is None or n.endswith("bias") for n, p in model.named_parameters()) or step == 0
    holder.close()


@pytest.mark.parametrize("accumulate", ["backward", "samples"])
def test_micro_batches_with_loss_scale_features_unscaled(accumulate: str) -> None:
    model = mlp()
    ref = copy.deepcopy(model)
    k = 3
    psm = PerSampleModule(model, loss_reduction="mean", accumulate=accumulate, loss_scale=1 / k)
    psm.register_projection(model, dim=16, seed=8)
    psm.register_transform(model, transforms.clip_norm(0.4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    names = [n for n, _ in model.named_parameters()]
    data = batches(2 * k, b=4)
    sizes = [4, 2, 3]
    for step in range(2):
        ref.load_state_dict(model.state_dict())
        opt.zero_grad()
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        count = 0
        for micro in range(k):
            x, y = data[step * k + micro]
            x, y = x[: sizes[micro]], y[: sizes[micro]]
            (F.cross_entropy(psm(x), y) / k).backward()
            g = per_sample(ref, x, y, lambda o, t: F.cross_entropy(o, t, reduction="sum"))
            close(psm.per_sample_projections()[""], features(g, names, Spec(16, "kron", 8)), f"step {step}.{micro}")
            c = clipped_sum(g, 0.4)
            for n in names:
                total[n] += c[n] if accumulate == "samples" else c[n] / sizes[micro] / k
            count += sizes[micro]
        # s times the reduction
        expected = {n: total[n] / count / k if accumulate == "samples" else total[n] for n in total}
        close_grads(model, expected, f"step {step} ({accumulate})")
        opt.step()


def test_registration_refusals_leave_the_wrapper_working() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("0", dim=8)
    with pytest.raises(TargetError, match=r"module '0' already has a projection"):
        psm.register_projection(model[0], dim=16)
    with pytest.raises(ProjectionError, match=r"dim=12 cannot be split"):
        psm.register_projection("2", dim=12)
    with pytest.raises(ProjectionError, match=r"unknown kind 'gauss'"):
        psm.register_projection("2", dim=16, kind="gauss")
    with pytest.raises(ProjectionError, match=r"per-token features are Kronecker only"):
        psm.register_projection("2", dim=16, kind="sjlt", per_token=True)
    with pytest.raises(ProjectionError, match=r"track_projected_factors: parameter '2.weight' has no projection"):
        psm.track_projected_factors("2.weight")
    with pytest.raises(ProjectionError, match=r"no factors tracked"):
        psm.projected_factors()
    with pytest.raises(ProjectionError, match=r"available after a backward pass"):
        psm.per_sample_projections()
    assert list(psm.projection_specs()) == ["0"]
    for step, (x, y) in enumerate(batches(3)):
        model.zero_grad()
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        assert list(psm.per_sample_projections()) == ["0"]
        close(psm.per_sample_projections()["0"], features(g, ["0.weight", "0.bias"], Spec(8)), f"step {step}")
        close_grads(model, summed(g), f"step {step}")


def test_same_model_rewrapped_at_each_checkpoint_between_plain_training() -> None:
    """A checkpoint loop on ONE model object: train it plainly, wrap it for an attribution pass (grads=False,
    an audit holder made before the projection), remove the wrapper, train on: nothing stays behind."""
    model = TokenMLP(True)
    twin = copy.deepcopy(model)
    opt, opt2 = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    for checkpoint in range(3):
        for _ in range(2):
            x, y = torch.randn(3, 16, 5, generator=gen), torch.randint(0, 3, (3, 16), generator=gen)
            for net, o in ((model, opt), (twin, opt2)):
                o.zero_grad()
                ce(net(x), y).backward()
            for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                close(p.grad, q.grad, f"checkpoint {checkpoint}: plain training {n}.grad")
            opt.step()
            opt2.step()
        with PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False) as psm:
            holder = psm.hold_per_sample()
            psm.register_projection(model, dim=8, seed=checkpoint, grads=False)
            psm.register_projection("up", dim=8, seed=checkpoint, per_token=True, grads=False)
            for step in range(3):
                holder.armed = step == 1
                x, y = torch.randn(3, 17, 5, generator=gen), torch.randint(0, 3, (3, 17), generator=gen)
                ce(psm(x), y).backward()
                g = per_sample(model, x, y, ce)
                found = psm.per_sample_projections()
                close(
                    found[""], features(g, names, Spec(8, "kron", checkpoint)), f"checkpoint {checkpoint} step {step}"
                )
                close(found["up"].sum(1), features(g, ["up.weight", "up.bias"], Spec(8, "kron", checkpoint)), "up")
                if holder.armed:
                    (held,) = holder.take()
                    by_name = {psm._engine.param_names[p]: v for p, v in held.grads.items()}
                    for n in names:
                        close(by_name[n], g[n], f"checkpoint {checkpoint} held {n}")
        for m in model.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks, type(m)
        assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_self_influence_and_lm_margin_against_naive_formulas(tmp_path: Path) -> None:
    from pergrad.attribution import lm_margin, self_influence

    store, _, _, train, _ = checkpoint_store(tmp_path)
    for pre in ("identity", "gram"):
        expected = torch.diagonal(naive_scores(train, train, pre))
        close(self_influence(store, pre), expected, f"self_influence {pre}")  # type: ignore[arg-type]
        close(self_influence(store, pre, indices=[3, 11]), expected[[3, 11]], f"self_influence {pre} subset")  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(3, 7, 5, generator=gen), torch.randint(0, 5, (3, 7), generator=gen)
    f, q = lm_margin(logits, targets)
    p = logits.softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    close(f, (p.log() - (1 - p).log()).sum(1), "lm_margin")
    close(q, (1 - p).mean(1), "lm_margin's Q")


def test_a_lazy_layer_appended_mid_run_under_a_projected_model() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=16, seed=2)
    psm.register_transform("0", transforms.clip_norm(0.3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(5, b=16)):
        if step == 2:
            torch.manual_seed(1)
            model.append(nn.LazyLinear(3))
        y = y % 3 if step >= 2 else y
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        names = [n for n, _ in model.named_parameters()]
        close(psm.per_sample_projections()[""], features(g, names, Spec(16, "kron", 2)), f"step {step}")
        expected = clipped_sum({n: g[n] for n in ("0.weight", "0.bias")}, 0.3)
        close_grads(model, {**summed(g), **expected}, f"step {step}")
        if step < 2:
            opt.step()


def test_a_transformed_lazy_layer_appended_under_a_gradless_projection() -> None:
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection(model, dim=16, seed=2, grads=False)
    for step, (x, y) in enumerate(batches(5, b=16)):
        if step == 2:
            torch.manual_seed(1)
            model.append(nn.LazyLinear(3))
            psm.register_transform("3", transforms.clip_norm(0.01))  # its parameters are not shaped yet
        y = y % 3 if step >= 2 else y
        model.zero_grad(set_to_none=True)
        ce(psm(x), y).backward()
        g = per_sample(model, x, y, ce)
        names = [n for n, _ in model.named_parameters()]
        close(psm.per_sample_projections()[""], features(g, names, Spec(16, "kron", 2)), f"step {step}")
        if step >= 2:
            expected = clipped_sum({n: g[n] for n in ("3.weight", "3.bias")}, 0.01)
            close(model[3].weight.grad, expected["3.weight"], f"step {step} 3.weight.grad")
            close(model[3].bias.grad, expected["3.bias"], f"step {step} 3.bias.grad")


def test_query_features_by_autograd_grad_of_the_parameters() -> None:
    """A notebook computes a query's features without touching .grad: torch.autograd.grad of the parameters.
    The features must be the query's, or an error must say to call backward()."""
    model = mlp()
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection(model, dim=16, seed=1)
    names = [n for n, _ in model.named_parameters()]
    for step, (x, y) in enumerate(batches(3)):
        ce(psm(x), y).backward()
        close(
            psm.per_sample_projections()[""],
            features(per_sample(model, x, y, ce), names, Spec(16, seed=1)),
            f"step {step}",
        )
        torch.autograd.grad(ce(psm(x[:3]), y[:3]), list(model.parameters()))
        with pytest.raises(
            ProjectionError,
            match=r"accumulated into no parameter of the projection target\(s\) \[''\].*Call loss.backward\(\)",
        ):
            psm.per_sample_projections()


def kron_factors(name: str, shape: tuple[int, int], spec: Spec) -> tuple[Tensor, Tensor]:
    r_row, r_col = kron_ranks(spec.dim, *shape)
    row = gaussian(r_row, shape[0], spec.seed, name, shape, "kron", "row", 0) / math.sqrt(r_row)
    col = gaussian(r_col, shape[1], spec.seed, name, shape, "kron", "col", 0) / math.sqrt(r_col)
    return row, col


def test_factors_of_a_tied_lm_weight_and_of_a_layer_called_twice() -> None:
    """EK-FAC on an LM with tied embeddings (the Embedding's lookups and the head's positions both feed the
    weight's factors) and on a layer called twice; reference: each call's (a, d) on a plain copy."""
    lm, twice = TinyLM(), Twice()
    ref_lm, ref_twice = copy.deepcopy(lm), copy.deepcopy(twice)
    psm = PerSampleModule(lm, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection("emb.weight", dim=4, seed=2)
    psm.track_projected_factors("emb.weight")
    psm2 = PerSampleModule(twice, loss_reduction="sum")
    psm2.register_projection("lin.weight", dim=4, seed=1, grads=False)
    psm2.track_projected_factors("lin.weight")
    pr, pc = kron_factors("emb.weight", (11, 6), Spec(4, "kron", 2))
    qr, qc = kron_factors("lin.weight", (6, 6), Spec(4, "kron", 1))
    sums = [torch.zeros(2, 2) for _ in range(4)]
    gen = torch.Generator().manual_seed(0)
    seen: list[tuple[Tensor, Tensor]] = []

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        out.retain_grad()
        seen.append((inputs[0], out))

    ref_twice.lin.register_forward_hook(hook)
    for step in range(3):
        t = (15, 16, 17)[step]
        x = torch.randint(0, 11, (3, t), generator=gen)
        ce(psm(x), x).backward()
        e = ref_lm.emb(x)
        e.retain_grad()
        h = torch.tanh(ref_lm.mix(e))
        out = ref_lm.head(h)
        out.retain_grad()
        ce(out, x).backward()
        u1, v1 = pr[:, x].permute(1, 2, 0), e.grad @ pc.T
        u2, v2 = out.grad @ pr.T, h.detach() @ pc.T
        expected = (torch.einsum("bsp,bsq->bpq", u1, v1) + torch.einsum("bsp,bsq->bpq", u2, v2)).flatten(1)
        close(psm.per_sample_projections()["emb.weight"], expected, f"step {step} tied features")
        for u, v in ((u1, v1), (u2, v2)):
            sums[0] += torch.einsum("bsp,bsq->pq", u, u)
            sums[1] += torch.einsum("bsp,bsq->pq", v, v)
        x2, y2 = torch.randn(4, t, 6, generator=gen), torch.randn(4, t, 4, generator=gen)
        sq(psm2(x2), y2).backward()
        seen.clear()
        sq(ref_twice(x2), y2).backward()
        assert len(seen) == 2
        for a, o in seen:
            u, v = o.grad @ qr.T, a.detach() @ qc.T
            sums[2] += torch.einsum("bsp,bsq->pq", u, u)
            sums[3] += torch.einsum("bsp,bsq->pq", v, v)
    f = psm.projected_factors()["emb.weight"]
    assert (f.samples, f.positions) == (9, 2 * 3 * (15 + 16 + 17))
    close(f.row, sums[0] / 9, "tied row factor")
    close(f.col, sums[1] / 9, "tied col factor")
    f = psm2.projected_factors()["lin.weight"]
    assert f.samples == 12
    close(f.row, sums[2] / 12, "twice row factor")
    close(f.col, sums[3] / 12, "twice col factor")


@pytest.mark.parametrize("call", ["transform", "projection", "gradless projection", "factors"])
def test_registering_on_a_removed_wrapper_is_refused_and_hooks_nothing(call: str) -> None:
    """After ``remove()`` (a notebook cell run again), registering must not hook the model again, nor be
    accepted and silently never applied (a clipping transform would give unclipped .grad)."""
    model = mlp()
    plain = copy.deepcopy(model)
    psm = PerSampleModule(model, loss_reduction="sum")
    psm.register_projection("2.weight", dim=4)
    psm.remove()
    with pytest.raises(
        PergradError,
        match=rf"{'track_projected_factors' if call == 'factors' else 'register_' + call.split()[-1]} on a PerSampleModule that was removed .* Wrap the model again",
    ):
        if call == "transform":
            psm.register_transform(model, transforms.clip_norm(0.1))
        elif call == "factors":
            psm.track_projected_factors("2.weight")
        else:
            psm.register_projection(model, dim=16, grads=call == "projection")
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m)
    for step, (x, y) in enumerate(batches(2)):
        model.zero_grad()
        plain.zero_grad()
        ce(model(x), y).backward()
        ce(plain(x), y).backward()
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            close(p.grad, q.grad, f"step {step} {n}.grad")
