"""``pergrad.integrations.hf.PerSampleTrainer``: a real HuggingFace ``Trainer`` on the CPU, every optimizer step's ``.grad``
(captured at ``on_pre_optimizer_step``) and the parameters after each step against a per-sample reference:
each sample run ALONE (unpadded) through a copy of the model at that step's parameters, its own loss
differentiated by autograd in float64, clipped where the run clips, averaged over every sample of the step
(all its micro-batches)."""

from __future__ import annotations

import copy
import socket
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

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from pergrad import PerSampleModule, TrainerConfigError, WrapperAttributeError, transforms
from pergrad.integrations.hf import DPConfig, PerSampleTrainer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 23
TOL = 1e-9  # float64 throughout: the Trainer does not cast the model
LM_CLIP = 20.0  # the tiny GPT-2's per-sample norms (sum of its token losses) are 11 to 38 here
NORMS: list[float] = []  # every per-sample gradient norm the reference clipped (the bound must bite on some, not all)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPT2LMHeadModel(config).double()


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
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
        rows.append(
            {
                "input_ids": torch.randint(3, VOCAB, (length,), generator=g),
                "labels": torch.randint(0, 3, (), generator=g),
            }
        )
    return rows


def collate(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right padding: pad id 0, attention mask 0, token labels -100."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    labels = (
        torch.stack([r["labels"] for r in rows]) if rows[0]["labels"].dim() == 0 else ids.masked_fill(mask == 0, -100)
    )
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
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in self.model.named_parameters()
            if p.requires_grad
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
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        weight_decay=0.0,
        warmup_steps=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def run(
    model: nn.Module,
    data: list[dict[str, Tensor]],
    tmp_path: Path,
    trainer_cls: type = Recording,
    resume: Any = None,
    **kwargs: Any,
) -> tuple[Recorder, PerSampleTrainer]:
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
    base: nn.Module,
    step: dict[str, Any],
    own: Callable[[nn.Module, dict[str, Tensor], int], Tensor],
    clip: float | None,
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
                NORMS.append(float(norm))
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


def check_steps(
    recorder: Recorder, base: nn.Module, own: Callable[..., Tensor], clip: float | None, lr: float = 0.1
) -> list[list[int]]:
    """Every step's ``.grad`` is ``mean_i clip(g_i)`` over the step's samples, and SGD stepped with it;
    returns the micro-batch sizes of each step."""
    assert len(recorder.steps) >= 3
    NORMS.clear()
    sizes = []
    for k, step in enumerate(recorder.steps):
        ref = reference(base, step, own, clip)
        sizes.append([b["input_ids"].shape[0] for b in step["batches"]])
        for n, g in ref.items():
            got = step["grads"][n]
            assert got is not None, n
            torch.testing.assert_close(got, g, rtol=TOL, atol=TOL, msg=f"step {k} .grad of {n}")
        after = recorder.steps[k + 1]["params"] if k + 1 < len(recorder.steps) else recorder.final
        for n, g in ref.items():  # SGD, constant learning rate, no weight decay
            torch.testing.assert_close(after[n], step["params"][n] - lr * g, rtol=TOL, atol=TOL)
    if clip is not None:  # clipping changes some samples and leaves others: a wrong scale would show
        assert min(NORMS) < clip < max(NORMS), NORMS
    return sizes


