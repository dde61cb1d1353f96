"""Products whose result is symmetric, in a Triton kernel that computes only the tiles on and above the diagonal
(optim.muon_symmetric): Newton-Schulz's Gram matrix A = X X^T and its polynomial b A + c A^2 (= b A + c A A^T, A
being symmetric) are two of its three matmuls. With t tiles a side, t (t - 1) / 2 of the t^2 are never computed:
at the speedrun's 768 rows (t = 6) 42% of each product, 25% of the iteration's flops at its stacks.

One kernel serves both: out = alpha * X X^T (+ beta * C, C symmetric). Each program computes one square tile
(rows i, columns j, i <= j, in fp32) and writes it twice, at (i, j) and mirrored at (j, i): the mirror is the
same values stored through swapped strides, with no transpose in registers. A stack of one tile a side saves
nothing, nor one whose last tiles are mostly padding: `saves` says when to call it. Triton compiles it for CUDA; on
a CPU its interpreter runs it (TRITON_INTERPRET=1, numpy's arithmetic), which is how the tests check it.
Registered as an opaque custom op with a shape-only fake: a compiled Newton-Schulz (optim.muon_compile) keeps it
whole in its graph and calls it as it is.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

AVAILABLE = importlib.util.find_spec("triton") is not None
# read when the kernel is defined below, as triton.jit reads it: whether it runs interpreted is fixed from then on
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device`, or None: it needs Triton, and a CUDA device (compiled) or a CPU
    (Triton's interpreter, under TRITON_INTERPRET=1 when this module was imported)."""
    if not AVAILABLE:
        return "Triton is not installed (CUDA builds of torch bring it; pip install triton)"
    if device.type == "cuda" and INTERPRETED:
        return "TRITON_INTERPRET=1 makes Triton interpret it on the CPU, slowly: unset it for a GPU run"
    if device.type != "cuda" and not INTERPRETED:
        return (f"Triton compiles it for CUDA devices, not {device.type} (TRITON_INTERPRET=1 runs it in Triton's "
                f"interpreter, slowly: for tests)")
    return None


def _block(rows: int) -> int:
    """The side of a tile for a result of rows x rows: 128 (the records' choice at 768) down to tl.dot's least, 16."""
    return 128 if rows > 256 else 64 if rows > 32 else 32 if rows > 16 else 16


def saves(rows: int) -> bool:
    """Whether the kernel computes fewer cells of a rows x rows result than the whole product has: t (t + 1) / 2
    tiles of a side B, t = ceil(rows / B), against rows^2 (one tile a side, or a ragged edge's padding, can cost
    more; then cuBLAS's whole product is the better call). 768 rows: 21 of 36 tiles, exact."""
    block = _block(rows)
    tiles = -(-rows // block)
    return tiles * (tiles + 1) // 2 * block * block < rows * rows


if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _upper_tiles(x_ptr, c_ptr, out_ptr, m, k, alpha, beta,
                     sxb, sxm, sxk, scb, scm, scn, sob, som, son,
                     HAS_C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        i, j, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if i > j:  # a tile below the diagonal: its mirror's program writes it
            return
        rows, cols = i * BLOCK + tl.arange(0, BLOCK), j * BLOCK + tl.arange(0, BLOCK)
        inner = tl.arange(0, BLOCK_K)
        x = x_ptr + b * sxb
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + inner
            left = tl.load(x + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < m) & (ks[None, :] < k),
                           other=0.0)
            right = tl.load(x + cols[:, None] * sxm + ks[None, :] * sxk, mask=(cols[:, None] < m) & (ks[None, :] < k),
                            other=0.0)
            acc = tl.dot(left, tl.trans(right), acc, input_precision=PRECISION)
        acc = acc * alpha
        inside = (rows[:, None] < m) & (cols[None, :] < m)
        if HAS_C:
            c = tl.load(c_ptr + b * scb + rows[:, None] * scm + cols[None, :] * scn, mask=inside, other=0.0)
            acc += beta * c.to(tl.float32)
        result = acc.to(out_ptr.dtype.element_ty)
        out = out_ptr + b * sob
        tl.store(out + rows[:, None] * som + cols[None, :] * son, result, mask=inside)
        if i < j:
            tl.store(out + rows[:, None] * son + cols[None, :] * som, result, mask=inside)

    # the schema written out: inferring an optional tensor from a string annotation differs between torch versions
    @torch.library.custom_op("shardrun::symmetric_product", mutates_args=(),
                             schema="(Tensor x, float alpha, Tensor? c, float beta) -> Tensor")
    def symmetric_product(x: Tensor, alpha: float, c: Tensor | None, beta: float) -> Tensor:
        """alpha * x @ x.mT (+ beta * c, which must be symmetric) of a [batch, m, k] stack of bf16, fp16 or fp32, in
        x's dtype, each result rounded once from an fp32 sum."""
        torch._check(x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16, torch.float32),
                     lambda: f"symmetric_product: x must be a [batch, m, k] stack of bf16, fp16 or fp32, got "
                             f"{x.dtype} {tuple(x.shape)}")
        batch, m, k = x.shape
        torch._check(c is None or (c.shape == (batch, m, m) and c.dtype == x.dtype),
                     lambda: f"symmetric_product: c must be [{batch}, {m}, {m}] of {x.dtype}")
        out = x.new_empty(batch, m, m)
        block, wide = _block(m), x.element_size() == 2
        # bf16: 128 x 64 operand tiles, 3 stages of two in shared memory (96 KiB); fp32 takes half as deep a step,
        # the same bytes, within an A100's 164 KiB too
        block_k = min(64 if wide else 32, max(16, triton.next_power_of_2(k)))
        tiles = triton.cdiv(m, block)
        cs = c.stride() if c is not None else (0, 0, 0)
        _upper_tiles[(tiles, tiles, batch)](
            x, c if c is not None else x, out, m, k, alpha, beta, *x.stride(), *cs, *out.stride(),
            HAS_C=c is not None, BLOCK=block, BLOCK_K=block_k,
            # fp32 as torch multiplies it by default (no TF32); 16-bit operands ignore the setting
            PRECISION="tf32" if wide else "ieee",
            num_warps=8 if block == 128 else 4, num_stages=3)
        return out

    @symmetric_product.register_fake
    def _(x: Tensor, alpha: float, c: Tensor | None, beta: float) -> Tensor:
        return x.new_empty(x.shape[0], x.shape[1], x.shape[1])
