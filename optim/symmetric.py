"""Products whose result is symmetric, in a Triton kernel that computes only the tiles on and above the diagonal
(optim.muon_symmetric): Newton-Schulz's Gram matrix A = X X^T and its polynomial b A + c A^2 (= b A + c A A^T, A
being symmetric) are two of its three matmuls, so about a third of its flops are never done.

One kernel serves both: out = alpha * X X^T (+ beta * C, C symmetric). Each program computes one square tile
(rows i, columns j, i <= j, in fp32) and writes it twice, at (i, j) and mirrored at (j, i): the mirror is the
same values stored through swapped strides, with no transpose in registers. Triton compiles it for CUDA; on a
CPU its interpreter runs it (TRITON_INTERPRET=1, numpy's arithmetic), which is how the tests check it. Registered
as an opaque custom op with a shape-only fake: a compiled Newton-Schulz (optim.muon_compile) keeps it whole in its
graph and calls it as it is.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

AVAILABLE = importlib.util.find_spec("triton") is not None


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device`, or None: it needs Triton, and a CUDA device or Triton's interpreter."""
    if not AVAILABLE:
        return "Triton is not installed (CUDA builds of torch bring it; pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"Triton compiles it for CUDA devices, not {device.type} (TRITON_INTERPRET=1 runs it in Triton's "
                f"interpreter, slowly: for tests)")
    return None


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
        """alpha * x @ x.mT (+ beta * c, which must be symmetric) of a [batch, m, k] stack, in x's dtype, each
        result rounded once from an fp32 sum."""
        batch, m, k = x.shape
        out = x.new_empty(batch, m, m)
        block = 128 if m > 256 else 64 if m > 32 else 32 if m > 16 else 16
        block_k = 64 if k > 32 else 32 if k > 16 else 16
        tiles = triton.cdiv(m, block)
        cs = c.stride() if c is not None else (0, 0, 0)
        _upper_tiles[(tiles, tiles, batch)](
            x, c if c is not None else x, out, m, k, alpha, beta, *x.stride(), *cs, *out.stride(),
            HAS_C=c is not None, BLOCK=block, BLOCK_K=block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=8 if block == 128 else 4, num_stages=3)
        return out

    @symmetric_product.register_fake
    def _(x: Tensor, alpha: float, c: Tensor | None, beta: float) -> Tensor:
        return x.new_empty(x.shape[0], x.shape[1], x.shape[1])
