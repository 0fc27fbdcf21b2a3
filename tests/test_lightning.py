"""pergrad.integrations.lightning with a real ``lightning.pytorch.Trainer`` on CPU: every optimizer step's ``.grad``
(captured in ``on_before_optimizer_step``) against a per-sample reference (torch.func, float64) of the
micro-batches that step saw, and the parameters the optimizer made of it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from reference import clipped, reference_grad_sample
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from pergrad import PerSampleModule, TrainerConfigError, transforms
from pergrad.integrations.lightning import DPSGD, LightningOptionError, PerSample, per_sample_module, poisson_loader
from pergrad.privacy import epsilon_of

ROOT = Path(__file__).resolve().parents[1]
LR = 0.5
BOUND = 0.3


def cross_entropy_of_one(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target)


class Net(pl.LightningModule):
    """A small MLP in ``self.model``; records, per optimizer step, the parameters it started from, the
    micro-batches its backward passes saw and the ``.grad`` the optimizer is about to use."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
        self.micro: list[tuple[Tensor, Tensor]] = []
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.micro.append((x.clone(), y.clone()))
        return F.cross_entropy(self.model(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.records.append({"params": params, "micro": self.micro, "grad": grads})
        self.micro = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def data(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(3 * torch.randn(n, 5, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g))


def trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
        "max_epochs": 2,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def reference_step(model: nn.Module, record: dict[str, Any], k: int, bound: float) -> dict[str, Tensor]:
    """What the step's ``.grad`` must be: ``(1/k) sum_m mean_{i in m} clip(g_i)`` over its micro-batches
    ``m`` (Lightning divides each micro-batch's mean loss by k), ``g_i`` by torch.func at the step's
    starting parameters."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    total: dict[str, Tensor] = {}
    for x, y in record["micro"]:
        ref = clipped(reference_grad_sample(model, x, y, cross_entropy_of_one), bound)
        for n, g in ref.items():
            total[n] = total.get(n, 0) + g.mean(0) / k
    return total


def check_steps(net: Net, k: int = 1, bound: float = BOUND, steps: int | None = None) -> None:
    assert net.records, "no optimizer step was recorded"
    if steps is not None:
        assert len(net.records) == steps
    for t, record in enumerate(net.records):
        expected = reference_step(net.model, record, k, bound)
        for n, g in record["grad"].items():
            torch.testing.assert_close(g, expected[n], rtol=1e-10, atol=1e-12, msg=f"step {t}, {n}")
        if t + 1 < len(net.records):  # what SGD made of it
            after = net.records[t + 1]["params"]
            for n, p in record["params"].items():
                torch.testing.assert_close(after[n], p - LR * record["grad"][n], rtol=1e-12, atol=1e-14)


def assert_unwrapped(model: nn.Module) -> None:
    """No hook, no grad_sample left: a new wrapper can be built and removed."""
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())
    PerSampleModule(model).remove()


# -- automatic optimisation, accumulation ---------------------------------------------------------------


def test_every_step_is_the_mean_of_clipped_per_sample_gradients(tmp_path: Path) -> None:
    net = Net()
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    loader = DataLoader(data(14), batch_size=4)  # batches of 4, 4, 4, 2
    trainer(tmp_path, callbacks=[callback]).fit(net, loader)
    check_steps(net, steps=8)
    assert callback.psm is None
    assert_unwrapped(net.model)


@pytest.mark.parametrize(("k", "n", "steps"), [(2, 16, 4), (3, 14, 4)])
def test_accumulate_grad_batches(tmp_path: Path, k: int, n: int, steps: int) -> None:
    """k=2 over 4 batches of 4; k=3 over batches 4, 4, 4, 2 (the last step has one micro-batch, which
    Lightning still divides by 3)."""
    net = Net()
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    trainer(tmp_path, callbacks=[callback], accumulate_grad_batches=k).fit(net, DataLoader(data(n), batch_size=4))
    assert [len(r["micro"]) for r in net.records] == ([2, 2] if k == 2 else [3, 1]) * 2
    check_steps(net, k=k, steps=steps)


def test_a_gradient_accumulation_scheduler_changes_the_loss_scale_with_k(tmp_path: Path) -> None:
    """k = 1 in epoch 0, k = 2 from epoch 1 (Lightning's GradientAccumulationScheduler)."""
    net = Net()
    callbacks = [
        PerSample("model", transforms={"": transforms.clip_norm(BOUND)}),
        pl.callbacks.GradientAccumulationScheduler(scheduling={0: 1, 1: 2}),
    ]
    trainer(tmp_path, callbacks=callbacks, max_epochs=3).fit(net, DataLoader(data(16), batch_size=4))
    assert [len(r["micro"]) for r in net.records] == [1, 1, 1, 1, 2, 2, 2, 2]
    for t, record in enumerate(net.records):
        expected = reference_step(net.model, record, len(record["micro"]), BOUND)
        for n, g in record["grad"].items():
            torch.testing.assert_close(g, expected[n], rtol=1e-10, atol=1e-12, msg=f"step {t}, {n}")


def test_per_layer_transforms_and_the_module_reaches_the_wrapper(tmp_path: Path) -> None:
    """A transform per layer; the LightningModule reads per-sample norms through ``per_sample_module``."""

    class WithNorms(Net):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.psm = per_sample_module(self)
            return loss

    net = WithNorms()
    callback = PerSample("model", transforms={"0": transforms.clip_norm(BOUND), "2": transforms.clip_norm(BOUND)})
    trainer(tmp_path, callbacks=[callback], max_epochs=1).fit(net, DataLoader(data(10), batch_size=4))
    assert net.psm is not None and callback.psm is None
    for t, record in enumerate(net.records):
        model = copy.deepcopy(net.model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(record["params"][n])
        (x, y) = record["micro"][0]
        ref = reference_grad_sample(model, x, y, cross_entropy_of_one)
        for layer in ("0", "2"):
            part = clipped({n: g for n, g in ref.items() if n.startswith(layer + ".")}, BOUND)
            for n, g in part.items():
                torch.testing.assert_close(record["grad"][n], g.mean(0), rtol=1e-10, atol=1e-12, msg=f"step {t} {n}")


# -- refusals ---------------------------------------------------------------------------------------------


def test_gradient_clip_val_is_refused_and_leaves_the_model_unwrapped(tmp_path: Path) -> None:
    net = Net()
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    with pytest.raises(LightningOptionError, match=r"gradient_clip_val=1\.0\).*remove gradient_clip_val"):
        trainer(tmp_path, callbacks=[callback], gradient_clip_val=1.0).fit(net, DataLoader(data(8), batch_size=4))
    assert_unwrapped(net.model)


def test_an_unknown_module_name_lists_the_children(tmp_path: Path) -> None:
    with pytest.raises(LightningOptionError, match=r"Net has no submodule 'net'.*children are \['model'\]"):
        trainer(tmp_path, callbacks=[PerSample("net")]).fit(Net(), DataLoader(data(8), batch_size=4))


class HandWrapped(Net):
    """The network wrapped by hand in the LightningModule (no ``PerSample`` callback), clipped over all of it;
    ``training_step`` calls ``self.model`` as ``Net``'s does (its hooks are the wrapper's)."""

    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.psm = PerSampleModule(
            self.model, loss_scale=(lambda: 1 / self.trainer.accumulate_grad_batches) if scaled else None
        )
        self.psm.register_transform("", transforms.clip_norm(BOUND))


def test_a_hand_wrapped_network_under_accumulate_grad_batches_without_its_loss_scale_is_refused(
    tmp_path: Path,
) -> None:
    """Lightning divides each micro-batch's loss by k: without ``loss_scale=1/k`` pergrad would clip at kC.
    Refused at the first forward (nothing written); the fix the message names trains exactly, and k = 1
    needs none."""
    net = HandWrapped(scaled=False)
    with pytest.raises(
        TrainerConfigError,
        match=r"wrapped Sequential is called from the training_step of HandWrapped, whose "
        r"Trainer\(accumulate_grad_batches=2\) divides each micro-batch's loss by 2.*no loss_scale.*clip it at 2C.*"
        r"loss_scale=lambda: 1 / self.trainer.accumulate_grad_batches.*pergrad.integrations.lightning.PerSample",
    ):
        trainer(tmp_path, accumulate_grad_batches=2).fit(net, DataLoader(data(16), batch_size=4))
    assert not net.records and all(p.grad is None for p in net.model.parameters())
    net.psm.remove()
    net = HandWrapped(scaled=True)
    trainer(tmp_path, accumulate_grad_batches=2).fit(net, DataLoader(data(16), batch_size=4))
    check_steps(net, k=2, steps=4)
    net.psm.remove()
    net = HandWrapped(scaled=False)
    trainer(tmp_path).fit(net, DataLoader(data(8), batch_size=4))
    check_steps(net, k=1, steps=4)
    net.psm.remove()


def test_loss_scale_is_the_callbacks() -> None:
    with pytest.raises(TypeError, match="PerSample sets loss_scale itself"):
        PerSample("model", loss_scale=0.5)


# -- the core does not import it --------------------------------------------------------------------------


def test_import_pergrad_does_not_import_lightning() -> None:
    code = "import sys, pergrad; assert 'lightning' not in sys.modules and 'pergrad.integrations.lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- mixed precision ----------------------------------------------------------------------------------------


def autocast_reference_step(model: nn.Module, record: dict[str, Any], bound: float) -> dict[str, Tensor]:
    """``mean_i clip(g_i)`` with each ``g_i`` from a backward of sample i alone under the same
    ``torch.autocast("cpu", torch.bfloat16)`` Lightning's ``bf16-mixed`` runs the training step in."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    names = [n for n, _ in model.named_parameters()]
    (x, y) = record["micro"][0]
    per_sample: dict[str, list[Tensor]] = {n: [] for n in names}
    for i in range(len(x)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters()))):
            per_sample[n].append(g.float())
    return {n: g.mean(0) for n, g in clipped({n: torch.stack(v) for n, v in per_sample.items()}, bound).items()}


def test_bf16_mixed_matches_the_same_autocast_per_sample(tmp_path: Path) -> None:
    """bf16-mixed: float32 parameters, the step under CPU autocast. pergrad builds g_i from the layers'
    bf16 inputs and output gradients; a one-sample backward under the same autocast computes the weight
    gradient in a bf16 matmul of its own, so the two agree to bf16's resolution: within 2% (relative
    norm) per parameter, every step."""
    net = Net(dtype=torch.float32)
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)})
    loader = DataLoader(data(14, dtype=torch.float32), batch_size=4)
    trainer(tmp_path, callbacks=[callback], precision="bf16-mixed").fit(net, loader)
    assert len(net.records) == 8
    for t, record in enumerate(net.records):
        expected = autocast_reference_step(net.model, record, BOUND)
        for n, g in record["grad"].items():
            assert g.dtype == torch.float32
            error = (g - expected[n]).norm() / expected[n].norm()
            assert error < 0.02, f"step {t}, {n}: relative error {error:.4f}"


# -- DP-SGD -------------------------------------------------------------------------------------------------

DELTA = 1e-5


class PoissonNet(Net):
    """``Net`` whose train loader draws Poisson batches of ``data(n)`` (rate ``q``) through ``poisson_loader``."""

    def __init__(self, n: int, q: float, seed: int = 5) -> None:
        super().__init__()
        self.n, self.q, self.seed = n, q, seed

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return poisson_loader(data(self.n), self.q, trainer=self.trainer, generator=generator)


def dp_reference_step(model: nn.Module, record: dict[str, Any], expected_batch: float) -> dict[str, Tensor]:
    """``sum_i clip(g_i) / E[B]`` over every sample of the step's micro-batches (sigma = 0)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x, y in record["micro"]:
        if len(x):
            for n, g in clipped(reference_grad_sample(model, x, y, cross_entropy_of_one), BOUND).items():
                total[n] += g.sum(0) / expected_batch
    return total


@pytest.mark.parametrize("k", [1, 2])
def test_dpsgd_without_noise_is_the_clipped_sum_over_the_expected_batch_size(tmp_path: Path, k: int) -> None:
    """sigma = 0: every step's .grad is sum_i clip(g_i) / (q N) over the step's Poisson draw (k micro-batches
    of it), whatever its size; the draws include an empty micro-batch and sizes from 0 to 6."""
    net = PoissonNet(n=12, q=0.25)
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=0.0, delta=DELTA, log_epsilon="step")
    trainer(tmp_path, callbacks=[callback], max_epochs=3, accumulate_grad_batches=k).fit(net)
    assert len(net.records) == 12 and all(len(r["micro"]) == k for r in net.records)
    sizes = [len(x) for r in net.records for x, _ in r["micro"]]
    assert 0 in sizes and len(set(sizes)) > 2, sizes
    for t, record in enumerate(net.records):
        expected = dp_reference_step(net.model, record, 0.25 * 12)
        for n, g in record["grad"].items():
            torch.testing.assert_close(g, expected[n], rtol=1e-10, atol=1e-12, msg=f"step {t}, {n}")
        if t + 1 < len(net.records):
            for n, p in record["params"].items():
                after = net.records[t + 1]["params"][n]
                torch.testing.assert_close(after, p - LR * record["grad"][n], rtol=1e-12, atol=1e-14)
    assert callback.dp is not None and callback.dp.steps == 12
    assert_unwrapped(net.model)


def test_dpsgd_logs_epsilon_and_resumes_from_a_checkpoint_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """sigma = 1: the epsilon logged is dp.epsilon(delta) = epsilon_of(sigma, q, steps, delta); a run resumed
    from the checkpoint of epoch 1 (fresh objects, other seeds: the checkpoint restores the sampler's and the
    noise generator's state) takes exactly the uninterrupted run's steps 5 to 12."""
    steps_per_epoch = 4

    def run(root: Path, seed: int, max_epochs: int, ckpt: Path | None = None) -> tuple[PoissonNet, DPSGD]:
        net = PoissonNet(n=12, q=0.25, seed=seed)
        callback = DPSGD(
            "model",
            max_grad_norm=BOUND,
            noise_multiplier=1.0,
            delta=DELTA,
            generator=torch.Generator().manual_seed(seed + 1000),  # not the sampler's seed: refused
        )
        saver = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        fit = trainer(root, callbacks=[callback, saver], max_epochs=max_epochs, enable_checkpointing=True)
        fit.fit(net, ckpt_path=ckpt)
        assert callback.dp is not None
        logged = float(fit.callback_metrics["epsilon"])
        assert logged == pytest.approx(callback.dp.epsilon(DELTA), rel=1e-6)
        assert logged == pytest.approx(epsilon_of(1.0, 0.25, callback.dp.steps, DELTA), rel=1e-6)
        return net, callback

    whole, whole_dp = run(tmp_path / "whole", seed=3, max_epochs=3)
    assert whole_dp.dp is not None and whole_dp.dp.steps == 3 * steps_per_epoch
    resumed, resumed_dp = run(tmp_path / "resumed", seed=99, max_epochs=3, ckpt=tmp_path / "whole" / "epoch=0.ckpt")
    assert resumed_dp.dp is not None and resumed_dp.dp.steps == 3 * steps_per_epoch
    assert len(resumed.records) == 2 * steps_per_epoch
    for t, (a, b) in enumerate(zip(whole.records[steps_per_epoch:], resumed.records)):
        assert [len(x) for x, _ in a["micro"]] == [len(x) for x, _ in b["micro"]]
        for n in a["grad"]:
            assert torch.equal(a["params"][n], b["params"][n]), f"step {t + steps_per_epoch}, {n}"
            assert torch.equal(a["grad"][n], b["grad"][n]), f"step {t + steps_per_epoch}, {n}"


def test_dpsgd_refuses_a_loader_that_is_not_poisson(tmp_path: Path) -> None:
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=1.0, delta=DELTA)
    with pytest.raises(LightningOptionError, match=r"assumes Poisson sampling.*BatchSampler.*poisson_loader"):
        trainer(tmp_path, callbacks=[callback]).fit(Net(), DataLoader(data(8), batch_size=4))


class TemperatureNet(PoissonNet):
    """A learned temperature beside ``self.model``, stepped by the same optimizer (outside the clipping)."""

    def __init__(self) -> None:
        super().__init__(n=12, q=0.25)
        self.temperature = nn.Parameter(torch.ones((), dtype=torch.float64))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x) / self.temperature, y)


