"""Second order through tensors shared by the batch (``pergrad._core.shortcuts.shared``): position embeddings of
``torch.arange(T)``, HuggingFace's ``position_ids`` buffer, relative-position buckets, raw parameters
(cls token, position embeddings, LayerScale), a shared weight looked up by ``F.embedding``, and
tensors created inside the forward that may carry the batch. After ``loss.backward(create_graph=True)``
the gradient of a penalty built from ``grad_sample``, from ``per_sample_norms()`` or from the clipped
``.grad`` is torch.func's double differentiation in float64, on every step of a loop whose length
equals the batch size on one step and crosses the 16-position threshold."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad

from pergrad import PerSampleModule, transforms
from tests.test_second_order import clipped_mean, close, sq_norms
from tests.test_shared import (
    BeforeTheBatch,
    Buckets,
    BufferPositions,
    Combined,
    Conditional,
    LoraEmbedding,
    MatrixParameter,
    NanoGPT,
    RawParameters,
    ShiftedLabels,
    Sinusoidal,
    floats,
    ids,
    squared,
    token_loss,
)

Params = dict[str, Tensor]
Batch = Callable[[int, int, torch.Generator], tuple[Tensor, Tensor]]
Loss = Callable[[Tensor, Tensor], Tensor]

STEPS = [(3, 5), (4, 4), (2, 17), (3, 16)]  # (batch, length): T == B once, both sides of 16

MODELS: dict[str, Callable[[], tuple[nn.Module, Batch, Loss]]] = {
    "positions (NanoGPT, tied head)": lambda: (NanoGPT(), ids(9), token_loss),
    "position_ids buffer, shared -> Linear": lambda: (BufferPositions(), ids(9), token_loss),
    "relative-position buckets": lambda: (Buckets(), floats(4, 3), squared),
    "raw parameters (cls token, pos_embed, gamma)": lambda: (RawParameters(), floats(4, 3), squared),
    "shared weight in F.embedding (LoRA)": lambda: (LoraEmbedding(), ids(10), token_loss),
    "raw matrix times the batch": lambda: (MatrixParameter(), floats(4, 3), squared),
    "decoder inputs shifted inside the forward": lambda: (ShiftedLabels("assign"), ids(9), token_loss),
    "Fourier features -> Linear": lambda: (Sinusoidal(), floats(4, 3), squared),
    "shared + buffer rows": lambda: (Combined(), ids(9), token_loss),
    "shared before the batch": lambda: (BeforeTheBatch(), ids(9), token_loss),
    "embedding of labels computed inside": lambda: (Conditional(), floats(3, 2), squared),
}


def reference(model: nn.Module, x: Tensor, y: Tensor, loss: Loss, penalty: Callable[[Params], Tensor]) -> Params:
    """``d penalty(g_1..g_B) / d theta``: torch.func's ``grad`` of the penalty of each sample's own
    ``grad(f_i)`` (one sample at a time: some of these forwards write into tensors)."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def f(ps: Params, i: int) -> Tensor:
        return loss(functional_call(model, ps, (x[i : i + 1],)), y[i : i + 1])

    def per_sample(ps: Params) -> Params:
        found = [grad(f)(ps, i) for i in range(x.shape[0])]
        return {k: torch.stack([g[k] for g in found]) for k in ps}

    return grad(lambda ps: penalty(per_sample(ps)))(params)


def mean_sq_norm(g: Params) -> Tensor:
    return sq_norms(g).mean()


def clipped_sq_norm(g: Params) -> Tensor:
    return sum(v.square().sum() for v in clipped_mean(g, 0.5).values())  # type: ignore[return-value]


