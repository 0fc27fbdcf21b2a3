"""Adversarial tests of pergrad's Lightning callbacks under ``torch.compile``, as users write it: the whole
LightningModule compiled (``trainer.fit(torch.compile(module))``: Lightning compiles its ``training_step``), the
network compiled in ``__init__`` / ``configure_model`` (before the callback wraps it) or after the callback wrapped
it, ``DPSGD``, accumulation, validation between epochs, a checkpoint resumed, ``bf16-mixed``, manual optimisation.
Batches change shape every step (positions on both sides of 16, T == B, other batch sizes); every optimizer step's
``.grad`` is checked in float64 against a one-sample-at-a-time autograd loop on a copy of the network made before
anything was compiled (DP noise: against the same run eagerly, same seeds)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from pergrad import PerSampleModule, transforms
from pergrad.errors import TargetError
from pergrad.integrations.lightning import DPSGD, PerSample, per_sample_module
from tests.reference import assert_close, clipped
from tests.test_attack_ddp_compile import one_at_a_time
from tests.test_lightning import assert_unwrapped, trainer

BOUND = 0.3
LR = 0.5
SHAPES = [(4, 15), (4, 16), (4, 17), (4, 4), (3, 16), (5, 15)]  # both sides of 16, T == B, other batch sizes
AOT = {"backend": "aot_eager"}


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def seq_batches(steps: int = len(SHAPES), seed: int = 0, dtype: torch.dtype = torch.float64) -> list[Any]:
    """``steps`` batches ``(x [B, T, 5], y [B])`` of the shapes ``SHAPES`` in turn."""
    out = []
    for k in range(steps):
        b, t = SHAPES[k % len(SHAPES)]
        g = torch.Generator().manual_seed(1000 * seed + k)
        out.append((torch.randn(b, t, 5, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g)))
    return out


def loader(batches: list[Any]) -> DataLoader:
    """Each batch as it is (``batch_size=None``)."""
    return DataLoader(batches, batch_size=None)


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.mean(1), y)


def plain(model: nn.Module) -> nn.Module:
    """The network under a ``torch.compile`` (``OptimizedModule``) wrapper, or itself."""
    return getattr(model, "_orig_mod", model)


class SeqNet(pl.LightningModule):
    """An MLP over ``[B, T, 5]`` in ``self.model`` (compiled in ``__init__`` with ``compile_inner``); records, per
    optimizer step, the parameters it started from, its micro-batches and the ``.grad`` the optimizer is given,
    by the names of the uncompiled network."""

    def __init__(self, dtype: torch.dtype = torch.float64, compile_inner: dict[str, Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model: nn.Module = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
        self.reference = [copy.deepcopy(self.model)]  # (a list: not a submodule) made before compiling
        if compile_inner is not None:
            self.model = torch.compile(self.model, **compile_inner)
        self.micro: list[tuple[Tensor, Tensor]] = []
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.micro.append((x.clone(), y.clone()))
        return ce(self.model(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        net = plain(self.model)
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        self.records.append({"params": params, "micro": self.micro, "grad": grads})
        self.micro = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def at_step(reference: nn.Module, record: dict[str, Any]) -> nn.Module:
    """``reference`` holding the parameters the recorded step started from."""
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(record["params"][n])
    return reference


def per_sample_at(reference: nn.Module, record: dict[str, Any]) -> dict[str, Tensor]:
    """Each sample's own gradient of the recorded step's first micro-batch, at the step's parameters."""
    x, y = record["micro"][0]
    return one_at_a_time(at_step(reference, record), x, y)


def expected_grad(
    reference: nn.Module, record: dict[str, Any], k: int, *, dp_batch: float | None = None
) -> dict[str, Tensor]:
    """The step's ``.grad``: ``(1/k) sum_m mean_{i in m} clip(g_i)`` (Lightning divides each micro-batch's loss by
    k), or with ``dp_batch`` ``sum_i clip(g_i) / dp_batch`` (DPSGD, sigma = 0), at the step's parameters."""
    at_step(reference, record)
    total = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for x, y in record["micro"]:
        if not len(x):
            continue
        for n, g in clipped(one_at_a_time(reference, x, y), BOUND).items():
            total[n] += g.sum(0) / dp_batch if dp_batch is not None else g.mean(0) / k
    return total


