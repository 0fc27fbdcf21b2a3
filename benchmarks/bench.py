"""Speed and memory of per-sample gradients: pergrad next to plain backward, torch.func, Opacus, BackPACK.

Every (workload, method) pair runs in its own subprocess, so the peak memory it reports is its own.
Each child builds the model and batch, warms up, times ``--steps`` steps (median), reads its peak
RSS, then checks its result against torch.func's per-sample gradients of the same batch.
Ratios are against the plain backward of the same run. Peers that are not installed are skipped
with a printed line. Nothing here is a test: tests only run ``--quick`` and assert nothing about time.

    python benchmarks/bench.py                      # all workloads, all methods found
    python benchmarks/bench.py --quick              # tiny shapes, no peers (CI smoke test)
    python benchmarks/bench.py --scaling            # pergrad vs plain over batch size and width
    python benchmarks/bench.py --workloads gpt2 bert  # transformers (benchmarks/transformer.py)
    python benchmarks/bench.py --methods plain torch_func_project pergrad_project_kron pergrad_project_dense \
        trak_project dattri_trak dattri_tracin logix_logra     # issue 25: projected per-sample gradients
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

OVERHEAD = ["pergrad_hooks"]  # pergrad's hooks and end-of-backward bookkeeping with no rule to run
MATERIALISE = ["torch_func", "pergrad", "opacus_hooks", "opacus_ew", "backpack"]
NORMS = ["pergrad_norms", "opacus_ghost_norms", "backpack_l2"]
CLIP = ["pergrad_clip", "opacus_ghost_clip"]
STATS = ["pergrad_stats", "pergrad_stats_trace"]  # every statistic; trace_variance alone (CABS)
# one training step on mean_i f_i + PENALTY * mean_i ||g_i||^2, its full gradient w.r.t. the parameters
PENALTY = ["torch_func_penalty", "pergrad_penalty", "pergrad_penalty_norms", "backpack_penalty", "backpack_penalty_l2"]
# PROJECT_DIM features P vec(g_i) of each sample's whole gradient (issue 25): a per-sample forward,
# backward and features per batch; the peers' own projections, each checked against its own P.
# pergrad_project_*: features AND .grad (a training step that also projects); pergrad_features_*:
# features alone (grads=False: the weights run detached, as attribution runs them, like the peers);
# _cached: the dense blocks drawn once and kept (cache_mb), not drawn again at every batch
PROJECT = [
    "torch_func_project", "pergrad_project_kron", "pergrad_project_dense",
    "pergrad_features_kron", "pergrad_features_dense", "pergrad_features_dense_cached", "pergrad_features_sjlt",
    "trak_project", "dattri_trak", "dattri_tracin", "logix_logra",
]  # fmt: skip
METHODS = ["plain", *OVERHEAD, *MATERIALISE, *NORMS, *CLIP, *STATS, *PENALTY, *PROJECT]
PEERS = {
    "opacus": ("opacus_hooks", "opacus_ew", "opacus_ghost_norms", "opacus_ghost_clip"),
    "backpack": ("backpack", "backpack_l2", "backpack_penalty", "backpack_penalty_l2"),
    "trak": ("trak_project",),
    "dattri": ("dattri_trak", "dattri_tracin"),
    "logix": ("logix_logra",),
}
CLIP_NORM = 1.0
PENALTY_WEIGHT = 1.0  # lam: as large as the loss's own gradient, so the check sees a wrong penalty term
PROJECT_DIM = 512  # k of the tables (Kronecker: 16 x 32)
QUICK_PROJECT_DIM = 64  # --quick (8 x 8): the dense rows' cost is proportional to k
PROJECT_SEED = 0
PROJECT_CACHE_MB = 4096  # pergrad_features_dense_cached: room for every dense block (the mlp's: 1.3 GiB in float32)
LOGRA_RANK = 23  # LoGra's r x r features per layer: 529, the nearest square to PROJECT_DIM
# float32 features against float64 ones of the same P, relative to the largest: round-off, as for every
# other check here (the cnn's first conv sums 1024 positions with cancellation: torch.func's own
# float32 gradients are off by 3e-3 there; pergrad's features in float64 agree to 2e-15)
PROJECT_TOL = 1e-2


class Unsupported(Exception):
    """A peer cannot compute a method's quantity on a workload (the child reports it as skipped, with why)."""


# -- workloads -------------------------------------------------------------------------------------


