"""Random models from the supported layers, checked end to end against torch.func on EVERY step.

Models have random depth and widths (some wide enough for the Gram form of the fused norms),
residual connections with in-place adds, in-place ReLUs, tied input/output embeddings, a layer
reused within one forward, a layer called at two lengths in one forward, position embeddings shared
by the batch (without a batch dim, or a ``[1, T]`` buffer), and frozen parts; a random transform
target (none, the whole model, one module, one parameter), a random ``keep_grad_sample``, a user's
hook on a parameter (a tensor hook or a post-accumulate-grad hook) and a ``load_state_dict(...,
assign=True)`` that replaces the parameters mid-run, activation checkpointing of every block (reentrant
or not), micro-batches (``accumulate="samples"``, or each loss divided by 2 with ``loss_scale=0.5``)
and a loss scale (``grad_scaler=256``); tensors the forward builds itself (``shifted``, ``fourier``,
``offset`` blocks, square steps where T == B), a head used on odd steps only, a loss term from step 2
on, in-place transforms, and ``torch.autograd.grad`` of a parameter after a step. Each example runs
three steps with their own
batch size and sequence length or spatial size, on both sides of the 16 positions per sample from
which weights run detached; ``.grad``, ``grad_sample``, the norms and the hooks are checked on
every step. The ``ci`` profile runs 300 derandomized examples (``HYPOTHESIS_PROFILE=long`` for
2000); a failure prints the drawn model spec, shrunk.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pergrad import DetachedWeightError, HookStateError, PerSampleModule, SecondOrderError, TransformError, transforms
from pergrad._core.shortcuts import detach
from tests.conftest import LIBRARY_FEW_FLOPS
from tests.reference import assert_close, reference_grad_sample

FUZZ_EXAMPLES = {"ci": 300, "dev": 60, "long": 2000}[os.environ.get("HYPOTHESIS_PROFILE", "dev")]
LENGTHS = [1, 2, 3, 15, 16, 17]  # positions per sample on both sides of detach.MANY = 16
MAX_LENGTH = 24


@dataclass(frozen=True)
class Block:
    """One step of a random model.

    kind: linear | norm | residual | reuse | pool | positions | shifted | fourier | offset | conv |
    conv_residual. ``pool`` calls its Linear on ``h`` and on ``h`` averaged over positions (two lengths
    in one forward); ``positions`` adds an Embedding of the position ids shared by the batch
    (``arange(T)`` without a batch dim when ``bias``, else a ``[1, T]`` buffer). Tensors the forward
    builds itself: ``shifted`` adds an Embedding of the input ids shifted right inside the forward (a
    decoder's inputs from its labels); ``fourier`` a Linear on ``sin(arange(T)[:, None] * freqs)``;
    ``offset`` a raw ``[1, D]`` parameter plus rows ``[:T]`` of a buffer table, broadcast over the batch.
    ``transposed``: a Linear on the batch moved to dim 1 (``h.transpose(0, 1)``: a sequence-first layer in a
    batch-first model) and moved back; at T == B only where the batch is followed tells the dims apart."""

    kind: str
    width: int = 0
    bias: bool = True
    frozen: bool = False
    kernel: int = 1
    groups: int = 1
    padding_mode: str = "zeros"
    long_first: bool = False  # pool: call the Linear on the longer input first


@dataclass(frozen=True)
class Spec:
    family: str  # "seq" or "image"
    width: int  # input features / channels
    steps: tuple[tuple[int, tuple[int, ...]], ...]  # (batch, sequence or spatial dims) of each step
    blocks: tuple[Block, ...]
    vocab: int = 0  # seq: an Embedding of this vocabulary first (0: float input)
    tied: bool = False  # seq: the head reuses the embedding's weight
    out: int = 2
    aux: bool = False  # a second head, used on odd steps only


class Offset(nn.Module):
    """A raw ``[1, D]`` parameter plus the first T rows of a ``[MAX_LENGTH, D]`` buffer (a module of the
    user's own: its parameter is tracked to where it meets the batch)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, width))
        self.register_buffer("table", torch.randn(MAX_LENGTH, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t, extra = h.shape[1], h.dim() - 3
        return h + (self.weight + self.table[:t]).view(t, *[1] * extra, -1)


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        width = spec.width
        if spec.vocab:
            self.emb = nn.Embedding(spec.vocab, width)
        self.blocks = nn.ModuleList()
        nd = len(spec.steps[0][1])
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1] if spec.family == "image" else None
        self.register_buffer("position_ids", torch.arange(MAX_LENGTH).expand(1, -1))
        self.register_buffer("freqs", torch.tensor([0.5, 1.0, 2.0, 4.0]))
        for b in spec.blocks:
            if b.kind == "linear":
                layer: nn.Module = nn.Linear(width, b.width, bias=b.bias)
                width = b.width
            elif b.kind in ("residual", "reuse", "pool", "transposed"):
                layer = nn.Linear(width, width, bias=b.bias)
            elif b.kind == "norm":
                layer = nn.LayerNorm(width, bias=b.bias)
            elif b.kind == "positions":
                layer = nn.Embedding(MAX_LENGTH, width)
            elif b.kind == "shifted":
                layer = nn.Embedding(spec.vocab, width)
            elif b.kind == "fourier":
                layer = nn.Linear(4, width, bias=b.bias)
            elif b.kind == "offset":
                layer = Offset(width)
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
            self.pool = nn.AdaptiveAvgPool1d(1) if nd == 1 else None
        self.head = nn.Linear(width, spec.vocab if spec.tied else spec.out, bias=not spec.tied)
        if spec.tied:
            self.head.weight = self.emb.weight
        # a second head, used on some steps only (its parameters are not reached on the others)
        self.aux = nn.Linear(width, self.head.out_features) if spec.aux else None
        self.use_aux = False

    checkpoint: str = "none"  # "reentrant" / "non-reentrant": every block under activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ids = x  # what ``shifted`` shifts (also when a checkpointed block runs again)
        h = self.emb(x) if self.spec.vocab else x
        for b, layer in zip(self.spec.blocks, self.blocks, strict=True):
            if self.checkpoint == "none" or not h.requires_grad:  # (reentrant needs an input that requires grad)
                h = self.block(b, layer, h)
            else:
                run = functools.partial(self.block, b, layer)
                h = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=self.checkpoint == "reentrant")
        if self.spec.family == "image":  # average over positions: any spatial size
            h = h.flatten(2).mean(2)
        if self.aux is not None and self.use_aux:
            return self.head(h) + self.aux(h)
        return self.head(h)

    def block(self, b: Block, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if b.kind in ("linear", "conv"):
            return torch.relu_(layer(h))  # in place on the layer's output
        if b.kind in ("residual", "conv_residual"):
            out = layer(h)
            out += h  # in-place residual add
            h = torch.tanh(out)
        elif b.kind == "transposed":  # sequence-first inside: the batch on dim 1 for the layer
            h = torch.tanh(layer(h.transpose(0, 1))).transpose(0, 1)
        elif b.kind == "reuse":
            h = torch.tanh(layer(torch.tanh(layer(h))))
        elif b.kind == "pool":  # the same Linear on [B, T, ..., D] and on [B, D], in either order
            long = layer(h) if b.long_first else None
            summary = layer(h.flatten(1, -2).mean(1))
            long = layer(h) if long is None else long
            h = torch.tanh(long) + summary.view(summary.shape[0], *[1] * (h.dim() - 2), -1)
        elif b.kind == "shifted":  # ids shifted right by one inside the forward
            ids = self.ids
            shifted = torch.cat([ids.new_zeros(ids[:, :1].shape), ids[:, :-1]], 1)
            h = h + layer(shifted)
        elif b.kind == "fourier":  # features computed from positions, no batch
            t, extra = h.shape[1], h.dim() - 3
            features = torch.sin(torch.arange(t, dtype=self.freqs.dtype)[:, None] * self.freqs)
            h = h + layer(features).view(t, *[1] * extra, -1)
        elif b.kind == "positions":  # shared by the batch: no batch dim, or a batch dim of 1
            t, extra = h.shape[1], h.dim() - 3
            if b.bias:
                pos = layer(torch.arange(t)).view(t, *[1] * extra, -1)
            else:
                pos = layer(self.position_ids[:, :t]).view(1, t, *[1] * extra, -1)
            h = h + pos
        else:
            h = layer(h)
        return h


widths = st.one_of(st.integers(1, 5), st.integers(1, 5), st.sampled_from([24, 40]))  # 24+: Gram form at T=16


@st.composite
def seq_specs(draw: st.DrawFn) -> Spec:
    width = draw(widths)
    vocab = draw(st.sampled_from([0, 0, 6]))
    nd = draw(st.sampled_from([0, 1, 1, 2]))
    kinds = ["linear", "norm", "residual", "reuse"]
    if nd:
        kinds += ["pool", "pool", "positions", "positions", "fourier", "offset", "transposed"]
        kinds += ["shifted"] * 2 if vocab else []
    blocks = []
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=4)):
        block = Block(kind, draw(widths), draw(st.booleans()), draw(st.booleans()))
        blocks.append(replace(block, long_first=draw(st.booleans())) if kind == "pool" else block)
    final = next((b.width for b in reversed(blocks) if b.kind == "linear"), width)
    tied = bool(vocab) and final == width and draw(st.booleans())
    extra = tuple(draw(st.lists(st.integers(1, 2), min_size=max(nd - 1, 0), max_size=max(nd - 1, 0))))
    steps = []
    square = nd and draw(st.booleans())  # the length equals the batch size on every step
    for _ in range(3):
        length = (draw(st.sampled_from(LENGTHS)),) if nd else ()
        batch = length[0] if square else draw(st.integers(1, 4))
        steps.append((batch, length + extra))
    return Spec("seq", width, tuple(steps), tuple(blocks), vocab, tied, aux=draw(st.booleans()))


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
    sizes = {1: [2, 3, 15, 16, 17], 2: [2, 3, 4, 5], 3: [2, 3]}[nd]  # positions on both sides of 16
    steps = [(draw(st.integers(1, 3)), tuple(draw(st.sampled_from(sizes)) for _ in range(nd))) for _ in range(3)]
    return Spec("image", width, tuple(steps), tuple(blocks))


def make_batch(spec: Spec, model: Net, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + step)
    batch, shape = spec.steps[step]
    if spec.vocab:
        x = torch.randint(0, spec.vocab, (batch, *shape), generator=gen)
    elif spec.family == "seq":
        x = torch.randn(batch, *shape, spec.width, generator=gen, dtype=torch.float64)
    else:
        x = torch.randn(batch, spec.width, *shape, generator=gen, dtype=torch.float64)
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


class HookLog:
    """A user's hook on one parameter: what autograd handed a tensor hook, or what ``.grad`` held
    when a post-accumulate-grad hook ran (after pergrad wrote it)."""

    def __init__(self, kind: str) -> None:
        self.kind, self.seen = kind, []  # type: ignore[var-annotated]

    def attach(self, p: nn.Parameter) -> None:
        if self.kind == "tensor":
            p.register_hook(lambda g: self.seen.append(g.clone()))
        elif self.kind == "post":
            p.register_post_accumulate_grad_hook(lambda q: self.seen.append(q.grad.clone()))


class Rescale:
    """A user's forward hook that rescales a layer's output by a factor that changes over the steps (a
    schedule, stochastic depth): ``out * scale`` or ``out.mul_(scale)``. pergrad must see the layer's own
    output; the reference runs the same hook."""

    SCHEDULE = (1.0, 0.5, 2.0)  # the factor at each step: 1 at step 0

    def __init__(self, in_place: bool) -> None:
        self.in_place, self.scale = in_place, 1.0

    def __call__(self, module: nn.Module, args: tuple[object, ...], out: torch.Tensor) -> torch.Tensor:
        return out.mul_(self.scale) if self.in_place else out * self.scale


@settings(max_examples=FUZZ_EXAMPLES)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_models_match_torch_func_on_every_step(data: st.DataObject, seed: int) -> None:
    spec = data.draw(st.one_of(seq_specs(), seq_specs(), image_specs()), label="spec")
    torch.manual_seed(seed)
    model = Net(spec).double()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    hooked = sorted({n.rsplit(".", 1)[0] for n in trainable})
    choice = data.draw(st.sampled_from(["none", "root", "module", "param"]), label="target kind")
    # the flops below which weights stay attached: a layer of these sizes on both sides as the batch changes
    detach.FEW_FLOPS = data.draw(st.sampled_from([0, 0, 48, 400, LIBRARY_FEW_FLOPS]), label="detach.FEW_FLOPS")
    keep = data.draw(st.booleans(), label="keep_grad_sample")
    hook = HookLog(data.draw(st.sampled_from(["none", "none", "tensor", "post"]), label="user hook"))
    always = [n for n in trainable if not n.startswith("aux.")]  # reached on every step
    hook_name = data.draw(st.sampled_from(always), label="hooked parameter") if always else ""
    replace_at = data.draw(st.sampled_from([None, None, 1, 2]), label="load_state_dict(assign=True) before step")
    set_to_none = data.draw(st.booleans(), label="zero_grad(set_to_none)")
    # reentrant checkpointing recomputes a block outside the model's forward, where tensors shared by the
    # batch cannot be followed: refused (tests/test_checkpointing.py), so not drawn with them
    shared = any(b.kind in ("positions", "fourier", "offset", "shifted") for b in spec.blocks)
    modes = ["none", "none", "non-reentrant"] + ([] if shared else ["reentrant"])
    model.checkpoint = data.draw(st.sampled_from(modes), label="checkpoint")
    # micro-batches: "samples" (accumulate="samples"), "divided" (each loss / k, loss_scale=1/k)
    accumulation = data.draw(st.sampled_from(["none", "none", "samples", "divided"]), label="accumulation")
    if accumulation != "none":
        hook = HookLog("none")  # (a user's hook runs once per micro-batch)
    loss_scale = data.draw(st.sampled_from([1.0, 1.0, 2.0**8]), label="grad_scaler (the loss scale)")
    params = dict(model.named_parameters())
    if hook_name:
        hook.attach(params[hook_name])
    # a user's forward hook rescaling one layer's output over the steps, registered before or after wrapping
    layers = [i for i, b in enumerate(spec.blocks) if b.kind not in ("offset",)]
    rescaled = data.draw(st.sampled_from([None, None, *layers]), label="a rescaling forward hook on block")
    in_place = data.draw(st.booleans(), label="in place")
    rescale = Rescale(in_place) if rescaled is not None else None
    hook_late = data.draw(st.booleans(), label="the rescaling hook registered after wrapping")
    if rescale is not None and not hook_late:
        model.blocks[rescaled].register_forward_hook(rescale)
    # the model converted to float32 and back before a step (new data, new AccumulateGrad nodes)
    move_at = data.draw(st.sampled_from([None, None, 1, 2]), label="model.float().double() before step")
    # a gradient penalty on the input (lazy R1) at one step: refused, never silently dropped
    float_input = not spec.vocab
    penalty_at = data.draw(st.sampled_from([None, None, None, 1]), label="an input-gradient penalty at step")
    if not float_input or model.checkpoint == "reentrant":
        penalty_at = None
    # the model compiled (aot_eager: torch.compile's own graphs, quick to build) on a few examples
    compiled = data.draw(st.sampled_from([False] * 19 + [True]), label="torch.compile(backend='aot_eager')")
    if compiled:  # kept to the plain loop: each of these is compiled and tested in its own tests
        model.checkpoint, replace_at, move_at, penalty_at = "none", None, None, None
    options = {
        "keep_grad_sample": keep,
        "track_norms": True,
        "accumulate": "samples" if accumulation == "samples" else "backward",
        "grad_scaler": None if loss_scale == 1.0 else loss_scale,
        "loss_scale": 0.5 if accumulation == "divided" else None,
    }
    with PerSampleModule(model, **options) as psm:  # type: ignore[arg-type]
        if compiled:
            torch._dynamo.reset()  # (a compiled model of an earlier example: its graphs are not this model's)
        forward = torch.compile(model, backend="aot_eager") if compiled else psm
        if rescale is not None and hook_late:
            model.blocks[rescaled].register_forward_hook(rescale)
        target_name, kind = "", "none"
        if choice == "root":
            psm.register_transform(model, transforms.clip_norm(0.5))
            kind = "clip"
        elif choice == "module" and hooked:
            target_name, kind = data.draw(st.sampled_from(hooked), label="module"), "clip"
            psm.register_transform(target_name, transforms.clip_norm(0.5))
        elif choice == "param" and trainable:
            target_name, kind = data.draw(st.sampled_from(trainable), label="param"), "double"
            in_place = data.draw(st.sampled_from([False, False, False, True]), label="an in-place transform")
            psm.register_transform(target_name, (lambda g: g.mul_(2)) if in_place else (lambda g: g * 2))
            kind = "in place" if in_place else kind
        # a term of the loss on one parameter from step 2 on (a warm-up regulariser): refused where a
        # transform covers the parameter (pergrad could not split it into samples), autograd's elsewhere
        candidates = [n for n in always if n != hook_name] if accumulation == "none" else []
        # (torch refuses torch.autograd.grad through a reentrant checkpoint: not drawn with one)
        probes = [False, False, True] if model.checkpoint != "reentrant" else [False]
        probe = data.draw(st.sampled_from(probes), label="a partial backward after each step")
        late = None
        if candidates and data.draw(st.booleans(), label="a term from step 2 on"):
            late = data.draw(st.sampled_from(candidates), label="its parameter")
        for step in range(len(spec.steps)):
            model.use_aux = step % 2 == 1
            what = f"step {step} {spec.steps[step]}"
            if step == replace_at:  # a checkpoint loader: new Parameter objects, same names
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
                params = dict(model.named_parameters())
                if hook_name:
                    hook.attach(params[hook_name])
            if step == move_at:
                model.float().double()
            if rescale is not None:
                rescale.scale = Rescale.SCHEDULE[step]
            x, target = make_batch(spec, model, step, seed)
            batch = x.shape[0]
            checkpointing, model.checkpoint = model.checkpoint, "none"  # torch.func runs the model plainly
            ref = reference_grad_sample(model, x, target)
            model.checkpoint = checkpointing
            expected = expected_grad(ref, target_name, kind)
            micro = [slice(0, batch)]
            if accumulation != "none" and batch > 1:
                micro = [slice(0, (batch + 1) // 2), slice((batch + 1) // 2, batch)]
            if accumulation == "divided":  # .grad: (1/k) sum over micro-batches of their (1/b) sum_i T(g_i)
                parts = [expected_grad({n: g[m] for n, g in ref.items()}, target_name, kind) for m in micro]
                expected = {n: sum(part[n] for part in parts) * 0.5 for n in expected}
            psm.zero_grad(set_to_none)
            hook.seen.clear()
            if step == penalty_at:  # pergrad tracks norms: the penalty's part cannot be split into samples
                xg = x[micro[0]].clone().requires_grad_(True)
                with pytest.raises(SecondOrderError):
                    out = psm(xg)
                    (gx,) = torch.autograd.grad(out.sum(), xg, create_graph=True)
                    penalised = (out - target[micro[0]]).pow(2).sum() + 0.1 * gx.square().sum()
                    (penalised * loss_scale).backward()
                return
            for m in micro:
                rows = x[m].shape[0]
                loss = (forward(x[m]) - target[m]).pow(2).sum() / rows
                if late is not None and step >= 2:
                    loss = loss + 0.1 * params[late].sum()  # a gradient of 0.1 everywhere, never 0
                    covered = kind != "none" and (
                        choice == "root"
                        or (choice == "module" and late.startswith(target_name + "."))
                        or (choice == "param" and late == target_name)
                    )
                    if covered or step == replace_at:  # (a rebound wrapper checks its next backward)
                        with pytest.raises(HookStateError, match=re.escape(f"parameter '{late}'")):
                            (loss * loss_scale).backward()
                        return
                    expected[late] = expected[late] + 0.1
                if kind == "in place" and not (target_name.startswith("aux.") and not model.use_aux):
                    with pytest.raises(TransformError, match=r"modified its input .* in place"):
                        (loss * loss_scale).backward()
                    return
                (loss * loss_scale * (0.5 if accumulation == "divided" else 1.0)).backward()
            last = micro[-1]
            norms = psm.per_sample_norms()
            reached = [n for n in always if n != late] + [
                n for n in trainable if n.startswith("aux.") and model.use_aux
            ]
            for name, p in model.named_parameters():
                assert type(p) is nn.Parameter
                if not p.requires_grad:
                    assert p.grad is None and not hasattr(p, "grad_sample")
                    continue
                if name.startswith("aux.") and not model.use_aux:  # not reached: left as zero_grad left it
                    assert (p.grad is None or not p.grad.any()) and not hasattr(p, "grad_sample"), name
                    continue
                if keep:
                    assert_close(p.grad_sample, ref[name][last], f"{what}: grad_sample of {name} in {spec}")
                assert_close(p.grad / loss_scale, expected[name], f"{what}: .grad of {name} in {spec}")
                assert_close(norms[name], ref[name][last].flatten(1).norm(dim=1), f"{what}: norm of {name} in {spec}")
            if hook.kind != "none" and hook_name:
                assert len(hook.seen) == 1, f"{what}: the {hook.kind} hook on {hook_name} ran {len(hook.seen)} times"
                want = ref[hook_name].mean(0) if hook.kind == "tensor" else expected[hook_name]
                got = hook.seen[0] / loss_scale
                assert_close(got, want, f"{what}: what the {hook.kind} hook on {hook_name} saw")
            # a partial backward after the step: torch.autograd.grad of one parameter (captum's way) gives
            # autograd's gradient, or refuses a weight pergrad runs detached; .grad is left alone
            if probe and reached:
                asked = data.draw(st.sampled_from(reached), label=f"autograd.grad of, after step {step}")
                before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
                again = (psm(x[last]) - target[last]).pow(2).sum() / x[last].shape[0]
                try:
                    (got,) = torch.autograd.grad(again, [params[asked]])
                except DetachedWeightError:
                    pass
                else:
                    assert_close(got, ref[asked][last].mean(0), f"{what}: autograd.grad of {asked}")
                for name, p in model.named_parameters():
                    assert (p.grad is None) == (before[name] is None), name
                    if p.grad is not None:
                        assert torch.equal(p.grad, before[name]), f"{what}: autograd.grad changed .grad of {name}"