# -- every optimizer step against the per-sample reference ----------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["mean", "clip", "clip+checkpointing", "clip+reentrant"],
)
def test_gpt2_every_step_is_the_mean_of_each_samples_own_clipped_gradient(tmp_path: Path, case: str) -> None:
    """Padded rows of different lengths, 2 micro-batches per step, 13 samples: the third step is one
    micro-batch of one sample (the end of the epoch), the fourth starts the next epoch."""
    base = gpt2()
    clip = LM_CLIP if "clip" in case else None
    overrides: dict[str, Any] = {}
    if "checkpointing" in case or "reentrant" in case:
        overrides["activation_checkpointing"] = True
        overrides["activation_checkpointing_kwargs"] = {"use_reentrant": case.endswith("reentrant")}
    recorder, trainer = run(
        copy.deepcopy(base),
        lm_data(13),
        tmp_path,
        args=arguments(tmp_path, **overrides),
        transforms={"": transforms.clip_norm(clip)} if clip else None,
    )
    assert check_steps(recorder, base, lm_sample, clip) == [[3, 3], [3, 3], [1], [3, 3]]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4  # logged per step: the mean of the per-sample losses, not k times it
    first = recorder.steps[0]
    reference_model = copy.deepcopy(base)
    own = [lm_sample(reference_model, b, i).item() for b in first["batches"] for i in range(b["input_ids"].shape[0])]
    assert losses[0] == pytest.approx(sum(own[:3]) / 3 / 2 + sum(own[3:]) / 3 / 2, rel=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gpt2_with_torch_compile_every_step_is_exact(tmp_path: Path, backend: str) -> None:
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the model it trains (the model pergrad
    hooked), and every step is still the mean of each sample's own clipped gradient."""
    torch._dynamo.reset()  # (code Dynamo compiled for a GPT-2 of another test would run this one unhooked)
    try:
        base = gpt2()
        args = arguments(tmp_path, torch_compile=True, torch_compile_backend=backend)
        recorder, trainer = run(
            copy.deepcopy(base), lm_data(13), tmp_path, args=args, transforms={"": transforms.clip_norm(LM_CLIP)}
        )
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # the steps ran the compiled model
        assert check_steps(recorder, base, lm_sample, LM_CLIP) == [[3, 3], [3, 3], [1], [3, 3]]
    finally:
        torch._dynamo.reset()


def test_bert_classifier_every_step_is_the_mean_of_clipped_per_sample_gradients(tmp_path: Path) -> None:
    base = bert()
    recorder, trainer = run(copy.deepcopy(base), class_data(13), tmp_path, transforms={"": transforms.clip_norm(1.2)})
    assert check_steps(recorder, base, class_sample, 1.2) == [[3, 3], [3, 3], [1], [3, 3]]
    held_out = class_data(5, seed=3)  # evaluation: the same per-sample loss, no gradient kept
    metrics = trainer.evaluate(held_out)
    model = trainer.model
    own = [class_own_loss(model, r["input_ids"], r["labels"]).item() for r in held_out]
    assert metrics["eval_loss"] == pytest.approx(sum(own) / 5, rel=1e-9)


def test_bert_with_lora_every_step_is_exact(tmp_path: Path) -> None:
    """peft LoRA on the attention and MLP projections, a new head trained beside (modules_to_save):
    only those are trainable, and their per-sample gradients are clipped together."""
    peft = pytest.importorskip("peft")
    base = peft.get_peft_model(
        bert(),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="SEQ_CLS", target_modules=["query", "value"]),
    ).double()
    recorder, _ = run(copy.deepcopy(base), class_data(13), tmp_path, transforms={"": transforms.clip_norm(1.0)})
    names = set(recorder.steps[0]["grads"])
    assert names and all("lora_" in n or "classifier" in n for n in names)
    check_steps(recorder, base, class_sample, 1.0)


def test_per_sample_lm_loss_as_compute_loss_func_of_a_plain_trainer(tmp_path: Path) -> None:
    """The Trainer-compatible form: a plain Trainer with compute_loss_func=PerSampleLMLoss() does not
    divide the loss by the micro-batches, so a wrapper kept aside with accumulate="samples" makes
    every step's .grad the mean over the step's samples."""
    from pergrad import PerSampleLMLoss

    base = gpt2()
    model = copy.deepcopy(base)
    psm = PerSampleModule(model, accumulate="samples", keep_grad_sample=False)
    psm.register_transform(model, transforms.clip_norm(LM_CLIP))
    recorder = Recorder()
    recorder.model = model

    class Plain(Trainer):
        def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
            recorder.steps[-1]["batches"].append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Plain(
        model=model,
        args=arguments(tmp_path, max_steps=3),
        train_dataset=lm_data(13),
        data_collator=collate,
        compute_loss_func=PerSampleLMLoss(),
        callbacks=[recorder],
    )
    trainer.train()
    psm.remove()
    check_steps(recorder, base, lm_sample, LM_CLIP)


