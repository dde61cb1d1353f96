"""scripts/beside/side_probe.py: a script run in the probe's process, its Muon-type optimizer's steps counted, some
of them profiled by kernel category, and what it measured written even when the script fails."""
import json
import sys

import pytest

from scripts.beside.side_probe import category
from tests.helpers import run

SCRIPT = '''import sys
from pathlib import Path
import torch

class LittleMuon(torch.optim.SGD):  # what the probe counts: a step of the optimizer named like Muon
    pass

Path(sys.argv[1]).write_text(" ".join(sys.argv))
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
muon = LittleMuon(model[0].parameters(), lr=0.01)
adam = torch.optim.AdamW(model[2].parameters(), lr=0.01)
for step in range(6):
    model(torch.randn(32, 64)).square().mean().backward()
    muon.step()
    adam.step()
    model.zero_grad()
if sys.argv[2:] == ["hang"]:
    print("steps done", flush=True)
    __import__("time").sleep(600)
if sys.argv[2:] == ["fail"]:
    raise RuntimeError("the script failed after its steps")
'''


@pytest.mark.parametrize("name,cat", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"), ("nvjet_hsh_128x256_64x4", "matmul"),
    ("aten::mm", "matmul"), ("triton_tem_fused_0", "attention"), ("flash_fwd_kernel", "attention"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"), ("triton_poi_fused_add_mul_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4>", "elementwise"), ("aten::add_", "elementwise"),
    ("Memcpy HtoD (Pinned -> Device)", "other")])
def test_kernels_are_sorted_by_name(name, cat):
    assert category(name, in_optimizer=False) == cat
    assert category(name, in_optimizer=True) == "optimizer"


def probe(tmp_path, *script_args, check=True):
    script = tmp_path / "train_like.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "scripts.beside.side_probe", "--json", str(tmp_path / "probe.json"),
           "--profile-from", "2", "--profile-steps", "2", str(script), str(tmp_path / "argv.txt"), *script_args]
    return run(cmd, check=check), json.loads((tmp_path / "probe.json").read_text())


def test_steps_are_counted_and_two_of_them_profiled(tmp_path):
    _, res = probe(tmp_path)
    assert (tmp_path / "argv.txt").read_text() == f"{tmp_path / 'train_like.py'} {tmp_path / 'argv.txt'}"
    assert res["muon_steps"] == 6 and res["error"] is None and res["compile_s"] == 0.0
    rows = {r["category"]: r for r in res["profile"]["rows"]}
    assert res["profile"]["time"] == "cpu" and list(rows) == ["matmul", "attention", "optimizer", "communication",
                                                             "elementwise", "other"]
    assert rows["matmul"]["ms"] > 0 and rows["optimizer"]["ms"] > 0 and rows["attention"]["ms"] == 0
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert any(name.startswith("aten::") for name, _ in rows["matmul"]["top"])


def test_a_failing_script_still_leaves_what_was_measured(tmp_path):
    proc, res = probe(tmp_path, "fail", check=False)
    assert proc.returncode == 1 and "the script failed after its steps" in proc.stderr
    assert res["error"] == "RuntimeError: the script failed after its steps" and res["muon_steps"] == 6
