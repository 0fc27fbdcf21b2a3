"""captum and pergrad: TracIn scores from ``grad_sample`` (``pergrad.integrations.captum``) against captum's own
``TracInCP`` and against torch.func, in float64, on a model trained a few steps while wrapped (its
weights run detached from the second backward on); captum's default mode on a model still wrapped is
refused with pergrad's error naming the ways out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from captum.influence import TracInCP, TracInCPFast
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pergrad import CaptumError, DetachedWeightError, PerSampleModule, transforms
from pergrad.integrations.captum import sample_grads, tracin_influence, tracin_self_influence
from tests.reference import assert_close, reference_grad_sample

RATES = [0.5, 0.25, 0.125]  # the learning rate each checkpoint's load function returns


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(11, 6), nn.Linear(6, 8)  # 17 positions: proj.weight runs detached
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.proj(self.emb(ids))).mean(1)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Tokens().double()


def data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 11, (n, 17), generator=gen), torch.randint(0, 3, (n,), generator=gen))


def checkpoints(tmp_path: Path) -> tuple[list[str], Callable[[nn.Module, str], float]]:
    """Three checkpoints of the model, and captum's load function (it returns the learning rate)."""
    net, paths = model(), []
    for c in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(c), dtype=p.dtype))
        paths.append(str(tmp_path / f"checkpoint-{c}.pt"))
        torch.save(net.state_dict(), paths[-1])

    def load(m: nn.Module, path: str) -> float:
        m.load_state_dict(torch.load(path))
        return RATES[paths.index(path)]

    return paths, load


def trained_wrapper() -> tuple[nn.Module, PerSampleModule]:
    """A model wrapped with a clipping transform after three training steps of changing batch sizes."""
    net = model()
    psm = PerSampleModule(net)
    psm.register_transform(net, transforms.clip_norm(0.5))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        ids, y = data(3 + step, seed=10 + step).tensors
        optimizer.zero_grad()
        F.cross_entropy(psm(ids), y).backward()
        optimizer.step()
    return net, psm


def by_hand(paths: list[str], load: Callable[[nn.Module, str], float], train: TensorDataset, test: TensorDataset):
    """TracIn from torch.func: ``sum_c lr_c <g_test, g_train>`` and ``sum_c lr_c ||g_train||^2``."""
    net, scores, selves = model(), 0.0, 0.0

    def flat(ds: TensorDataset) -> Tensor:
        ref = reference_grad_sample(net, *ds.tensors, lambda out, t: F.cross_entropy(out, t, reduction="sum"))
        return torch.cat([g.flatten(1) for g in ref.values()], dim=1)

    for path in paths:
        rate = load(net, path)
        g_train, g_test = flat(train), flat(test)
        scores = scores + rate * g_test @ g_train.T
        selves = selves + rate * g_train.square().sum(1)
    return scores, selves


def test_tracin_from_grad_sample_equals_captum_and_torch_func(tmp_path: Path) -> None:
    paths, load = checkpoints(tmp_path)
    train, test = data(11, seed=1), data(4, seed=2)
    want, want_self = by_hand(paths, load, train, test)
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    plain = model()
    captum = TracInCP(plain, train, checkpoints=paths, checkpoints_load_func=load, loss_fn=loss_fn, batch_size=4)
    assert_close(captum.influence(test.tensors), want, "captum's TracInCP")
    assert_close(captum.self_influence(), want_self, "captum's self influence")

    net, psm = trained_wrapper()
    before = {n: (p.grad.clone(), p.grad_sample.clone()) for n, p in net.named_parameters()}
    for batch_size in (4, 3):  # batches of 4, 4, 3 and of 3, 3, 3, 2
        loader = DataLoader(train, batch_size=batch_size)
        got = tracin_influence(psm, loader, test.tensors, paths, load, loss_fn)
        assert_close(got, want, f"tracin_influence, batches of {batch_size}")
        assert_close(tracin_self_influence(psm, loader, paths, load, loss_fn), want_self, "self influence")
    for n, p in net.named_parameters():  # the training state is as it was
        assert torch.equal(p.grad, before[n][0]) and torch.equal(p.grad_sample, before[n][1]), n


