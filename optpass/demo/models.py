"""Small models for the demo, the tests and the benchmarks.

``TinyLM`` is a causal transformer language model with the pieces a real one
has (token + position embedding, pre-norm attention and MLP blocks, layer
norm, an output head tied to the token embedding), small enough to train on a
CPU in seconds. Parameter names read like a real model's
(``layers.0.attn.wq.weight``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Sequential):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 4)):
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 64
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    seq_len: int = 16
    mlp_ratio: int = 4
    tie_head: bool = True      # the output head shares the token embedding's weight (GPT-2's choice)


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads

        def heads(y):
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: LMConfig = LMConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_head:
            self.head.weight = self.embed.weight  # tied output head
        torch.nn.init.normal_(self.embed.weight, std=0.02)  # small, as the tied head's logits
        if not cfg.tie_head:
            torch.nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.forward(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLPLM(nn.Module):
    """A next-token MLP language model: token embedding -> ``layers`` x Linear(width, width) -> head.

    It reads one token at a time (a bigram model), which is all ``synthetic_corpus``'s
    pattern needs. Its parameters sit in a few wide square layers: tens of millions of
    parameters with little compute per step when a step has few tokens, and few kernels
    to compile (what ``python -m optpass.demo`` needs to show memory on a CPU quickly).
    The square layers start with He initialisation, so the signal keeps its scale
    through the ReLUs and the loss falls within a few dozen steps.
    """

    def __init__(self, vocab: int = 64, width: int = 3072, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = MLP((width,) * (layers + 1))
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(tokens)))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.forward(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_groups_no_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: weight decay on matrices, none on biases, norms and 1-D parameters."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def synthetic_corpus(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    """A token stream with learnable structure: a noisy repeating arithmetic pattern."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 4, (length,), generator=g)
    tokens = torch.cumsum(steps, 0) % vocab
    noise = torch.rand(length, generator=g) < 0.05
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return tokens


def batches(corpus: torch.Tensor, batch: int, seq_len: int, seed: int = 0):
    """Endless (tokens, next-token targets) batches of random windows of the corpus."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(corpus) - seq_len - 1, (batch,), generator=g)
        idx = start[:, None] + torch.arange(seq_len + 1)
        window = corpus[idx]
        yield window[:, :-1], window[:, 1:]
