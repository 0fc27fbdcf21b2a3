"""Attribution quality as the field measures it: the linear datamodeling score (LDS, Park et al. 2023).

Two tasks, everything on the CPU, one thread (``--threads``):

- ``digits``: scikit-learn's digits, 1,200 train / 300 test, an MLP 64-64-10 trained with SGD (momentum).
  The output measured is each test sample's margin ``log p_y - log(1 - p_y)``.
- ``lm``: a byte-level causal transformer (``examples/attribution_lm.py``'s TinyLM, width 32, one block) on
  scikit-learn's dataset descriptions, 1,000 train / 100 held-out sequences of 32 bytes, trained with Adam.
  The output measured is each test sequence's summed token margins (``lm_margin``).

Ground truth: ``--models`` models, each trained (its own seed) on a random half of the training set
(``pergrad.attribution.subsets``, ``retrain``); ``lds`` correlates, test sample by test sample, the summed
scores of each half with the output measured. Every method scores from the same ``--checkpoints`` models
trained on the whole training set (independent seeds: TRAK's ensemble), at ``k`` features each:

- ``trak``: pergrad's TRAK mode: features of the margin (``margin`` / ``lm_margin``), each checkpoint its own
  projection seed, ``preconditioner="trak"`` (the Gram of the whole store, the out-to-loss term averaged);
- ``gram (loss)``: the loss-gradient route, ``preconditioner="gram"``; ``gram (loss), one seed``: the same with
  one projection seed for every checkpoint (what the examples did before issue 42);
- ``tracin``: identity on the loss gradients (``kind``: ``kron``, and ``dense``/``sjlt`` for the digits);
- ``ekfac`` / ``ekfac (sampled Fisher)``: one Kronecker projection per weight, ``track_projected_factors`` summed in
  the backward of the loss with the true labels (empirical Fisher) or with labels drawn from the model (true
  Fisher), eigenvalues corrected with ``ekfac`` from the same backward's features;
- ``exact influence``: unprojected per-sample gradients (torch.func, float64): ``g(z)^T (G^T G + lambda I)^{-1}
  g_i`` through its kernel form ``K_z (K + lambda I)^{-1}``; ``exact trak``: the same on the margins with TRAK's
  ``Q``; ``exact tracin``: ``g(z)^T g_i``;
- ``traker``: traker 0.3.2 (``TRAKer``, its CPU projector, default settings: float16 features, lambda 0), run by
  ``--traker-python`` (a separate environment with traker; skipped without it; never a dependency of pergrad);
  ``trak (re-implemented)``: TRAK's estimator written out from the paper with torch.func per-sample gradients and
  a dense Gaussian projection, independent of pergrad's projections.

Projection seeds (``--seeds N``): the TRAK-mode rows and traker run with projection seeds ``0..N-1`` (pergrad:
``FeatureStore.open(seed=s)``, checkpoint ``c`` projecting with ``s + 100_000 c``; traker: ``projector_seed=s``) on
the same checkpoints and ground truth (trained once per task); each such row gives the mean and sd over seeds,
and each TRAK-mode row is compared with traker at the same k (``versus_traker``: the difference, its standard
error over seeds and paired over test samples, a bootstrap over both).

Times: features (train and test, every checkpoint) plus scoring, on one thread (the median over seeds); the
ground truth's training is not counted. Nothing here is a test; tests run ``--tiny`` (seconds) and assert nothing
about time.

    python benchmarks/lds.py                        # 100 half models, 10 checkpoints, k = 128 and 512
    python benchmarks/lds.py --quick                # 40 half models, 5 checkpoints, k = 128 (under 5 minutes)
    python benchmarks/lds.py --traker-python /tmp/trakvenv/bin/python --seeds 5 --json benchmarks/runs/lds-run.json
    python benchmarks/lds.py --tasks lm --seeds 5 --methods trak,traker --traker-python ENV/bin/python
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pergrad import PerSampleModule  # noqa: E402
from pergrad.attribution import (  # noqa: E402
    FeatureStore,
    ekfac,
    feature_columns,
    lds,
    lm_margin,
    margin,
    retrain,
    sampled_labels,
    scores,
    spearman,
    subsets,
)


def _load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- tasks ---------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    """A training set, a test set, how to train a model on a subset, and the output measured."""

    name: str
    x: Tensor  # train inputs
    y: Tensor  # train targets
    x_test: Tensor
    y_test: Tensor
    make: Callable[[int], nn.Module]  # seed -> a fresh model
    fit: Callable[[nn.Module, Tensor, int], None]  # model, train indices, seed: trains in place
    output: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # (model output, targets) -> (f [B], Q [B])
    loss: Callable[[Tensor, Tensor], Tensor]  # (model output, targets) -> [B] each sample's training loss
    sampled_loss: Callable[[Tensor, torch.Generator], Tensor]  # model output -> [B] loss of labels drawn from it
    batch: int = 300  # feature batch

    @property
    def n(self) -> int:
        return len(self.y)

    def measure(self, model: nn.Module) -> Tensor:
        with torch.no_grad():
            return self.output(model(self.x_test), self.y_test)[0]


def digits(quick: bool) -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    order = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(data.data, dtype=torch.float32)[order] / 16
    y = torch.tensor(data.target)[order]

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def fit(model: nn.Module, idx: Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(25):
            for b in idx[torch.randperm(len(idx), generator=gen)].split(64):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[b]), y[b]).backward()
                opt.step()

    def sampled(logits: Tensor, gen: torch.Generator) -> Tensor:
        return F.cross_entropy(logits, sampled_labels(logits, generator=gen), reduction="none")

    return Task(
        "digits",
        x[:1200],
        y[:1200],
        x[1200:1500],
        y[1200:1500],
        make,
        fit,
        margin,
        lambda out, t: F.cross_entropy(out, t, reduction="none"),
        sampled,
    )


def language_model(quick: bool) -> Task:
    lm = _load_example("attribution_lm")
    seqs = lm.sequences(32)
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0))
    seqs = seqs[order]
    train, test = seqs[:1000], seqs[1000:1100]

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return lm.TinyLM(32, width=32, heads=2, blocks=1)

    def fit(model: nn.Module, idx: Tensor, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(4):
            for b in idx[torch.randperm(len(idx), generator=gen)].split(32):
                opt.zero_grad(set_to_none=True)
                out = model(train[b, :-1])
                F.cross_entropy(out.flatten(0, 1), train[b, 1:].flatten()).backward()
                opt.step()

    def loss(out: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(out.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape).sum(1)

    def sampled(out: Tensor, gen: torch.Generator) -> Tensor:
        return loss(out, sampled_labels(out, generator=gen))

    return Task(
        "lm", train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:], make, fit, lm_margin, loss, sampled, batch=100
    )


# -- features ------------------------------------------------------------------------------------------------------


def project_pass(
    task: Task,
    model: nn.Module,
    store: FeatureStore | None,
    name: str,
    projection: dict[str, Any],
    what: str,
) -> Tensor:
    """Write the features of ``what`` ("loss" or "output") of every train sample into ``store`` (when given) and
    return those of the test samples: one wrapper, ``grads=False`` (an attribution pass)."""
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    psm.register_projection(model, **projection, grads=False)
    if store is not None:
        for idx in torch.arange(task.n).split(task.batch):
            out = psm(task.x[idx])
            if what == "output":
                f, q = task.output(out, task.y[idx])
                f.sum().backward()
                store.write_from(psm, idx, name, out_to_loss=q)
            else:
                task.loss(out, task.y[idx]).sum().backward()
                store.write_from(psm, idx, name)
    out = psm(task.x_test)
    (task.output(out, task.y_test)[0] if what == "output" else task.loss(out, task.y_test)).sum().backward()
    test = psm.per_sample_projections()[""]
    psm.remove()
    return test


def ekfac_pass(
    task: Task, model: nn.Module, store: FeatureStore, name: str, dims: dict[str, int], seed: int, sampled: bool
) -> tuple[Tensor, dict[range, Any], FeatureStore | None]:
    """One Kronecker projection per weight; factors summed in the backward of the loss (``sampled``: of labels
    drawn from the model, the true Fisher, whose features also give the eigenvalue correction). Returns the test
    features, the blocks, and the store of sampled-label features (None for the empirical Fisher)."""
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    for target, dim in dims.items():
        psm.register_projection(target, dim=dim, seed=seed, grads=False)
    psm.track_projected_factors(*dims)
    gen = torch.Generator().manual_seed(seed)
    fisher = None
    if sampled:
        fisher = FeatureStore.open(Path(store.path).with_name(store.path.name + "-fisher"), n=task.n, k=store.k)
        for idx in torch.arange(task.n).split(task.batch):
            task.sampled_loss(psm(task.x[idx]), gen).sum().backward()
            fisher.write(idx, torch.cat(list(psm.per_sample_projections().values()), 1))
        fisher.flush()
        blocks_from = psm.projected_factors()
        psm.reset_projected_factors()
    for idx in torch.arange(task.n).split(task.batch):
        task.loss(psm(task.x[idx]), task.y[idx]).sum().backward()
        store.write(idx, torch.cat(list(psm.per_sample_projections().values()), 1), name)
    if not sampled:
        blocks_from = psm.projected_factors()
    columns = feature_columns(dims)
    blocks = {columns[t]: f for t, f in blocks_from.items()}
    task.loss(psm(task.x_test), task.y_test).sum().backward()
    test = torch.cat(list(psm.per_sample_projections().values()), 1)
    psm.remove()
    return test, blocks, fisher


def weight_dims(model: nn.Module, total: int) -> dict[str, int]:
    """A Kronecker dim (a power of two) for every Linear / Embedding weight, about ``total`` over all."""
    names = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]
    each = 2 ** max(2, round(math.log2(max(4, total / len(names)))))
    return dict.fromkeys(names, each)


def per_sample_grads(task: Task, model: nn.Module, x: Tensor, y: Tensor, what: str) -> Tensor:
    """``[B, #params]`` float64 per-sample gradients of the loss or the output, torch.func."""
    model = copy.deepcopy(model).double()
    params = {k: p.detach() for k, p in model.named_parameters()}

    def f(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return (task.output(out, yi.unsqueeze(0))[0] if what == "output" else task.loss(out, yi.unsqueeze(0))).sum()

    x = x.double() if x.is_floating_point() else x
    rows = []
    for start in range(0, len(y), 100):
        g = vmap(grad(f), in_dims=(None, 0, 0))(params, x[start : start + 100], y[start : start + 100])
        rows.append(torch.cat([v.flatten(1) for v in g.values()], 1))
    return torch.cat(rows)


def kernel_influence(train: list[Tensor], test: list[Tensor], damping: float, q: Tensor | None = None) -> Tensor:
    """``sum_c g_c(z)^T (G_c^T G_c + lambda_c I)^{-1} g_c(i)`` as ``K_z (K + lambda I)^{-1}`` (Woodbury),
    ``lambda_c = damping * trace(G^T G) / n`` (relative to the kernel's mean eigenvalue); times ``Q`` if given."""
    out = torch.zeros(test[0].shape[0], train[0].shape[0], dtype=torch.float64)
    for g, gz in zip(train, test):
        kernel = g @ g.T
        lam = damping * kernel.trace() / kernel.shape[0]
        out += torch.linalg.solve(kernel + lam * torch.eye(kernel.shape[0], dtype=torch.float64), g @ gz.T).T
    return out if q is None else out * q


# -- the methods ---------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    lds: float
    sem: float  # standard error of the mean over test samples
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def evaluate(score: Tensor, masks: Tensor, outputs: Tensor, seconds: float, **extra: Any) -> Outcome:
    per_test = lds(score, masks, outputs)
    per_test = per_test[~per_test.isnan()]
    sem = float(per_test.std() / math.sqrt(per_test.numel()))
    return Outcome(float(per_test.mean()), sem, seconds, extra)


def run_pergrad(
    task: Task,
    checkpoints: list[nn.Module],
    root: Path,
    label: str,
    *,
    k: int,
    kind: str = "kron",
    what: str = "output",
    preconditioner: str = "trak",
    one_seed: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, float]:
    names = [f"c{c}" for c in range(len(checkpoints))]
    start = time.perf_counter()
    store = FeatureStore.open(
        root / f"{label}-seed{seed}",
        n=task.n,
        k=k,
        checkpoints=names,
        kind=kind,
        dtype=dtype,
        seed=None if one_seed else seed,
        seeds=[seed] * len(names) if one_seed else None,
        output=("margin" if task.name == "digits" else "lm-margin") if what == "output" else "loss",
        out_to_loss=what == "output",
    )
    test = {
        name: project_pass(task, model, store, name, store.projection(name), what)
        for name, model in zip(names, checkpoints)
    }
    store.flush()
    score = scores(test, store, preconditioner=preconditioner)
    return score, time.perf_counter() - start


def run_ekfac(
    task: Task, checkpoints: list[nn.Module], root: Path, label: str, k: int, sampled: bool, damping: float
) -> tuple[Tensor, float]:
    names = [f"c{c}" for c in range(len(checkpoints))]
    dims = weight_dims(checkpoints[0], k)
    start = time.perf_counter()
    total = sum(dims.values())
    store = FeatureStore.open(root / label, n=task.n, k=total, checkpoints=names)
    score = torch.zeros(task.x_test.shape[0], task.n, dtype=torch.float64)
    for c, (name, model) in enumerate(zip(names, checkpoints)):
        test, blocks, fisher = ekfac_pass(task, model, store, name, dims, 100_000 * c, sampled)
        store.flush()
        one = _OneCheckpoint(store, name)
        m = ekfac(fisher if fisher is not None else one, blocks, damping)
        score += scores(test, one, preconditioner=m).double()
    return score, time.perf_counter() - start


class _OneCheckpoint:
    """One checkpoint of a store seen as a store of its own (a preconditioner per checkpoint)."""

    def __init__(self, store: FeatureStore, name: str) -> None:
        self.store, self.name = store, name
        self.n, self.k, self.dtype, self.checkpoints = store.n, store.k, store.dtype, ("final",)

    def chunks(self, size: int, checkpoint: Any = None, indices: Any = None) -> Any:
        return self.store.chunks(size, self.name, indices)


def _margin_features(task: Task, model: nn.Module, proj: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``[B, k]``: torch.func per-sample gradients of the output times ``proj`` ``[#params, k]``."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return task.output(out, yi.unsqueeze(0))[0].sum()

    rows = []
    for s in range(0, len(y), 100):
        g = vmap(grad(f), in_dims=(None, 0, 0))(params, x[s : s + 100], y[s : s + 100])
        rows.append(torch.cat([v.flatten(1) for v in g.values()], 1) @ proj)
    return torch.cat(rows).double()


def reimplemented_trak(task: Task, checkpoints: list[nn.Module], k: int) -> tuple[Tensor, float]:
    """TRAK written out from the paper: torch.func per-sample gradients of the margin (float32), a dense Gaussian
    projection per checkpoint (entries N(0, 1/k)), ``X (X^T X)^{-1} X^T``, the scores averaged over checkpoints,
    times the out-to-loss term averaged over checkpoints."""
    start = time.perf_counter()
    total = torch.zeros(task.x_test.shape[0], task.n, dtype=torch.float64)
    q_mean = torch.zeros(task.n, dtype=torch.float64)
    for c, model in enumerate(checkpoints):
        gen = torch.Generator().manual_seed(1000 + c)
        size = sum(p.numel() for p in model.parameters())
        proj = torch.randn(size, k, generator=gen) / math.sqrt(k)
        phi = _margin_features(task, model, proj, task.x, task.y)
        phi_test = _margin_features(task, model, proj, task.x_test, task.y_test)
        with torch.no_grad():
            q_mean += task.output(model(task.x), task.y)[1].double()
        total += phi_test @ torch.linalg.solve(phi.T @ phi, phi.T)
    score = total / len(checkpoints) * (q_mean / len(checkpoints))
    return score, time.perf_counter() - start


TRAKER_SCRIPT = r'''
import json, math, sys, time, pickle, tempfile
import torch
from torch import nn
from trak import TRAKer
from trak.modelout_functions import AbstractModelOutput

torch.set_num_threads(int(sys.argv[3]))
payload = pickle.load(open(sys.argv[1], "rb"))
task, k = payload["task"], payload["k"]

class LMMargin(AbstractModelOutput):
    """The same output as pergrad's lm_margin: the summed token margins, Q the tokens' mean of 1 - p."""
    def __init__(self):
        super().__init__()
    def get_output(self, model, weights, buffers, ids, targets):
        logits = torch.func.functional_call(model, (weights, buffers), ids.unsqueeze(0))[0]
        correct = logits.gather(1, targets[:, None]).squeeze(1)
        others = logits.masked_fill(torch.arange(logits.shape[1]) == targets[:, None], -torch.inf).logsumexp(1)
        return (correct - others).sum()
    def get_out_to_loss_grad(self, model, weights, buffers, batch):
        ids, targets = batch
        logits = torch.func.functional_call(model, (weights, buffers), ids)
        p = logits.softmax(-1).gather(2, targets[..., None]).squeeze(2)
        return (1 - p).mean(1, keepdim=True).clone().detach()

model = payload["model"]
x, y, xt, yt = payload["x"], payload["y"], payload["x_test"], payload["y_test"]
start = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    out = "image_classification" if task == "digits" else LMMargin()
    traker = TRAKer(model=model, task=out, train_set_size=len(y), save_dir=tmp, device="cpu", proj_dim=k,
                    projector_seed=payload["seed"], logging_level=40)
    for mid, state in enumerate(payload["states"]):
        traker.load_checkpoint(state, model_id=mid)
        for s in range(0, len(y), payload["batch"]):
            traker.featurize(batch=(x[s:s + payload["batch"]], y[s:s + payload["batch"]]),
                             num_samples=len(y[s:s + payload["batch"]]))
    traker.finalize_features()
    for mid, state in enumerate(payload["states"]):
        traker.start_scoring_checkpoint(exp_name="test", checkpoint=state, model_id=mid, num_targets=len(yt))
        for s in range(0, len(yt), payload["batch"]):
            traker.score(batch=(xt[s:s + payload["batch"]], yt[s:s + payload["batch"]]),
                         num_samples=len(yt[s:s + payload["batch"]]))
    scores = traker.finalize_scores(exp_name="test")
    seconds = time.perf_counter() - start
    torch.save({"scores": torch.as_tensor(scores).T.contiguous(), "seconds": seconds}, sys.argv[2])
'''


def run_traker(
    python: str, task: Task, checkpoints: list[nn.Module], k: int, threads: int, seed: int = 0
) -> tuple[Tensor, float] | str:
    import pickle

    with tempfile.TemporaryDirectory() as tmp:
        payload = {
            "task": task.name,
            "k": k,
            "model": task.make(0),
            "states": [m.state_dict() for m in checkpoints],
            "x": task.x,
            "y": task.y,
            "x_test": task.x_test,
            "y_test": task.y_test,
            "batch": task.batch,
            "seed": seed,
        }
        (Path(tmp) / "in.pkl").write_bytes(pickle.dumps(payload))
        (Path(tmp) / "run.py").write_text(TRAKER_SCRIPT)
        done = subprocess.run(
            [python, str(Path(tmp) / "run.py"), str(Path(tmp) / "in.pkl"), str(Path(tmp) / "out.pt"), str(threads)],
            capture_output=True,
            text=True,
            cwd=str(HERE.parent / "examples"),  # the pickled TinyLM's module is importable from there
            env={"PYTHONPATH": f"{HERE.parent}:{HERE.parent / 'examples'}", "PATH": "/usr/bin:/bin"},
        )
        if done.returncode != 0:
            return f"traker failed: {done.stderr[-1500:]}"
        out = torch.load(Path(tmp) / "out.pt")
        return out["scores"].double(), float(out["seconds"])


def tracin_fidelity(task: Task, checkpoints: list[nn.Module], exact: Tensor, ks: list[int]) -> list[dict[str, Any]]:
    """How much of exact TracIn's top 5 (unprojected float64 gradients) each kind and k recovers: the mean over
    test samples of ``|top5(projected) & top5(exact)|``, the Spearman correlation of each test sample's scores
    with the exact ones (averaged), and the time of the features and scores."""
    want = exact.topk(5, dim=1).indices
    rows = []
    with tempfile.TemporaryDirectory(prefix="pergrad-fidelity-") as tmp:
        for kind in ("kron", "sjlt", "dense"):
            for k in ks:
                score, seconds = run_pergrad(
                    task, checkpoints, Path(tmp), f"{kind}{k}", k=k, kind=kind, what="loss", preconditioner="identity"
                )
                got = score.topk(5, dim=1).indices
                overlap = (got.unsqueeze(2) == want.unsqueeze(1)).any(2).sum(1).double().mean()
                rho = spearman(score.double(), exact, dim=1).mean()
                rows.append({"kind": kind, "k": k, "top5": float(overlap), "spearman": float(rho), "seconds": seconds})
                print(
                    f"  tracin top 5, {kind:5} k={k:5}: {float(overlap):.2f} of 5, Spearman {float(rho):.3f}, "
                    f"{seconds:5.2f} s",
                    flush=True,
                )
    return rows


def versus_traker(per_test: dict[str, Tensor], ks: list[int], draws: int = 4000) -> list[dict[str, Any]]:
    """Each TRAK-mode row against traker at the same k, on the same checkpoints and ground truth: the difference
    of their LDS (means over seeds), its standard error over projection seeds (``sqrt(sd_a^2 / N_a + sd_b^2 /
    N_b)``; absent with one seed), paired over test samples (``d_t``: the two rows' per-test LDS, each averaged
    over seeds: ``sd(d) / sqrt(tests)``), and a 95% interval of a bootstrap that redraws both the seeds of each
    row and the test samples (paired)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in ks:
        theirs = per_test.get(f"traker 0.3.2, k={k}")
        for label, ours in per_test.items():
            if theirs is None or not label.startswith("trak,") or not label.endswith(f"k={k}"):
                continue
            valid = ~(ours.isnan().any(0) | theirs.isnan().any(0))  # test samples both rows define
            a, b = ours[:, valid].double(), theirs[:, valid].double()
            d = a.mean(0) - b.mean(0)
            seeds_a, seeds_b = a.mean(1), b.mean(1)
            pick_a = torch.randint(a.shape[0], (draws, a.shape[0]), generator=gen)
            pick_b = torch.randint(b.shape[0], (draws, b.shape[0]), generator=gen)
            tests = torch.randint(a.shape[1], (draws, a.shape[1]), generator=gen)
            boot = torch.stack(
                [a[pick_a[i]][:, tests[i]].mean() - b[pick_b[i]][:, tests[i]].mean() for i in range(draws)]
            )
            low, high = boot.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            spread = None
            if a.shape[0] > 1 and b.shape[0] > 1:
                spread = math.sqrt(float(seeds_a.var()) / a.shape[0] + float(seeds_b.var()) / b.shape[0])
            rows.append(
                {
                    "row": label,
                    "versus": f"traker 0.3.2, k={k}",
                    "seeds": [a.shape[0], b.shape[0]],
                    "tests": int(valid.sum()),
                    "difference": float(d.mean()),
                    "se_over_seeds": spread,
                    "se_paired_over_tests": float(d.std() / math.sqrt(d.numel())),
                    "bootstrap_95": [low, high],
                }
            )
    return rows


# -- the benchmark -------------------------------------------------------------------------------------------------


def run_task(task: Task, args: argparse.Namespace, ks: list[int]) -> dict[str, Any]:
    t0 = time.perf_counter()
    masks = subsets(task.n, args.models, seed=1)

    def train_on(idx: Tensor) -> nn.Module:
        seed = int(idx[:8].sum()) + len(idx)  # a seed per subset
        model = task.make(seed)
        task.fit(model, idx, seed)
        return model

    outputs = retrain(masks, train_on, task.measure)
    truth_seconds = time.perf_counter() - t0
    checkpoints = []
    for c in range(args.checkpoints):
        model = task.make(10_000 + c)
        task.fit(model, torch.arange(task.n), 10_000 + c)
        checkpoints.append(model)
    with torch.no_grad():
        accuracy = None
        if task.name == "digits":
            accuracy = float(
                sum((m(task.x_test).argmax(1) == task.y_test).float().mean() for m in checkpoints) / len(checkpoints)
            )
    results: dict[str, dict[str, Any]] = {}
    fidelity: list[dict[str, Any]] = []
    per_test: dict[str, Tensor] = {}  # label -> [seeds, tests] the LDS of each test sample, for each seed

    def record(label: str, found: tuple[Tensor, float] | str, **extra: Any) -> None:
        if isinstance(found, str):
            results[label] = {"error": found}
            print(f"  {label}: {found[:300]}", flush=True)
            return
        outcome = evaluate(found[0], masks, outputs, found[1], **extra)
        results[label] = {"lds": outcome.lds, "sem": outcome.sem, "seconds": outcome.seconds, **outcome.extra}
        print(f"  {label:42} LDS {outcome.lds:.3f} +- {outcome.sem:.3f}   {outcome.seconds:6.2f} s", flush=True)

    def sweep(label: str, run: Callable[..., tuple[Tensor, float] | str]) -> None:
        """``run(seed)`` for each of ``--seeds`` projection seeds, on the same checkpoints and ground truth: one
        row (one seed), or the mean and sd over seeds with each seed's row."""
        rows, tests = [], []
        for seed in range(args.seeds):
            found = run(seed=seed)
            if isinstance(found, str) or args.seeds == 1:
                record(label, found)
                if not isinstance(found, str):
                    per_test[label] = lds(found[0], masks, outputs)[None]
                return
            outcome = evaluate(found[0], masks, outputs, found[1])
            rows.append({"seed": seed, "lds": outcome.lds, "sem": outcome.sem, "seconds": outcome.seconds})
            tests.append(lds(found[0], masks, outputs))
            print(
                f"  {label + f', seed {seed}':42} LDS {outcome.lds:.3f} +- {outcome.sem:.3f}   {outcome.seconds:6.2f} s"
            )
        values = torch.tensor([r["lds"] for r in rows], dtype=torch.float64)
        results[label] = {
            "lds": float(values.mean()),
            "sd": float(values.std()),  # over seeds
            "sem": sum(r["sem"] for r in rows) / len(rows),  # over test samples, averaged over seeds
            "seconds": float(torch.tensor([r["seconds"] for r in rows]).median()),
            "seeds": rows,
        }
        per_test[label] = torch.stack(tests)
        print(f"  {label:42} LDS {values.mean():.3f} sd {values.std():.3f} over {len(rows)} seeds", flush=True)

    methods = set(args.methods.split(","))
    with tempfile.TemporaryDirectory(prefix="pergrad-lds-") as tmp:
        root = Path(tmp)
        for k in ks:
            kinds = (
                ("kron", "float16", "dense", "sjlt") if task.name == "digits" or not args.quick else ("kron", "float16")
            )
            for kind in [kind for kind in kinds if ("float16" if kind == "float16" else "trak") in methods]:
                label = f"trak, kron, float16, k={k}" if kind == "float16" else f"trak, {kind}, k={k}"
                sweep(
                    label,
                    functools.partial(
                        run_pergrad,
                        task,
                        checkpoints,
                        root,
                        f"trak-{kind}-{k}",
                        k=k,
                        kind="kron" if kind == "float16" else kind,
                        dtype=torch.float16 if kind == "float16" else torch.float32,
                    ),
                )
            if args.traker_python and "traker" in methods:
                sweep(
                    f"traker 0.3.2, k={k}",
                    functools.partial(run_traker, args.traker_python, task, checkpoints, k, args.threads),
                )
            if "loss" not in methods:
                continue
            record(
                f"gram (loss), kron, k={k}",
                run_pergrad(task, checkpoints, root, f"gram{k}", k=k, what="loss", preconditioner="gram"),
            )
            record(
                f"gram (loss), kron, one seed, k={k}",
                run_pergrad(
                    task, checkpoints, root, f"gram1-{k}", k=k, what="loss", preconditioner="gram", one_seed=True
                ),
            )
            record(
                f"tracin, kron, k={k}",
                run_pergrad(task, checkpoints, root, f"tracin{k}", k=k, what="loss", preconditioner="identity"),
            )
        for k in ks if not args.quick and "reimplemented" in methods else ():
            record(f"trak (re-implemented), k={k}", reimplemented_trak(task, checkpoints, k))
        dims = weight_dims(checkpoints[0], args.ekfac_k)
        for sampled in (False, True) if "ekfac" in methods else ():
            label = f"ekfac{' (sampled Fisher)' if sampled else ''}, k={sum(dims.values())}"
            record(
                label, run_ekfac(task, checkpoints, root, label.replace(" ", ""), args.ekfac_k, sampled, args.damping)
            )
    if (not args.quick or task.name == "digits") and "exact" in methods:
        start = time.perf_counter()
        grads = [per_sample_grads(task, m, task.x, task.y, "loss") for m in checkpoints]
        grads_test = [per_sample_grads(task, m, task.x_test, task.y_test, "loss") for m in checkpoints]
        seconds = time.perf_counter() - start
        exact = torch.stack([gz @ g.T for g, gz in zip(grads, grads_test)]).sum(0)
        record("exact tracin (unprojected)", (exact, seconds))
        if task.name == "digits":
            fidelity = tracin_fidelity(task, checkpoints, exact, args.fidelity_k)
        record("exact influence (unprojected)", (kernel_influence(grads, grads_test, args.damping), seconds))
        del grads, grads_test
        outs = [per_sample_grads(task, m, task.x, task.y, "output") for m in checkpoints]
        outs_test = [per_sample_grads(task, m, task.x_test, task.y_test, "output") for m in checkpoints]
        with torch.no_grad():
            q = torch.stack([task.output(m(task.x), task.y)[1].double() for m in checkpoints]).mean(0)
        record("exact trak (unprojected)", (kernel_influence(outs, outs_test, args.damping, q), seconds))
    return {
        "n_train": task.n,
        "n_test": int(task.x_test.shape[0]),
        "models": args.models,
        "checkpoints": args.checkpoints,
        "test_accuracy": accuracy,
        "ground_truth_seconds": truth_seconds,
        "results": results,
        "versus_traker": versus_traker(per_test, ks),
        "tracin_top5": fidelity,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 half models, 5 checkpoints, k=128")
    parser.add_argument("--tiny", action="store_true", help="seconds: 6 half models, 2 checkpoints (tests)")
    parser.add_argument("--tasks", default="digits,lm")
    parser.add_argument("--models", type=int, default=None, help="half-data models of the ground truth")
    parser.add_argument("--checkpoints", type=int, default=None, help="full-data models every method scores from")
    parser.add_argument("--k", default=None, help="comma-separated feature counts (default 128,512; quick 128)")
    parser.add_argument("--ekfac-k", type=int, default=None, help="about this many EK-FAC features over all weights")
    parser.add_argument("--damping", type=float, default=1e-3, help="EK-FAC's and the exact influence's damping")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fidelity-k", default=None, help="k of TracIn's top-5 fidelity (default 128,256,512,1024)")
    parser.add_argument("--traker-python", help="a Python with traker 0.3.2 installed (a separate environment)")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="projection seeds 0..N-1 for the TRAK-mode rows and traker (same checkpoints and ground truth); "
        "each row then gives the mean and sd over seeds",
    )
    parser.add_argument(
        "--methods",
        default="trak,float16,traker,loss,reimplemented,ekfac,exact",
        help="comma-separated: trak (pergrad's TRAK mode), float16 (its kron rows with a float16 store), traker, loss (the loss-gradient Gram and TracIn), "
        "reimplemented, ekfac, exact (unprojected, and TracIn's top-5 fidelity)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: give at least one projection seed")
    torch.set_num_threads(args.threads)
    if args.tiny:
        args.quick = True
    default_models, default_checkpoints, default_k = (
        (6, 2, "16") if args.tiny else (40, 5, "128") if args.quick else (100, 10, "128,512")
    )
    args.models = args.models or default_models
    args.checkpoints = args.checkpoints or default_checkpoints
    ks = [int(k) for k in (args.k or default_k).split(",")]
    args.ekfac_k = args.ekfac_k or (64 if args.tiny else 640)
    args.fidelity_k = [int(k) for k in (args.fidelity_k or ("16" if args.tiny else "128,256,512,1024")).split(",")]
    device = f"cpu ({platform.processor() or platform.machine()}), {args.threads} thread(s), torch {torch.__version__}"
    print(f"device: {device}", flush=True)
    report: dict[str, Any] = {"device": device, "args": vars(args), "tasks": {}}
    builders = {"digits": digits, "lm": language_model}
    for name in args.tasks.split(","):
        task = builders[name](args.quick)
        if args.tiny:
            task = Task(
                task.name,
                task.x[:120],
                task.y[:120],
                task.x_test[:20],
                task.y_test[:20],
                task.make,
                task.fit,
                task.output,
                task.loss,
                task.sampled_loss,
                batch=50,
            )
        print(
            f"{name}: {task.n} train, {task.x_test.shape[0]} test; {args.models} half models, {args.checkpoints} checkpoints",
            flush=True,
        )
        start = time.perf_counter()
        report["tasks"][name] = run_task(task, args, ks)
        report["tasks"][name]["seconds"] = time.perf_counter() - start
    print()
    for name, found in report["tasks"].items():
        print(f"| {name} | LDS | seconds |\n|---|---|---|")
        for label, r in found["results"].items():
            cell = f"{r['lds']:.3f} ± {r['sem']:.3f}" if "lds" in r else r["error"][:60]
            if "sd" in r:
                cell = f"{r['lds']:.3f} ± {r['sd']:.3f} (sd over {len(r['seeds'])} seeds; SE {r['sem']:.3f})"
            print(f"| {label} | {cell} | {r.get('seconds', float('nan')):.2f} |")
        print()
        if found["versus_traker"]:
            print(
                "| row | minus traker | SE over seeds | SE paired over tests | bootstrap 95% |\n|---|---|---|---|---|"
            )
            for r in found["versus_traker"]:
                spread = "" if r["se_over_seeds"] is None else f"{r['se_over_seeds']:.4f}"
                low, high = r["bootstrap_95"]
                print(
                    f"| {r['row']} | {r['difference']:+.4f} | {spread} | {r['se_paired_over_tests']:.4f} | "
                    f"[{low:+.4f}, {high:+.4f}] |"
                )
            print()
        if found["tracin_top5"]:
            print("| TracIn, kind | k | of exact top 5 | Spearman | seconds |\n|---|---|---|---|---|")
            for r in found["tracin_top5"]:
                print(f"| {r['kind']} | {r['k']} | {r['top5']:.2f} | {r['spearman']:.3f} | {r['seconds']:.2f} |")
            print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