@pytest.mark.parametrize("mode", ["grad_sample", "norms", "clipped materialised", "clipped fused"])
@pytest.mark.parametrize("name", list(MODELS))
def test_second_order_through_shared_tensors(name: str, mode: str) -> None:
    torch.manual_seed(20)
    model, batch, loss = MODELS[name]()
    model = model.double()
    plain = copy.deepcopy(model)  # the reference runs the model unwrapped
    keep = mode in ("grad_sample", "clipped materialised")
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=mode == "norms")
    params = dict(model.named_parameters())
    if mode.startswith("clipped"):
        psm.register_transform(model, transforms.clip_norm(0.5))
    gen = torch.Generator().manual_seed(0)
    for step, (b, t) in enumerate(STEPS):
        x, y = batch(b, t, gen)
        plain.load_state_dict(model.state_dict())
        expected = reference(plain, x, y, loss, clipped_sq_norm if mode.startswith("clipped") else mean_sq_norm)
        for p in params.values():
            p.grad = None
        (loss(psm(x), y) / b).backward(create_graph=True)
        if mode == "grad_sample":
            penalty = mean_sq_norm({n: p.grad_sample for n, p in params.items()})  # type: ignore[attr-defined]
        elif mode == "norms":
            penalty = torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()
        else:
            penalty = sum(p.grad.square().sum() for p in params.values())  # type: ignore[union-attr,assignment]
        got = torch.autograd.grad(penalty, list(params.values()), allow_unused=True)
        close(dict(zip(params, got, strict=True)), expected, f"{name}, {mode}, step {step} (B={b}, T={t})")
        with torch.no_grad():
            for p in params.values():
                p -= 0.05 * p.grad  # type: ignore[operator]
    psm.remove()


# -- HuggingFace models as their users build them: GPT-2's positions, BERT with LoRA on its embeddings


def _hf_reference(
    model: nn.Module, inputs: dict[str, Tensor], losses: Callable[[object], Tensor], penalty: Callable[[Params], Tensor]
) -> Params:
    """``d penalty(g_1..g_B) / d theta`` by autograd: each sample's own loss ``f_i`` (from the same
    batched forward) differentiated with ``create_graph=True``, then the penalty differentiated."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for f_i in losses(model(**inputs)):
        found = torch.autograd.grad(f_i, list(params.values()), retain_graph=True, create_graph=True, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), found, strict=True)])
    g = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}
    return dict(zip(params, torch.autograd.grad(penalty(g), list(params.values())), strict=True))


def _hf_model(name: str) -> tuple[nn.Module, Callable[[object, Tensor], Tensor], bool]:
    """The model, its per-sample loss ``[B]`` of (output, ids), and whether labels are the ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(30)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=20, n_positions=24, n_embd=8, n_layer=1, n_head=2, attn_implementation="eager"
        )
        model = transformers.GPT2LMHeadModel(config)

        def lm(out: object, ids: Tensor) -> Tensor:
            logits = out.logits[:, :-1]  # type: ignore[attr-defined]
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            return losses.view(ids.shape[0], -1).sum(1)

        return model, lm, True
    peft = pytest.importorskip("peft")
    config = transformers.BertConfig(
        vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=24, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["word_embeddings", "query", "value"], lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora)

    def classes(out: object, y: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(out.logits, y, reduction="none")  # type: ignore[attr-defined]

    return model, classes, False


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21
@pytest.mark.parametrize("keep", [True, False], ids=["grad_sample", "norms"])
@pytest.mark.parametrize("name", ["gpt2", "bert-lora"])
def test_second_order_through_huggingface_models(name: str, keep: bool) -> None:
    """GPT-2 (``wpe`` of shared position ids, tied head, HF Conv1D, LayerNorm) and BERT with peft's
    LoRA on its word embeddings (raw A, B looked up by ``F.embedding``): the per-sample gradient-norm
    penalty's gradient, every step."""
    model, loss, lm = _hf_model(name)
    model = model.double().eval()  # eval: no dropout
    plain = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    psm = PerSampleModule(model, keep_grad_sample=keep, track_norms=not keep)
    gen = torch.Generator().manual_seed(0)
    for step, (b, t) in enumerate([(3, 5), (4, 4), (2, 17)]):
        ids_ = torch.randint(0, 20, (b, t), generator=gen)
        y = ids_ if lm else torch.randint(0, 3, (b,), generator=gen)
        plain.load_state_dict(model.state_dict())
        expected = _hf_reference(plain, {"input_ids": ids_}, lambda out, y=y: loss(out, y), mean_sq_norm)
        for p in params.values():
            p.grad = None
        (loss(psm(input_ids=ids_), y).sum() / b).backward(create_graph=True)
        if keep:
            penalty = mean_sq_norm({n: p.grad_sample for n, p in params.items()})  # type: ignore[attr-defined]
        else:
            penalty = torch.stack([n.square() for n in psm.per_sample_norms().values()]).sum(0).mean()
        got = torch.autograd.grad(penalty, list(params.values()))
        close(dict(zip(params, got, strict=True)), expected, f"{name} step {step} (B={b}, T={t})")
        with torch.no_grad():
            for p in params.values():
                p -= 0.05 * p.grad  # type: ignore[operator]
    psm.remove()
