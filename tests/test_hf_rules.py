"""HuggingFace ``transformers`` layers, supported by qualified class name (pergrad never imports
transformers): each rule against a per-sample autograd loop (every sample alone, its own loss),
materialised and with fused clipping; the forward of every registered class against the form its
rule assumes; whole tiny models wrapped without ``fallback``."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import pergrad  # noqa: E402
from pergrad import PerSampleModule, UnsupportedLayerError, transforms  # noqa: E402
from pergrad.registry import RuleRegistry, qualified_name  # noqa: E402
from pergrad.rules import hf  # noqa: E402
from tests.reference import assert_close  # noqa: E402
from tests.test_fused import check_statistics, flat_norms, times  # noqa: E402

Conv1D = transformers.pytorch_utils.Conv1D
ROOT = Path(__file__).resolve().parents[1]

NORM_RULES: dict[Callable[..., dict[str, torch.Tensor]], tuple[str, ...]] = {
    pergrad.rules.llama_rms_norm: hf.LLAMA_RMS_NORMS,
    pergrad.rules.olmo2_rms_norm: hf.OLMO2_RMS_NORMS,
    pergrad.rules.gemma_rms_norm: hf.GEMMA_RMS_NORMS,
    pergrad.rules.gemma3n_rms_norm: hf.GEMMA3N_RMS_NORMS,
    pergrad.rules.t5_layer_norm: hf.T5_LAYER_NORMS,
}
NORM_NAMES = [name for names in NORM_RULES.values() for name in names]
# The weight's gradient is formed in float32 inside these layers even in a float64 model, so pergrad
# and autograd agree to float32 round-off of the summed terms there: with a mean loss their output
# gradients d differ by float64 round-off (B * (d_i / B)), which can flip a float32 rounding. (With
# a sum loss they agree bit for bit: test_norm_rules_replicate_the_dtype_handling_bit_for_bit.)
FLOAT32_INSIDE = {*hf.GEMMA_RMS_NORMS, *hf.GEMMA3N_RMS_NORMS}
FLOAT32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def layer_class(name: str) -> type[nn.Module]:
    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)


class Head(nn.Module):
    """``tanh`` after the layer, so the loss is not quadratic in the layer's output."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x))


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


def autograd_loop(
    params: dict[str, nn.Parameter], sample_loss: Callable[[int], torch.Tensor], batch: int
) -> dict[str, torch.Tensor]:
    """``{name: [B, *p.shape]}``: ``d f_i / d p``, one backward of ``f_i = sample_loss(i)`` (a forward
    of sample i alone) per sample."""
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for i in range(batch):
        found = torch.autograd.grad(sample_loss(i), list(params.values()), allow_unused=True)
        for (n, p), g in zip(params.items(), found):
            grads[n].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(g) for n, g in grads.items()}


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def layer_reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-sample autograd loop on ``squared_error`` of each sample's output."""
    return autograd_loop(trainable(model), lambda i: squared_error(model(x[i : i + 1]), target[i : i + 1]), len(x))


