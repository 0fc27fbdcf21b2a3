"""What pergrad keeps between steps is bounded by one step's worth, whatever shapes arrive (issue 12).

DP-SGD draws each batch by Poisson sampling (its size changes every step, 0 and 1 included),
sequence models are padded to each batch's longest sequence, and evaluation runs batches of other
sizes. These tests count the bytes of tensor memory pergrad's own structures keep alive after every
step (``tests.reference.held_bytes``: the buffer pool, ``grad_sample``, any kept state), never time
or RSS, and check every step's numbers against torch.func in float64.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pergrad import HookStateError, PerSampleModule, transforms
from pergrad._core.memory.pool import SLACK, BufferPool
from tests.reference import assert_close, held_bytes, reference_grad_sample
from tests.test_every_step import expected_grads

VOCAB = 13


class Seq(nn.Module):
    """Tokens -> embedding -> Linear -> LayerNorm -> Linear, on every position ([B, T] -> [B, T, 3])."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.inp(self.emb(idx)))))


def squared(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``sum_i f_i`` with ``f_i`` the squared error over sample i's positions."""
    return (out - target).pow(2).sum()


def batch(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (b, t), generator=gen), torch.randn(b, t, 3, generator=gen, dtype=torch.float64)


def schedule(steps: int, seed: int) -> list[tuple[int, int]]:
    """(batch size, length) per step: Poisson sampling (expected batch 4 of 40) and lengths 1..24,
    on both sides of the 16 positions from which layers run detached; sizes 0 and 1 included."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.distributions.Binomial(40, torch.tensor(0.1)).sample((steps,)).long().tolist()
    sizes[3], sizes[7] = 0, 1  # the sampler's rare draws, on purpose
    lengths = torch.randint(1, 25, (steps,), generator=gen).tolist()
    return list(zip(sizes, lengths, strict=True))


CONFIGS = {
    "materialised, root clipping": dict(keep=True, transform="clip"),
    "materialised, no transform": dict(keep=True, transform=None),
    "fused root clipping": dict(keep=False, transform="clip"),
    "fused norms, a built transform": dict(keep=False, transform="square"),
}


def wrap(model: nn.Module, keep: bool, transform: str | None) -> PerSampleModule:
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=True)
    if transform == "clip":
        psm.register_transform(model, transforms.clip_norm(0.5))
    elif transform == "square":
        psm.register_transform(model.inp, transforms.square())
    return psm


def expected(ref: dict[str, torch.Tensor], transform: str | None) -> dict[str, torch.Tensor]:
    if transform != "square":
        return expected_grads(ref, 0.5 if transform == "clip" else None)
    return {k: (g.square() if k.startswith("inp.") else g).mean(0) for k, g in ref.items()}


def step(psm: PerSampleModule, x: torch.Tensor, y: torch.Tensor) -> None:
    psm.zero_grad()
    (squared(psm(x), y) / max(x.shape[0], 1)).backward()


def one_step_worth(model: nn.Module, keep: bool, transform: str | None, b: int, t: int) -> int:
    """What a fresh wrapper holds after ONE step of ``b`` samples of length ``t``."""
    model = copy.deepcopy(model)
    with wrap(model, keep, transform) as psm:
        step(psm, *batch(b, t, torch.Generator().manual_seed(1)))
        return held_bytes(psm)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_memory_stays_within_one_step_over_changing_shapes(config: str) -> None:
    """30 steps of Poisson batch sizes (0 and 1 among them) and changing lengths, with evaluation
    batches larger than any training batch in between: after every step pergrad holds no more than
    the pool's bound (``pergrad._core.memory.pool``): what a fresh wrapper holds after one step of the largest of
    those shapes, with each per-sample tensor in a block up to ``SLACK`` times its size (a block
    that served another shape before; a fresh wrapper allocates exact sizes). Every step is exact."""
    keep, transform = CONFIGS[config]["keep"], CONFIGS[config]["transform"]
    torch.manual_seed(0)
    model = Seq().double()
    steps = schedule(30, seed=0)
    b_max, t_max = max(b for b, _ in steps), max(t for _, t in steps)
    bound = max(one_step_worth(model, keep, transform, b, t) for b, t in set(steps))
    model_at_start = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    held = []
    with wrap(model, keep, transform) as psm:
        for i, (b, t) in enumerate(steps):
            x, y = batch(b, t, gen)
            step(psm, x, y)
            what = f"step {i} (B={b}, T={t})"
            if b == 0:
                assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), what
            else:
                ref = reference_grad_sample(model, x, y, loss=squared)
                want = expected(ref, transform)
                norms = psm.per_sample_norms()
                for name, p in model.named_parameters():
                    assert_close(p.grad, want[name], f".grad of {name}, {what}")
                    assert_close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {name}, {what}")
                    if keep:
                        assert_close(p.grad_sample, ref[name], f"grad_sample of {name}, {what}")
            if i % 5 == 4:  # evaluation: larger batches and lengths than training ever sees
                with torch.no_grad():
                    psm(batch(2 * b_max, t_max + 8, gen)[0])
                psm(batch(2 * b_max + 1, t_max + 4, gen)[0])  # a forward with grad, never backpropagated
            held.append(held_bytes(psm))
            assert held[-1] <= SLACK * bound, f"{what}: pergrad holds {held[-1]} bytes, its largest step alone {bound}"
    assert held[0] == one_step_worth(model_at_start, keep, transform, *steps[0])  # the same count


@pytest.mark.parametrize("keep", [True, False])
def test_constant_shapes_write_into_the_same_memory_every_step(keep: bool) -> None:
    """The reuse that makes constant shapes fast: from the second step on, no new memory."""
    torch.manual_seed(0)
    model = Seq().double()
    gen = torch.Generator().manual_seed(0)
    with wrap(model, keep, "clip") as psm:
        seen = []
        for _ in range(5):
            step(psm, *batch(6, 20, gen))
            blocks = sorted(b.data.data_ptr() for b in psm._engine.pool._blocks)
            weights = [model.emb.weight, model.inp.weight, model.head.weight]  # their rules write with out=
            pointers = [p.grad_sample.data_ptr() for p in weights] if keep else []
            seen.append((blocks, pointers, held_bytes(psm)))
        assert seen[1][0]  # the pool serves this model
        assert seen[2:] == [seen[1]] * 3


def test_a_grad_sample_held_by_the_user_keeps_its_values() -> None:
    """Memory something else refers to is never handed out again: a ``grad_sample`` kept from the
    previous step still holds that step's values, and the pool forgets it (it is the user's now)."""
    torch.manual_seed(0)
    model = Seq().double()
    gen = torch.Generator().manual_seed(0)
    steps = [(5, 20), (5, 20), (3, 9), (6, 22), (6, 22)]
    bound = max(one_step_worth(model, True, "clip", b, t) for b, t in set(steps))
    kept: dict[str, torch.Tensor] = {}
    kept_ref: dict[str, torch.Tensor] = {}
    with wrap(model, True, "clip") as psm:
        for i, (b, t) in enumerate(steps):
            x, y = batch(b, t, gen)
            step(psm, x, y)
            for name, g in kept.items():
                assert_close(g, kept_ref[name], f"grad_sample of {name} kept from step {i - 1}, after step {i}")
            ref = reference_grad_sample(model, x, y, loss=squared)
            for name, p in model.named_parameters():
                assert_close(p.grad_sample, ref[name], f"grad_sample of {name}, step {i}")
            kept = {name: p.grad_sample for name, p in model.named_parameters()}
            kept_ref = ref
            assert held_bytes(psm) <= SLACK * bound


# -- the pool alone ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 40), st.sampled_from([torch.float32, torch.float64]), st.booleans()), max_size=6
        ),
        min_size=1,
        max_size=12,
    )
)
def test_pool_never_lends_memory_in_use_and_keeps_within_its_limit(
    passes: list[list[tuple[int, torch.dtype, bool]]],
) -> None:
    """Random backward passes: each asks for tensors of random sizes and dtypes and holds some of
    them (as ``grad_sample`` or a user would). A tensor handed out keeps its values while held;
    after every pass the pool holds at most ``limit`` bytes of free blocks and blocks serving that
    pass (or no free block at all), and ``limit`` is the most bytes one pass asked for."""
    pool = BufferPool()
    held: list[tuple[torch.Tensor, float]] = []
    most = 0
    for i, requests in enumerate(passes):
        held = [(t, v) for t, v in held if (i + int(v)) % 3]  # let some go, after one or more passes
        pool.begin()
        asked = 0
        for j, (n, dtype, keep) in enumerate(requests):
            t = pool.take((n, 2), torch.empty(0, dtype=dtype))
            asked += t.nbytes
            value = float(100 * i + j)
            t.fill_(value)
            if keep:
                held.append((t, value))
        pool.end()
        most = max(most, asked)
        assert pool.limit == most
        for t, value in held:
            assert bool((t == value).all()), f"pass {i}: a held tensor was overwritten"
        blocks = pool._blocks
        free = sum(b.data.nbytes for b in blocks if b.free)
        serving = sum(b.data.nbytes for b in blocks if not b.free and b.round == pool._round)
        assert free + serving <= pool.limit or free == 0, (free, serving, pool.limit)
        assert all(b.free or b.round == pool._round for b in blocks), "memory held from an earlier pass"


# -- nothing of a step outlives it ------------------------------------------------------------------------


def leak_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    from tests.test_checkpointing import Positions
    from tests.test_projection import Attention
    from tests.test_shared import Buckets, NanoGPT, RawParameters

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 18), generator=gen)
    floats = torch.randn(3, 18, 4, generator=gen, dtype=torch.float64)
    wider = torch.randn(3, 18, 5, generator=gen, dtype=torch.float64)
    return {
        "shared positions, tied head": (NanoGPT(vocab=VOCAB), ids),
        "relative position buckets": (Buckets(), floats),
        "raw parameters": (RawParameters(), floats),
        # (reentrant checkpointing computes its segment again outside the forward pergrad follows: positions before it)
        "shared positions, reentrant checkpointing": (Positions(reentrant=True, inside=False), wider),
        "shared positions, checkpointing": (Positions(reentrant=False), wider),
        "multi-head attention": (Attention(), floats),
    }


def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        (name, mode)
        for name in leak_models()
        for mode in ["hooks", "grad_sample", "clip", "features", "second order"]
        if not (name == "multi-head attention" and mode == "second order")  # (SDPA's backward is not differentiable)
    ],
)
def test_no_step_leaves_tensors_behind(name: str, mode: str) -> None:
    """Eight steps of the same shapes, each with a forward whose graph is dropped unused and one without
    grad beside it: after the last as many tensors are alive as after the second. (A hook on an
    autograd node that holds, through what it closes over, a tensor whose graph holds that node makes a
    cycle Python's gc cannot collect: such a step's call, inputs and graph would stay for good.)"""
    torch.manual_seed(0)
    model, x = leak_models()[name]
    model = model.double()
    psm = PerSampleModule(model, keep_grad_sample=mode in ("grad_sample", "second order"), track_norms=True)
    if mode == "clip":
        psm.register_transform(model, transforms.clip_norm(0.5))
    if mode == "features":
        psm.register_projection(model, dim=8, grads=False)

    def output() -> torch.Tensor:
        return psm(x).square().sum()

    earlier = live_tensors()  # (held: kept out of the counts, whatever earlier tests leave to be freed)
    known = {id(t) for t in earlier}
    counts = []
    with psm:
        for step in range(8):
            psm.zero_grad()
            if mode == "second order":
                output().backward(create_graph=True)
                penalty = sum(p.grad_sample.square().sum() for p in model.parameters() if p.requires_grad)
                assert isinstance(penalty, torch.Tensor)
                penalty.backward()
                psm.zero_grad()
            else:
                output().backward()
            output()  # a forward with grad, never backpropagated
            with torch.no_grad():
                psm(x)
            if step in (1, 7):  # (a scan of every object: twice)
                counts.append(sum(id(t) not in known for t in live_tensors()))
    assert counts[0] == counts[1], f"{counts[1] - counts[0]} more tensors alive after 6 more steps"


class Mixed(nn.Module):
    """Tokens -> embedding -> Linear -> LayerNorm -> Conv1d over the positions -> Linear ([B, T] -> [B, T, 3]):
    every way pergrad holds a call (a bias or pergrad's zero standing in as the anchor, or added to the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.inp(self.emb(idx))))
        return self.head(torch.tanh(self.conv(h.transpose(1, 2)).transpose(1, 2)))


MODES = ["hooks", "grad_sample", "norms", "clip", "features", "features and grads"]


def wrap_in_mode(model: nn.Module, mode: str) -> PerSampleModule:
    """``model`` wrapped for one of ``MODES``: hooks alone, ``grad_sample``, norms, clipping, or features
    (with or without ``.grad``)."""
    psm = PerSampleModule(model, keep_grad_sample=mode == "grad_sample", track_norms=mode == "norms")
    if mode == "clip":
        psm.register_transform(model, transforms.clip_norm(0.5))
    if mode.startswith("features"):
        psm.register_projection(model, dim=8, grads=mode == "features and grads")
    return psm


@pytest.mark.parametrize("mode", MODES)
def test_a_loop_that_keeps_its_loss_keeps_no_layer_input(mode: str) -> None:
    """A training loop keeps its ``loss`` (and with it the autograd graph) until the next step's is
    made, after that step's forward. Autograd lets go of what the graph saved as the backward runs;
    pergrad lets go of each layer's input as well (it would otherwise stay alive through the next
    forward, doubling what the forward holds). Every step, first and later (layers run detached from
    the second), both sides of 16 positions."""
    torch.manual_seed(0)
    model = Mixed().double()
    psm = wrap_in_mode(model, mode)
    inputs: list[weakref.ref[torch.Tensor]] = []
    handles = [
        layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
        for layer in (model.inp, model.norm, model.conv, model.head)  # (the embedding's are the loop's own ids)
    ]
    loss = None
    for step, length in enumerate([5, 20, 3, 17]):
        ids = torch.randint(0, VOCAB, (4, length))
        inputs.clear()
        loss = psm(ids).square().sum()
        loss.backward()
        gc.collect()
        alive = [i for i, ref in enumerate(inputs) if ref() is not None]
        assert not alive, f"step {step}: the inputs of calls {alive} are alive after the backward"
    assert loss is not None
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_a_step_leaves_no_reference_cycle(mode: str) -> None:
    """Everything a step makes is freed by reference counting, as plain autograd's is: no cycle is left
    for Python's collector, whose full collections (tens of ms over a process's objects) come sooner
    the more a loop leaves to it. Counted with the collector off, over steps first and later, both
    sides of 16 positions, the loss kept past the backward as a loop keeps it, the batches held by the
    loop (a dataset in memory)."""
    torch.manual_seed(0)
    model = Mixed().double()
    psm = wrap_in_mode(model, mode)
    batches = [torch.randint(0, VOCAB, (4, length)) for length in [5, 20, 3, 17]]
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for ids in batches:
            psm.zero_grad()
            loss = psm(ids).square().sum()
            loss.backward()
            if mode == "norms":
                psm.per_sample_norms()
            if mode.startswith("features"):
                psm.per_sample_projections()
        del loss
        found = gc.collect()
    finally:
        if was:
            gc.enable()
    assert found == 0, f"{found} objects in reference cycles after 4 steps"


def test_a_second_backward_through_a_freed_graph_is_refused() -> None:
    """A second backward through a call whose node the first freed (no ``retain_graph=True``): autograd
    would refuse at that node; pergrad refuses first (it let go of the call's input), saying what to do.
    With ``retain_graph=True`` the second backward adds the same again, as autograd does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with PerSampleModule(model) as psm:
        for _ in range(2):  # the first backward (checked against autograd) and a later one (weights detached)
            psm.zero_grad()
            out = psm(x)
            out.sum().backward(retain_graph=True)
            once = {n: p.grad_sample.clone() for n, p in model.named_parameters()}
            out.sum().backward()
            for n, p in model.named_parameters():
                assert_close(p.grad_sample, 2 * once[n], n)
            with pytest.raises(HookStateError, match=r"layer '2' \(Linear\).*Pass retain_graph=True"):
                out.sum().backward()  # (sum's node saves nothing: the first node it reaches is the layer's)


@pytest.mark.parametrize("mode", ["hooks", "head clipped"])
def test_the_first_backwards_check_lets_go_of_each_layer_once_it_agreed(mode: str) -> None:
    """The first backward's check compares each parameter's summed per-sample gradients with autograd's
    as its ``AccumulateGrad`` runs, so a layer's ``(a, d)`` that no consumer reads is let go as the backward
    moves on, as autograd lets go of what it saved, instead of every layer's being held to the end (which
    doubled the first step's peak memory). Read when the input's gradient arrives, at the end of the graph:
    no later layer's input is alive but the one a transform reads, on the first step and later ones;
    ``.grad`` exact on each."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.Tanh())], nn.Linear(6, 3)).double()
    psm = PerSampleModule(model, keep_grad_sample=False)
    if mode == "head clipped":
        psm.register_transform("8", transforms.clip_norm(0.3))
    inputs: list[weakref.ref[torch.Tensor]] = []
    for layer in list(model)[2::2]:
        layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    for step, b in enumerate([5, 3, 5]):
        x, y = torch.randn(b, 6, dtype=torch.float64), torch.randint(0, 3, (b,))
        ref = reference_grad_sample(model, x.detach(), y, loss=nn.functional.cross_entropy)
        head = {k: g for k, g in ref.items() if k.startswith("8.")} if mode == "head clipped" else {}
        expected = {k: g.mean(0) for k, g in ref.items()} | (expected_grads(head, 0.3) if head else {})
        inputs.clear()
        alive: list[int] = []

        def read(g: torch.Tensor, alive: list[int] = alive) -> None:
            alive.extend(i for i, ref in enumerate(inputs) if ref() is not None)

        x.requires_grad_(True)
        x.register_hook(read)
        psm.zero_grad()
        nn.functional.cross_entropy(psm(x), y).backward()
        kept = [3] if mode == "head clipped" else []  # the clipped head's, which its transform reads at the end
        assert alive == kept, f"step {step}: the inputs of layers {alive} were alive at the end of the backward"
        for name, p in model.named_parameters():
            assert_close(p.grad, expected[name], f"step {step}: {name}")


def test_the_first_backwards_check_as_it_runs_still_refuses_a_regulariser() -> None:
    """A term of the loss that uses a weight directly: its layer's sums disagree when its ``AccumulateGrad``
    runs, and the first backward refuses it at its end, naming the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    psm = PerSampleModule(model, keep_grad_sample=False)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss = nn.functional.cross_entropy(psm(x), y) + 0.1 * model[0].weight.square().sum()
    with pytest.raises(HookStateError, match=r"parameter '0\.weight': its gradient has a part that no hooked layer"):
        loss.backward()


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("detach", [True, False])
def test_a_dropped_wrapper_and_its_model_are_collected(keep: bool, verify: bool, detach: bool) -> None:
    """A notebook that wraps a new model and drops the old one without ``remove()``: once neither is
    referenced, the collector frees them, after steps with a transform (the taps, the detaching shortcut's
    zero anchor and the ``AccumulateGrad`` pre-hooks are held by autograd, whose references Python's
    collector cannot follow: none of them holds the wrapper)."""

    def train() -> tuple[weakref.ref[PerSampleModule], weakref.ref[nn.Module]]:
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3, bias=False)).double()
        psm = PerSampleModule(model, keep_grad_sample=keep, verify=verify, detach_transformed=detach)
        psm.register_transform(model, transforms.clip_norm(1.0))
        for b in (5, 3):
            psm.zero_grad()
            psm(torch.randn(b, 4, dtype=torch.float64)).square().sum().backward()
        return weakref.ref(psm), weakref.ref(model)

    wrapper, model = train()
    gc.collect()
    assert wrapper() is None and model() is None, "the dropped wrapper (or its model) is still alive"


@pytest.mark.parametrize("verify", [True, False])
def test_a_wrapper_the_user_does_not_keep_still_clips_every_step(verify: bool) -> None:
    """``PerSampleModule(model).register_transform(...)`` without keeping the wrapper, training the model
    itself: its hooks on the model keep the wrapper's engine alive (the hooks autograd holds refer to it
    weakly), so every step's ``.grad`` is the clipped mean, with a collection between steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    PerSampleModule(model, keep_grad_sample=False, verify=verify).register_transform(model, transforms.clip_norm(0.3))
    for step, b in enumerate([5, 3, 5, 4]):
        gc.collect()
        x, y = torch.randn(b, 4, dtype=torch.float64), torch.randn(b, 3, dtype=torch.float64)
        ref = reference_grad_sample(model, x, y)
        expected = expected_grads(ref, 0.3)
        model.zero_grad()
        (model(x) - y).square().sum(1).mean().backward()
        for name, p in model.named_parameters():
            assert_close(p.grad, expected[name], f"step {step}: {name}")
