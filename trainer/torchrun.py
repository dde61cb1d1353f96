"""torchrun as run.sh launches it: the workers' output reaches the console untouched, torchrun's own goes to a file.

    python -m trainer.torchrun [TORCHRUN OPTIONS] train.py [TRAIN.PY ARGS]

A failed run then leaves the user train.py's one message instead of it followed by torchrun's log lines and its
~30-line ChildFailedError report (and a stopped one without its SignalException traceback, or the exceptions Python
can only print as "Exception ignored in", which a stopping agent sometimes meets). That text goes to
<log.dir>/<run_id>/torchrun.log once train.py has made the run folder, else to a temporary file. A rank that died
without a word (killed by a signal: -9 from the OOM killer) gets one line naming it and the file. The exit status is
torchrun's: 0, or 1 for a failed or stopped run (0 for a run that had finished when a signal stopped torchrun).
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from argparse import Namespace
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainer.runs import STOPPED_BY_SIGNAL


def main(argv: list[str]) -> int:
    """Run torchrun with `argv` (its own command line), keep its text in a file; its exit status."""
    args = torchrun.parse_args(argv)
    text = io.StringIO()
    handler = logging.StreamHandler(text)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # torch gives "torch" and several of its loggers (torch.distributed, .rendezvous, ...) each a stderr handler
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger, logging.Logger) and logger.handlers:
            logger.handlers = [handler]
    keep_unraisable(text)
    interrupts = note_interrupts()
    status, note, started = 0, "", time.time()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        status = 1
        text.write(traceback.format_exc())
        # a rank killed by a signal printed nothing (train.py's own errors exit 1 after saying why): name it, also
        # where a rank that lost it as a peer failed in the same moment; not the ranks torchrun itself then stopped
        killed = [(rank, failure) for rank, failure in sorted(e.failures.items())
                  if failure.exitcode < 0 and failure.signal_name() != "SIGTERM"]
        rank, failure = killed[0] if killed else e.get_first_failure()
        if failure.exitcode < 0:
            oom = " (out of memory? see trainer/memory.py)" if failure.signal_name() == "SIGKILL" else ""
            note = f"rank {rank} was killed by {failure.signal_name()}{oom}"
    except SignalException:  # torchrun was stopped and passed the signal on: the ranks say what they did
        # a signal that came after the run had finished (a Ctrl-C as it ended) stopped no training; a Ctrl-C
        # before, in its final eval, stops the caller as any Ctrl-C does (train.py exits 130 there)
        status = 0 if finished_since(args, started, interrupts[0] if interrupts else math.inf) else 1
        text.write(traceback.format_exc())
    finally:
        path = keep(text.getvalue(), args, argv, named=bool(note))
    if note:
        print(f"torchrun: {note}; torchrun's report: {path}", file=sys.stderr, flush=True)
    return status


def note_interrupts() -> list[float]:
    """From now on the time of each Ctrl-C (SIGINT) this process gets, whatever handler torchrun installs for it:
    Python writes each signal's number to its wakeup fd before any handler runs."""
    times: list[float] = []
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while True:
            times.extend(time.time() for signum in os.read(read, 64) if signum == signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    return times


def keep_unraisable(text: io.StringIO) -> None:
    """From now on an exception Python cannot raise (in a finalizer, a __del__) is written to `text`, not stderr.
    Seen: Ctrl-C stops the agent, and its rendezvous keep-alive timer, collected in its own thread, joins itself
    ("cannot join current thread"; torch's _PeriodicTimer)."""
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        text.write(f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n")
        text.write("".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                      unraisable.exc_traceback)))
    sys.unraisablehook = hook


def keep(text: str, args: Namespace, argv: list[str], named: bool) -> Path | None:
    """Append torchrun's `text` to the run folder's torchrun.log; its path. Without a run folder, a temporary file
    where the line that names a killed rank will name it (`named`), else none: the ranks said what went wrong
    (a refused config), and a file nobody is told of would be left in /tmp at each launch."""
    folder = run_folder(args)
    entry = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} torchrun {' '.join(argv)}\n{text}"
    if folder is None:
        if not named:
            return None
        with tempfile.NamedTemporaryFile("w", prefix="shardrun-torchrun-", suffix=".log", delete=False) as f:
            f.write(entry)
        return Path(f.name)
    path = folder / "torchrun.log"
    with path.open("a") as f:  # a log, appended to by each launch of the run (a resume too)
        f.write(entry)
    return path


def finished_since(args: Namespace, started: float, before: float) -> bool:
    """True when train.py under torchrun's `args` wrote a finished run's summary.json after `started` and before
    `before` (time.time()'s)."""
    folder = run_folder(args)
    summary = folder / "summary.json" if folder else None
    if summary is None or not summary.is_file() or not started <= summary.stat().st_mtime < before:
        return False
    return json.loads(summary.read_text())["status"] not in STOPPED_BY_SIGNAL


def run_folder(args: Namespace) -> Path | None:
    """The run folder train.py made under torchrun's `args`, or None (another script, a refused config)."""
    if Path(args.training_script).name != "train.py":
        return None
    from trainer.config import ConfigError, parse_args

    try:
        cfg = parse_args(args.training_script_args)
    except (ConfigError, SystemExit):
        return None
    # train.py's default_run_id: torchrun's rendezvous id, which --standalone drew ("none": none was given)
    run_id = cfg.log.run_id or (f"{cfg.name}-{args.rdzv_id}" if args.rdzv_id != "none" else "")
    folder = Path(cfg.log.dir) / run_id
    return folder if run_id and folder.is_dir() else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
