"""trainer/runs.py: where a run folder says its checkpoint is (summary.json, else config.toml, else the folder)."""
import json
from pathlib import Path

import pytest

from trainer.runs import checkpoint_path, saved_checkpoint


def test_the_checkpoint_goes_where_train_checkpoint_path_says_else_into_the_run_folder():
    assert checkpoint_path(Path("runs/r"), "") == Path("runs/r/checkpoint.pt")
    assert checkpoint_path(Path("runs/r"), "out/x.pt") == Path("out/x.pt")


def test_a_finished_run_is_read_from_its_summary_an_unfinished_one_from_its_config(tmp_path):
    assert saved_checkpoint(tmp_path) == tmp_path / "checkpoint.pt"  # killed before it wrote config.toml
    (tmp_path / "config.toml").write_text('[train]\ncheckpoint_path = "out/named.pt"\n')
    assert saved_checkpoint(tmp_path) == Path("out/named.pt")
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_path": "elsewhere/final.pt"}))
    assert saved_checkpoint(tmp_path) == Path("elsewhere/final.pt")  # the record wins over the config
    (tmp_path / "summary.json").write_text("{")
    with pytest.raises(ValueError):
        saved_checkpoint(tmp_path)
