"""trainer/torchrun.py: torchrun as run.sh launches it, its own noise kept in the run folder's torchrun.log."""
import signal
import subprocess
import time

from tests.e2e.test_errors_once import WORKER, launcher
from tests.helpers import ROOT


def test_a_stopped_torchrun_leaves_the_ranks_words_and_no_traceback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.Popen(launcher(script, "wait"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{rank}").exists() for rank in "01") and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # as a scheduler stops a job: torchrun passes it on to the ranks
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err == "", err
    assert sorted(out.splitlines()) == ["rank 0 stopped", "rank 1 stopped"]