# -- projected per-sample gradients (training-data attribution during training) --------------------------------


class Projecting(Recording):
    """Records, beside each micro-batch, the features its backward gave (``per_sample_projections()``)."""

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.recorder.steps[-1]["batches"][-1]["features"] = {
            name: f.detach().clone() for name, f in self.psm.per_sample_projections().items()
        }
        return loss


@pytest.mark.parametrize("case", ["clip", "clip+reentrant"])
def test_gpt2_features_of_every_micro_batch_are_of_each_samples_own_gradient(tmp_path: Path, case: str) -> None:
    """``projections=`` in a clipping run with 2 micro-batches per step: after every micro-batch's backward,
    ``per_sample_projections()`` holds ``P vec(g_i)`` of that micro-batch's samples, each run alone at the step's
    parameters (the raw ``g_i``, before clipping, of the sample's own loss), for a Kronecker projection of the
    whole model and a dense one of one block; and every step's ``.grad`` is still the clipped mean."""
    from pergrad.attribution.projectors import Projector, Spec

    base = gpt2()
    specs = {"": Spec(16, "kron", 5, None), "transformer.h.1.mlp": Spec(8, "dense", 2, None)}
    overrides: dict[str, Any] = {}
    if case.endswith("reentrant"):
        overrides = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}}
    recorder, _ = run(
        copy.deepcopy(base),
        lm_data(13),
        tmp_path,
        args=arguments(tmp_path, **overrides),
        trainer_cls=Projecting,
        transforms={"": transforms.clip_norm(LM_CLIP)},
        projections={t: {"dim": s.dim, "kind": s.kind, "seed": s.seed} for t, s in specs.items()},
    )
    assert check_steps(recorder, base, lm_sample, LM_CLIP) == [[3, 3], [3, 3], [1], [3, 3]]
    shapes = {n: tuple(p.shape) for n, p in base.named_parameters()}
    blocks = {t: {n: Projector(s, n, shapes[n]).matrix() for n in shapes if n.startswith(t)} for t, s in specs.items()}
    assert len(blocks[""]) == len(shapes) and len(blocks["transformer.h.1.mlp"]) == 4
    for k, step in enumerate(recorder.steps):
        model = copy.deepcopy(base)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(step["params"][n])
        params = dict(model.named_parameters())
        for m, batch in enumerate(step["batches"]):
            assert set(batch["features"]) == set(specs)
            for i in range(batch["input_ids"].shape[0]):
                grads = dict(zip(params, torch.autograd.grad(lm_sample(model, batch, i), list(params.values()))))
                for target, found in batch["features"].items():
                    want = sum(grads[n].flatten() @ block.T for n, block in blocks[target].items())
                    torch.testing.assert_close(
                        found[i], want, rtol=TOL, atol=TOL, msg=f"step {k} micro-batch {m} sample {i} {target!r}"
                    )


# -- DP-SGD ------------------------------------------------------------------------------------------------


def dp_arguments(tmp_path: Path, **overrides: Any) -> TrainingArguments:
    kwargs: dict[str, Any] = dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=6)
    kwargs.update(overrides)
    return arguments(tmp_path, **kwargs)


