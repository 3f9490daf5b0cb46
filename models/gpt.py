"""A GPT-style decoder-only transformer language model (Radford et al. 2019; the nanoGPT layout).

    h_0 = E_tok[x] + E_pos[0..T)
    h   = h + Attn(LN(h));  h = h + MLP(LN(h))          (pre-LayerNorm blocks, `layers` times)
    logits = LN(h) @ E_tok^T                            (head tied to the token embedding)

Attention is causal (position t sees positions <= t), through `scaled_dot_product_attention`.
Dropout (GPT-2's embd/attn/resid_pdrop, one probability p for the three; 0 by default, none): on h_0, on the
attention weights, and on each residual branch's output before it is added; only in training mode.
Init (GPT-2, sec. 2.3): weights ~ N(0, 0.02), residual output projections ~ N(0, 0.02 / sqrt(2 * layers)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq_len, width = hidden.shape
        query, key, value = self.qkv(hidden).split(width, dim=2)
        shape = (batch, seq_len, self.heads, width // self.heads)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        attention_dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(query, key, value, dropout_p=attention_dropout, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, seq_len, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.residual_dropout(self.attn(self.attn_norm(hidden)))
        return hidden + self.residual_dropout(self.mlp(self.mlp_norm(hidden)))


class GPT(nn.Module):
    """Token ids (batch, seq_len) -> next-token logits (batch, seq_len, vocab_size)."""

    def __init__(self, vocab_size: int, seq_len: int, layers: int = 2, width: int = 128, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        if width % heads:
            raise ValueError(f"gpt width ({width}) must be a multiple of heads ({heads})")
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(seq_len, width)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for residual_out in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(residual_out.weight, std=INIT_STD / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.seq_len:
            raise ValueError(f"sequence of {seq_len} tokens is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(seq_len, device=tokens.device)
        hidden = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.final_norm(hidden))
