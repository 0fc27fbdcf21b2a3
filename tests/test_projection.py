"""Projected per-sample gradients (``register_projection``): ``P vec(g_i)`` of each target, checked
every step against the same ``P`` (regenerated) applied to torch.func's per-sample gradients."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from reference import assert_close, clipped_mean, reference_grad_sample, run_pergrad
from torch import Tensor, nn

import pergrad._core.backward.sources
import pergrad.attribution.projectors
from pergrad import PerSampleModule, TargetError, transforms
from pergrad.attribution.projectors import Projector, Spec, kron_ranks
from pergrad.errors import ProjectionError

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

DIM = 8  # kron: ranks 2 and 4 (the 4 on the narrower side of each weight)


class Attention(nn.Module):
    """A Linear, then nn.MultiheadAttention (its in_proj_weight has no Kronecker rule: built, projected)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.attn(h, h, h, need_weights=False)[0]


class Tied(nn.Module):
    """An embedding and a head sharing one weight: two calls feed it, their projections add up."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=0)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class Twice(nn.Module):
    """One Linear called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.lin(torch.tanh(self.lin(x))))


class Raw(nn.Module):
    """Raw parameters (no layer of their own: tracked where they meet the batch), built then projected."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.mix = nn.Parameter(torch.randn(4, 4))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh((x * self.scale) @ self.mix))


class Recurrent(nn.Module):
    """An LSTM or a GRU (built per sample by the recurrent rule, then projected), then a Linear."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU]) -> None:
        super().__init__()
        self.rnn = cell(4, 3, batch_first=True)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0])


def lora(embedding: bool) -> nn.Module:
    """peft's LoRA on two Linears (A and B are Linears: the Kronecker rule) and, with ``embedding``, on an
    embedding before them (its A and B are raw parameters: built, then projected); the base weights frozen."""
    peft = pytest.importorskip("peft")
    layers = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)]
    base = nn.Sequential(nn.Embedding(11, 4), *layers) if embedding else nn.Sequential(*layers)
    targets = ["0", "1", "3"] if embedding else ["0", "2"]
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(base, config)


def floats(*shape: int) -> Callable[[int], Tensor]:
    return lambda b: torch.randn(b, *shape, dtype=torch.float64)


def token_ids(t: int) -> Callable[[int], Tensor]:
    return lambda b: torch.randint(0, 11, (b, t))


# family -> (model for t positions, input of a batch, output shape)
CASES: dict[str, Callable[[int], tuple[nn.Module, Callable[[int], Tensor], tuple[int, ...]]]] = {
    "linear": lambda t: (
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Flatten(), nn.Linear(3 * t, 2)),
        floats(t, 4),
        (2,),
    ),
    "conv1d": lambda t: (
        nn.Sequential(
            nn.Conv1d(3, 4, 3, padding=2, dilation=2),
            nn.Tanh(),
            nn.Conv1d(4, 4, 3, stride=2, groups=2),
            nn.Flatten(),
            nn.Linear(4 * ((t - 3) // 2 + 1), 2),
        ),
        floats(3, t),
        (2,),
    ),
    "conv2d": lambda t: (
        nn.Sequential(nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2)), nn.Tanh()),
        floats(2, t, 3),
        (4, (t + 2 - 3) // 2 + 1, 3 + 2 - 2 * (2 - 1) - 1 + 1),
    ),
    "conv_transpose": lambda t: (
        nn.Sequential(nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), nn.Tanh()),
        floats(3, t),
        (4, 2 * t - 1),
    ),
    "raw": lambda t: (Raw(), floats(t, 4), (t, 3)),
    "embedding": lambda t: (nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.Linear(4, 3)), token_ids(t), (t, 3)),
    "hf_conv1d": lambda t: (nn.Sequential(Conv1D(5, 4), nn.Tanh(), Conv1D(3, 5)), floats(t, 4), (t, 3)),
    "layer_norm": lambda t: (
        nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)),
        floats(t, 4),
        (t, 3),
    ),
    "attention": lambda t: (Attention(), floats(t, 4), (t, 4)),
    "tied": lambda t: (Tied(), token_ids(t), (t, 11)),
    "twice": lambda t: (Twice(), floats(t, 4), (t, 3)),
    "conv3d": lambda t: (
        nn.Sequential(nn.Conv3d(2, 3, (3, 2, 1), padding=(1, 0, 0), dilation=(2, 1, 1)), nn.Tanh()),
        floats(2, t, 3, 2),
        (3, t - 2, 2, 2),
    ),
    "group_norm": lambda t: (
        nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh()),
        floats(2, t),
        (4, t),
    ),
    "lstm": lambda t: (Recurrent(nn.LSTM), floats(t, 4), (t, 2)),
    "gru": lambda t: (Recurrent(nn.GRU), floats(t, 4), (t, 2)),
    "fallback": lambda t: (nn.Sequential(nn.Linear(4, 5), nn.PReLU(), nn.Linear(5, 3)), floats(t, 4), (t, 3)),
    "lora": lambda t: (lora(embedding=False), floats(t, 4), (t, 3)),
    "lora_embedding": lambda t: (lora(embedding=True), token_ids(t), (t, 3)),
}
# what a family's wrapper needs besides the defaults: PReLU has no rule of its own
OPTIONS: dict[str, dict[str, bool]] = {"fallback": {"fallback": True}}


