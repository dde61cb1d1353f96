"""Run a script or module with a SIGKILL at an exact point: right after a given call of a function returns.
A kill sent from the test after polling for a file comes too late on a fast machine (the run is done) or
lands anywhere on a slow one; this one lands at the same point on any machine.

usage: python tests/workers/die_at.py MODULE:FUNCTION WHEN SCRIPT [ARG ...]
       python tests/workers/die_at.py MODULE:FUNCTION WHEN -m MODULE [ARG ...]
WHEN: N, the n-th call; or NAME=VALUE, the first call whose argument NAME is VALUE (compared as text).

Under torchrun: only the rank in $DIE_RANK (every rank when unset), and only in the first attempt, so that
a restarted group runs on. $DIE_SIGNAL names another signal (SIGINT: a Ctrl-C), and DIE_TARGET=parent sends it
to the parent process instead (torchrun's agent, which a terminal's Ctrl-C reaches: its workers run in sessions of
their own); the process then runs on. FUNCTION must be looked up in its module when called, or imported by name after
this wrapper patched it (as `from trainer.checkpoint import save_resume` in train.py is: it runs later).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import runpy
import signal
import sys


def main(target: str, when: str, *command: str) -> None:
    module_name, name = target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    armed = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
             and os.environ.get("DIE_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"))
    key, _, value = when.rpartition("=")
    calls = 0

    @functools.wraps(original)
    def dying(*args, **kwargs):
        nonlocal calls
        result = original(*args, **kwargs)
        calls += 1
        hit = (str(inspect.signature(original).bind(*args, **kwargs).arguments[key]) == value if key else
               calls == int(value))
        if armed and hit:
            os.kill(os.getppid() if os.environ.get("DIE_TARGET") == "parent" else os.getpid(),
                    getattr(signal, os.environ.get("DIE_SIGNAL", "SIGKILL")))
        return result

    setattr(module, name, dying)
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
