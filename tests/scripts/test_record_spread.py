"""scripts/record_spread.py on logs made in a record's format: each eval step's spread over the runs that reached
it, and a file that is not a record's log refused by name."""
import subprocess
import sys

import pytest

from scripts.record_spread import spread
from tests.helpers import ROOT
from tests.scripts.beside_fixtures import record_log


def test_each_eval_steps_spread_over_the_runs_that_reached_it(tmp_path):
    finals = [3.27, 3.28, 3.29]  # mean 3.28, sample standard deviation 0.01
    logs = [record_log(tmp_path / f"run{i}.txt", {0: (10.8258, 0), 9: (final, 900)}, 9)
            for i, final in enumerate(finals)]
    logs.append(record_log(tmp_path / "short.txt", {0: (10.8258, 0)}, 9))  # died before its last eval
    rows = spread({str(p): p.read_text() for p in logs})
    assert [(r["step"], r["runs"]) for r in rows] == [(0, 4), (9, 3)]
    assert rows[0]["stdev"] == 0 and (rows[0]["low"], rows[0]["high"]) == (10.8258, 10.8258)
    assert rows[1]["mean"] == pytest.approx(3.28) and rows[1]["stdev"] == pytest.approx(0.01)
    assert (rows[1]["low"], rows[1]["high"]) == (3.27, 3.29)

    out = subprocess.run([sys.executable, "-m", "scripts.record_spread", *map(str, logs)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "| 9 | 3 | 3.2800 | 0.0100 | 3.2700 | 3.2900 |" in out.splitlines()


def test_a_file_that_is_not_a_records_log_is_refused_by_name(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("no evals here\n")
    done = subprocess.run([sys.executable, "-m", "scripts.record_spread", str(other), str(tmp_path / "gone.txt")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and f"no such file: {tmp_path / 'gone.txt'}" in done.stderr
    done = subprocess.run([sys.executable, "-m", "scripts.record_spread", str(other)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and f"{other} has no 'step:S/N val_loss:...' line" in done.stderr