def check_steps(net: SeqNet, steps: int, k: int = 1, **options: Any) -> None:
    """Every recorded step's ``.grad`` against the reference, and SGD's update from it."""
    assert len(net.records) == steps, [len(r["micro"]) for r in net.records]
    reference = net.reference[0]
    for t, record in enumerate(net.records):
        expected = expected_grad(reference, record, k, **options)
        for n, g in record["grad"].items():
            assert_close(g, expected[n], f"step {t}: .grad of {n}")
        if t + 1 < len(net.records):
            for n, p in record["params"].items():
                assert_close(net.records[t + 1]["params"][n], p - LR * record["grad"][n], f"step {t}: {n} updated")


def clip() -> PerSample:
    return PerSample("model", transforms={"": transforms.clip_norm(BOUND)})


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


# -- the whole LightningModule compiled ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [AOT, {"backend": "aot_eager", "dynamic": True}, {"backend": "inductor"}],
    ids=["aot", "dynamic", "inductor"],
)
def test_fit_of_the_compiled_lightning_module(tmp_path: Path, options: dict[str, Any]) -> None:
    """``trainer.fit(torch.compile(module))``: Lightning compiles ``training_step`` and ``forward``."""
    net = SeqNet()
    callback = clip()
    from torch._dynamo.utils import counters

    counters.clear()
    trainer(tmp_path, callbacks=[callback], max_epochs=2).fit(torch.compile(net, **options), loader(seq_batches()))
    assert compiled_frames() > 0
    check_steps(net, steps=2 * len(SHAPES))
    assert callback.psm is None
    assert_unwrapped(net.model)


@pytest.mark.parametrize("k", [2, 3])
def test_the_compiled_module_with_accumulate_grad_batches(tmp_path: Path, k: int) -> None:
    """k = 2 over 6 batches (3 steps of 2); k = 3 over 8 (steps of 3, 3 and a last one of 2, still divided by 3)."""
    net = SeqNet()
    n = 6 if k == 2 else 8
    trainer(tmp_path, callbacks=[clip()], max_epochs=1, accumulate_grad_batches=k).fit(
        torch.compile(net, **AOT), loader(seq_batches(n))
    )
    assert [len(r["micro"]) for r in net.records] == ([2, 2, 2] if k == 2 else [3, 3, 2])
    check_steps(net, steps=len(net.records), k=k)


def test_a_gradient_accumulation_scheduler_with_the_compiled_module(tmp_path: Path) -> None:
    """k = 1 in epoch 0, 2 from epoch 1: the loss scale follows it under the compiled training step."""
    net = SeqNet()
    callbacks = [clip(), pl.callbacks.GradientAccumulationScheduler(scheduling={0: 1, 1: 2})]
    trainer(tmp_path, callbacks=callbacks, max_epochs=2).fit(torch.compile(net, **AOT), loader(seq_batches(4)))
    assert [len(r["micro"]) for r in net.records] == [1, 1, 1, 1, 2, 2]
    reference = net.reference[0]
    for t, record in enumerate(net.records):
        expected = expected_grad(reference, record, len(record["micro"]))
        for n, g in record["grad"].items():
            assert_close(g, expected[n], f"step {t}: .grad of {n}")


