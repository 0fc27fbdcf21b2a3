"""DP fine-tuning of HuggingFace transformers with LoRA: a BERT classifier and a GPT-2 language model.

The fine-tuning is DP-SGD exactly as in ``examples/dp_sgd.py``, from ``pergrad.privacy``: batches by
Poisson sampling (``PoissonBatchSampler``: every sample joins each step's batch with probability
``--rate``), every sample's gradient over ALL trainable parameters clipped to norm ``--clip`` (``DPSGD``
registers ``clip_norm`` on the root target, computed in the ordinary backward without building
per-sample gradients), Gaussian noise ``N(0, sigma^2 C^2)`` added to the summed clipped gradient and the
sum divided by the EXPECTED batch size (at ``optimizer.step()``, which ``DPSGD`` hooks), then an ordinary
optimizer step (Adam).
Google's ``dp_accounting`` (RDP accountant by default; ``pergrad.privacy.epsilon_of``) turns (sigma,
rate, number of steps) into the epsilon spent at ``--delta``.

Data: real text that ships with Python, ``pydoc_data.topics`` -- the 79 pages of the Python
documentation that ``help("while")`` prints (the Language Reference, and library pages such as
"String Methods" and "pdb"). Prose paragraphs are split into sentences (code, grammar and tables
dropped). Four pages are the PRIVATE data set (80% train, 20% test): "Compound statements",
"Special method names", "pdb -- The Python Debugger", "String Methods". The other 75 pages, minus
any sentence that also occurs on a private page, are PUBLIC.

The models: DP fine-tuning starts from a pretrained model, and nothing is downloaded here, so each
tiny, randomly initialised model (``BertConfig``/``GPT2Config``) is first pretrained WITHOUT privacy
on the public pages (``--pretrain-steps``; plain Adam, no clipping, no noise, no privacy cost: a
stand-in for ``from_pretrained``). The word-level vocabulary is built from the public text too, like
a pretrained tokenizer. Then ``peft`` LoRA freezes every base weight and adds rank-8 adapters
(``lora_A``/``lora_B``, plain ``nn.Linear`` layers) to the attention and MLP projections (and to
GPT-2's output layer ``lm_head``, untied from the input embedding), and only those (and BERT's new
classification head, peft's ``modules_to_save``) are trained with DP on the private pages. pergrad
hooks exactly the trainable layers: GPT-2's own ``Conv1D`` projections, the embeddings and the
LayerNorms are frozen, so they need no rule. (Without the public pretraining a randomly
initialised, frozen BERT passes too little of its input to the [CLS] position for LoRA to learn:
test accuracy stays near the majority class's share even with ``--sigma 0``.)

- BERT (``BertForSequenceClassification``): pretrained to tell the 75 public pages apart, then
  fine-tuned (a new 4-way head) to tell which private page a sentence comes from; metric: test
  accuracy (the table also shows the majority class's share).
- GPT-2 (``GPT2LMHeadModel``): pretrained as a language model on the public sentences, fine-tuned
  on the private ones; metric: test perplexity, ``exp(sum of token losses / number of predicted
  tokens)``.

The per-sample loss of a language model
---------------------------------------
DP-SGD clips the gradient of each sample's OWN loss ``f_i``. For a language model ``f_i`` must be
computed from sample i's tokens alone: here the SUM of its token losses, padding excluded
(``pergrad.per_sample_lm_loss``: logits shifted against the next tokens, ``cross_entropy`` with
``reduction="none"`` and ``ignore_index=-100`` on padded positions, summed over each row), and the
batch loss is ``sum_i f_i`` (``PerSampleModule(..., loss_reduction="sum")``). pergrad then clips
``g_i = grad f_i``, which is what the privacy analysis assumes.

The loss HuggingFace computes when you pass ``labels=`` to the model is NOT such a sum: it is the
mean over ALL predicted tokens of the batch, ``sum_i f_i / sum_j n_j`` (``n_j``: sample j's number of
predicted tokens). Every sample's share is divided by a number that depends on the OTHER samples of
the batch, so the "per-sample gradient" pergrad would see is ``grad f_i / sum_j n_j``: not the
gradient of any sample's own loss, with a norm that shrinks as the batch (and its token count)
grows, so the clipping bound ``C`` would mean something different at every step (and with Poisson
sampling the batch size is random). So the example calls
``model(input_ids=..., attention_mask=...).logits`` and computes the loss itself. (Dividing ``f_i``
by sample i's OWN token count, ``--token-loss mean``, is also a per-sample loss; the perplexity in
the table is always per token.)

Wrapping does not change the model: ``psm(...)`` runs ``model(...)``; attributes and ``generate()``
are used on the model itself (a short GPT-2 sample is printed after training).

Run: python examples/dp_finetune.py [--model bert|gpt2|both] [--epochs 3] [--sigma 1.0] [--clip 1.0]
     [--rate 0.05] [--delta 1e-5] [--seed 0] [--quick]
(needs ``pip install -c constraints.txt -e ".[examples,hf]"``: transformers, peft, dp-accounting, tqdm)
"""

