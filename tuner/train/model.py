"""A tiny LLaMA in torch, laid out exactly as llama.cpp's `llama` architecture computes it.

RMSNorm, rotary embeddings in llama.cpp's "normal" mode (adjacent pairs rotated, so Q/K weights export without
the HF permutation), SwiGLU feed-forward, tied input/output embeddings (llama.cpp falls back to token_embd when
the GGUF has no output.weight).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int
    dim: int
    layers: int
    heads: int
    ffn: int
    ctx: int = 128
    eps: float = 1e-5
    rope_base: float = 10000.0

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, base: float, pos: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, H, T, D]; rotate adjacent pairs (x0,x1), (x2,x3)... by pos * base^(-2i/D) (GGML_ROPE_TYPE_NORM).

    pos: [B, T] positions (default 0..T-1), so packed sequences can restart positions after a shared prompt."""
    B, H, T, D = x.shape
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    p = torch.arange(T, dtype=torch.float32)[None, :] if pos is None else pos.float()
    ang = (p[:, :, None] * inv[None, None, :])[:, None]  # [B|1, 1, T, D/2]
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2)


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.attn_norm = RMSNorm(c.dim, c.eps)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        self.w_gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.w_up = nn.Linear(c.dim, c.ffn, bias=False)
        self.w_down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.c.dim // self.c.heads
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, self.c.heads, hd).transpose(1, 2)
        k = self.wk(h).view(B, T, self.c.heads, hd).transpose(1, 2)
        v = self.wv(h).view(B, T, self.c.heads, hd).transpose(1, 2)
        q, k = rope(q, self.c.rope_base, pos), rope(k, self.c.rope_base, pos)
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, self.c.dim))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class TinyLlama(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        nn.init.normal_(self.tok.weight, std=0.02)
        for b in self.blocks:
            for m in (b.wq, b.wk, b.wv, b.w_gate, b.w_up):
                nn.init.normal_(m.weight, std=0.02)
            for m in (b.wo, b.w_down):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * c.layers))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T]; optional pos [B, T] and boolean mask [B, 1, T, T] (True = may attend) for packed batches."""
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x, pos, mask)
        return self.norm(x) @ self.tok.weight.T  # tied output