class Validated(SeqNet):
    """``SeqNet`` with a validation loop that calls the network (under Lightning's inference mode)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.validated: list[Tensor] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = ce(self.model(x), y)
        self.validated.append(loss.detach().clone())
        return loss


def test_validation_between_epochs_of_the_compiled_module(tmp_path: Path) -> None:
    """A validation loop after each epoch (and the sanity check before): training stays exact, and the
    validation losses are the reference network's at the parameters of that moment."""
    net = Validated()
    val = seq_batches(3, seed=7)
    trainer(tmp_path, callbacks=[clip()], max_epochs=3, num_sanity_val_steps=1).fit(
        torch.compile(net, **AOT), loader(seq_batches(4)), loader(val)
    )
    check_steps(net, steps=12)
    assert len(net.validated) == 1 + 3 * 3
    reference = net.reference[0]  # the sanity check at the start; epochs 0 and 1 at the next epoch's start
    points = [(0, net.records[0]["params"], val[:1])] + [
        (1 + 3 * e, net.records[4 * e + 4]["params"], val) for e in range(2)
    ]
    with torch.no_grad():
        for start, params, batches in points:
            for n, p in reference.named_parameters():
                p.copy_(params[n])
            for j, (x, y) in enumerate(batches):
                assert_close(net.validated[start + j], ce(reference(x), y), f"validation {start + j}")


# -- the network compiled inside the LightningModule ------------------------------------------------------


@pytest.mark.parametrize("options", [AOT, {"backend": "inductor"}], ids=["aot", "inductor"])
def test_the_network_compiled_in_init_is_wrapped_by_the_callback(tmp_path: Path, options: dict[str, Any]) -> None:
    """``self.model = torch.compile(self.model)`` in ``__init__``: the callback wraps the ``OptimizedModule``."""
    net = SeqNet(compile_inner=options)
    from torch._dynamo.utils import counters

    counters.clear()
    trainer(tmp_path, callbacks=[clip()], max_epochs=2).fit(net, loader(seq_batches()))
    assert compiled_frames() > 0
    check_steps(net, steps=2 * len(SHAPES))
    assert_unwrapped(plain(net.model))


class ConfiguredNet(SeqNet):
    """The network compiled in ``configure_model`` (Lightning calls it before the callbacks' ``on_fit_start``)."""

    def configure_model(self) -> None:
        if not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, **AOT)


def test_the_network_compiled_in_configure_model(tmp_path: Path) -> None:
    net = ConfiguredNet()
    trainer(tmp_path, callbacks=[clip()], max_epochs=2, accumulate_grad_batches=2).fit(net, loader(seq_batches()))
    assert isinstance(net.model, torch._dynamo.eval_frame.OptimizedModule)
    check_steps(net, steps=len(SHAPES), k=2)


class CompiledAfterWrapping(SeqNet):
    """The network compiled in the LightningModule's ``on_fit_start``: after the callback wrapped it (the
    callback's ``on_fit_start`` runs first); ``training_step`` calls the compiled one."""

    def on_fit_start(self) -> None:
        assert per_sample_module(self).module is self.model
        self.model = torch.compile(self.model, **AOT)


def test_the_network_compiled_after_the_callback_wrapped_it(tmp_path: Path) -> None:
    net = CompiledAfterWrapping()
    callback = clip()
    trainer(tmp_path, callbacks=[callback], max_epochs=2).fit(net, loader(seq_batches()))
    check_steps(net, steps=2 * len(SHAPES))
    assert callback.psm is None
    assert_unwrapped(plain(net.model))


def test_per_layer_transforms_on_a_network_compiled_in_init(tmp_path: Path) -> None:
    """A transform per layer on an ``OptimizedModule``: named as in the uncompiled network (``"0"``) it is refused
    naming the compile and the name that works (``"_orig_mod.0"``), before anything is wrapped; that name trains
    exactly, each layer clipped on its own."""
    net = SeqNet(compile_inner=AOT)
    callback = PerSample("model", transforms={"0": transforms.clip_norm(BOUND)})
    with pytest.raises(
        TargetError,
        match=r"no module or parameter named '0' in the wrapped model: the wrapped model is compiled "
        r"\(torch.compile's OptimizedModule.*pass '_orig_mod.0', or wrap the network before compiling it",
    ):
        trainer(tmp_path, callbacks=[callback], max_epochs=1).fit(net, loader(seq_batches()))
    assert not net.records and all(p.grad is None for p in net.model.parameters())
    assert_unwrapped(plain(net.model))
    layers = {"_orig_mod.0": transforms.clip_norm(BOUND), "_orig_mod.2": transforms.clip_norm(BOUND)}
    trainer(tmp_path, callbacks=[PerSample("model", transforms=layers)], max_epochs=1).fit(net, loader(seq_batches()))
    reference = net.reference[0]
    assert len(net.records) == len(SHAPES)
    for t, record in enumerate(net.records):
        per_sample = per_sample_at(reference, record)
        for layer in ("0", "2"):
            part = clipped({n: g for n, g in per_sample.items() if n.startswith(layer + ".")}, BOUND)
            for n, g in part.items():
                assert_close(record["grad"][n], g.mean(0), f"step {t}: .grad of {n}")


