"""train.py turns on the CUDA allocator's expandable segments before torch starts, in every process torchrun
starts, unless the user chose an allocator setting."""
import sys
from pathlib import Path

import pytest

from tests.helpers import TRAIN, run, torchrun_cmd

# Loaded by every Python process of the run (PYTHONPATH): when a train.py process first imports torch, it writes
# the variable as that moment sees it to a file named for its rank and exits, so no run needs torch or data.
PROBE = '''
import os
import sys


def _at_torch(event, args):
    if event == "import" and args[0] == "torch" and sys.argv[0].endswith("train.py"):
        with open(os.path.join(os.environ["ALLOC_PROBE_OUT"], os.environ.get("RANK", "alone")), "w") as f:
            f.write(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "unset"))
        os._exit(0)


sys.addaudithook(_at_torch)
'''
ARGS = [TRAIN, "--config", "configs/tiny.toml", "--data.train=unread/*.bin"]  # the probe exits before any read


def seen_at_torch_import(tmp_path: Path, cmd: list[str]) -> dict[str, str]:
    """{rank or "alone": PYTORCH_CUDA_ALLOC_CONF when that train.py process imported torch} for `cmd`."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(PROBE)
    out = tmp_path / "seen"
    out.mkdir()
    run(cmd, env={"PYTHONPATH": str(tmp_path / "site"), "ALLOC_PROBE_OUT": str(out)})
    return {f.name: f.read_text() for f in out.iterdir()}


@pytest.fixture
def unset(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_train_sets_expandable_segments_before_torch_starts(tmp_path, unset):
    assert seen_at_torch_import(tmp_path, [sys.executable, *ARGS]) == {"alone": "expandable_segments:True"}


def test_every_process_torchrun_starts_gets_it(tmp_path, unset):
    want = {"0": "expandable_segments:True", "1": "expandable_segments:True"}
    assert seen_at_torch_import(tmp_path, torchrun_cmd(ARGS, nproc=2)) == want


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_allocator_setting_is_kept(tmp_path, unset, monkeypatch, name):
    monkeypatch.setenv(name, "max_split_size_mb:128")
    seen = seen_at_torch_import(tmp_path, [sys.executable, *ARGS])
    # PYTORCH_ALLOC_CONF is torch's newer name for the setting: the older one is then left alone
    assert seen == {"alone": "max_split_size_mb:128" if name == "PYTORCH_CUDA_ALLOC_CONF" else "unset"}
