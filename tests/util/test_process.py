"""util/process.py: a bounded command's exit code, or its whole group stopped at its timeout, politely first."""
import os
import sys
import time

from util.process import run_group

# a child that starts a grandchild (as a trainer starts compile workers) and records both pids
SPAWN = """import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(os.getpid(), grandchild.pid, flush=True)
{body}"""


def alive(pid: int) -> bool:
    """Whether `pid` still runs: a zombie (ended, not yet reaped by whoever adopted it) does not."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_exit_code_and_the_output_come_back(tmp_path):
    code = run_group([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], cwd=tmp_path, env=dict(os.environ),
                     log=tmp_path / "out" / "log.txt", timeout=30, grace=1)
    assert code == 3 and (tmp_path / "out" / "log.txt").read_text() == "hello\n"


def test_past_its_timeout_the_whole_group_is_stopped(tmp_path):
    for body, grace in (("time.sleep(60)", 5), ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                 "time.sleep(60)", 1)):
        log = tmp_path / "log.txt"
        t0 = time.time()
        code = run_group([sys.executable, "-c", SPAWN.format(body=body)], cwd=tmp_path, env=dict(os.environ),
                         log=log, timeout=2, grace=grace)
        assert code == "timeout" and time.time() - t0 < 2 + grace + 3
        pids = [int(p) for p in log.read_text().split()]
        time.sleep(0.2)
        assert not any(alive(pid) for pid in pids), body  # the grandchild too, even where SIGTERM was ignored