# -- what the training step reads, manual optimisation, a wrapper of the user's ---------------------------


class Manual(SeqNet):
    """Manual optimisation: zero, ``manual_backward``, per-sample norms read from the wrapper, step; all in the
    training step Lightning compiles (``optimizer.step()`` calls ``on_before_optimizer_step``, which records)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.automatic_optimization = False
        self.norms: list[dict[str, Tensor]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.micro.append((x.clone(), y.clone()))
        loss = ce(self.model(x), y)
        self.manual_backward(loss)
        self.norms.append({n: v.clone() for n, v in per_sample_module(self).per_sample_norms().items()})
        optimizer.step()
        return loss.detach()


def test_manual_optimisation_in_the_compiled_training_step(tmp_path: Path) -> None:
    net = Manual()
    trainer(
        tmp_path,
        callbacks=[PerSample("model", transforms={"": transforms.clip_norm(BOUND)}, track_statistics=True)],
        max_epochs=2,
    ).fit(torch.compile(net, **AOT), loader(seq_batches()))
    check_steps(net, steps=2 * len(SHAPES))
    reference = net.reference[0]
    for t, (record, norms) in enumerate(zip(net.records, net.norms, strict=True)):
        for n, g in per_sample_at(reference, record).items():
            assert_close(norms[n], g.flatten(1).norm(dim=1), f"step {t}: norm of {n}")


class KeepsGradSample(SeqNet):
    """Reads ``p.grad_sample`` before each optimizer step."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.grad_samples: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grad_samples.append({n: p.grad_sample.clone() for n, p in plain(self.model).named_parameters()})
        super().on_before_optimizer_step(optimizer)


@pytest.mark.parametrize("where", ["module", "network"])
def test_keep_grad_sample_under_compile(tmp_path: Path, where: str) -> None:
    """``keep_grad_sample=True``: each step's ``p.grad_sample`` is the reference's per-sample gradients (raw)."""
    net = KeepsGradSample(compile_inner=AOT if where == "network" else None)
    callback = PerSample("model", transforms={"": transforms.clip_norm(BOUND)}, keep_grad_sample=True)
    fitted = torch.compile(net, **AOT) if where == "module" else net
    trainer(tmp_path, callbacks=[callback], max_epochs=1).fit(fitted, loader(seq_batches()))
    check_steps(net, steps=len(SHAPES))
    reference = net.reference[0]
    for t, (record, kept) in enumerate(zip(net.records, net.grad_samples, strict=True)):
        for n, g in per_sample_at(reference, record).items():
            assert_close(kept[n], g, f"step {t}: grad_sample of {n}")


class HandWrapped(SeqNet):
    """The network wrapped by the LightningModule itself in ``__init__`` (no callback); the module is then
    compiled whole."""

    def __init__(self) -> None:
        super().__init__()
        self.psm = PerSampleModule(self.model, loss_scale=lambda: 1 / self.trainer.accumulate_grad_batches)
        self.psm.register_transform("", transforms.clip_norm(BOUND))


def test_a_hand_wrapped_network_in_the_compiled_module(tmp_path: Path) -> None:
    net = HandWrapped()
    trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2).fit(torch.compile(net, **AOT), loader(seq_batches()))
    check_steps(net, steps=len(SHAPES), k=2)
    net.psm.remove()


