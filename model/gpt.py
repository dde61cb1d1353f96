"""The GPT: GPT-2 by default, with the NanoGPT speedrun's modern options behind config keys.

Classes appear in the order a forward pass meets them: norm -> rotary -> attention -> MLP -> block -> GPT.
The model is a plain nn.Module: DDP/FSDP2, compile and precision are applied from outside (trainer/parallel.py).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig  # re-exported: `from model.gpt import GPTConfig` keeps working

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch builds without FlexAttention fall back to SDPA
    flex_attention = None


class Norm(nn.Module):
    """LayerNorm (GPT-2) or RMSNorm, with a learned gain."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.rms = cfg.norm == "rmsnorm"
        self.weight = nn.Parameter(torch.empty(cfg.n_embd))
        self.bias = nn.Parameter(torch.empty(cfg.n_embd)) if cfg.bias and not self.rms else None

    def forward(self, x: Tensor) -> Tensor:
        if self.rms:
            return F.rms_norm(x, self.weight.shape, self.weight)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias)


def rotary(x: Tensor, base: float) -> Tensor:
    """Rotate each (first half, second half) pair of x [B, H, T, D] by its position's angles."""
    T, D = x.shape[-2:]
    # Computed per call, not kept in a buffer: after building on the meta device only parameters need init.
    inv_freq = base ** -(torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def attention_mask(idx: Tensor, window: int, doc_causal: bool, bos_id: int) -> Tensor:
    """Boolean [B, 1, T, T] mask, True where query q may attend to key k: causal, windowed, same document."""
    T = idx.size(1)
    pos = torch.arange(T, device=idx.device)
    delta = pos[:, None] - pos[None, :]
    mask = delta >= 0
    if window:
        mask = mask & (delta < window)
    mask = mask.expand(idx.size(0), 1, T, T)
    if doc_causal:
        # The BOS token opens its document, so it belongs with the tokens after it.
        doc = torch.cumsum(idx == bos_id, dim=1)
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return mask


def flex_mask_mod(idx: Tensor, window: int, doc_causal: bool, bos_id: int) -> Callable:
    """The FlexAttention mask_mod(b, h, q, k) of the same rule as `attention_mask`."""
    doc = torch.cumsum(idx == bos_id, dim=1)

    def allowed(b, h, q, k):
        ok = q >= k
        if window:
            ok = ok & (q - k < window)
        if doc_causal:
            ok = ok & (doc[b, q] == doc[b, k])
        return ok
    return allowed


def flex_block_mask(idx: Tensor, window: int, doc_causal: bool, bos_id: int) -> BlockMask:
    """The FlexAttention BlockMask equivalent to `attention_mask` (CUDA)."""
    B, T = idx.shape
    mask_mod = flex_mask_mod(idx, window, doc_causal, bos_id)
    # _compile=True builds the block mask without materialising the dense [B, T, T] mask (GBs at long T).
    return create_block_mask(mask_mod, B if doc_causal else None, None, T, T, device=idx.device, _compile=True)


_warned_fallback = False


def _warn_flex_fallback(reason: str) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"attention='flex' {reason}: using SDPA with an equivalent explicit mask", stacklevel=3)