from __future__ import annotations

import argparse
import math
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule, per_sample_lm_loss
from pergrad.privacy import DPSGD, PoissonBatchSampler, epsilon_of

# the private data set: pydoc topic -> the page's title
PRIVATE_PAGES = {
    "compound": "Compound statements",
    "specialnames": "Special method names",
    "debugger": "pdb -- The Python Debugger",
    "string-methods": "String Methods",
}
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"  # BOS doubles as BERT's [CLS]

Forward = Callable[..., Any]  # the model, or the PerSampleModule wrapping it
Sequences = list[list[int]]


def prose_sentences(text: str) -> list[str]:
    """The sentences of the prose paragraphs of one pydoc topic (code, grammar and tables dropped)."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        if ">>>" in block or "::=" in block or re.search(r"^\s*[+=*-]{4,}", block, re.MULTILINE):
            continue  # an interactive session, a grammar rule, a table or a heading's underline
        words = block.split()
        if len(words) < 6 or sum(w[0].isalpha() for w in words) < 0.7 * len(words):
            continue  # a code snippet or a list of names
        for sentence in re.split(r"(?<=[.!?:])\s+(?=[A-Z\"“])", " ".join(words)):
            if len(sentence.split()) >= 5:
                out.append(sentence)
    return out


class Vocab:
    """Word-level tokenizer: lower-cased words and single punctuation marks, the most frequent kept."""

    def __init__(self, texts: Iterable[str], size: int) -> None:
        counts = Counter(token for text in texts for token in self.split(text))
        self.itos = [PAD, UNK, BOS, EOS] + [t for t, _ in counts.most_common(size - 4)]
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.pad, self.unk, self.bos, self.eos = range(4)

    @staticmethod
    def split(text: str) -> list[str]:
        return re.findall(r"\w+|[^\w\s]", text.lower())

    def encode(self, text: str, max_len: int) -> list[int]:
        """``<bos> tokens... <eos>``, at most ``max_len`` ids."""
        ids = [self.bos] + [self.stoi.get(t, self.unk) for t in self.split(text)] + [self.eos]
        return ids[:max_len]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.itos[i] for i in ids)

    def __len__(self) -> int:
        return len(self.itos)


class Corpus(NamedTuple):
    """Token ids and labels: public (label = index of the public page), private train and test."""

    vocab: Vocab
    public: Sequences
    public_labels: Tensor
    train: Sequences
    train_labels: Tensor
    test: Sequences
    test_labels: Tensor
    n_public_pages: int


def load_corpus(vocab_size: int, max_len: int, train_size: int = 0) -> Corpus:
    from pydoc_data.topics import topics  # ships with CPython, for help()

    private: dict[str, int] = {}
    for label, page in enumerate(PRIVATE_PAGES):
        for sentence in prose_sentences(topics[page]):
            private.setdefault(sentence, label)  # a sentence twice on the private pages counts once
    public: dict[str, int] = {}
    public_pages = sorted(set(topics) - set(PRIVATE_PAGES))
    for label, page in enumerate(public_pages):
        for sentence in prose_sentences(topics[page]):
            if sentence not in private:  # pages overlap: "if" and "while" repeat "compound"
                public.setdefault(sentence, label)
    # a fixed shuffle (independent of --seed) into train and test
    items = sorted(private.items())
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    n_test = round(0.2 * len(items))
    test, train = [items[i] for i in order[:n_test]], [items[i] for i in order[n_test:]]
    train = train[: train_size or None]
    vocab = Vocab(public.keys(), vocab_size)  # like a pretrained tokenizer: public text only

    def encode(pairs: Iterable[tuple[str, int]]) -> tuple[Sequences, Tensor]:
        pairs = list(pairs)
        return [vocab.encode(s, max_len) for s, _ in pairs], torch.tensor([y for _, y in pairs])

    return Corpus(vocab, *encode(public.items()), *encode(train), *encode(test), len(public_pages))


def pad_batch(seqs: Sequences, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad to the longest sequence: ``input_ids`` and ``attention_mask`` (1 = a real token)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def lm_loss(forward: Forward, seqs: Sequences, pad_id: int, reduction: str = "sum") -> Tensor:
    """``sum_i f_i`` over ``seqs``: the loss from the logits, NOT from ``labels=`` (see the docstring)."""
    ids, mask = pad_batch(seqs, pad_id)
    return per_sample_lm_loss(forward(input_ids=ids, attention_mask=mask).logits, ids, mask, reduction).sum()


def classification_loss(forward: Forward, seqs: Sequences, labels: Tensor, pad_id: int) -> Tensor:
    """``sum_i f_i``: each sentence's cross-entropy, summed."""
    ids, mask = pad_batch(seqs, pad_id)
    return F.cross_entropy(forward(input_ids=ids, attention_mask=mask).logits, labels, reduction="sum")


