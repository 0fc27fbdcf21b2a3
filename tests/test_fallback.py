"""fallback=True: modules without a rule get exact per-sample gradients through torch.func."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pergrad import PerSampleModule, UnsupportedLayerError, transforms
from tests.reference import assert_close, reference_grad_sample, run_pergrad


class Gate(nn.Module):
    """Raw parameters, a read-only buffer, a keyword argument and a second tensor input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.shift = nn.Parameter(torch.randn(dim))
        self.register_buffer("offset", torch.randn(dim))

    def forward(self, x: torch.Tensor, other: torch.Tensor, *, power: int = 2) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.offset) ** power + other * self.shift


class Model(nn.Module):
    """PReLU, a custom module called twice with two inputs, and nn.MultiheadAttention as it is."""

    def __init__(self, dim: int, heads: int, batch_first: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(3, dim)
        self.gate = Gate(dim)
        self.act = nn.PReLU()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=batch_first, add_bias_kv=True)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.gate(h, h.flip(-1), power=3)
        h = self.gate(h, h, power=1)
        h = self.act(h)
        b = h.shape[0] if self.attn.batch_first else h.shape[1]
        length = h.shape[1] if self.attn.batch_first else h.shape[0]
        pad = torch.zeros(b, length, dtype=torch.bool)
        pad[:, length - 1] = length > 1  # the last key is padding when there are several
        h, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        return self.out(h)


@given(heads=st.sampled_from([1, 2]), batch=st.integers(1, 4), length=st.integers(1, 4), batch_first=st.booleans())
def test_fallback_matches_torch_func(heads: int, batch: int, length: int, batch_first: bool) -> None:
    torch.manual_seed(batch * 10 + length)
    model = Model(4, heads, batch_first).double()
    shape = (batch, length, 3) if batch_first else (length, batch, 3)
    x = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    batch_dim = 0 if batch_first else 1
    ref = reference_grad_sample(model, x, target, batch_dim=batch_dim)
    with PerSampleModule(model, fallback=True, batch_first=batch_first) as psm:
        psm.register_transform("gate", transforms.clip_norm(0.1))
        run_pergrad(psm, x, target, batch_dim=batch_dim)
        for name, p in model.named_parameters():
            assert_close(p.grad_sample, ref[name], name)
        g = {k: ref[f"gate.{k}"] for k in ("scale", "shift")}
        norms = torch.stack([v.flatten(1).square().sum(1) for v in g.values()]).sum(0).sqrt()
        factor = (0.1 / norms).clamp(max=1)
        for k, v in g.items():
            assert_close(getattr(model.gate, k).grad, (v * factor.view(-1, 1)).mean(0), k)


def test_without_fallback_the_error_names_it() -> None:
    # Gate's raw parameters are tracked to where they meet the batch (pergrad.rules.raw); PReLU is
    # a torch.nn layer without a rule
    with pytest.raises(UnsupportedLayerError, match=r"layer 'act' .*PReLU.*fallback=True"):
        PerSampleModule(Model(4, 2, True))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(2, cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(2, cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(2, cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18ish(nn.Module):
    """ResNet-18's shape (stem, 4 stages of 2 basic blocks), GroupNorm instead of BatchNorm, narrow."""

    def __init__(self, widths: tuple[int, ...] = (4, 4, 8, 8)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.GroupNorm(2, widths[0]), nn.ReLU(inplace=True)
        )
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Encoder(nn.Module):
    """Two nn.TransformerEncoderLayer as they are (nn.MultiheadAttention inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)).mean(1))


@pytest.mark.parametrize("name", ["resnet18", "transformer"])
def test_real_models_wrapped_unmodified(name: str) -> None:
    torch.manual_seed(0)
    if name == "resnet18":
        model, x = ResNet18ish().double(), torch.randn(3, 3, 16, 16, dtype=torch.float64)
    else:
        model, x = Encoder().double(), torch.randn(3, 5, 3, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference_grad_sample(model, x, target)
    with PerSampleModule(model, fallback=True) as psm:
        run_pergrad(psm, x, target)
        for n, p in model.named_parameters():
            assert_close(p.grad_sample, ref[n], n)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.func's vmap cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w if bool((x * self.w).sum() > 0) else -x * self.w


def test_fallback_that_torch_func_cannot_run_is_a_clear_error() -> None:
    with PerSampleModule(Branchy(), fallback=True) as psm:
        loss = psm(torch.randn(2, 3)).sum()
        with pytest.raises(
            UnsupportedLayerError, match=r"torch.func fallback could not compute .* Branchy .*register_rule\(Branchy\)"
        ):
            loss.backward()


def test_multihead_attention_is_supported_without_fallback() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4)).double()
    attn = nn.MultiheadAttention(4, 2, batch_first=True).double()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.attn = model[0], attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.attn(h, h, h, need_weights=False)[0]

    net = Net()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    target = torch.randn(3, 5, 4, dtype=torch.float64)
    ref = reference_grad_sample(net, x, target)
    with PerSampleModule(net) as psm:
        run_pergrad(psm, x, target)
        for name, p in net.named_parameters():
            assert_close(p.grad_sample, ref[name], name)
