"""Sampling from a GPT: `generate` extends a batch of token ids one sampled id at a time."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, *, vocab_size: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend idx [B, T] by max_new_tokens sampled ids, conditioning on at most the model's block_size tokens.

    temperature 0 is greedy; top_k keeps the k likeliest ids; vocab_size, when given, samples only ids below it
    (a tokenizer smaller than the model's vocabulary).
    """
    block_size = model.cfg.block_size
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -block_size:])
        logits = logits[:, -1, :vocab_size]
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, next_id], dim=1)
    return idx