def pretrain(model: nn.Module, batch_loss: Callable[[Tensor], Tensor], n: int, steps: int, name: str) -> float:
    """Public pretraining, no privacy: plain Adam on batches of 64; returns the seconds it took."""
    from tqdm import tqdm

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    start = time.perf_counter()
    for _ in tqdm(range(steps), desc=f"{name} public pretraining", leave=False):
        index = torch.randint(n, (64,))
        optimizer.zero_grad()
        (batch_loss(index) / len(index)).backward()
        optimizer.step()
    model.eval()
    return time.perf_counter() - start


def dp_finetune(
    model: nn.Module,
    batch_loss: Callable[[PerSampleModule, Tensor], Tensor],
    n: int,
    args: argparse.Namespace,
    name: str,
) -> tuple[int, float]:
    """DP-SGD over ``args.epochs`` epochs of ``int(1/rate)`` Poisson-sampled steps; (steps, seconds per epoch).

    ``batch_loss(psm, index)`` returns ``sum_i f_i`` over the samples ``index``, forward through ``psm``.
    """
    from tqdm import tqdm

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    # the batches from the operating system's entropy: a seed of ours (--seed is public) would give them away
    sampler = PoissonBatchSampler(n, args.rate, steps=int(1 / args.rate))
    model.train()
    start = time.perf_counter()
    with PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False) as psm:
        # flat clipping of all trainable params, the noise at each optimizer step, the division by E[B]
        dp = DPSGD(psm, optimizer, sampler, max_grad_norm=args.clip, noise_multiplier=args.sigma)
        for epoch in range(args.epochs):
            for batch in tqdm(sampler, desc=f"{name} DP epoch {epoch + 1}/{args.epochs}", leave=False):
                optimizer.zero_grad()
                if batch:  # an empty batch (one process): no forward, the step is the noise alone
                    batch_loss(psm, torch.tensor(batch)).backward()  # .grad = sum_i clip(g_i) / E[B]
                optimizer.step()  # DPSGD adds the noise first: (sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / E[B]
        dp.remove()
    model.eval()
    return dp.steps, (time.perf_counter() - start) / max(args.epochs, 1)


