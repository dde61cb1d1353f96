"""The GPT: GPT-2 by default, with the NanoGPT speedrun's modern options behind config keys.

Classes appear in the order a forward pass meets them: norm -> gate, smear, bigram table -> rotary -> attention
(XSA) -> MLP -> block -> MUDD connection -> GPT.
The model is a plain nn.Module: DDP/FSDP2, compile and precision are applied from outside (trainer/parallel.py).
"""
from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig, stage_of  # re-exported: `from model.gpt import GPTConfig` keeps working

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch builds without FlexAttention fall back to SDPA
    flex_attention = None


class Norm(nn.Module):
    """LayerNorm (GPT-2) or RMSNorm, with a learned gain unless norm_gain is off."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.rms = cfg.norm == "rmsnorm"
        self.weight = nn.Parameter(torch.empty(cfg.n_embd)) if cfg.norm_gain else None
        self.bias = nn.Parameter(torch.empty(cfg.n_embd)) if cfg.bias and not self.rms else None

    def forward(self, x: Tensor) -> Tensor:
        if self.rms:
            return F.rms_norm(x, (x.size(-1),), self.weight)
        return F.layer_norm(x, (x.size(-1),), self.weight, self.bias)


GATE_CHANNELS = 12  # the records' gates read the first 12 channels of their input


class Gate(nn.Module):
    """sigmoid(W x[..., :k]): `outputs` gates in (0, 1) from the first k channels of x (k = min(12, n_embd) unless
    `channels` says), as the records' sparse gates (attention output, smear, value embeddings, skips). W starts at
    zero, every gate at 0.5 (GPT.reset_parameters)."""

    def __init__(self, cfg: GPTConfig, outputs: int, channels: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, channels or min(GATE_CHANNELS, cfg.n_embd)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(F.linear(x[..., :self.weight.size(1)], self.weight))


class Smear(nn.Module):
    """The records' smear: each token's embedding x_t adds lambda * gate(x_t) * x_{t-1}, the previous token's (the
    first has none), so a block reads the previous token without attending to it. lambda starts at 0: no change."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate = Gate(cfg, 1)
        self.lam = nn.Parameter(torch.empty(1))

    def forward(self, x: Tensor) -> Tensor:
        now, before = x[:, 1:], x[:, :-1]
        return torch.cat((x[:, :1], now + self.lam * self.gate(now) * before), dim=1)


# The records' odd multipliers of the current and the previous token: their products spread over the integers
# before the modulo, and below 2^31 for vocabularies under 59,000 tokens, where the records' int32 hash agrees.
BIGRAM_MULTIPLIERS = (36313, 27191)
SIGN_ROWS = 8192  # the sign trick's patterns: enough that two bigrams sharing a table row rarely share one
SIGN_SEED = 0  # the patterns are drawn from their own generator: the same on every rank, no other draw moved


