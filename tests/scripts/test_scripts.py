"""Every script in scripts/ starts both as people type it (python scripts/x.py) and as a module (python -m scripts.x);
the other command lines show their usage."""
import os
import subprocess
import sys

import pytest

from tests.helpers import PACKAGES, ROOT

SCRIPTS = sorted(p for p in (ROOT / "scripts").rglob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def module(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


@pytest.mark.parametrize("how", ["path", "module"])
def test_every_script_starts_by_path_and_as_a_module(how, tmp_path):
    # By path from another folder, so that only the venv's path (run.sh puts the project on it) finds the package;
    # as a module from the root, as `python -m` is used. All at once: each start is mostly torch's import.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {module(p): subprocess.Popen([sys.executable, *([str(p)] if how == "path" else ["-m", module(p)]),
                                       "--help"], cwd=tmp_path if how == "path" else ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in SCRIPTS}
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=400)  # all at once: room for a busy machine
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = f"exit {proc.returncode}: {(err.strip().splitlines() or [out[-300:]])[-1]}"
    assert len(SCRIPTS) >= 11 and not failed, failed


def test_no_file_outside_tests_edits_sys_path():
    code = [ROOT / "train.py", *(p for d in PACKAGES for p in (ROOT / d).rglob("*.py"))]
    edits = [str(p.relative_to(ROOT)) for p in code if "sys.path" in p.read_text()]
    assert not edits, f"{edits}: import the project as a package (run.sh puts it on the venv's path)"


@pytest.mark.parametrize("cmd", [["-m", "data.prepare"], ["train.py"]])
def test_the_other_command_lines_show_their_usage(cmd):
    # argparse formats every help string only for --help: a stray % in one crashed prepare's
    proc = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