def test_dp_sgd_without_noise_is_the_sum_of_clipped_gradients_over_the_expected_batch(tmp_path: Path) -> None:
    """Poisson batches (expected size 1 * 2 micro-batches of 13 samples), noise_multiplier=0: every step's
    .grad is sum_i clip(g_i) / 2 over the samples the Poisson draw put in the step, an empty step included
    (no forward; .grad 0, the noise alone)."""
    base = gpt2()
    privacy = DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=0.0, delta=1e-5, seed=5)  # reproducible batches
    recorder, trainer = run(copy.deepcopy(base), lm_data(13), tmp_path, args=dp_arguments(tmp_path), privacy=privacy)
    sizes = [[b["input_ids"].shape[0] for b in step["batches"]] for step in recorder.steps]
    assert len(sizes) == 6 and all(len(s) == 2 for s in sizes)
    # with seed 5: [[0, 0], [1, 1], [1, 1], [2, 2], [1, 1], [1, 0]]
    assert [0, 0] in sizes and len({sum(s) for s in sizes}) > 2, sizes  # an empty step; the batch size varies
    NORMS.clear()
    for k, step in enumerate(recorder.steps):
        n = sum(sizes[k])
        ref = reference(base, step, lm_sample, LM_CLIP) if n else None
        for name, got in step["grads"].items():
            want = torch.zeros_like(got) if ref is None else ref[name] * n / 2
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=f"step {k} {name}")
    assert trainer.dp.steps == 6
    assert min(NORMS) < LM_CLIP < max(NORMS), NORMS


def test_dp_sgd_adds_the_noise_once_per_step_and_logs_epsilon(tmp_path: Path) -> None:
    from pergrad.privacy import epsilon_of

    base = gpt2()
    sigma, clip = 2.0, LM_CLIP
    privacy = DPConfig(max_grad_norm=clip, noise_multiplier=sigma, delta=1e-5)
    recorder, trainer = run(
        copy.deepcopy(base), lm_data(13), tmp_path, args=dp_arguments(tmp_path, max_steps=3), privacy=privacy
    )
    for step in recorder.steps:
        n = sum(b["input_ids"].shape[0] for b in step["batches"])
        ref = reference(base, step, lm_sample, clip) if n else None
        noise = torch.cat(
            [(g - (0 if ref is None else ref[name] * n / 2)).flatten() for name, g in step["grads"].items()]
        )
        # 26,720 draws of N(0, (sigma C / E[B])^2) from the OS's entropy: the empirical std within 3% (6.9
        # standard errors, 4e-12; twice the noise: +41%), the mean within 0.045 std (7.4 standard errors, 2e-13;
        # it was 0.03, 4.9 of them: 1e-6 a step, 3e-6 a run)
        assert noise.std().item() == pytest.approx(sigma * clip / 2, rel=0.03)
        assert abs(noise.mean().item()) < 0.045 * sigma * clip / 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert not any("grad_norm" in entry for entry in logs)  # Trainer's is measured before the noise
    logged = [entry["epsilon"] for entry in logs]
    q = 2 / 13
    assert logged == pytest.approx([epsilon_of(sigma, q, k, 1e-5) for k in (1, 2, 3)], rel=1e-9)
    assert trainer.epsilon() == logged[-1] and logged[0] < logged[1] < logged[2]