def expected(ref: dict[str, Tensor], net: nn.Module, spec: Spec, prefix: str = "") -> Tensor:
    """``sum_p P_p vec(g_i(p))`` over the target's parameters, ``P_p`` regenerated from its name."""
    total = 0
    for name, p in net.named_parameters():
        if name.startswith(prefix) and p.requires_grad:  # (frozen parameters have no gradient to project)
            matrix = Projector(spec, name, tuple(p.shape)).matrix().to(ref[name].device)
            total = total + ref[name].flatten(1) @ matrix.T
    assert isinstance(total, Tensor)
    return total


def check_steps(
    family: str,
    positions: int,
    keep_grad_sample: bool,
    kind: str,
    loss_reduction: str = "mean",
    clip: float | None = None,
    device: str = "cpu",
) -> None:
    torch.manual_seed(0)
    net, batch_of, out_shape = CASES[family](positions)
    net = net.double().to(device)
    psm = PerSampleModule(
        net, keep_grad_sample=keep_grad_sample, loss_reduction=loss_reduction, **OPTIONS.get(family, {})
    )
    if clip is not None:
        psm.register_transform(net, transforms.clip_norm(clip))
    spec = Spec(DIM, kind, seed=3)
    psm.register_projection(net, dim=DIM, kind=kind, seed=3)
    first = next(iter(net.named_children()))[0]  # a second target: one layer, the other kind, float32
    other = Spec(16, "dense" if kind == "kron" else "kron", seed=5, dtype=torch.float32)
    psm.register_projection(first, dim=16, kind=other.kind, seed=5, dtype=torch.float32)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    names = dict(net.named_parameters())
    for step, batch in enumerate([3, 5, 4, 6]):  # the detaching shortcut starts after the first backward
        x, y = batch_of(batch).to(device), torch.randn(batch, *out_shape, dtype=torch.float64).to(device)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        run_pergrad(psm, x, y, loss_reduction)
        found = psm.per_sample_projections()
        assert set(found) == {"", first}
        assert_close(found[""], expected(ref, net, spec), f"step {step}: {kind} features of the model")
        part = expected(ref, net, other, prefix=first + ".").float()
        torch.testing.assert_close(found[first], part, rtol=1e-5, atol=1e-6)
        assert found[first].dtype == torch.float32
        assert found[""].device == found[first].device == x.device
        reduce = (lambda g: g.mean(0)) if loss_reduction == "mean" else (lambda g: g.sum(0))
        grads = clipped_mean(ref, clip) if clip is not None else {n: reduce(g) for n, g in ref.items()}
        if clip is not None and loss_reduction == "sum":
            grads = {n: g * batch for n, g in grads.items()}
        for name, g in grads.items():  # .grad is unchanged by the projection
            grad = names[name].grad
            assert grad is not None
            assert_close(grad, g, f"step {step}: {name}.grad")
        optimizer.step()
    psm.remove()


