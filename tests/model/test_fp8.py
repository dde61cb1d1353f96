"""The FP8 head (model/fp8.py, model.fp8_head): its product and both gradients against float64 within the float8
rounding bound, saturation, compiled with fullgraph=True, a GPT that trains with it, and evals without it.

The bound is model/fp8.py's fp8_matmul_bounds: each float8 cast off by at most half a unit in its last place, the
products of float8 values exact in fp32, and the bf16 output's rounding on top (twice on the CPU, whose _scaled_mm
rounds to bf16 before and after it applies the scales); scripts/gpu_check/kernels.py judges a GPU's run by it.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from model import fp8
from model.fp8 import (E4M3, E5M2, OUTPUT_ROUNDING, Scales, fp8_matmul, fp8_matmul_bounds, head_scales,
                       to_float8)
from optim.config import OptimConfig
from optim.groups import build_optimizers
from tests.helpers import MODERN_GPT as MODERN
from tests.model.tiny import batch, tiny, train_tied
from trainer.config import parse_args

N, K, M = 64, 64, 256  # tokens, width, padded vocabulary


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with RMS-1 rows (the final norm's output), a head's weights well inside 2^-9 x 448, and the gradient a
    mean cross-entropy over the N rows gives its logits: at most 1 / N, as head_scales expects."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g)
    x = x / x.square().mean(-1, keepdim=True).sqrt()
    w = 0.05 * torch.randn(M, K, generator=g)
    targets = torch.randint(0, M, (N,), generator=g)
    grad = (torch.softmax(3 * torch.randn(N, M, generator=g), -1) - F.one_hot(targets, M)) / N
    return x, w, grad


def fp8_and_grads(x, w, grad, scales: Scales, fn=fp8_matmul):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, scales)
    out.backward(grad)
    return out, x.grad, w.grad


def test_the_product_and_both_gradients_are_float64s_within_the_float8_rounding_bound():
    x, w, grad = operands()
    s = head_scales(K, N)
    out, grad_x, grad_w = fp8_and_grads(x, w, grad, s)
    assert (out.dtype, grad_x.dtype, grad_w.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    bounds = fp8_matmul_bounds(x, w, grad, s)
    for got, (want, bound) in zip((out, grad_x, grad_w), bounds.values()):
        error = (got.double() - want).abs()
        assert (error <= bound).all()
        # the bound is the casts' worst case; their errors, of either sign, mostly cancel: the typical one is
        # far below it, and far above an unquantised product's
        assert 1e-3 < error.norm() / want.norm() < 2.0 ** -4


def test_the_product_and_gradients_are_exact_on_the_float8_copies_but_for_the_outputs_rounding():
    # what tells them from a bf16 product and autograd's gradients: each is the float64 product of the operands'
    # float8 copies (torch's own cast, nothing saturates here), then rounded to bf16 (fp32 for w's gradient). The
    # gradient reaches the op in the output's dtype, bf16.
    x, w, grad = operands(1)
    s = head_scales(K, N)
    x8, w8, g8 = (t.div(scale).to(dtype).double() * scale
                  for t, scale, dtype in ((x, s.x, E4M3), (w, s.w, E4M3), (grad.bfloat16().float(), s.grad, E5M2)))
    results = fp8_and_grads(x, w, grad, s)
    plain = x.double() @ w.double().T, grad.double() @ w.double(), grad.double().T @ x.double()
    for got, (a, b), unquantised, rounding in zip(results, ((x8, w8.T), (g8, w8), (g8.T, x8)), plain,
                                                  (OUTPUT_ROUNDING, OUTPUT_ROUNDING, 2.0 ** -24)):
        want, accumulation = a @ b, 2.0 ** -16 * (a.abs() @ b.abs())  # fp32 sums of at most 256 terms
        assert ((got.double() - want).abs() <= rounding * want.abs() + accumulation).all()
        assert not ((unquantised - want).abs() <= rounding * want.abs() + accumulation).all()


def test_values_beyond_the_float8_range_are_clamped_to_its_largest_never_nan_or_inf():
    big = torch.tensor([1000.0, -1e6, math.inf, 300.0])
    assert to_float8(big, 1.0, E4M3).float().tolist() == [448.0, -448.0, 448.0, 288.0]
    assert to_float8(big, 1.0, E5M2).float().tolist() == [1024.0, -57344.0, 57344.0, 320.0]
    # a row 10 x past the scale saturates: its product is that of the row clamped to 448 x s.x
    x, w, grad = operands(2)
    s = head_scales(K, N)
    x[0] *= 10 * math.sqrt(K) / x[0].abs().max()
    clamped = x.clamp(-448 * s.x, 448 * s.x)
    saturated, clipped = fp8_and_grads(x, w, grad, s), fp8_and_grads(clamped, w, grad, s)
    assert all(torch.equal(a, b) for a, b in zip(saturated, clipped)) and saturated[0].isfinite().all()
    # and a gradient 1000 x past its scale saturates at e5m2's largest, not inf
    _, grad_x, grad_w = fp8_and_grads(x, w, grad * 1000 * N, s)
    assert grad_x.isfinite().all() and grad_w.isfinite().all()

def test_the_compiled_cast_cuda_runs_rounds_as_the_eager_one():
    # one fused pass on CUDA (fp8._cast), the same fp32 arithmetic: bit for bit, here on CPU's inductor
    t = torch.randn(64, 96, dtype=torch.bfloat16) * 300
    for scale, dtype in ((0.5, E4M3), (2.0 ** -9, E4M3), (1 / 448, E5M2)):
        assert torch.equal(fp8.compiled_to_float8()(t, scale, dtype).view(torch.uint8),
                           to_float8(t, scale, dtype).view(torch.uint8))


def test_both_ops_fake_implementations_match_the_real_ones_shapes_dtypes_and_strides():
    # what a compiled graph plans its buffers from, CUDA's layouts included (grad_w is a transposed product)
    x, w = torch.randn(32, 64, dtype=torch.bfloat16), 0.02 * torch.randn(128, 64, requires_grad=True)
    s = head_scales(64, 32)
    checks = torch.library.opcheck(fp8._fp8_matmul, (x, w, *s), test_utils=("test_faketensor",
                                                                            "test_autograd_registration"))
    x8, w8 = to_float8(x, s.x, E4M3), to_float8(w.detach(), s.w, E4M3)
    grad = torch.randn(32, 128, dtype=torch.bfloat16) / 32
    checks |= torch.library.opcheck(fp8._fp8_matmul_backward, (grad, x8, w8, *s), test_utils=("test_faketensor",))
    assert set(checks.values()) == {"SUCCESS"}



@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_op_compiles_with_fullgraph_and_matches_its_eager_run(backend):
    """One node to dynamo (fullgraph=True raises at a break); inductor also relies on the fake's shapes and
    dtypes, and lays out the backward's casts itself."""
    x, w, grad = operands(3)
    s = head_scales(K, N)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: fp8_matmul(x, w, s), fullgraph=True, backend=backend)
    eager, traced = fp8_and_grads(x, w, grad, s), fp8_and_grads(x, w, grad, s, fn=lambda x, w, _: compiled(x, w))
    torch._dynamo.reset()
    for a, b in zip(eager, traced):
        assert a.dtype == b.dtype and a.shape == b.shape
        # inductor may divide by a scale as a product with its reciprocal: a value on a float8 rounding boundary
        # then rounds the other way, one float8 step of one term
        assert torch.allclose(a.float(), b.float(), rtol=OUTPUT_ROUNDING, atol=b.abs().max().item() * 2.0 ** -5)


