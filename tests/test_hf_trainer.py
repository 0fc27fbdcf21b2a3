"""``pergrad.hf.PerSampleTrainer``: a real HuggingFace ``Trainer`` on the CPU, every optimizer step's ``.grad``
(captured at ``on_pre_optimizer_step``) and the parameters after each step against a per-sample reference:
each sample run ALONE (unpadded) through a copy of the model at that step's parameters, its own loss
differentiated by autograd in float64, clipped where the run clips, averaged over every sample of the step
(all its micro-batches)."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from pergrad import PerSampleModule, TrainerConfigError, WrapperAttributeError, transforms  # noqa: E402
from pergrad.hf import DPConfig, PerSampleTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 23
TOL = 1e-9  # float64 throughout: the Trainer does not cast the model


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return GPT2LMHeadModel(config).double()


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
        num_labels=3,
    )
    return BertForSequenceClassification(config).double()


def lm_data(n: int, seed: int = 1) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 10, (), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def class_data(n: int, seed: int = 1) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 10, (), generator=g))
        rows.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=g), "labels": torch.randint(0, 3, (), generator=g)})
    return rows


def collate(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right padding: pad id 0, attention mask 0, token labels -100."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    labels = torch.stack([r["labels"] for r in rows]) if rows[0]["labels"].dim() == 0 else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Recorder(TrainerCallback):
    """Per optimizer step: the trainable parameters before it, its micro-batches, ``.grad`` at
    ``on_pre_optimizer_step``; and the parameters after the last step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.model: nn.Module | None = None

    def params(self) -> dict[str, Tensor]:
        assert self.model is not None
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append({"params": self.params(), "batches": [], "grads": None})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.model is not None
        self.steps[-1]["grads"] = {
            n: None if p.grad is None else p.grad.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.final = self.params()


class Recording(PerSampleTrainer):
    """Records every micro-batch the Trainer trains on."""

    recorder: Recorder

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        self.recorder.steps[-1]["batches"].append({k: v.clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)


def arguments(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], per_device_train_batch_size=3,
        gradient_accumulation_steps=2, max_steps=4, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=0.0, save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, weight_decay=0.0, warmup_steps=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def run(model: nn.Module, data: list[dict[str, Tensor]], tmp_path: Path, trainer_cls: type = Recording, resume: Any = None, **kwargs: Any) -> tuple[Recorder, PerSampleTrainer]:
    recorder = Recorder()
    args = kwargs.pop("args", None) or arguments(tmp_path)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, data_collator=collate, **kwargs)
    recorder.model = trainer.model
    trainer.recorder = recorder
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return recorder, trainer


def lm_own_loss(model: nn.Module, ids: Tensor) -> Tensor:
    """One sample alone, unpadded: the sum of its next-token losses."""
    logits = model(input_ids=ids[None]).logits[0]
    return F.cross_entropy(logits[:-1], ids[1:], reduction="sum")


def class_own_loss(model: nn.Module, ids: Tensor, label: Tensor) -> Tensor:
    return F.cross_entropy(model(input_ids=ids[None]).logits, label[None])


def reference(
    base: nn.Module, step: dict[str, Any], own: Callable[[nn.Module, dict[str, Tensor], int], Tensor], clip: float | None
) -> dict[str, Tensor]:
    """``mean_i clip(g_i)`` over every sample of the step, each sample alone at the step's parameters."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in step["params"]:
                p.copy_(step["params"][n])
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total: dict[str, Tensor] = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    for batch in step["batches"]:
        for i in range(batch["input_ids"].shape[0]):
            grads = torch.autograd.grad(own(model, batch, i), list(params.values()), allow_unused=True)
            g = {n: torch.zeros_like(p) if d is None else d for (n, p), d in zip(params.items(), grads)}
            if clip is not None:
                norm = torch.sqrt(sum(v.square().sum() for v in g.values()))
                g = {n: v * min(1.0, clip / float(norm)) for n, v in g.items()}
            for n in total:
                total[n] += g[n]
            count += 1
    return {n: t / count for n, t in total.items()}


def lm_sample(model: nn.Module, batch: dict[str, Tensor], i: int) -> Tensor:
    ids = batch["input_ids"][i][batch["attention_mask"][i] == 1]
    return lm_own_loss(model, ids)


def class_sample(model: nn.Module, batch: dict[str, Tensor], i: int) -> Tensor:
    ids = batch["input_ids"][i][batch["attention_mask"][i] == 1]
    return class_own_loss(model, ids, batch["labels"][i])


def check_steps(recorder: Recorder, base: nn.Module, own: Callable[..., Tensor], clip: float | None, lr: float = 0.1) -> None:
    assert len(recorder.steps) >= 3
    sizes = []
    for k, step in enumerate(recorder.steps):
        ref = reference(base, step, own, clip)
        sizes.append([b["input_ids"].shape[0] for b in step["batches"]])
        for n, g in ref.items():
            got = step["grads"][n]
            assert got is not None, n
            torch.testing.assert_close(got, g, rtol=TOL, atol=TOL, msg=lambda m: f"step {k} .grad of {n}: {m}")
        after = recorder.steps[k + 1]["params"] if k + 1 < len(recorder.steps) else recorder.final
        for n, g in ref.items():  # SGD, constant learning rate, no weight decay
            torch.testing.assert_close(after[n], step["params"][n] - lr * g, rtol=TOL, atol=TOL)
    return sizes
