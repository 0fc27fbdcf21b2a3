"""HuggingFace models as their users build them, every parameter trainable, without fallback=True:
exact against each sample's own loss differentiated by autograd, materialised and
with fused root clipping, over steps whose sequence length equals the batch size on some steps.

Position ids shared by the batch (``[1, T]`` rows, T5's relative-position buckets ``[T, T]``) and
raw parameters (ViT's ``cls_token`` and position embeddings) are what these models need beyond
the layer rules.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pergrad import PerSampleModule, TokenLossWarning, transforms
from tests.reference import assert_close, clipped_mean

transformers = pytest.importorskip("transformers")

VOCAB = 40
STEPS = [(3, 5), (4, 4), (2, 6)]  # (batch, length): the second has T == B


def lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's own loss, ``[B]``: the sum of its next-token losses."""
    logits = out.logits[:, :-1]  # type: ignore[attr-defined]
    losses = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    return losses.view(labels.shape[0], -1).sum(1)


def class_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels, reduction="none")  # type: ignore[attr-defined]


def per_sample(
    model: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor, loss: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: [B, *p.shape]}``: ``d f_i / d p`` for each sample's own loss ``f_i``, differentiated in
    the same batched forward (models that compute parts in float32, such as Llama's rotary
    embeddings, round a sample alone differently from the batch)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    losses = loss(model(**inputs), labels)
    rows = []
    for f_i in losses:
        grads = torch.autograd.grad(f_i, list(params.values()), retain_graph=True, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def check(
    model: nn.Module,
    batch: Callable[[int, int, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]],
    loss: Callable[..., torch.Tensor],
    float32_inside: bool = False,
    steps: list[tuple[int, int]] = STEPS,
) -> None:
    """``float32_inside``: the model computes its norms in float32 even in float64 (HF's RMSNorm and
    T5LayerNorm cast), so one batched backward and the per-sample ones agree to float32 round-off."""
    close = assert_close
    if float32_inside:

        def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
            scale = float(expected.abs().max()) + 1e-30
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")

    model = model.double().eval()  # eval: no dropout, so one sample alone computes what it does in the batch
    plain = copy.deepcopy(model)  # the reference runs unwrapped (wrapped, transformed weights run detached)
    for keep, clip in [(True, None), (False, 0.5)]:
        gen = torch.Generator().manual_seed(0)
        with PerSampleModule(model, keep_grad_sample=keep, track_norms=True) as psm:
            if clip is not None:
                psm.register_transform(model, transforms.clip_norm(clip))
            for b, t in steps:
                inputs, labels = batch(b, t, gen)
                ref = per_sample(plain, inputs, labels, loss)
                expected = clipped_mean(ref, clip) if clip is not None else {n: g.mean(0) for n, g in ref.items()}
                psm.zero_grad()
                (loss(psm(**inputs), labels).sum() / b).backward()
                norms = psm.per_sample_norms()
                for name, p in model.named_parameters():
                    if not p.requires_grad:
                        continue
                    what = f"{type(model).__name__} B={b} T={t} {name}"
                    if keep:
                        close(p.grad_sample, ref[name], f"grad_sample of {what}")
                    close(p.grad, expected[name], f".grad of {what}")
                    close(norms[name], ref[name].flatten(1).norm(dim=1), f"norms of {what}")


def tokens(labels: str) -> Callable[[int, int, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]:
    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = torch.randint(1, VOCAB, (b, t), generator=gen)
        y = ids if labels == "lm" else torch.randint(0, 3, (b,), generator=gen)
        return {"input_ids": ids}, y

    return batch


def test_bert() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    check(transformers.BertForSequenceClassification(config), tokens("class"), class_loss)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21
def test_bert_with_lora_on_its_word_embeddings() -> None:
    """peft's LoRA on an nn.Embedding keeps A and B in ParameterDicts and looks A up with
    ``F.embedding(ids, A.T, padding_idx=...)``: raw parameters of the LoRA layer, exact without
    fallback, token 0 (BERT's padding_idx) included."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["word_embeddings", "query", "value"], lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(transformers.BertForSequenceClassification(config), lora)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_embedding_A" in n for n in names) and any("lora_embedding_B" in n for n in names)

    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = torch.randint(0, VOCAB, (b, t), generator=gen)
        ids[0, -1] = 0
        return {"input_ids": ids}, torch.randint(0, 3, (b,), generator=gen)

    check(model, batch, class_loss)


def test_distilbert() -> None:
    torch.manual_seed(1)
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=8, n_layers=1, n_heads=2, hidden_dim=16, max_position_embeddings=16, num_labels=3
    )
    check(transformers.DistilBertForSequenceClassification(config), tokens("class"), class_loss)


def test_roberta_position_ids_computed_from_the_input() -> None:
    torch.manual_seed(2)
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=20, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    check(transformers.RobertaForSequenceClassification(config), tokens("class"), class_loss)


def test_gpt2_tied_head_and_conv1d() -> None:
    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    check(transformers.GPT2LMHeadModel(config), tokens("lm"), lm_loss)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_family(family: str) -> None:
    torch.manual_seed(4)
    common = {
        "vocab_size": VOCAB, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "max_position_embeddings": 16,
    }  # fmt: skip
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    check(model, tokens("lm"), lm_loss, float32_inside=True)


def padded(labels: str) -> Callable[[int, int, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """``tokens(labels)`` with an attention mask: sample ``i`` ends in ``i % 3`` pads (HF builds its 4-D
    attention masks from it by advanced indexing, ``padding_mask[batch_idx, kv_idx]``)."""

    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs, y = tokens(labels)(b, t, gen)
        mask = torch.ones(b, t, dtype=torch.long)
        for i in range(b):
            mask[i, t - i % 3 :] = 0
        return {**inputs, "attention_mask": mask}, y

    return batch


PADDED = {
    "bert": lambda: transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            max_position_embeddings=16,
            num_labels=3,
        )
    ),
    "distilbert": lambda: transformers.DistilBertForSequenceClassification(
        transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=8, n_layers=1, n_heads=2, hidden_dim=16, max_position_embeddings=16, num_labels=3
        )
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=16,
            max_position_embeddings=16,
        )
    ),
}


@pytest.mark.parametrize("family", sorted(PADDED))
def test_padded_batches_with_an_attention_mask(family: str) -> None:
    """Every step with an attention mask, ``T == B`` on the second."""
    torch.manual_seed(8)
    lm = family in ("gpt2", "llama")
    check(
        PADDED[family](),
        padded("lm" if lm else "class"),
        lm_loss if lm else class_loss,
        float32_inside=family == "llama",
    )


def test_t5_relative_position_buckets() -> None:
    torch.manual_seed(5)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)

    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = torch.randint(1, VOCAB, (b, t), generator=gen)
        return {"input_ids": ids, "decoder_input_ids": ids.flip(1)}, ids

    def loss(out: object, labels: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none")  # type: ignore[attr-defined]
        return losses.view(labels.shape[0], -1).sum(1)

    check(model, batch, loss, float32_inside=True)


@pytest.mark.parametrize("steps", [[(3, 5), (2, 17), (4, 3)], [(3, 3), (17, 17), (4, 4)]], ids=["T!=B", "T==B"])
def test_t5_trained_on_labels_alone(steps: list[tuple[int, int]]) -> None:
    """``model(input_ids=..., labels=...)`` as T5's docs train it: the decoder's input ids are the labels
    shifted right inside the model (``new_zeros`` + slice assign), not one of the model's inputs."""
    torch.manual_seed(7)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip

    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids = torch.randint(1, VOCAB, (b, t), generator=gen)
        labels = torch.randint(1, VOCAB, (b, t), generator=gen)
        return {"input_ids": ids, "labels": labels}, labels

    def loss(out: object, labels: torch.Tensor) -> torch.Tensor:
        logits = out.logits  # type: ignore[attr-defined]
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return losses.view(labels.shape[0], -1).sum(1)

    check(transformers.T5ForConditionalGeneration(config), batch, loss, float32_inside=True, steps=steps)


def test_vit_cls_token_and_position_embeddings() -> None:
    torch.manual_seed(6)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, num_labels=3,
    )  # fmt: skip

    def batch(b: int, t: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x = torch.randn(b, 3, 8, 8, generator=gen, dtype=torch.float64)
        return {"pixel_values": x}, torch.randint(0, 3, (b,), generator=gen)

    check(transformers.ViTForImageClassification(config), batch, class_loss)


def test_labels_loss_over_padded_tokens_warns_once_and_is_left_alone() -> None:
    """HF's ``labels=`` loss is a mean over the batch's tokens: with rows of different label counts
    pergrad warns (once), without changing what the backward computes; equal counts, sequence
    labels, or a loss computed from the logits do not warn."""
    torch.manual_seed(7)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).double()
    ids = torch.randint(1, VOCAB, (3, 6))
    padded = ids.clone()
    padded[0, 4:] = -100
    with PerSampleModule(model) as psm:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            psm(input_ids=ids, labels=ids).loss.backward()  # equal counts: (1/B) sum_i mean_t, fine
            lm_loss(psm(input_ids=ids), ids).mean().backward()
            psm(input_ids=ids, labels=padded)  # a forward whose loss is not backpropagated
        with pytest.warns(
            TokenLossWarning, match=r"mean over all 16 labelled tokens.*4 to 6.*docs/guides/language-models.md"
        ):
            psm(input_ids=ids, labels=padded).loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            psm(input_ids=ids, labels=padded).loss.backward()  # once per wrapper
    classes = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    with (
        PerSampleModule(transformers.BertForSequenceClassification(classes).double()) as psm,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        psm(input_ids=ids, labels=torch.tensor([0, 2, 1])).loss.backward()
