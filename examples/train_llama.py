"""Train a plain-PyTorch Llama (torchtitan's shape: no transformers) with a meshplan plan applied to it.

    torchrun --nproc-per-node 2 examples/train_llama.py --layout dp_shard=2
    torchrun --nproc-per-node 4 examples/train_llama.py --layout pp=2,dp_shard=2 --micro-batch-size 4

Rank 0 builds the module, exports it (`meshplan.export`, the batch and sequence dims symbolic) and plans
it (`meshplan plan`); every rank builds the same module (the same seed) and trains it under
`meshplan.apply` with the loop of `train_hf.py`. The module is one meshplan has never seen: grouped-query
attention with `repeat_kv`, rotary embeddings in real arithmetic, RMSNorm, a SwiGLU feed-forward, an
untied output head.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from train_hf import (  # this folder's loop (the script's folder is on sys.path)
    next_token_loss,
    parser,
    plan,
    start,
    train,
)

import meshplan
from core.errors import MeshplanError

SHAPE = {"vocab": 256, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "hidden": 172}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(seq: int, head_dim: int, device: torch.device, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, heads, head_dim): each pair of features turned by its position's angle."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rotate(self.wq(x).view(b, s, self.heads, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(b, s, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads  # repeat_kv: each KV head read by `rep` query heads
        k = k[:, :, :, None, :].expand(b, s, self.kv_heads, rep, self.head_dim).reshape(b, s, self.heads, self.head_dim)
        v = v[:, :, :, None, :].expand(b, s, self.kv_heads, rep, self.head_dim).reshape(b, s, self.heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():  # torchtitan's initialisation, roughly: small normal weights
            if p.dim() > 1:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = rotary(tokens.shape[1], self.head_dim, tokens.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build() -> Llama:
    torch.manual_seed(0)  # the same weights on every rank
    return Llama(**SHAPE)


def main() -> None:
    args = parser(__doc__.splitlines()[0], "meshplan-train-llama").parse_args()
    rank, world, device = start()
    work = Path(args.workdir).resolve()
    onnx_path, strategy_path = work / "model.onnx", work / "strategy.json"
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        ids = torch.zeros((2, args.seq), dtype=torch.long)
        meshplan.export(build(), (ids,), onnx_path, dynamic=[("batch", "seq")], weights=False)
        plan(args, onnx_path, strategy_path, world)
    dist.barrier()
    train(build().to(device), strategy_path, args, lambda m, ids: next_token_loss(m(ids), ids), SHAPE["vocab"])


if __name__ == "__main__":
    try:
        main()
    except MeshplanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
