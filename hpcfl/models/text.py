"""Next-character models over a symbol vocabulary: LEAF's character LSTM and a small causal Transformer.

Both read ``x`` of shape ``(B, L)`` (symbol codes, any integer dtype; the datasets keep them as
uint8) and give logits ``(B, V)`` for the symbol after the last one, with the zoo's interface
(``classifier``, ``features``, ``forward_with_repr``; see :mod:`hpcfl.models`).

- ``char-lstm``: LEAF's Shakespeare model (Caldas et al., arXiv:1812.01097; ``models/shakespeare/
  stacked_lstm.py``): embedding 8 → two LSTM layers of 256 → Linear on the last step's output.
  819,920 parameters for 80 symbols (PyTorch's LSTM keeps two bias vectors per layer where
  TensorFlow's cell keeps one: LEAF's count is 2·4·256 = 2,048 lower).
- ``char-transformer``: pre-LayerNorm causal Transformer (GPT-2's block, nanoGPT's layout): token
  embedding + learned positions → ``layers`` × (LayerNorm → causal self-attention → residual,
  LayerNorm → MLP 4×, GELU → residual) → LayerNorm → Linear on the last position. Attention's
  projections are plain ``nn.Linear`` layers (``qkv``, ``proj``), so per-sample hooks see them.
  Defaults (d 64, 2 layers, 4 heads) give 115,536 parameters for 80 symbols and L = 80.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class CharLSTM(nn.Module):
    """LEAF's stacked character LSTM."""

    def __init__(
        self, seq_len: int, vocab: int, *, embed: int = 8, hidden: int = 256, layers: int = 2
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.classifier = nn.Linear(hidden, vocab)

    def features(self, x: Tensor) -> Tensor:
        """The last step's output of the top LSTM layer ``(B, hidden)``."""
        out, _ = self.lstm(self.embedding(x.long()))  # (B, L, hidden)
        return out[:, -1]

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, V)`` and the representation they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, V)`` of the next symbol."""
        return self.classifier(self.features(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with its projections as ``nn.Linear`` layers."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # each (B, L, d)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        # written out rather than F.scaled_dot_product_attention: torch.func.vmap (batched clients,
        # per-sample references) has no batching rule for SDPA's fused CPU kernel and loops instead
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (B, H, L, L)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        y = weights @ v  # (B, H, L, d/H)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """A small causal Transformer predicting the symbol after the last position."""

    def __init__(
        self, seq_len: int, vocab: int, *, d_model: int = 64, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.classifier = nn.Linear(d_model, vocab)

    def features(self, x: Tensor) -> Tensor:
        """The last position's final-LayerNorm output ``(B, d_model)``."""
        idx = x.long()
        # positions per sample (B, L), not one (L,) row broadcast: per-sample gradient paths then see
        # each sample's own position-embedding output
        pos = torch.arange(idx.shape[1], device=idx.device).expand(idx.shape[0], -1)
        h = self.embedding(idx) + self.positions(pos)  # (B, L, d)
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h[:, -1])

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, V)`` and the representation they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, V)`` of the next symbol."""
        return self.classifier(self.features(x))
