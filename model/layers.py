"""The building blocks every GPT here has: the norm and the MLP (GPT-2's by default), and the records' sparse gate
that several optional pieces read (attn_gate, smear, ve_gate, skip_gate)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig


class Norm(nn.Module):
    """LayerNorm (GPT-2) or RMSNorm, with a learned gain unless norm_gain is off."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.rms = cfg.norm == "rmsnorm"
        self.weight = nn.Parameter(torch.empty(cfg.n_embd)) if cfg.norm_gain else None
        self.bias = nn.Parameter(torch.empty(cfg.n_embd)) if cfg.bias and not self.rms else None

    def reset_parameters(self) -> None:
        """Gain 1, bias 0."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.rms:
            return F.rms_norm(x, (x.size(-1),), self.weight)
        return F.layer_norm(x, (x.size(-1),), self.weight, self.bias)


GATE_CHANNELS = 12  # the records' gates read the first 12 channels of their input


class Gate(nn.Module):
    """sigmoid(W x[..., :k]): `outputs` gates in (0, 1) from the first k channels of x (k = min(12, n_embd) unless
    `channels` says), as the records' sparse gates (attention output, smear, value embeddings, skips). W starts at
    zero, every gate at 0.5."""

    def __init__(self, cfg: GPTConfig, outputs: int, channels: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, channels or min(GATE_CHANNELS, cfg.n_embd)))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(F.linear(x[..., :self.weight.size(1)], self.weight))


class MLP(nn.Module):
    """Two-layer MLP with GELU (GPT-2) or ReLU² (speedrun: cheaper and trains faster)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.relu2 = cfg.activation == "relu2"

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return self.proj(h)