def build(workload: str, quick: bool, batch: int | None = None, width: int | None = None) -> tuple[Any, Any, Any]:
    """``(model, x, y)`` for a workload; float32, fixed seed."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if workload == "mlp":
        w = width or (32 if quick else 512)
        b = batch or (16 if quick else 256)
        model = nn.Sequential(nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
        return model, torch.randn(b, 784), torch.randint(0, 10, (b,))
    if workload == "cnn":
        b = batch or (8 if quick else 64)
        c1, c2 = (4, 8) if quick else (32, 64)
        model = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(c2 * 64, 128), nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip
        return model, torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))
    if workload == "seq":
        b, t, vocab, d = (batch or 4, 8, 100, 16) if quick else (batch or 32, 64, 5000, 128)

        class Seq(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb, self.norm1 = nn.Embedding(vocab, d), nn.LayerNorm(d)
                self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
                self.norm2, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

            def forward(self, idx: torch.Tensor) -> torch.Tensor:
                h = self.norm2(self.down(F.gelu(self.up(self.norm1(self.emb(idx))))))
                return self.head(h.mean(1))

        return Seq(), torch.randint(0, vocab, (b, t)), torch.randint(0, 10, (b,))
    if workload == "resnet":
        b, c, size = (batch or 4, 8, 8) if quick else (batch or 32, 32, 16)

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1, self.norm1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(8, c)
                self.conv2, self.norm2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.GroupNorm(8, c)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out = torch.relu_(self.norm1(self.conv1(x)))
                out = self.norm2(self.conv2(out))
                out += x
                return torch.relu_(out)

        model = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.GroupNorm(8, c), nn.ReLU(inplace=True),
            Block(), Block(), Block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10),
        )  # fmt: skip
        return model, torch.randn(b, 3, size, size), torch.randint(0, 10, (b,))
    if workload in ("gpt2", "bert"):
        import transformer

        return transformer.gpt2_stack(quick, batch) if workload == "gpt2" else transformer.tiny_bert(quick, batch)
    raise ValueError(f"unknown workload {workload!r}")


# -- methods: each returns (step, result); result() gives what is checked against torch.func ----------


def pergrad_for(model: Any, kind: str) -> Any:
    """The wrapper a pergrad row measures (``bench.py``, ``flops.py``, ``held.py``), by ``kind``:

    - ``hooks``: every hook runs and each backward's bookkeeping is done (the layers' kept inputs
      and output gradients collected, the end-of-backward pass over them), but nothing asks for a
      per-sample quantity, so no rule runs and .grad stays autograd's: pergrad's fixed cost;
    - ``materialise``: ``grad_sample``; ``norms``: every per-sample norm; ``clip``: flat clipping of
      the whole model at ``CLIP_NORM``; ``stats``: every statistic; ``stats_trace``: ``trace_variance``;
    - ``penalty``: ``grad_sample`` (for a penalty built from it); ``penalty_norms``: the per-sample
      norms without materialising (a penalty built from ``per_sample_norms()``);
    - ``..._lean``: the same, with lean forwards (``lean_forwards=True``).
    """
    from pergrad import PerSampleModule, transforms

    lean = kind.endswith("_lean")
    kind = kind.removesuffix("_lean")
    stats: bool | set[str] = {"trace_variance"} if kind == "stats_trace" else kind == "stats"
    psm = PerSampleModule(
        model,
        keep_grad_sample=kind in ("materialise", "penalty"),
        track_norms=kind in ("norms", "penalty_norms"),
        track_statistics=stats,
        lean_forwards=lean,
    )
    if kind == "clip":
        psm.register_transform(model, transforms.clip_norm(CLIP_NORM))
    return psm


def squared_norms_mean(per_sample: Any) -> Any:
    """``mean_i ||g_i||^2`` over every tensor of ``per_sample`` (each ``[B, ...]``): the penalty."""
    import torch

    return torch.stack([g.flatten(1).square().sum(1) for g in per_sample]).sum(0).mean()


def penalty_step(params: dict[str, Any], penalty: Any) -> None:
    """The rest of a penalty step once a backward with ``create_graph=True`` has left the mean loss's
    gradient (with its graph) in ``.grad``: ``.grad`` becomes that gradient plus ``PENALTY_WEIGHT``
    times the penalty's gradient, detached, as an optimizer step reads it."""
    import torch

    plist = list(params.values())
    found = torch.autograd.grad(PENALTY_WEIGHT * penalty, plist)
    with torch.no_grad():
        for p, g in zip(plist, found, strict=True):
            p.grad = p.grad.detach() + g