# -- checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("private", [False, True], ids=["clip", "dp"])
def test_resume_from_a_checkpoint_gives_the_same_next_steps(tmp_path: Path, private: bool) -> None:
    """4 steps straight through, saving after step 2; then a new trainer on a fresh model resumed from
    that checkpoint: steps 3 and 4 take the same .grad as the uninterrupted run. Under DP-SGD (no noise
    here, batches seeded by DPConfig.seed) the resumed run continues the sampler's stream from where the
    checkpoint left it: its batches are the uninterrupted run's next draws, none drawn again."""
    base = gpt2()
    options: dict[str, Any] = (
        {"privacy": DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=0.0, delta=1e-5, seed=3)}
        if private
        else {"transforms": {"": transforms.clip_norm(LM_CLIP)}}
    )
    make_args = dp_arguments if private else arguments
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    straight, first = run(copy.deepcopy(base), lm_data(13), tmp_path, args=args, **options)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed, second = run(copy.deepcopy(base), lm_data(13), tmp_path, args=args, resume=str(checkpoint), **options)
    assert len(resumed.steps) == 2
    for k, step in enumerate(resumed.steps):
        before = straight.steps[k + 2]
        for a, b in zip(step["batches"], before["batches"], strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"])
        for name, got in step["grads"].items():
            torch.testing.assert_close(got, before["grads"][name], rtol=TOL, atol=TOL)
    for name, p in resumed.final.items():
        torch.testing.assert_close(p, straight.final[name], rtol=TOL, atol=TOL)
    if private:
        assert second.dp is not None and first.dp is not None
        assert second.dp.steps == first.dp.steps == 4
        assert second.epsilon() == first.epsilon()


def test_dp_resume_never_trains_on_a_draw_again(tmp_path: Path) -> None:
    """Resumed with TrainingArguments(ignore_data_skip=True) (and without: PerSampleTrainer sets it), a DP-SGD
    run draws afresh: no resumed step's batch is one the run already trained on (each row is its own sample
    here: 200 rows, q = 1/10), and the steps are counted on from the checkpoint."""
    base = gpt2()
    # Two fresh draws are equal with probability (q^2 + (1-q)^2)^N minus both empty: 6e-18 at N = 200, E[B] = 20.
    # At N = 40, E[B] = 4 it was 1.4e-4 a pair of draws, 9 pairs: the test failed in 1.2e-3 of runs (4,977 of
    # 4,000,000 simulated runs of the 6 draws).
    data = lm_data(200)
    privacy = DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=1.0, delta=1e-5)
    args = dp_arguments(
        tmp_path,
        per_device_train_batch_size=10,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        ignore_data_skip=True,
    )
    straight, _ = run(copy.deepcopy(base), data, tmp_path, args=args, privacy=privacy)
    resumed, second = run(
        copy.deepcopy(base), data, tmp_path, args=args, resume=str(tmp_path / "out" / "checkpoint-3"), privacy=privacy
    )
    assert second.dp is not None and second.dp.steps == 6 and len(resumed.steps) == 3

    def draws(recorder: Recorder) -> list[set[bytes]]:
        return [{row.numpy().tobytes() for b in step["batches"] for row in b["input_ids"]} for step in recorder.steps]

    trained = draws(straight)[:3]
    again = [d for d in draws(resumed) if d and any(d == before for before in trained)]
    assert not again


def test_save_pretrained_while_wrapped_saves_the_models_own_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base = gpt2()
    _, trainer = run(
        copy.deepcopy(base),
        lm_data(7),
        tmp_path,
        args=arguments(tmp_path, max_steps=2),
        transforms={"": transforms.clip_norm(0.5)},
    )
    trainer.save_model(str(tmp_path / "saved"))  # Trainer's save: the model's save_pretrained, still wrapped
    trainer.model.save_pretrained(str(tmp_path / "direct"))
    own = trainer.model.state_dict()
    for folder in ("saved", "direct"):
        saved = load_file(str(tmp_path / folder / "model.safetensors"))
        reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / folder), dtype=torch.float64)
        assert set(reloaded.state_dict()) == set(base.state_dict())
        assert set(saved) <= set(own) and not any("pergrad" in k or "grad_sample" in k for k in saved)
        for k, v in reloaded.state_dict().items():
            torch.testing.assert_close(v, own[k], rtol=0, atol=0)
    assert trainer.psm.module is trainer.model  # still wrapped: the next step is still per sample


# -- what is refused, and what a wrapper is not -----------------------------------------------------------------


def test_trainer_given_the_wrapper_says_what_to_pass(tmp_path: Path) -> None:
    model = gpt2()
    psm = PerSampleModule(model)
    with pytest.raises(
        WrapperAttributeError,
        match=r"PerSampleModule has no attribute 'to': it is not an nn.Module.*"
        r"psm.module.to.*pergrad.integrations.hf.PerSampleTrainer\(model=model",
    ):
        Trainer(model=psm, args=arguments(tmp_path))
    assert not hasattr(psm, "config") and hasattr(psm.module, "config")
    assert getattr(psm, "generate", None) is None
    copy.copy(psm)  # copy's protocol lookups on an instance whose __init__ never ran: no recursion
    bare = PerSampleModule.__new__(PerSampleModule)
    assert getattr(bare, "__setstate__", None) is None
    with pytest.raises(WrapperAttributeError, match=r"no attribute 'anything'"):
        getattr(bare, "anything")  # noqa: B009
    with pytest.raises(TrainerConfigError, match=r"takes the model itself, not a PerSampleModule.*psm.module"):
        PerSampleTrainer(model=psm, args=arguments(tmp_path))
    psm.remove()


