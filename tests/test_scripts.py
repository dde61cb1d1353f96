"""Every script in scripts/ starts both as people type it (python scripts/x.py) and as a module (python -m scripts.x)."""
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("how", ["path", "module"])
def test_every_script_starts_by_path_and_as_a_module(how, tmp_path):
    # By path from another folder, so that only the script itself can put the repository on sys.path;
    # as a module from the root, as `python -m` is used. All at once: each start is mostly torch's import.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {p.stem: subprocess.Popen([sys.executable, *([str(p)] if how == "path" else ["-m", f"scripts.{p.stem}"]),
                                       "--help"], cwd=tmp_path if how == "path" else ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in SCRIPTS}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = f"exit {proc.returncode}: {(err.strip().splitlines() or [out[-300:]])[-1]}"
    assert len(SCRIPTS) >= 7 and not failed, failed
