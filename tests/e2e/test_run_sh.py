"""`bash run.sh`, the main job of a machine without a GPU, end to end in a copy of the repository."""
import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import time

import pytest
import torch
from matplotlib.image import imread

from tests.helpers import ROOT, run
from trainer.parallel import cannot_compile


def copy_of_the_repo(tmp_path) -> tuple:
    """A copy of the repository without runs, shards, venv or a wheel folder (run.sh would install from it), and
    the environment that runs run.sh there."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "runs", "shards", ".git", "__pycache__",
                                                             ".pytest_cache", "wheels", "upstream"))
    return repo, {"SHARDRUN_VENV": sys.prefix, "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.slow
def test_bash_run_sh_runs_the_cpu_track_offline(tmp_path):
    repo, env = copy_of_the_repo(tmp_path)
    env["BUDGET"] = "8"
    # demo shards of other settings (as another Python's standard library makes): remade, and a new run started
    run([sys.executable, "-m", "data.prepare", "--demo", "--max-docs", "3", "--val-tokens", "10", "--out",
         "shards/demo"], cwd=repo, env=env)
    out = run(["bash", "run.sh"], cwd=repo, env=env, timeout=900).stdout
    assert "CPU track: no GPU found" in out and "processes x 1 thread" in out
    assert "[run.sh] making shards/demo again (--overwrite); runs on the old shards are not continued" in out
    # compiled where inductor can build its kernels (a machine without, the next test)
    compiled = cannot_compile() is None
    assert ("| compile True" in out) == compiled and ("training eagerly" in out) == (not compiled), out[-3000:]
    assert "\nplan: budget 8 s -> the row up to 40 s: model.n_layer = 2," in out  # cpu.toml's row for 8 s
    done = [line for line in out.splitlines() if line.startswith("done: budget")]
    assert len(done) == 1 and "bits/byte" in done[0] and "tok/s" in done[0], out[-3000:]
    (run_dir,) = (repo / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["track"] == "cpu" and summary["world_size"] == len(os.sched_getaffinity(0))  # nproc
    assert summary["final_val_bpb"] > 0 and summary["train_time_s"] >= 8
    sample = out.split(f"a sample from runs/{run_dir.name}/checkpoint.pt:", 1)[1]
    assert sample.strip().startswith("def"), out[-3000:]  # the prompt, then generated text
    # The closing summary names the picture, the checkpoint and how to sample more; each is there.
    summary_lines = out.rsplit("[run.sh] done: ", 1)[1].splitlines()
    assert summary_lines[1:] == [f"  curves      runs/{run_dir.name}/loss.png",
                                 f"  checkpoint  runs/{run_dir.name}/checkpoint.pt",
                                 f'  sample      bash run.sh sample runs/{run_dir.name}/checkpoint.pt --prompt "def " '
                                 f"--tokens 300"]
    assert imread(run_dir / "loss.png").shape[:2] == (600, 1000) and (run_dir / "checkpoint.pt").is_file()
    assert json.loads((repo / "shards" / "demo" / "meta.json").read_text())["complete"]
    # from another folder, the run named as seen from there; its config's data glob is relative to the checkout
    (tmp_path / "elsewhere").mkdir()
    out = run(["bash", str(repo / "run.sh"), "sample", f"../repo/runs/{run_dir.name}", "--prompt", "def ", "--tokens",
               "5"], cwd=tmp_path / "elsewhere", env=env).stdout
    assert out.startswith("def ") and len(out) > len("def \n"), out


@pytest.mark.slow
def test_an_interrupted_main_job_says_how_to_continue_and_run_sh_again_continues_it(tmp_path):
    repo, env = copy_of_the_repo(tmp_path)
    # the main job's config, stopping at step 20 of a long budget, with a line per step and a short final eval;
    # its checkpoint where the config names it (as the hackathon's does), which the resume and the sample use
    config = (repo / "configs" / "cpu.toml").read_text()
    config = config.replace("[train]\n", '[train]\nmax_steps = 20\ncheckpoint_path = "out/cpu.pt"\n')
    config = config.replace("every_steps = 10", "every_steps = 1").replace("tokens = 262144", "tokens = 16384")
    (repo / "configs" / "short.toml").write_text(config)
    # on a machine without a C++ compiler (CXX names one that is not there): eager, and said so
    env.update(CONFIG="configs/short.toml", BUDGET="600", CXX=str(tmp_path / "no-such-g++"))
    job = subprocess.Popen(["bash", "run.sh"], cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not [p for p in (repo / "runs").glob("cpu-*/metrics.jsonl") if p.read_text().count('"train"') >= 2]:
            assert job.poll() is None and time.time() < deadline, "run.sh ended or took too long before step 2"
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: run.sh, torchrun and what else is in the foreground
        out = job.communicate(timeout=300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0, out[-3000:]
    assert ("[run.sh] training eagerly (--train.compile=false), 1.3-1.5x fewer steps: inductor builds its kernels "
            f"with a C++ compiler and found none (it tried {tmp_path / 'no-such-g++'})") in out
    assert "| compile False" in out
    (run_dir,) = (repo / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] < 20, out[-3000:]
    step = summary["steps"]
    assert out.splitlines()[-1] == (f"[run.sh] stopped: runs/{run_dir.name} is saved at step {step}; "
                                    f"CONFIG=configs/short.toml BUDGET=600 bash run.sh continues it"), out[-3000:]

    # continued from another folder: the lines it prints name the checkout's files as seen from there
    (tmp_path / "elsewhere").mkdir()
    out = run(["bash", str(repo / "run.sh")], cwd=tmp_path / "elsewhere", env=env, timeout=900).stdout
    assert (f"[run.sh] continuing the unfinished run {run_dir} (saved at step {step}); FRESH=1 bash {repo}/run.sh "
            f"starts a new one") in out, out[-3000:]
    assert list((repo / "runs").iterdir()) == [run_dir] and f"resumed at step {step}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "max_steps" and summary["steps"] == 20
    assert "a sample from out/cpu.pt:" in out, out[-3000:]
    assert torch.load(repo / "out" / "cpu.pt", weights_only=True)["step"] == 20  # the final save, where the config says
    assert out.rsplit("[run.sh] done: ", 1)[1].splitlines()[2:] == [
        f"  checkpoint  {repo}/out/cpu.pt", f'  sample      bash {repo}/run.sh sample {repo}/out/cpu.pt --prompt "def " '
                                            f'--tokens 300']
    sample = out.rsplit("  sample      ", 1)[1].splitlines()[0].replace("300", "5")
    assert run(["bash", "-c", sample], cwd=tmp_path / "elsewhere", env=env).stdout.startswith("def ")  # as pasted


def test_ctrl_c_while_the_main_job_prepares_stops_it_and_keeps_the_shards(tmp_path):
    repo, env = copy_of_the_repo(tmp_path)
    job = subprocess.Popen(["bash", "run.sh"], cwd=repo, env={**os.environ, **env}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    meta = repo / "shards" / "demo" / "meta.json"
    try:
        deadline = time.time() + 300
        while not meta.exists() or not json.loads(meta.read_text())["shards"]:  # the val shard written
            assert job.poll() is None and time.time() < deadline, "run.sh ended or took too long before a shard"
            time.sleep(0.02)
        os.killpg(job.pid, signal.SIGINT)
        out = job.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    # stopped with the shell's Ctrl-C status; not remade with --overwrite and trained on as before
    assert job.returncode == 130 and "[run.sh] training" not in out and "--overwrite" not in out, out[-3000:]
    kept = json.loads(meta.read_text())
    assert not kept["complete"] and all((meta.parent / s["file"]).exists() for s in kept["shards"])
    assert out.splitlines()[-1].startswith("prepare: interrupted; kept "), out[-3000:]


@pytest.fixture
def bare(tmp_path):
    """run.sh and requirements.txt alone in a folder (no runs/, records/ or train.py), using our venv."""
    for name in ("run.sh", "requirements.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path, {"SHARDRUN_VENV": sys.prefix}


def test_run_sh_called_through_a_link_works_in_its_checkout(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "run.sh").symlink_to(ROOT / "run.sh")
    proc = run(["bash", str(tmp_path / "bin" / "run.sh"), "sample", "--help"], cwd=tmp_path,
               env={"SHARDRUN_VENV": sys.prefix})
    assert "usage: sample.py" in proc.stdout, proc.stdout + proc.stderr  # it failed on requirements.txt beside the link


def test_multi_node_needs_a_rendezvous_id(bare):
    # a fixed default id would name every job's run folder alike, and the next job would resume the last one
    folder, env = bare
    proc = run(["bash", "run.sh", "train", "configs/tiny.toml"], cwd=folder, check=False,
               env={**env, "NNODES": "2", "NPROC": "1", "MASTER_ADDR": "127.0.0.1"})
    assert proc.returncode != 0 and "multi-node runs need RDZV_ID" in proc.stderr


@pytest.mark.parametrize("knob, value, message", [
    ("NPROC", "abc", "run.sh: NPROC=abc: give a whole number"), ("NPROC", "1.5", "NPROC=1.5: give a whole number"),
    ("NPROC", "0", "give 1 or more"), ("NNODES", "-1", "NNODES=-1: give a whole number"),
    ("FRESH", "0", "run.sh: FRESH=0: FRESH=1 starts a new run"),
    ("BUDGET", "3 min", "run.sh: BUDGET=3 min: give the training budget in seconds, e.g. BUDGET=180"),
])
def test_a_knob_that_is_no_count_is_refused_before_anything_runs(bare, knob, value, message):
    folder, env = bare
    proc = run(["bash", "run.sh", "train", "configs/tiny.toml"], cwd=folder, env={**env, knob: value}, check=False)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
