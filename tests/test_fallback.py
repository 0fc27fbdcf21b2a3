"""fallback=True: modules without a rule get exact per-sample gradients through torch.func."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pergrad import BatchMixingError, PerSampleModule, UnsupportedLayerError, transforms
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


class Attend(nn.Module):
    """nn.MultiheadAttention with need_weights=True; the head reads the attention output, the
    attention weights (batch on dim 0 in any layout), or both. The result has the batch on the
    wrapper's batch dim."""

    def __init__(self, batch_first: bool, average: bool, reads: str) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.out = nn.Linear(4, 2)
        self.batch_first, self.average, self.reads = batch_first, average, reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        o, w = self.attn(h, h, h, need_weights=True, average_attn_weights=self.average)
        features = []
        if "output" in self.reads:
            y = self.out(o)
            features.append((y if self.batch_first else y.transpose(0, 1)).flatten(1))
        if "weights" in self.reads:
            features.append(torch.tanh(3 * w).flatten(1))
        f = torch.cat(features, 1)
        return f if self.batch_first else f.T


@pytest.mark.parametrize(
    ("batch_first", "average", "reads"),
    [
        (True, True, "output+weights"),
        (False, False, "output+weights"),
        (True, False, "weights"),
        (False, True, "weights"),
    ],
)
def test_attention_weights_in_the_loss(batch_first: bool, average: bool, reads: str) -> None:
    """The attention weights' gradient counts (it was not seen): exact, materialised and fused."""
    torch.manual_seed(4)
    model = Attend(batch_first, average, reads).double()
    batch_dim = 0 if batch_first else 1
    x = torch.randn((3, 4, 3) if batch_first else (4, 3, 3), dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference_grad_sample(model, x, target, batch_dim=batch_dim)
    reached = {n: g for n, g in ref.items() if n.startswith(("inp.", "attn.in_proj")) or "output" in reads}
    assert all(not g.any() for n, g in ref.items() if n not in reached)  # the rest is not in the loss
    norms = torch.stack([g.flatten(1).square().sum(1) for g in reached.values()]).sum(0).sqrt()
    factor = (0.5 / norms).clamp(max=1)
    for keep in (True, False):
        model.zero_grad()
        with PerSampleModule(model, batch_first=batch_first, keep_grad_sample=keep) as psm:
            psm.register_transform(model, transforms.clip_norm(0.5))
            run_pergrad(psm, x, target, batch_dim=batch_dim)
            for name, g in reached.items():
                p = model.get_parameter(name)
                if keep:
                    assert_close(p.grad_sample, g, name)
                assert_close(p.grad, (g * factor.view(-1, *([1] * (g.dim() - 1)))).mean(0), name)


class Branches(nn.Module):
    """Raw parameters and a tuple, dict and tuple-in-dict of outputs, some computed from others inside
    the module: the hidden state (as a view), the next state computed from it, both again (the next
    state returned twice), a per-sample sum of the hidden state, and a pooled state whose batch is on
    dim 0 in any layout."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(5))
        self.w2 = nn.Parameter(torch.randn(5))
        self.time = 1 if batch_first else 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, object], torch.Tensor, torch.Tensor]:
        h1 = torch.tanh(x * self.w1)
        h2 = torch.tanh(h1 * self.w2 + x)
        return h1.view_as(h1), {"next": h2, "again": (h1, h2)}, h1.sum(-1), (h2 * self.w1).mean(self.time)


class UsesBranches(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.branches = Branches(batch_first)
        self.time, self.batch_first = (1 if batch_first else 0), batch_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view, states, total, pooled = self.branches(self.inp(x))
        again = states["again"]
        t = self.time
        f = torch.cat(
            [
                view.mean(t),
                states["next"].pow(2).sum(t),
                again[0].pow(3).mean(t),
                again[1].amax(t),
                total.mean(t).unsqueeze(1),
                pooled,
            ],
            1,
        )
        return f if self.batch_first else f.T


@pytest.mark.parametrize("batch_first", [True, False])
def test_fallback_uses_every_output_once(batch_first: bool) -> None:
    """Every output's own gradient counts once: what the module's other outputs send back into a
    tensor it returns (computed from it inside) is not counted again, nor a tensor returned twice."""
    torch.manual_seed(5)
    model = UsesBranches(batch_first).double()
    batch_dim = 0 if batch_first else 1
    x = torch.randn((3, 4, 3) if batch_first else (4, 3, 3), dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = reference_grad_sample(model, x, target, batch_dim=batch_dim)
    for keep in (True, False):
        model.zero_grad()
        with PerSampleModule(model, fallback=True, batch_first=batch_first, keep_grad_sample=keep) as psm:
            psm.register_transform(model.branches, transforms.clip_norm(0.1))
            for step in range(2):  # the second backward, through a second forward, is checked by nobody else
                model.zero_grad()
                run_pergrad(psm, x, target, batch_dim=batch_dim)
                g = {k: ref[f"branches.{k}"] for k in ("w1", "w2")}
                norms = torch.stack([v.square().sum(1) for v in g.values()]).sum(0).sqrt()
                factor = (0.1 / norms).clamp(max=1).view(-1, 1)
                for k, v in g.items():
                    if keep:
                        assert_close(getattr(model.branches, k).grad_sample, v, f"step {step} {k}")
                    assert_close(getattr(model.branches, k).grad, (v * factor).mean(0), f"step {step} {k}")


class WithBatchMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * self.w
        return y, y.square().mean()  # the second: a statistic of the whole batch


def test_an_output_shared_by_the_batch_may_not_enter_the_loss() -> None:
    torch.manual_seed(6)
    model = WithBatchMean().double()
    x, target = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with PerSampleModule(model, fallback=True) as psm:
        (psm(x)[0] - target).pow(2).sum().div(4).backward()  # unused: exact
        assert_close(model.w.grad_sample, 2 * x * (x * model.w.detach() - target))
        y, aux = psm(x)
        loss = (y - target).pow(2).sum().div(4) + aux
        with pytest.raises(
            BatchMixingError,
            match=r"output 1 of a WithBatchMean has shape \(\) for the batch of 4 samples but \(\) for one sample "
            r"run alone: no dim holds one slice per sample, yet it received a gradient",
        ):
            loss.backward()


class Elman(nn.Module):
    """A two-layer Elman RNN written out in Python (batch-first input, no rule: the fallback), returning
    the output sequence ``[B, T, H]`` and the final states ``[2, B, H]``: batch on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.u1 = nn.Parameter(torch.randn(3, 4) / 2), nn.Parameter(torch.randn(3, 3) / 2)
        self.w2, self.u2 = nn.Parameter(torch.randn(3, 3) / 2), nn.Parameter(torch.randn(3, 3) / 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = h2 = x.new_zeros(x.shape[0], 3)
        outputs = []
        for t in range(x.shape[1]):
            h1 = torch.tanh(x[:, t] @ self.w1.T + h1 @ self.u1.T)
            h2 = torch.tanh(h1 @ self.w2.T + h2 @ self.u2.T)
            outputs.append(h2)
        return torch.stack(outputs, 1), torch.stack([h1, h2])


class ReadsFinalStates(nn.Module):
    def __init__(self, both: bool) -> None:
        super().__init__()
        self.rnn, self.both = Elman(), both
        self.head = nn.Linear(9 if both else 6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h_n = self.rnn(x)
        features = h_n.permute(1, 0, 2).flatten(1)
        return self.head(torch.cat([features, out.mean(1)], 1) if self.both else features)


@pytest.mark.parametrize("both", [False, True])
def test_fallback_finds_the_batch_of_each_output_from_one_sample_alone(both: bool) -> None:
    """The final states have the batch on dim 1 with batch-first inputs: found from their shape for one
    sample alone, also with a batch of 2 (the number of layers, where dim 0 has the batch size too).
    Root clipping over steps with batch sizes 2, 3, 1, materialised and fused."""
    torch.manual_seed(7)
    model = ReadsFinalStates(both).double()
    for keep in (True, False):
        with PerSampleModule(model, fallback=True, keep_grad_sample=keep, track_norms=True) as psm:
            psm.register_transform(model, transforms.clip_norm(0.3))
            for step, batch in enumerate((2, 3, 1)):
                x = torch.randn(batch, 4, 4, dtype=torch.float64)
                target = torch.randn(batch, 2, dtype=torch.float64)
                ref = reference_grad_sample(model, x, target)
                norms = torch.stack([g.flatten(1).square().sum(1) for g in ref.values()]).sum(0).sqrt()
                factor = (0.3 / norms).clamp(max=1)
                model.zero_grad()
                run_pergrad(psm, x, target)
                for name, p in model.named_parameters():
                    g = ref[name]
                    if keep:
                        assert_close(p.grad_sample, g, f"step {step} {name}")
                    assert_close(psm.per_sample_norms()[name], g.flatten(1).norm(dim=1), f"step {step} {name}")
                    assert_close(p.grad, (g * factor.view(-1, *([1] * p.dim()))).mean(0), f"step {step} {name}")


class Named(nn.Module):
    """Returns a dict whose first tensor has no gradient (a detached copy of the input), then a
    per-sample state and states of both weights stacked in front of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"skip": x.detach(), "y": torch.tanh(x * self.w1), "both": torch.stack([x * self.w1, x * self.w2])}


class ReadsNamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.named, self.head = nn.Linear(2, 3), Named(), nn.Linear(9, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.named(self.inp(x))
        return self.head(torch.cat([out["y"], out["both"].permute(1, 0, 2).flatten(1)], 1))


def test_fallback_takes_a_dict_whose_first_tensor_has_no_gradient() -> None:
    torch.manual_seed(8)
    model = ReadsNamed().double()
    with PerSampleModule(model, fallback=True, loss_reduction="sum") as psm:
        for step, batch in enumerate((4, 2)):
            x, target = torch.randn(batch, 2, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
            ref = reference_grad_sample(model, x, target)
            model.zero_grad()
            run_pergrad(psm, x, target, loss_reduction="sum")
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"step {step} {name}")
