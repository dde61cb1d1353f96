"""A stand-in for the `kernels` package, on a record script's PYTHONPATH where the kernel hub cannot be reached.

modded-nanogpt's records since 2025-09-03 call `get_kernel('varunneal/flash-attention-3')` at import and use one
function of it, inside `torch.compile(model, dynamic=False, fullgraph=True)`:

    flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                causal=True, softmax_scale=s, window_size=(w, 0))

q, k, v are [tokens, heads, head_dim], one row of documents that start at the offsets cu_seqlens (a table padded
with the row's length, or with repeated offsets). FlashAttention's window (w, 0) lets query i see keys i - w to i.
Here the same attention is FlexAttention's: document ids by searchsorted of the offsets, a causal, windowed,
same-document mask built by create_block_mask at every call (a cost FA3 has not; the harness times it), then
flex_attention. On CPU, where FlexAttention has no backward, a call that needs gradients takes the dense path: the
same mask made dense, into scaled_dot_product_attention.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

PROVIDES = "varunneal/flash-attention-3"
MASK_BUILDS = 20  # time_block_mask averages this many builds


def document_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each position's document: how many offsets are at or before it (padding offsets equal to `tokens` count
    for none, repeated ones shift every id alike)."""
    positions = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True)


def mask_mod(docs: torch.Tensor, window: int):
    """FlexAttention's mask function: key k is seen by query q in q's document, at or before q, and at most
    `window` positions back (window < 0: no limit)."""
    def allowed(b, h, q, k):
        seen = (docs[q] == docs[k]) & (q >= k)
        return seen & (q - k <= window) if window >= 0 else seen
    return allowed


def block_mask(cu_seqlens: torch.Tensor, tokens: int, window: int) -> BlockMask:
    """The BlockMask of one row of `tokens` tokens: what every call builds anew."""
    return create_block_mask(mask_mod(document_ids(cu_seqlens, tokens), window), None, None, tokens, tokens,
                             device=cu_seqlens.device)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, causal: bool = False,
                           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                           **unsupported) -> torch.Tensor:
    """FA3's varlen attention for one row of documents, self-attention, causal, a left window; [T, H, D] out."""
    if not causal or window_size[1] > 0 or cu_seqlens_q is not cu_seqlens_k or unsupported:
        raise NotImplementedError(f"kernels stand-in: only causal self-attention with a left window, as the "
                                  f"records call it (causal={causal}, window_size={window_size}, "
                                  f"{sorted(unsupported)})")
    tokens, window = q.size(0), window_size[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and needs_grad:
        dense = create_mask(mask_mod(document_ids(cu_seqlens_k, tokens), window), None, None, tokens, tokens,
                            device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=softmax_scale)
    else:
        out = flex_attention(q, k, v, block_mask=block_mask(cu_seqlens_k, tokens, window), scale=softmax_scale)
    return out.squeeze(0).transpose(0, 1)


def get_kernel(name: str, *args, **kwargs) -> types.SimpleNamespace:
    """The hub kernel `name`, where it is the one this stand-in provides; says once that it is a stand-in."""
    if name != PROVIDES:
        raise ModuleNotFoundError(f"kernels stand-in: provides {PROVIDES!r} only, not {name!r}")
    print(f"kernels stand-in: {name} -> FlexAttention ({__file__})", file=sys.stderr, flush=True)
    return types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(
        flash_attn_varlen_func=flash_attn_varlen_func))


def time_block_mask(doc_starts: Iterable[int], tokens: int, window: int) -> float:
    """Milliseconds of one block_mask build on the GPU, compiled as in the record's model, for a row of `tokens`
    tokens whose documents start at `doc_starts`: what each attention call of the record's step pays."""
    cu = torch.tensor([0, *doc_starts], dtype=torch.int32, device="cuda")

    def build(cu):  # what a call builds; its blocks' count, so that nothing of it is left out
        return block_mask(cu, tokens, window).kv_num_blocks.sum()

    build = torch.compile(build, dynamic=False, fullgraph=True)
    build(cu)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(MASK_BUILDS):
        build(cu)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / MASK_BUILDS


def gpu_check() -> dict:
    """The largest error of flex's output and gradients on the GPU against the dense path in float64, on ragged
    documents with a window, 1,024 tokens of 2 heads of 128: eager in float32, compiled in one graph in bf16 (as
    the record runs it)."""
    tokens, heads, dim = 1024, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 100, 357, 358, 800, tokens, tokens], dtype=torch.int32, device="cuda")
    q, k, v, dy = (torch.randn(tokens, heads, dim, device="cuda", generator=gen) for _ in range(4))
    call = dict(causal=True, softmax_scale=0.12, window_size=(128, 0))
    exact = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    out64 = flash_attn_varlen_func(*exact, cu.cpu(), cu.cpu(), **call)
    want = [out64, *torch.autograd.grad(out64, exact, dy.double().cpu())]
    compiled = torch.compile(flash_attn_varlen_func, dynamic=False, fullgraph=True)
    errors = {}
    for name, attend, dtype in (("float32 eager", flash_attn_varlen_func, torch.float32),
                                ("bfloat16 compiled", compiled, torch.bfloat16)):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attend(*inputs, cu, cu, **call)
        got = [out, *torch.autograd.grad(out, inputs, dy.to(dtype))]
        errors[name] = max((g.double().cpu() - w).abs().max().item() for g, w in zip(got, want))
    return errors
