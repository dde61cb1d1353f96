"""Which keys each query may attend to: causal, within a window (model.window, its schedule from
model.window_start, S layers half of it by model.window_pattern) and within its document (model.doc_causal), as an
explicit boolean mask for SDPA or a FlexAttention BlockMask (model.attention = "flex"). With none of these keys a
layer gets None: SDPA's plain causal attention."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor

from model.config import GPTConfig, stage_of

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch builds without FlexAttention fall back to SDPA
    flex_attention = None

if TYPE_CHECKING:
    Mask: TypeAlias = Tensor | BlockMask | None  # a layer's: plain causal, an explicit boolean mask, or a BlockMask


def short_window(window: int, block: int = 0) -> int:
    """The window of the layers marked S in window_pattern: half the long one (the records), at least 1; with a
    `block` > 0, half its whole blocks (the records count windows in blocks of 128 tokens)."""
    return max((window // block // 2) * block if block else window // 2, 1)


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


def window_at(cfg: GPTConfig, progress: float) -> int:
    """The window of the L layers at `progress` in [0, 1] of training: window_stages's stage by stage and `window`
    from 1 on (record 46: 384, 896, 1,408, then 1,664), window_start growing linearly to window (the records
    before: 128 -> 1,792), or window throughout."""
    if cfg.window_stages:
        return cfg.window if progress >= 1 else cfg.window_stages[stage_of(progress, len(cfg.window_stages))]
    if not cfg.window_start:
        return cfg.window
    return round(cfg.window_start + (cfg.window - cfg.window_start) * min(max(progress, 0.0), 1.0))


def layer_masks(cfg: GPTConfig, idx: Tensor, windows: Tensor) -> list[Mask]:
    """Per layer: None (plain causal, or no attention), an explicit boolean mask, or a FlexAttention BlockMask;
    `windows` holds the (long, short) window now, in keys a query may see, unless model.window_past adds its own."""
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
    keys = windows + 1 if cfg.window_past else windows  # two numbers added, inside the compiled graph
    by_kind = {"L": keys[0], "S": keys[1]} if cfg.window else {"L": None}
    kinds = dict.fromkeys(pattern[i] for i in attending)  # none built for the layers without attention
    masks = {kind: build(idx, by_kind[kind], cfg.doc_causal, cfg.bos_id) for kind in kinds}
    return [masks[kind] if i in attending else None for i, kind in enumerate(pattern)]


def mean_keys(seq_len: int, window: int) -> float:
    """Keys per query, averaged over the positions of a causal sequence: min(p + 1, window); window 0 = none."""
    w = seq_len if window <= 0 else min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
