"""The FP8 head (record 46, model.fp8_head): in training the head multiplies float8 copies of its input and weight,
cast with fixed scales, and its backward a float8 copy of the output gradient, all through torch._scaled_mm.

`fp8_matmul` is x @ w.T as a torch.library custom op with a fake implementation, so that a model compiled with
fullgraph=True traces it as one node (its casts compiled apart, see _cast), and a backward
that keeps the float8 copies (a quarter of the fp32 ones) and is a custom op too: CUDA's _scaled_mm wants its first
operand row-major and its second column-major, layouts that a compiler left free to choose strides could change.
Products of float8 values are exact in fp32, so the error is the casts' rounding: 3 mantissa bits for x and w
(e4m3, relative 2^-4 at most), 2 for the gradient (e5m2, 2^-3); `fp8_matmul_bounds` gives the most each result may
miss float64's by. (The forward's fast accumulation on Hopper keeps fewer bits than fp32: the GPU check measures it.)
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# a cast's error, (relative, absolute): half a unit in the last place of a normal value (3 mantissa bits in e4m3, 2 in
# e5m2), or of a subnormal one (e4m3 below 2^-6, spacing 2^-9; e5m2 below 2^-14, spacing 2^-16)
E4M3_ERROR, E5M2_ERROR = (2.0 ** -4, 2.0 ** -10), (2.0 ** -3, 2.0 ** -17)
# a bf16 result's rounding, 2^-8 (7 mantissa bits), twice: the CPU's _scaled_mm rounds before and after the scales
OUTPUT_ROUNDING = 2.0 ** -7


class Scales(NamedTuple):
    """What each operand is divided by before its float8 cast (and the product multiplied by after)."""
    x: float
    w: float
    grad: float


def head_scales(n_embd: int, rows: int) -> Scales:
    """The head's fixed scales (the record's), for `rows` tokens of width n_embd.

    x: the final norm's output has RMS 1 per row, so no entry exceeds sqrt(n_embd), which maps to e4m3's largest,
    448. w: 2^-9 spans |w| <= 0.875. grad: a logit's gradient is at most 1 in the record's loss, a sum over the
    tokens, and 1 / rows in ours, their mean (k / rows in batch stage k under train.stage_loss_scale): that maps
    to 448, and e5m2 holds values from 2^-24 of it (small probabilities, the micro-steps' division) to 2^7 times
    it."""
    return Scales(x=math.sqrt(n_embd) / 448, w=2.0 ** -9, grad=1.0 / (448 * rows))


def to_float8(t: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """t / scale cast to `dtype`, values beyond its range clamped to its largest: torch's own cast gives inf in
    e5m2, and NaN from 480 up in e4m3 on older versions (2.6's). In fp32, as a compiled graph computes a bf16 t:
    a bf16 quotient would round twice, and eager and compiled runs apart."""
    top = torch.finfo(dtype).max
    return t.float().div(scale).clamp(-top, top).to(dtype)


# On CUDA the casts run compiled, each one pass over its tensor, as the record's op compiles its body: eager, the
# cast of a [tokens x vocab] gradient writes three fp32 copies of it (3.3 GB each at the speedrun's head), more
# time than the float8 matmul saves. Inside a custom op the compiled function runs as it is called, whether or not
# the model around it is compiled.
@functools.cache
def compiled_to_float8() -> Callable[[Tensor, float, torch.dtype], Tensor]:
    """to_float8 under torch.compile, made at the first call: torch.compile at import would load dynamo (~2 s) into
    every process that imports the model."""
    return torch.compile(to_float8, dynamic=False)


def _cast(t: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """to_float8(t, scale, dtype): compiled on CUDA, eager elsewhere (CPUs run the op in tests and rehearsals)."""
    return (compiled_to_float8() if t.is_cuda else to_float8)(t.contiguous(), scale, dtype)


def _scalar(value: float, like: Tensor) -> Tensor:
    # _scaled_mm takes its scales as one-element fp32 tensors on the operands' device
    return torch.full((), value, dtype=torch.float32, device=like.device)


@torch.library.custom_op("shardrun::fp8_matmul", mutates_args=())
def _fp8_matmul(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    x8, w8 = _cast(x, x_s, E4M3), _cast(w, w_s, E4M3)
    # CUDA takes the first operand row-major, the second column-major (w8.T is) and sizes that are multiples of 16
    out = torch._scaled_mm(x8, w8.T, scale_a=_scalar(x_s, x), scale_b=_scalar(w_s, x), out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    return out, x8, w8


@_fp8_matmul.register_fake
def _(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    out = x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16)
    return out, torch.empty_like(x, dtype=E4M3), torch.empty_like(w, dtype=E4M3)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    x, w, *scales = inputs
    ctx.save_for_backward(*output[1:])
    ctx.scales, ctx.dtypes = Scales(*scales), (x.dtype, w.dtype)
    ctx.set_materialize_grads(False)


@torch.library.custom_op("shardrun::fp8_matmul_backward", mutates_args=())
def _fp8_matmul_backward(grad: Tensor, x8: Tensor, w8: Tensor, x_s: float, w_s: float,
                         grad_s: float) -> tuple[Tensor, Tensor]:
    g8 = _cast(grad, grad_s, E5M2)
    grad_x = torch._scaled_mm(g8, w8.T.contiguous().T, scale_a=_scalar(grad_s, grad), scale_b=_scalar(w_s, grad),
                              out_dtype=torch.bfloat16)
    # (x^T g)^T: the long vocabulary dimension is the product's columns, not its rows
    grad_w = torch._scaled_mm(x8.T.contiguous(), g8.T.contiguous().T, scale_a=_scalar(x_s, grad),
                              scale_b=_scalar(grad_s, grad), out_dtype=torch.float32).T
    return grad_x, grad_w


@_fp8_matmul_backward.register_fake
def _(grad: Tensor, x8: Tensor, w8: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor]:
    # grad_w as the real one is laid out: the transpose of a [K, M] product
    return (grad.new_empty(grad.size(0), w8.size(1), dtype=torch.bfloat16),
            grad.new_empty(w8.size(1), w8.size(0), dtype=torch.float32).T)


def _backward(ctx, grad: Tensor, *_float8_copies: Tensor) -> tuple[Tensor | None, ...]:
    x8, w8 = ctx.saved_tensors
    grad_x, grad_w = _fp8_matmul_backward(grad, x8, w8, *ctx.scales)
    x_dtype, w_dtype = ctx.dtypes
    return grad_x.to(x_dtype), grad_w.to(w_dtype), None, None, None


_fp8_matmul.register_autograd(_backward, setup_context=_save)


def fp8_matmul(x: Tensor, w: Tensor, scales: Scales) -> Tensor:
    """x [N, K] @ w [M, K].T in bf16, from e4m3 copies of x / scales.x and w / scales.w; the gradients, as through
    x @ w.T, from an e5m2 copy of the output's / scales.grad (x's in bf16, w's in fp32, then each one's dtype)."""
    return _fp8_matmul(x, w, *scales)[0]


def fp8_head(x: Tensor, w: Tensor) -> Tensor:
    """The head's logits x [..., C] @ w [V, C].T through fp8_matmul at the head's scales: x is the final norm's
    output."""
    rows = x.reshape(-1, x.size(-1))
    return fp8_matmul(rows, w, head_scales(x.size(-1), rows.size(0))).view(*x.shape[:-1], w.size(0))


def rounding_bound(a: Tensor, b: Tensor, scale: float, errors_a: tuple, errors_b: tuple) -> Tensor:
    """The most scale * (q(a) @ q(b)) can miss scale * (a @ b) by, elementwise, for float64 a and b in float8 units
    and q their casts, each off by at most e(v) = relative |v| + absolute (errors_a, errors_b): products of float8
    values are exact in fp32, and q(a) q(b) - a b = a (q(b) - b) + (q(a) - a) b + (q(a) - a)(q(b) - b)."""
    ea, eb = (errors[0] * t.abs() + errors[1] for t, errors in ((a, errors_a), (b, errors_b)))
    # in place: a product as wide as the vocabulary is 16,384 x 50,304 float64s at the speedrun's head, 6.6 GB
    return (ea @ (b.abs() + eb)).addmm_(a.abs(), eb).mul_(scale)


def fp8_matmul_bounds(x: Tensor, w: Tensor, grad: Tensor, scales: Scales) -> dict[str, tuple[Tensor, Tensor]]:
    """fp8_matmul(x, w, scales)'s output and, for the output gradient `grad`, x's and w's gradients in float64
    ("out", "grad_x", "grad_w"), each with the most fp8_matmul's may miss it by, elementwise: its float8 casts'
    (two e4m3 forward, about 2^-3 of sum_k |x_k w_k|; an e5m2 and an e4m3 backward, 2^-3 + 2^-4), and its output's
    rounding (OUTPUT_ROUNDING, on either side of the casts)."""
    s = scales
    x, w, g = x.double() / s.x, w.double() / s.w, grad.double() / s.grad  # in float8 units
    out = dict.fromkeys(("out", "grad_x", "grad_w"))
    # the output's pair last: at the speedrun's head it is 2 x 6.6 GB of float64, as is each of g's size that the
    # gradients' bounds hold for a while
    for name, a, b, scale, errors in (("grad_x", g, w, s.grad * s.w, E5M2_ERROR),
                                      ("grad_w", g.T, x, s.grad * s.x, E5M2_ERROR),
                                      ("out", x, w.T, s.x * s.w, E4M3_ERROR)):
        want, bound = (a @ b).mul_(scale), rounding_bound(a, b, scale, errors, E4M3_ERROR)
        out[name] = want, want.abs().add_(bound).mul_(OUTPUT_ROUNDING).add_(bound)
    return out
