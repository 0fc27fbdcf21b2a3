"""Projected features beyond tests/test_projection.py: projection-only weights that skip autograd's
weight gradient (``grads=False``), the Kronecker form of transposed convolutions, per-token features
(``per_token=True``) and features under DDP. Every step of a loop is checked in float64 against
torch.func (or one-sample-at-a-time autograd), with ``P`` regenerated from the parameters' names."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, jacrev, vmap

import pergrad._core.backward.sources
from pergrad import PerSampleModule, TargetError, transforms
from pergrad.attribution.projectors import Projector, Spec
from pergrad.errors import ProjectionError
from tests.reference import assert_close, clipped_mean, reference_grad_sample, run_pergrad
from tests.strategies import conv_layers
from tests.test_distributed import Pool, make_model
from tests.test_projection import CASES, DIM, OPTIONS, Attention, Tied

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D

BATCHES = [3, 5, 4, 6]  # detaching starts after the first backward: four steps, changing sizes


def _features(grads: dict[str, Tensor], net: nn.Module, spec: Spec, prefix: str = "") -> Tensor:
    """``sum_p P_p vec(g(p))`` over the parameters under ``prefix``, for ``grads[name]`` ``[*lead, *shape]``
    (per sample ``[B, ...]`` or per token ``[B, T, ...]``)."""
    total: Tensor | None = None
    for name, p in net.named_parameters():
        if name.startswith(prefix) and p.requires_grad:  # (frozen parameters have no gradient to project)
            g = grads[name]
            flat = g.reshape(*g.shape[: g.dim() - p.dim()], -1)
            term = flat @ Projector(spec, name, tuple(p.shape)).matrix().T
            total = term if total is None else total + term
    assert total is not None
    return total


def _target_like(net: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():  # (not a forward pergrad follows)
        return torch.randn_like(net(x))


# -- 1. grads=False: the projection is the weights' only consumer -----------------------------------

# family (of tests/test_projection.CASES) -> the parameters of its first layer "0" that run detached
GRADLESS = {
    "linear": ["0.weight"],  # its bias anchors the call (pergrad._core.shortcuts.detach): autograd's .grad, exact
    "conv1d": ["0.weight", "0.bias"],  # a convolution's bias goes with its weight
    "hf_conv1d": ["0.weight"],
    "embedding": ["0.weight"],  # no bias: pergrad's probe added to its output anchors the call
}


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])  # both sides of detach.MANY
@pytest.mark.parametrize("family", sorted(GRADLESS))
def test_projection_only_weights_skip_their_weight_gradient(
    family: str, positions: int, keep_grad_sample: bool, verify: bool
) -> None:
    torch.manual_seed(0)
    net, batch_of, out_shape = CASES[family](positions)
    net = net.double()
    names = dict(net.named_parameters())
    computed: list[str] = []  # the parameters autograd delivered a gradient to in this backward
    # pre-hooks on the AccumulateGrad nodes (held: cached weakly), before pergrad's: a detached weight's
    # node runs with no gradient (pergrad's touch); a tensor hook would keep the weight attached
    nodes = {name: get_gradient_edge(p).node for name, p in names.items()}
    for name, node in nodes.items():
        node.register_prehook(lambda g, name=name: computed.append(name) if g[0] is not None else None)
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample, verify=verify)
    only = Spec(32, seed=3)  # r 4 x 8: no factor has the shape of a weight
    psm.register_projection("0", dim=32, seed=3, grads=False)
    whole = Spec(DIM, seed=1)
    psm.register_projection(net, dim=DIM, seed=1)  # overlapping, with .grad: fine
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for step, batch in enumerate(BATCHES):
        x, y = batch_of(batch), torch.randn(batch, *out_shape, dtype=torch.float64)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        computed.clear()
        run_pergrad(psm, x, y)
        found = psm.per_sample_projections()
        assert_close(found["0"], _features(ref, net, only, "0."), f"step {step}: features of the projection-only layer")
        assert_close(found[""], _features(ref, net, whole), f"step {step}: features of the model")
        detached = GRADLESS[family] if step > 0 or not verify else []
        if step == 0 and verify:  # the check of the first backward needs autograd's gradients: all computed
            assert set(computed) == set(names)
        for name, p in names.items():
            if name in detached:
                assert p.grad is None, f"step {step}: {name}.grad was written"
                assert name not in computed, f"step {step}: autograd computed {name}'s gradient"
            else:
                assert p.grad is not None
                assert_close(p.grad, ref[name].mean(0), f"step {step}: {name}.grad")
            if keep_grad_sample:
                assert_close(p.grad_sample, ref[name], f"step {step}: {name}.grad_sample")
        optimizer.step()
    psm.remove()


def test_a_transform_cannot_cover_a_projection_only_parameter() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    psm = PerSampleModule(net)
    psm.register_projection("0", dim=16, grads=False)
    with pytest.raises(
        TargetError,
        match=r"the whole model has a transform, and the projection of module '0' with grads=False leaves the "
        r"\.grad of \['0\.bias', '0\.weight'\] unwritten: .* with grads=True \(the default\)",
    ):
        psm.register_transform(net, transforms.clip_norm(1.0))
    psm.register_transform("2", transforms.clip_norm(1.0))  # no parameter in common: fine
    with pytest.raises(
        TargetError, match=r"module '2' has a transform, and the projection of parameter '2\.weight' with grads=False"
    ):
        psm.register_projection("2.weight", dim=16, grads=False)
    psm.register_projection("2.weight", dim=16)  # with .grad: fine
    psm.remove()


# -- 2. transposed convolutions: Kronecker, nothing built -------------------------------------------

# name -> (model for p input positions, input of a batch)
TRANSPOSED: dict[str, Callable[[int], tuple[nn.Module, Callable[[int], Tensor]]]] = {
    "1d": lambda p: (
        nn.Sequential(nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2)),
        lambda b: torch.randn(b, 4, p, dtype=torch.float64),
    ),
    "2d": lambda p: (
        nn.Sequential(
            nn.ConvTranspose2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0), dilation=(1, 2)),
            nn.Tanh(),
            nn.ConvTranspose2d(4, 2, 2, bias=False),
        ),
        lambda b: torch.randn(b, 2, p, 1, dtype=torch.float64),
    ),
    "2d_one_channel": lambda p: (  # its twin runs 1 -> 8 channels: P_row g_i(W) by batch-as-groups (attribution.forms.conv._conv_kron)
        nn.Sequential(nn.ConvTranspose2d(8, 1, (3, 1), stride=(2, 1), padding=(1, 0), output_padding=(1, 0))),
        lambda b: torch.randn(b, 8, p, 1, dtype=torch.float64),
    ),
    "3d": lambda p: (
        nn.Sequential(
            nn.ConvTranspose3d(2, 3, (1, 2, 3), stride=(1, 1, 2), padding=(0, 0, 1), output_padding=(0, 0, 1))
        ),
        lambda b: torch.randn(b, 2, 1, 1, p, dtype=torch.float64),
    ),
}


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("positions", [15, 17])
@pytest.mark.parametrize("case", sorted(TRANSPOSED))
def test_conv_transpose_features_every_step(case: str, positions: int, keep_grad_sample: bool, clip: bool) -> None:
    """Features, ``.grad`` (clipped: the fused norms and weighted sums) and norms, every step."""
    torch.manual_seed(0)
    net, batch_of = TRANSPOSED[case](positions)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample, track_norms=True)
    if clip:
        psm.register_transform(net, transforms.clip_norm(0.5))
    psm.register_projection(net, dim=DIM, seed=2)
    psm.register_projection("0.weight", dim=16, kind="dense", seed=4)
    names = dict(net.named_parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for step, batch in enumerate(BATCHES):
        x = batch_of(batch)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        run_pergrad(psm, x, y)
        found = psm.per_sample_projections()
        assert_close(found[""], _features(ref, net, Spec(DIM, seed=2)), f"step {step}: kron features")
        dense = _features(ref, net, Spec(16, "dense", seed=4), "0.weight")
        assert_close(found["0.weight"], dense, f"step {step}: dense features")
        grads = clipped_mean(ref, 0.5) if clip else {n: g.mean(0) for n, g in ref.items()}
        norms = psm.per_sample_norms()
        for name, p in names.items():
            assert p.grad is not None
            assert_close(p.grad, grads[name], f"step {step}: {name}.grad")
            assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"step {step}: norms of {name}")
        optimizer.step()
    psm.remove()


@pytest.mark.parametrize("case", sorted(TRANSPOSED))
def test_conv_transpose_features_build_no_per_sample_gradient(case: str) -> None:
    torch.manual_seed(0)
    net, batch_of = TRANSPOSED[case](17)
    net = net.double()
    psm = PerSampleModule(net, keep_grad_sample=False, verify=False)
    psm.register_projection(net, dim=DIM)
    for batch in BATCHES:
        x = batch_of(batch)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        with mock.patch.object(
            pergrad._core.backward.sources, "run_rule", side_effect=AssertionError("a rule built g_i")
        ):
            run_pergrad(psm, x, y)
        assert_close(psm.per_sample_projections()[""], _features(ref, net, Spec(DIM)), "features")
    psm.remove()


@pytest.mark.parametrize(
    ("channels", "outputs", "size"),
    # (attribution.forms.conv._conv_kron, by flops; 3x3 kernel, no padding: size 3 gives one position, 6 gives 16, 8 gives 36)
    # U V^T with U = P_row d_i: one position, V by a channels-last convolution (1 input channel) or a
    # channels-first one (8);
    # P_row g_i(W), then P_col^T: from the unfolded patches (1 input channel, 16 positions) or by
    # batch-as-groups (8 input channels, 36 positions, 128 outputs);
    # P_row (d_i V^T): 3 outputs, V channels-last (4 input channels) or channels-first (8)
    [(1, 16, 3), (8, 16, 3), (1, 16, 6), (8, 128, 8), (4, 3, 6), (8, 3, 6)],
)
def test_conv_features_by_each_contraction(channels: int, outputs: int, size: int) -> None:
    """A one-group convolution's Kronecker features contract ``d_i`` with ``P_row`` first, or with
    ``V = conv(a_i, P_col)`` first, or take ``P_row g_i(W)`` (by batch-as-groups or from the unfolded
    patches, as the weight rule would), whichever costs fewest flops, ``V`` by a channels-last convolution
    of few input channels or a channels-first one of more: every way exact, every step."""
    torch.manual_seed(2)
    positions = (size - 2) ** 2
    net = nn.Sequential(nn.Conv2d(channels, outputs, 3), nn.Flatten(), nn.Linear(outputs * positions, 2)).double()
    psm = PerSampleModule(net, keep_grad_sample=False, verify=False)
    psm.register_projection(net, dim=32, seed=5, grads=False)
    for batch in BATCHES:
        x = torch.randn(batch, channels, size, size, dtype=torch.float64)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        with mock.patch.object(
            pergrad._core.backward.sources, "run_rule", side_effect=AssertionError("a rule built g_i")
        ):
            run_pergrad(psm, x, y)
        assert_close(psm.per_sample_projections()[""], _features(ref, net, Spec(32, seed=5)), f"batch {batch}")
    psm.remove()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dim=st.sampled_from([2, 8, 32, 128]), wide=st.booleans())
def test_conv_features_of_any_convolution_every_step(data: st.DataObject, dim: int, wide: bool) -> None:
    """Any convolution (1-3-D, groups, stride, dilation, every padding mode) and any dim: ``_conv_kron``'s
    choice among its contractions moves with the shapes and the ranks; the features are exact at every step
    (the weights run detached from the first: ``verify=False``), with no ``g_i`` built."""
    layer, shape = data.draw(conv_layers(wide=wide))
    net = nn.Sequential(layer)
    psm = PerSampleModule(net, keep_grad_sample=False, verify=False)
    psm.register_projection(net, dim=dim, seed=3, grads=False)
    for batch in (shape[0], shape[0] + 2, shape[0] + 1):
        x = torch.randn(batch, *shape[1:], dtype=torch.float64)
        y = _target_like(net, x)
        ref = reference_grad_sample(net, x, y)
        with mock.patch.object(
            pergrad._core.backward.sources, "run_rule", side_effect=AssertionError("a rule built g_i")
        ):
            run_pergrad(psm, x, y)
        assert_close(psm.per_sample_projections()[""], _features(ref, net, Spec(dim, seed=3)), f"batch {batch}")
    psm.remove()


# -- 3. per-token features ----------------------------------------------------------------------------


class TokenWise(nn.Module):
    """Embedding, Linear, HF Conv1D, each token on its own: a token's loss term depends on it alone."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4, padding_idx=0)
        self.lin = nn.Linear(4, 5)
        self.head = Conv1D(3, 5)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(self.emb(ids))))