# -- DP-SGD --------------------------------------------------------------------------------------------------

DELTA = 1e-5
N, Q, T = 12, 0.25, 16


class PoissonSeqNet(SeqNet):
    """``SeqNet`` whose train loader draws Poisson batches (rate ``Q``) of ``N`` sequences of ``T`` positions;
    batch sizes change from step to step, some micro-batches are empty."""

    def __init__(self, seed: int = 5, **options: Any) -> None:
        super().__init__(**options)
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        from pergrad.integrations.lightning import poisson_loader

        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(N, T, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)
        )
        return poisson_loader(data, Q, trainer=self.trainer, generator=torch.Generator().manual_seed(self.seed))


def dpsgd(sigma: float, seed: int = 5) -> DPSGD:
    return DPSGD(
        "model",
        max_grad_norm=BOUND,
        noise_multiplier=sigma,
        delta=DELTA,
        log_epsilon="step",
        generator=torch.Generator().manual_seed(seed + 1000),
    )


@pytest.mark.parametrize("how", ["module", "network"])
@pytest.mark.parametrize("k", [1, 2])
def test_dpsgd_without_noise_under_compile(tmp_path: Path, how: str, k: int) -> None:
    """sigma = 0: every step's ``.grad`` is ``sum_i clip(g_i) / (q N)`` over the step's Poisson draw; the draws
    include an empty micro-batch and several sizes."""
    net = PoissonSeqNet(compile_inner=AOT if how == "network" else None)
    callback = dpsgd(0.0)
    fitted = torch.compile(net, **AOT) if how == "module" else net
    trainer(tmp_path, callbacks=[callback], max_epochs=3, accumulate_grad_batches=k).fit(fitted)
    sizes = [len(x) for r in net.records for x, _ in r["micro"]]
    assert 0 in sizes and len(set(sizes)) > 2, sizes
    check_steps(net, steps=12, dp_batch=Q * N)
    assert callback.dp is not None and callback.dp.steps == 12
    assert_unwrapped(plain(net.model))


def test_dpsgd_with_noise_compiled_is_the_eager_run(tmp_path: Path) -> None:
    """sigma = 1, the same seeds: the compiled module's run takes the eager run's steps (.grad, noise included)."""
    runs = []
    for compiled in (False, True):
        net = PoissonSeqNet()
        callback = dpsgd(1.0)
        trainer(tmp_path, callbacks=[callback], max_epochs=2).fit(torch.compile(net, **AOT) if compiled else net)
        assert callback.dp is not None and callback.dp.steps == 8
        runs.append(net.records)
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        assert [len(x) for x, _ in a["micro"]] == [len(x) for x, _ in b["micro"]]
        for n in a["grad"]:
            assert_close(b["params"][n], a["params"][n], f"step {t}: {n}")
            assert_close(b["grad"][n], a["grad"][n], f"step {t}: .grad of {n}")
        assert any((a["grad"][n] != 0).any() for n in a["grad"])


def test_a_compiled_run_resumed_from_a_checkpoint_is_the_uninterrupted_run(tmp_path: Path) -> None:
    """DPSGD (sigma = 1, generators of the user's) on the compiled module: a fresh compiled module resumed from
    the checkpoint of epoch 0 (``ckpt_path``) takes the uninterrupted run's steps 5 to 12; and with sigma = 0 the
    resumed run's steps are the reference's."""

    def run(root: Path, sigma: float, max_epochs: int, ckpt: Path | None = None) -> PoissonSeqNet:
        torch._dynamo.reset()
        net = PoissonSeqNet()
        saver = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        fit = trainer(root, callbacks=[dpsgd(sigma), saver], max_epochs=max_epochs, enable_checkpointing=True)
        fit.fit(torch.compile(net, **AOT), ckpt_path=ckpt)
        return net

    whole = run(tmp_path / "whole", 1.0, 3)
    resumed = run(tmp_path / "resumed", 1.0, 3, tmp_path / "whole" / "epoch=0.ckpt")
    assert len(whole.records) == 12 and len(resumed.records) == 8
    for t, (a, b) in enumerate(zip(whole.records[4:], resumed.records, strict=True)):
        for n in a["grad"]:
            assert_close(b["params"][n], a["params"][n], f"step {t + 4}: {n}")
            assert_close(b["grad"][n], a["grad"][n], f"step {t + 4}: .grad of {n}")
    run(tmp_path / "quiet", 0.0, 1)
    resumed = run(tmp_path / "quiet-resumed", 0.0, 3, tmp_path / "quiet" / "epoch=0.ckpt")
    check_steps(resumed, steps=8, dp_batch=Q * N)