@pytest.mark.parametrize(
    ("overrides", "options", "match"),
    [
        (
            {"max_grad_norm": 1.0},
            {"transforms": {"": transforms.clip_norm(1.0)}},
            r"max_grad_norm=1.0\).*AGGREGATE.*TrainingArguments\(max_grad_norm=0\)",
        ),
        ({"max_grad_norm": 1.0}, {"privacy": DPConfig(1.0, 1.0, 1e-5)}, r"not per-sample clipping.*max_grad_norm=0"),
        ({"label_smoothing_factor": 0.1}, {}, r"label_smoothing_factor=0.1.*LabelSmoother.*per_sample_loss"),
        ({"optim": "lomo"}, {}, r"optim=.*lomo.*inside the backward"),
        ({"train_sampling_strategy": "group_by_length"}, {"privacy": DPConfig(1.0, 1.0, 1e-5)}, r"Poisson"),
        (
            {},
            {"compute_loss_func": lambda out, labels, num_items_in_batch=None: out.logits.mean()},
            r"per_sample_loss=fn",
        ),
        ({}, {"per_sample_options": {"accumulate": "backward"}}, r"\['accumulate'\] are set by PerSampleTrainer"),
    ],
)
def test_options_that_break_per_sample_numbers_are_refused(
    tmp_path: Path, overrides: dict[str, Any], options: dict[str, Any], match: str
) -> None:
    model = gpt2()
    with pytest.raises(TrainerConfigError, match=match):
        PerSampleTrainer(
            model=model,
            args=arguments(tmp_path, **overrides),
            train_dataset=lm_data(5),
            data_collator=collate,
            **options,
        )
    PerSampleModule(model).remove()  # nothing was left wrapped


def test_aggregate_clipping_is_refused_at_train_for_a_transform_registered_later(tmp_path: Path) -> None:
    model = gpt2()
    trainer = PerSampleTrainer(
        model=model, args=arguments(tmp_path, max_grad_norm=1.0), train_dataset=lm_data(5), data_collator=collate
    )
    trainer.psm.register_transform(model, transforms.clip_norm(1.0))
    with pytest.raises(TrainerConfigError, match=r"max_grad_norm=0"):
        trainer.train()


def test_data_parallel_over_several_gpus_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = arguments(tmp_path)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(TrainerConfigError, match=r"sees 2 GPUs.*nn.DataParallel.*torchrun"):
        PerSampleTrainer(model=gpt2(), args=args, train_dataset=lm_data(5), data_collator=collate)


def test_a_loss_that_is_not_per_sample_is_refused(tmp_path: Path) -> None:
    trainer = PerSampleTrainer(
        model=gpt2(),
        args=arguments(tmp_path),
        train_dataset=lm_data(5),
        data_collator=collate,
        per_sample_loss=lambda out, labels: out.logits.mean(),
    )
    with pytest.raises(TrainerConfigError, match=r"per_sample_loss returned \(\); it must return \[B\] = \[3\]"):
        trainer.train()


# -- the loss and the package ---------------------------------------------------------------------------------


def test_per_sample_lm_loss_is_each_rows_own_loss() -> None:
    from pergrad import per_sample_lm_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, VOCAB, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (3, 6), generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    labels = ids.masked_fill(mask == 0, -100)
    own = torch.stack(
        [
            F.cross_entropy(logits[i, : int(n) - 1], ids[i, 1 : int(n)], reduction="sum")
            for i, n in enumerate(mask.sum(1))
        ]
    )
    torch.testing.assert_close(per_sample_lm_loss(logits, labels), own)
    torch.testing.assert_close(per_sample_lm_loss(logits, ids, mask), own)
    torch.testing.assert_close(per_sample_lm_loss(logits, labels, reduction="mean"), own / (mask.sum(1) - 1))
    torch.testing.assert_close(per_sample_lm_loss(logits[:, :-1], labels[:, 1:], shift=False), own)