class Attention(nn.Module):
    """Causal multi-head self-attention; optional QK-norm, rotary positions and value embeddings."""

    def __init__(self, cfg: GPTConfig, has_ve: bool):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Mixing weights of the value and the value embedding.
        self.ve_lambda = nn.Parameter(torch.empty(2)) if has_ve else None

    def forward(self, x: Tensor, ve: Tensor | None, mask) -> Tensor:
        cfg, (B, T, C) = self.cfg, x.shape
        q, k, v = self.qkv(x).view(B, T, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
        dtype = q.dtype
        if ve is not None:
            v = self.ve_lambda[0] * v + self.ve_lambda[1] * ve.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = F.rms_norm(q, (cfg.head_dim,)), F.rms_norm(k, (cfg.head_dim,))
        if cfg.rotary:
            q, k = rotary(q, cfg.rope_base), rotary(k, cfg.rope_base)
        # Back to qkv's dtype: under autocast the value embedding (nn.Embedding is not autocast) and the norms can
        # make fp32 from bf16; SDPA casts its inputs, FlexAttention (torch 2.6) refuses mixed dtypes.
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = flex_attention(q, k, v, block_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


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


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig, has_ve: bool):
        super().__init__()
        self.norm1, self.attn = Norm(cfg), Attention(cfg, has_ve)
        self.norm2, self.mlp = Norm(cfg), MLP(cfg)

    def forward(self, x: Tensor, ve: Tensor | None, mask) -> Tensor:
        x = x + self.attn(self.norm1(x), ve, mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token (+ position) embeddings -> blocks -> final norm -> head over the padded vocabulary."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab
        self.wte = nn.Embedding(V, cfg.n_embd)
        self.wpe = None if cfg.rotary else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, cfg.n_embd) for _ in range(cfg.value_embeds))
        k = cfg.value_embeds
        self.blocks = nn.ModuleList(Block(cfg, has_ve=i < k or i >= cfg.n_layer - k) for i in range(cfg.n_layer))
        self.skip_weights = nn.Parameter(torch.empty(cfg.n_layer // 2)) if cfg.unet_skips else None
        self.norm_f = Norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every parameter (also after `to_empty` from the meta device), GPT-2 style.

        Matrices and tables N(0, init_std), residual projections scaled by 1/sqrt(2 n_layer) (or zero);
        gains and skip weights 1, biases 0, value/value-embedding mix 0.5 each (as modded-nanogpt starts it).
        """
        cfg = self.cfg
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, Norm):
                nn.init.ones_(m.weight)
            if isinstance(m, Attention) and m.ve_lambda is not None:
                nn.init.constant_(m.ve_lambda, 0.5)
            if isinstance(m, (nn.Linear, Norm)) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)
        projections = [p for b in self.blocks for p in (b.attn.proj.weight, b.mlp.proj.weight)]
        if cfg.zero_init_proj and not cfg.tie_embeddings:
            projections.append(self.lm_head.weight)
        for w in projections:
            if cfg.zero_init_proj:
                nn.init.zeros_(w)
            else:
                nn.init.normal_(w, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def _mask(self, idx: Tensor):
        """None (plain causal), an explicit boolean mask, or a FlexAttention BlockMask."""
        cfg = self.cfg
        if not (cfg.window or cfg.doc_causal):
            return None
        if cfg.attention == "flex":
            if flex_attention is None:
                _warn_flex_fallback("is not in this torch build")
            elif idx.device.type != "cuda":
                _warn_flex_fallback(f"has no backward on {idx.device.type}")
            else:
                return flex_block_mask(idx, cfg.window, cfg.doc_causal, cfg.bos_id)
        return attention_mask(idx, cfg.window, cfg.doc_causal, cfg.bos_id)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """idx [B, T] -> (logits [B, T, vocab_size] float, None); with targets -> (None, mean cross-entropy over
        the targets that are not -100).

        With targets the logits are not returned, so the [B, T, V] float copy can be freed early.
        """
        cfg, T = self.cfg, idx.size(1)
        if self.wpe is not None and T > cfg.block_size:  # rotary positions take any length
            raise ValueError(f"sequence length {T} exceeds model block_size={cfg.block_size}, the size of the learned "
                             f"position table; raise [model] block_size or use rotary = true")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        ves = [ve(idx) for ve in self.value_embeds]
        ves = ves + [None] * (cfg.n_layer - 2 * len(ves)) + ves
        mask = self._mask(idx)
        half, skips = cfg.n_layer // 2, []
        for i, block in enumerate(self.blocks):
            if self.skip_weights is not None and i >= cfg.n_layer - half:
                x = x + self.skip_weights[i - (cfg.n_layer - half)] * skips.pop()
            x = block(x, ves[i], mask)
            if self.skip_weights is not None and i < half:
                skips.append(x)
        return self.head_loss(x, targets)

    def head_loss(self, x: Tensor, targets: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """forward's tail on the blocks' output: final norm, head, fp32 (softcapped) logits, cross-entropy.

        A method of its own so that trainer/parallel.py can compile it where the whole forward is not (FSDP2)."""
        cfg = self.cfg
        logits = self.lm_head(self.norm_f(x))[..., :cfg.vocab_size].float()
        if cfg.logit_softcap:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        if targets is None:
            return logits, None
        # targets of -100 (padding) are skipped: the mean is over the others, NaN if there are none
        return None, F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), ignore_index=-100)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul weights + 12 x n_layer x n_embd x seq_len for attention (PaLM)."""
        cfg = self.cfg
        lookup_only = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        matmul = self.num_params() - lookup_only + (self.lm_head.weight.numel() if cfg.tie_embeddings else 0)
        return 6.0 * matmul + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def config_from_dict(section: dict) -> GPTConfig:
    """GPTConfig from a plain dict; an unknown key or a wrong type is an error naming the key."""
    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(section) - set(fields))
    if unknown:
        raise ValueError(f"model config: unknown key(s) {unknown}; valid keys are {list(fields)}. "
                         "Fix or remove them in the [model] section.")
    values = {}
    for key, value in section.items():
        kind = {"int": int, "float": float, "bool": bool, "str": str}[fields[key]]
        # TOML writes 15 for 15.0; bool is a subclass of int but never a valid number here.
        ok = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or type(value) is not bool)
        if not ok:
            raise ValueError(f"model config: {key}={value!r} must be of type {fields[key]}; "
                             "fix it in the [model] section")
        values[key] = kind(value)
    return GPTConfig(**values)
