"""Errors at start: a config error comes before torch is imported, and an error that every rank hits prints
once, not once per rank (8 copies under 8 processes, 32 at the hackathon), before the process group exists
and after; real torchrun runs on gloo."""
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, TRAIN, run, tiny_args, tiny_data, torchrun


def test_a_config_error_comes_before_torch_is_imported():
    probe = ("import runpy, sys\n"
             f"sys.argv = [{TRAIN!r}, '--config', 'configs/tiny.toml', '--train.batch_sise=4']\n"
             "try:\n"
             f"    runpy.run_path({TRAIN!r}, run_name='__main__')\n"
             "finally:\n"
             "    print('torch imported:', 'torch' in sys.modules)\n")
    proc = run([sys.executable, "-c", probe], check=False)
    assert proc.returncode == 1 and proc.stdout == "torch imported: False\n", proc.stdout + proc.stderr
    assert proc.stderr.startswith("train.py: config error: command line: unknown key train.batch_sise")


def test_an_error_every_rank_hits_prints_once(tmp_path):
    data = tiny_data(tmp_path / "data")
    # from the command line, before the process group exists
    proc = torchrun(tiny_args(data, tmp_path / "runs", "once", "--train.batch_sise=4"), check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("train.py: config error: command line: unknown key train.batch_sise") == 1, proc.stderr
    # from the data, found by every rank after the group has formed
    proc = torchrun(tiny_args(data, tmp_path / "runs", "once", f"--data.train={data}/*_trian_*.bin"), check=False)
    assert proc.returncode != 0
    assert proc.stderr.count(f"config error: data.train = '{data}/*_trian_*.bin' matches no file") == 1, proc.stderr


def test_a_failure_under_run_sh_is_one_line_and_torchruns_report_stays_in_the_run_folder(tmp_path):
    # Each rank finds another out-of-vocabulary token first (its own windows): one message still, not one a rank
    # followed by torchrun's ~40 lines of log and ChildFailedError report.
    data = tiny_data(tmp_path / "data")
    # no val set: the val data's check at setup would refuse the ids before the run folder (and torchrun.log) exists
    args = tiny_args(data, tmp_path / "runs", "bad", "--model.vocab_size=100", "--data.val=")[3:]  # after --config X
    # torch's deprecation warnings in a DDP run are not this test's concern
    env = {"NPROC": "2", "SHARDRUN_VENV": sys.prefix, "PYTHONWARNINGS": "ignore::FutureWarning"}
    proc = run(["bash", "run.sh", "train", "configs/tiny.toml", *args], env=env, check=False)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: data error: ") and "vocab_size 100" in lines[0], \
        proc.stderr
    assert "ChildFailedError" in (tmp_path / "runs" / "bad" / "torchrun.log").read_text()


WORKER = """
import os, signal, sys, time
rank = os.environ["RANK"]
# one write: print() writes the text and its newline apart, so two ranks' lines could interleave
signal.signal(signal.SIGTERM, lambda *_: (os.write(1, f"rank {rank} stopped\\n".encode()), sys.exit(0)))
if rank == "1" and sys.argv[1].startswith("die"):
    open(os.path.join(os.path.dirname(sys.argv[0]), "dying"), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
if rank == "0" and sys.argv[1] == "die-with-peer":  # its collective fails as its peer dies: exit 1, at once
    while not os.path.exists(os.path.join(os.path.dirname(sys.argv[0]), "dying")):
        time.sleep(0.001)
    sys.exit(1)
open(os.path.join(os.path.dirname(sys.argv[0]), "ready" + rank), "w").close()
time.sleep(120)
"""


def launcher(script: Path, *args: str) -> list[str]:
    """trainer/torchrun.py (run.sh's torchrun) running `script` with `args` in 2 processes."""
    return [sys.executable, "-m", "trainer.torchrun", "--standalone", "--nproc_per_node=2", str(script),
            *map(str, args)]


@pytest.mark.parametrize("how", ["die", "die-with-peer"])
def test_a_rank_killed_by_a_signal_gets_one_line_naming_it_and_the_report(tmp_path, how):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = run(launcher(script, how), check=False)
    assert proc.returncode == 1
    message, = proc.stderr.splitlines()
    assert message.startswith("torchrun: rank 1 was killed by SIGKILL (out of memory? see trainer/memory.py); "
                              "torchrun's report: "), message
    report = Path(message.rsplit(": ", 1)[1])
    assert "ChildFailedError" in report.read_text() and "exitcode  : -9" in report.read_text()
    report.unlink()



def test_a_rank_whose_peer_is_killed_says_so_in_one_line(tmp_path):
    # rank 1 SIGKILLs itself after its save of step 4 (an OOM kill, say); rank 0's next collective fails: one line
    # from it (gloo's traceback of ~25 lines before), one from run.sh's torchrun naming the dead rank
    data = tiny_data(tmp_path / "data")
    die = [ROOT / "tests" / "workers" / "die_at.py", "trainer.checkpoint:save_resume", "step=4"]
    args = tiny_args(data, tmp_path / "runs", "lost", "--train.checkpoint_every_s=1e-9")
    env = {"DIE_RANK": "1", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore::FutureWarning"}
    proc = run(launcher(die[0], *die[1:], *args), env=env, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    killed, lost = sorted(proc.stderr.splitlines())
    assert lost.startswith("train.py: peer gone: rank 0 lost another rank, which ended or stopped answering (its own "
                           "message, or torchrun's report, says why): ") and "by peer" in lost, lost
    assert killed.startswith("torchrun: rank 1 was killed by SIGKILL"), killed
    Path(killed.rsplit(": ", 1)[1]).unlink()
    assert (tmp_path / "runs" / "lost" / "resume").is_dir()  # the saves up to step 4 stay, to resume from
