"""Layers whose weight gradient pergrad writes itself run with that weight detached after the first
backward (``detach_transformed=True``): autograd skips the weight gradient, and every result stays
what plain autograd and torch.func give."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from pergrad import DetachedWeightError, PerSampleModule, transforms
from pergrad._core.shortcuts.detach import Detacher, touch
from tests.reference import assert_close, clipped_mean, reference_grad_sample
from tests.test_fused import check_statistics
from tests.test_host_syncs import counting_syncs


def conv_net(bias: bool) -> nn.Module:
    """Positions enough that materialising mode detaches the convolutions and the Linear on [B, T, D]."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=bias), nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1, bias=bias), nn.Flatten(2), nn.Linear(36, 5, bias=bias), nn.Flatten(),
        nn.Linear(20, 3, bias=bias),
    ).double()  # fmt: skip


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize(("keep", "clip"), [(True, True), (True, False), (False, True), (False, False)])
def test_steps_after_the_first_are_exact(bias: bool, input_grad: bool, keep: bool, clip: bool) -> None:
    torch.manual_seed(0)
    model = conv_net(bias)
    x, y = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    ref = reference_grad_sample(model, x, y, loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    expected = clipped_mean(ref, 0.5) if clip else {k: g.mean(0) for k, g in ref.items()}
    weight_grads_by_autograd = []
    # on the AccumulateGrad nodes (held: they are cached weakly): a tensor hook would keep the weight attached
    nodes = [get_gradient_edge(p).node for p in model.parameters() if p.dim() > 1]
    for node in nodes:
        # a detached weight's AccumulateGrad runs with no gradient (pergrad's touch): not computed by autograd
        node.register_prehook(lambda g: weight_grads_by_autograd.append(g) if g[0] is not None else None)
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        if clip:
            psm.register_transform(model, transforms.clip_norm(0.5))
        for step in range(3):
            weight_grads_by_autograd.clear()
            psm.zero_grad()
            F.cross_entropy(psm(x.clone().requires_grad_(input_grad)), y).backward()
            norms = psm.per_sample_norms()
            for name, p in model.named_parameters():
                assert type(p) is nn.Parameter
                assert_close(p.grad, expected[name], f"step {step}: .grad of {name}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"step {step}: norms of {name}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"step {step}: grad_sample of {name}")
            # the first backward is checked against autograd's gradients; later ones skip them, except,
            # without a transform, for the two Linears (4 and 1 positions per sample): summing their
            # built g_i would cost more than autograd's weight gradient (and norms do not build them)
            assert len(weight_grads_by_autograd) == (4 if step == 0 else 0 if clip else 2)


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=[x])"])
def test_input_gradients_after_the_first_step_leave_parameters_alone(how: str) -> None:
    """The detached weights' anchors (bias or pergrad's zero) tell ``.backward()`` from
    ``torch.autograd.grad`` and ``backward(inputs=[x])``: those write no parameter's ``.grad``."""
    torch.manual_seed(1)
    for bias in (True, False):
        model = conv_net(bias)
        x, y = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
        xr = x.clone().requires_grad_()
        (expected,) = torch.autograd.grad(F.cross_entropy(model(xr), y), xr)
        with PerSampleModule(model, keep_grad_sample=False) as psm:
            psm.register_transform(model, transforms.clip_norm(1.0))
            F.cross_entropy(psm(x), y).backward()
            psm.zero_grad()
            xr = x.clone().requires_grad_()
            loss = F.cross_entropy(psm(xr), y)
            if how == "autograd.grad":
                (gx,) = torch.autograd.grad(loss, xr)
            else:
                loss.backward(inputs=[xr])
                gx = xr.grad
            assert_close(gx, expected)
            assert all(p.grad is None for p in model.parameters())


def test_model_is_restored_after_a_forward_that_raises() -> None:
    torch.manual_seed(2)
    model = conv_net(bias=False)
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with PerSampleModule(model) as psm:
        psm.register_transform(model, transforms.clip_norm(1.0))
        F.cross_entropy(psm(x), y).backward()
        with pytest.raises(RuntimeError):
            psm(torch.randn(4, 5, 6, 6, dtype=torch.float64))  # wrong channel count
        assert all(type(p) is nn.Parameter for p in model.parameters())
        assert all(m.bias is None for m in model if isinstance(m, nn.Conv2d | nn.Linear))
        assert sorted(model.state_dict()) == sorted(conv_net(bias=False).state_dict())


def test_autograd_grad_of_a_detached_weight_needs_the_opt_out() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for detach in (True, False):
        with PerSampleModule(model, detach_transformed=detach) as psm:
            psm.register_transform(model, transforms.clip_norm(1.0))
            F.cross_entropy(psm(x), y).backward()
            loss = F.cross_entropy(psm(x), y)
            if detach:
                with pytest.raises(
                    DetachedWeightError, match=r"weight of layer '0' \(Linear\).*detach_transformed=False"
                ):
                    torch.autograd.grad(loss, model[0].weight)
            else:
                (g,) = torch.autograd.grad(loss, model[0].weight)
                assert_close(g, torch.autograd.grad(F.cross_entropy(model(x), y), model[0].weight)[0])


