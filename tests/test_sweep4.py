"""Sweep 4: user habits over several optimizer steps, each step against an independent float64 reference.

The reference is a plain copy of the model (never wrapped), trained in lockstep: for each sample i its own
loss alone, autograd, then the transform applied by hand; the copy's optimizer steps on that reference mean.
"""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pergrad
from pergrad import PerSampleModule, transforms

REORDERED = (
    "reordered or mixed the samples along the batch dim"  # (the refusal of a batch reordered inside the forward)
)

pytestmark = pytest.mark.usefixtures("float64")

ATOL = 1e-9


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def sample_grads(ref, xs, loss_one):
    """[{name: g_i}] for each sample: a plain backward of sample i's own loss on the unwrapped copy."""
    out = []
    for args in xs:
        ref.zero_grad(set_to_none=True)
        loss_one(ref, *args).backward()
        out.append(
            {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in _trainable(ref).items()}
        )
    ref.zero_grad(set_to_none=True)
    return out


def clip_mean(grads, bound, names=None, reduction="mean"):
    """(1/B) sum_i min(1, C/||g_i||) g_i, the norm over ``names`` (all by default); others plain mean."""
    names = list(grads[0]) if names is None else names
    total = {n: torch.zeros_like(g) for n, g in grads[0].items()}
    for g in grads:
        norm = torch.sqrt(sum(g[n].square().sum() for n in names))
        f = min(1.0, bound / norm.item()) if norm > 0 else 1.0
        for n in g:
            total[n] += g[n] * (f if n in names else 1.0)
    div = len(grads) if reduction == "mean" else 1
    return {n: t / div for n, t in total.items()}


def assert_grads(model, expected, step, names=None):
    for n, p in _trainable(model).items():
        if names is not None and n not in names:
            continue
        assert p.grad is not None, f"step {step}: {n}.grad is None"
        err = (p.grad - expected[n]).abs().max().item()
        assert err < ATOL * max(1.0, expected[n].abs().max().item()), f"step {step}: {n} off by {err}"


def set_ref_grads(ref, expected):
    for n, p in _trainable(ref).items():
        p.grad = None if expected[n] is None else expected[n].clone()


def assert_same_params(model, ref, step):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        err = (p - q).abs().max().item()
        assert err < 1e-8, f"step {step}: parameter {n} drifted by {err}"


def ce_one(m, x, y):
    return F.cross_entropy(m(x), y)


def split(x, y):
    return [(x[i : i + 1], y[i : i + 1]) for i in range(x.shape[0])]


class MLP(nn.Module):
    def __init__(self, d=6, h=8, k=3, inplace=True):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, k)
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, x):
        x = x.view(x.shape[0], 6)  # flatten [B, 2, 3] (-1 fails on an empty Poisson batch)
        h = self.act(self.fc1(x))
        r = self.fc2(h)
        r += h  # in-place residual add on a layer's output, then an in-place ReLU on it
        return self.fc3(self.act(r))


def train_loop(
    model,
    batches,
    *,
    bound=0.5,
    opt=lambda ps: torch.optim.SGD(ps, lr=0.1),
    loss_batch=lambda out, y: F.cross_entropy(out, y),
    loss_one=ce_one,
    wrap_kwargs=None,
    target=None,
    between=None,
):
    """Wrap, clip, train len(batches) steps; every step's .grad against the reference copy."""
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False, **(wrap_kwargs or {}))
    psm.register_transform(model if target is None else target, transforms.clip_norm(bound))
    o, ro = opt(model.parameters()), opt(ref.parameters())
    clipped = 0
    for step, (x, y) in enumerate(batches):
        if between is not None:
            between(step, model, ref, psm, o, ro)
        grads = sample_grads(ref, split(x, y), loss_one)
        clipped += sum(torch.sqrt(sum(v.square().sum() for v in g.values())) > bound for g in grads)
        expected = clip_mean(grads, bound)
        o.zero_grad()
        loss_batch(psm(x), y).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)
    assert clipped > 0, "the bound clipped no sample: the test would not see clipping"
    return psm, ref


def cls_batches(sizes, shape=(2, 3), k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, *shape, generator=g), torch.randint(0, k, (b,), generator=g)) for b in sizes]


# ---------------------------------------------------------------- habits of the forward


def test_inplace_relu_inplace_residual_and_view_flatten_with_changing_batch_sizes():
    """MLP with ReLU(inplace), `h += f(h)`, `x.view(B, -1)`; B = 3,1,6,2,5 over five SGD steps."""
    torch.manual_seed(0)
    train_loop(MLP(), cls_batches([3, 1, 6, 2, 5]))


def test_adamw_weight_decay_and_lr_scheduler():
    """AdamW with weight decay and a StepLR scheduler stepped each step; clipped mean every step."""
    torch.manual_seed(1)
    model = MLP()
    scheds = []

    def opt(ps):
        o = torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)
        scheds.append(torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7))
        return o

    def between(step, *_):
        if step:
            for s in scheds:
                s.step()

    train_loop(MLP(), cls_batches([4, 4, 3, 5, 2, 4]), opt=opt, between=between)
    del model


