"""A small LLaMA-style decoder for the examples, tests and benches: random weights, no download.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP,
written the way torchtitan writes them so torch's ParallelStyles apply
unchanged: attention reshapes with ``-1`` heads, so a column-parallel
``wq``/``wk``/``wv`` simply gives each rank its own heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Config:
    vocab_size: int = 1024
    dim: int = 512
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    hidden_dim: int = 1536
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_frequencies(cfg: Config) -> torch.Tensor:
    """``[max_seq_len, head_dim // 2]`` complex rotations."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by ``freqs`` ``[seq, head_dim // 2]``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        # Grouped-query attention inside SDPA (``enable_gqa``: each kv head serves ``n_rep`` query heads, as
        # ``repeat_interleave`` of k and v would, without the copies), the way transformers' sdpa attention
        # runs a LLaMA without a mask.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.n_rep > 1
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Not a buffer: module.to(bf16) would cast the complex rotations to real.
        self.freqs = rope_frequencies(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1]].to(tokens.device)
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


def build(cfg: Config | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Transformer:
    """The model with weights drawn from ``seed`` (identical on every rank), in ``dtype``."""
    cfg = cfg or Config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        for name, p in model.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02 if "tok_embeddings" in name else p.shape[1] ** -0.5)
    return model.to(dtype)


def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, noise: float = 0.1, seed: int = 0):
    """``steps`` batches of ``[batch, seq + 1]`` tokens that follow a fixed random successor table.

    Each token is the table's successor of the previous one, or (with
    probability ``noise``) a random token: learnable, so a fine-tuning loss falls.
    """
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(vocab, (vocab,), generator=g)
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for i in range(seq):
            random = torch.rand(batch, generator=g) < noise
            tokens[:, i + 1] = torch.where(random, torch.randint(vocab, (batch,), generator=g), table[tokens[:, i]])
        yield tokens


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """One optimizer step on this rank's ``tokens``; returns the next-token loss averaged over ranks."""
    out = model(tokens[:, :-1])
    logits = getattr(out, "logits", out)  # a transformers model returns an output object
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / torch.distributed.get_world_size()


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, pad_to_multiple: int = 1) -> torch.Tensor:
    """Greedy decoding without a KV cache (the model is small; clarity over speed).

    ``pad_to_multiple`` pads every step's input at the end to a multiple of it:
    sequence parallelism shards the sequence evenly, and a causal model's
    logits at a position do not depend on the tokens after it.
    """
    tokens = prompt
    for _ in range(new_tokens):
        n = tokens.shape[1]
        logits = model(F.pad(tokens, (0, -n % pad_to_multiple)))
        next_token = logits[:, n - 1].float().argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens
