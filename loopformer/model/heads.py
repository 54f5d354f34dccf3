"""L1 and L2 of `L2 ∘ TF^r ∘ L1` (paper Sec. 2.2): token-wise read-in and read-out.

L1: token embedding (or a linear read-in of real vectors, for in-context learning) plus learned positions, plus
one learned table per position factor (e.g. a Sudoku cell's row, column and box) when the config has them.
L2: per-token logits (LM / token classification), pooled sequence classification, or regression.
Shapes: B batch, T length, D width, V vocabulary, C outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loopformer.model.config import ModelConfig


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model) if cfg.vocab_size > 0 else None
        self.read_in = nn.Linear(cfg.input_dim, cfg.d_model) if cfg.input_dim > 0 else None
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.pos == "learned" else None
        factors = cfg.pos_factors or []
        self.factors = nn.ModuleList(nn.Embedding(max(f) + 1, cfg.d_model) for f in factors)
        self.register_buffer("factor_index", torch.tensor([f[:cfg.max_len] for f in factors], dtype=torch.long)
                             .reshape(len(factors), cfg.max_len), persistent=False)   # [K, max_len]
        self.drop = nn.Dropout(cfg.dropout)
        self.max_len = cfg.max_len

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B,T] ids or [B,T,input_dim] reals; positions: [B,T] or None (0..T-1) -> [B,T,D]
        h = self.tok(x) if self.tok is not None else self.read_in(x)
        if self.pos is not None or len(self.factors):
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            if self.pos is not None:
                h = h + self.pos(positions)
            for k, table in enumerate(self.factors):               # row, column, box, ...: [B,T,D] each
                h = h + table(self.factor_index[k][positions])
        return self.drop(h)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.pool = cfg.head, cfg.pool
        self.proj = nn.Linear(cfg.d_model, cfg.out_dim, bias=cfg.head != "lm")

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # h: [..., B, T, D] -> lm/regression: [..., B, T, C]; sequence: [..., B, C]
        if self.kind != "sequence":
            return self.proj(h)
        if self.pool == "first":
            pooled = h[..., 0, :]
        elif self.pool == "last":
            if mask is None:
                pooled = h[..., -1, :]
            else:  # last non-pad position of each row
                idx = (mask.long().cumsum(-1).argmax(-1))                      # [B]
                pooled = h[..., torch.arange(h.shape[-3], device=h.device), idx, :]
        else:
            if mask is None:
                pooled = h.mean(-2)
            else:
                w = mask.to(h.dtype)[..., None]                               # [B,T,1]
                pooled = (h * w).sum(-2) / w.sum(-2).clamp(min=1)
        return self.proj(pooled)