def test_torch_where_and_masking_in_the_forward():
    """A forward with torch.where on the activations and a boolean mask multiplied in; SGD momentum."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            x = x.flatten(1)
            h = self.a(x)
            h = torch.where(h > 0, h, 0.1 * h.square())
            mask = (x[:, :1] > 0).to(h.dtype)
            return self.b(h * mask + h.tanh() * (1 - mask))

    torch.manual_seed(2)
    train_loop(M(), cls_batches([4, 5, 3, 4]), opt=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


# ---------------------------------------------------------------- sequence layers


class Encoder(nn.Module):
    def __init__(self, batch_first=True, norm_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(3, 8)
        self.layer = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=12, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x, pad=None):  # x [B, T, 3] batch first
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.layer(h, src_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.out(h.mean(1))


def seq_batches(sizes, t=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, t, 3, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_norm_first_over_steps(batch_first):
    """TransformerEncoderLayer(norm_first=True), batch_first True/False, Adam, B = 3,2,4,1."""
    torch.manual_seed(4)
    train_loop(Encoder(batch_first), seq_batches([3, 2, 4, 1]), opt=lambda ps: torch.optim.Adam(ps, lr=0.01))


class Padded(nn.Module):
    """Self-attention with a per-sample key_padding_mask derived from the input (trailing zeros are padding)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8, padding_idx=0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, tok):
        pad = tok == 0
        h = self.emb(tok)
        a, _ = self.attn(h, h, h, key_padding_mask=pad, need_weights=False)
        keep = (~pad).unsqueeze(-1).to(a.dtype)
        return self.out((a * keep).sum(1) / keep.sum(1))


def tok_batches(sizes, t=5, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in sizes:
        tok = torch.randint(1, 7, (b, t), generator=g)
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        tok[torch.arange(t) >= lengths[:, None]] = 0
        out.append((tok, torch.randint(0, 3, (b,), generator=g)))
    return out


def test_multihead_attention_with_key_padding_mask_and_padding_idx_embedding():
    """Embedding(padding_idx=0) -> MHA(key_padding_mask) -> masked mean; padded lengths differ per sample."""
    torch.manual_seed(6)
    train_loop(Padded(), tok_batches([3, 4, 2, 5]), opt=lambda ps: torch.optim.Adam(ps, lr=0.02))


class SeqFirstGRU(nn.Module):
    def __init__(self, kind=nn.GRU):
        super().__init__()
        self.rnn = kind(3, 5, num_layers=2)
        self.out = nn.Linear(5, 3)

    def forward(self, x):  # [T, B, 3]
        h, _ = self.rnn(x)
        return self.out(h[-1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM])
def test_sequence_first_recurrent_model_wrapped_with_batch_first_false(kind):
    """A [T, B, D] model (nn.GRU/LSTM batch_first=False) wrapped with batch_first=False; B = 2,4,1."""
    torch.manual_seed(7)
    batches = [(x.transpose(0, 1).contiguous(), y) for x, y in seq_batches([2, 4, 1])]
    ref_one = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731

    def split_t(x, y):
        return [(x[:, i : i + 1], y[i : i + 1]) for i in range(x.shape[1])]

    model = SeqFirstGRU(kind)
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, batch_first=False, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.3))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step, (x, y) in enumerate(batches):
        expected = clip_mean(sample_grads(ref, split_t(x, y), ref_one), 0.3)
        o.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


class TiedLM(nn.Module):
    def __init__(self, v=9, d=6):
        super().__init__()
        self.emb = nn.Embedding(v, d, padding_idx=0)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, v, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return self.head(torch.tanh(self.mix(self.emb(tok))))


def test_tied_embedding_and_output_weights_with_a_per_token_sum_loss():
    """Tied LM, each sample's loss the sum of its tokens' CE over the sample's mean: (1/B) sum_i sum_t ce."""
    torch.manual_seed(8)
    g = torch.Generator().manual_seed(8)
    batches = []
    for b in [3, 2, 4]:
        tok = torch.randint(0, 9, (b, 5), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))

    def loss_batch(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / out.shape[0]

    train_loop(TiedLM(), batches, loss_batch=loss_batch, loss_one=lambda m, x, y: loss_batch(m(x), y), bound=1.0)


# ---------------------------------------------------------------- notebook habits


def test_remove_then_wrap_again_with_another_bound_continues_exactly():
    """Train 3 steps clipped at 0.5, psm.remove(), 2 plain steps, wrap again at 0.2, 3 more steps."""
    torch.manual_seed(9)
    model = MLP()
    ref = copy.deepcopy(model)
    o, ro = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = cls_batches([3, 4, 2, 5, 3, 4, 2, 3], seed=9)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.5))
    for step, (x, y) in enumerate(batches):
        if step == 3:
            psm.remove()
        if step == 5:
            psm = PerSampleModule(model)
            psm.register_transform("", transforms.clip_norm(0.2))
        wrapped = step < 3 or step >= 5
        grads = sample_grads(ref, split(x, y), ce_one)
        expected = clip_mean(grads, 0.5 if step < 3 else 0.2) if wrapped else clip_mean(grads, float("inf"))
        o.zero_grad()
        F.cross_entropy((psm if wrapped else model)(x), y).backward()
        assert_grads(model, expected, step)
        if step >= 5:
            for n, p in model.named_parameters():
                assert torch.allclose(p.grad_sample, torch.stack([g[n] for g in grads]), atol=1e-10)
        elif step in (3, 4):
            assert not any(hasattr(p, "grad_sample") for p in model.parameters())
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


def test_re_running_the_register_cell_is_refused_and_training_stays_exact():
    """Register clip_norm twice on the model (a re-run cell): a TargetError; the first transform stays."""
    torch.manual_seed(10)

    def between(step, model, ref, psm, o, ro):
        if step == 1:
            with pytest.raises(pergrad.TargetError, match="overlaps"):
                psm.register_transform(model, transforms.clip_norm(0.5))
            with pytest.raises(pergrad.PergradError, match="already wrapped"):
                PerSampleModule(model)

    train_loop(MLP(), cls_batches([3, 4, 2]), between=between)


class WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.bn(self.fc(x.flatten(1))))))


def test_eval_mode_training_with_train_mode_no_grad_passes_between_steps():
    """Steps in eval() (BatchNorm running stats, Dropout off); between steps model.train() and a no_grad
    pass of the inner model moves BN's running stats; a with-grad eval pass whose output is dropped."""
    torch.manual_seed(11)
    model = WithNorm()
    g = torch.Generator().manual_seed(11)

    def between(step, model, ref, psm, o, ro):
        xs = torch.randn(6, 2, 3, generator=g)
        for m in (model, ref):
            m.train()
            with torch.no_grad():
                m(xs)  # updates running stats
            m.eval()
        model(xs).sum()  # an evaluation with grad on, output dropped, inner model called directly
        psm(xs[:2])  # and one through the wrapper, dropped

    _, ref = train_loop(model, cls_batches([4, 3, 5, 2]), between=between)
    assert torch.allclose(model.bn.running_mean, ref.bn.running_mean)


def test_a_training_step_with_the_wrapper_in_train_mode_batchnorm_is_refused():
    """After eval() steps, psm.train() with BatchNorm: the next forward is refused naming BatchNorm."""
    torch.manual_seed(12)
    model = WithNorm().eval()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(1.0))
    x, y = cls_batches([4])[0]
    F.cross_entropy(psm(x), y).backward()
    psm.train()
    with pytest.raises(pergrad.PergradError, match=r"(?i)batchnorm"):
        F.cross_entropy(psm(x), y).backward()


# ---------------------------------------------------------------- optimizers and accumulation


def test_zero_grad_set_to_none_false_and_clip_grad_norm_after_pergrad():
    """optimizer.zero_grad(set_to_none=False), then clip_grad_norm_(0.05) on pergrad's clipped mean."""
    torch.manual_seed(13)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.5))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
    for step, (x, y) in enumerate(cls_batches([3, 5, 4, 2, 6])):
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.5)
        o.zero_grad(set_to_none=False)
        F.cross_entropy(psm(x), y).backward()
        assert_grads(model, expected, step)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        exp_total = torch.sqrt(sum(v.square().sum() for v in expected.values()))
        assert abs(total.item() - exp_total.item()) < 1e-10
        o.step()
        set_ref_grads(ref, expected)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ro.step()
        assert_same_params(model, ref, step)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulate_samples_over_micro_batches_of_different_sizes(set_to_none):
    """accumulate="samples": micro-batches of 1, 3, 2 then one step; .grad = full-batch clipped mean."""
    torch.manual_seed(14)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False, accumulate="samples")
    psm.register_transform(model, transforms.clip_norm(0.4))
    o, ro = torch.optim.Adam(model.parameters(), lr=0.02), torch.optim.Adam(ref.parameters(), lr=0.02)
    for step, (x, y) in enumerate(cls_batches([6, 6, 5, 4], seed=14)):
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.4)
        o.zero_grad(set_to_none=set_to_none)
        cuts = [0, 1, 4, x.shape[0]] if x.shape[0] > 4 else [0, 1, x.shape[0]]
        for a, b in itertools.pairwise(cuts):
            F.cross_entropy(psm(x[a:b]), y[a:b]).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)


def test_loss_divided_by_k_with_loss_scale_over_equal_micro_batches():
    """loss / k over k=3 equal micro-batches with loss_scale=1/3: .grad = full-batch clipped mean, C stays C."""
    torch.manual_seed(15)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False, loss_scale=1 / 3)
    psm.register_transform(model, transforms.clip_norm(0.4))
    o, ro = (
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.5),
    )
    for step, (x, y) in enumerate(cls_batches([6, 6, 6], seed=15)):
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.4)
        o.zero_grad()
        for a in range(0, 6, 2):
            (F.cross_entropy(psm(x[a : a + 2]), y[a : a + 2]) / 3).backward()
        assert_grads(model, expected, step)
        norms = psm.per_sample_norms()
        assert set(norms) >= {"fc1.weight"}
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


def test_frozen_and_unfrozen_layers_and_a_new_param_group_between_steps():
    """fc1 frozen for steps 1-2 (requires_grad_(False)), unfrozen at 3; fc3 put in a new param group at 2."""
    torch.manual_seed(16)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.3))
    head = lambda m: [m.fc3.weight, m.fc3.bias]  # noqa: E731
    body = lambda m: [p for n, p in m.named_parameters() if not n.startswith("fc3")]  # noqa: E731
    o, ro = torch.optim.SGD(body(model), lr=0.1), torch.optim.SGD(body(ref), lr=0.1)
    for step, (x, y) in enumerate(cls_batches([3, 4, 5, 2, 4], seed=16)):
        frozen = step in (1, 2)
        for m in (model, ref):
            m.fc1.requires_grad_(not frozen)
        if step == 2:
            o.add_param_group({"params": head(model), "lr": 0.5})
            ro.add_param_group({"params": head(ref), "lr": 0.5})
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.3)
        model.zero_grad()  # fc3 is in no optimizer before step 2
        F.cross_entropy(psm(x), y).backward()
        assert_grads(model, expected, step)
        if frozen:
            assert model.fc1.weight.grad is None
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)


# ---------------------------------------------------------------- checkpoints, copies, dtypes


