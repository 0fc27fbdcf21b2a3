"""Adversarial cases for the one-pre-hook/one-forward-hook layer hooks (f60f869): user hooks of every kind,
a forward that raises, repeated and direct calls, checkpointing, lazy layers, copies, compile, recurrent
layers. Every case runs several steps (the detaching shortcut and the taps start after the first backward),
in float64, against a one-sample-at-a-time autograd loop on a ``copy.deepcopy`` of the model."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pergrad import PergradError, PerSampleModule, transforms
from tests.reference import assert_close, clipped_mean

B, C = 5, 0.3

Forward = Callable[[Any, Tensor], Tensor]


@pytest.fixture(autouse=True)
def float64() -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def call(m: Any, x: Tensor) -> Tensor:
    out: Tensor = m(x)
    return out


def loop_reference(model: nn.Module, fwd: Forward, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """``{name: [B, *p.shape]}``: each sample's gradient of ``(out_i - y_i)^2`` summed, one sample at a
    time through plain autograd on a deep copy of ``model`` (pergrad's hooks on it are inert)."""
    twin = copy.deepcopy(model)
    per: list[dict[str, Tensor]] = []
    for i in range(x.shape[0]):
        twin.zero_grad()
        (fwd(twin, x[i : i + 1]) - y[i : i + 1]).pow(2).sum().backward()
        per.append(
            {
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in twin.named_parameters()
                if p.requires_grad
            }
        )
    return {n: torch.stack([g[n] for g in per]) for n in per[0]}


def step(psm: PerSampleModule, fwd: Forward, x: Tensor, y: Tensor) -> None:
    psm.zero_grad()
    ((fwd(psm, x) - y).pow(2).sum() / x.shape[0]).backward()


def check(
    model: nn.Module, psm: PerSampleModule, fwd: Forward, x: Tensor, y: Tensor, clip: bool, what: str
) -> dict[str, Tensor]:
    """One step through ``psm`` checked against the loop; then an SGD update, so every step differs."""
    ref = loop_reference(model, fwd, x, y)
    step(psm, fwd, x, y)
    expected = clipped_mean(ref, C) if clip else {n: g.mean(0) for n, g in ref.items()}
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{what}: no .grad for {n}"
            assert_close(p.grad, expected[n], f"{what}: .grad of {n}")
            if psm.keep_grad_sample and not clip:
                assert_close(p.grad_sample, ref[n], f"{what}: grad_sample of {n}")
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return ref


def params_of(model: nn.Module) -> dict[tuple[int, str], Tensor | None]:
    return {(id(m), k): v for m in model.modules() for k, v in m._parameters.items()}


def assert_intact(model: nn.Module, before: dict[tuple[int, str], Tensor | None]) -> None:
    """Every ``module._parameters`` entry is the parameter it was (none left detached or tapped)."""
    now = params_of(model)
    assert now.keys() == before.keys()
    for key, p in before.items():
        assert now[key] is p, f"parameter {key[1]} was left swapped: {type(now[key]).__name__}"


def run(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    fwd: Forward = call,
    clip: bool = True,
    steps: int = 4,
    keep: bool = True,
    **options: Any,
) -> PerSampleModule:
    before = params_of(model)
    psm = PerSampleModule(model, keep_grad_sample=keep, **options)
    if clip:
        psm.register_transform("", transforms.clip_norm(C))
    for s in range(steps):
        check(model, psm, fwd, x, y, clip, f"step {s}")
        assert_intact(model, before)
    return psm


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def data(*shape: int, out: int = 3) -> tuple[Tensor, Tensor]:
    return torch.randn(B, *shape), torch.randn(B, out)


# -- user forward pre-hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [True, False])
def test_user_pre_hook_before_wrapping_rescales_the_input(keep: bool) -> None:
    torch.manual_seed(0)
    model = mlp()
    model[1].register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    run(model, *data(4), keep=keep).remove()
    run(model, *data(4), clip=False, keep=keep)


def test_user_pre_hook_with_kwargs_after_wrapping_replaces_the_input() -> None:
    torch.manual_seed(1)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    before = params_of(model)

    def replace(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return (torch.sin(args[0]),), kwargs

    model[1].register_forward_pre_hook(replace, with_kwargs=True)
    for s in range(4):
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


def test_user_pre_hook_prepended_after_wrapping_multiplies_the_input_in_place() -> None:
    torch.manual_seed(2)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    before = params_of(model)

    def triple(m: nn.Module, args: tuple[Any, ...]) -> None:
        args[0].mul_(3.0)

    model[1].register_forward_pre_hook(triple, prepend=True)
    for s in range(4):
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


# -- user forward hooks ----------------------------------------------------------------------------


def test_user_forward_hook_after_wrapping_rescales_the_output() -> None:
    torch.manual_seed(3)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    model[0].register_forward_hook(lambda m, args, out: out * 3.0)
    for s in range(4):
        check(model, psm, call, x, y, True, f"step {s}")


def test_user_always_called_kwargs_hook_before_wrapping_scales_in_place() -> None:
    torch.manual_seed(4)
    model = mlp()

    def scale(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> None:
        out.mul_(0.5)

    model[0].register_forward_hook(scale, with_kwargs=True, always_call=True)
    run(model, *data(4))


@pytest.mark.parametrize("when", [0, 2])
def test_user_forward_hook_prepended_after_wrapping_replaces_the_output(when: int) -> None:
    """torch runs a hook registered with ``prepend=True`` after wrapping before pergrad's: the output pergrad
    sees is the user's, not the layer's own. Exact numbers or an error, from any step on."""
    torch.manual_seed(5)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    for s in range(4):
        if s == when:
            model[0].register_forward_hook(lambda m, args, out: out * 3.0, prepend=True)
        check(model, psm, call, x, y, True, f"step {s}")


def test_user_forward_hook_removed_by_handle_midway() -> None:
    torch.manual_seed(6)
    model, (x, y) = mlp(), data(4)
    handle = model[1].register_forward_hook(lambda m, args, out: out * 2.0)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    for s in range(5):
        if s == 2:
            handle.remove()
        check(model, psm, call, x, y, True, f"step {s}")


# -- forwards that raise ---------------------------------------------------------------------------


class Flaky(nn.Module):
    """A Linear whose input goes wrong (a shape its weight does not take) in the steps named."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.out = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin1(x)
        h = self.lin2(h[:, :5] if self.fail else h)  # raises inside the layer's forward
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_layer_that_raises_midway_leaves_the_model_as_it_was(failing: int, keep: bool) -> None:
    torch.manual_seed(7)
    model, (x, y) = Flaky(), data(4)
    before = params_of(model)
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform("", transforms.clip_norm(C))
    for s in range(5):
        if s == failing:
            grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            model.fail = True
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
                ((psm(x) - y).pow(2).sum() / B).backward()
            model.fail = False
            assert_intact(model, before)
            for n, p in model.named_parameters():
                g = grads[n]
                assert (p.grad is None) == (g is None), n
                if g is not None:
                    assert torch.equal(p.grad, g), n
            continue
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


def test_a_user_pre_hook_that_raises_after_pergrads_puts_the_weights_back() -> None:
    torch.manual_seed(8)
    model, (x, y) = mlp(), data(4)
    before = params_of(model)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    armed = [False]

    def boom(m: nn.Module, args: tuple[Any, ...]) -> None:
        if armed[0]:
            raise ValueError("user pre-hook")

    model[1].register_forward_pre_hook(boom)
    for s in range(5):
        if s in (1, 3):
            armed[0] = True
            with pytest.raises(ValueError, match="user pre-hook"):
                psm(x)
            armed[0] = False
            assert_intact(model, before)
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


@pytest.mark.parametrize("prepend", [False, True])
def test_a_user_forward_hook_that_raises_leaves_the_next_steps_exact(prepend: bool) -> None:
    """A hook of the user's raising after the layer returned: torch calls pergrad's always-called hook
    on the exception path with the real output (prepended: pergrad's had not run yet)."""
    torch.manual_seed(9)
    model, (x, y) = mlp(), data(4)
    before = params_of(model)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    armed = [False]

    def boom(m: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
        if armed[0]:
            raise ValueError("user forward hook")

    model[1].register_forward_hook(boom, prepend=prepend)
    for s in range(5):
        if s in (1, 3):
            armed[0] = True
            with _no_warning(), pytest.raises(ValueError, match="user forward hook"):
                psm(x)
            armed[0] = False
            assert_intact(model, before)
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


class _no_warning:
    """Fails if a warning is given inside (torch turns an always-called hook's error into one)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: Any) -> None:
        self._catch.__exit__(*exc)
        assert not [str(w.message) for w in self._seen]


@pytest.mark.parametrize("layer", ["lstm", "mha"])
def test_an_all_inputs_layer_that_raises_gives_no_warning_and_stays_exact(layer: str) -> None:
    """An ``all_inputs`` layer (LSTM, MultiheadAttention) raising: pergrad's always-called hook runs
    on the exception path with no output and must not itself fail (torch would turn that into a warning)."""
    torch.manual_seed(10)
    model: nn.Module = Recurrent() if layer == "lstm" else Attention()
    x, y = torch.randn(B, 6, 4), torch.randn(B, 3)
    before = params_of(model)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    for s in range(4):
        if s == 2:
            with _no_warning(), pytest.raises((RuntimeError, AssertionError)):
                psm(torch.randn(B, 6, 5))
            assert_intact(model, before)
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


# -- repeated calls, direct calls, checkpointing ---------------------------------------------------


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(torch.tanh(self.inp(x)))
        return self.out(self.shared(torch.tanh(h)))


def test_a_layer_called_twice_per_forward() -> None:
    torch.manual_seed(11)
    run(Twice(), *data(4), steps=5)


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


def _model_of(m: Any) -> Any:
    return m.module if isinstance(m, PerSampleModule) else m


def test_direct_calls_of_submodules() -> None:
    torch.manual_seed(12)

    def fwd(m: Any, x: Tensor) -> Tensor:
        inner = _model_of(m)
        out: Tensor = inner.head(inner.backbone(x))
        return out

    run(Split(), *data(4), fwd=fwd, steps=5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    torch.manual_seed(13)
    model = Split()

    def fwd(m: Any, x: Tensor) -> Tensor:
        inner = _model_of(m)
        h = checkpoint(inner.backbone, x.requires_grad_(reentrant), use_reentrant=reentrant)
        out: Tensor = inner.head(h)
        return out

    class Wrapped(nn.Module):
        def __init__(self, inner: Split) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            return fwd(self.inner, x)

    run(Wrapped(model), *data(4), steps=4)


# -- lazy, removal, copies, transforms added later -------------------------------------------------


def test_lazy_modules_materialised_in_the_first_step() -> None:
    torch.manual_seed(14)
    model = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.LazyLinear(3))
    x, y = data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    step(psm, call, x, y)  # materialises (the reference needs the parameters)
    before = params_of(model)
    for s in range(4):
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)


def test_remove_then_wrap_again() -> None:
    torch.manual_seed(15)
    model, (x, y) = mlp(), data(4)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    psm = run(model, x, y, steps=3)
    psm.remove()
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())
    run(model, x, y, steps=3).remove()


def test_deepcopy_and_pickle_of_the_wrapped_model() -> None:
    torch.manual_seed(16)
    model, (x, y) = mlp(), data(4)
    psm = run(model, x, y, steps=2)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        twin.zero_grad()
        ((twin(x) - y).pow(2).sum() / B).backward()  # plain autograd: pergrad's hooks on it are inert
        ref = loop_reference(twin, call, x, y)
        for n, p in twin.named_parameters():
            assert_close(p.grad, ref[n].mean(0), n)
    for s in range(2, 5):
        check(model, psm, call, x, y, True, f"step {s}")
    twin_psm = copy.deepcopy(psm)
    for s in range(3):
        check(twin_psm.module, twin_psm, call, x, y, True, f"copied wrapper, step {s}")


def test_a_transform_registered_after_some_steps() -> None:
    torch.manual_seed(17)
    model, (x, y) = mlp(), data(4)
    before = params_of(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    for s in range(5):
        if s == 2:
            psm.register_transform("", transforms.clip_norm(C))
        check(model, psm, call, x, y, s >= 2, f"step {s}")
        assert_intact(model, before)


# -- process groups, compile, nesting --------------------------------------------------------------


def test_ddp_style_code_without_a_process_group() -> None:
    """Code written for DDP that guards on ``dist.is_initialized()`` (``no_sync`` absent, rank 0 alone)."""
    import torch.distributed as dist

    torch.manual_seed(18)
    assert not dist.is_initialized()
    model, (x, y) = mlp(), data(4)
    model.require_backward_grad_sync = True  # type: ignore[assignment]  # (an attribute some loops set)
    run(model, x, y, steps=4)


def test_ddp_applied_after_wrapping_with_a_single_process_group(tmp_path: Any) -> None:
    import torch.distributed as dist

    torch.manual_seed(19)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, (x, y) = mlp(), data(4)
        psm = PerSampleModule(model)
        psm.register_transform("", transforms.clip_norm(C))
        ddp = nn.parallel.DistributedDataParallel(model)
        for s in range(4):
            ref = loop_reference(model, call, x, y)
            psm.zero_grad()
            ((ddp(x) - y).pow(2).sum() / B).backward()
            expected = clipped_mean(ref, C)
            for n, p in model.named_parameters():
                assert_close(p.grad, expected[n], f"step {s}: {n}")
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
        psm.remove()
    finally:
        dist.destroy_process_group()


def test_torch_compile_of_the_wrapped_model() -> None:
    torch._dynamo.reset()
    torch.manual_seed(20)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    compiled = torch.compile(psm)
    try:
        for s in range(4):
            ref = loop_reference(model, call, x, y)
            psm.zero_grad()
            ((compiled(x) - y).pow(2).sum() / B).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad, clipped_mean(ref, C)[n], f"step {s}: {n}")
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    finally:
        torch._dynamo.reset()


def test_wrapping_a_wrapped_model_or_its_part_is_refused_and_leaves_the_outer_exact() -> None:
    torch.manual_seed(21)
    model, (x, y) = Split(), data(4)
    before = params_of(model)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    check(model, psm, call, x, y, True, "step 0")
    check(model, psm, call, x, y, True, "step 1")
    installed = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    for target in (model, model.backbone, model.head):
        with pytest.raises(PergradError, match="already"):
            PerSampleModule(target)
        assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == installed
    for s in range(2, 5):
        check(model, psm, call, x, y, True, f"step {s}")
        assert_intact(model, before)
    psm.remove()
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks


# -- layers with their own rules -------------------------------------------------------------------


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.lstm(x)[0][:, -1])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mha, self.out = nn.Linear(4, 6), nn.MultiheadAttention(6, 2, batch_first=True), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.out(self.mha(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "mha"])
def test_recurrent_and_attention_layers(kind: str) -> None:
    torch.manual_seed(22)
    if kind == "mha":
        model: nn.Module = Attention()
    else:
        model = Recurrent()
        if kind != "lstm":
            model.lstm = (nn.GRU if kind == "gru" else nn.RNN)(4, 5, batch_first=True)
    run(model, torch.randn(B, 6, 4), torch.randn(B, 3), steps=4)


class Mixed(nn.Module):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.lin(self.norm(h)).mean(1)


@pytest.mark.parametrize("length", [15, 16, 17])
def test_embedding_conv_layernorm_both_sides_of_the_positions_threshold(length: int) -> None:
    torch.manual_seed(23)
    model = Mixed(length)
    model.conv.register_forward_hook(lambda m, args, out: out * 2.0)  # before wrapping
    run(model, torch.randint(0, 7, (B, length)), torch.randn(B, 3), steps=4).remove()
    run(model, torch.randint(0, 7, (B, length)), torch.randn(B, 3), clip=False, steps=3)


def test_a_conv2d_with_an_in_place_forward_hook_prepended_after_wrapping() -> None:
    torch.manual_seed(24)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 16, 3))
    x, y = torch.randn(B, 2, 4, 4), torch.randn(B, 3)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    model[0].register_forward_hook(lambda m, args, out: out.mul_(2.0), prepend=True)
    for s in range(4):
        check(model, psm, call, x, y, True, f"step {s}")


@pytest.mark.parametrize("when", [0, 2])
def test_a_global_forward_hook_that_rescales_a_layers_output(when: int) -> None:
    """``register_module_forward_hook``: torch runs global forward hooks before every module's own, so
    pergrad runs its own ahead of them (``hooks.Ahead``) and keeps the layer's own output. The hook rescales
    the first layer's output (``out_features == 6``), in the reference's copy of the model too; registered
    before the first step and after, and taken away after the last (pergrad's global hook goes with it)."""
    torch.manual_seed(25)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    handle = None
    try:
        for s in range(4):
            if s == when:
                handle = nn.modules.module.register_module_forward_hook(
                    lambda m, args, out: out * 3.0 if isinstance(m, nn.Linear) and m.out_features == 6 else None
                )
            check(model, psm, call, x, y, True, f"step {s}")
    finally:
        if handle is not None:
            handle.remove()
    check(model, psm, call, x, y, True, "after the hook's removal")
    assert not nn.modules.module._global_forward_hooks, "pergrad's global forward hook outlived the user's"


@pytest.mark.parametrize("keep", [True, False])
def test_global_forward_hooks_that_observe_or_replace_outputs_with_two_wrappers(keep: bool) -> None:
    """A global forward hook that only reads (a profiler's) and one that replaces the output of every
    Tanh, registered in that order, with two wrapped models in one process: both exact on every step."""
    torch.manual_seed(26)
    models = [mlp(), mlp()]
    wrappers = [PerSampleModule(m, keep_grad_sample=keep) for m in models]
    seen: list[str] = []
    handles = [
        nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__)),
        nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 0.5 if isinstance(m, nn.Linear) else None
        ),
    ]
    try:
        for s in range(3):
            for model, psm in zip(models, wrappers, strict=True):
                x, y = data(4)
                check(model, psm, call, x, y, False, f"step {s}")
        assert "Linear" in seen
    finally:
        for handle in handles:
            handle.remove()
    for psm in wrappers:
        psm.remove()
    assert not nn.modules.module._global_forward_hooks


def test_a_forward_that_raises_under_a_global_forward_hook_leaves_the_model_intact() -> None:
    """A global forward hook of the user's, then a forward whose last layer raises (a wrong input width
    there): torch's error comes out, every parameter is back in place, and the next steps are exact. From
    the second step the first layer's weights run detached, so pergrad's hook (run ahead of the global one)
    is what puts them back."""
    torch.manual_seed(27)
    model, (x, y) = mlp(), data(4)
    before = params_of(model)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)
    try:
        check(model, psm, call, x, y, True, "step 0")
        model[3].register_forward_pre_hook(lambda m, args: (args[0][:, :2],) if args[0].shape[0] == 3 else None)
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            psm(x[:3])
        assert_intact(model, before)
        for s in range(1, 3):
            check(model, psm, call, x, y, True, f"step {s}")
    finally:
        handle.remove()


def test_flop_counter_mode_around_a_clipped_step() -> None:
    """``torch.utils.flop_counter.FlopCounterMode`` tracks modules with global forward hooks: a clipped step
    counted by it is exact, on every step."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(28)
    model, (x, y) = mlp(), data(4)
    psm = PerSampleModule(model)
    psm.register_transform("", transforms.clip_norm(C))
    for s in range(3):
        with FlopCounterMode(display=False) as counter:
            check(model, psm, call, x, y, True, f"step {s}")
        assert counter.get_total_flops() > 0
