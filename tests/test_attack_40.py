"""Issue 40's new layout, attacked as users meet it: old import paths, the integrations' checks plugged
into the core (Opacus and Lightning imported after wrapping, the LM-loss watcher), the one ``Options``
record through copies and pickles, the parallel back-end reading it, and the errors that must not move.
Every number against a one-sample autograd loop on a ``copy.deepcopy`` of the model, over several steps."""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import pergrad
from pergrad import PerSampleModule, TokenLossWarning, transforms
from pergrad._core.capture.hooks import CALL_WATCHERS
from pergrad._core.options import Options
from pergrad.errors import PergradError
from tests.reference import assert_close

ROOT = Path(__file__).resolve().parents[1]
BOUND = 0.7


def run_py(code: str, *flags: str) -> str:
    """``code`` in a fresh interpreter importing pergrad from this checkout; its stdout."""
    done = subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def loop_grads(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Each sample's gradient of ``sum (model(x_i) - y_i)^2``, one backward per sample on a copy."""
    model = copy.deepcopy(model)
    rows: list[dict[str, Tensor]] = []
    for i in range(len(x)):
        model.zero_grad()
        (model(x[i : i + 1]) - y[i : i + 1]).pow(2).sum().backward()
        rows.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}


def clip(g: dict[str, Tensor], bound: float = BOUND) -> dict[str, Tensor]:
    norms = torch.stack([v.flatten(1).square().sum(1) for v in g.values()]).sum(0).sqrt()
    factor = (bound / norms).clamp(max=1)
    return {n: v * factor.view(-1, *[1] * (v.dim() - 1)) for n, v in g.items()}