def test_state_dict_round_trip_through_torch_save_mid_training():
    """At step 2: torch.save(model.state_dict()) to bytes, perturb, load it back (plain and via the wrapper)."""
    torch.manual_seed(17)

    def between(step, model, ref, psm, o, ro):
        if step in (2, 4):
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": o.state_dict()}, buf)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            buf.seek(0)
            state = torch.load(buf)
            (model if step == 2 else psm).load_state_dict(state["model"])
            o.load_state_dict(state["opt"])

    train_loop(MLP(), cls_batches([3, 4, 2, 5, 3, 4]), opt=lambda ps: torch.optim.Adam(ps, lr=0.02), between=between)


def test_load_state_dict_assign_true_mid_training():
    """load_state_dict(..., assign=True) replaces the parameters; the optimizer is rebuilt on them."""
    torch.manual_seed(18)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.5))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(cls_batches([3, 4, 5, 2, 3], seed=18)):
        if step == 2:
            sd = {k: v.clone() * 0.9 for k, v in model.state_dict().items()}
            model.load_state_dict(sd, assign=True)
            ref.load_state_dict({k: v.clone() for k, v in sd.items()})
            o = torch.optim.SGD(model.parameters(), lr=0.1)
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.5)
        o.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)


def test_deepcopy_of_the_wrapped_model_is_plain_and_the_original_stays_clipped():
    """copy.deepcopy(model) mid-training trains with plain autograd; the wrapped original stays clipped."""
    torch.manual_seed(19)
    copies = []

    def between(step, model, ref, psm, o, ro):
        if step == 2:
            copies.append(copy.deepcopy(model))
        if copies:
            twin = copies[0]
            x, y = cls_batches([4], seed=step)[0]
            plain = copy.deepcopy(twin)
            twin.zero_grad()
            F.cross_entropy(twin(x), y).backward()
            F.cross_entropy(plain(x), y).backward()
            for p, q in zip(twin.parameters(), plain.parameters(), strict=True):
                assert torch.allclose(p.grad, q.grad, atol=1e-12)
            assert not any(hasattr(p, "grad_sample") for p in twin.parameters())

    train_loop(MLP(), cls_batches([3, 4, 2, 5, 3]), between=between)


def test_float_then_double_between_steps():
    """model.float() at step 2, model.double() at step 4 (new parameter tensors); optimizer rebuilt each time."""
    torch.manual_seed(20)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.5))
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(cls_batches([3, 4, 5, 2, 3, 4], seed=20)):
        if step == 2:
            model.float()
            ref.float()
        if step == 4:
            model.double()
            ref.double()
            ref.load_state_dict(model.state_dict())  # the float32 steps differ in rounding: resync
        if step in (2, 4):
            o = torch.optim.SGD(model.parameters(), lr=0.1)
            ro = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = x.to(next(model.parameters()).dtype)
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.5)
        o.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        tol = 1e-5 if x.dtype == torch.float32 else 1e-10
        for n, p in model.named_parameters():
            assert p.grad.dtype == p.dtype
            assert (p.grad - expected[n]).abs().max() < tol, (step, n)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


# ---------------------------------------------------------------- losses


def test_sum_loss_declared_with_loss_reduction_sum_and_mean_reduction():
    """loss_reduction="sum" (F.cross_entropy(reduction="sum")), reduction="mean": .grad = (1/B) sum clip(g_i)."""
    torch.manual_seed(21)
    train_loop(
        MLP(),
        cls_batches([3, 5, 2, 4]),
        loss_batch=lambda out, y: F.cross_entropy(out, y, reduction="sum"),
        wrap_kwargs={"loss_reduction": "sum", "reduction": "mean"},
    )


def test_sum_loss_with_sum_reduction():
    """loss_reduction="sum" and reduction="sum": .grad = sum_i clip(g_i)."""
    torch.manual_seed(22)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False, loss_reduction="sum")
    psm.register_transform(model, transforms.clip_norm(0.5))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for step, (x, y) in enumerate(cls_batches([3, 5, 2, 4], seed=22)):
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.5, reduction="sum")
        o.zero_grad()
        F.cross_entropy(psm(x), y, reduction="sum").backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


def test_per_sample_weighted_loss():
    """loss = (w * ce(reduction='none')).mean(), w fixed per sample: f_i = w_i ce_i."""
    torch.manual_seed(23)
    g = torch.Generator().manual_seed(23)
    batches = [(x, (y, torch.rand(x.shape[0], generator=g) * 2)) for x, y in cls_batches([3, 4, 5, 2])]

    def loss_batch(out, yw):
        y, w = yw
        return (w * F.cross_entropy(out, y, reduction="none")).mean()

    def split_w(x, yw):
        y, w = yw
        return [(x[i : i + 1], (y[i : i + 1], w[i : i + 1])) for i in range(x.shape[0])]

    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.3))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, yw) in enumerate(batches):
        expected = clip_mean(sample_grads(ref, split_w(x, yw), lambda m, xi, ywi: loss_batch(m(xi), ywi)), 0.3)
        o.zero_grad()
        loss_batch(psm(x), yw).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x.flatten(1)))
        return {"logits": self.cls(h), "aux": self.aux(h)}