def _token_grads(net: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [B, T, *shape]}``: the gradient of each token's own loss term ``sum (out_it - y_it)^2``."""
    params = {k: p.detach() for k, p in net.named_parameters()}

    def losses(params: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(net, params, (xi.unsqueeze(0),))[0]
        return (out - yi).pow(2).flatten(1).sum(1)  # [T]

    return vmap(jacrev(losses), in_dims=(None, 0, 0))(params, x, y)


def _ids(b: int, t: int) -> Tensor:
    return torch.randint(0, 11, (b, t))


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
@pytest.mark.parametrize("tokens", [15, 17])
@pytest.mark.parametrize("model", ["token_wise", "tied"])
def test_per_token_features_are_each_tokens_own_gradient(model: str, tokens: int, keep_grad_sample: bool) -> None:
    torch.manual_seed(0)
    net = (TokenWise() if model == "token_wise" else Tied()).double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample)
    psm.register_projection(net, dim=DIM, seed=6, per_token=True)
    first = next(iter(net.named_children()))[0]
    psm.register_projection(first, dim=32, seed=7)  # per sample, beside it
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for step, batch in enumerate(BATCHES):
        x = _ids(batch, tokens)
        x[0, :2] = 0  # padding tokens: their rows get nothing
        y = _target_like(net, x)
        per_token = _token_grads(net, x, y)
        ref = reference_grad_sample(net, x, y)
        optimizer.zero_grad()
        run_pergrad(psm, x, y)
        found = psm.per_sample_projections()
        assert found[""].shape == (batch, tokens, DIM)
        assert_close(found[""], _features(per_token, net, Spec(DIM, seed=6)), f"step {step}: per-token features")
        assert_close(found[""].sum(1), _features(ref, net, Spec(DIM, seed=6)), f"step {step}: summed over tokens")
        assert_close(found[first], _features(ref, net, Spec(32, seed=7), first + "."), f"step {step}: per sample")
        for name, p in net.named_parameters():  # .grad is unchanged by the projection
            assert p.grad is not None
            assert_close(p.grad, ref[name].mean(0), f"step {step}: {name}.grad")
        optimizer.step()
    psm.remove()


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over attention
@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_per_token_features_of_a_layer_before_attention_are_its_positions_terms(keep_grad_sample: bool) -> None:
    """Attention mixes the tokens: a token's term ``g_it = d_it a_it^T`` of the Linear before it is not the
    gradient of token t's own loss, but the term of ``g_i`` at position t (they sum to ``g_i``). The
    reference: ``d_it``, the gradient of sample i's loss with respect to the Linear's output, by torch.func."""
    torch.manual_seed(0)
    net = Attention().double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample)
    psm.register_projection("inp", dim=DIM, seed=1, per_token=True)
    spec_w = Projector(Spec(DIM, seed=1), "inp.weight", (4, 4)).matrix()
    spec_b = Projector(Spec(DIM, seed=1), "inp.bias", (4,)).matrix()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for step, batch in enumerate(BATCHES):
        x, y = torch.randn(batch, 17, 4, dtype=torch.float64), torch.randn(batch, 17, 4, dtype=torch.float64)
        with torch.no_grad():  # (not a forward pergrad follows)
            h = net.inp(x)

        def loss(hi: Tensor, yi: Tensor) -> Tensor:
            out = net.attn(hi[None], hi[None], hi[None], need_weights=False)[0][0]
            return (out - yi).pow(2).sum()

        d = vmap(torch.func.grad(loss))(h, y)  # [B, T, 4]
        terms = torch.einsum("nto,nti->ntoi", d, x).flatten(2) @ spec_w.T + d @ spec_b.T
        optimizer.zero_grad()
        run_pergrad(psm, x, y)
        assert_close(psm.per_sample_projections()["inp"], terms, f"step {step}: per-position terms")
        optimizer.step()
    psm.remove()


