"""Causal multi-head self-attention, and the records' pieces inside it, each behind its key: QK-norm
(model.qk_norm), rotary and YaRN (model/rotary.py), value embeddings mixed into the values (model.value_embeds;
their gate, record 55: model.ve_gate; the values' scale without them, record 46: model.value_scale), exclude-self
(record 82: model.xsa) and the output gate (record 28: model.attn_gate)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig
from model.layers import GATE_CHANNELS, Gate
from model.masks import flex_attention
from model.rotary import rotary, rotary_frequencies, yarn, yarn_jumps

if TYPE_CHECKING:
    from model.masks import Mask


def exclude_self(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """XSA: each head's output y [B, H, T, D] less tanh(alpha_h) times its component along the token's own value,
    u = v / max(|v|, 1e-4): y - tanh(alpha_h) (y . u) u. At alpha 0 it is y; at tanh 1, y is orthogonal to v."""
    u = F.normalize(v, dim=-1, eps=1e-4)
    return y - torch.tanh(alpha).to(y.dtype).view(-1, 1, 1) * (y * u).sum(-1, keepdim=True) * u


class Attention(nn.Module):
    """Causal multi-head self-attention; optional QK-norm, rotary positions, value embeddings, XSA and output
    gate."""

    def __init__(self, cfg: GPTConfig, has_ve: bool, xsa: bool = False):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Mixing weights of the value and the value embedding.
        self.ve_lambda = nn.Parameter(torch.empty(2)) if has_ve else None
        # value_scale (record 46): a layer without a value embedding still learns its values' scale
        self.v_lambda = nn.Parameter(torch.empty(1)) if cfg.value_scale and not has_ve else None
        # attn_gate: each head's output scaled by a gate read from this token's input (the records: a no-op when
        # the context holds nothing worth reading, without an attention sink)
        self.gate = Gate(cfg, cfg.n_head) if cfg.attn_gate else None
        # model.xsa: per head, how much of the output along the token's own value to drop (tanh of it; 0 at init)
        self.xsa_alpha = nn.Parameter(torch.empty(cfg.n_head)) if xsa else None
        # ve_gate: each head's value embedding times twice a gate read from the first 6 channels of this token's
        # input and of its value embedding: 1 at init, so the model starts as without it
        half = min(GATE_CHANNELS // 2, cfg.n_embd)
        self.ve_gate = Gate(cfg, cfg.n_head, 2 * half) if has_ve and cfg.ve_gate else None

    def reset_parameters(self) -> None:
        """Value and value embedding mixed half and half (or the value alone scaled by a half); XSA's alphas 0 (the
        projections are GPT's to init)."""
        for lam in (self.ve_lambda, self.v_lambda):
            if lam is not None:
                nn.init.constant_(lam, 0.5)
        if self.xsa_alpha is not None:
            nn.init.zeros_(self.xsa_alpha)

    def forward(self, x: Tensor, ve: Tensor | None, mask: Mask, yarn_window: Tensor | None = None,
                value: Tensor | None = None) -> Tensor:
        """x [B, T, C] -> [B, T, C]; `yarn_window` is the long window now (a tensor) under model.yarn, else None;
        `value` [B, T, C], a MUDD connection's, is added to the values (after the value embedding)."""
        cfg, (B, T, C) = self.cfg, x.shape
        q, k, v = self.qkv(x).view(B, T, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
        dtype = q.dtype
        if ve is not None:
            if self.ve_gate is not None:
                half = self.ve_gate.weight.size(1) // 2
                gates = 2 * self.ve_gate(torch.cat((x[..., :half], ve[..., :half]), dim=-1))  # [B, T, H]
                ve = ve.view(B, T, cfg.n_head, cfg.head_dim) * gates.unsqueeze(-1)
            v = self.ve_lambda[0] * v + self.ve_lambda[1] * ve.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        elif self.v_lambda is not None:
            v = self.v_lambda * v
        if value is not None:
            v = v + value.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = F.rms_norm(q, (cfg.head_dim,)), F.rms_norm(k, (cfg.head_dim,))
        if cfg.rotary:
            # Computed per call, not kept in a buffer: after building on the meta device only parameters need init.
            freqs, gain = rotary_frequencies(cfg.head_dim, cfg.rope_base, cfg.rope_truncate, x.device), None
            if yarn_window is not None and cfg.window_stages:
                freqs, gain = yarn_jumps(freqs, [*cfg.window_stages, cfg.window], yarn_window)
            elif yarn_window is not None:
                freqs, gain = yarn(freqs, cfg.first_window, yarn_window)
            # bf16 tables where the residual stream is bf16: train.bf16_stream, or FSDP2's bf16 casts
            bf16 = x.dtype == torch.bfloat16
            q, k = rotary(q, freqs, gain, bf16), rotary(k, freqs, bf16_tables=bf16)
        # Back to qkv's dtype: under autocast the value embedding (nn.Embedding is not autocast) and the norms can
        # make fp32 from bf16; SDPA casts its inputs, FlexAttention (torch 2.6) refuses mixed dtypes.
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        scale = cfg.attn_scale or None  # None: 1/sqrt(head_dim)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        elif isinstance(mask, Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            y = flex_attention(q, k, v, block_mask=mask, scale=scale)
        if self.xsa_alpha is not None:
            y = exclude_self(y, v, self.xsa_alpha)
        if self.gate is not None:
            y = y * self.gate(x).transpose(1, 2).unsqueeze(-1)  # [B, T, H] -> [B, H, T, 1]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))
