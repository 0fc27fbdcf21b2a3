"""Training-data attribution for a small language model: which training sequence taught it this one?

The text: the dataset descriptions that ship inside scikit-learn (``sklearn/datasets/descr/*.rst``,
about 43 kB of English prose, tables and references, read in file-name order). They are installed with
the package the digits example already needs, need no download, are fixed for a given scikit-learn
version, and are small enough to train on in seconds; Python's stdlib docstrings would also do, but
they are mostly code-like prose, megabytes of it, and change with every Python release.

Bytes are the tokens (vocabulary 256). The text is cut into non-overlapping sequences of
``length + 1`` bytes (input: the first ``length``, target: the next byte at each position); 10% are
held out. A tiny causal transformer (token and position embeddings, ``--blocks`` pre-norm blocks of
causal self-attention and an MLP, all Linear layers) trains for a few epochs with Adam, in plain
PyTorch. At the end of each epoch the model is wrapped in a ``PerSampleModule`` for one feature pass
(and unwrapped: it is the same model after): each sequence's loss is the sum of its own tokens'
cross-entropies, and every training sequence's projected gradient ``P vec(g_i)``
(``register_projection(model, dim=k, kind="kron")``) is written into a ``FeatureStore``; the queries'
features come from the same projection. TracIn then ranks, for each query, the training sequences by
``sum_c lr_c phi_c(query)^T phi_c(train)`` and ``top_k`` keeps the best three: on the raw features,
and on unit-normalised ones (a second store, rows divided by their norm: a sum of cosines), since raw
inner products favour the training sequences with the largest gradients.

What is measured: among the queries are planted exact copies of some training sequences and near
copies (``--changed`` of their bytes replaced by random printable ones). The example reports how often
the copy's source is the top-1 proponent (a training sequence with the same bytes counts as the
source: the text repeats some lines), against a random ranking (about 1 / number of training
sequences). It also prints a held-out query with its top proponents, to read.

Run: python examples/attribution_lm.py [--epochs 4] [--dim 512] [--seed 0] [--seeds 1] [--partial 20] [--threads 1]
[--quick]
(needs scikit-learn and numpy: ``pip install -e ".[examples]"``)
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pergrad import PerSampleModule
from pergrad.attribution import FeatureStore, token_scores, top_k


def load_text() -> bytes:
    """scikit-learn's dataset descriptions, every ``.rst`` of ``sklearn/datasets/descr``, in name order."""
    root = files("sklearn.datasets.descr")
    return b"".join(f.read_bytes() for f in sorted(root.iterdir(), key=lambda f: f.name) if f.name.endswith(".rst"))


def sequences(length: int) -> Tensor:
    """``[N, length + 1]`` byte sequences cut from the text, without overlap (the tail is dropped)."""
    data = torch.frombuffer(bytearray(load_text()), dtype=torch.uint8).long()
    count = len(data) // (length + 1)
    return data[: count * (length + 1)].view(count, length + 1)


def decode(seq: Tensor) -> str:
    return bytes(seq.tolist()).decode("utf-8", errors="replace")


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, written with nn.Linear (every weight has a Kronecker rule)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        x = x + self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, length: int, width: int = 64, heads: int = 4, blocks: int = 1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(blocks)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device).repeat(b, 1))
        return self.head(self.norm(self.blocks(x)))


def sequence_losses(logits: Tensor, seqs: Tensor) -> Tensor:
    """``[B]``: each sequence's own loss, the sum of its tokens' cross-entropies."""
    return F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten(), reduction="none").view(len(seqs), -1).sum(1)


def wrap(model: nn.Module, dim: int, seed: int) -> PerSampleModule:
    """The model in a ``PerSampleModule`` projecting each sample's gradient of the whole model to ``dim``
    Kronecker features; the batch loss is the mean of the samples' losses, so the features are each
    sequence's own loss's gradient."""
    psm = PerSampleModule(model, loss_reduction="mean", keep_grad_sample=False)
    psm.register_projection(model, dim=dim, kind="kron", seed=seed)
    return psm


def features(psm: PerSampleModule, seqs: Tensor) -> Tensor:
    """``[B, dim]``: ``P vec(grad f_i)`` of each sequence's own loss ``f_i``, from one backward
    (``.grad`` cleared again)."""
    sequence_losses(psm(seqs[:, :-1]), seqs).mean().backward()
    psm.module.zero_grad(set_to_none=True)
    return psm.per_sample_projections()[""]