def batches(seed: int, sizes: list[int]) -> Iterator[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for b in sizes:
        yield (
            torch.randn(b, 3, generator=gen, dtype=torch.float64),
            torch.randn(b, 2, generator=gen, dtype=torch.float64),
        )


def sgd(model: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


# -- old import paths ---------------------------------------------------------------------------------------


def test_old_module_paths_are_errors_under_W_error_and_pergrad_itself_imports() -> None:
    out = run_py(
        """
        import sys, pergrad
        for old in ["hf", "lightning", "lm_loss", "engine", "consumers.projection"]:
            try:
                __import__("pergrad." + old)
            except DeprecationWarning as e:
                assert "pergrad." + old.split(".")[0] + " moved to" in str(e), e
                assert "pergrad." + old not in sys.modules, old
                print("raised", old)
            else:
                print("imported", old)
        try:
            from pergrad.errors import OpacusRouteError
        except DeprecationWarning as e:
            print("raised errors:", "pergrad.integrations.opacus.OpacusRouteError" in str(e))
        """,
        "-W",
        "error::DeprecationWarning",
    )
    assert out.split("\n") == [
        "raised hf",
        "raised lightning",
        "raised lm_loss",
        "raised engine",
        "raised consumers.projection",
        "raised errors: True",
        "",
    ]


def test_old_module_paths_warn_once_and_are_the_new_modules() -> None:
    out = run_py(
        """
        import warnings
        warnings.simplefilter("always")
        import pergrad
        pairs = [("hf", "integrations.hf"), ("lightning", "integrations.lightning"), ("lm_loss", "integrations.lm"),
                 ("engine", "_core.backward.engine"), ("consumers.norms", "_core.consumers.norms")]
        import importlib
        for old, new in pairs:
            with warnings.catch_warnings(record=True) as w:
                a = importlib.import_module("pergrad." + old)
                b = importlib.import_module("pergrad." + old)
            mine = [x for x in w if issubclass(x.category, DeprecationWarning) and "pergrad." in str(x.message)]
            n = importlib.import_module("pergrad." + new)
            print(old, len(mine), a is n and b is n, n.__spec__.name == "pergrad." + new, n.__name__ == "pergrad." + new)
        from pergrad.lm_loss import PerSampleLMLoss as Old
        from pergrad.integrations.lm import PerSampleLMLoss as New
        print("isinstance", Old is New and isinstance(Old(), New) and isinstance(New(), Old))
        from pergrad.engine import Engine
        import pergrad._core.backward.engine as E
        print("engine", Engine is E.Engine)
        """
    )
    lines = out.split("\n")
    for old in ["hf", "lightning", "lm_loss", "engine"]:
        assert f"{old} 1 True True True" in lines, out
    # consumers (the package) warned for itself when consumers.norms was first imported through it
    assert any(line.startswith("consumers.norms ") and line.endswith("True True True") for line in lines), out
    assert "isinstance True" in lines and "engine True" in lines


def test_an_old_name_read_as_an_attribute_then_imported_warns_once() -> None:
    out = run_py(
        """
        import warnings
        warnings.simplefilter("always")
        import pergrad
        with warnings.catch_warnings(record=True) as w:
            a = pergrad.hf
            import pergrad.hf
            from pergrad import hf
            import pergrad.lm_loss
            b = pergrad.lm_loss
        import pergrad.integrations.hf as new
        print(len(w), a is hf is new, b is pergrad.integrations.lm)
        """
    )
    assert out.split("\n")[0] == "2 True True", out


def test_importing_an_old_package_path_keeps_the_new_packages_spec() -> None:
    """The import system sets the OLD name's spec on the module the finder returns: without putting the new
    one back, ``pergrad._core.consumers`` stops being a package for ``importlib.resources`` and
    ``importlib.reload`` re-runs nothing."""
    out = run_py(
        """
        import warnings, importlib, importlib.resources
        warnings.simplefilter("ignore")
        import pergrad.consumers
        import pergrad._core.consumers as c
        print(c.__spec__.name, c.__spec__.submodule_search_locations is not None)
        print(importlib.resources.files("pergrad._core.consumers").name)
        """
    )
    assert out.split("\n")[:2] == ["pergrad._core.consumers True", "consumers"]


def test_moved_errors_warn_and_are_the_same_classes() -> None:
    import pergrad.errors as errors

    for name in ["OpacusRouteError", "TrainerConfigError", "CaptumError", "PrivacyError"]:
        with pytest.warns(DeprecationWarning, match=rf"pergrad\.errors\.{name} moved to pergrad\.\w+\.\w+\.{name}"):
            old = getattr(errors, name)
        assert old is getattr(pergrad, name) if hasattr(pergrad, name) else old.__name__ == name
        assert issubclass(old, PergradError)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchError'"):
        errors.NoSuchError  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            raise pergrad.OpacusRouteError("x")
        except errors.OpacusRouteError as e:  # an ``except`` by the old path still catches
            assert type(e) is pergrad.OpacusRouteError


def test_cli_module_and_console_entry() -> None:
    out = run_py(
        "import runpy, sys; sys.argv = ['pergrad', 'demo', '--help']; runpy.run_module('pergrad', run_name='__main__')"
    )
    assert "usage:" in out and "demo" in out
    done = subprocess.run(
        [sys.executable, "-m", "pergrad", "demo", "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout == out, done.stderr
    # the console script calls pergrad.cli:main
    entry = run_py(
        "import sys; from pergrad.cli import main; sys.argv = ['pergrad', 'demo', '--help']; sys.exit(main())"
    )
    assert entry == out
    bad = subprocess.run(
        [sys.executable, "-m", "pergrad", "nope"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr


# -- Opacus and Lightning imported after the model was wrapped ------------------------------------------------


def test_opacus_imported_after_wrapping_still_refuses_a_dropped_transform_and_keeps_the_no_op_route_exact() -> None:
    out = run_py(
        """
        import copy, sys, warnings
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import pergrad
        from pergrad import PerSampleModule, transforms, OpacusRouteError
        assert "opacus" not in sys.modules
        torch.manual_seed(0)
        def make():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        model = make()
        psm = PerSampleModule(model)
        psm.register_transform(model, transforms.clip_norm(0.1))
        from opacus import PrivacyEngine   # imported only now
        gen = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(24, 3, generator=gen), torch.randn(24, 2, generator=gen))
        def private(m):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return PrivacyEngine().make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                    data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=0.5,
                    grad_sample_mode="no_op", poisson_sampling=False)
        wrapped, opt, loader = private(model)
        x, y = next(iter(loader))
        try:
            (wrapped(x) - y).pow(2).sum(1).mean().backward()
        except OpacusRouteError as e:
            print("refused", "transform registered for the whole model: it would be dropped" in str(e))
        print("grad untouched", all(p.grad is None for p in model.parameters()))
        psm.remove()
        # the route that keeps Opacus: no transform, grad_sample kept; exact against a one-sample loop
        model = make()
        ref = copy.deepcopy(model)
        PerSampleModule(model)
        wrapped, opt, loader = private(model)
        worst = 0.0
        for x, y in loader:
            opt.zero_grad()
            (wrapped(x) - y).pow(2).sum(1).mean().backward()
            rows = []
            for i in range(len(x)):
                ref.zero_grad()
                (ref(x[i:i+1]) - y[i:i+1]).pow(2).sum().backward()
                rows.append([p.grad.clone() for p in ref.parameters()])
            for j, p in enumerate(model.parameters()):
                worst = max(worst, (p.grad_sample - torch.stack([r[j] for r in rows])).abs().max().item())
            norms = torch.stack([torch.cat([g.flatten() for g in r]).norm() for r in rows])
            factor = (0.5 / (norms + 1e-6)).clamp(max=1)
            opt.step()
            with torch.no_grad():
                for j, p in enumerate(ref.parameters()):
                    p -= 0.1 * sum(f * r[j] for f, r in zip(factor, rows)) / 8
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
        print("worst", worst < 1e-5)
        """
    )
    assert out.split("\n")[:4] == ["refused True", "grad untouched True", "worst True", ""], out


LIGHTNING_SCRIPT = """
import copy, sys, tempfile
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pergrad import PerSampleModule, transforms, TrainerConfigError
assert "lightning" not in sys.modules and "lightning.pytorch" not in sys.modules

K, BOUND, LR = 2, 0.7, 0.1
class Net(nn.Module):
    def __init__(self, scaled):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        self.psm = PerSampleModule(self.model, loss_scale=(lambda: 1 / K) if scaled else None)
        self.psm.register_transform("", transforms.clip_norm(BOUND))

nets = {s: Net(s) for s in (False, True)}
import lightning.pytorch as pl   # imported only after wrapping

class Lit(pl.LightningModule):
    def __init__(self, inner):
        super().__init__()
        self.model = inner.model
        self.psm = inner.psm
        self.records = []
    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx % K == 0:
            self.records.append({"params": copy.deepcopy(self.model.state_dict()), "batches": []})
        self.records[-1]["batches"].append((x, y))
        return (self.model(x) - y).pow(2).sum(1).mean()
    def on_before_optimizer_step(self, optimizer):
        self.records[-1]["grad"] = {n: p.grad.clone() for n, p in self.model.named_parameters()}
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR)

gen = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(16, 3, generator=gen, dtype=torch.float64), torch.randn(16, 2, generator=gen, dtype=torch.float64))
def fit(lit):
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=K, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=tempfile.mkdtemp()).fit(lit, DataLoader(data, batch_size=4))
lit = Lit(nets[False])
try:
    fit(lit)
    print("not refused")
except TrainerConfigError as e:
    print("refused", "accumulate_grad_batches=2" in str(e) and "no loss_scale" in str(e))
print("nothing written", all(p.grad is None for p in lit.model.parameters()))
lit = Lit(nets[True])
fit(lit)
ref = copy.deepcopy(lit.model)
worst = 0.0
for rec in lit.records:
    ref.load_state_dict(rec["params"])
    want = None
    for x, y in rec["batches"]:
        rows = []
        for i in range(len(x)):
            ref.zero_grad()
            (ref(x[i:i+1]) - y[i:i+1]).pow(2).sum().backward()
            rows.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        norms = torch.stack([torch.cat([g.flatten() for g in r.values()]).norm() for r in rows])
        f = (BOUND / norms).clamp(max=1)
        part = {n: sum(fi * r[n] for fi, r in zip(f, rows)) / len(x) / K for n in rows[0]}
        want = part if want is None else {n: want[n] + part[n] for n in part}
    worst = max(worst, max((rec["grad"][n] - want[n]).abs().max().item() for n in want))
print("steps", len(lit.records), "exact", worst < 1e-12)
"""


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_imported_after_wrapping_refuses_a_missing_loss_scale_and_the_right_one_is_exact(
    package: str,
) -> None:
    script = LIGHTNING_SCRIPT.replace("import lightning.pytorch as pl", f"import {package} as pl")
    if package == "pytorch_lightning":  # the standalone package alone: the check must not need lightning.pytorch
        script += "\nassert 'lightning.pytorch' not in sys.modules, 'lightning.pytorch imported'\n"
    out = run_py(script)
    assert out.split("\n")[:3] == ["refused True", "nothing written True", "steps 2 exact True"], out


# -- the LM-loss watcher ----------------------------------------------------------------------------------


def tiny_lm(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return GPT2LMHeadModel(config).double()


def lm_batch(seed: int, lengths: list[int], width: int = 6) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (len(lengths), width), generator=gen)
    labels = ids.clone()
    for i, n in enumerate(lengths):
        labels[i, n:] = -100
    return ids, labels


def lm_loop_grads(model: nn.Module, ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *shape]}``: the gradient of each sample's own HF loss, one backward per sample on ``model``."""
    rows: dict[str, list[Tensor]] = {}
    for i in range(len(ids)):
        model.zero_grad()
        model(ids[i : i + 1], labels=labels[i : i + 1]).loss.backward()
        for n, p in model.named_parameters():
            rows.setdefault(n, []).append(p.grad.clone())
    return {n: torch.stack(g) for n, g in rows.items()}


def test_unequal_token_labels_warn_once_per_wrapper_and_equal_ones_are_exact() -> None:
    model = tiny_lm(0)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        psm = PerSampleModule(model)
        for step in range(3):
            model.zero_grad()
            ids, labels = lm_batch(step, [6, 6, 6])  # equal lengths: per-sample exact, no warning
            psm(ids, labels=labels).loss.backward()
            want = lm_loop_grads(ref, ids, labels)
            for n, p in model.named_parameters():  # HF's loss casts the logits to float32 (.float())
                torch.testing.assert_close(p.grad_sample, want[n], rtol=1e-4, atol=1e-6, msg=n)
        assert not [x for x in w if issubclass(x.category, TokenLossWarning)]
        for step in range(3):
            model.zero_grad()
            ids, labels = lm_batch(10 + step, [6, 3, 5])
            psm(ids, labels=labels).loss.backward()
        psm.remove()
        second = PerSampleModule(model)  # a new wrapper warns again, once
        for step in range(2):
            ids, labels = lm_batch(20 + step, [2, 6, 4])
            second(ids, labels=labels).loss.backward()
        other = PerSampleModule(tiny_lm(1))  # two wrappers at once: each warns once
        for step in range(2):
            ids, labels = lm_batch(30 + step, [2, 6, 4])
            other(ids, labels=labels).loss.backward()
            second(ids, labels=labels).loss.backward()
    warned = [x for x in w if issubclass(x.category, TokenLossWarning)]
    assert len(warned) == 3, [str(x.message)[:80] for x in w]
    assert all("different numbers of labelled tokens" in str(x.message) for x in warned)


def test_a_call_without_labels_runs_no_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = CALL_WATCHERS["labels"]
    monkeypatch.setitem(CALL_WATCHERS, "labels", lambda *a: (calls.append("labels"), real(*a))[1])
    model = tiny_lm(2)
    psm = PerSampleModule(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(2):
            ids, labels = lm_batch(40 + step, [6, 2, 4])
            out = psm(ids, attention_mask=torch.ones_like(ids))
            per_token = torch.nn.functional.cross_entropy(
                out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none"
            ).view(3, -1)
            per_token.sum(1).mean().backward()
            psm(ids).logits.sum().backward()
    assert calls == [] and not [x for x in w if issubclass(x.category, TokenLossWarning)]
    # float labels (a regression target) and a [B] label vector are not token labels: the watcher ignores them
    psm(ids, labels=labels)
    assert calls == ["labels"]


# -- copies and pickles of a wrapper made with non-default options --------------------------------------------


def half() -> float:
    return 0.5


class Scale(nn.Module):
    """A layer of the user's: ``x * w`` elementwise, its rule in a private registry."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


def scale_rule(layer: nn.Module, a: Tensor, d: Tensor) -> dict[str, Tensor]:
    return {"w": torch.einsum("n...f,n...f->nf", a, d)}


def scaled_net() -> nn.Module:
    model = net()
    model.append(Scale())
    return model


def _options_wrapper(model: nn.Module) -> PerSampleModule:
    rules = pergrad.default_registry.copy()
    rules.register(Scale)(scale_rule)
    psm = PerSampleModule(
        model,
        reduction="sum",
        accumulate="samples",
        track_statistics={"variance", "sq_norms"},
        keep_grad_sample=False,
        loss_scale=half,
        rules=rules,
    )
    psm.register_transform("0", transforms.clip_norm(BOUND))
    return psm


def _reference_sum(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``0.5 * sum_i T(g_i)``: layer 0 clipped on its own, the others untransformed."""
    g = loop_grads(model, x, y)
    first = clip({n: v for n, v in g.items() if n.startswith("0.")})
    return {n: 0.5 * (first.get(n, v)).sum(0) for n, v in g.items()}


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_a_copy_with_non_default_options_continues_training_exactly(how: str) -> None:
    model = scaled_net()
    psm = _options_wrapper(model)
    ref = copy.deepcopy(model)
    data = list(batches(1, [4, 3, 5, 2, 4, 4, 1, 3]))

    def step(wrapper: PerSampleModule, k: int) -> None:
        want: dict[str, Tensor] = {}
        for x, y in data[2 * k : 2 * k + 2]:  # two micro-batches (accumulate="samples", reduction="sum")
            (0.5 * (wrapper(x) - y).pow(2).sum(1).mean()).backward()  # loss_scale=half: the loss is halved
            for n, v in _reference_sum(ref, x, y).items():
                want[n] = want.get(n, 0) + v
        for n, p in wrapper.module.named_parameters():
            assert_close(p.grad, want[n], f"step {k} {n}")
            assert not hasattr(p, "grad_sample")
        norms = wrapper.per_sample_norms()
        g = loop_grads(ref, *data[2 * k + 1])
        for n in g:
            assert_close(norms[n], g[n].flatten(1).norm(dim=1), f"norm {n}")
        stats = wrapper.statistics()
        assert stats.tracked == frozenset({"variance", "sq_norms"}) and stats.batch_size == len(data[2 * k + 1][0])
        assert_close(stats.sq_norms, sum(v.flatten(1).square().sum(1) for v in g.values()), "sq_norms")
        sgd(wrapper.module)
        ref.load_state_dict(wrapper.module.state_dict())
        wrapper.module.zero_grad()

    for k in range(2):
        step(psm, k)
    if how == "deepcopy":
        copied = copy.deepcopy(psm)
    elif how == "torch.save":
        buffer = io.BytesIO()
        torch.save(psm, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    else:
        copied = pickle.loads(pickle.dumps(psm))
    assert copied.options == psm.options and copied.options is not psm.options
    assert copied.options.track_statistics == frozenset({"variance", "sq_norms"})
    assert copied.loss_scale is half and list(copied.registered_transforms()) == ["module '0'"]
    assert copied._registry is not psm._registry and Scale in copied._registry
    psm.remove()
    assert all(p.grad is None for p in copied.module.parameters())
    for k in range(2, 4):
        step(copied, k)


def test_pickles_share_the_default_registry_and_see_a_rule_registered_after_loading() -> None:
    """The unpickled wrapper reads the process's default registry, as 3a0a015's did (not a frozen copy): a
    layer of a type registered only after loading, added to the model, is wrapped at the next call, exactly."""
    from pergrad.registry import default_registry

    model = net()
    blob = pickle.dumps(PerSampleModule(model))
    loaded = pickle.loads(blob)
    assert loaded._registry is default_registry
    default_registry.register(Scale)(scale_rule)
    try:
        loaded.module.append(Scale())
        ref = copy.deepcopy(loaded.module)
        for k, (x, y) in enumerate(batches(5, [3, 4, 2])):
            loaded.module.zero_grad()
            (loaded(x) - y).pow(2).sum(1).mean().backward()
            g = loop_grads(ref, x, y)
            for n, p in loaded.module.named_parameters():
                assert_close(p.grad_sample, g[n], f"step {k} {n}")
                assert_close(p.grad, g[n].mean(0), f"step {k} {n}")
            sgd(loaded.module)
            ref.load_state_dict(loaded.module.state_dict())
    finally:
        loaded.remove()
        del default_registry._rules[Scale]
    psm2 = PerSampleModule(net(), rules=pergrad.default_registry.copy())
    copied = copy.deepcopy(psm2)
    assert copied._registry is not psm2._registry and copied._registry is not default_registry
    assert copied.options == psm2.options == Options()


# -- reads before any backward ------------------------------------------------------------------------------


def test_reads_before_any_backward() -> None:
    psm = PerSampleModule(net())
    with pytest.raises(PergradError, match=r"nothing to measure: run a backward first; with keep_grad_sample=False"):
        psm.per_sample_norms()
    with pytest.raises(PergradError, match=r"nothing to measure: run a backward first"):
        psm.statistics()
    holder = psm.hold_per_sample()
    assert holder.armed is False and holder.take() == []
    holder.close()
    tracked = PerSampleModule(net(), track_statistics={"variance"})
    with pytest.raises(PergradError, match=r"^statistics\(\) is available after a backward pass$"):
        tracked.statistics()
    assert dict(tracked.per_sample_norms()) == {}
    with pytest.raises(
        PergradError, match=r"activation_grads\(\) needs PerSampleModule\(\.\.\., keep_activation_grads=True\)"
    ):
        tracked.activation_grads()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"loss_reduction": "bogus"}, ValueError, r"^loss_reduction must be 'mean' or 'sum', got 'bogus'$"),
        ({"reduction": "bogus"}, ValueError, r"^reduction must be 'mean' or 'sum', got 'bogus'$"),
        ({"accumulate": "bogus"}, ValueError, r"^accumulate must be 'backward' or 'samples', got 'bogus'$"),
        ({"track_statistics": "variance"}, TypeError, r"got the string 'variance'"),
        ({"track_statistics": {"bogus"}}, ValueError, r"unknown statistic\(s\) \['bogus'\]"),
    ],
)
def test_bad_options_are_refused_with_the_model_untouched(kwargs: dict[str, Any], error: type, message: str) -> None:
    model = net()
    with pytest.raises(error, match=message):
        PerSampleModule(model, **kwargs)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    PerSampleModule(model).remove()  # and it can be wrapped at once


def test_options_are_frozen_and_copies_rebuild_from_them() -> None:
    psm = PerSampleModule(net(), reduction="sum", track_norms=True)
    with pytest.raises(AttributeError):
        psm.options.reduction = "mean"  # type: ignore[misc]
    assert psm._engine.options is psm.options
    copied = copy.deepcopy(psm)
    assert copied._engine.options == psm.options and copied.reduction == "sum"


# -- dtype moves after wrapping ----------------------------------------------------------------------------------


def test_a_model_moved_to_float64_after_wrapping_is_exact_on_every_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    model.to(torch.float64)
    for step, (x, y) in enumerate(batches(7, [4, 4, 3, 16])):
        ref = copy.deepcopy(model)
        model.zero_grad()
        (psm(x) - y).pow(2).sum(1).mean().backward()
        g = loop_grads(ref, x, y)
        want = {n: v.mean(0) for n, v in clip(g).items()}
        for n, p in model.named_parameters():
            assert p.dtype == torch.float64
            assert_close(p.grad, want[n], f"step {step} {n}")
            assert_close(p.grad_sample, g[n], f"step {step} {n}")
        sgd(model)


# -- DDP with accumulate="samples" ---------------------------------------------------------------------------


def _ddp_samples(rank: int, world: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    model = net()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, accumulate="samples")
    psm.register_transform(model, transforms.clip_norm(BOUND))
    ddp = DistributedDataParallel(model)
    sizes = [[(2, 3), (3, 1)], [(1, 4), (2, 2)], [(3, 3), (1, 2)]]  # per step: per rank the micro-batch sizes
    worst = 0.0
    for step, per_rank in enumerate(sizes):
        data = [list(batches(100 * step + r, list(per_rank[r]))) for r in range(world)]
        with ddp.no_sync():
            x, y = data[rank][0]
            (ddp(x) - y).pow(2).sum(1).mean().backward()
        x, y = data[rank][1]
        (ddp(x) - y).pow(2).sum(1).mean().backward()
        every = [clip(loop_grads(ref, x, y)) for r in range(world) for x, y in data[r]]
        total = sum(len(next(iter(g.values()))) for g in every)
        for n, p in model.named_parameters():
            want = sum(g[n].sum(0) for g in every) / total
            worst = max(worst, (p.grad - want).abs().max().item())
        sgd(model)
        model.zero_grad()
        ref.load_state_dict(model.state_dict())
    return worst


def test_ddp_two_processes_accumulate_samples(tmp_path: Path) -> None:
    from tests.test_distributed import Pool

    pool = Pool(2, tmp_path)
    try:
        assert all(w < 1e-12 for w in pool.run(_ddp_samples))
    finally:
        pool.close()


def test_hold_per_sample_asked_before_any_backward_holds_exact_gradients_without_grad_sample() -> None:
    model = net()
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    holder = psm.hold_per_sample()  # before any backward
    ref = copy.deepcopy(model)
    for step, (x, y) in enumerate(batches(9, [4, 4, 17, 2])):
        holder.armed = step % 2 == 0
        model.zero_grad()
        (psm(x) - y).pow(2).sum(1).mean().backward()
        g = loop_grads(ref, x, y)
        for n, p in model.named_parameters():
            assert_close(p.grad, clip(g)[n].mean(0), f"step {step} {n}")
            assert not hasattr(p, "grad_sample")
        held = holder.take()
        if step % 2:
            assert held == []
        else:
            (one,) = held
            assert one.batch_size == len(x)
            names = {p: n for n, p in model.named_parameters()}
            assert {names[p] for p in one.grads} == set(g)
            for p, v in one.grads.items():
                assert_close(v, g[names[p]], f"held step {step} {names[p]}")
        sgd(model)
        ref.load_state_dict(model.state_dict())
    holder.close()


def test_a_copy_of_a_wrapper_with_a_grad_scaler_is_exact_or_refuses() -> None:
    model = net()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    copied = copy.deepcopy(PerSampleModule(model, grad_scaler=scaler))
    ref = copy.deepcopy(copied.module)
    for step, (x, y) in enumerate(batches(11, [4, 3])):
        copied.module.zero_grad()
        try:
            scaler.scale((copied(x) - y).pow(2).sum(1).mean()).backward()
        except PergradError:
            return  # refusing is right too
        g = loop_grads(ref, x, y)
        for n, p in copied.module.named_parameters():
            assert_close(p.grad_sample, g[n], f"step {step} {n}")


def test_a_wrapper_pickled_with_its_grad_scaler_or_given_one_after_loading_is_exact() -> None:
    """Pickled in one file with the scaler it reads, the loaded wrapper reads the loaded scaler; a wrapper loaded
    alone is given the scaler the user drives with ``psm.grad_scaler = ...``."""
    for together in (True, False):
        model = net()
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        saved = pickle.loads(pickle.dumps({"psm": PerSampleModule(model, grad_scaler=scaler), "scaler": scaler}))
        psm, scaler = saved["psm"], saved["scaler"]
        if not together:
            scaler = torch.amp.GradScaler("cpu", init_scale=32.0)
            psm.grad_scaler = scaler
        assert psm.grad_scaler is scaler
        ref = copy.deepcopy(psm.module)
        for step, (x, y) in enumerate(batches(12, [4, 3])):
            psm.module.zero_grad()
            scaler.scale((psm(x) - y).pow(2).sum(1).mean()).backward()
            g = loop_grads(ref, x, y)
            for n, p in psm.module.named_parameters():
                assert_close(p.grad_sample, g[n], f"{together} step {step} {n}")


def test_a_token_loss_warning_raised_as_an_error_leaves_nothing_written_and_training_goes_on() -> None:
    """``filterwarnings = error`` (a common pytest setting): the warning raises at the backward's start; nothing
    is written and the next steps are exact."""
    model = tiny_lm(3)
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenLossWarning)
        ids, labels = lm_batch(50, [6, 2, 4])
        with pytest.raises(TokenLossWarning, match="different numbers of labelled tokens"):
            psm(ids, labels=labels).loss.backward()
        assert all(p.grad is None and not hasattr(p, "grad_sample") for p in model.parameters())
        for step in range(2):
            model.zero_grad()
            ids, labels = lm_batch(51 + step, [6, 6, 6])
            psm(ids, labels=labels).loss.backward()
            want = lm_loop_grads(ref, ids, labels)
            for n, p in model.named_parameters():  # HF's loss casts the logits to float32 (.float())
                torch.testing.assert_close(p.grad_sample, want[n], rtol=1e-4, atol=1e-6, msg=n)
                torch.testing.assert_close(p.grad, want[n].mean(0), rtol=1e-4, atol=1e-6, msg=n)


def test_a_loss_scale_set_after_wrapping_travels_with_copies_and_a_lightning_style_lambda_deep_copies() -> None:
    model = net()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(BOUND))
    psm.loss_scale = half  # set later, as PerSample does
    for how in ("deepcopy", "pickle"):
        copied = copy.deepcopy(psm) if how == "deepcopy" else pickle.loads(pickle.dumps(psm))
        assert copied.loss_scale is half
        ref = copy.deepcopy(copied.module)
        for step, (x, y) in enumerate(batches(13, [4, 3, 5])):
            copied.module.zero_grad()
            (0.5 * (copied(x) - y).pow(2).sum(1).mean()).backward()
            g = loop_grads(ref, x, y)
            for n, p in copied.module.named_parameters():
                assert_close(p.grad_sample, g[n], f"{how} step {step} {n}")
                assert_close(p.grad, 0.5 * clip(g)[n].mean(0), f"{how} step {step} {n}")
            sgd(copied.module)
            ref.load_state_dict(copied.module.state_dict())
        copied.remove()


# a wrapper pickled by pergrad 0.1 (3a0a015): PerSampleModule(nn.Sequential(nn.Linear(3, 2)).double(),
# reduction="sum") with clip_norm(0.7) on "0"; zlib-compressed, base64 (its hooks reference pergrad.hooks)
OLD_PICKLE = (
    "eNrVVctvG0UY9yuuY8duCNCKBlUREsLh4ebRKI0QSlUqENpiHr34Eg2zu2PPkN0d785MgpEihUNSB41UoQ6c+AMQZ+4gceUCHBE9"
    "IvEnIHHg251184Q7e9hv53vOfPub37df+fLbS4Xs0a0hSQYJ9jsh91VAjK6hhLiKBdI8Mm19TfLEo50oyu2i4/FIYhaRxOj6fRIr"
    "EkmGA3Be/MzsQURNJmBm0cCMdQMNcYJDIkkiwAi5XdXv54t5FPEIQXnBhIQsExsSRJqHRj+NXOxt7+LER8OEIMr5tjC64fEgIJ5k"
    "PEpX7yU+SYh/l3npfhc/NPrycZgNoXOp+gpiAvVVEJw2m65uoT5Pzvq3naJuTlqTl66id+DYeR2nROdBKH3tdDjaZZKitMAgT+UU"
    "x0I/f8YLB7t4JJCH4TB+7lcCv7knfsdnttZCVk/o6+c9LqhZgFxPISGxJMiH5pzqxbMnDWfqwHkCjv3/8pg/78HF6Qo1lMMl/dHF"
    "JaOvnsNRABjCAKLqPfsxARCtjel0CqTqLmEDKo2esbFISRbAb5jLAeofgwuC6cYJA8BJ8ATtrGQYbtp4AQIPAOGzdv/9hIfIHUnY"
    "5CNz59ViobBf+rwe/P31W38tfPzN+8919kvv/lmG915caPdm4bIMEy454A/tpKDlUVwEh14TLAGTMiCIRD7DUVwa9+qglKMhQYJ9"
    "SkRc3osr7d4UKAXliYynnFKvDCsWybjqVHqVNAePBvElp6IU1Gz30guabzkueNkR6ne5cgNy32rrcbHXAqeNm+ur66tLy2tLK0s3"
    "b8U2sTdUcdmpdmVc+QDSbcWFi3yLuFMtHD9738Xfg/jI/eXXTZA/cPY4XS+Mln/L5Fc7P2X2l3/+cdMcmBRmTskpHxqn7BQPzVH2"
    "7yXox9nXA/jSFZdhQMXr9I02vX1n5v/e5dXl9VtrGyunulz6ly5PfKHLpRNdpuGDtIu3b9z7/biLB0ATBxd2UNHGnqHNh4ZeznT0"
    "GSuudOnVnKoaGTU4TStalpjodcsErbGgCxPHsdMcK/pCvpy2AXUrZvK4F23cNMS9ZEstWvGKFa9ZcQNudoNFqE+wVAlcIqesZ7iS"
    "JxQl5Qrlpne5FXAh4Hr6KmNugEVIMIjpE6qyUCGkdLH0KOqzREiYILPbhAxRysJI4HAIAwqmCkwYbxumRxIKc6Rn7TKlIxgkzBOm"
    "/QXMJux5KlQBcBTQ0YTzgfuyhBhq7uC0bpY7TVMFuLH+CPLX+sDKaQRop5KMxbp6zicSw8agWCSAgUOgbdiK3RnQOJBQV9ezY2ZL"
    "01Vbhq7puckQeRIIFFZ7M2DDLnxPWE/XQvxJdiLz9uYf/ewR7qHBW2bLHKWA6PwDFq+4DQ=="
)


def test_a_wrapper_pickled_by_the_old_layout_loads_and_trains_exactly() -> None:
    import base64
    import zlib

    with pytest.warns(DeprecationWarning, match=r"pergrad\.hooks moved to pergrad\._core\.capture\.hooks"):
        psm = pickle.loads(zlib.decompress(base64.b64decode(OLD_PICKLE)))
    assert psm.options == Options(reduction="sum")
    assert list(psm.registered_transforms()) == ["module '0'"]
    model = psm.module
    ref = copy.deepcopy(model)
    for step, (x, y) in enumerate(batches(17, [4, 1, 3])):
        model.zero_grad()
        (psm(x) - y).pow(2).sum(1).mean().backward()
        g = loop_grads(ref, x, y)
        for n, p in model.named_parameters():
            assert_close(p.grad_sample, g[n], f"step {step} {n}")
            assert_close(p.grad, clip(g)[n].sum(0), f"step {step} {n}")
        sgd(model)
        ref.load_state_dict(model.state_dict())
    psm.remove()
    assert all(
        not m._forward_pre_hooks or all(type(h).__name__ == "_Inert" for h in m._forward_pre_hooks.values())
        for m in model.modules()
    )