def test_a_gpt_with_the_fp8_head_compiles_with_fullgraph_and_trains_as_eager():
    # aot_eager: dynamo's graph and AOTAutograd's backward, without inductor's code generation (tests/trainer/
    # test_compile.py's reason); the same ops, so the same numbers
    eager = _losses(tiny(**MODERN, fp8_head=True), 2)
    torch._dynamo.reset()
    m = tiny(**MODERN, fp8_head=True)
    m.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    assert _losses(m, 2) == eager
    torch._dynamo.reset()


def _losses(m, steps: int) -> list[float]:
    # 4 x 16 tokens a step: a multiple of 16, as CUDA's _scaled_mm needs
    return train_tied(m, build_optimizers(m, OptimConfig(lr=3e-3)), steps)


@pytest.mark.parametrize("options", [dict(tie_embeddings=False), MODERN], ids=["gpt2_untied", "modern"])
def test_a_gpt_with_the_fp8_head_trains_and_takes_its_steps_from_the_float8_product(options):
    losses, plain = _losses(tiny(fp8_head=True, **options), 6), _losses(tiny(**options), 6)
    assert losses[-1] < losses[0] - 0.1, losses
    # from the same start: the float8 head's own steps, near the plain head's
    assert losses != plain and losses == pytest.approx(plain, rel=2e-2)


def test_evals_score_the_unquantised_head_and_the_default_path_is_unchanged():
    m, plain = tiny(**MODERN, fp8_head=True), tiny(**MODERN)
    with torch.no_grad():
        m.lm_head.weight.normal_(std=0.02)  # MODERN starts it at zero
        plain.load_state_dict(m.state_dict())
    x = batch(T=17)
    m.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(m(x)[0], plain(x)[0])
        assert torch.equal(m(x[:, :-1], x[:, 1:])[1], plain(x[:, :-1], x[:, 1:])[1])
    m.train()
    plain.train()
    trained, unquantised = m(x[:, :-1])[0], plain(x[:, :-1])[0]
    assert not torch.equal(trained, unquantised) and torch.allclose(trained, unquantised, atol=0.05)


def test_the_speedrun_configs_keep_it_off_until_a_gpu_measures_it():
    assert not parse_args(["--config", "configs/speedrun_8xh100.toml"]).model.fp8_head
