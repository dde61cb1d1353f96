"""A command run in a process group of its own, bounded in time: at its timeout, or when the caller unwinds (a
Ctrl-C, a SIGTERM turned into an exception), the whole group gets SIGTERM, then SIGKILL after a grace period, so
that nothing it started (compile workers, torchrun's ranks) outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_group(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path, timeout: float,
              grace: float) -> int | str:
    """Run `cmd` in a new session with stdout and stderr to `log`; its exit code, or "timeout" past `timeout` s (its
    group then gets SIGTERM, and SIGKILL `grace` s later)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
