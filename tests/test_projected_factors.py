"""Kronecker factors of projected weights (``track_projected_factors``): every step's sums of ``u u^T``
and ``v v^T`` checked against ``u``, ``v`` recomputed by hand from each layer call's input and output
gradient (hooks of the test's own), and the features against ``vec(sum_s u v^T)`` and torch.func."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from reference import assert_close, reference_grad_sample, run_pergrad
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution.projectors import Projector, Spec
from pergrad.errors import ProjectionError
from tests.test_projection import Attention, Tied, Twice, floats, token_ids

DIM, SEED = 8, 4  # kron: 2 x 4


def _hf_conv1d(t: int) -> tuple[nn.Module, Callable[[int], Tensor], tuple[int, ...]]:
    conv1d = pytest.importorskip("transformers").pytorch_utils.Conv1D
    return nn.Sequential(conv1d(5, 4), nn.Tanh(), conv1d(3, 5)), floats(t, 4), (t, 3)


# family -> (model for t positions, input of a batch, output shape)
CASES: dict[str, Callable[[int], tuple[nn.Module, Callable[[int], Tensor], tuple[int, ...]]]] = {
    "linear": lambda t: (nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), floats(t, 4), (t, 3)),
    "conv1d": lambda t: (
        nn.Sequential(
            nn.Conv1d(4, 4, 3, padding=2, dilation=2, groups=2), nn.Tanh(), nn.Conv1d(4, 2, 3, stride=2, padding=1)
        ),
        floats(4, t),
        (2, (t - 1) // 2 + 1),
    ),
    "conv2d": lambda t: (
        nn.Sequential(nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2)), nn.Tanh()),
        floats(2, t, 3),
        (4, (t - 1) // 2 + 1, 3),
    ),
    "hf_conv1d": _hf_conv1d,
    "tied": lambda t: (Tied(), token_ids(t), (t, 11)),
    "twice": lambda t: (Twice(), floats(t, 4), (t, 3)),
}


def _patches(conv: nn.Conv1d | nn.Conv2d, a: Tensor) -> Tensor:
    """``[n, groups, L, C/g * prod(kernel)]``: each output position's input patch, per group, laid out
    as the weight ``[O, C/g, *kernel]`` flattens (unfolded by hand)."""
    n, groups = a.shape[0], conv.groups
    if isinstance(conv, nn.Conv2d):
        assert groups == 1
        cols = F.unfold(a, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # [n, C*kh*kw, L]
        return cols.transpose(1, 2).unsqueeze(1)
    (k,), (dil,), (stride,), (pad,) = conv.kernel_size, conv.dilation, conv.stride, conv.padding
    x = F.pad(a, (pad, pad)).unfold(2, dil * (k - 1) + 1, stride)[..., ::dil]  # [n, C, L, k]
    x = x.reshape(n, groups, a.shape[1] // groups, x.shape[2], k)
    return x.permute(0, 1, 3, 2, 4).reshape(n, groups, x.shape[3], -1)


def hand_factors(module: nn.Module, a: Tensor, d: Tensor, row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
    """``u [n, s, p]``, ``v [n, s, q]`` of one call from its input ``a`` and each sample's own output
    gradient ``d``, with ``P_row``, ``P_col`` of the weight's Kronecker block."""
    n = a.shape[0]
    if isinstance(module, nn.Embedding):  # rows: the vocabulary (one-hot tokens); padding adds nothing
        keep = (a != module.padding_idx).unsqueeze(2).double()
        return F.one_hot(a, module.num_embeddings).double() @ row.T * keep, d * keep @ col.T
    if isinstance(module, nn.Linear):
        return d.reshape(n, -1, d.shape[-1]) @ row.T, a.reshape(n, -1, a.shape[-1]) @ col.T
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        groups = module.groups
        patches = _patches(module, a)  # [n, g, L, C/g k]
        dg = d.reshape(n, groups, d.shape[1] // groups, -1)  # [n, g, o, L]
        u = torch.einsum("pgo,ngol->nglp", row.reshape(row.shape[0], groups, -1), dg)
        return u.reshape(n, -1, row.shape[0]), (patches @ col.T).reshape(n, -1, col.shape[0])
    # HF Conv1D: the weight is stored [in, out]
    return a.reshape(n, -1, a.shape[-1]) @ row.T, d.reshape(n, -1, d.shape[-1]) @ col.T


class Recorder:
    """Each call of the modules holding a tracked weight: its input and output gradient (hooks of the test's own)."""

    def __init__(self, net: nn.Module, weights: dict[str, nn.Parameter]) -> None:
        self.calls: list[tuple[str, nn.Module, Tensor, Tensor]] = []
        self.on = False  # off while torch.func computes the reference
        for module in net.modules():
            for name, p in weights.items():
                if getattr(module, "weight", None) is p:
                    module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            if not self.on:
                return
            a = inputs[0].detach()
            out.register_hook(lambda g: self.calls.append((name, module, a, g.detach())))

        return hook


def check_factors(family: str, positions: int, keep_grad_sample: bool, loss_reduction: str = "mean") -> None:
    torch.manual_seed(0)
    net, batch_of, out_shape = CASES[family](positions)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample, loss_reduction=loss_reduction)
    weights = {n: p for n, p in net.named_parameters() if p.dim() >= 2}
    for name in weights:  # one projection target per weight
        psm.register_projection(name, dim=DIM, seed=SEED)
    psm.register_projection(next(n for n, p in net.named_parameters() if p.dim() == 1), dim=4, kind="dense")
    psm.track_projected_factors(*weights)
    blocks = {n: Projector(Spec(DIM, seed=SEED), n, tuple(p.shape)).factors() for n, p in weights.items()}
    recorder = Recorder(net, weights)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    ranks = {n: Projector(Spec(DIM, seed=SEED), n, tuple(p.shape)).ranks for n, p in weights.items()}
    sums = {
        n: [torch.zeros(r, r, dtype=torch.float64), torch.zeros(q, q, dtype=torch.float64), 0]
        for n, (r, q) in ranks.items()
    }
    for step, batch in enumerate([3, 5, 4, 6]):  # the detaching shortcut starts after the first backward
        if step == 2:  # the sums start again
            psm.reset_projected_factors()
            sums = {n: [torch.zeros_like(s[0]), torch.zeros_like(s[1]), 0] for n, s in sums.items()}
        x, y = batch_of(batch), torch.randn(batch, *out_shape, dtype=torch.float64)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        recorder.calls.clear()
        recorder.on = True
        run_pergrad(psm, x, y, loss_reduction)
        recorder.on = False
        features = {n: torch.zeros(batch, DIM, dtype=torch.float64) for n in weights}
        for name, module, a, d in recorder.calls:
            own = d * batch if loss_reduction == "mean" else d  # each sample's own loss's output gradient
            u, v = hand_factors(module, a, own, *blocks[name])
            features[name] += torch.einsum("nsp,nsq->npq", u, v).flatten(1)
            sums[name][0] += torch.einsum("nsp,nsr->pr", u, u)
            sums[name][1] += torch.einsum("nsq,nsr->qr", v, v)
        found, projected = psm.projected_factors(), psm.per_sample_projections()
        assert set(found) == set(weights)
        for name, p in weights.items():
            sums[name][2] += batch
            matrix = Projector(Spec(DIM, seed=SEED), name, tuple(p.shape)).matrix()
            assert_close(features[name], ref[name].flatten(1) @ matrix.T, f"step {step}: {name}: vec(sum u v^T)")
            assert_close(projected[name], features[name], f"step {step}: {name}: features")
            f = found[name]
            assert f.samples == sums[name][2], f"step {step}: {name}: samples"
            assert f.row.dtype == f.col.dtype == torch.float64
            assert_close(f.row, sums[name][0] / f.samples, f"step {step}: {name}: row factor")
            assert_close(f.col, sums[name][1] / f.samples, f"step {step}: {name}: col factor")
        optimizer.step()
    psm.remove()


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])  # both sides of detach.MANY
@pytest.mark.parametrize("family", sorted(CASES))
def test_factors_match_hand_sums_every_step(family: str, positions: int, keep_grad_sample: bool) -> None:
    check_factors(family, positions, keep_grad_sample)


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("family", ["linear", "conv1d"])
def test_factors_are_of_each_samples_own_loss_under_a_sum_loss(family: str, keep_grad_sample: bool) -> None:
    check_factors(family, 17, keep_grad_sample, loss_reduction="sum")