def pair_hash(idx: Tensor, first: int, pair: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """pair(previous, current) at each position of idx [B, T] but the first, which has no previous token: `first`."""
    start = idx.new_full((idx.size(0), 1), first)
    return torch.cat((start, pair(idx[:, :-1], idx[:, 1:])), dim=1)


def bigram_rows(idx: Tensor, rows: int) -> Tensor:
    """The bigram table's row of each token of idx [B, T]: (a * current XOR b * previous) mod (rows - 1), a and b
    BIGRAM_MULTIPLIERS; each sequence's first token gets the last row, which no bigram hashes to."""
    now, before = BIGRAM_MULTIPLIERS
    return pair_hash(idx, rows - 1, lambda p, c: torch.bitwise_xor(now * c, before * p) % (rows - 1))


class BigramHash(nn.Embedding):
    """The records' bigram hash embedding: row bigram_rows(idx) of a [bigram_hash, bigram_width] table, zero at init,
    as [B, T, n_embd] with zeros after its width. Distinct bigrams share a row, so with bigram_signs each row read is
    multiplied by a fixed random +-1 pattern picked by (previous XOR current) mod SIGN_ROWS (the first token: pattern
    0): bigrams sharing a row mostly pull it apart in different channels."""

    def __init__(self, cfg: GPTConfig):
        # _weight: no init drawn here; GPT.reset_parameters calls ours
        super().__init__(cfg.bigram_hash, cfg.bigram_width, _weight=torch.empty(cfg.bigram_hash, cfg.bigram_width))
        self.n_embd = cfg.n_embd
        # A buffer, so a checkpoint holds the patterns it was trained with.
        self.register_buffer("signs", torch.empty(SIGN_ROWS, cfg.bigram_width) if cfg.bigram_signs else None)

    def reset_parameters(self) -> None:
        """Zero the table; draw the sign patterns from their own seeded generator (nothing drawn from torch's)."""
        nn.init.zeros_(self.weight)
        if self.signs is not None:
            bits = torch.randint(0, 2, self.signs.shape, generator=torch.Generator().manual_seed(SIGN_SEED),
                                 device="cpu")
            with torch.no_grad():
                self.signs.copy_(2 * bits - 1)

    def forward(self, idx: Tensor) -> Tensor:
        rows = super().forward(bigram_rows(idx, self.num_embeddings))
        if self.signs is not None:
            rows = rows * F.embedding(pair_hash(idx, 0, lambda p, c: torch.bitwise_xor(p, c) % SIGN_ROWS), self.signs)
        return rows if rows.size(-1) == self.n_embd else F.pad(rows, (0, self.n_embd - rows.size(-1)))


def rotary_frequencies(head_dim: int, base: float, truncate: bool, device=None) -> Tensor:
    """Angle per position of each (first half, second half) pair of a head: head_dim/2 frequencies."""
    if truncate:
        # The records' half-truncated rotary: head_dim/4 frequencies from 1 down to 1/base (both ends
        # included), and the other pairs keep frequency 0, so half of each head carries no position.
        quarter = head_dim // 4
        rotated = base ** -torch.linspace(0, 1, quarter, device=device, dtype=torch.float32)
        return torch.cat((rotated, rotated.new_zeros(head_dim // 2 - quarter)))
    return base ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


# YaRN's ramp over the turns a frequency makes across the start window: under ALPHA it is interpolated fully (its
# angles stay within those it trained on), over BETA kept (it tells nearby tokens apart), linear between
YARN_ALPHA, YARN_BETA = 1.0, 32.0
# the logits' gain, 1 + TEMPERATURE ln(window / start): more keys flatten a softmax of normalised q and k
YARN_TEMPERATURE = 0.2


def yarn(freqs: Tensor, start: int, window: Tensor) -> tuple[Tensor, Tensor]:
    """YaRN's rotary frequencies and attention-logit gain at the `window` now, for a model whose window started at
    `start` tokens: f * lerp(start / window, 1, ramp), ramp clamp((turns - ALPHA) / (BETA - ALPHA), 0, 1) with
    turns = start f / 2 pi; gain 1 + TEMPERATURE ln(window / start). `window` is a tensor: no new graph per size."""
    ramp = ((freqs * (start / (2 * math.pi)) - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
    # lerp is exact at both ends: a kept frequency (ramp 1), and every one at the start window, is unchanged
    stretch = torch.lerp(start / window.float(), torch.ones_like(ramp), ramp)
    return freqs * stretch, 1 + YARN_TEMPERATURE * torch.log(window.float() / start)


def rotary(x: Tensor, freqs: Tensor, gain: Tensor | None = None) -> Tensor:
    """Rotate each (first half, second half) pair of x [B, H, T, D] by its position times its frequency in `freqs`
    [D/2]; `gain` also scales the result (YaRN's attention temperature, on the queries)."""
    T = x.size(-2)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos(), angles.sin()
    if gain is not None:
        cos, sin = cos * gain, sin * gain
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def short_window(window: int) -> int:
    """The window of the layers marked S in window_pattern: half the long one (the records), at least 1."""
    return max(window // 2, 1)


def attention_mask(idx: Tensor, window: Tensor | None, doc_causal: bool, bos_id: int) -> Tensor:
    """Boolean [B, 1, T, T] mask, True where query q may attend to key k: causal, windowed, same document.

    `window` is a tensor (None = no window), so a new window size is a new value, not a new graph."""
    T = idx.size(1)
    pos = torch.arange(T, device=idx.device)
    delta = pos[:, None] - pos[None, :]
    mask = delta >= 0
    if window is not None:
        mask = mask & (delta < window)
    mask = mask.expand(idx.size(0), 1, T, T)
    if doc_causal:
        # The BOS token opens its document, so it belongs with the tokens after it.
        doc = torch.cumsum(idx == bos_id, dim=1)
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return mask


def flex_mask_mod(idx: Tensor, window: Tensor | None, doc_causal: bool, bos_id: int) -> Callable:
    """The FlexAttention mask_mod(b, h, q, k) of the same rule as `attention_mask`."""
    doc = torch.cumsum(idx == bos_id, dim=1)

    def allowed(b, h, q, k):
        ok = q >= k
        if window is not None:
            ok = ok & (q - k < window)
        if doc_causal:
            ok = ok & (doc[b, q] == doc[b, k])
        return ok
    return allowed


FLEX_BLOCK = 128  # FlexAttention's default tile of queries and of keys


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """[B, n, n] bool -> (count [B, 1, n], indices [B, 1, n, n]): each query block's key blocks listed first."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), indices[:, None].contiguous()


def flex_block_mask(idx: Tensor, window: Tensor | None, doc_causal: bool, bos_id: int,
                    block: int = FLEX_BLOCK) -> BlockMask:
    """The FlexAttention BlockMask of `attention_mask`'s rule, from per-tile bounds.

    A tile pairs a block of queries with a block of keys. It is skipped when no pair in it is allowed, runs
    without the mask when every pair is, and applies mask_mod otherwise. Deciding that from each tile's first
    and last position and document costs O((T / block)^2): no [T, T] mask exists even for a 48K-token
    sequence, eager or compiled, and nothing here is a Python number taken from a tensor, so torch.compile
    traces it without a graph break (create_block_mask(_compile=True) breaks the graph from torch 2.10 on).
    """
    B, T = idx.shape
    first = torch.arange(0, T, block, device=idx.device)
    last = (first + block - 1).clamp(max=T - 1)
    # q - k over the pairs of query block i and key block j spans [lo, hi]
    lo, hi = first[:, None] - last[None, :], last[:, None] - first[None, :]
    some, every = hi >= 0, lo >= 0
    if window is not None:
        some, every = some & (lo < window), every & (hi < window)
    some, every = some[None], every[None]
    if doc_causal:
        doc = torch.cumsum(idx == bos_id, dim=1)
        # document numbers only grow along a row, so a block holds exactly the documents from its first
        # position's to its last's: two blocks share a document if those ranges overlap, and all their pairs
        # do if both ranges are the same single document
        d_first, d_last = doc[:, first], doc[:, last]
        q_first, q_last, k_first, k_last = d_first[:, :, None], d_last[:, :, None], d_first[:, None], d_last[:, None]
        some = some & (q_first <= k_last) & (q_last >= k_first)
        every = every & (q_first == k_last) & (q_last == k_first)
    return BlockMask.from_kv_blocks(*_ordered(some & ~every), *_ordered(every), BLOCK_SIZE=block,
                                    mask_mod=flex_mask_mod(idx, window, doc_causal, bos_id), seq_lengths=(T, T))


def flex_available(device: torch.device) -> bool:
    """FlexAttention can train here: it is in this torch build and the device is CUDA (CPU has no backward)."""
    return flex_attention is not None and device.type == "cuda"


_warned_fallback = False


def _warn_flex_fallback(reason: str) -> None:
    global _warned_fallback
    # Not while torch.compile traces: dynamo cannot trace warnings.warn, so it would break the graph there.
    if not _warned_fallback and not torch.compiler.is_compiling():
        _warned_fallback = True
        warnings.warn(f"attention='flex' {reason}: using SDPA with an equivalent explicit mask", stacklevel=3)


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
        # attn_gate: each head's output scaled by a gate read from this token's input (the records: a no-op when
        # the context holds nothing worth reading, without an attention sink)
        self.gate = Gate(cfg, cfg.n_head) if cfg.attn_gate else None
        # model.xsa: per head, how much of the output along the token's own value to drop (tanh of it; 0 at init)
        self.xsa_alpha = nn.Parameter(torch.empty(cfg.n_head)) if xsa else None
        # ve_gate: each head's value embedding times twice a gate read from the first 6 channels of this token's
        # input and of its value embedding: 1 at init, so the model starts as without it
        half = min(GATE_CHANNELS // 2, cfg.n_embd)
        self.ve_gate = Gate(cfg, cfg.n_head, 2 * half) if has_ve and cfg.ve_gate else None

    def forward(self, x: Tensor, ve: Tensor | None, mask, yarn_window: Tensor | None = None,
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
        if value is not None:
            v = v + value.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = F.rms_norm(q, (cfg.head_dim,)), F.rms_norm(k, (cfg.head_dim,))
        if cfg.rotary:
            # Computed per call, not kept in a buffer: after building on the meta device only parameters need init.
            freqs, gain = rotary_frequencies(cfg.head_dim, cfg.rope_base, cfg.rope_truncate, x.device), None
            if yarn_window is not None:
                freqs, gain = yarn(freqs, cfg.window_start, yarn_window)
            q, k = rotary(q, freqs, gain), rotary(k, freqs)
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
    """Pre-norm transformer block; with x0_mix its input is first mixed with the embedding x0, and with bigram_hash
    it adds a learned scalar times the bigram table's output. Without attention (model.no_attention) it has neither
    the attention nor its norm, and is x + mlp(norm2(x)); without an MLP (model.no_mlp), likewise x + attn(norm1(x))."""

    def __init__(self, cfg: GPTConfig, has_ve: bool, attention: bool = True, mlp: bool = True, xsa: bool = False):
        super().__init__()
        self.x0_lambda = nn.Parameter(torch.empty(2)) if cfg.x0_mix else None
        self.bigram_lambda = nn.Parameter(torch.empty(1)) if cfg.bigram_hash else None
        self.norm1, self.attn = (Norm(cfg), Attention(cfg, has_ve, xsa)) if attention else (None, None)
        self.norm2, self.mlp = (Norm(cfg), MLP(cfg)) if mlp else (None, None)

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, mask, yarn_window: Tensor | None = None,
                bigram: Tensor | None = None, value: Tensor | None = None) -> Tensor:
        if self.x0_lambda is not None:
            x = self.x0_lambda[0] * x + self.x0_lambda[1] * x0
        if self.bigram_lambda is not None:
            x = x + self.bigram_lambda * bigram
        if self.attn is not None:
            x = x + self.attn(self.norm1(x), ve, mask, yarn_window, value)
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x


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


class GPT(nn.Module):
    """Token (+ position) embeddings -> blocks -> final norm -> head over the padded vocabulary."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab
        self.wte = nn.Embedding(V, cfg.n_embd)
        self.smear = Smear(cfg) if cfg.smear else None
        self.wpe = None if cfg.rotary else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, cfg.n_embd) for _ in range(cfg.value_embeds))
        self.bigram = BigramHash(cfg) if cfg.bigram_hash else None
        self.blocks = nn.ModuleList(Block(cfg, has_ve=i in cfg.value_embed_layers, attention=i in cfg.attention_layers,
                                          mlp=i in cfg.mlp_layers, xsa=i in cfg.xsa) for i in range(cfg.n_layer))
        self.skip_weights = nn.Parameter(torch.empty(cfg.n_layer // 2)) if cfg.unet_skips else None
        # skip_gate: skip j also times twice a gate read from the embedding x0: 1 at init, as without it
        self.skip_gate = Gate(cfg, cfg.n_layer // 2) if cfg.skip_gate else None
        # backout: a learned share of an early residual is taken back before the head, so that what the early layers
        # wrote for the later ones alone need not reach the prediction
        self.backout_lambda = nn.Parameter(torch.empty(1)) if cfg.backout else None
        # mudd: a connection after each layer listed, over x0 and the mudd_sources outputs up to it
        self.mudd = nn.ModuleList(Mudd(cfg, i) for i in cfg.mudd)
        self.norm_f = Norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
        if cfg.tie_embeddings and not cfg.untie_at:
            self.lm_head.weight = self.wte.weight
        # untie_at: the head is a parameter of its own from the start, so that DDP, FSDP2 and the optimizer see one
        # set of parameters throughout, and follows the embedding until the untie (tie_grads, tie_weights). Whether
        # it still does is saved with the weights; `tied` is its copy on the host, read each step without a sync.
        self.tied = bool(cfg.untie_at)
        if cfg.untie_at:
            self.register_buffer("head_tied", torch.ones((), dtype=torch.long))
            self.register_load_state_dict_post_hook(_read_tied)
        # The (long, short) window as a tensor the forward reads: a new size is a new value of a graph input,
        # never a recompile. Not saved: it follows training progress (set_progress).
        self.register_buffer("windows", torch.zeros(2, dtype=torch.long), persistent=False)
        # The training loss's weights (mtp_weights, prefix_weight), likewise a tensor that follows the progress;
        # None where the loss is the next token's alone.
        terms = cfg.tokens_ahead + bool(cfg.prefix_weight)
        self.register_buffer("loss_weights", torch.zeros(terms) if terms > 1 else None, persistent=False)
        self._weights_now: list[float] = []
        # Each token's prefix token, -1 for none (the tokenizer's: train.py fills it, set_prefix_targets); the
        # checkpoint needs none of it, since evals score the next token alone.
        if cfg.prefix_weight:
            self.register_buffer("prefix_targets", torch.full((cfg.vocab_size,), -1, dtype=torch.long),
                                 persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every parameter (also after `to_empty` from the meta device), GPT-2 style.

        Matrices and tables N(0, init_std), residual projections scaled by 1/sqrt(2 n_layer) (or zero);
        gains and skip weights 1, biases 0, value/value-embedding mix 0.5 each, x0 mix (1, 0), gates' weights,
        the smear's lambda and XSA's alphas 0, the bigram table 0 and its lambdas 0.1, backout's lambda 0.5, the MUDD
        MLPs' output matrices and biases 0 (as modded-nanogpt starts them); under untie_at the head tied, and the
        embedding its copy, the value a shared matrix ends with; the window and the loss's weights the final ones
        (set_progress(1)).
        """
        cfg = self.cfg
        for m in self.modules():
            if isinstance(m, BigramHash):
                m.reset_parameters()
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, Norm) and m.weight is not None:
                nn.init.ones_(m.weight)
            if isinstance(m, Attention) and m.ve_lambda is not None:
                nn.init.constant_(m.ve_lambda, 0.5)
            if isinstance(m, Attention) and m.xsa_alpha is not None:
                nn.init.zeros_(m.xsa_alpha)
            if isinstance(m, Block) and m.bigram_lambda is not None:
                nn.init.constant_(m.bigram_lambda, 0.1)
            if isinstance(m, Gate):
                nn.init.zeros_(m.weight)
            if isinstance(m, Smear):
                nn.init.zeros_(m.lam)
            if isinstance(m, Block) and m.x0_lambda is not None:
                with torch.no_grad():
                    m.x0_lambda.copy_(torch.tensor([1.0, 0.0]))
            if isinstance(m, (nn.Linear, Norm)) and m.bias is not None:
                nn.init.zeros_(m.bias)
        if self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)
        if self.backout_lambda is not None:
            nn.init.constant_(self.backout_lambda, 0.5)
        projections = [m.proj.weight for b in self.blocks for m in (b.attn, b.mlp) if m is not None]
        if cfg.zero_init_proj and not cfg.tie_embeddings:
            projections.append(self.lm_head.weight)
        for w in projections:
            if cfg.zero_init_proj:
                nn.init.zeros_(w)
            else:
                nn.init.normal_(w, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        for m in self.mudd:  # last: the other parameters draw as without them
            m.reset_parameters()
        if cfg.untie_at:
            with torch.no_grad():
                self.wte.weight.copy_(self.lm_head.weight)
                self.head_tied.fill_(1)
            self.tied = True
        self._use_window(self.window_at(1.0))
        self._weights_now = []
        self._use_loss_weights(self.loss_weights_at(1.0))

    def window_at(self, progress: float) -> int:
        """The window of the L layers at `progress` in [0, 1] of training: window_start growing linearly to
        window (the records: 128 -> 1,792), or window throughout."""
        cfg = self.cfg
        if not cfg.window_start:
            return cfg.window
        return round(cfg.window_start + (cfg.window - cfg.window_start) * min(max(progress, 0.0), 1.0))

    def loss_weights_at(self, progress: float) -> list[float]:
        """The weights of the training loss's terms at `progress` in [0, 1] of training: each position's next
        token, the tokens after it (mtp_weights) and its target's prefix token (prefix_weight); [] for the next
        token alone.

        With n mtp_weights the run is n equal stages, and the weight of the token k + 1 ahead fades linearly to 0
        across stage n - 1 - k: record 53's [1, 0.5, 0.25 -> 0], [1, 0.5 -> 0], [1] for [1.0, 0.5, 0.25]. The
        prefix term holds over the first third and fades across the second, as record 88's."""
        cfg = self.cfg
        if self.loss_weights is None:
            return []
        ahead = [float(w) for w in cfg.mtp_weights] or [1.0]
        n = len(ahead)
        weights = [ahead[0]] + [fading(w, progress, n, n - 1 - k) for k, w in enumerate(ahead[1:], 1)]
        return weights + ([fading(cfg.prefix_weight, progress, 3, 1)] if cfg.prefix_weight else [])

    def set_progress(self, progress: float) -> None:
        """Use the window and the loss's weights of `progress` (train.py: the LR schedule's, each step; its evals
        keep the last step's window and score the next token alone)."""
        window = self.window_at(progress)
        if window != self.window:
            self._use_window(window)
        self._use_loss_weights(self.loss_weights_at(progress))

    def _use_loss_weights(self, weights: list[float]) -> None:
        # only the entries that changed, one fill_ each (no host-device sync): one a step while a term fades
        for i, (new, old) in enumerate(itertools.zip_longest(weights, self._weights_now)):
            if new != old:
                self.loss_weights[i].fill_(new)
        self._weights_now = weights

    def set_prefix_targets(self, targets: list[int]) -> None:
        """The prefix token of each token id (-1: none) that prefix_weight trains towards (data/tokenizer.py's
        prefix_tokens for the data's tokenizer)."""
        self.prefix_targets.copy_(torch.tensor(targets, dtype=torch.long))

    def tie_grads(self) -> None:
        """While the head follows the embedding (untie_at): add its gradient to the embedding's and drop it, so
        that the embedding gets what one shared matrix would and the optimizer steps it alone (the head's own
        optimizer state starts at the untie). Call after the backward's gradient sync, before clipping."""
        if self.tied and self.lm_head.weight.grad is not None:
            self.wte.weight.grad.add_(self.lm_head.weight.grad)
            self.lm_head.weight.grad = None

    @torch.no_grad()
    def tie_weights(self) -> None:
        """While the head follows the embedding: give it the embedding's weights (after each optimizer step)."""
        if self.tied:
            self.lm_head.weight.copy_(self.wte.weight)

    def untie(self) -> None:
        """The head stops following the embedding: from now on it keeps the weights it has and gets a gradient
        of its own (optim/groups.py's untie_head also gives it the embedding's optimizer state)."""
        self.tie_weights()
        self.head_tied.fill_(0)
        self.tied = False

    def _use_window(self, window: int) -> None:
        # fill_ passes the number as a kernel argument: no host-device sync
        self.windows[0].fill_(window)
        self.windows[1].fill_(short_window(window))
        self.window = window

    def _masks(self, idx: Tensor) -> list:
        """Per layer: None (plain causal, or no attention), an explicit boolean mask, or a FlexAttention BlockMask."""
        cfg = self.cfg
        pattern, attending = cfg.layer_windows, cfg.attention_layers
        if not (cfg.window or cfg.doc_causal):
            return [None] * cfg.n_layer
        build = attention_mask
        if cfg.attention == "flex":
            if flex_available(idx.device):
                build = flex_block_mask
            else:
                _warn_flex_fallback("is not in this torch build" if flex_attention is None
                                    else f"has no backward on {idx.device.type}")
        windows = {"L": self.windows[0], "S": self.windows[1]} if cfg.window else {"L": None}
        kinds = dict.fromkeys(pattern[i] for i in attending)  # none built for the layers without attention
        masks = {kind: build(idx, windows[kind], cfg.doc_causal, cfg.bos_id) for kind in kinds}
        return [masks[kind] if i in attending else None for i, kind in enumerate(pattern)]

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
        if self.smear is not None:
            x = self.smear(x)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        if cfg.embed_norm:
            x = F.rms_norm(x, (x.size(-1),))
        x0 = x
        bigram = None if self.bigram is None else self.bigram(idx)
        ves = [ve(idx) for ve in self.value_embeds]
        ves = ves + [None] * (cfg.n_layer - 2 * len(ves)) + ves
        masks = self._masks(idx)
        half, skips = cfg.n_layer // 2, []
        skip_gates = 2 * self.skip_gate(x0) if self.skip_gate is not None else None
        # the blocks get the window, not its frequencies: FSDP2's mixed precision casts floating-point block inputs
        yarn_window = self.windows[0] if cfg.yarn else None
        mudd, outputs, value = dict(zip(cfg.mudd, self.mudd)), {}, None
        for i, block in enumerate(self.blocks):
            if self.skip_weights is not None and i >= cfg.n_layer - half:
                j = i - (cfg.n_layer - half)
                weight = self.skip_weights[j] if skip_gates is None else self.skip_weights[j] * skip_gates[..., j:j + 1]
                x = x + weight * skips.pop()
            x = block(x, x0, ves[i], masks[i], yarn_window, bigram, value)
            if i in cfg.mudd_sources:
                outputs[i] = x
            value = None
            if i in mudd:
                x, value = mudd[i](x, [x0, *(outputs[j] for j in cfg.mudd_reads(i))])
            if self.skip_weights is not None and i < half:
                skips.append(x)
            if i == cfg.backout - 1:
                early = x
        if self.backout_lambda is not None:
            x = x - self.backout_lambda * early
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
        if self.loss_weights is not None and self.training:  # in this order: no training guard without the terms
            return None, self.weighted_loss(logits, targets)
        # targets of -100 (padding) are skipped: the mean is over the others, NaN if there are none
        return None, F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1), ignore_index=-100)

    def weighted_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The training loss of mtp_weights and prefix_weight: at each position the cross-entropies of its logits
        against the next token, the tokens after it in its row and its target's prefix token, weighted by
        `loss_weights`, summed and divided by the count of next-token targets, so that with the other weights at
        0 it is the plain mean. A position whose token k ahead lies past its row's end (or is padding), or whose
        target has no prefix token, leaves that term out. Same head, same logits: no new parameter or matmul."""
        cfg = self.cfg
        aims = [F.pad(targets[:, k:], (0, k), value=-100) for k in range(cfg.tokens_ahead)]
        if cfg.prefix_weight:
            aims.append(torch.where(targets >= 0, self.prefix_targets[targets.clamp(min=0)], -1))
        aims = torch.stack(aims, dim=-1)  # [B, T, terms]
        # log_softmax keeps what F.cross_entropy keeps: one [B, T, V] tensor for the backward
        picked = F.log_softmax(logits, dim=-1).gather(-1, aims.clamp(min=0))
        weights = torch.where(aims >= 0, self.loss_weights, 0.0)
        return -(picked * weights).sum() / (targets != -100).sum()

    def num_params(self) -> int:
        """Number of distinct parameters (a shared head counted once; under untie_at the head is one of its own)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, window: int | None = None) -> float:
        """Training FLOPs per token of a seq_len-token sequence: 6 per matmul weight, plus 12 x n_embd per layer
        with attention for each key a query attends to (QK^T and AV, forward and backward; PaLM's count, made
        causal), plus 6 x n_embd per weight a MUDD connection gives a source (its weighted sums).

        A token at position p attends to min(p + 1, w) keys, w being its layer's window at `window` (default:
        the current one; S layers half of it). Document boundaries are ignored: with doc_causal it is an
        upper bound, the FLOPs of the window alone.
        """
        cfg = self.cfg
        long = self.window if window is None else window
        kinds = [cfg.layer_windows[i] for i in cfg.attention_layers]
        layers = [long if kind == "L" else short_window(long) for kind in kinds]
        keys = sum(mean_keys(seq_len, w) for w in layers)
        mixed = sum(m.proj.size(0) for m in self.mudd)
        return 6.0 * self.matmul_weights + 12.0 * cfg.n_embd * keys + 6.0 * cfg.n_embd * mixed

    @functools.cached_property
    def matmul_weights(self) -> int:
        """Parameters that multiply an activation: all but the embedding tables, a tied head counted as the head."""
        # Cached: train.py counts FLOPs every step, and walking the modules each time costs more than the count.
        lookup_only = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        shared = self.lm_head.weight is self.wte.weight  # a tied head under untie_at is a parameter of its own
        return self.num_params() - lookup_only + (self.lm_head.weight.numel() if shared else 0)


def _read_tied(model: GPT, _keys) -> None:
    """After load_state_dict: the host's copy of the saved head_tied flag (one sync, at load only)."""
    model.tied = bool(model.head_tied)


def fading(weight: float, progress: float, stages: int, stage: int) -> float:
    """`weight` before stage `stage` of `stages` equal stages of the run, falling linearly to 0 across it, 0
    after it (stage_of's stages, the batch schedule's)."""
    now = stage_of(progress, stages)
    if now != stage:
        return weight if now < stage else 0.0
    return weight * (1.0 - min(max(progress * stages - stage, 0.0), 1.0))


def mean_keys(seq_len: int, window: int) -> float:
    """Keys per query, averaged over the positions of a causal sequence: min(p + 1, window); window 0 = none."""
    w = seq_len if window <= 0 else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

