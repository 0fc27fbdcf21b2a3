"""Random models from the supported layers, checked end to end against torch.func.

Models have random depth and widths, sequence or spatial shapes, residual connections with in-place
adds, in-place ReLUs, tied input/output embeddings, a layer reused within one forward, and frozen
parts; a random transform target (none, the whole model, one module, one parameter) and a random
``keep_grad_sample``. The ``ci`` profile runs 300 derandomized examples
(``HYPOTHESIS_PROFILE=long`` for more); a failure prints the drawn model spec, shrunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pergrad import PerSampleModule, transforms
from tests.reference import assert_close, reference_grad_sample

FUZZ_EXAMPLES = {"ci": 300, "dev": 60, "long": 2000}[os.environ.get("HYPOTHESIS_PROFILE", "dev")]


@dataclass(frozen=True)
class Block:
    """One step of a random model. kind: linear | norm | residual | reuse | conv | conv_residual."""

    kind: str
    width: int = 0
    bias: bool = True
    frozen: bool = False
    kernel: int = 1
    groups: int = 1
    padding_mode: str = "zeros"


@dataclass(frozen=True)
class Spec:
    family: str  # "seq" or "image"
    batch: int
    width: int  # input features / channels
    shape: tuple[int, ...]  # sequence dims (seq) or spatial dims (image)
    blocks: tuple[Block, ...]
    vocab: int = 0  # seq: an Embedding of this vocabulary first (0: float input)
    tied: bool = False  # seq: the head reuses the embedding's weight
    out: int = 2


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        width = spec.width
        if spec.vocab:
            self.emb = nn.Embedding(spec.vocab, width)
        self.blocks = nn.ModuleList()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[len(spec.shape) - 1] if spec.family == "image" else None
        for b in spec.blocks:
            if b.kind == "linear":
                layer: nn.Module = nn.Linear(width, b.width, bias=b.bias)
                width = b.width
            elif b.kind in ("residual", "reuse"):
                layer = nn.Linear(width, width, bias=b.bias)
            elif b.kind == "norm":
                layer = nn.LayerNorm(width, bias=b.bias)
            else:
                assert conv is not None
                out = width if b.kind == "conv_residual" else b.width * b.groups
                layer = conv(
                    width, out, b.kernel, padding="same", groups=b.groups, bias=b.bias, padding_mode=b.padding_mode
                )
                width = out
            layer.requires_grad_(not b.frozen)
            self.blocks.append(layer)
        if spec.family == "image":
            width *= int(torch.tensor(spec.shape).prod())
        self.head = nn.Linear(width, spec.vocab if spec.tied else spec.out, bias=not spec.tied)
        if spec.tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.spec.vocab else x
        for b, layer in zip(self.spec.blocks, self.blocks, strict=True):
            if b.kind in ("linear", "conv"):
                h = torch.relu_(layer(h))  # in place on the layer's output
            elif b.kind in ("residual", "conv_residual"):
                out = layer(h)
                out += h  # in-place residual add
                h = torch.tanh(out)
            elif b.kind == "reuse":
                h = torch.tanh(layer(torch.tanh(layer(h))))
            else:
                h = layer(h)
        return self.head(h.flatten(1) if self.spec.family == "image" else h)


@st.composite
def seq_specs(draw: st.DrawFn) -> Spec:
    width = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([0, 0, 6]))
    kinds = st.sampled_from(["linear", "norm", "residual", "reuse"])
    blocks = []
    for kind in draw(st.lists(kinds, max_size=4)):
        blocks.append(Block(kind, draw(st.integers(1, 5)), draw(st.booleans()), draw(st.booleans())))
    final = next((b.width for b in reversed(blocks) if b.kind == "linear"), width)
    tied = bool(vocab) and final == width and draw(st.booleans())
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return Spec("seq", draw(st.integers(1, 4)), width, shape, tuple(blocks), vocab, tied)


@st.composite
def image_specs(draw: st.DrawFn) -> Spec:
    nd = draw(st.integers(1, 3))
    width = channels = draw(st.integers(1, 3))
    blocks = []
    for kind in draw(st.lists(st.sampled_from(["conv", "conv_residual"]), max_size=3)):
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if channels % g == 0]))  # groups first
        per_group = draw(st.integers(1, 2))
        mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
        kernel = draw(st.sampled_from([1, 3]))
        blocks.append(Block(kind, per_group, draw(st.booleans()), draw(st.booleans()), kernel, groups, mode))
        if kind == "conv":
            channels = groups * per_group
    shape = tuple(draw(st.integers(2, 4)) for _ in range(nd))
    return Spec("image", draw(st.integers(1, 3)), width, shape, tuple(blocks))


def make_batch(spec: Spec, model: Net, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if spec.vocab:
        x = torch.randint(0, spec.vocab, (spec.batch, *spec.shape), generator=gen)
    elif spec.family == "seq":
        x = torch.randn(spec.batch, *spec.shape, spec.width, generator=gen, dtype=torch.float64)
    else:
        x = torch.randn(spec.batch, spec.width, *spec.shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn(model(x).shape, generator=gen, dtype=torch.float64)
    return x, target


def expected_grad(ref: dict[str, torch.Tensor], target: str, kind: str) -> dict[str, torch.Tensor]:
    covered = [n for n in ref if target == "" or n == target or n.startswith(target + ".")]
    out = {n: g.mean(0) for n, g in ref.items()}
    if kind == "clip":
        norms = torch.stack([ref[n].flatten(1).square().sum(1) for n in covered]).sum(0).sqrt()
        factor = (0.5 / norms).clamp(max=1)
        out.update({n: (ref[n] * factor.view(-1, *([1] * (ref[n].dim() - 1)))).mean(0) for n in covered})
    elif kind == "double":
        out.update({n: 2 * ref[n].mean(0) for n in covered})
    return out


@settings(max_examples=FUZZ_EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_models_match_torch_func(data: st.DataObject, seed: int) -> None:
    spec = data.draw(st.one_of(seq_specs(), image_specs()), label="spec")
    torch.manual_seed(seed)
    model = Net(spec).double()
    x, target = make_batch(spec, model, seed)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    ref = reference_grad_sample(model, x, target)
    hooked = sorted({n.rsplit(".", 1)[0] for n in trainable})
    choice = data.draw(st.sampled_from(["none", "root", "module", "param"]), label="target kind")
    keep = data.draw(st.booleans(), label="keep_grad_sample")
    with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
        target_name, kind = "", "none"
        if choice == "root":
            psm.register_transform(model, transforms.clip_norm(0.5))
            kind = "clip"
        elif choice == "module":
            target_name, kind = data.draw(st.sampled_from(hooked), label="module"), "clip"
            psm.register_transform(target_name, transforms.clip_norm(0.5))
        elif choice == "param":
            target_name, kind = data.draw(st.sampled_from(trainable), label="param"), "double"
            psm.register_transform(target_name, lambda g: g * 2)
        expected = expected_grad(ref, target_name, kind)
        # the second step runs with the weights pergrad writes itself detached (after the first check)
        for step in ("first step", "second step"):
            psm.zero_grad()
            out = psm(x)
            ((out - target).pow(2).sum() / spec.batch).backward()
            norms = psm.per_sample_norms()
            for name, p in model.named_parameters():
                assert type(p) is nn.Parameter
                if not p.requires_grad:
                    assert p.grad is None and not hasattr(p, "grad_sample")
                    continue
                if keep:
                    assert_close(p.grad_sample, ref[name], f"{step}: grad_sample of {name} in {spec}")
                assert_close(p.grad, expected[name], f"{step}: .grad of {name} in {spec}")
                assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"{step}: norm of {name} in {spec}")
