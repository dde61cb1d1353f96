"""What a run folder says about its run, read from real files without torch: its last resume state, whether the
run ended there, the newest unfinished run of a pattern, and where its checkpoint is."""
import json
import os
from pathlib import Path

import pytest

from trainer.config import Config, to_toml
from trainer.runs import checkpoint_path, done_path, read_marker, saved_checkpoint, unfinished_run


def saved_run(run_dir, step, *, summary=None, with_config=True, mtime=None):
    """A run folder whose resume/done.json names `step`, with `summary` as its summary.json."""
    config = Config().to_dict()
    done_path(run_dir).parent.mkdir(parents=True)
    marker = {"dir": f"step{step:07d}", "step": step, "world_size": 1}
    done_path(run_dir).write_text(json.dumps({**marker, "config": config} if with_config else marker))
    (run_dir / "config.toml").write_text(to_toml(config))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if mtime is not None:
        os.utime(done_path(run_dir), (mtime, mtime))
    return run_dir


def test_a_run_without_a_resume_state_has_no_marker(tmp_path):
    assert read_marker(tmp_path) is None


def test_the_marker_says_whether_the_run_ended_at_its_state(tmp_path):
    ended = {"steps": 30, "status": "max_steps"}
    assert read_marker(saved_run(tmp_path / "a", 30, summary=ended))["finished"] == ended
    assert read_marker(saved_run(tmp_path / "b", 30))["finished"] is None  # killed: no summary
    assert read_marker(saved_run(tmp_path / "c", 30, summary={"steps": 30, "status": "sigterm"}))["finished"] is None
    # the summary of an earlier stretch, the state saved later
    assert read_marker(saved_run(tmp_path / "d", 40, summary=ended))["finished"] is None


def test_the_newest_unfinished_run_of_the_pattern_is_the_one_found(tmp_path):
    saved_run(tmp_path / "r_old", 10, mtime=1_000)
    saved_run(tmp_path / "r_new", 20, mtime=2_000)
    saved_run(tmp_path / "r_done", 30, summary={"steps": 30, "status": "max_steps"}, mtime=3_000)
    saved_run(tmp_path / "other", 40, mtime=4_000)
    (tmp_path / "r_empty").mkdir()  # started, never saved
    assert unfinished_run(tmp_path, "r_*", Config(), 1) == (tmp_path / "r_new", 20, [])
    assert unfinished_run(tmp_path, "r_done", Config(), 1) is None


def test_the_checkpoint_goes_where_train_checkpoint_path_says_else_into_the_run_folder():
    assert checkpoint_path(Path("runs/r"), "") == Path("runs/r/checkpoint.pt")
    assert checkpoint_path(Path("runs/r"), "out/x.pt") == Path("out/x.pt")


def test_a_finished_run_is_read_from_its_summary_an_unfinished_one_from_its_config(tmp_path):
    assert saved_checkpoint(tmp_path) == tmp_path / "checkpoint.pt"  # killed before it wrote config.toml
    (tmp_path / "config.toml").write_text('[train]\ncheckpoint_path = "out/named.pt"\n')
    assert saved_checkpoint(tmp_path) == Path("out/named.pt")
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_path": "elsewhere/final.pt"}))
    assert saved_checkpoint(tmp_path) == Path("elsewhere/final.pt")  # the record wins over the config
    # an older save in the folder (train.checkpoint_path changed on resume) does not stand for the record's
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert saved_checkpoint(tmp_path) == Path("elsewhere/final.pt")
    # the run saved into its folder, which stood elsewhere then (moved or copied since): this folder's own file
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_path": f"/old/runs/{tmp_path.name}/checkpoint.pt"}))
    assert saved_checkpoint(tmp_path) == tmp_path / "checkpoint.pt"
    (tmp_path / "summary.json").write_text("{")
    with pytest.raises(ValueError):
        saved_checkpoint(tmp_path)
