"""A run's files as rank 0 writes them: log.txt and metrics.jsonl appended and cut back on resume, summary.json
read back whole, the environment lines (hardware, git commit) at the top; other ranks write nothing."""
import json
import os
import re
import resource
import subprocess
import sys
from dataclasses import asdict, fields

import pytest
import torch

from trainer import metrics
from util.atomic import DiskFullError
from trainer.distributed import Dist
from trainer.metrics import RunLog, Summary, git_commit, hardware, peak_mem_gb


def a_summary() -> Summary:
    """A summary with a value of its field's type in every field (null where the field allows it)."""
    return Summary(run_id="r", config_name="tiny", track="tiny", status="completed", final_val_loss=3.5,
                   best_val_loss=3.25, final_val_bpb=None, target_loss=None, time_to_target_s=None, steps=30,
                   tokens_seen=15360, tokens_per_s=1200.5, train_time_s=12.75, budget_s=None, mfu=None,
                   peak_mem_gb=0.5, data_wait_frac=0.01, world_size=1, hardware="1 x CPU process", torch_version="2",
                   git_commit=None, checkpoint_path="runs/r/checkpoint.pt",
                   wall={"init": 1.0, "train": 12.75}, resume_changes=[{"step": 10, "key": "train.max_steps",
                                                                        "saved": 20, "now": 30}])


def test_rank_0_prints_and_appends_lines_and_records(tmp_path, capsys):
    log = RunLog(tmp_path / "run", Dist())
    log.print("step 1 | loss 5.5")
    log.metric({"type": "train", "step": 1, "loss": 5.5})
    log.metric({"type": "eval", "step": 1, "val_loss": 5.25})
    size = log.metrics_bytes()
    log.close()
    assert capsys.readouterr().out == "step 1 | loss 5.5\n"
    assert (tmp_path / "run" / "log.txt").read_text() == "step 1 | loss 5.5\n"
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert [json.loads(line) for line in records.splitlines()] == [{"type": "train", "step": 1, "loss": 5.5},
                                                                  {"type": "eval", "step": 1, "val_loss": 5.25}]
    assert size == len(records.encode())


def test_a_resumed_log_cuts_metrics_back_to_the_saved_length_and_keeps_appending_to_log_txt(tmp_path):
    log = RunLog(tmp_path, Dist())
    log.print("first attempt")
    log.metric({"type": "train", "step": 1})
    saved = log.metrics_bytes()  # what the resume state records
    log.metric({"type": "train", "step": 2})  # logged after the save: the resumed run does step 2 again
    log.close()
    log = RunLog(tmp_path, Dist(), metrics_bytes=saved)
    log.print("second attempt")
    log.metric({"type": "train", "step": 2})
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (tmp_path / "log.txt").read_text() == "first attempt\nsecond attempt\n"
    # a length beyond the file's leaves it as it is; a fresh run (length 0) starts it empty
    RunLog(tmp_path, Dist(), metrics_bytes=10**6).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    RunLog(tmp_path, Dist()).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_other_ranks_write_nothing(tmp_path, capsys):
    log = RunLog(tmp_path / "run", Dist(rank=1, world_size=2))
    log.environment(Dist(rank=1, world_size=2))
    log.print("step 1")
    log.metric({"type": "train", "step": 1})
    log.summary(a_summary())
    assert log.metrics_bytes() == 0
    log.close()
    assert not (tmp_path / "run").exists() and capsys.readouterr().out == ""


def test_summary_json_reads_back_into_the_same_summary(tmp_path):
    log = RunLog(tmp_path, Dist())
    log.summary(a_summary())
    log.close()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert list(saved) == sorted(f.name for f in fields(Summary))  # write_json sorts the keys
    assert Summary(**saved) == a_summary() and saved == asdict(a_summary())


def test_the_environment_lines_name_versions_hardware_commit_and_command(tmp_path):
    log = RunLog(tmp_path, Dist())
    log.environment(Dist())
    log.close()
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines[0].startswith(f"python {sys.version.split()[0]} | torch {torch.__version__} | ")
    assert lines[1] == f"hardware: {hardware(Dist())} | git commit: {git_commit()}"
    assert lines[2] == "command: " + " ".join(sys.argv)
    assert len(lines) == 3  # on CPU there is no peak to assume for MFU


def test_hardware_and_peak_memory_of_a_cpu_process():
    assert re.fullmatch(rf"4 x CPU process \(\S.*, {os.cpu_count()} cores\)", hardware(Dist(world_size=4)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    peak = peak_mem_gb(Dist())
    assert 0.05 < before <= peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # torch is in it


def git(repo, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_git_commit_is_head_marked_dirty_by_changes_to_tracked_files(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "ROOT", tmp_path)  # a repository of its own, where the test makes the changes
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above it counts
    assert git_commit() is None  # not a repository
    git(tmp_path, "init", "-q")
    assert git_commit() is None  # no commit yet
    (tmp_path / "train.py").write_text("print(1)\n")
    git(tmp_path, "add", "train.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "notes.txt").write_text("untracked files are not the code that ran\n")
    assert git_commit() == head
    (tmp_path / "train.py").write_text("print(2)\n")
    assert git_commit() == head + "+dirty"


def test_a_full_disk_under_log_txt_names_it(tmp_path):
    (tmp_path / "log.txt").symlink_to("/dev/full")  # every write fails with the kernel's ENOSPC
    log = RunLog(tmp_path, Dist())
    with pytest.raises(DiskFullError) as e:
        log.print("step 1 | loss 5.5")
    assert str(e.value).startswith(f"{tmp_path / 'log.txt'}: no space left on device while writing it: it needs "
                                   f"about 18 bytes, ")  # the line and its newline
    assert str(e.value).endswith(" bytes are free there; free some space or write to another filesystem")