def clip(ref: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Each sample's gradient over all of ``ref`` clipped to ``max_norm`` (``clip_norm`` on the root)."""
    factor = (max_norm / flat_norms(ref)).clamp(max=1)
    return {k: times(g, factor) for k, g in ref.items()}


def check_layer(layer: nn.Module, x: torch.Tensor, loss_reduction: str, **tolerance: float) -> None:
    """``grad_sample`` and ``.grad`` (materialised); then, without ``grad_sample``, the fused root
    clipping (``.grad`` is the mean of the clipped reference ``g_i``), norms and statistics over two
    backward passes (the second runs with the transformed weight detached)."""

    def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        if tolerance:
            torch.testing.assert_close(actual, expected, **tolerance, msg=lambda m: f"{what}: {m}")
        else:
            assert_close(actual, expected, what)

    model = Head(layer)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = layer_reference(model, x, target)

    def loss(psm: PerSampleModule) -> torch.Tensor:
        total = squared_error(psm(x), target)
        return total / len(x) if loss_reduction == "mean" else total

    with PerSampleModule(model, loss_reduction=loss_reduction) as psm:
        loss(psm).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                close(p.grad_sample, ref[name], f"grad_sample of {name}")
                close(p.grad, ref[name].mean(0) if loss_reduction == "mean" else ref[name].sum(0), f".grad of {name}")
            else:
                assert not hasattr(p, "grad_sample")
    model.zero_grad()
    clipped = clip(ref, 0.5)
    with PerSampleModule(
        model, loss_reduction=loss_reduction, reduction="mean", keep_grad_sample=False, track_statistics=True
    ) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for _ in range(2):
            psm.zero_grad()
            loss(psm).backward()
            norms = psm.per_sample_norms()
            for name, g in ref.items():
                p = model.get_parameter(name)
                assert not hasattr(p, "grad_sample")
                close(norms[name], g.flatten(1).norm(dim=1), f"norm of {name}")
                close(p.grad, clipped[name].mean(0), f"clipped .grad of {name}")
            if len(x) > 1 and not tolerance:
                check_statistics(psm.statistics(), ref)


# -- pergrad without transformers -------------------------------------------------------------------


def test_pergrad_does_not_import_transformers() -> None:
    code = "import sys, pergrad, pergrad.rules.hf; assert 'transformers' not in sys.modules, 'imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# -- the registry by name ---------------------------------------------------------------------------


def test_builtin_names_are_registered_and_listed() -> None:
    registry = pergrad.default_registry
    assert "transformers.pytorch_utils.Conv1D" in registry and Conv1D in registry
    names = registry.supported_names()
    assert hf.CONV1D in names and set(NORM_NAMES) <= set(names) and "torch.nn.modules.linear.Linear" in names
    llama_norm = layer_class("transformers.models.llama.modeling_llama.LlamaRMSNorm")
    types = registry.supported_types()
    assert Conv1D in types and llama_norm in types and nn.Linear in types  # their modules are imported
    assert registry.lookup(llama_norm(4)).fn is pergrad.rules.llama_rms_norm
    assert registry.lookup(Conv1D(3, 2)).fused is not None


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class SubScale(Scale):
    pass


def scale_rule(layer: nn.Module, a: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"w": torch.einsum("n...f,n...f->nf", a, d)}


def test_register_by_name_is_exact_and_one_key_with_the_class() -> None:
    registry = RuleRegistry()
    name = qualified_name(Scale)
    registry.register(name)(scale_rule)
    assert Scale in registry and name in registry and SubScale not in registry
    assert registry.lookup(SubScale()) is None  # a subclass has its own name
    assert registry.supported_types() == [Scale] and registry.supported_names() == [name]
    with pytest.raises(ValueError, match=r"a rule for Scale is already registered \(scale_rule\).*overwrite=True"):
        registry.register(Scale)(scale_rule)
    with pytest.raises(ValueError, match=rf"a rule for {name} is already registered"):
        registry.register(name)(scale_rule)
    copied = registry.copy()
    copied.register(Scale, overwrite=True)(pergrad.rules.linear)  # the class replaces the name
    assert copied.supported_names() == [name] and copied.lookup(Scale()).fn is pergrad.rules.linear
    assert registry.lookup(Scale()).fn is scale_rule  # the copy is independent
    never_imported = "some_package_not_imported.layers.FancyNorm"
    registry.register(never_imported)(scale_rule)
    assert never_imported in registry and never_imported in registry.supported_names()
    assert registry.supported_types() == [Scale]  # not resolvable without importing it: left out
    assert "some_package_not_imported" not in sys.modules


@pytest.mark.parametrize("bad", ["Conv1D", "transformers..Conv1D", "a.<locals>.B", 3])
def test_register_rejects_what_is_not_a_class_or_qualified_name(bad: object) -> None:
    with pytest.raises(TypeError, match=r"register\(\) takes nn.Module subclasses or .*qualified class names"):
        RuleRegistry().register(bad)(scale_rule)  # type: ignore[arg-type]


def test_register_fused_needs_a_rule() -> None:
    spec = pergrad.default_registry.lookup(nn.Linear(2, 2))
    assert spec is not None and spec.fused is not None
    fused = spec.fused
    with pytest.raises(KeyError, match=r"no rule is registered for 'x.Y'"):
        RuleRegistry().register_fused(("x.Y",), fused)


def test_model_with_a_registered_name_and_errors_that_list_them() -> None:
    llama_norm = layer_class("transformers.models.llama.modeling_llama.LlamaRMSNorm")

    class MyNorm(llama_norm):  # type: ignore[misc, valid-type]
        pass

    with pytest.raises(
        UnsupportedLayerError, match=r"layer '0' .*MyNorm.*subclasses LlamaRMSNorm.*register_rule\(MyNorm\)"
    ):
        PerSampleModule(nn.Sequential(MyNorm(3)))
    with pytest.raises(UnsupportedLayerError, match=r"layer '1' .*PReLU.*Supported types: .*Conv1D.*LlamaRMSNorm"):
        PerSampleModule(nn.Sequential(llama_norm(3), nn.PReLU()))
    registry = pergrad.default_registry.copy()
    registry.register(MyNorm)(pergrad.rules.llama_rms_norm)
    model = Head(MyNorm(3).double())
    x, target = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(4, 2, 3, dtype=torch.float64)
    ref = layer_reference(model, x, target)
    with PerSampleModule(model, rules=registry, loss_reduction="sum") as psm:
        squared_error(psm(x), target).backward()
        assert_close(model.layer.weight.grad_sample, ref["layer.weight"])


# -- Conv1D -----------------------------------------------------------------------------------------


@st.composite
def conv1d_cases(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    """A GPT-2 ``Conv1D`` (either parameter may be frozen) and an input shape ``[B, *positions, nx]``."""
    nx, nf = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    layer = Conv1D(nf, nx).double()
    with torch.no_grad():
        layer.bias.normal_()
    frozen = draw(st.sampled_from([None, "weight", "bias"]))
    if frozen is not None:
        getattr(layer, frozen).requires_grad_(False)
    positions = draw(st.lists(st.integers(1, 4), max_size=2))
    return layer, (draw(st.integers(1, 4)), *positions, nx)


@given(case=conv1d_cases(), loss_reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_conv1d_matches_a_per_sample_autograd_loop(
    case: tuple[nn.Module, tuple[int, ...]], loss_reduction: str, seed: int
) -> None:
    layer, shape = case
    torch.manual_seed(seed)
    check_layer(layer, torch.randn(shape, dtype=torch.float64), loss_reduction)


@given(case=conv1d_cases(), seed=st.integers(0, 2**16))
def test_conv1d_fused_functions_agree_with_its_rule(case: tuple[nn.Module, tuple[int, ...]], seed: int) -> None:
    """Every fused function on (a, d) against the same quantity read off the rule's g_i (the engine
    calls ``dots`` only for some layouts, so it is checked here directly)."""
    layer, shape = case
    torch.manual_seed(seed)
    spec = pergrad.default_registry.lookup(layer)
    assert spec is not None and spec.fused is not None
    fused = spec.fused
    a = torch.randn(shape, dtype=torch.float64)
    d = torch.randn(*shape[:-1], layer.nf, dtype=torch.float64)
    built = spec.fn(layer, a, d)
    other = {k: torch.randn_like(g[0]) for k, g in built.items()}
    norms, summed, dots = fused.sq_norms(layer, a, d), fused.summed(layer, a, d), fused.dots(layer, a, d, other)
    assert norms.keys() == summed.keys() == dots.keys() == built.keys()
    for k, g in built.items():
        assert_close(norms[k], g.flatten(1).square().sum(1), f"sq_norms {k}")
        assert_close(summed[k], g.sum(0), f"summed {k}")
        assert_close(dots[k], (g * other[k]).flatten(1).sum(1), f"dots {k}")
    assert fused.moments is not None
    moments = fused.moments(layer, a, d, other)
    if len(shape) > 2:
        assert moments is None  # built instead
        return
    assert moments is not None
    for k, g in built.items():
        assert_close(moments[0][k], g.flatten(1).square().sum(1), f"moments: sq_norms {k}")
        assert_close(moments[1][k], g.square().sum(0), f"moments: sum of squares {k}")
        assert_close(moments[2][k], (g * other[k]).flatten(1).sum(1), f"moments: dots {k}")


def test_conv1d_weight_gradient_is_the_transposed_linear_one() -> None:
    """Conv1D(nf, nx) computes what nn.Linear(nx, nf) with weight W^T does: the rules agree likewise."""
    conv = Conv1D(4, 3).double()
    a, d = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(5, 2, 4, dtype=torch.float64)
    linear = nn.Linear(3, 4).double()
    got, want = pergrad.rules.conv1d(conv, a, d), pergrad.rules.linear(linear, a, d)
    assert_close(got["weight"], want["weight"].transpose(1, 2))
    assert_close(got["bias"], want["bias"])


# -- RMSNorm-like layers ----------------------------------------------------------------------------


def norm_layer(name: str, dim: int, eps: float, dtype: torch.dtype = torch.float64) -> nn.Module:
    layer = layer_class(name)(dim, eps=eps).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()  # Gemma's starts at 0, Llama's at 1: neither is a typical trained weight
    return layer


def tolerance(name: str) -> dict[str, float]:
    return FLOAT32_TOLERANCE if name in FLOAT32_INSIDE else {}


@pytest.mark.parametrize("name", NORM_NAMES, ids=lambda n: n.rsplit(".", 1)[1])
def test_every_registered_norm_class(name: str) -> None:
    torch.manual_seed(0)
    for shape in [(1, 6), (4, 6), (3, 5, 6), (2, 3, 2, 6)]:  # [B, D], [B, T, D], [B, T, heads, D]
        check_layer(norm_layer(name, 6, 1e-5), torch.randn(shape, dtype=torch.float64), "mean", **tolerance(name))


BRIEF_NORMS = [
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.t5.modeling_t5.T5LayerNorm",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.llama4.modeling_llama4.Llama4TextRMSNorm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    "transformers.models.helium.modeling_helium.HeliumRMSNorm",
    "transformers.models.moshi.modeling_moshi.MoshiRMSNorm",
    "transformers.models.gemma3n.modeling_gemma3n.Gemma3nRMSNorm",
]


@pytest.mark.parametrize("name", BRIEF_NORMS, ids=lambda n: n.rsplit(".", 1)[1])
@given(
    batch=st.integers(1, 4),
    positions=st.lists(st.integers(1, 4), max_size=2),
    dim=st.integers(1, 6),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
# samples' weight gradients that cancel (2.9, -3.6, 0.6 sum to -0.08), computed in float32 inside the
# float64 Gemma norm: its first backward's check once refused autograd's float32 round-off
@example(batch=3, positions=[4], dim=1, eps=0.1, loss_reduction="mean", seed=1)
def test_norm_rules_over_shapes(
    name: str, batch: int, positions: list[int], dim: int, eps: float, loss_reduction: str, seed: int
) -> None:
    torch.manual_seed(seed)
    x = torch.randn(batch, *positions, dim, dtype=torch.float64)
    check_layer(norm_layer(name, dim, eps), x, loss_reduction, **tolerance(name))


# one class per forward variant (where the casts are, which epsilon, rsqrt or pow)
VARIANTS = [
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.llama4.modeling_llama4.Llama4TextRMSNorm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.moshi.modeling_moshi.MoshiRMSNorm",
    "transformers.models.helium.modeling_helium.HeliumRMSNorm",
    "transformers.models.gemma3n.modeling_gemma3n.Gemma3nRMSNorm",
    "transformers.models.t5.modeling_t5.T5LayerNorm",
]
DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),  # a float32 weight on a bfloat16 activation
    (torch.float32, torch.float32),
]


@pytest.mark.parametrize("name", VARIANTS, ids=lambda n: n.rsplit(".", 1)[1])
@pytest.mark.parametrize(("weight_dtype", "input_dtype"), DTYPES, ids=str)
def test_norm_rules_replicate_the_dtype_handling_bit_for_bit(
    name: str, weight_dtype: torch.dtype, input_dtype: torch.dtype
) -> None:
    """Each rule forms and sums ``d * x_hat`` in the dtypes the forward's autograd does, op for op,
    so with a sum loss (``d`` unscaled) its ``g_i`` are autograd's per-sample gradients exactly,
    stored in the weight's dtype. A rule rounding ``x_hat`` or summing in another dtype is off by
    whole units in the last place of bfloat16/float16."""
    torch.manual_seed(0)
    model = Head(norm_layer(name, 8, 1e-5, weight_dtype))
    for shape in [(3, 8), (4, 5, 8), (2, 3, 2, 8)]:
        x = torch.randn(shape).to(input_dtype)
        with torch.no_grad():
            target = torch.randn_like(model(x))
        ref = layer_reference(model, x, target)
        with PerSampleModule(model, loss_reduction="sum") as psm:
            squared_error(psm(x), target).backward()
            got = model.layer.weight.grad_sample
            assert got.dtype == weight_dtype
            torch.testing.assert_close(got, ref["layer.weight"], rtol=0, atol=0)
        model.zero_grad()


# The forwards (and ``_norm`` helpers) of transformers 5.23 each rule was written for, docstrings
# and annotations left out. A class is registered only if its source is one of its rule's forms.
_NORM = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"
_LLAMA_BODY = """input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
"""
FORMS: dict[Callable[..., dict[str, torch.Tensor]], list[tuple[str, str | None]]] = {
    pergrad.rules.llama_rms_norm: [
        (_LLAMA_BODY + "return self.weight * hidden_states.to(input_dtype)", None),
        ("output = self._norm(x.float()).type_as(x)\nreturn output * self.weight", _NORM),
    ],
    pergrad.rules.olmo2_rms_norm: [(_LLAMA_BODY + "return (self.weight * hidden_states).to(input_dtype)", None)],
    pergrad.rules.gemma_rms_norm: [
        (
            "output = self._norm(x.float())\noutput = output * (1.0 + self.weight.float())\nreturn output.type_as(x)",
            _NORM,
        ),
        ("output = self._norm(x.float())\noutput = output * self.weight.float()\nreturn output.type_as(x)", _NORM),
        (_LLAMA_BODY + "return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)", None),
    ],
    pergrad.rules.gemma3n_rms_norm: [
        (
            "normed_output = self._norm(hidden_states.float())\nif self.with_scale:\n"
            "    normed_output = normed_output * self.weight.float()\nreturn normed_output.type_as(hidden_states)",
            "mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps\n"
            "return hidden_states * torch.pow(mean_squared, -0.5)",
        )
    ],
    pergrad.rules.t5_layer_norm: [
        (
            "variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)\n"
            "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)\n"
            "if self.weight.dtype in [torch.float16, torch.bfloat16]:\n"
            "    hidden_states = hidden_states.to(self.weight.dtype)\nreturn self.weight * hidden_states",
            None,
        )
    ],
    pergrad.rules.conv1d: [
        (
            "size_out = x.size()[:-1] + (self.nf,)\nx = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)\n"
            "x = x.view(size_out)\nreturn x",
            None,
        )
    ],
}


def body(fn: Callable[..., object] | None) -> str | None:
    """A method's statements without its docstring, as ``ast.unparse`` writes them."""
    if fn is None:
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(tree, ast.FunctionDef)
    stmts = tree.body
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant):
        stmts = stmts[1:]
    return "\n".join(ast.unparse(s) for s in stmts)


@pytest.mark.parametrize("name", [*NORM_NAMES, hf.CONV1D], ids=lambda n: n.rsplit(".", 1)[1])
def test_registered_class_has_the_forward_its_rule_assumes(name: str) -> None:
    cls = layer_class(name)
    assert qualified_name(cls) == name
    spec = pergrad.default_registry.lookup(Conv1D(3, 2) if name == hf.CONV1D else norm_layer(name, 4, 1e-5))
    assert spec is not None
    forward = body(cls.forward)
    assert forward is not None
    found = (forward, body(cls._norm) if "self._norm(" in forward else None)  # type: ignore[attr-defined]
    assert found in FORMS[spec.fn], f"{name}'s forward is none of {spec.fn.__name__}'s forms:\n{forward}"


# -- whole models ---------------------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's loss is the sum over its tokens: with a sum over the batch, ``f_i`` is that sum."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


def check_model(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    """Per-sample gradients of a model on ``lm_loss`` (batches of keyword inputs and ``labels``, which
    the model is not given): materialised on the first batch, then fused root clipping and norms on
    every batch (two steps). Parameters of layers computing in float32 inside (Gemma's norms) are
    compared to float32 round-off: autograd's own ``.grad`` sums their float32 terms over the whole
    batch, the reference one sample at a time."""
    params = trainable(model)
    float32_inside = {
        f"{name}.weight" for name, m in model.named_modules() if qualified_name(type(m)) in FLOAT32_INSIDE
    }

    def close(actual: torch.Tensor, expected: torch.Tensor, name: str, what: str) -> None:
        if name in float32_inside:
            torch.testing.assert_close(actual, expected, **FLOAT32_TOLERANCE, msg=lambda m: f"{what}: {m}")
        else:
            assert_close(actual, expected, what)

    def forward(module: nn.Module | PerSampleModule, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(module(**{k: v for k, v in batch.items() if k != "labels"}).logits, batch["labels"])

    def sample_loss(batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        return forward(model, {k: v[i : i + 1] for k, v in batch.items()})

    refs = [autograd_loop(params, lambda i, b=b: sample_loss(b, i), len(b["labels"])) for b in batches]
    with PerSampleModule(model, loss_reduction="sum") as psm:  # no fallback
        forward(psm, batches[0]).backward()
        for name, p in params.items():
            close(p.grad_sample, refs[0][name], name, f"grad_sample of {name}")
            close(p.grad, refs[0][name].sum(0), name, f".grad of {name}")
    model.zero_grad()
    with PerSampleModule(
        model, loss_reduction="sum", reduction="mean", keep_grad_sample=False, track_norms=True
    ) as psm:
        psm.register_transform(model, transforms.clip_norm(0.5))
        for batch, ref in zip(batches, refs):
            psm.zero_grad()
            forward(psm, batch).backward()
            clipped, norms = clip(ref, 0.5), psm.per_sample_norms()
            for name, p in params.items():
                close(norms[name], ref[name].flatten(1).norm(dim=1), name, f"norm of {name}")
                close(p.grad, clipped[name].mean(0), name, f"clipped .grad of {name}")


def token_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """A batch of 3 sequences of 6 tokens, then one of 4 of 4 (``T == B``) with a padding attention mask
    (sample ``i`` ends in ``i % 3`` pads): HF builds its attention masks from it by advanced indexing."""
    out = []
    for b, t in [(3, 6), (4, 4)]:
        ids = torch.randint(0, vocab, (b, t))
        batch = {"input_ids": ids, "labels": ids}
        if b == t:
            mask = torch.ones(b, t, dtype=torch.long)
            for i in range(b):
                mask[i, t - i % 3 :] = 0
            batch["attention_mask"] = mask
        out.append(batch)
    return out


SMALL = {
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "vocab_size": 50,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
CAUSAL_LMS = {  # family: (config, model, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),  # q_norm/k_norm on [B, T, heads, D]
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


@pytest.mark.parametrize("family", sorted(CAUSAL_LMS))
def test_causal_lm_with_frozen_embeddings_without_fallback(family: str) -> None:
    config_name, model_name, extra = CAUSAL_LMS[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**SMALL, **extra)).double().eval()
    model.get_input_embeddings().requires_grad_(False)
    norms = [m for m in model.modules() if qualified_name(type(m)) in NORM_NAMES]
    assert norms and all(m.weight.requires_grad for m in norms)
    check_model(model, token_batches(50))


def gpt2() -> nn.Module:
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=16, n_head=2, n_layer=2, n_positions=16, vocab_size=50, bos_token_id=0, eos_token_id=0
        )
    )
    return model.double().eval()


def test_gpt2_conv1d_layers_with_frozen_embeddings() -> None:
    """wte (tied to the head) and wpe (its input, the positions, is shared by the batch) frozen:
    every other parameter is a Conv1D's or a LayerNorm's."""
    torch.manual_seed(0)
    model = gpt2()
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    assert sum(isinstance(m, Conv1D) and m.weight.requires_grad for m in model.modules()) == 8
    check_model(model, token_batches(50))


@pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)  # peft 0.21 on transformers 5
def test_gpt2_with_lora_on_its_conv1d_attention() -> None:
    """peft wraps each ``c_attn`` Conv1D (frozen) with LoRA's trainable nn.Linear A and B: wrapping
    needs no fallback, the frozen Conv1D does not stand in the way, and the LoRA gradients are exact."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True, init_lora_weights=False
    )
    model = peft.get_peft_model(gpt2(), config).double().eval()
    names = list(trainable(model))
    assert len(names) == 4 and all(".c_attn.lora_" in n for n in names)
    assert all(not m.weight.requires_grad for m in model.modules() if isinstance(m, Conv1D))
    check_model(model, token_batches(50))


def test_t5_with_frozen_embeddings_and_position_bias() -> None:
    """T5LayerNorm in an encoder-decoder; the shared embeddings and the relative position bias (its
    input, the position buckets, is shared by the batch) frozen."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config).double().eval()
    model.get_input_embeddings().requires_grad_(False)
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            module.requires_grad_(False)
    batches = []
    for _ in range(2):
        labels = torch.randint(1, 50, (3, 4))
        ids = torch.randint(0, 50, (3, 5))
        batches.append({"input_ids": ids, "decoder_input_ids": model._shift_right(labels), "labels": labels})
    check_model(model, batches)
