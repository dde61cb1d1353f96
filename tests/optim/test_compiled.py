"""optim.muon_compile: Muon's math under torch.compile (inductor, on CPU) steps as eager does, as near a float64
reference, compiles each piece once while the rate and momentum change, and agrees with eager under 2-rank DDP and
FSDP2 on gloo."""
import pytest
import torch
from torch._dynamo.utils import counters

from model import get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers
from tests.helpers import ROOT, torchrun
from tests.workers.muon_compile_worker import STEPS, optimizer, schedule
from tests.workers.muon_worker import mlp

# The worker MLP's matrices [33, 16] (Q, K, V of [11, 16] under Polar Express), [5, 33] and [16, 5] (Newton-Schulz,
# one wide shape each): a graph for the Nesterov step, one per batch of Newton-Schulz (3), NorMuon's two halves
# (its sums and its rescaling) and one for the decay and the update.
GRAPHS = 1 + 3 + 2 + 1


def train(dtype: torch.dtype, compile: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """STEPS steps of `optimizer` on the worker MLP's matrices in `dtype` (Newton-Schulz too), on gradients that
    are the same numbers in every dtype, at a new rate and momentum each step: (the weights before, after, and the
    graphs dynamo had compiled after each step)."""
    params = [p.detach().to(dtype).requires_grad_() for p in mlp().parameters()]
    before = [p.detach().clone() for p in params]
    opt = optimizer(params, compile)
    opt.ns_dtype = dtype
    rng, graphs = torch.Generator().manual_seed(1), []
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=rng).to(dtype)
        schedule(opt, step)
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return before, [p.detach() for p in params], graphs


@pytest.fixture(scope="module")
def runs():
    """Eager in fp32, compiled in fp32 (the one compile of this module) and the float64 reference, eager."""
    torch._dynamo.reset()
    counters.clear()
    out = {"eager": train(torch.float32, False), "compiled": train(torch.float32, True),
           "float64": train(torch.float64, False)}
    torch._dynamo.reset()
    return out


def test_compiled_steps_as_eager_does_and_as_near_float64(runs):
    before, eager, _ = runs["eager"]
    _, compiled, _ = runs["compiled"]
    _, reference, _ = runs["float64"]
    assert max((w - b).abs().max() for w, b in zip(eager, before)) > 0.01  # the steps moved the weights
    for e, c, r in zip(eager, compiled, reference):
        # Fusion reorders fp32 sums, so compiled rounds differently from eager but no worse: against float64 its
        # error stays within twice eager's, plus a few ulps of the weights for a matrix where eager's happens to
        # be near none; by the triangle inequality the two then differ by at most the sum of both errors.
        eager_err, ulp = (e.double() - r).abs().max().item(), torch.finfo(torch.float32).eps * e.abs().max().item()
        bound = 2 * eager_err + 4 * ulp
        assert (c.double() - r).abs().max().item() <= bound
        torch.testing.assert_close(c, e, atol=eager_err + bound, rtol=0)


def test_each_piece_compiles_once_while_the_rate_and_momentum_change(runs):
    # the schedule sets a new rate and momentum before every step: inputs of the graphs, not new graphs
    assert runs["eager"][2] == [0] * STEPS
    assert runs["compiled"][2] == [GRAPHS] * STEPS
    assert runs["float64"][2] == [GRAPHS] * STEPS  # eager again: the key off compiles nothing


def test_the_key_reaches_muon_and_needs_it():
    model = get_model(dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    assert [getattr(o, "compile", None) for o in build_optimizers(model, OptimConfig(name="muon"))] == [None, False]
    assert build_optimizers(model, OptimConfig(name="muon", muon_compile=True))[1].compile
    for key in ("muon_compile", "muon_symmetric"):
        with pytest.raises(ValueError, match=f"^optim config: {key} = true is a Muon option, which name='adamw' "
                                             f"does not use; set name = 'muon' or {key} = false$"):
            OptimConfig(**{key: True})


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What the worker's DDP and FSDP2 runs saved, key off and on: one torchrun launch for both modes."""
    out = tmp_path_factory.mktemp("muon_compile") / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "muon_compile_worker.py", out], env={"PYTHONPATH": str(ROOT)})
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_step_compiled_as_eager(two_ranks, mode):
    eager, compiled = two_ranks["weights"][mode, False], two_ranks["weights"][mode, True]
    # The rounding of one process, where the two differ by a few 1e-7 (above; eager's own error against float64 is
    # as large), through a real backward and NorMuon's division by small second moments, which magnifies last-bit
    # differences about twofold (tests/optim/test_muon.py): ten times that
    for key, w in eager.items():
        torch.testing.assert_close(compiled[key], w, atol=5e-6, rtol=0, msg=f"{mode} {key}")
    graphs = two_ranks["graphs"]
    for rank in range(2):
        eager_graphs, compiled_graphs = graphs[mode, False][rank], graphs[mode, True][rank]
        assert compiled_graphs[0] > eager_graphs[-1]  # the key compiled at its first step ...
        assert compiled_graphs[1:] == compiled_graphs[:-1]  # ... and never again, the rate and momentum changing
