"""optim/symmetric.py's Triton kernel (in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET) against
float64, and Muon with it (optim.muon_symmetric) against Muon without."""
import pytest
import torch

pytest.importorskip("triton", reason="optim.muon_symmetric's kernel needs Triton (requirements.txt: Linux x86-64)")

from optim.config import OptimConfig  # noqa: E402
from optim.groups import build_optimizers  # noqa: E402
from optim.muon import Muon, newton_schulz  # noqa: E402
from optim import symmetric  # noqa: E402
from model import get_model  # noqa: E402
from trainer.config import ConfigError, parse_args  # noqa: E402
from trainer.parallel import check_kernels  # noqa: E402

product = torch.ops.shardrun.symmetric_product


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


# [batch, rows, inner]: the speedrun's gates (a part of one 16-row tile, one row); one tile and a part of one; tiles
# of 16, 32, 64 and 128 rows with a ragged last tile and ragged inner blocks; stacks of several
SHAPES = [(10, 6, 12), (1, 1, 12), (1, 16, 16), (1, 20, 24), (2, 48, 80), (3, 130, 70), (1, 300, 40)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_gram_matrix_and_its_polynomial_equal_float64(shape):
    """Every element of both results, written by its own tile or mirrored from the one above the diagonal: an
    element the kernel skipped would hold whatever the new tensor's memory held."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    gram = x.double() @ x.double().mT
    assert relative(product(x, 1.0, None, 0.0), gram) < 1e-6
    a = gram.float()
    assert relative(product(a, -2.5, a, 0.75), 0.75 * gram - 2.5 * gram @ gram) < 1e-6
    assert relative(product(x, 0.5, None, 0.0), 0.5 * gram) < 1e-6


def test_strided_operands_are_read_through_their_strides():
    """A tall matrix reaches the kernel transposed (a view), and the term added is read by its own strides."""
    tall = torch.randn(2, 140, 90, generator=torch.Generator().manual_seed(1))
    wide = tall.mT  # 90 rows: two tiles, one mirrored
    assert not wide.is_contiguous()
    gram = wide.double() @ wide.double().mT
    assert relative(product(wide, 1.0, None, 0.0), gram) < 1e-6
    c = torch.randn(2, 90, 90, generator=torch.Generator().manual_seed(2))
    c = (c + c.mT).mT  # symmetric, transposed strides
    assert relative(product(wide, 1.0, c, -1.0), gram - c.double()) < 1e-6


@pytest.mark.parametrize("coefficients", ["newton_schulz", "polar_express"])
@pytest.mark.parametrize("shape", [(2, 200, 128), (192, 256)])  # two tiles a side (128 rows, tall), three
def test_newton_schulz_with_the_kernel_equals_it_without(shape, coefficients):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    plain = newton_schulz(g, 5, coefficients)
    kernel = newton_schulz(g, 5, coefficients, True)
    torch.testing.assert_close(kernel, plain, atol=1e-5, rtol=0)
    assert not torch.equal(kernel, plain)  # the kernel's own sums: it ran
    compiled = torch.compile(newton_schulz, backend="aot_eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(g, 5, coefficients, True), kernel, atol=0, rtol=0)


def test_inductor_calls_the_kernel_in_its_compiled_graph():
    """The default backend's code generation around the op (its absent term, None, included), not only tracing."""
    g = torch.randn(2, 128, 160, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(newton_schulz, fullgraph=True, dynamic=False)
    # inductor fuses the scaled sums, which round apart from eager's by ~1e-6 after five iterations: the bound of the
    # kernel against the plain matmuls above
    torch.testing.assert_close(compiled(g, 5, "polar_express", True), newton_schulz(g, 5, "polar_express", True),
                               atol=1e-5, rtol=0)


def test_a_stack_the_tiles_would_not_save_on_keeps_the_plain_matmuls():
    """One tile a side is the whole product, and a ragged last tile is mostly padding (65 rows: 3 tiles of 64^2
    against 65^2 cells): cuBLAS's whole product is the better call. The speedrun's 768 rows: 21 of 36 tiles."""
    assert [symmetric.saves(rows) for rows in (1, 6, 16, 64, 65, 128, 129, 192, 257, 320, 768)] == [
        False, False, False, False, False, True, False, True, False, True, True]
    g = torch.randn(3, 48, 80, generator=torch.Generator().manual_seed(3))
    assert torch.equal(newton_schulz(g, 5, "polar_express", True), newton_schulz(g, 5, "polar_express"))


def test_muon_steps_the_same_with_the_kernel():
    """Three steps of every Muon group of a small GPT (fused qkv views, wide and tall matrices) built by the key."""
    model_cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=128)  # 128 rows: two tiles
    models, idx = [], torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    for key in (False, True):
        torch.manual_seed(0)
        model = get_model(model_cfg)
        optimizers = build_optimizers(model, OptimConfig(name="muon", muon_symmetric=key,
                                                         ns_coefficients="polar_express"))
        assert optimizers[1].symmetric is key
        for _ in range(3):
            model(idx, idx)[1].backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        models.append(model)
    for (name, plain), kernel in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(kernel, plain, atol=2e-5, rtol=0, msg=name)


def test_without_a_gpu_or_the_interpreter_the_key_is_refused(monkeypatch):
    cfg = parse_args(["--config", "configs/tiny.toml", "--data.train=x", "--optim.name=muon",
                      "--optim.muon_symmetric=true"])
    check_kernels(cfg, torch.device("cpu"))  # the interpreter: tests/conftest.py
    assert symmetric.unavailable(torch.device("cuda")) == ("TRITON_INTERPRET=1 makes Triton interpret it on the "
                                                           "CPU, slowly: unset it for a GPU run")
    monkeypatch.setattr(symmetric, "INTERPRETED", False)  # as if imported without TRITON_INTERPRET
    assert symmetric.unavailable(torch.device("cuda")) is None
    reason = symmetric.unavailable(torch.device("cpu"))
    assert reason == ("Triton compiles it for CUDA devices, not cpu (TRITON_INTERPRET=1 runs it in Triton's "
                      "interpreter, slowly: for tests)")
    with pytest.raises(ConfigError, match=r"^optim.muon_symmetric = true: optim/symmetric.py's Triton kernel cannot "
                                          r"run here: Triton compiles it for CUDA devices, not cpu .*; or set "
                                          r"--optim.muon_symmetric=false$"):
        check_kernels(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^Muon symmetric=True: Triton compiles it for CUDA devices, not cpu"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], symmetric=True)