def test_dpsgd_refuses_a_trained_parameter_outside_the_network(tmp_path: Path) -> None:
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=1.0, delta=DELTA)
    net = TemperatureNet()
    with pytest.raises(
        LightningOptionError, match=r"optimizer steps \['temperature'\].*outside the network DPSGD clips"
    ):
        trainer(tmp_path, callbacks=[callback]).fit(net)
    assert_unwrapped(net.model)


def test_dpsgd_refuses_an_epoch_cut_inside_an_accumulation_window(tmp_path: Path) -> None:
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=1.0, delta=DELTA)
    net = PoissonNet(n=12, q=0.25)
    cut = r"an epoch has 3 micro-batches \(limit_train_batches\?\), not a multiple of accumulate_grad_batches=2"
    with pytest.raises(LightningOptionError, match=cut):
        trainer(tmp_path, callbacks=[callback], accumulate_grad_batches=2, limit_train_batches=3).fit(net)
    assert_unwrapped(net.model)
    # a multiple of it is fine: every step one whole draw
    net = PoissonNet(n=12, q=0.25)
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=0.0, delta=DELTA)
    trainer(tmp_path, callbacks=[callback], accumulate_grad_batches=2, limit_train_batches=4).fit(net)
    assert callback.dp is not None and callback.dp.steps == 4
    for t, record in enumerate(net.records):
        expected = dp_reference_step(net.model, record, 0.25 * 12)
        for n, g in record["grad"].items():
            torch.testing.assert_close(g, expected[n], rtol=1e-10, atol=1e-12, msg=f"step {t}, {n}")