@pytest.mark.parametrize("keep_grad_sample", [True, False], ids=["materialised", "fused"])
def test_per_token_features_beside_projected_factors_read_each_call_once(keep_grad_sample: bool) -> None:
    """Both read the kept ``(a, d)`` of a call at the end of the backward: each call counts once."""
    torch.manual_seed(0)
    net = TokenWise().double()
    psm = PerSampleModule(net, keep_grad_sample=keep_grad_sample)
    psm.register_projection("lin", dim=16, per_token=True)
    psm.register_projection("lin.weight", dim=16)
    psm.track_projected_factors("lin.weight")
    seen = 0
    for step, batch in enumerate(BATCHES):
        x = _ids(batch, 9)
        y = _target_like(net, x)
        per_token = _token_grads(net, x, y)
        run_pergrad(psm, x, y)
        seen += batch * 9
        found = psm.per_sample_projections()["lin"]
        assert_close(found, _features(per_token, net, Spec(16), "lin."), f"step {step}: per-token features")
        assert psm.projected_factors()["lin.weight"].positions == seen, f"step {step}: positions of the factors"
    psm.remove()


def test_per_token_refusals_name_the_layer_and_the_fix() -> None:
    net = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    psm = PerSampleModule(net)
    with pytest.raises(
        ProjectionError, match=r"per-token features are Kronecker only, got kind='dense'; pass kind='kron'"
    ):
        psm.register_projection(net, dim=16, kind="dense", per_token=True)
    with pytest.raises(
        ProjectionError,
        match=r"per_token=True\) on the whole model: layer '1' \(LayerNorm\) has no per-token form .*per_token=False",
    ):
        psm.register_projection(net, dim=16, per_token=True)
    psm.register_projection("2", dim=16, per_token=True)
    psm(torch.randn(3, 7, 4, dtype=torch.float64)).sum().backward()
    assert psm.per_sample_projections()["2"].shape == (3, 7, 16)
    with pytest.raises(
        ProjectionError, match=r"layer '2' \(Linear\) was called on an input of shape \(3, 5\); per-token features "
    ):
        psm(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    psm.remove()


# -- 4. DDP: each rank's features are one process's features of its samples --------------------------

DDP_SIZES = [(3, 5), (4, 2), (6, 1), (2, 7)]  # per step, per rank


def _ddp_batches() -> list[list[tuple[Tensor, Tensor]]]:
    gen = torch.Generator().manual_seed(3)
    return [
        [
            (torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen).double())
            for n in sizes
        ]
        for sizes in DDP_SIZES
    ]