def plant(train: Tensor, held: Tensor, copies: int, changed: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """The queries: the held-out sequences, then ``copies`` exact copies of training sequences, then
    ``copies`` near copies (``changed`` bytes of each replaced by random printable ASCII). Returns
    ``(queries [m, L], source [m])``, source -1 for held-out queries."""
    picked = torch.randperm(len(train), generator=gen)[: 2 * copies]
    exact, near = train[picked[:copies]], train[picked[copies:]].clone()
    for row in near:
        where = torch.randperm(row.numel(), generator=gen)[:changed]
        row[where] = torch.randint(32, 127, (changed,), generator=gen)
    source = torch.cat([torch.full((len(held),), -1), picked])
    return torch.cat([held, exact, near]), source


def per_token_found(
    model: nn.Module, train: Tensor, count: int, dim: int, seed: int, feature_batch: int = 128
) -> dict[str, float]:
    """Per-token attribution of ``count`` queries that copy the first half of a training sequence (drawn with
    ``seed``) and continue with random printable bytes: ``{"copied": fraction of the copied query tokens whose
    best training token (cosine of per-token features) is the same token of the source, "random": fraction of
    the random query tokens whose best training token is in the source}``."""
    gen = torch.Generator().manual_seed(seed)
    n, width = train.shape
    length, half = width - 1, (width - 1) // 2
    source = torch.randperm(n, generator=gen)[:count]
    queries = train[source].clone()
    queries[:, half + 1 :] = torch.randint(32, 127, (count, width - half - 1), generator=gen)
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding)]
    psm = PerSampleModule(model, loss_reduction="sum", keep_grad_sample=False)
    for layer in layers:  # each layer's own per-token projection; the features concatenated
        psm.register_projection(layer, dim=dim, kind="kron", seed=seed, per_token=True, grads=False)
    with tempfile.TemporaryDirectory(prefix="pergrad-attribution-tokens-") as root:
        store = FeatureStore.open(root, n=n, k=dim * len(layers), tokens=length, kind="kron", output="loss")
        for idx in torch.arange(n).split(feature_batch):
            sequence_losses(psm(train[idx, :-1]), train[idx]).sum().backward()
            store.write(idx, torch.cat(list(psm.per_sample_projections().values()), -1))
        store.flush()
        sequence_losses(psm(queries[:, :-1]), queries).sum().backward()
        tokens = torch.cat(list(psm.per_sample_projections().values()), -1)  # [count, T, k]
        psm.remove()
        norms = store.read(torch.arange(n), per_token=True).norm(dim=2).clamp(min=1e-12)  # [n, T]
        cos = token_scores(F.normalize(tokens.flatten(0, 1), dim=1), store) / norms  # [count T, n, T]
    best = cos.flatten(1).argmax(1).view(count, length)
    seq, tok = best // length, best % length
    same = (seq == source[:, None]) & (tok == torch.arange(length))
    return {
        "copied": same[:, :half].float().mean().item(),
        "random": (seq[:, half:] == source[:, None]).float().mean().item(),
    }


@dataclass
class Result:
    seed: int
    n_train: int
    n_held: int
    copies: int
    top1: dict[str, dict[str, float]]  # "raw" / "unit" -> {"exact", "near"}: fraction of the copies whose
    # source (or a training sequence with the same bytes) is the top-1 proponent
    random_top1: float  # what a random ranking gives: mean over the copies of (#identical to source) / n
    held_loss: float  # held-out loss, nats per byte
    seconds: float
    top: dict[str, Tensor] = field(repr=False)  # "raw" / "unit" -> [m, 3] train indices of the best proponents
    per_token: dict[str, float] = field(default_factory=dict)  # per_token_found at the last checkpoint
    example: str = field(default="", repr=False)


