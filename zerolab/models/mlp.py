"""A next-token MLP: each position predicts the next token from its own embedding only."""
from __future__ import annotations

import torch
import torch.nn as nn

from zerolab.schema import ModelConfig


class NextTokenMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.mlp_hidden)
        layers = []
        for _ in range(cfg.mlp_depth):
            layers += [nn.Linear(cfg.mlp_hidden, cfg.mlp_hidden), nn.GELU()]
        self.hidden = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(cfg.mlp_hidden)
        self.head = nn.Linear(cfg.mlp_hidden, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.hidden(self.embed(idx))))