def ddp_features(rank: int, world: int, keep: bool, order: str) -> list[dict[str, Any]]:
    """Per step: the parameters before the step, and this rank's features."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    if order == "wrap-ddp":  # PerSampleModule(DDP(net)): parameter names start with DDP's "module."
        psm = PerSampleModule(DistributedDataParallel(model), keep_grad_sample=keep)
        call: nn.Module | PerSampleModule = psm
    else:  # PerSampleModule(net), then DDP(net): pergrad finds it at the first forward
        psm = PerSampleModule(model, keep_grad_sample=keep)
        call = DistributedDataParallel(model)
    psm.register_projection(model, dim=DIM, seed=9)
    psm.register_projection(model[2], dim=16, kind="dense", seed=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in _ddp_batches():
        x, t = step[rank]
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        ((call(x) - t).pow(2).sum() / len(x)).backward()
        found = psm.per_sample_projections()
        out.append({"params": params, "features": {k: v.clone() for k, v in found.items()}})
        opt.step()
        opt.zero_grad()
    psm.remove()
    return out


@pytest.fixture(scope="module")
def pool2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pool = Pool(2, Path(tmp_path_factory.mktemp("projection_world2")))
    yield pool
    pool.close()


@pytest.mark.parametrize("order", ["wrap-ddp", "ddp-net"])
@pytest.mark.parametrize("keep", [True, False], ids=["materialised", "fused"])
def test_ddp_features_of_each_rank_are_one_process_features_of_its_samples(pool2: Pool, keep: bool, order: str) -> None:
    results = pool2.run(ddp_features, keep, order)
    model = make_model()
    batches = _ddp_batches()
    for rank, steps in enumerate(results):
        for step, got in enumerate(steps):
            model.load_state_dict(got["params"])
            x, t = batches[step][rank]
            ref = reference_grad_sample(model, x, t)
            feats = got["features"]
            whole, part = ("module", "module.2") if order == "wrap-ddp" else ("", "2")  # keys: names in what is wrapped
            assert_close(feats[whole], _features(ref, model, Spec(DIM, seed=9)), f"rank {rank} step {step}")
            dense = _features(ref, model, Spec(16, "dense", seed=9), "2.")
            assert_close(feats[part], dense, f"rank {rank} step {step}: dense features of layer 2")


# -- 5. projected as each output gradient arrives -------------------------------------------------------


@pytest.mark.parametrize("grads", [True, False])
@pytest.mark.parametrize("kind", ["kron", "dense", "sjlt"])
@pytest.mark.parametrize("family", sorted(CASES))
def test_features_are_the_same_numbers_at_the_end_of_the_backward_or_as_each_gradient_arrives(
    family: str, kind: str, grads: bool
) -> None:
    """The first backward (its check reads every call at the end) and the later ones (a call only the
    projection reads is projected as its output gradient arrives) give the same batch the same features,
    to float64 round-off (the two paths may sum in another order: bit-for-bit equality held on some
    machines, not on others, for the recurrent layers), and those of torch.func."""
    torch.manual_seed(0)
    net, batch_of, out_shape = CASES[family](17)
    net = net.double()
    x, y = batch_of(4), torch.randn(4, *out_shape, dtype=torch.float64)
    psm = PerSampleModule(net, keep_grad_sample=False, **OPTIONS.get(family, {}))
    psm.register_projection(net, dim=DIM, kind=kind, seed=3, grads=grads)
    found = []
    for _ in range(3):
        psm.zero_grad()
        run_pergrad(psm, x, y)
        found.append(psm.per_sample_projections()[""])
    assert_close(found[0], _features(reference_grad_sample(net, x, y), net, Spec(DIM, kind, seed=3)), "torch.func")
    for step in (1, 2):
        assert_close(found[step], found[0], f"step {step}")
    psm.remove()


@pytest.mark.parametrize("grads", [True, False])
def test_a_projected_call_lets_its_output_gradient_go_before_the_backward_ends(grads: bool) -> None:
    """What only the projection reads is not held to the end of the backward: the last layer's output
    gradient is freed before the backward reaches the model's input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    psm = PerSampleModule(net, keep_grad_sample=False)
    psm.register_projection(net, dim=DIM, seed=3, grads=grads)
    caught: list[weakref.ref[Tensor]] = []
    alive: list[bool] = []
    for step in range(3):
        caught.clear()
        alive.clear()
        x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
        out = psm(x)
        out.register_hook(lambda g: caught.append(weakref.ref(g)))
        x.register_hook(lambda g: alive.append(caught[0]() is not None))
        out.pow(2).sum().backward()
        del out
        assert alive == [step == 0], f"step {step}: the output gradient alive at the input: {alive}"  # (0: the check)
    psm.remove()