def test_model_returning_a_dict_with_an_unused_head_and_a_loss_on_a_subset_of_logits():
    """Model returns {"logits", "aux"}; loss uses logits[:, :2] only; aux.* get no gradient (stay None)."""
    torch.manual_seed(24)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.2))

    def loss(out, y):
        return F.cross_entropy(out["logits"][:, :2], y % 2)

    o, ro = torch.optim.SGD(model.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
    for step, (x, y) in enumerate(cls_batches([3, 4, 1, 5], seed=24)):
        grads = sample_grads(ref, split(x, y), lambda m, xi, yi: loss(m(xi), yi))
        expected = clip_mean(grads, 0.2)
        o.zero_grad()
        loss(psm(x), y).backward()
        for n, p in model.named_parameters():
            if n.startswith("aux"):
                assert p.grad is None, n
            else:
                assert (p.grad - expected[n]).abs().max() < 1e-10, (step, n)
        o.step()
        set_ref_grads(ref, {n: (None if n.startswith("aux") else v) for n, v in expected.items()})
        ro.step()
        assert_same_params(model, ref, step)


def test_a_run_of_batch_size_one_steps_between_larger_ones():
    """B = 1,1,1,4,1,2: clipping of a single sample is min(1, C/||g||) g exactly."""
    torch.manual_seed(25)
    train_loop(MLP(), cls_batches([1, 1, 1, 4, 1, 2]), opt=lambda ps: torch.optim.Adam(ps, lr=0.05))


# ---------------------------------------------------------------- other transforms and targets


def generic_loop(model, batches, register, expect, *, keep=False, steps_opt=None, check=None, wrap_kwargs=None):
    """Wrap, ``register(psm, model)``; each step .grad against ``expect(per-sample grads, batch size)``."""
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=keep, **(wrap_kwargs or {}))
    register(psm, model)
    mk = steps_opt or (lambda ps: torch.optim.SGD(ps, lr=0.1))
    o, ro = mk(model.parameters()), mk(ref.parameters())
    for step, (x, y) in enumerate(batches):
        grads = sample_grads(ref, split(x, y), ce_one)
        expected = expect(grads, step)
        o.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        assert_grads(model, expected, step)
        if check is not None:
            check(psm, model, grads, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)
    return psm


def _norm(g, names):
    return torch.sqrt(sum(g[n].square().sum() for n in names))


@pytest.mark.parametrize("keep", [False, True])
def test_normalize_on_the_whole_model(keep):
    """transforms.normalize(1e-3) on the model: .grad = mean_i g_i / (||g_i|| + eps); B changes."""

    def expect(grads, step):
        out = {n: torch.zeros_like(v) for n, v in grads[0].items()}
        for g in grads:
            f = 1 / (_norm(g, list(g)) + 1e-3)
            for n in g:
                out[n] += g[n] * f / len(grads)
        return out

    torch.manual_seed(26)
    generic_loop(
        MLP(),
        cls_batches([3, 5, 1, 4]),
        lambda psm, m: psm.register_transform(m, transforms.normalize(1e-3)),
        expect,
        keep=keep,
    )


def test_own_one_sample_transform_on_a_submodule_leaves_the_others_plain():
    """A user T for one sample on module fc2 only; fc1/fc3 get plain autograd's mean gradient."""

    def unit_half(gs):
        norm = torch.sqrt(sum(g.square().sum() for g in gs.values()))
        return {k: 0.5 * g / (norm + 1e-12) for k, g in gs.items()}

    def expect(grads, step):
        out = {n: sum(g[n] for g in grads) / len(grads) for n in grads[0]}
        names = ["fc2.weight", "fc2.bias"]
        for n in names:
            out[n] = sum(0.5 * g[n] / _norm(g, names) for g in grads) / len(grads)
        return out

    torch.manual_seed(27)
    generic_loop(MLP(), cls_batches([3, 4, 2, 5]), lambda psm, m: psm.register_transform("fc2", unit_half), expect)


def test_per_layer_clipping_one_transform_per_parameter_with_norms_read():
    """clip_norm(0.3) on every parameter on its own (per-layer clipping); per_sample_norms() every step."""
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]

    def register(psm, m):
        for n in names:
            psm.register_transform(n, transforms.clip_norm(0.3))

    def expect(grads, step):
        return {n: sum(g[n] * min(1.0, 0.3 / _norm(g, [n]).item()) for g in grads) / len(grads) for n in names}

    def check(psm, model, grads, step):
        norms = psm.per_sample_norms()
        for n in names:
            ref = torch.stack([_norm(g, [n]) for g in grads])
            assert torch.allclose(norms[n], ref, atol=1e-10), (step, n)

    torch.manual_seed(28)
    generic_loop(MLP(), cls_batches([3, 4, 2, 5]), register, expect, check=check, wrap_kwargs={"track_norms": True})


def test_scale_transform_with_weights_of_each_steps_batch():
    """transforms.scale(w) with fixed per-sample weights (B=4 every step): .grad = (1/B) sum_i w_i g_i."""
    g = torch.Generator().manual_seed(29)
    w = torch.rand(4, generator=g) + 0.5

    def expect(grads, step):
        return {n: sum(w[i] * gi[n] for i, gi in enumerate(grads)) / len(grads) for n in grads[0]}

    torch.manual_seed(29)
    generic_loop(MLP(), cls_batches([4, 4, 4]), lambda psm, m: psm.register_transform(m, transforms.scale(w)), expect)


def test_grad_sample_and_statistics_against_the_reference_every_step():
    """keep_grad_sample=True with clipping on fc3 only; grad_sample of every parameter and the mean statistic."""

    def expect(grads, step):
        out = {n: sum(g[n] for g in grads) / len(grads) for n in grads[0]}
        names = ["fc3.weight", "fc3.bias"]
        for n in names:
            out[n] = sum(g[n] * min(1.0, 0.1 / _norm(g, names).item()) for g in grads) / len(grads)
        return out

    def check(psm, model, grads, step):
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad_sample, torch.stack([g[n] for g in grads]), atol=1e-12), (step, n)
        norms = psm.per_sample_norms()
        for n in norms:
            assert torch.allclose(norms[n], torch.stack([g[n].norm() for g in grads]), atol=1e-10)

    torch.manual_seed(30)
    generic_loop(
        MLP(),
        cls_batches([3, 5, 2, 4]),
        lambda psm, m: psm.register_transform(m.fc3, transforms.clip_norm(0.1)),
        expect,
        keep=True,
        check=check,
    )