class Tokens(nn.Module):
    """A Linear on 16 positions per sample (detached with statistics) between two small ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.wide, self.head = nn.Linear(3, 6), nn.Linear(6, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(torch.tanh(self.inp(x)))).mean(1))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("model_kind", ["conv", "tokens"])
def test_statistics_after_the_first_step_take_means_from_built_gradients(keep: bool, model_kind: str) -> None:
    torch.manual_seed(4)
    if model_kind == "conv":
        model, x = conv_net(bias=True), torch.randn(5, 3, 6, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (5,))
    else:
        model, x = Tokens().double(), torch.randn(5, 16, 3, dtype=torch.float64)
        y = torch.randint(0, 2, (5,))
    ref = reference_grad_sample(model, x, y, loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    with PerSampleModule(model, keep_grad_sample=keep, track_statistics=True) as psm:
        for _ in range(3):
            psm.zero_grad()
            F.cross_entropy(psm(x), y).backward()
            check_statistics(psm.statistics(), ref)
            for name, p in model.named_parameters():
                assert_close(p.grad, ref[name].mean(0), f".grad of {name}")


def test_a_transform_registered_after_some_steps_detaches_its_weights_from_then_on() -> None:
    """With nothing to compute, no layer gets the detaching hooks; registering a transform installs
    them for the weights it covers, and the steps stay exact."""
    torch.manual_seed(3)
    model = conv_net(True)
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    ref = reference_grad_sample(model, x, y, loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    by_autograd: list[torch.Tensor] = []
    nodes = [get_gradient_edge(p).node for p in model.parameters() if p.dim() > 1]
    for node in nodes:
        node.register_prehook(lambda g: by_autograd.append(g) if g[0] is not None else None)  # (as above)
    with PerSampleModule(model, keep_grad_sample=False) as psm:
        hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
        for step in range(5):
            if step == 2:
                psm.register_transform("4", transforms.clip_norm(0.5))  # the Linear on [B, 4, 36]
                # re-installed with the detacher and the tap that checks what reaches the weights
                # (pergrad._core.shortcuts.reach) inside the layer's one pre-hook: no hook more
                assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks
            by_autograd.clear()
            psm.zero_grad()
            F.cross_entropy(psm(x), y).backward()
            expected = {k: g.mean(0) for k, g in ref.items()}
            if step >= 2:
                expected.update(
                    {f"4.{k}": v for k, v in clipped_mean({k: ref[f"4.{k}"] for k in ("weight", "bias")}, 0.5).items()}
                )
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step}: .grad of {name}")
            assert len(by_autograd) == (4 if step < 2 else 3)  # from then on, the Linear's weight is pergrad's


def test_the_zero_a_touched_weight_gets_is_recognised_without_reading_it() -> None:
    """Under DDP a detached weight's ``AccumulateGrad`` gets ``touch``'s zero at every step; telling
    it from a real gradient (which would mean the weight was used outside its layer) must not read
    a value, or every DDP step would make the host wait for the GPU once per detached weight."""
    detacher = Detacher(engine=None)  # type: ignore[arg-type]  # _zero and is_touch_zero need no engine
    w = nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    arrived: list[Tensor] = []
    w.register_hook(lambda g: arrived.append(g))
    touch(x, (w,), detacher._zero(w)).sum().backward()
    with counting_syncs() as found:
        assert detacher.is_touch_zero(arrived[-1])
    assert found == []
    assert torch.equal(w.grad, torch.zeros(3, 2, dtype=torch.float64))
    # the zero summed with a real gradient is not the zero any more
    (touch(x, (w,), detacher._zero(w)).sum() + (w * 2).sum()).backward()
    assert not detacher.is_touch_zero(arrived[-1])
    assert torch.equal(arrived[-1], torch.full((3, 2), 2.0, dtype=torch.float64))
    assert not detacher.is_touch_zero(torch.zeros((), dtype=torch.float64).expand(3, 2))  # another zero


class Embedded(nn.Module):
    """Token and position embeddings (the position ids shared by the batch) before a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(11, 6, padding_idx=0), nn.Embedding(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("keep", [True, False])
def test_embeddings_run_detached_after_the_first_step_and_stay_exact(keep: bool) -> None:
    """An embedding has no bias to anchor its call: pergrad's probe is added to its output instead,
    so a clipped embedding's weight gradient is pergrad's alone from the second backward on, over
    batches of changing sizes and lengths, with padding and position ids shared by the batch."""
    torch.manual_seed(3)
    model = Embedded().double()
    embeddings = {"tok.weight", "pos.weight"}
    by_autograd: list[str] = []
    nodes = {name: get_gradient_edge(p).node for name, p in model.named_parameters()}
    for name, node in nodes.items():
        node.register_prehook(lambda g, name=name: by_autograd.append(name) if g[0] is not None else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    with PerSampleModule(model, keep_grad_sample=keep) as psm:
        psm.register_transform(model, transforms.clip_norm(0.4))
        for step, (batch, length) in enumerate([(4, 5), (3, 8), (5, 2), (2, 5)]):
            ids = torch.randint(0, 11, (batch, length))
            ids[0, -1] = 0  # a padding token
            y = torch.randint(0, 3, (batch,))
            ref = reference_grad_sample(model, ids, y, loss=lambda out, t: F.cross_entropy(out, t, reduction="sum"))
            expected = clipped_mean(ref, 0.4)
            by_autograd.clear()
            optimizer.zero_grad()
            F.cross_entropy(psm(ids), y).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad, expected[name], f"step {step}: .grad of {name}")
                if keep:
                    assert_close(p.grad_sample, ref[name], f"step {step}: grad_sample of {name}")
            assert embeddings.isdisjoint(by_autograd) == (step > 0), f"step {step}: autograd computed {by_autograd}"
            optimizer.step()
        ids = torch.randint(1, 11, (2, 3))
        with pytest.raises(DetachedWeightError, match="Pass detach_transformed=False"):
            torch.autograd.grad(psm(ids).sum(), [model.tok.weight])