def test_the_core_never_imports_the_hf_integration() -> None:
    code = (
        "import sys, pergrad, pergrad.privacy, pergrad.integrations.lm; "
        "assert 'transformers' not in sys.modules and 'pergrad.integrations.hf' not in sys.modules, 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# -- two processes (torchrun, gloo) -----------------------------------------------------------------------------

DDP_SCRIPT = """
import sys
from pathlib import Path

import torch

sys.path.insert(0, {root!r})
from tests.test_hf_trainer import LM_CLIP, Recorder, Recording, collate, dp_arguments, gpt2, lm_data

from pergrad.integrations.hf import DPConfig

out = Path(sys.argv[1])
for name, sigma in (("exact", 0.0), ("noisy", 1.0)):
    recorder = Recorder()
    args = dp_arguments(out / name, max_steps=6, ddp_backend="gloo")
    privacy = DPConfig(max_grad_norm=LM_CLIP, noise_multiplier=sigma, delta=1e-5, seed=4 if sigma == 0 else None)
    trainer = Recording(model=gpt2(), args=args, train_dataset=lm_data(13), data_collator=collate, privacy=privacy)
    recorder.model = trainer.model
    trainer.recorder = recorder
    trainer.add_callback(recorder)
    trainer.train()
    torch.save({{"steps": recorder.steps, "dp_steps": trainer.dp.steps}}, out / f"{{name}}{{args.process_index}}.pt")
"""


def test_dp_sgd_under_torchrun_every_rank_takes_every_step(tmp_path: Path) -> None:
    """2 processes (torchrun, gloo on CPU), DP-SGD with 2 micro-batches per step and one sample expected per
    rank and micro-batch: ranks' shares are often empty. Every rank still runs every backward (a stand-in row
    where its share is empty), so every step's .grad is the same on both ranks and, without noise, is
    ``sum_i clip(g_i) / E[B]`` over BOTH ranks' samples of the step (each sample alone, in float64); with
    noise, both ranks hold the same noisy .grad (the noise once, seeded from rank 0's entropy)."""
    script = tmp_path / "dp_ddp.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT)))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:  # a free port for the rendezvous (torchrun's port 0 never meets)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(script),
    ]
    done = subprocess.run([*command, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, timeout=3600)
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    exact = [torch.load(tmp_path / f"exact{r}.pt", weights_only=False) for r in range(2)]
    assert exact[0]["dp_steps"] == exact[1]["dp_steps"] == 6
    base = gpt2()
    sizes = []
    for k, (zero, one) in enumerate(zip(exact[0]["steps"], exact[1]["steps"])):
        sizes.append([[b["input_ids"].shape[0] for b in rank["batches"]] for rank in (zero, one)])
        both = {
            "params": zero["params"],
            "batches": [b for b in zero["batches"] + one["batches"] if len(b["input_ids"])],
        }
        n = sum(len(b["input_ids"]) for b in both["batches"])
        ref = reference(base, both, lm_sample, LM_CLIP) if n else None
        for name, got in zero["grads"].items():
            assert torch.equal(got, one["grads"][name]), f"step {k} {name}: the ranks differ"
            want = torch.zeros_like(got) if ref is None else ref[name] * n / 4  # E[B] = 1 * 2 micro * 2 ranks
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=f"step {k} {name}")
    flat = [s for step in sizes for rank in step for s in rank]
    assert 0 in flat and any(sum(rank) > 0 and 0 in rank for step in sizes for rank in step), sizes
    noisy = [torch.load(tmp_path / f"noisy{r}.pt", weights_only=False) for r in range(2)]
    for zero, one in zip(noisy[0]["steps"], noisy[1]["steps"]):
        for name, got in zero["grads"].items():
            assert torch.equal(got, one["grads"][name])