def with_lora(model: nn.Module, **lora: Any) -> nn.Module:
    """Freeze ``model`` and add LoRA adapters (rank 8) where ``lora`` says."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        # peft 0.21 on transformers 5 calls a deprecated alias; and it sets fan_in_fan_out per layer by
        # itself (True for GPT-2's Conv1D projections, whose weight is stored [in, out]), with a warning
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, **lora))


def bert(vocab_size: int, num_labels: int, max_len: int) -> nn.Module:
    """A tiny, randomly initialised ``BertForSequenceClassification`` (dropout off)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(config)


def bert_lora(model: nn.Module) -> nn.Module:
    # task_type="SEQ_CLS" also trains the head ("classifier"): peft's modules_to_save
    return with_lora(model, task_type="SEQ_CLS", target_modules=["query", "key", "value", "dense"])


def gpt2(vocab_size: int, max_len: int) -> nn.Module:
    """A tiny, randomly initialised ``GPT2LMHeadModel`` (dropout off; ids 0-3 are pad, unk, bos, eos)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=max_len,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config)


def gpt2_lora(model: nn.Module) -> nn.Module:
    return with_lora(model, task_type="CAUSAL_LM", target_modules=["c_attn", "c_proj", "c_fc", "lm_head"])


def run_bert(data: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    pad = data.vocab.pad
    base = bert(len(data.vocab), data.n_public_pages, args.max_len)
    pretrain_s = pretrain(
        base,
        lambda i: classification_loss(base, [data.public[j] for j in i], data.public_labels[i], pad),
        len(data.public),
        args.pretrain_steps,
        "bert",
    )
    model = bert(len(data.vocab), len(PRIVATE_PAGES), args.max_len)
    model.bert.load_state_dict(base.bert.state_dict())  # the pretrained encoder, a new head
    model = bert_lora(model)
    x_test, mask_test = pad_batch(data.test, pad)

    def accuracy() -> float:
        with torch.no_grad():
            logits = model(input_ids=x_test, attention_mask=mask_test).logits
        return (logits.argmax(1) == data.test_labels).float().mean().item()

    before = accuracy()
    steps, seconds = dp_finetune(
        model,
        lambda psm, i: classification_loss(psm, [data.train[j] for j in i], data.train_labels[i], pad),
        len(data.train),
        args,
        "bert",
    )
    return {
        "before": before,
        "after": accuracy(),
        "reference": torch.bincount(data.test_labels).max().item() / len(data.test_labels),
        "steps": steps,
        "pretrain_seconds": pretrain_s,
        "seconds_per_epoch": seconds,
    }


def run_gpt2(data: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    pad = data.vocab.pad
    model = gpt2(len(data.vocab), args.max_len)
    pretrain_s = pretrain(
        model, lambda i: lm_loss(model, [data.public[j] for j in i], pad), len(data.public), args.pretrain_steps, "gpt2"
    )
    model = gpt2_lora(model)
    x_test, mask_test = pad_batch(data.test, pad)

    def perplexity() -> float:
        with torch.no_grad():
            total = lm_loss(model, data.test, pad)
        return math.exp(total.item() / mask_test[:, 1:].sum().item())

    before = perplexity()
    steps, seconds = dp_finetune(
        model,
        lambda psm, i: lm_loss(psm, [data.train[j] for j in i], pad, args.token_loss),
        len(data.train),
        args,
        "gpt2",
    )
    after = perplexity()
    prompt = torch.tensor([data.vocab.encode("The", 2)])  # <bos> the
    with torch.no_grad():  # the model itself: generate() is untouched by the wrapping
        sample = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
        )
    return {
        "before": before,
        "after": after,
        "reference": unigram_perplexity(data.train, x_test, mask_test, len(data.vocab)),
        "steps": steps,
        "pretrain_seconds": pretrain_s,
        "seconds_per_epoch": seconds,
        "sample": data.vocab.decode(sample[0].tolist()),
    }


def unigram_perplexity(train: Sequences, x_test: Tensor, mask_test: Tensor, vocab_size: int) -> float:
    """Test perplexity of the private training set's word frequencies (add-one smoothed): a yardstick."""
    counts = torch.ones(vocab_size)
    for s in train:
        counts.index_add_(0, torch.tensor(s[1:]), torch.ones(len(s) - 1))
    targets = x_test[:, 1:][mask_test[:, 1:] == 1]
    return math.exp(-(counts / counts.sum()).log()[targets].mean().item())


