"""trainer/torchrun.py: torchrun as run.sh launches it, its own noise kept in the run folder's torchrun.log."""
import signal
import subprocess
import time

from tests.e2e.test_errors_once import WORKER, launcher
from tests.helpers import ROOT, TRAIN, run, tiny_args, tiny_data


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


def test_an_exception_python_can_only_ignore_goes_to_torchruns_log_not_the_console(capsys):
    """As the stopping agent's keep-alive timer, collected in its own thread, fails to join itself."""
    import io
    import sys

    from trainer.torchrun import keep_unraisable

    class JoinsItself:
        def __del__(self):
            raise RuntimeError("cannot join current thread")

    text, before = io.StringIO(), sys.unraisablehook
    try:
        keep_unraisable(text)
        JoinsItself()  # collected at once: its __del__ raises where nothing can catch it
    finally:
        sys.unraisablehook = before
    assert capsys.readouterr().err == ""
    assert "RuntimeError: cannot join current thread" in text.getvalue() and "JoinsItself" in text.getvalue()


def test_a_refused_launch_leaves_no_report_file_nobody_is_told_of(tmp_path):
    # a config error every rank prints: no run folder for torchrun's log, and no line naming a file
    data = tiny_data(tmp_path / "data")
    proc = run(launcher(TRAIN, *tiny_args(data, tmp_path / "runs", "bad", "--train.batch_sise=4")[1:]),
               env={"TMPDIR": str(tmp_path)}, check=False)
    assert proc.returncode == 1 and "unknown key train.batch_sise" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("shardrun-torchrun-*")), proc.stderr
