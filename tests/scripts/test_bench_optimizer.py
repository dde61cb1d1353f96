"""scripts/bench/optimizer.py on CPU: the plain config and the optimizer keys' variants stepped on the same
gradients from the same weights, each timed, its weights held to the plain config's."""
import json

import pytest
import torch

from scripts.bench import optimizer as bench

# 128 wide: Muon's 128-row matrices are the symmetric kernel's (two tiles a side; in Triton's interpreter here)
ARGS = ["--config", "configs/tiny.toml", "--cpu", "--steps", "2", "--warmup", "1", "--optim.name=muon",
        "--model.n_embd=128"]


@pytest.mark.slow
def test_each_variant_is_timed_beside_the_plain_config_on_the_same_gradients(tmp_path, capsys):
    out = tmp_path / "optimizer.json"
    rows = bench.main([*ARGS, "--variant", "optim.muon_symmetric", "--variant",
                       "optim.muon_compile,optim.muon_symmetric", "--variant", "optim.bf16_storage",
                       "--json", str(out)])
    assert [r["variant"] for r in rows] == ["plain", "optim.muon_symmetric",
                                            "optim.muon_compile + optim.muon_symmetric", "optim.bf16_storage"]
    assert json.loads(out.read_text())["rows"] == rows
    assert all(r["muon_ms"] > 0 and r["adamw_ms"] > 0 for r in rows) and rows[0]["ratio"] == 1.0
    plain, symmetric, compiled, storage = (r["weights_vs_plain"] for r in rows)
    # the kernel's own fp32 sums: the same weights to a rounding, not bit for bit (so it ran)
    assert plain == 0 and 0 < symmetric < 1e-5 and 0 < compiled < 1e-5
    assert 1e-4 < storage < 1e-2  # bf16's rounding of the tables, head and moments: ~2^-9 of a weight
    table = capsys.readouterr().out
    assert "optimizer steps of tiny.toml on CPU" in table and "optim.bf16_storage" in table


def test_a_config_without_muon_a_key_of_another_kind_or_a_typo_is_refused_naming_the_fix():
    with pytest.raises(SystemExit, match="trains with optim.name = 'adamw'; its keys are Muon's: add "
                                         "--optim.name=muon"):
        bench.main(["--config", "configs/tiny.toml", "--cpu"])
    with pytest.raises(SystemExit, match=r"--variant optim.lr: not one of the keys that change only the optimizer "
                                         r"step \(optim.muon_compile, optim.muon_symmetric, optim.bf16_storage\)"):
        bench.main([*ARGS, "--variant", "optim.lr"])
    with pytest.raises(SystemExit, match=r"unexpected argument '--stepz'.*the bench's own options"):
        bench.main([*ARGS, "--stepz", "5"])


def test_the_plain_config_is_plain_whatever_the_config_says():
    cpu = torch.device("cpu")
    cfg = bench.variant_config("configs/speedrun_1gpu.toml", ["--optim.muon_compile=true"], [], cpu)
    assert not (cfg.optim.muon_compile or cfg.optim.muon_symmetric or cfg.optim.bf16_storage)
    assert bench.variant_config("configs/speedrun_1gpu.toml", [], ["optim.bf16_storage"], cpu).optim.bf16_storage


def test_a_variant_whose_kernel_cannot_run_here_is_refused_as_train_py_refuses_it(monkeypatch):
    from optim import symmetric

    monkeypatch.setattr(symmetric, "INTERPRETED", False)  # as if imported without TRITON_INTERPRET
    with pytest.raises(SystemExit, match=r"optim.muon_symmetric = true: optim/symmetric.py's Triton kernel cannot "
                                         r"run here: Triton compiles it for CUDA devices, not cpu"):
        bench.variant_config("configs/speedrun_1gpu.toml", [], ["optim.muon_symmetric"], torch.device("cpu"))
