"""parallelize in one process leaves the plain module; a step's parts on 2 gloo ranks (one torchrun launch):
gradient clipping under DDP and FSDP2, eager and compiled, equals one process."""
import shutil
import sys
import sysconfig

import pytest
import torch

from model import get_model
from tests.helpers import ROOT, run, torchrun
from tests.workers.muon_worker import GPT_CONFIG
from tests.workers.step_worker import CASES, CLIP, clipped
from trainer.config import TrainConfig
from trainer.distributed import Dist
from trainer.parallel import autocast, compiler_missing, parallelize


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_trains_the_plain_module_and_rank_0_gets_a_copy_of_its_state(parallel):
    model = get_model(GPT_CONFIG)
    wrapped = parallelize(model, TrainConfig(parallel=parallel), Dist())
    assert wrapped.module is wrapped.wrapped is wrapped.eval_module is model
    assert (wrapped.kind, wrapped.sharded, wrapped.master) == ("no wrapper", False, True)
    state = wrapped.full_state()
    assert state.keys() == model.state_dict().keys()
    name, value = next(iter(model.state_dict().items()))
    assert torch.equal(state[name], value) and state[name].data_ptr() != value.data_ptr()
    assert parallelize(get_model(GPT_CONFIG), TrainConfig(), Dist(rank=1)).full_state() is None
    with wrapped.grad_sync(False), autocast(Dist(), "bfloat16"):  # CPU: fp32, nothing to skip
        assert model(torch.zeros(1, 4, dtype=torch.long))[0].dtype == torch.float32


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("step") / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "step_worker.py", out], env={"PYTHONPATH": str(ROOT)})
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def one_process() -> tuple[float, float, dict]:
    return clipped("ddp", Dist())  # a single process gets no wrapper and no collective


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_clip_to_the_global_norm_of_one_process(two_ranks, one_process, case):
    norm, loss, grads = two_ranks["clip"][case]
    want_norm, want_loss, want = one_process
    assert want_norm > 5 * CLIP  # clipping acts
    # the norm of the whole gradient, not of a rank's shard (FSDP2) or of its own batch
    assert norm == pytest.approx(want_norm, rel=1e-5) and loss == pytest.approx(want_loss, rel=1e-5)
    assert grads.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, atol=1e-7, rtol=1e-4, msg=f"{case} {name}")
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])) == pytest.approx(CLIP, rel=1e-4)


def test_fsdp_compiles_the_blocks_and_the_head_and_loss(two_ranks):
    # (blocks, tail: final norm, head, softcap, cross-entropy), each compiled or not
    assert two_ranks["compiled"] == {"ddp": (False, False), "fsdp": (False, False), "fsdp_compiled": (True, True)}


def test_inductor_on_cpu_needs_a_compiler_that_runs_and_pythons_c_headers(monkeypatch, tmp_path):
    """What compiler_missing names (check_kernels' refusal, run.sh's eager run): CXX naming a folder, then a
    Python without Python.h (Debian's without python3-dev)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, str(tmp_path))}):
        assert compiler_missing() == (f"inductor builds its kernels with a C++ compiler and found none (it tried "
                                      f"{tmp_path}); install g++ or clang++ (CXX names another)")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *args, **kwargs: {"include": str(tmp_path)})
    reason = compiler_missing()
    assert reason is not None
    if "C++ compiler" not in reason:  # this machine has one: its headers are what is missing now
        assert reason == (f"inductor builds its kernels against Python's C headers, which this Python lacks "
                          f"({tmp_path / 'Python.h'}); install its development package (python3-dev on Debian and "
                          f"Ubuntu)")


def test_a_toolchain_that_cannot_build_inductors_kernels_fails_the_trial_compile(tmp_path):
    """`true` answers `--version` as a compiler would and builds nothing: compiler_missing passes it, the trial
    compile of cannot_compile (what run.sh asks) does not. A fresh inductor cache, so that nothing is reused."""
    code = ("from trainer.parallel import cannot_compile, compiler_missing\n"
            "print(compiler_missing())\nprint(cannot_compile())")
    out = run([sys.executable, "-c", code], env={"CXX": shutil.which("true"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)},
              timeout=300).stdout.splitlines()
    if out[0] == "None":  # Python's headers are here: only the trial tells
        assert out[1].startswith("inductor's trial compile failed: ") and "backend=" not in out[1], out
    else:
        assert out[1] == out[0] and "Python's C headers" in out[0], out
