"""How a train.py process ends: an error every rank hits is said once, by the rank that reports it; Ctrl-C and
SIGTERM ask the loop to stop after its step, and a Ctrl-C after that stops at once with 130."""
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from trainer.exits import fail, interrupted, watch_stop_signals


def test_the_reporting_rank_says_the_error_and_every_rank_exits_1(capsys, monkeypatch):
    with pytest.raises(SystemExit) as stopped:
        fail("train.py: config error: no such key", first=True)
    assert stopped.value.code == 1 and capsys.readouterr().err == "train.py: config error: no such key\n"
    monkeypatch.setenv("WORLD_SIZE", "1")  # alone, a silent rank has no other rank to wait for
    with pytest.raises(SystemExit) as stopped:
        fail("train.py: config error: no such key", first=False)
    assert stopped.value.code == 1 and capsys.readouterr().err == ""


def test_a_silent_rank_leaves_the_first_exit_to_the_rank_that_prints():
    """Under torchrun the first rank to exit stops the others: a rank that does not print waits, with the
    default SIGTERM, so that torchrun's stop cannot cut the printing rank short."""
    code = ("import os; from trainer.exits import fail; os.environ['WORLD_SIZE'] = '2'\n"
            "try:\n    fail('x', first=False)\nexcept SystemExit as e:\n    print(e.code)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=1)
    except subprocess.TimeoutExpired:  # still waiting: the SIGTERM torchrun would send ends it at once
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and out == ""


def test_a_stop_signal_asks_for_a_stop_and_a_ctrl_c_after_it_exits_at_once(monkeypatch, capfd):
    # written with os.write, as a signal handler must (print() may hold stdout's lock): capfd sees file descriptors
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setenv("RANK", "0")
    requested: list[int] = []
    try:
        watch_stop_signals(requested)
        os.kill(os.getpid(), signal.SIGTERM)
        assert requested == [signal.SIGTERM] and capfd.readouterr().err == ""
        os.kill(os.getpid(), signal.SIGINT)
        assert requested == [signal.SIGTERM, signal.SIGINT]
        assert capfd.readouterr().err.startswith("train.py: Ctrl-C: stopping after this step to save the run")
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
        assert stopped.value.code == 130 and "stopped at once, without saving" in capfd.readouterr().err
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_an_interruption_is_said_by_rank_0_alone(monkeypatch, capfd):
    for rank, said in (("0", "train.py: interrupted\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stopped:
            interrupted("train.py: interrupted")
        assert stopped.value.code == 130 and capfd.readouterr().err == said


@pytest.mark.parametrize("nth_write", [1, 2, 4])
def test_a_ctrl_c_in_the_middle_of_a_save_exits_130_with_its_line_alone(tmp_path, nth_write):
    """A second Ctrl-C mid-save: torch.save's zip writer, cut between two writes, raises "unexpected pos" from
    its __exit__ in the interruption's place (so exited 1, with a traceback; the cut at the first write, before
    anything is written, never did). The temporary file goes too."""
    code = f"""if True:
        import io, torch
        from trainer.exits import exiting_without_teardown, interrupted
        from util.atomic import atomic_path

        class Interrupting(io.FileIO):  # the signal handler runs in the write torch's writer calls back
            writes = 0
            def write(self, data):
                self.writes += 1
                if self.writes == {nth_write}:
                    interrupted("train.py: interrupted again")
                return super().write(data)

        with exiting_without_teardown(), atomic_path({str(tmp_path / "checkpoint.pt")!r}) as tmp:
            with Interrupting(tmp, "wb") as f:
                torch.save({{"w": torch.zeros(4)}}, f)
    """
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RANK": "0"})
    assert (proc.returncode, proc.stderr) == (130, "train.py: interrupted again\n")
    assert list(tmp_path.iterdir()) == []


def ending_with(ending: str, prompt: str | None = None) -> subprocess.CompletedProcess:
    """A process that prints "ran" and ends by `ending` under exiting_without_teardown, with an atexit function
    and a global whose __del__ stands for the interpreter's finalization (it would call it); with `prompt`,
    under `python -i`, what is typed at its prompt."""
    code = f"""if True:
        import atexit, os, sys
        from trainer.exits import exiting_without_teardown

        class Finalized:
            def __del__(self):
                os.write(1, b"finalized\\n")

        KEPT = Finalized()
        atexit.register(lambda: os.write(1, b"atexit\\n"))
        with exiting_without_teardown():
            print("ran")
            {ending}
    """
    interactive = ["-i"] if prompt is not None else []
    return subprocess.run([sys.executable, *interactive, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, input=prompt)


@pytest.mark.parametrize("ending, status, err", [("pass", 0, ""), ("raise SystemExit(3)", 3, ""),
                                                ("raise SystemExit('train.py: bad key')", 1, "train.py: bad key\n")])
def test_a_process_ends_with_its_status_after_its_atexit_functions_and_skips_finalization(ending, status, err):
    """What a run's exit status rests on: after the atexit functions (wandb's, logging's) nothing of the
    interpreter's finalization runs, where gloo's threads met a half-destroyed runtime (SIGABRT after "done")."""
    proc = ending_with(ending)
    assert (proc.returncode, proc.stdout, proc.stderr) == (status, "ran\natexit\n", err)


def test_an_uncaught_error_prints_its_traceback_and_ends_1_without_finalization():
    """As Python reports it, ended as above: a rank whose collective failed when its peer died (gloo's "Connection
    reset by peer") met the same SIGABRT in finalization, torchrun's exitcode -6."""
    proc = ending_with("raise ValueError('no such shard')")
    assert (proc.returncode, proc.stdout) == (1, "ran\natexit\n")
    assert proc.stderr.startswith("Traceback (most recent call last):") and proc.stderr.endswith(
        "ValueError: no such shard\n"), proc.stderr
    assert "exits.py" not in proc.stderr  # the traceback starts where the error rose, as Python's own
    # through the hook in place (wandb's marks its run failed), and Python's own where that hook fails
    hooked = ending_with("sys.excepthook = lambda *a: os.write(2, b'hooked\\n'); raise ValueError('x')")
    assert (hooked.returncode, hooked.stdout, hooked.stderr) == (1, "ran\natexit\n", "hooked\n")
    broken = ending_with("sys.excepthook = lambda *a: 1 / 0; raise ValueError('no such shard')")
    assert (broken.returncode, broken.stdout) == (1, "ran\natexit\n")
    assert broken.stderr.endswith("ValueError: no such shard\n"), broken.stderr


def test_under_python_i_an_error_reaches_the_prompt_for_a_post_mortem():
    proc = ending_with("raise ValueError('no such shard')", prompt="import sys; print(repr(sys.last_value))\n")
    assert proc.stdout.startswith("ran\nValueError('no such shard')\n"), proc.stdout
    assert "Traceback (most recent call last):" in proc.stderr


def test_a_keyboard_interrupt_outside_an_interruption_propagates_as_python_ends_it():
    proc = ending_with("raise KeyboardInterrupt")
    assert proc.returncode != 0 and proc.stdout == "ran\natexit\nfinalized\n"
    assert proc.stderr.endswith("KeyboardInterrupt\n"), proc.stderr