class ConvertedByPrecision(Net):
    """A LightningModule that wraps its own network (no pergrad callback) and clips it."""

    def __init__(self) -> None:
        super().__init__(dtype=torch.float32)
        self.psm = PerSampleModule(self.model)
        self.psm.register_transform(self.model, transforms.clip_norm(BOUND))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        x = x.to(next(self.model.parameters()).dtype)
        self.micro.append((x.clone(), y.clone()))
        return F.cross_entropy(self.psm(x), y)


def test_a_hand_wrapped_network_converted_by_the_trainers_precision_stays_exact(tmp_path: Path) -> None:
    """Trainer(precision="64-true") converts the LightningModule to float64 after it wrapped its network:
    every parameter gets new data and a new AccumulateGrad node; pergrad wraps again at the first forward."""
    net = ConvertedByPrecision()
    trainer(tmp_path, precision="64-true").fit(net, DataLoader(data(12, dtype=torch.float32), batch_size=4))
    assert all(p.dtype == torch.float64 for p in net.model.parameters())
    check_steps(net, steps=6)
    net.psm.remove()


def test_dpsgd_refuses_gradient_clip_val(tmp_path: Path) -> None:
    callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=1.0, delta=DELTA)
    net = PoissonNet(n=12, q=0.25)
    with pytest.raises(LightningOptionError, match=r"gradient_clip_val=0\.5\).*remove gradient_clip_val"):
        trainer(tmp_path, callbacks=[callback], gradient_clip_val=0.5).fit(net)
    assert_unwrapped(net.model)