def setup(
    method: str, model: Any, x: Any, y: Any, project_dim: int = PROJECT_DIM
) -> tuple[Callable[[], None], Callable[[], tuple[str, dict[str, Any]]]]:
    import torch
    import torch.nn.functional as F

    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    b = x.shape[0]

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    def full_grad() -> tuple[str, dict[str, Any]]:
        return "penalty_grad", {n: params[n].grad for n in names}

    if method in PROJECT:
        return setup_projection(method, model, x, y, project_dim)

    if method == "plain":

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss_of(model(x)).backward()

        return step, lambda: ("mean_grad", {n: params[n].grad for n in names})

    if method == "torch_func":
        from torch.func import functional_call, grad, vmap

        detached = {k: v.detach() for k, v in params.items()}

        def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_sample = vmap(grad(one), in_dims=(None, 0, 0))
        box: dict[str, Any] = {}

        def step() -> None:
            box["g"] = per_sample(detached, x, y)

        return step, lambda: ("grad_sample", box["g"])

    if method == "torch_func_penalty":
        from torch.func import functional_call, grad, grad_and_value, vmap

        detached = {k: v.detach() for k, v in params.items()}

        def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        per_sample = vmap(grad_and_value(one), in_dims=(None, 0, 0))

        def objective(p: dict[str, torch.Tensor]) -> torch.Tensor:
            g, losses = per_sample(p, x, y)  # the losses come with the gradients: no second forward
            return losses.mean() + PENALTY_WEIGHT * squared_norms_mean(g.values())

        full = grad(objective)
        box = {}

        def step() -> None:
            box["g"] = full(detached)

        return step, lambda: ("penalty_grad", box["g"])

    if method in ("pergrad_penalty", "pergrad_penalty_norms"):
        kind = method.removeprefix("pergrad_")
        psm = pergrad_for(model, kind)

        def step() -> None:
            psm.zero_grad()
            loss_of(psm(x)).backward(create_graph=True)
            if kind == "penalty":
                penalty = squared_norms_mean(params[n].grad_sample for n in names)
            else:
                penalty = torch.stack([v.square() for v in psm.per_sample_norms().values()]).sum(0).mean()
            penalty_step(params, penalty)

        return step, full_grad

    if method.startswith("pergrad"):
        psm = pergrad_for(model, method.removeprefix("pergrad").lstrip("_") or "materialise")
        kind = method.removeprefix("pergrad").lstrip("_").removesuffix("_lean") or "materialise"
        box = {}

        def step() -> None:
            psm.zero_grad()
            loss_of(psm(x)).backward()
            if kind == "norms":  # what a user reads each step
                box["read"] = psm.per_sample_norms()
            elif kind.startswith("stats"):
                box["read"] = psm.statistics().trace_variance

        def result() -> tuple[str, dict[str, Any]]:
            if kind == "hooks":
                return "mean_grad", {n: params[n].grad for n in names}
            if kind == "materialise":
                return "grad_sample", {n: params[n].grad_sample for n in names}
            if kind == "norms":
                return "norms", psm.per_sample_norms()
            if kind == "clip":
                return "clipped_grad", {n: params[n].grad for n in names}
            if kind == "stats_trace":
                return "trace_variance", {"all": psm.statistics().trace_variance}
            found = psm.statistics()
            return "second_moment", {n: found.params[n].second_moment for n in names}

        return step, result

    if method in ("opacus_hooks", "opacus_ew"):
        from opacus.grad_sample.utils import get_gsm_class

        gsm = get_gsm_class(method.split("_")[1])(model, loss_reduction="mean")

        def step() -> None:
            gsm.zero_grad(set_to_none=True)
            for p in params.values():
                p.grad_sample = None
            loss_of(gsm(x)).backward()

        return step, lambda: ("grad_sample", {n: params[n].grad_sample for n in names})

    if method in ("opacus_ghost_norms", "opacus_ghost_clip"):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(
            model, max_grad_norm=CLIP_NORM, use_ghost_clipping=True, loss_reduction="mean"
        )
        clip = method.endswith("clip")
        box = {}

        def step() -> None:
            gsm.zero_grad(set_to_none=True)
            losses = F.cross_entropy(gsm(x), y, reduction="none")
            losses.mean().backward(retain_graph=clip)
            norms = gsm.get_norm_sample()
            box["norms"] = norms
            if clip:  # the second, reweighted backward of ghost clipping
                coef = gsm.get_clipping_coef()
                gsm.zero_grad(set_to_none=True)
                gsm.disable_hooks()
                (losses * coef).sum().div(b).backward()
                gsm.enable_hooks()

        def result() -> tuple[str, dict[str, Any]]:
            if clip:
                return "clipped_grad", {n: params[n].grad for n in names}
            return "total_norms", {"all": box["norms"]}

        return step, result

    if method in ("backpack", "backpack_l2"):
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad, BatchL2Grad

        extended = extend(model)
        lossfn = extend(torch.nn.CrossEntropyLoss())
        extension = BatchGrad() if method == "backpack" else BatchL2Grad()

        def step() -> None:
            extended.zero_grad(set_to_none=True)
            with backpack(extension):
                lossfn(extended(x), y).backward()

        def result() -> tuple[str, dict[str, Any]]:
            if method == "backpack":  # BackPACK stores g_i / B with reduction="mean"
                return "grad_sample", {n: getattr(params[n], "grad_batch", None) for n in names} | {"_scale": b}
            return "sq_norms_scaled", {n: getattr(params[n], "batch_l2", None) for n in names} | {"_scale": b * b}

        return step, result

    if method in ("backpack_penalty", "backpack_penalty_l2"):
        # under backward(create_graph=True) both BatchGrad's grad_batch and BatchL2Grad's batch_l2 carry a graph
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad, BatchL2Grad

        extended = extend(model)
        lossfn = extend(torch.nn.CrossEntropyLoss())
        l2 = method.endswith("l2")
        extension, attr = (BatchL2Grad(), "batch_l2") if l2 else (BatchGrad(), "grad_batch")

        def step() -> None:
            extended.zero_grad(set_to_none=True)
            for p in params.values():
                if hasattr(p, attr):
                    delattr(p, attr)
            with backpack(extension):
                lossfn(extended(x), y).backward(create_graph=True)
            found = [getattr(params[n], attr, None) for n in names]
            if any(f is None for f in found):
                missing = [n for n, f in zip(names, found, strict=True) if f is None]
                kinds = sorted({type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in missing})
                raise Unsupported(
                    f"BackPACK's {type(extension).__name__} leaves out {', '.join(missing)} "
                    f"(it has no rule for {', '.join(kinds)}): the penalty would miss them"
                )
            # with reduction="mean" BackPACK's g_i is the sample's gradient / B: mean_i ||g_i||^2 is
            # B^2 times the mean of its squared norms (batch_l2 holds those squared norms, [B] each)
            sq = torch.stack(found).sum(0) if l2 else torch.stack([f.flatten(1).square().sum(1) for f in found]).sum(0)
            penalty_step(params, b * b * sq.mean())

        return step, full_grad

    raise ValueError(f"unknown method {method!r}")


# -- projected per-sample gradients (issue 25) -----------------------------------------------------------


def pergrad_projectors(
    model: Any, kind: str, dim: int = PROJECT_DIM, seed: int = PROJECT_SEED
) -> Callable[[dict[str, Any]], Any]:
    """``g -> sum_p P_p vec(g_i(p))`` with pergrad's own blocks ``P_p`` of the whole model (regenerated by
    ``pergrad.attribution.projectors`` from the seed, each parameter's name and shape): the projection that
    ``register_projection(model, dim=dim, kind=kind, seed=seed)`` computes, applied to given
    per-sample gradients ``{name: [B, *shape]}`` in their dtype."""
    from pergrad.attribution.projectors import Projector, Spec

    spec = Spec(dim, kind, seed)
    blocks = {n: Projector(spec, n, tuple(p.shape)) for n, p in model.named_parameters()}

    def project(per_sample: dict[str, Any]) -> Any:
        return sum(blocks[n].apply(g) for n, g in per_sample.items())

    return project


