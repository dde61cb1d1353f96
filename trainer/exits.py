"""How a train.py process ends: an error said once however many ranks hit it, Ctrl-C and SIGTERM turned into a stop
after the step (or, the second time, at once), and an exit whose status is the run's. No torch here: train.py answers
a config error before it imports it."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
from typing import Iterator, NoReturn

from util.exceptions import chain


def fail(message: str, first: bool) -> None:
    """Exit 1; `message` goes to stderr only where `first` (the rank that reports it), so an error that every
    rank hits prints once."""
    if first:
        print(message, file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # torchrun stops every rank once one exits: leave the first exit to the rank that prints, which may not
        # have got that far yet
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(10)
    sys.exit(1)


class Interrupted(SystemExit):
    """A stop at once by a signal (exit 130). Raised from a signal handler, it still runs the `finally` blocks
    and atomic writes' cleanup."""


def interrupted(message: str) -> NoReturn:
    """Exit at once with 130, the shell's status for Ctrl-C; `message` on rank 0 only (every rank gets the
    signal)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{message}\n".encode())  # not print(): the signal may have come while print held stdout
    raise Interrupted(130)


def _unwinding_an_interruption(error: BaseException) -> bool:
    """Whether `error` arose in the cleanup that an Interrupted ran through (torch.save's zip writer raises in
    its place)."""
    return any(isinstance(e, Interrupted) for e in chain(error))


def watch_stop_signals(requested: list[int]) -> None:
    """From now on SIGTERM and a first Ctrl-C (SIGINT) append their number to `requested`: the loop stops after
    the step and saves. A signal after a Ctrl-C exits at once: a second Ctrl-C, or the SIGTERM that torchrun's
    agent sends its workers when Ctrl-C interrupts its own wait for them (it forwards the first as SIGINT)."""
    def on_signal(signum: int, _frame) -> None:
        if signal.SIGINT in requested:
            interrupted("train.py: interrupted again: stopped at once, without saving (the last save stays, and "
                        "the same command resumes from it)")
        requested.append(signum)
        if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
            os.write(2, b"train.py: Ctrl-C: stopping after this step to save the run (Ctrl-C again stops at once, "
                        b"without saving)\n")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)



def ignore_stop_signals() -> None:
    """From now on SIGINT and SIGTERM do nothing: the run is saved and summarised, and the process is only ending
    (a Ctrl-C then would otherwise say that it stops to save the run, and end a finished run with 130)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)

def report(kind: str, error: Exception | str) -> None:
    """fail() with "train.py: <kind>: <error>", printed by the first rank to report an error of that kind: after
    the early parse an error may be one rank's own, or every rank's in its own words (each rank reads other
    windows of the data, and may find another bad token first)."""
    from trainer.distributed import first_to_report  # torch: by now train.py has imported it

    fail(f"train.py: {kind}: {error}", first_to_report(kind))


@contextlib.contextmanager
def exiting_without_teardown() -> Iterator[None]:
    """Around a process's whole work: when it ends, normally or by sys.exit, flush stdout and stderr, run the
    atexit functions (wandb's, logging's) and end the process with its status at once, skipping the interpreter's
    finalization and C++'s static destructors. There, after a finished run, torch's gloo threads occasionally
    met a half-destroyed runtime: "terminate called without an active exception", SIGABRT, a run that had
    printed "done" exiting 134; so did a rank whose collective failed when its peer died. An uncaught error ends
    the same way, with Python's own traceback and status 1; a KeyboardInterrupt or the like propagates as usual,
    and an error that arose while an Interrupted unwound ends with the interruption's 130 alone. Under `python -i`
    nothing changes: Python's prompt follows, with the error for a post-mortem (pdb.pm())."""
    if sys.flags.interactive:
        yield
        return
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:
        if _unwinding_an_interruption(e):
            status = 130  # the interruption's status and its one line, without the cleanup's traceback
        elif isinstance(e, Exception):
            tb = e.__traceback__
            if tb is not None and tb.tb_frame is sys._getframe():  # from the raise down: not this `yield`
                tb = e.__traceback__ = tb.tb_next
            try:
                sys.excepthook(type(e), e, tb)  # wandb's hook marks its run failed
            except BaseException:  # noqa: BLE001 - a hook that fails: Python's own, as the interpreter falls back
                with contextlib.suppress(BaseException):
                    sys.__excepthook__(type(e), e, tb)
            status = 1
        else:
            raise
    else:
        status = 0
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(status)