# -- strategy="ddp" -----------------------------------------------------------------------------------------

DDP_SCRIPT = """
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, {tests!r})
from test_lightning import BOUND, DELTA, Net, PoissonNet, assert_unwrapped, data, trainer

from pergrad import transforms
from pergrad.integrations.lightning import DPSGD, PerSample

out = Path(sys.argv[1])
net = Net()
callback = PerSample("model", transforms={{"": transforms.clip_norm(BOUND)}})
fit = trainer(out, callbacks=[callback], strategy="ddp", devices=2, accumulate_grad_batches=2)
fit.fit(net, DataLoader(data(32), batch_size=4, shuffle=True))
assert_unwrapped(net.model)
torch.save(net.records, out / f"clip{{fit.global_rank}}.pt")

net = PoissonNet(n=16, q=0.25)
callback = DPSGD("model", max_grad_norm=BOUND, noise_multiplier=0.0, delta=DELTA)
fit = trainer(out, callbacks=[callback], strategy="ddp", devices=2, accumulate_grad_batches=2, use_distributed_sampler=False)
fit.fit(net)
assert_unwrapped(net.model)
torch.save(net.records, out / f"dp{{fit.global_rank}}.pt")
"""


def test_ddp_two_processes_every_rank_gets_the_global_reduction(tmp_path: Path) -> None:
    """strategy="ddp", 2 CPU processes (gloo), accumulate_grad_batches=2, two fits in one launch.

    PerSample with clip_norm: each rank sees 16 samples per epoch in batches of 4 (a DistributedSampler's
    shuffled share); each rank's ``.grad`` is the mean over both ranks of ``(1/2) sum_m mean_{i in m}
    clip(g_i)``. DPSGD, sigma = 0, Poisson batches of 16 samples at q = 1/4 shared out over the ranks
    (some micro-batches empty): each rank's ``.grad`` is ``sum_i clip(g_i) / (q N)`` over BOTH ranks'
    samples of the step."""
    script = tmp_path / "fit_ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    model = Net().model

    ranks = [torch.load(tmp_path / f"clip{r}.pt") for r in range(2)]
    assert [len(r) for r in ranks] == [4, 4]
    for t, (zero, one) in enumerate(zip(*ranks)):
        assert len(zero["micro"]) == len(one["micro"]) == 2
        assert not torch.equal(zero["micro"][0][0], one["micro"][0][0])  # each rank its own samples
        both = [reference_step(model, record, 2, BOUND) for record in (zero, one)]
        for n in zero["grad"]:
            assert torch.equal(zero["params"][n], one["params"][n])
            expected = (both[0][n] + both[1][n]) / 2
            for r, record in enumerate((zero, one)):
                torch.testing.assert_close(record["grad"][n], expected, rtol=1e-10, atol=1e-12, msg=f"rank {r} {t} {n}")

    ranks = [torch.load(tmp_path / f"dp{r}.pt") for r in range(2)]
    assert [len(r) for r in ranks] == [8, 8]
    sizes = [len(x) for rank in ranks for record in rank for x, _ in record["micro"]]
    assert 0 in sizes and max(sizes) > 1, sizes
    for t, (zero, one) in enumerate(zip(*ranks)):
        both = [dp_reference_step(model, record, 0.25 * 16) for record in (zero, one)]
        for n in zero["grad"]:
            assert torch.equal(zero["params"][n], one["params"][n])
            for r, record in enumerate((zero, one)):
                expected = both[0][n] + both[1][n]
                torch.testing.assert_close(record["grad"][n], expected, rtol=1e-10, atol=1e-12, msg=f"rank {r} {t} {n}")