def setup_projection(
    method: str, model: Any, x: Any, y: Any, dim: int = PROJECT_DIM
) -> tuple[Callable[[], None], Callable[[], tuple[str, dict[str, Any]]]]:
    """A ``PROJECT`` method: each step is the forward, the backward and ``dim`` features of each
    sample's gradient; its result is ``("projection", {"features": [B, k], "_project": P})`` where
    ``P`` maps per-sample gradients ``{name: [B, *shape]}`` to the features the method should have
    found (its own random projection, regenerated), so the check is exact, not statistical."""
    import torch
    import torch.nn.functional as F

    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    b = x.shape[0]
    box: dict[str, Any] = {}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call

        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def projection() -> tuple[str, dict[str, Any]]:
        return "projection", {"features": box["features"], "_project": box["project"]}

    if method == "torch_func_project":
        # vmap(grad) of every parameter, then the dense Gaussian P of pergrad_project_dense (the same
        # blocks, drawn the same way): the two differ only in how g_i is found
        from torch.func import grad, vmap

        detached = {k: v.detach() for k, v in params.items()}
        per_sample = vmap(grad(one), in_dims=(None, 0, 0))
        box["project"] = pergrad_projectors(model, "dense", dim)

        def step() -> None:
            box["features"] = box["project"](per_sample(detached, x, y))

        return step, projection

    if method.startswith(("pergrad_project_", "pergrad_features_")):
        from pergrad import PerSampleModule

        kind = method.split("_")[2]
        psm = PerSampleModule(model, keep_grad_sample=False)
        psm.register_projection(
            model, dim=dim, kind=kind, seed=PROJECT_SEED, grads=method.startswith("pergrad_project_"),
            cache_mb=PROJECT_CACHE_MB if method.endswith("_cached") else 0,
        )  # fmt: skip
        box["project"] = pergrad_projectors(model, kind, dim)

        def step() -> None:
            psm.zero_grad()
            F.cross_entropy(psm(x), y).backward()
            box["features"] = psm.per_sample_projections()[""]

        return step, projection

    if method == "trak_project":
        # TRAKer.featurize's features without its disk store and out-to-loss terms: its
        # FunctionalGradientComputer (vmap(grad)) then its CPU projector (BasicProjector, Gaussian,
        # regenerated block by block at every batch), divided by sqrt(#params) as featurize does
        import tempfile

        from trak import TRAKer
        from trak.modelout_functions import AbstractModelOutput

        class CrossEntropy(AbstractModelOutput):  # the loss of every other row, not TRAK's margin
            def __init__(self) -> None:
                super().__init__()

            @staticmethod
            def get_output(model: Any, weights: Any, buffers: Any, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
                out = torch.func.functional_call(model, (weights, buffers), (xi.unsqueeze(0),))
                return F.cross_entropy(out, yi.unsqueeze(0))

            def get_out_to_loss_grad(self, model: Any, weights: Any, buffers: Any, batch: Any) -> torch.Tensor:
                return torch.ones(batch[0].shape[0], 1)

        traker = TRAKer(
            model=model, task=CrossEntropy(), train_set_size=b, save_dir=tempfile.mkdtemp(prefix="trak-"),
            device="cpu", proj_dim=dim, use_half_precision=False, projector_seed=PROJECT_SEED,
            logging_level=40,
        )  # fmt: skip
        scale = traker.normalize_factor

        def step() -> None:
            grads = traker.gradient_computer.compute_per_sample_grad(batch=(x, y))
            box["features"] = traker.projector.project(grads, model_id=0) / scale

        def trak_project(per_sample: dict[str, Any]) -> Any:
            found = {n: g.float() for n, g in per_sample.items()}
            return traker.projector.project(found, model_id=0).double() / scale.double()

        box["project"] = trak_project
        return step, projection

    if method in ("dattri_trak", "dattri_tracin"):
        # the featurization of TRAKAttributor.cache / TracInAttributor.attribute for one batch: vmap(grad)
        # of the flattened parameters, a new random_project projector (normal, on the CPU), its
        # features; TRAK also divides by sqrt(#params) and computes each sample's 1 - p(correct)
        from dattri.func.projection import random_project
        from dattri.task import AttributionTask

        def loss(p: Any, data: Any) -> torch.Tensor:
            xi, yi = data
            return F.cross_entropy(torch.func.functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        task = AttributionTask(loss_func=loss, model=model, checkpoints=model.state_dict())
        grad_loss = task.get_grad_loss_func(in_dims=(None, 0))
        flat, _ = task.get_param(ckpt_idx=0)
        kwargs = {"proj_dim": dim, "proj_max_batch_size": 32, "proj_seed": PROJECT_SEED, "device": "cpu"}
        trak = method == "dattri_trak"
        scale = math.sqrt(flat.numel()) if trak else 1.0
        if trak:
            probability = torch.func.vmap(
                lambda p, data: torch.exp(-loss(p, data)), in_dims=(None, 0), randomness="different"
            )

        def step() -> None:
            g = torch.nan_to_num(grad_loss(flat, (x, y))) / scale
            box["features"] = random_project(g, b, **kwargs)(g, ensemble_id=0)
            if trak:
                box["q"] = 1 - probability(dict(model.named_parameters()), (x, y)).flatten()

        def dattri_project(per_sample: dict[str, Any]) -> Any:
            g = torch.cat([per_sample[n].flatten(1) for n in names], 1).float() / scale
            return random_project(g, b, **kwargs)(g, ensemble_id=0).double()

        box["project"] = dattri_project
        return step, projection

    if method == "logix_logra":
        return setup_logra(model, x, y)

    raise ValueError(f"unknown method {method!r}")


def setup_logra(model: Any, x: Any, y: Any) -> tuple[Callable[[], None], Callable[[], tuple[str, dict[str, Any]]]]:
    """LogIX's LoGra: ``add_lora`` puts an encoder ``A`` ``[r, in]``, a zero bottleneck ``B`` ``[r, r]`` and
    a decoder ``C`` ``[out, r]`` beside every Linear and Conv2d, and logs the per-sample gradient of
    ``B``, ``C^T g_i A^T``: ``r x r`` features per layer (concatenated, not summed), of the weights of
    Linear and Conv2d only (no biases, embeddings or norms)."""
    import tempfile

    import torch
    import torch.nn.functional as F
    from logix import LogIX
    from logix.config import LoRAConfig

    b = x.shape[0]
    total = sum(p.numel() for p in model.parameters())
    os.chdir(tempfile.mkdtemp(prefix="logix-"))  # LogIX writes its config and LoRA weights under the cwd
    run = LogIX(project="bench")
    run.watch(model)
    run.add_lora(lora_config=LoRAConfig(rank=LOGRA_RANK))  # replaces each layer by a LoRA wrapper
    run.setup({"grad": ["log"]})
    wrapped = {
        name.removesuffix(".logix_lora_B"): model.get_submodule(name.removesuffix("logix_lora_B").rstrip("."))
        for name, _ in model.named_modules()
        if name.endswith("logix_lora_B")
    }
    if not wrapped:
        raise Unsupported("LogIX's add_lora found no Linear or Conv2d")
    box: dict[str, Any] = {}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with run(data_id=list(range(b))):
            F.cross_entropy(model(x), y).backward()
        _, log = run.get_log()
        box["features"] = torch.cat([log[f"{n}.logix_lora_B"]["grad"].reshape(b, -1) for n in wrapped], 1)

    def logra_project(per_sample: dict[str, Any]) -> Any:
        # C^T g_i A^T of each wrapped layer's weight; LogIX logs the gradient of the loss as given, the
        # mean: g_i / B
        found = []
        for n, lora in wrapped.items():
            a = lora.logix_lora_A.weight.detach().double().reshape(lora.logix_lora_A.weight.shape[0], -1)
            c = lora.logix_lora_C.weight.detach().double().reshape(lora.logix_lora_C.weight.shape[0], -1)
            g = per_sample[f"{n}.weight"]
            found.append((c.T @ g.reshape(b, g.shape[1], -1) @ a.T).reshape(b, -1) / b)
        return torch.cat(found, 1)

    covered = sum((getattr(lora, "_linear", None) or lora._conv).weight.numel() for lora in wrapped.values())
    note = f"features of {covered} of {total} parameters (Linear/Conv2d weights)"

    def result() -> tuple[str, dict[str, Any]]:
        return "projection", {"features": box["features"], "_project": logra_project, "_note": note}

    return step, result


# -- the check against torch.func -----------------------------------------------------------------------


def check(kind: str, got: dict[str, Any], model: Any, x: Any, y: Any) -> tuple[bool, float, str]:
    """Compare a method's result with the same quantity from torch.func per-sample gradients."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    if kind == "penalty_grad":
        return _compare(got, penalty_reference(model, x, y), 1)
    if kind == "projection":
        return check_projection(got, model, x, y)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    scale = got.pop("_scale", 1)
    if kind == "mean_grad":
        expected = {n: g.mean(0) for n, g in ref.items()}
    elif kind == "grad_sample":
        expected = ref
    elif kind == "norms":
        expected = {n: g.flatten(1).norm(dim=1) for n, g in ref.items()}
    elif kind in ("sq_norms_scaled",):
        expected = {n: g.flatten(1).square().sum(1) for n, g in ref.items()}
    elif kind == "total_norms":
        expected = {"all": torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()}
    elif kind == "clipped_grad":
        expected = clipped_mean(ref)
    elif kind == "trace_variance":
        expected = {"all": sum((g.square().mean(0) - g.mean(0).square()).sum() for g in ref.values())}
    elif kind == "second_moment":
        expected = {n: g.square().mean(0) for n, g in ref.items()}
    else:
        raise ValueError(kind)
    return _compare(got, expected, scale)


def clipped_mean(per_sample: dict[str, Any]) -> dict[str, Any]:
    """``(1/B) sum_i min(1, C / ||g_i||) g_i`` of every parameter, ``||g_i||`` over all of them (``C = CLIP_NORM``)."""
    import torch

    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_sample.values()]).sum(0).sqrt()
    factor = (CLIP_NORM / norms).clamp(max=1)
    return {n: (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0) for n, g in per_sample.items()}


def per_sample_reference64(model: Any, x: Any, y: Any) -> dict[str, Any]:
    """Each sample's gradient of its own loss, every parameter, from torch.func in float64."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    model64 = copy.deepcopy(model).double()
    x64 = x.double() if x.is_floating_point() else x
    params = {k: v.detach() for k, v in model64.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model64, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return dict(vmap(grad(one), in_dims=(None, 0, 0))(params, x64, y))


def check_projection(got: dict[str, Any], model: Any, x: Any, y: Any) -> tuple[bool, float, str]:
    """A method's features against its own projection ``P`` (``got["_project"]``) of torch.func's
    float64 per-sample gradients: ``max |features - P vec(g_i)| / max |P vec(g_i)|`` below
    ``PROJECT_TOL``, so a wrong gradient, a wrong sample or a wrong scale fails it."""
    features, project = got["features"], got["_project"]
    expected = project(per_sample_reference64(model, x, y))
    if features is None or tuple(features.shape) != tuple(expected.shape):
        shape = None if features is None else list(features.shape)
        return False, float("inf"), f"features {shape}, expected {list(expected.shape)}"
    worst = float((features.double() - expected).abs().max() / expected.abs().max())
    return worst < PROJECT_TOL, worst, got.get("_note", "")


def penalty_reference(model: Any, x: Any, y: Any) -> dict[str, Any]:
    """torch.func's gradient of ``mean_i f_i + PENALTY_WEIGHT * mean_i ||g_i||^2`` w.r.t. the
    parameters, in float64, returned in float32: ``grad`` of the batch loss plus the penalty of
    ``grad(f_i)`` taken one sample at a time. A loop, not ``vmap``: in torch 2.13 the batching rule of
    LayerNorm's backward is wrong under a second differentiation (pytorch/functorch#534), which
    ``torch_func_penalty`` on ``seq`` shows."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad

    model64 = copy.deepcopy(model).double()
    x64 = x.double() if x.is_floating_point() else x
    params = {k: v.detach() for k, v in model64.named_parameters()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model64, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def objective(p: dict[str, torch.Tensor]) -> torch.Tensor:
        found = [grad(one)(p, x64[i], y[i]) for i in range(x64.shape[0])]
        per_sample = [torch.stack([g[k] for g in found]) for k in p]
        loss = F.cross_entropy(functional_call(model64, p, (x64,)), y)
        return loss + PENALTY_WEIGHT * squared_norms_mean(per_sample)

    return {n: g.float() for n, g in grad(objective)(params).items()}


def _compare(got: dict[str, Any], expected: dict[str, Any], scale: float) -> tuple[bool, float, str]:
    worst, missing = 0.0, [n for n in expected if got.get(n) is None]
    # a parameter whose gradient is zero in exact arithmetic (BERT's key bias: softmax ignores a
    # shift of every key) is measured against the largest gradient, not against its own round-off
    floor = 1e-6 * max(float(e.abs().max()) for e in expected.values())
    for n, e in expected.items():
        if got.get(n) is not None:
            worst = max(worst, float((got[n].detach() * scale - e).abs().max() / (e.abs().max() + floor + 1e-12)))
    ok = not missing and worst < 1e-2  # float32 against a float32 reference: round-off grows with depth
    return ok, worst, (f"missing: {', '.join(missing)}" if missing else "")


# -- one child: time, memory, check ------------------------------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def malloc_in_use_mib() -> float | None:
    """Bytes malloc has handed out and not taken back (glibc ``mallinfo2``: small blocks and mmapped
    ones), or None where that is not glibc."""
    read = _mallinfo2()
    if read is None:
        return None
    info = read()
    return (info.uordblks + info.hblkhd) / 2**20


@functools.cache
def _mallinfo2() -> Any:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2


def malloc_peak_mib(step: Callable[[], None]) -> float | None:
    """The most memory malloc had handed out at once during one call of ``step``, read after every
    operator (CPU tensors are malloc'd): the CPU counterpart of CUDA's ``max_memory_allocated``,
    free of what resident memory adds (freed pages the allocator keeps, arenas per thread)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if malloc_in_use_mib() is None:
        return None

    class Watch(TorchDispatchMode):
        peak = 0.0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, malloc_in_use_mib() or 0.0)
            return out

    watch = Watch()
    with watch:
        step()
    return watch.peak


def first_step_peak_mib(step: Callable[[], None], device: Any) -> float | None:
    """The most memory the first call of ``step`` had allocated at once: CUDA's allocator (its peak then
    reset, so that the run's peak is the later steps'), or malloc on the CPU (``malloc_peak_mib``)."""
    import torch

    if device.type != "cuda":
        return malloc_peak_mib(step)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    return float(peak)


def device_name(device: str, threads: int) -> str:
    """What the table ran on: the CPU with the threads it used, or the accelerator's name."""
    import torch

    if device == "cpu":
        return f"cpu ({platform.machine()}, {os.cpu_count()} cores, {threads} threads)"
    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep the memory a process frees (no trimming of the heap's top, no ``mmap``
    for blocks under 32 MiB), as a caching allocator would: a step then reuses the last step's pages
    instead of faulting fresh ones in (``--keep-freed-memory``). False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(m_trim_threshold, 2**30)) and bool(libc.mallopt(m_mmap_threshold, 2**25))
    except (OSError, AttributeError):
        return False


def page_faults() -> int:
    """The process's minor page faults so far (fresh pages the kernel zeroed and mapped in)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.keep_freed_memory and not keep_freed_memory():
        return {"error": "--keep-freed-memory needs glibc's malloc"}
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    try:
        model, x, y = build(args.workload, args.quick, args.batch, args.width)
    except ImportError as err:  # bert without transformers
        return {"skipped": f"not installed ({err.name})"}
    model, x, y = model.to(device), x.to(device), y.to(device)
    # float32 convolutions, not cuDNN's default TF32: the checks against float64 are of the method, not of TF32
    # (which puts autograd's own .grad of the cnn 7e-2 off on an H200)
    torch.backends.cudnn.allow_tf32 = False
    n_params = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model)  # the check runs torch.func on a model without any library's hooks

    def wait() -> None:  # a step's time includes the device work it queued
        if cuda:
            torch.cuda.synchronize(device)

    wait()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device) / 2**20
    else:
        baseline = rss_mib()
    alloc_baseline = malloc_in_use_mib() or 0.0
    syncs = None
    try:
        step, result = setup(args.method, model, x, y, QUICK_PROJECT_DIM if args.quick else PROJECT_DIM)
        first = first_step_peak_mib(step, device)  # the first step runs the first backward's check
        for _ in range(args.warmup - 1):
            step()
        wait()
        times: list[float] = []
        cpu_times: list[float] = []  # the process's CPU time (all its threads): less moved by a shared machine
        faults: list[int] = []
        for _ in range(args.steps):
            start, cpu_start, faults_start = time.perf_counter(), time.process_time(), page_faults()
            step()
            wait()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            faults.append(page_faults() - faults_start)
            if args.budget and len(times) >= 3 and sum(times) > args.budget:
                break  # a slow method: its median of at least 3 steps
        if cuda:  # one more step, counting the host syncs CUDA reports (item, nonzero, blocking copies)
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            wait()
    except ImportError as err:
        return {"skipped": f"not installed ({err.name})"}
    except Unsupported as err:
        return {"skipped": str(err)}
    except Exception as err:  # a peer that crashes on this workload is a result, not a harness failure
        return {"error": f"{type(err).__name__}: {str(err)[:160]}"}
    if cuda:
        peak = allocated = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        allocated = malloc_peak_mib(step)  # one more step, every operator watched
    kind, got = result()
    ok, worst, note = check(kind, dict(got), reference, x, y)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "steps_timed": len(times),
        "cpu_ms": statistics.median(cpu_times) * 1e3,
        "page_faults_per_step": statistics.median(faults),  # minor faults: fresh pages mapped in
        "peak_extra_mib": peak - baseline,  # resident memory (CPU) or the CUDA allocator's
        "alloc_extra_mib": None if allocated is None else allocated - alloc_baseline,  # malloc'd (CPU)
        "first_alloc_extra_mib": None if first is None else first - (baseline if cuda else alloc_baseline),
        "analytic_mib": x.shape[0] * n_params * 4 / 2**20,
        "params": n_params,
        "batch": x.shape[0],
        "checked": kind,
        "correct": ok,
        "max_rel_err": worst,
        "note": note,
        "torch": torch.__version__,
        "device": device_name(args.device, args.threads),
        "host_syncs_per_step": syncs,  # counted on CUDA only
    }


def run_child(
    args: argparse.Namespace, workload: str, method: str, batch: int | None = None, width: int | None = None
) -> dict[str, Any]:
    cmd = [
        args.python, str(Path(__file__).resolve()), "--child", "--workload", workload, "--method", method,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
        "--device", args.device, "--budget", str(args.budget),
    ]  # fmt: skip
    if args.keep_freed_memory:
        cmd.append("--keep-freed-memory")
    if args.quick:
        cmd.append("--quick")
    if batch:
        cmd += ["--batch", str(batch)]
    if width:
        cmd += ["--width", str(width)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def _median_or_none(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def merge_rounds(runs: list[dict[str, Any]], plain: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's rounds as one result: the median of its per-round medians, and the median of its
    per-round ratios to the plain backward of the same round; correct only if every round was."""
    if "median_ms" not in runs[0]:
        return runs[0]
    ratios = [r["median_ms"] / p["median_ms"] for r, p in zip(runs, plain, strict=True)]
    return {
        **runs[0],
        "median_ms": statistics.median(r["median_ms"] for r in runs),
        "ratio_to_plain": statistics.median(ratios),
        "rounds_ms": [r["median_ms"] for r in runs],
        "cpu_ms": _median_or_none([r.get("cpu_ms") for r in runs]),
        "page_faults_per_step": _median_or_none([r.get("page_faults_per_step") for r in runs]),
        "peak_extra_mib": statistics.median(r["peak_extra_mib"] for r in runs),
        "alloc_extra_mib": _median_or_none([r.get("alloc_extra_mib") for r in runs]),
        "first_alloc_extra_mib": _median_or_none([r.get("first_alloc_extra_mib") for r in runs]),
        "correct": all(r["correct"] for r in runs),
        "max_rel_err": max(r["max_rel_err"] for r in runs),
    }


# -- the table ---------------------------------------------------------------------------------------


def _is_peer(method: str) -> bool:
    return method.startswith("torch_func") or method.split("_")[0] in PEERS


def cell(r: dict[str, Any], plain: dict[str, Any], fastest_peer: tuple[float, str] | None) -> str:
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "crash"
    ratio = r.get("ratio_to_plain", r["median_ms"] / plain["median_ms"])
    text = f"{r['median_ms']:.1f} ms ({ratio:.2f}x)"
    if fastest_peer:
        text += f", {r['median_ms'] / fastest_peer[0]:.2f}x {fastest_peer[1]}"
    if not r["correct"]:
        why = r["note"] or f"max rel err {r['max_rel_err']:.1e}"
        text += f" WRONG ({why})"
    return text


def table(results: dict[str, dict[str, dict[str, Any]]], methods: list[str]) -> str:
    workloads = list(results)
    out = ["| method | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for m in methods:
        cells = []
        for w in workloads:
            r, plain = results[w].get(m, {"skipped": ""}), results[w]["plain"]
            peers = [
                (v["median_ms"], k)
                for k, v in results[w].items()
                if _is_peer(k) and "median_ms" in v and v["correct"] and _group(k) == _group(m)
            ]
            cells.append(cell(r, plain, min(peers) if peers and m.startswith("pergrad") else None))
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    tables = (
        ("peak_extra_mib", "peak resident memory"),
        ("alloc_extra_mib", "peak allocated memory"),
        ("first_alloc_extra_mib", "first step's peak allocated memory"),
    )
    for key, what in tables:
        if key != "peak_extra_mib" and not any(r.get(key) is not None for w in workloads for r in results[w].values()):
            continue  # a run saved before it was measured, or (allocated) a CUDA run: the same numbers as the peak
        out.append("")
        out.append(f"| {what} beyond plain backward (MiB) / analytic B x #params x 4 | " + " | ".join(workloads) + " |")
        out.append("|---|" + "---|" * len(workloads))
        for m in methods[1:]:
            cells = []
            for w in workloads:
                r, plain = results[w].get(m, {}), results[w]["plain"]
                if "median_ms" in r and r.get(key) is not None and plain.get(key) is not None:
                    beyond = r[key] - plain[key]
                    cells.append(f"{beyond:.0f} / {r['analytic_mib']:.0f} ({beyond / r['analytic_mib']:.2f}x)")
                else:
                    cells.append("-")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _group(method: str) -> str:
    for group in (OVERHEAD, MATERIALISE, NORMS, CLIP, STATS, PENALTY, PROJECT):
        if method in group:
            return str(group)
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, pergrad/plain/torch.func only")
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "seq", "resnet"])
    parser.add_argument("--methods", nargs="+", default=None, help=f"subset of {METHODS}")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="run every method this many times, interleaved")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--budget", type=float, default=0.0, help="seconds of timed steps per method, at least 3 steps (0: all --steps)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N to run the same table on a GPU")
    parser.add_argument("--scaling", action="store_true", help="pergrad vs plain over batch size and width (mlp)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the children")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--keep-freed-memory", action="store_true",
        help="every child tells glibc's malloc to keep freed memory (no page faults from trimming; see keep_freed_memory)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "results" / "latest.json")
    parser.add_argument("--from-json", type=Path, help="print the tables of a saved run and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help="every workload at this batch size (default: each workload's own)")
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        first = next(iter(saved["results"].values()))
        print(f"{saved['command']}\n{saved['machine']}\ndevice: {saved.get('device', 'cpu')}\n")
        print(table(saved["results"], list(first)))
        if "scaling" in saved:
            print_scaling(saved["scaling"])
        return 0
    problem = device_problem(args.device)
    if problem:
        parser.error(problem)
    if args.quick:
        args.steps, args.warmup, args.rounds = min(args.steps, 3), min(args.warmup, 1), 1
    methods = args.methods or [m for m in METHODS if not (args.quick and m.split("_")[0] in PEERS)]
    order = ["plain", *[m for m in methods if m != "plain"]]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    device = device_name(args.device, args.threads)
    print(f"device: {device}", flush=True)
    for w in args.workloads:
        rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in order}
        for k in range(args.rounds):  # every method once per round: a slow spell hits one round of each
            for m in order:
                if k and ("skipped" in rounds[m][0] or "error" in rounds[m][0]):
                    continue
                r = run_child(args, w, m, args.batch)
                rounds[m].append(r)
                status = (
                    r.get("skipped")
                    or r.get("error")
                    or (
                        f"{r['median_ms']:.1f} ms, {r['page_faults_per_step']:.0f} page faults per step, correct={r['correct']}"
                    )
                )
                if r.get("host_syncs_per_step") is not None:
                    status += f", host syncs per step: {r['host_syncs_per_step']}"
                print(f"{w:6s} {m:20s} round {k + 1}: {status}", flush=True)
        results[w] = {m: merge_rounds(rs, rounds["plain"]) for m, rs in rounds.items()}
    report: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {args.threads} threads, python {platform.python_version()}",
        "device": device,
        "command": " ".join(["python", "benchmarks/bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "results": results,
    }
    print()
    print(table(results, ["plain", *[m for m in methods if m != "plain"]]))
    if args.scaling:
        report["scaling"] = scaling(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nsaved {args.out}")
    return 0


def device_problem(device: str) -> str | None:
    """Why the table cannot run on ``device`` (None if it can)."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        return f"--device {device!r}: {err}"
    if kind == "cpu":
        return None
    if kind != "cuda":
        return f"--device {device!r}: the benchmark runs on cpu or cuda"
    if not torch.cuda.is_available():
        return (
            f"--device {device!r}: no CUDA device is available here (torch {torch.__version__}, "
            + (f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build")
            + "); run without --device for the CPU table"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        return f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s)"
    return None


def scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    """pergrad (materialised and fused norms) vs plain on the mlp, over batch size and width."""
    series = [{"batch": b, "width": 512} for b in ((4, 16) if args.quick else (16, 64, 256, 1024))]
    series += [{"batch": 32, "width": w} for w in ((16, 64) if args.quick else (128, 512, 1024, 2048))]
    rows = []
    for point in series:
        r = {
            m: run_child(args, "mlp", m, point["batch"], point["width"]) for m in ("plain", "pergrad", "pergrad_norms")
        }
        rows.append({**point, **r})
        print(f"scaling batch {point['batch']} width {point['width']} done", flush=True)
    print_scaling(rows)
    return rows


def print_scaling(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| batch | width | plain ms | pergrad ms (x plain) | pergrad_norms ms (x plain) "
        "| pergrad peak MiB beyond plain / analytic |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        p, g, nrm = row["plain"], row["pergrad"], row["pergrad_norms"]
        print(
            f"| {row['batch']} | {row['width']} | {p['median_ms']:.1f} | {g['median_ms']:.1f} "
            f"({g['median_ms'] / p['median_ms']:.1f}x) | {nrm['median_ms']:.1f} ({nrm['median_ms'] / p['median_ms']:.2f}x) "
            f"| {g['peak_extra_mib'] - p['peak_extra_mib']:.0f} / {g['analytic_mib']:.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
