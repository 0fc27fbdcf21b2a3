"""Transformer workloads of ``bench.py`` (``--workloads gpt2 bert``).

``gpt2``: a GPT-2-shaped stack written with ``torch.nn`` -- token and position embeddings (the
positions ``wpe(arange(T))`` shared by the batch), pre-norm blocks of causal attention (one fused
``qkv`` Linear, ``scaled_dot_product_attention``, an output projection) and a GELU MLP (``4 d``),
a final LayerNorm and a classification head on the mean over positions; d=768, 12 heads, 2 blocks,
T=128, B=8, float32 (``--quick``: d=48, T=16, B=4).

``bert``: HuggingFace's ``BertForSequenceClassification`` built from a tiny config (hidden 128,
2 layers, 2 heads, intermediate 512, T=64, B=16; ``--quick``: hidden 16, T=8, B=4), dropout off,
as users build it; skipped when ``transformers`` is not installed.
"""

from __future__ import annotations

from typing import Any


def gpt_stack(d: int, heads: int, length: int, blocks: int, vocab: int) -> Any:
    """The GPT-2-shaped stack described above, ``d`` wide with ``blocks`` blocks, positions up to ``length``,
    mapping ``[B, T]`` token ids to ``[B, 10]`` logits."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, length, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(n, length, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(n, length, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(length, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            return self.head(self.ln(self.blocks(h)).mean(1))

    return Stack()


def gpt2_stack(quick: bool, batch: int | None) -> tuple[Any, Any, Any]:
    import torch

    d, heads, t, b, blocks, vocab = (48, 4, 16, batch or 4, 2, 100) if quick else (768, 12, 128, batch or 8, 2, 1000)
    model = gpt_stack(d, heads, t, blocks, vocab)
    return model, torch.randint(0, vocab, (b, t)), torch.randint(0, 10, (b,))


def tiny_bert(quick: bool, batch: int | None) -> tuple[Any, Any, Any]:
    import torch
    import transformers
    from torch import nn

    hidden, t, b = (16, 8, batch or 4) if quick else (128, 64, batch or 16)
    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=4 * hidden, max_position_embeddings=t, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip

    class Logits(nn.Module):  # bench.py's loss takes logits
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertForSequenceClassification(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids).logits  # type: ignore[no-any-return]

    return Logits(), torch.randint(0, 1000, (b, t)), torch.randint(0, 10, (b,))
