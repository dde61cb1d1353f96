"""MUDD connections (record 81; arXiv 2502.12170), model.mudd and model.mudd_sources: after a listed block, a small
MLP on its output weighs x0 and earlier blocks' outputs into the residual stream and the next block's values."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig


# The record's MUDD MLP: hidden width the smallest multiple of 64 above its outputs, output (MLP + bias) times
# 0.2 / sqrt(sources), and the value channel's sum times 1.15 more.
MUDD_WIDTH_STEP = 64
MUDD_SCALE = 0.2
MUDD_VALUE_GAIN = 1.15


def mudd_width(outputs: int) -> int:
    """The hidden width of a MUDD MLP with `outputs` weights."""
    return MUDD_WIDTH_STEP * (outputs // MUDD_WIDTH_STEP + 1)


class Mudd(nn.Module):
    """A trimmed MUDD connection (record 81; arXiv 2502.12170) after block `layer`: a GELU MLP on its output h gives
    each position weights a_k (and b_k) over hidden states s_k: x0 and the outputs of the mudd_sources layers up to
    `layer` (before their own connection). The residual stream goes on as h + sum_k a_k s_k and, if the next block
    has attention, it adds 1.15 sum_k b_k s_k to its values. The MLP's output matrix and bias start at zero: every
    weight is 0, the model as without it."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        sources = 1 + len(cfg.mudd_reads(layer))
        self.channels = 1 + cfg.mudd_feeds_values(layer)  # residual, then values
        outputs = self.channels * sources
        self.fc = nn.Parameter(torch.empty(mudd_width(outputs), cfg.n_embd))
        self.proj = nn.Parameter(torch.empty(outputs, mudd_width(outputs)))
        self.bias = nn.Parameter(torch.empty(outputs))
        self.scale = MUDD_SCALE / math.sqrt(sources)

    def reset_parameters(self) -> None:
        """fc as nn.Linear's default (the record's kaiming_uniform_, a = sqrt(5)); proj and bias zero."""
        bound = 1 / math.sqrt(self.fc.size(1))
        nn.init.uniform_(self.fc, -bound, bound)
        nn.init.zeros_(self.proj)
        nn.init.zeros_(self.bias)

    def weights(self, h: Tensor) -> Tensor:
        """h [B, T, C] -> each position's weights [B, T, channels, sources]."""
        w = F.linear(F.gelu(F.linear(h, self.fc)), self.proj, self.bias) * self.scale
        return w.unflatten(-1, (self.channels, -1))

    def forward(self, h: Tensor, sources: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """(h + the residual channel's sum, the value channel's sum or None) for block output h [B, T, C]."""
        w = self.weights(h)
        sums = []
        for c in range(self.channels):
            # one source at a time: a stack of the sources would be a copy of them all
            total = w[..., c, :1] * sources[0]
            for k in range(1, len(sources)):
                total = total + w[..., c, k:k + 1] * sources[k]
            sums.append(total)
        return h + sums[0], MUDD_VALUE_GAIN * sums[1] if self.channels == 2 else None