def test_sample_grads_is_captums_jacobian_for_chosen_parameters() -> None:
    net, psm = trained_wrapper()
    ids, y = data(5, seed=3).tensors
    chosen = [net.head.weight, net.proj.weight]
    got = sample_grads(psm, (ids, y), nn.CrossEntropyLoss(reduction="none"), chosen)
    ref = reference_grad_sample(net, ids, y, lambda out, t: F.cross_entropy(out, t, reduction="sum"))
    assert_close(got[0], ref["head.weight"], "head.weight")
    assert_close(got[1], ref["proj.weight"], "proj.weight")


def test_captums_default_mode_on_a_wrapped_model_is_refused_with_the_ways_out(tmp_path: Path) -> None:
    paths, load = checkpoints(tmp_path)
    train, test = data(6, seed=1), data(2, seed=2)
    net, psm = trained_wrapper()
    captum = TracInCP(net, train, paths, load, loss_fn=nn.CrossEntropyLoss(reduction="none"), batch_size=3)
    with pytest.raises(
        DetachedWeightError,
        match=r"weight of layer '(proj|head)' \(Linear\).*captum's TracInCP.*detach_transformed=False.*"
        r"psm\.remove\(\) \(or leave its `with` block\).*pergrad\.integrations\.captum\.tracin_influence",
    ):
        captum.influence(test.tensors)
    psm.remove()  # the first way out: exact
    want, _ = by_hand(paths, load, train, test)
    assert_close(captum.influence(test.tensors), want, "after remove()")


def test_captums_default_mode_with_detach_transformed_false(tmp_path: Path) -> None:
    paths, load = checkpoints(tmp_path)
    train, test = data(6, seed=1), data(2, seed=2)
    net = model()
    psm = PerSampleModule(net, detach_transformed=False)
    psm.register_transform(net, transforms.clip_norm(0.5))
    for step in range(3):
        ids, y = data(3 + step, seed=10 + step).tensors
        net.zero_grad()
        F.cross_entropy(psm(ids), y).backward()
    captum = TracInCP(net, train, paths, load, loss_fn=nn.CrossEntropyLoss(reduction="none"), batch_size=4)
    want, want_self = by_hand(paths, load, train, test)
    assert_close(captum.influence(test.tensors), want, "captum, wrapped with detach_transformed=False")
    assert_close(captum.self_influence(), want_self, "captum's self influence")


def test_tracincp_fast_works_on_a_wrapped_model(tmp_path: Path) -> None:
    """TracInCPFast differentiates with respect to the last layer's output, never a weight."""
    paths, load = checkpoints(tmp_path)
    train, test = data(6, seed=1), data(2, seed=2)

    def fast(net: nn.Module) -> Tensor:
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        return TracInCPFast(net, net.head, train, paths, load, loss_fn=loss_fn, batch_size=4).influence(test.tensors)

    want = fast(model())
    net, _ = trained_wrapper()
    before = [p.grad.clone() for p in net.parameters()]
    assert_close(fast(net), want, "TracInCPFast on the wrapped model")
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))


def test_a_loss_that_is_not_one_per_sample_is_refused() -> None:
    _, psm = trained_wrapper()
    with pytest.raises(CaptumError, match=r"loss of shape \(\) for a batch of 5 samples: it must return one loss per"):
        sample_grads(psm, data(5, seed=3).tensors, nn.CrossEntropyLoss())


def test_a_wrapper_without_grad_sample_is_refused() -> None:
    net = model()
    psm = PerSampleModule(net, keep_grad_sample=False)
    for step in range(2):
        net.zero_grad()
        F.cross_entropy(psm(data(3 + step, seed=step).tensors[0]), data(3 + step, seed=step).tensors[1]).backward()
    with pytest.raises(CaptumError, match=r"no grad_sample on any of the parameters.*keep_grad_sample=True"):
        sample_grads(psm, data(5, seed=3).tensors, nn.CrossEntropyLoss(reduction="none"))