def test_errors_name_the_target_and_the_fix() -> None:
    net = Attention()
    psm = PerSampleModule(net, keep_grad_sample=False)
    with pytest.raises(ProjectionError, match=r"no factors tracked; call track_projected_factors\('fc.weight'\)"):
        psm.projected_factors()
    with pytest.raises(ProjectionError, match=r"needs at least one projection target"):
        psm.track_projected_factors()
    with pytest.raises(
        ProjectionError,
        match=r"module 'inp' \(Linear\) has no projection; register one per weight first, e\.g\. "
        r"register_projection\('inp.weight', dim=64\)",
    ):
        psm.track_projected_factors(net.inp)
    psm.register_projection(net.inp, dim=8)
    with pytest.raises(
        ProjectionError,
        match=r"module 'inp' \(Linear\) projects 2 parameters \['inp.weight', 'inp.bias'\] into one sum of blocks.*"
        r"register_projection\('inp.weight', dim=\.\.\.\)",
    ):
        psm.track_projected_factors("inp")
    psm.register_projection("inp.bias", dim=8)
    with pytest.raises(
        ProjectionError, match=r"parameter 'inp.bias' \(shape \[4\]\) has no Kronecker block \(one dim: a CountSketch\)"
    ):
        psm.track_projected_factors("inp.bias")
    psm.register_projection("attn.in_proj_weight", dim=8)
    with pytest.raises(
        ProjectionError,
        match=r"parameter 'attn.in_proj_weight' is computed by layer 'attn' \(MultiheadAttention\), which has no "
        r"Kronecker factor form .*identity or the Gram matrix",
    ):
        psm.track_projected_factors(net.attn.in_proj_weight)
    psm.register_projection("inp.weight", dim=8)
    psm.track_projected_factors("inp.weight")
    with pytest.raises(ProjectionError, match=r"available after a backward pass"):
        psm.projected_factors()
    psm(torch.randn(3, 5, 4)).sum().backward()
    factors = psm.projected_factors()
    assert set(factors) == {"inp.weight"} and factors["inp.weight"].samples == 3
    assert factors["inp.weight"].positions == 15
    psm.reset_projected_factors()
    with pytest.raises(ProjectionError, match=r"available after a backward pass"):
        psm.projected_factors()
    psm.remove()