@pytest.mark.parametrize("kind", ["kron", "dense", "sjlt"])
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])  # both sides of detach.MANY
@pytest.mark.parametrize("family", sorted(CASES))
def test_features_match_torch_func_every_step(family: str, positions: int, keep_grad_sample: bool, kind: str) -> None:
    check_steps(family, positions, keep_grad_sample, kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["kron", "dense", "sjlt"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_features_on_cuda_match_torch_func_every_step(family: str, kind: str) -> None:
    # the projection is drawn on the CPU and moved: the features on the GPU are of the same P, in float64
    check_steps(family, 17, False, kind, device="cuda")


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("family", ["conv1d", "tied"])
def test_features_are_of_the_raw_gradients_beside_a_transform(
    family: str, keep_grad_sample: bool, loss_reduction: str
) -> None:
    """Clipping changes .grad, not the features: they are the samples' own g_i, under either reduction."""
    check_steps(family, 17, keep_grad_sample, "kron", loss_reduction, clip=0.3)


@pytest.mark.parametrize("family", ["linear", "conv1d", "conv2d", "conv3d", "embedding", "hf_conv1d", "lora"])
def test_kronecker_families_build_no_per_sample_gradient(family: str) -> None:
    torch.manual_seed(0)
    net, batch_of, out_shape = CASES[family](17)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=False, verify=False)
    psm.register_projection(net, dim=DIM)
    x, y = batch_of(4), torch.randn(4, *out_shape, dtype=torch.float64)
    ref = reference_grad_sample(net, x, y)
    with mock.patch.object(pergrad._core.backward.sources, "run_rule", side_effect=AssertionError("a rule built g_i")):
        run_pergrad(psm, x, y)
    assert_close(psm.per_sample_projections()[""], expected(ref, net, Spec(DIM)), "features")


PRINT_P = """
import torch
torch.set_num_threads(1)
from pergrad.attribution.projectors import Projector, Spec
for kind in ("kron", "dense", "sjlt"):
    p = Projector(Spec(32, kind, seed=7), "0.weight", (6, 5)).matrix()
    print(kind, p.flatten().tolist())
"""


def test_the_same_seed_gives_the_same_projection_in_a_fresh_process() -> None:
    done = subprocess.run([sys.executable, "-c", PRINT_P], capture_output=True, text=True, check=True, timeout=900)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for kind in ("kron", "dense", "sjlt"):
        here = Projector(Spec(32, kind, seed=7), "0.weight", (6, 5)).matrix()
        there = torch.tensor(eval(lines[kind]), dtype=torch.float64).view(32, 30)
        assert torch.equal(here, there), kind
        renamed = Projector(Spec(32, kind, seed=7), "1.weight", (6, 5)).matrix()
        reseeded = Projector(Spec(32, kind, seed=8), "0.weight", (6, 5)).matrix()
        assert not torch.allclose(here, renamed) and not torch.allclose(here, reseeded), kind


def test_factors_and_sketches_are_moved_to_the_parameters_device_once() -> None:
    # a copy to a GPU at every backward makes the host wait for it ("meta" stands in for the GPU here: a copy
    # there is a new tensor each time); a factor above CACHED elements (1.2M) is kept too
    like = torch.empty(0, device="meta")
    factors = Projector(Spec(8, "kron"), "emb.weight", (600_000, 3))
    assert factors.factors()[0].numel() > pergrad.attribution.projectors.CACHED
    first, again = factors.factors(like), factors.factors(like)
    assert all(a.device == like.device and a is b for a, b in zip(first, again))
    sketch = Projector(Spec(8, "kron"), "linear.bias", (5,))
    (where, signs), again = sketch.sketched(like), sketch.sketched(like)
    assert where.dtype == torch.int64 and signs.dtype == like.dtype
    assert where is again[0] and signs is again[1]


def test_a_dense_block_is_drawn_in_chunks_that_make_the_same_matrix() -> None:
    """A large dense block is drawn ``CHUNK`` elements at a time (never whole); it projects exactly as
    the matrix its chunks make."""
    with mock.patch("pergrad.attribution.projectors.CHUNK", 64), mock.patch("pergrad.attribution.projectors.CACHED", 0):
        proj = Projector(Spec(16, "dense", seed=1), "w", (3, 10))
        assert sum(1 for _ in proj.dense_blocks()) == 8  # 4 columns of 16 at a time
        g = torch.randn(5, 3, 10, dtype=torch.float64)
        assert_close(proj.apply(g), g.flatten(1) @ proj.matrix().T, "chunked dense projection")
        sketch = Projector(Spec(16, "sjlt", seed=1), "w", (3, 10))  # signed copies of 12 columns at a time
        assert_close(sketch.apply(g), g.flatten(1) @ sketch.matrix().T, "chunked CountSketch")


def test_dense_entries_are_signs_over_sqrt_k_in_every_dtype() -> None:
    """Rademacher blocks: exactly ``±1/sqrt(k)`` in float64 and in float32 (the same signs), about half
    of each sign, rows nearly orthogonal (``E[P^T P] = I``)."""
    proj = Projector(Spec(64, "dense", seed=2), "w", (40, 50))
    p64 = proj.matrix()
    c = 1 / math.sqrt(64)
    assert set(p64.unique().tolist()) == {-c, c}
    p32 = torch.cat([block for _, block in proj.dense_blocks(torch.zeros(1, dtype=torch.float32))], dim=1)
    assert p32.dtype == torch.float32 and torch.equal(p32.sign(), p64.sign().float())
    assert set(p32.unique().tolist()) == {float(torch.tensor(-c, dtype=torch.float32)), float(torch.tensor(c))}
    assert abs(float((p64 > 0).double().mean()) - 0.5) < 0.02  # 2000 x 64 draws: 6 standard deviations
    gram = p64.T @ p64  # [2000, 2000]: diagonal exactly 1, off-diagonal ~ N(0, 1/64)
    assert torch.allclose(gram.diagonal(), torch.ones(2000, dtype=torch.float64))


def test_a_dense_block_is_kept_within_cache_mb_and_drawn_again_without() -> None:
    """Without ``cache_mb`` a large dense block is drawn at every backward; with room for it, once; the
    features are the same either way."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(300, 40), nn.Tanh(), nn.Linear(40, 3)).double()  # 12000 x 64 > CACHED
    x, y = torch.randn(5, 300, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    found = {}
    for cache_mb in (0, 16):
        psm = PerSampleModule(net, keep_grad_sample=False)
        psm.register_projection(net, dim=64, kind="dense", cache_mb=cache_mb)
        with (
            mock.patch("pergrad.attribution.projectors.CACHED", 1000),
            mock.patch.object(torch, "randint", wraps=torch.randint) as draws,
        ):
            feats = []
            for _ in range(3):
                psm.zero_grad()
                F.mse_loss(psm(x), y, reduction="sum").backward()
                feats.append(psm.per_sample_projections()[""])
        # without a cache, the 3 blocks over CACHED entries are drawn at each of the 3 backward passes (the
        # last bias's once); with one, each of the 4 blocks once
        assert draws.call_count == (10 if cache_mb == 0 else 4), cache_mb
        assert torch.equal(feats[0], feats[2])
        found[cache_mb] = feats[0]
        psm.remove()
    assert torch.equal(found[0], found[16])


def test_errors_name_the_target_and_the_fix() -> None:
    net = nn.Sequential(nn.Linear(3, 2))
    psm = PerSampleModule(net)
    with pytest.raises(ProjectionError, match=r"unknown kind 'gaussian'; pass kind='kron', 'dense' or 'sjlt'"):
        psm.register_projection(net, dim=16, kind="gaussian")
    with pytest.raises(ProjectionError, match=r"dim=12 cannot be split .* a square or twice a square .*kind='dense'"):
        psm.register_projection(net, dim=12)
    with pytest.raises(ProjectionError, match=r"dim must be a positive int, got 0"):
        psm.register_projection(net, dim=0, kind="dense")
    with pytest.raises(TargetError, match=r"the module Linear is not part of the wrapped model"):
        psm.register_projection(nn.Linear(3, 2), dim=16)
    with pytest.raises(TargetError, match=r"no module or parameter named 'head'"):
        psm.register_projection("head", dim=16)
    with pytest.raises(ProjectionError, match=r"no projection registered; call register_projection first"):
        psm.per_sample_projections()
    psm.register_projection("0.weight", dim=12, kind="dense")
    with pytest.raises(ProjectionError, match=r"available after a backward pass"):
        psm.per_sample_projections()
    with pytest.raises(TargetError, match=r"parameter '0.weight' already has a projection"):
        psm.register_projection(net[0].weight, dim=16)
    psm(torch.randn(3, 3)).sum().backward()
    assert psm.per_sample_projections()["0.weight"].shape == (3, 12)
    psm.remove()


def test_a_one_dim_parameter_of_a_kronecker_projection_is_count_sketched() -> None:
    """A bias's block is a CountSketch: one ``±1`` per column (each coordinate to one feature, with a
    sign), drawn from its key; applying it equals multiplying by that matrix, in float64 and float32."""
    projector = Projector(Spec(64, "kron", 3), "fc.bias", (300,))
    assert projector.sketch and not projector.kron
    p = projector.matrix()
    assert p.shape == (64, 300)
    assert torch.equal((p != 0).sum(0), torch.ones(300, dtype=torch.long))
    assert set(p[p != 0].tolist()) == {-1.0, 1.0}
    assert torch.equal(p, Projector(Spec(64, "kron", 3), "fc.bias", (300,)).matrix())
    assert not torch.equal(p, Projector(Spec(64, "kron", 4), "fc.bias", (300,)).matrix())
    g = torch.randn(5, 300, dtype=torch.float64)
    assert_close(projector.apply(g), g @ p.T, "sketched features")
    torch.testing.assert_close(projector.apply(g.float()), (g @ p.T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("k", "rows", "cols", "expected"),
    [
        (128, 256, 32, (32, 4)),  # an LM head [vocab, width]: the vocabulary the most compressed side before
        (128, 32, 256, (4, 32)),
        (128, 32, 32, (8, 16)),  # square, 2 r^2: a tie, the smaller r_row (as version 2)
        (64, 8, 8, (8, 8)),  # square, r^2
        (128, 128, 32, (16, 8)),  # 2 and 8 equally far from 4: the cheaper (128 * 16 + 32 * 8)
        (128, 10, 64, (4, 32)),  # never 16 rows for 10 (version 2 gave 16 x 8)
        (512, 512, 784, (16, 32)),
        (4096, 50257, 768, (512, 8)),
        (18, 3, 3, (3, 6)),
    ],
)
def test_kronecker_ranks_follow_the_proportion_of_the_sides(
    k: int, rows: int, cols: int, expected: tuple[int, int]
) -> None:
    """``r_row * r_col = k`` with ``r_row / r_col`` nearest ``rows / cols`` in log among every factor pair of
    ``k`` (checked here by brute force in floats), the Projector's ranks and its factors' shapes."""
    got = kron_ranks(k, rows, cols)
    assert got == expected and got[0] * got[1] == k
    pairs = [(r, k // r) for r in range(1, k + 1) if k % r == 0]
    distance = [abs(math.log(a / b) - math.log(rows / cols)) for a, b in pairs]
    assert abs(math.log(got[0] / got[1]) - math.log(rows / cols)) <= min(distance) + 1e-12
    projector = Projector(Spec(k, "kron", seed=1), "w", (rows, cols))
    assert projector.ranks == expected
    if rows * cols <= 1 << 16:
        row, col = projector.factors()
        assert row.shape == (expected[0], rows) and col.shape == (expected[1], cols)
    conv = Projector(Spec(k, "kron", seed=1), "conv", (rows, 1, cols))  # [out, in, kernel]: C * prod(rest)
    assert conv.ranks == expected
    with pytest.raises(ValueError):
        kron_ranks(24, rows, cols)  # neither a square nor twice one
