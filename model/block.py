"""The pre-norm transformer block: attention then MLP, each on the residual stream, with the records' optional
inputs (x0_mix's embedding, bigram_hash's table output, a MUDD connection's values) and their optional absence
(model.no_attention, model.no_mlp)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch import Tensor

from model.attention import Attention
from model.config import GPTConfig
from model.layers import MLP, Norm

if TYPE_CHECKING:
    from model.masks import Mask


class Block(nn.Module):
    """Pre-norm transformer block; with x0_mix its input is first mixed with the embedding x0, and with bigram_hash
    it adds a learned scalar times the bigram table's output. Without attention (model.no_attention) it has neither
    the attention nor its norm, and is x + mlp(norm2(x)); without an MLP (model.no_mlp), likewise x + attn(norm1(x))."""

    def __init__(self, cfg: GPTConfig, has_ve: bool, attention: bool = True, mlp: bool = True, xsa: bool = False):
        super().__init__()
        self.x0_lambda = nn.Parameter(torch.empty(2)) if cfg.x0_mix else None
        self.x0_mix_init = cfg.x0_mix_init
        self.bigram_lambda = nn.Parameter(torch.empty(1)) if cfg.bigram_hash else None
        self.norm1, self.attn = (Norm(cfg), Attention(cfg, has_ve, xsa)) if attention else (None, None)
        self.norm2, self.mlp = (Norm(cfg), MLP(cfg)) if mlp else (None, None)

    def reset_parameters(self) -> None:
        """x0 mix (x0_mix_init, 0): the block's input alone; the bigram table's lambda 0.1."""
        if self.x0_lambda is not None:
            with torch.no_grad():
                # x0_mix_init (record 46: 1.1): each later block scales an output again, so early ones weigh more
                self.x0_lambda.copy_(torch.tensor([self.x0_mix_init, 0.0]))
        if self.bigram_lambda is not None:
            nn.init.constant_(self.bigram_lambda, 0.1)

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, mask: Mask, yarn_window: Tensor | None = None,
                bigram: Tensor | None = None, value: Tensor | None = None) -> Tensor:
        if self.x0_lambda is not None:
            x = self.x0_lambda[0] * x + self.x0_lambda[1] * x0
        if self.bigram_lambda is not None:
            x = x + self.bigram_lambda.to(x.dtype) * bigram  # fp32, shape [1]: it would make a bf16 stream fp32
        if self.attn is not None:
            x = x + self.attn(self.norm1(x), ve, mask, yarn_window, value)
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x