def run(
    seed: int,
    *,
    epochs: int,
    dim: int,
    length: int = 32,
    width: int = 64,
    blocks: int = 1,
    lr: float = 1e-2,
    batch: int = 32,
    copies: int = 20,
    changed: int = 3,
    feature_batch: int = 128,
    partial: int = 20,
) -> Result:
    start = time.perf_counter()
    data = sequences(length)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    held_count = len(data) // 10
    held, train = data[order[:held_count]], data[order[held_count:]]
    queries, source = plant(train, held, copies, changed, gen)
    torch.manual_seed(seed)
    model = TinyLM(length, width, blocks=blocks)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    names = [f"epoch{e + 1}" for e in range(epochs)]
    query_features: dict[str, list[Tensor]] = {"raw": [], "unit": []}
    with tempfile.TemporaryDirectory(prefix="pergrad-attribution-lm-") as root:
        raw, unit = (  # unit: each row divided by its norm
            FeatureStore.open(Path(root) / sub, n=len(train), k=dim, checkpoints=names, seed=seed, kind="kron")
            for sub in ("raw", "unit")
        )
        with raw, unit:
            for name in names:
                for idx in torch.randperm(len(train), generator=gen).split(batch):  # plain PyTorch
                    optimizer.zero_grad(set_to_none=True)
                    sequence_losses(model(train[idx, :-1]), train[idx]).mean().backward()
                    optimizer.step()
                # pergrad for the feature pass only (removed, the model is as it was), with this checkpoint's
                # own projection (both stores record the same seeds)
                psm = wrap(model, dim, raw.seed(name))
                for idx in torch.arange(len(train)).split(feature_batch):
                    phi = features(psm, train[idx])
                    raw.write_from(psm, idx, checkpoint=name)
                    unit.write(idx, F.normalize(phi, dim=1), checkpoint=name)
                phi = torch.cat([features(psm, q) for q in queries.split(feature_batch)])
                query_features["raw"].append(phi)
                query_features["unit"].append(F.normalize(phi, dim=1))
                psm.remove()
        # TracIn: each checkpoint weighed by its learning rate (Adam's step size; constant here)
        top = {
            kind: top_k(query_features[kind], store, 3, weights=[lr] * epochs)[1]
            for kind, store in (("raw", raw), ("unit", unit))
        }
    # the partial copies are drawn from a generator of their own: the queries above stay as they were
    found = per_token_found(model, train, partial, dim // 8, seed + 1) if partial else {}
    with torch.no_grad():
        held_loss = sequence_losses(model(held[:, :-1]), held).sum().item() / held[:, 1:].numel()
    same = (train.unsqueeze(0) == train[source[held_count:]].unsqueeze(1)).all(2)  # [2 copies, n]
    top1 = {}
    for kind, best in top.items():
        hit = same.float().gather(1, best[held_count:, :1]).squeeze(1)
        top1[kind] = {"exact": hit[:copies].mean().item(), "near": hit[copies:].mean().item()}
    example = f"held-out query: {decode(held[0])!r}\n" + "".join(
        f"  top-{r + 1} proponent (cosine): {decode(train[int(top['unit'][0, r])])!r}\n" for r in range(3)
    )
    return Result(
        seed,
        len(train),
        held_count,
        copies,
        top1=top1,
        random_top1=same.float().mean().item(),
        held_loss=held_loss,
        seconds=time.perf_counter() - start,
        top=top,
        per_token=found,
        example=example,
    )


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="epochs; one checkpoint at the end of each")
    parser.add_argument("--dim", type=int, default=512, help="features per sequence (r x r or r x 2r)")
    parser.add_argument("--length", type=int, default=32, help="input bytes per sequence")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--copies", type=int, default=20, help="exact copies planted, and as many near copies")
    parser.add_argument("--changed", type=int, default=3, help="bytes changed in a near copy")
    parser.add_argument("--partial", type=int, default=20, help="half copies for the per-token scores (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds, from --seed on")
    parser.add_argument("--quick", action="store_true", help="2 epochs, dim 256")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the model is tiny)")
    args = parser.parse_args(argv)
    epochs, dim = (2, 256) if args.quick else (args.epochs, args.dim)
    threads = torch.get_num_threads()
    # a width-64 model on batches of 32 x 32 bytes: each op is too small for intra-op threads to pay; on a
    # loaded machine they spin (quick, 2 shared cores: 1 thread 5 s of CPU, 2 threads 19 s and twice the wall)
    torch.set_num_threads(args.threads)
    try:
        return _main(args, epochs, dim)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, epochs: int, dim: int) -> list[Result]:
    from tqdm.auto import tqdm

    results = [
        run(
            seed,
            epochs=epochs,
            dim=dim,
            length=args.length,
            width=args.width,
            blocks=args.blocks,
            lr=args.lr,
            copies=args.copies,
            changed=args.changed,
            partial=args.partial,
        )
        for seed in tqdm(range(args.seed, args.seed + args.seeds), desc="seeds", disable=args.seeds == 1)
    ]
    first = results[0]
    print(
        f"sklearn dataset descriptions, bytes as tokens: {first.n_train} training sequences of {args.length + 1} "
        f"bytes, {first.n_held} held out; TinyLM width {args.width}, {args.blocks} block(s), Adam lr {args.lr}, "
        f"{epochs} checkpoints, kron dim {dim}; {len(results)} seed(s), mean (min..max)"
    )
    rows = [
        (f"{label}, {kind}", [r.top1[key][kind] for r in results])
        for key, label in (("raw", "TracIn top-1 is the source"), ("unit", "TracIn on unit features (cosine)"))
        for kind in ("exact", "near")
    ]
    rows.append(("random ranking", [r.random_top1 for r in results]))
    if args.partial:
        rows.append(("per token: copied token found at its source", [r.per_token["copied"] for r in results]))
        rows.append(("per token: random token found in the source", [r.per_token["random"] for r in results]))
    rows.append(("held-out loss (nats/byte)", [r.held_loss for r in results]))
    print(f"{args.copies} exact copies and {args.copies} near copies ({args.changed} bytes changed) among the queries")
    if args.partial:
        print(
            f"{args.partial} half copies (the first half of a training sequence, then random bytes): per-token scores"
        )
    for label, values in rows:
        print(f"{label:50}{statistics.mean(values):8.3f} ({min(values):.3f}..{max(values):.3f})")
    print(first.example, end="")
    print(f"{statistics.mean(r.seconds for r in results):.1f} s per seed")
    return results


if __name__ == "__main__":
    main()
