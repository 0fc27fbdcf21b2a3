"""Wrapping is all or nothing: a ``PerSampleModule(...)`` that raises leaves the model exactly as it
was (hooks, parameters, accumulate-grad hooks), so a later wrap works and trains exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import pergrad.module
from pergrad import PerSampleModule, transforms
from pergrad._core.capture.hooks import LayerHooks
from pergrad._core.parallel.distributed import World
from pergrad.errors import PergradError
from tests.reference import assert_close, reference_grad_sample, run_pergrad

CLIP = 0.1


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def state(model: nn.Module) -> dict[str, Any]:
    """Everything pergrad may install on a model, by module and parameter name."""
    found: dict[str, Any] = {}
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            found[f"{name}:{attr}"] = dict(getattr(m, attr))
        found[f"{name}:_parameters"] = dict(m._parameters)
        found[f"{name}:class"] = type(m)
    for name, p in model.named_parameters():
        found[f"{name}:hooks"] = (dict(p._backward_hooks or {}), dict(p._post_accumulate_grad_hooks or {}))
        found[f"{name}:attrs"] = sorted(vars(p))
        found[f"{name}:grad"] = p.grad
    return found


def train_exactly(model: nn.Module, psm: PerSampleModule) -> None:
    """Several steps of root clipping, changing batch sizes, each checked against torch.func."""
    psm.register_transform(model, transforms.clip_norm(CLIP))
    gen = torch.Generator().manual_seed(1)
    for step, b in enumerate((4, 2, 6, 3)):
        x = torch.randn(b, 4, generator=gen, dtype=torch.float64)
        y = torch.randn(b, 3, generator=gen, dtype=torch.float64)
        psm.zero_grad()
        run_pergrad(psm, x, y)
        ref = reference_grad_sample(model, x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
        factor = (CLIP / norms).clamp(max=1)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], f"step {step} {name}.grad_sample")
            expected = (ref[name] * factor.view(-1, *[1] * (p.dim()))).mean(0)
            assert_close(p.grad, expected, f"step {step} {name}.grad")
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad


class Broken(RuntimeError):
    pass


def _fail(*args: Any, **kwargs: Any) -> None:
    raise Broken("injected")


class FailingWorld(World):
    def install(self) -> None:
        raise Broken("injected")


@pytest.mark.parametrize("stage", ["layer hooks", "accumulate hooks", "world install"])
def test_failed_construction_leaves_the_model_as_it_was(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever step of the construction raises, after everything else was installed."""
    model = mlp()
    before = state(model)
    with monkeypatch.context() as patch:
        if stage == "layer hooks":
            patch.setattr(LayerHooks, "install", _fail)
        elif stage == "accumulate hooks":
            patch.setattr(PerSampleModule, "_install_accumulate_hooks", _fail)
        else:
            patch.setattr(pergrad.module, "world_for", lambda *args: FailingWorld())
        with pytest.raises(Broken):
            PerSampleModule(model)
    assert state(model) == before
    # the model trains as plain autograd (nothing of the failed wrapper runs) ...
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    run_pergrad(model, x, y)
    assert_close(model[0].weight.grad, reference_grad_sample(model, x, y)["0.weight"].mean(0), "plain .grad")
    model.zero_grad()
    # ... and wraps again, exactly
    psm = PerSampleModule(model)
    train_exactly(model, psm)
    psm.remove()
    assert state(model) == before | {f"{n}:grad": p.grad for n, p in model.named_parameters()}


@pytest.fixture
def one_process_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_with_a_builtin_communication_hook_is_refused_and_left_alone(one_process_group: None) -> None:
    """The world's install raises after the layers' hooks were installed: all of them go again."""
    model = mlp()
    ddp = DistributedDataParallel(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    before, attributes = state(ddp), dict(vars(ddp))
    with pytest.raises(PergradError, match="could not register its DDP communication hook"):
        PerSampleModule(ddp)
    assert state(ddp) == before and vars(ddp) == attributes
    psm = PerSampleModule(model)  # the module inside, with no DDP of pergrad's
    train_exactly(model, psm)
