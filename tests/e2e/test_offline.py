"""A node without network: what train.py and the GPU check need, and a one-line answer for what is missing.

Each test runs a real interpreter that can import only the packages it names (tests/helpers.py stock_python),
so a module-level import of an optional package would fail here. The wheel folder itself, and the check run
from it, are in tests/scripts/test_gpu_check.py's CPU rehearsal.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run, stock_python, tiny_args, tiny_data

# torch, numpy and tiktoken, and tomli_w as a wheel folder brings it: what train.py needs
CORE = ("torch", "numpy", "tiktoken", "tomli_w")


@pytest.fixture(scope="module")
def core_python(tmp_path_factory) -> Path:
    return stock_python(tmp_path_factory.mktemp("core") / "venv", CORE)


def one_line(stderr: str) -> str:
    """The only line of `stderr`, which must hold one."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_without_the_wheel_folder_the_check_ends_in_one_line_naming_what_is_missing(tmp_path):
    python = stock_python(tmp_path / "stock")
    env = {"PYTHON": str(python), "SHARDRUN_VENV": str(tmp_path / "venv"), "SHARDRUN_WHEELS": str(tmp_path / "w")}
    proc = run(["bash", "scripts/gpu_check.sh", "--cpu", "--json", str(tmp_path / "c.json")], env=env, check=False,
               timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    line = one_line(proc.stderr)
    assert "lacks tomli_w and there is no wheel folder" in line and "bash run.sh wheels --python-version 3." in line
    assert not (tmp_path / "venv").exists() and not (tmp_path / "c.json").exists()  # nothing half-made


def test_train_py_runs_with_torch_numpy_tiktoken_and_tomli_w_alone(core_python, tmp_path):
    data = tiny_data(tmp_path / "data")
    proc = run([str(core_python), *tiny_args(data, tmp_path / "runs", "core", "--train.max_steps=3")],
               env={"PYTHONPATH": str(ROOT)})
    summary = json.loads((tmp_path / "runs" / "core" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_val_loss"] > 0
    # no matplotlib: the curves are skipped in one warning line that names it, and the run succeeds
    warning = [line for line in proc.stdout.splitlines() if "loss.png" in line]
    assert len(warning) == 1 and "needs the Python package matplotlib" in warning[0], proc.stdout


def assert_names_the_package(proc, package: str) -> None:
    """The command failed with one line naming `package` and how to install it, and no traceback."""
    assert proc.returncode != 0, proc.stdout
    line = one_line(proc.stderr)
    assert f"needs the Python package {package}, which" in line and f"pip install {package}" in line, line
    assert "Traceback" not in proc.stdout + proc.stderr


def test_log_wandb_without_wandb_names_it_in_one_line(core_python, tmp_path):
    data = tiny_data(tmp_path / "data")
    cmd = tiny_args(data, tmp_path / "runs", "w", "--log.wandb=true", "--train.max_steps=1")
    assert_names_the_package(run([str(core_python), *cmd], env={"PYTHONPATH": str(ROOT)}, check=False), "wandb")


def test_a_jsonl_corpus_without_datasets_names_it_in_one_line(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    python = stock_python(tmp_path / "py", (*CORE, "tqdm"))  # prepare's progress bar needs tqdm (stock images have it)
    cmd = ["-m", "data.prepare", "--files", str(tmp_path / "c.jsonl"), "--tokenizer", "bytes", "--out",
           str(tmp_path / "shards")]
    assert_names_the_package(run([str(python), *cmd], env={"PYTHONPATH": str(ROOT)}, check=False), "datasets")


def test_the_leaderboards_t_test_without_scipy_names_it_in_one_line(core_python, tmp_path):
    data = tiny_data(tmp_path / "data")
    for seed in (0, 1):  # two runs of one row, with a target: the t-test's input
        run([str(core_python), *tiny_args(data, tmp_path / "runs", f"s{seed}", "--train.max_steps=2",
                                           f"--train.seed={seed}", "--eval.target_loss=9")],
            env={"PYTHONPATH": str(ROOT)})
    cmd = ["-m", "scripts.leaderboard", str(tmp_path / "runs"), "--pool-seeds"]
    assert_names_the_package(run([str(core_python), *cmd], env={"PYTHONPATH": str(ROOT)}, check=False), "scipy")


def test_an_unknown_without_is_refused_before_anything_is_downloaded(tmp_path):
    proc = run([sys.executable, "-m", "scripts.wheels", "--without", "wandb,nosuch", "--out", str(tmp_path / "w")],
               check=False, env={"PIP_NO_INDEX": "1"})
    assert proc.returncode == 1 and "--without nosuch: not in requirements.txt" in proc.stderr
    assert not (tmp_path / "w").exists()


def test_a_venv_keeps_the_torch_decision_it_was_made_with_whatever_python_calls_it_later(tmp_path):
    # a venv made around a node's own torch (its stamp ends in -1), later reached with a PYTHON without torch:
    # no reinstall (pip would put torch==2.13.0 over the node's torch); pip here would only say it was called
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\ncase "$*" in *pip*) echo "pip called"; exit 1;; esac\n'
                                         f'exec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    stamp = hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest()
    (venv / ".requirements.sha").write_text(f"{stamp}-1\n")
    env = {"PYTHON": str(stock_python(tmp_path / "bare", ())), "SHARDRUN_VENV": str(venv),
           "SHARDRUN_WHEELS": str(tmp_path / "w")}
    proc = run(["bash", "run.sh", "sample", "--help"], env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: sample.py"), proc.stdout + proc.stderr