# ---------------------------------------------------------------- DP-SGD


def _dp_setup(model, n, q, sigma, bound, seed, sampler_seed=None):
    from torch.utils.data import DataLoader, TensorDataset

    from pergrad.privacy import DPSGD, PoissonBatchSampler, collate_with_empty

    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 2, 3, generator=g), torch.randint(0, 3, (n,), generator=g))
    generator = None if sampler_seed is None else torch.Generator().manual_seed(sampler_seed)
    sampler = PoissonBatchSampler(n, q, generator=generator)  # None: the OS's entropy
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate_with_empty(data))
    psm = PerSampleModule(model, keep_grad_sample=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = DPSGD(psm, opt, sampler, max_grad_norm=bound, noise_multiplier=sigma)
    return psm, opt, dp, loader


def test_dpsgd_without_noise_is_the_clipped_sum_over_the_expected_batch_size():
    """DPSGD(noise_multiplier=0): each step's .grad = sum_i clip(g_i) / (qN), whatever B was drawn."""
    torch.manual_seed(31)
    model = MLP()
    ref = copy.deepcopy(model)
    n, q, bound = 40, 0.1, 0.3
    # seeded batches: from the OS's entropy, the 10 sizes were all equal in 2.6e-7 of runs (sum_k P(B = k)^10)
    psm, opt, _, loader = _dp_setup(model, n, q, 0.0, bound, 31, sampler_seed=1031)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sizes = []
    for step, (x, y) in enumerate(loader):
        grads = sample_grads(ref, split(x, y), ce_one) if len(x) else []
        sizes.append(len(x))
        if grads:
            expected = {k: v * len(x) / (q * n) for k, v in clip_mean(grads, bound).items()}
        else:
            expected = {k: torch.zeros_like(p) for k, p in ref.named_parameters()}
        F.cross_entropy(psm(x), y, reduction="mean" if len(x) else "sum").backward()
        opt.step()  # DPSGD's hook: the (zero) noise, then the update
        set_ref_grads(ref, expected)
        ropt.step()
        opt.zero_grad()
        assert_same_params(model, ref, step)
    assert len(sizes) == 10 and len(set(sizes)) > 1


def test_dpsgd_noise_std_is_sigma_c_over_qn_on_every_parameter():
    """DPSGD(sigma=2, C=0.5, qN=4): .grad minus the clipped sum/(qN) has std sigma*C/(qN) on every parameter.
    The noise is the OS's: each mean within 7 standard errors of 0 (5 of them, 4 parameters, failed 2.3e-6 of
    runs; 7: 1e-11), each std within 6 of them + 2% (1e-10). 500 runs with 1 and 2 threads: worst mean 4.4,
    worst std 3.8 standard errors."""
    torch.manual_seed(32)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 40))
    n, q, sigma, bound = 40, 0.1, 2.0, 0.5
    psm, opt, dp, loader = _dp_setup(model, n, q, sigma, bound, 32)
    opt.param_groups[0]["lr"] = 0.0
    ref = copy.deepcopy(model)
    noise = {k: [] for k, _ in model.named_parameters()}
    for x, y in loader:
        if len(x):
            grads = sample_grads(ref, split(x, y % 3), ce_one)
            clean = {k: v * len(x) / (q * n) for k, v in clip_mean(grads, bound).items()}
        else:
            clean = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
        F.cross_entropy(psm(x), y % 3, reduction="mean" if len(x) else "sum").backward()
        dp.add_noise()
        for k, p in model.named_parameters():
            noise[k].append((p.grad - clean[k]).flatten())
        opt.step()  # lr 0: the parameters stay, so the reference stays valid
        opt.zero_grad()
        dp_steps = dp.steps
    assert dp_steps == 10
    want = sigma * bound / (q * n)
    for k, parts in noise.items():
        z = torch.cat(parts)
        assert abs(z.mean().item()) < 7 * want / z.numel() ** 0.5, k
        assert abs(z.std().item() / want - 1) < 6 / (2 * z.numel()) ** 0.5 + 0.02, (k, z.std().item(), want)


# ---------------------------------------------------------------- bugs: the batch reordered in the forward