def test_a_backward_that_reaches_part_of_the_model_gets_the_features_of_that_part() -> None:
    """Only the parameters a backward accumulates into count: ``backward(inputs=[bias])`` gives the
    bias's features (not its weight's, though the layer's output gradient arrived), and
    ``torch.autograd.grad`` of the input (a saliency map) none, so reading them is refused; the ordinary backward after each gets
    every parameter's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    psm = PerSampleModule(net, keep_grad_sample=False)
    spec = Spec(DIM, seed=3)
    psm.register_projection(net, dim=DIM, seed=3, grads=False)
    for step in range(4):
        x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
        y = torch.randn(5, 3, dtype=torch.float64)
        ref = reference_grad_sample(net, x.detach(), y)
        ((psm(x) - y).pow(2).sum() / 5).backward(inputs=[net[2].bias])
        assert_close(psm.per_sample_projections()[""], _features(ref, net, spec, "2.bias"), f"step {step}: inputs=")
        torch.autograd.grad((psm(x) - y).pow(2).sum() / 5, x)
        with pytest.raises(ProjectionError, match=r"accumulated into no parameter .* torch.autograd.grad call"):
            psm.per_sample_projections()
        ((psm(x) - y).pow(2).sum() / 5).backward()
        assert_close(psm.per_sample_projections()[""], _features(ref, net, spec), f"step {step}: every parameter")
    psm.remove()
