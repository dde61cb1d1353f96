"""scripts/gpu_check.sh: the CPU rehearsal runs every step of the GPU check for real, and its verdicts can fail."""
import json
import math
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts import gpu_check
from tests.helpers import ROOT, run


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_check(tmp_path):
    out = tmp_path / "check.json"
    proc = run(["bash", "scripts/gpu_check.sh", "--cpu", "--json", str(out), "--work", str(tmp_path / "work")],
               env={"PYTHON": sys.executable}, timeout=480)
    res = json.loads(out.read_text())
    checks = {r["check"]: r for r in res["checks"]}
    assert list(checks) == ["speedrun", "text", "hackathon"]
    assert all(r["status"] == "ok" for r in checks.values()), checks
    for name, r in checks.items():
        assert r["steps"] >= 1 and r["compile_s"] > 0 and 0 <= r["data_wait_frac"] < 1 and r["peak_mem_gb"] > 0
        assert f"| {name} |" in proc.stdout
    # random tokens teach nothing; the real text does
    assert checks["speedrun"]["val_loss"] == pytest.approx(math.log(50257), abs=0.1)
    assert checks["hackathon"]["val_loss"] == pytest.approx(math.log(32000), abs=0.1)
    assert checks["text"]["val_loss"] < math.log(257) - 0.5
    assert checks["text"]["tok_s"] > 0
    # each check trained the recipe it names, on the data built for it
    assert "configs/hackathon_32gpu.toml" in checks["hackathon"]["args"]
    summary = json.loads((tmp_path / "work" / "runs" / "text" / "summary.json").read_text())
    assert summary["config_name"] == "speedrun_8xh100" and summary["status"] == "budget"


def test_verdicts_catch_a_leaking_mask_and_a_model_that_does_not_learn():
    v = math.log(50257)
    assert gpu_check.verdict("speedrun", v + 0.01, v, 2.5) == "ok"
    assert "leaks" in gpu_check.verdict("speedrun", v - 1.0, v, 2.5)
    assert gpu_check.verdict("text", 1.2, math.log(257), 2.5) == "ok"
    assert "outside" in gpu_check.verdict("text", 0.01, math.log(257), 2.5)
    assert "outside" in gpu_check.verdict("text", 4.0, math.log(257), 2.5)
    assert "no val loss" in gpu_check.verdict("text", float("nan"), math.log(257), 2.5)


def test_random_documents_look_like_fineweb_shards():
    tokens = gpu_check.random_documents(2_000_000, 50257, 50256, np.random.default_rng(0))
    starts = np.flatnonzero(tokens == 50256)
    assert starts[0] == 0 and tokens.max() <= 50256 and tokens.min() >= 0
    assert len(tokens) / len(starts) == pytest.approx(gpu_check.MEAN_DOC_TOKENS, rel=0.1)


def test_a_check_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    t0 = time.time()
    rc, _ = gpu_check.run_bounded(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "out.log", 1,
                                  gpu_check.CPU)
    assert rc == "timeout" and time.time() - t0 < 10
    assert gone(int(pid_file.read_text()))


def test_a_check_in_flight_is_killed_when_the_script_is_stopped(tmp_path):
    # gpu_check.sh's outer timeout SIGTERMs the script, whose handler exits: the check's group must go too
    pid_file = tmp_path / "child.pid"
    previous = signal.signal(signal.SIGALRM, lambda *_: sys.exit("stopped"))
    signal.alarm(2)
    try:
        with pytest.raises(SystemExit):
            gpu_check.run_bounded(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "out.log", 50,
                                  gpu_check.CPU)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert gone(int(pid_file.read_text()))


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once `pid` no longer runs (absent, or a zombie waiting for init to reap it)."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_to_use_cpu_mode():
    proc = run(["bash", "scripts/gpu_check.sh"], env={"PYTHON": sys.executable}, check=False, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr and "--cpu" in proc.stderr