class SortUnsort(nn.Module):
    """Run the middle layer on the batch sorted by a key, then put the rows back (sort by length, unsort)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        order = torch.argsort(x.flatten(1)[:, 0])
        h = torch.tanh(self.b(h[order]))[order.argsort()]
        return self.c(h)


def test_batch_sorted_then_unsorted_around_a_layer_is_refused():
    """Sort the batch by a key before a layer and unsort after (the pack_padded_sequence habit), clipped: row i of
    the layer's input is another sample, so pergrad refuses the forward (it used to give the rows' g_i to the wrong
    samples: b.weight.grad_sample off by 0.176, the clipped .grad by 1.8e-3), and writes no .grad."""
    torch.manual_seed(33)
    model = SortUnsort()
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(0.2))
    for x, _ in cls_batches([4, 5, 3], seed=0):
        model.zero_grad()
        with pytest.raises(
            pergrad.errors.BatchMixingError, match=rf"layer 'b' \(Linear\).*after the op argsort {REORDERED}"
        ):
            psm(x)
        assert all(p.grad is None for p in model.parameters())


class SortedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, tok):
        lengths, order = (tok != 0).sum(1).sort(descending=True)
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(tok)[order], lengths, batch_first=True)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1][order.argsort()])


def test_packed_lstm_sorted_by_length_inside_the_forward_is_refused():
    """Embedding -> sort by length -> pack -> LSTM -> unsort h_n -> Linear: the LSTM's packed rows are not the
    samples in order (its grad_sample was off by 0.37), so the forward is refused naming the sort."""
    torch.manual_seed(0)
    model = SortedLSTM()
    psm = PerSampleModule(model)
    for tok, _ in tok_batches([4, 3, 5]):
        with pytest.raises(pergrad.errors.BatchMixingError, match=rf"layer 'lstm' \(LSTM\).*op sort {REORDERED}"):
            psm(tok)


class Moved(nn.Module):
    """Linear -> tanh -> ``move`` (an op on the batch of hidden rows) -> tanh -> Linear."""

    def __init__(self, move):
        super().__init__()
        self.a, self.b, self.move = nn.Linear(6, 4), nn.Linear(4, 3), move

    def forward(self, x):
        return self.b(torch.tanh(self.move(self.a(x.flatten(1)))))


@pytest.mark.parametrize(
    "op", ["flip", "roll", "index_select", "gather", "indexing", "cumsum", "softmax", "sort", "take_along_dim"]
)
def test_batch_reordered_or_mixed_before_a_layer_is_refused(op):
    """A layer on h.flip(0) (or roll, index_select, gather, h[perm], cumsum, softmax, sort along the batch dim):
    row i of its input is not sample i (b.weight.grad_sample was off by 0.63), so the forward is refused."""
    perm = torch.tensor([2, 0, 3, 1])
    move = {
        "flip": lambda h: h.flip(0),
        "roll": lambda h: h.roll(1, 0),
        "index_select": lambda h: h.index_select(0, perm),
        "gather": lambda h: h.gather(0, perm[:, None].expand_as(h)),
        "indexing": lambda h: h[perm],
        "cumsum": lambda h: h.cumsum(0),
        "softmax": lambda h: F.softmax(h, dim=0),
        "sort": lambda h: h.sort(0).values,
        "take_along_dim": lambda h: torch.take_along_dim(h, perm[:, None], 0),
    }[op]

    torch.manual_seed(34)
    psm = PerSampleModule(Moved(move))
    x, _ = cls_batches([4], seed=34)[0]
    with pytest.raises(pergrad.errors.BatchMixingError, match=rf"layer 'b' \(Linear\).*after the op \w+ {REORDERED}"):
        psm(x)


@pytest.mark.parametrize("op", ["flip", "cumsum", "softmax", "sort"])
def test_the_same_ops_on_other_dims_or_indexing_in_order_are_exact(op):
    """flip, cumsum, softmax, sort along the features, and h[arange(B)] (each sample in its row) before a layer:
    exact per-sample gradients on every step, batch sizes changing."""
    move = {
        "flip": lambda h: h.flip(1)[torch.arange(h.shape[0])],
        "cumsum": lambda h: h.cumsum(-1),
        "softmax": lambda h: F.softmax(h, dim=1),
        "sort": lambda h: h.sort(-1).values,
    }[op]

    torch.manual_seed(36)
    model = Moved(move)
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model)
    o, ro = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step, (x, y) in enumerate(cls_batches([4, 1, 5], seed=36)):
        grads = sample_grads(ref, split(x, y), ce_one)
        o.zero_grad()
        F.cross_entropy(psm(x), y).backward()
        for n, p in model.named_parameters():
            err = (p.grad_sample - torch.stack([g[n] for g in grads])).abs().max().item()
            assert err < 1e-10, f"step {step}: {n}.grad_sample off by {err}"
        o.step()
        set_ref_grads(ref, {n: p.grad.clone() for n, p in model.named_parameters()})
        ro.step()


# ---------------------------------------------------------------- adversarial training


@pytest.mark.parametrize("keep", [False, True])
def test_fgsm_adversarial_training_autograd_grad_on_the_input_then_a_clipped_step(keep):
    """Each step: torch.autograd.grad(loss, x) through the wrapper (FGSM), then train clipped on x_adv."""
    torch.manual_seed(35)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=keep)
    psm.register_transform(model, transforms.clip_norm(0.3))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step, (x, y) in enumerate(cls_batches([3, 4, 2, 5, 3], seed=35)):
        o.zero_grad()
        x = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(F.cross_entropy(psm(x), y), x)
        xr = x.detach().clone().requires_grad_()
        (rgx,) = torch.autograd.grad(F.cross_entropy(ref(xr), y), xr)
        assert torch.allclose(gx, rgx, atol=1e-12)
        assert all(p.grad is None for p in model.parameters())
        x_adv = (x + 0.1 * gx.sign()).detach()
        expected = clip_mean(sample_grads(ref, split(x_adv, y), ce_one), 0.3)
        F.cross_entropy(psm(x_adv), y).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
        assert_same_params(model, ref, step)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(7, 8, padding_idx=0)
        self.tgt = nn.Embedding(7, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(8, 2, 12, dropout=0.0, batch_first=True, norm_first=True)
        self.out = nn.Linear(8, 7)

    def forward(self, src, tgt):
        pad = src == 0
        mem = self.enc(self.src(src), src_key_padding_mask=pad)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.dec(self.tgt(tgt), mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        return self.out(h)


def test_encoder_decoder_with_causal_mask_and_memory_padding_mask():
    """TransformerEncoderLayer + TransformerDecoderLayer(norm_first, causal tgt_mask, memory padding), Adam."""
    torch.manual_seed(36)
    g = torch.Generator().manual_seed(36)
    batches = []
    for b in [3, 2, 4]:
        src, _ = tok_batches([b], seed=int(torch.randint(0, 99, (1,), generator=g)))[0]
        tgt = torch.randint(0, 7, (b, 4), generator=g)
        batches.append(((src, tgt[:, :-1]), tgt[:, 1:]))

    def loss(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum") / out.shape[0]

    model = Seq2Seq()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(0.5))
    o, ro = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    for step, ((src, tgt), y) in enumerate(batches):
        per = [((src[i : i + 1], tgt[i : i + 1]), y[i : i + 1]) for i in range(len(y))]
        expected = clip_mean(sample_grads(ref, per, lambda m, a, yi: loss(m(*a), yi)), 0.5)
        o.zero_grad()
        loss(psm(src, tgt), y).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


def test_two_forwards_in_flight_backwarded_in_reverse_order():
    """la = loss(psm(xa)); lb = loss(psm(xb)); lb.backward(); la.backward(): .grad = clip-mean(a) + clip-mean(b)."""
    torch.manual_seed(37)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model)
    psm.register_transform(model, transforms.clip_norm(0.3))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
    bs = cls_batches([3, 4, 5, 2, 4, 3, 5, 2], seed=37)
    for step in range(4):
        (xa, ya), (xb, yb) = bs[2 * step], bs[2 * step + 1]
        raw_a = sample_grads(ref, split(xa, ya), ce_one)
        ga, gb = clip_mean(raw_a, 0.3), clip_mean(sample_grads(ref, split(xb, yb), ce_one), 0.3)
        expected = {n: ga[n] + gb[n] for n in ga}
        o.zero_grad()
        la = F.cross_entropy(psm(xa), ya)
        lb = F.cross_entropy(psm(xb), yb)
        lb.backward()
        la.backward()
        assert_grads(model, expected, step)
        for n, p in model.named_parameters():  # the last backward's (forward a's) samples
            assert torch.allclose(p.grad_sample, torch.stack([g[n] for g in raw_a]), atol=1e-12), (step, n)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()


def test_a_sorted_batch_cannot_break_the_clipping_sensitivity_bound():
    """Privacy: with the batch sorted/unsorted around a layer, each layer's rows were clipped with another sample's
    norm (removing one sample moved the clipped sum by 0.2532 > C = 0.2); now no clipped sum is written at all."""
    torch.manual_seed(33)
    model = SortUnsort()
    psm = PerSampleModule(model, keep_grad_sample=False, loss_reduction="sum")
    psm.register_transform(model, transforms.clip_norm(0.2))
    for seed in range(3):
        x, y = cls_batches([6], seed=seed)[0]
        model.zero_grad()
        with pytest.raises(pergrad.errors.BatchMixingError, match=REORDERED):
            F.cross_entropy(psm(x), y, reduction="sum").backward()
        assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- more habits


def test_a_with_block_per_epoch_wraps_and_unwraps_each_time():
    """for epoch: with PerSampleModule(model) as psm: register clip, 2 steps; a plain eval step between epochs."""
    torch.manual_seed(38)
    model = MLP()
    ref = copy.deepcopy(model)
    o, ro = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    batches = iter(cls_batches([3, 4, 2, 5, 4, 3, 5, 2, 3], seed=38))
    step = 0
    for _ in range(3):
        with PerSampleModule(model, keep_grad_sample=False) as psm:
            psm.register_transform(model, transforms.clip_norm(0.3))
            for _ in range(2):
                x, y = next(batches)
                expected = clip_mean(sample_grads(ref, split(x, y), ce_one), 0.3)
                o.zero_grad()
                F.cross_entropy(psm(x), y).backward()
                assert_grads(model, expected, step)
                o.step()
                set_ref_grads(ref, expected)
                ro.step()
                step += 1
        x, y = next(batches)  # unwrapped: plain autograd
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        expected = clip_mean(sample_grads(ref, split(x, y), ce_one), float("inf"))
        assert_grads(model, expected, step)
        assert_same_params(model, ref, step)


def test_square_transform_gives_the_mean_second_moment_every_step():
    """transforms.square() on the model: .grad = (1/B) sum_i g_i**2 (keep_grad_sample=False), B changes."""

    def expect(grads, step):
        return {n: sum(g[n].square() for g in grads) / len(grads) for n in grads[0]}

    torch.manual_seed(39)
    generic_loop(
        MLP(), cls_batches([3, 5, 1, 4]), lambda psm, m: psm.register_transform(m, transforms.square()), expect
    )


def test_loss_divided_by_k_over_unequal_micro_batches_with_loss_scale():
    """loss/2 over micro-batches of 1 and 4 with loss_scale=1/2: .grad = (clip-mean(mb1) + clip-mean(mb2)) / 2."""
    torch.manual_seed(40)
    model = MLP()
    ref = copy.deepcopy(model)
    psm = PerSampleModule(model, keep_grad_sample=False, loss_scale=0.5)
    psm.register_transform(model, transforms.clip_norm(0.3))
    o, ro = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step, (x, y) in enumerate(cls_batches([5, 5, 5], seed=40)):
        m1 = clip_mean(sample_grads(ref, split(x[:1], y[:1]), ce_one), 0.3)
        m2 = clip_mean(sample_grads(ref, split(x[1:], y[1:]), ce_one), 0.3)
        expected = {n: (m1[n] + m2[n]) / 2 for n in m1}
        o.zero_grad()
        (F.cross_entropy(psm(x[:1]), y[:1]) / 2).backward()
        (F.cross_entropy(psm(x[1:]), y[1:]) / 2).backward()
        assert_grads(model, expected, step)
        o.step()
        set_ref_grads(ref, expected)
        ro.step()