# -- mixed precision ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["module", "network"])
def test_bf16_mixed_compiled_is_the_eager_run(tmp_path: Path, how: str) -> None:
    """``precision="bf16-mixed"``, float32 parameters: the compiled run's ``.grad`` is the eager run's to bf16's
    resolution (1% relative norm per parameter), every step."""
    runs = []
    for compiled in (False, True):
        net = SeqNet(dtype=torch.float32, compile_inner=AOT if compiled and how == "network" else None)
        fitted = torch.compile(net, **AOT) if compiled and how == "module" else net
        trainer(tmp_path, callbacks=[clip()], precision="bf16-mixed", max_epochs=1).fit(
            fitted, loader(seq_batches(dtype=torch.float32))
        )
        runs.append(net.records)
    assert len(runs[0]) == len(runs[1]) == len(SHAPES)
    for t, (a, b) in enumerate(zip(*runs, strict=True)):
        for n, g in a["grad"].items():
            assert b["grad"][n].dtype == torch.float32
            error = (b["grad"][n] - g).norm() / g.norm()
            assert error < 1e-2, f"step {t}, {n}: relative error {error:.4f}"


# -- strategy="ddp" -------------------------------------------------------------------------------------------

DDP_SCRIPT = """
import sys
from pathlib import Path

import torch

sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from tests.test_attack_lightning_compile import AOT, SeqNet, clip, loader, seq_batches, plain
from tests.test_lightning import assert_unwrapped, trainer

out = Path(sys.argv[1])
for how in ("module", "network"):
    torch._dynamo.reset()
    net = SeqNet(compile_inner=AOT if how == "network" else None)
    fit = trainer(out, callbacks=[clip()], strategy="ddp", devices=2, accumulate_grad_batches=2, max_epochs=1,
                  use_distributed_sampler=False)
    batches = seq_batches(12, seed=3)  # this rank's: every other one
    fit.fit(torch.compile(net, **AOT) if how == "module" else net, loader(batches[fit.global_rank :: 2]))
    assert_unwrapped(plain(net.model))
    torch.save(net.records, out / f"{{how}}{{fit.global_rank}}.pt")
"""


def test_strategy_ddp_with_the_compiled_module_or_network(tmp_path: Path) -> None:
    """strategy="ddp", 2 CPU processes, ``accumulate_grad_batches=2``, each rank its own batches of changing
    shapes; the module compiled whole, then the network compiled in ``__init__``: each rank's ``.grad`` is the
    mean over both ranks of ``(1/2) sum_m mean_{i in m} clip(g_i)``, every step, and the ranks stay equal."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "fit_ddp.py"
    script.write_text(DDP_SCRIPT.format(root=str(root)))
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    reference = SeqNet().reference[0]
    for how in ("module", "network"):
        ranks = [torch.load(tmp_path / f"{how}{r}.pt") for r in range(2)]
        assert [len(r) for r in ranks] == [3, 3]
        for t, (zero, one) in enumerate(zip(*ranks, strict=True)):
            both = [expected_grad(reference, record, 2) for record in (zero, one)]
            for n in zero["grad"]:
                assert torch.equal(zero["params"][n], one["params"][n]), f"{how} step {t}: the ranks' {n} differ"
                for r, record in enumerate((zero, one)):
                    assert_close(record["grad"][n], (both[0][n] + both[1][n]) / 2, f"{how} rank {r} step {t}: {n}")