QUICK = {"pretrain_steps": 20, "epochs": 1, "rate": 0.1}  # --quick, what the tests run


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bert", "gpt2", "both"], default="both")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping bound C")
    parser.add_argument("--rate", type=float, default=0.05, help="Poisson sampling rate (expected batch / N)")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation, batches and noise")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate of the DP fine-tuning")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="public pretraining steps (batches of 64)")
    parser.add_argument("--token-loss", choices=["sum", "mean"], default="sum", help="LM: f_i over its own tokens")
    parser.add_argument("--max-len", type=int, default=48, help="tokens per sentence, <bos>/<eos> included")
    parser.add_argument("--vocab", type=int, default=2000, help="vocabulary size")
    parser.add_argument("--train-size", type=int, default=0, help="use only N private training sentences (0: all)")
    parser.add_argument("--quick", action="store_true", help="20 pretraining steps, 1 epoch at rate 0.1 (10 DP steps)")
    args = parser.parse_args(argv)
    if args.quick:  # the quick settings, under any option given explicitly
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)

    data = load_corpus(args.vocab, args.max_len, args.train_size)
    runners = {"bert": run_bert, "gpt2": run_gpt2}
    results: dict[str, dict[str, Any]] = {}
    for name in ["bert", "gpt2"] if args.model == "both" else [args.model]:
        result = runners[name](data, args)
        result["epsilon"] = epsilon_of(args.sigma, args.rate, result["steps"], args.delta, args.accountant)
        results[name] = result

    print(
        f"\nDP-SGD + LoRA on {len(data.train)} private sentences (test {len(data.test)}; public {len(data.public)}): "
        f"sigma={args.sigma}, C={args.clip}, rate={args.rate}, {args.epochs} epochs, delta={args.delta}, "
        f"{args.accountant.upper()} accountant"
    )
    header = (
        f"{'model':<5} {'metric':<16} {'before DP':>9} {'after DP':>9} {'reference':>24} "
        f"{'pretrain s':>10} {'DP steps':>8} {'s/epoch':>8} {'epsilon':>8}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in results.items():
        if name == "bert":
            metric, reference, fmt = "test accuracy", f"majority class {r['reference']:.3f}", ".3f"
        else:
            metric, reference, fmt = "test perplexity", f"unigram {r['reference']:.1f}", ".1f"
        print(
            f"{name:<5} {metric:<16} {r['before']:>9{fmt}} {r['after']:>9{fmt}} {reference:>24} "
            f"{r['pretrain_seconds']:>10.1f} {r['steps']:>8} {r['seconds_per_epoch']:>8.2f} {r['epsilon']:>8.3f}"
        )
    if "gpt2" in results:
        print(f"\nGPT-2 after DP fine-tuning, greedy generate() from '<bos> the': {results['gpt2']['sample']}")
    return results


if __name__ == "__main__":
    main()
