"""What a run folder says about its run, read without torch: whether a launch continues it (run.sh asks before
it launches train.py) and where it saved its checkpoint.

A run whose last resume state is where it ended (its summary.json says so) is finished: relaunching it does
nothing, unless its budget is extended. A run stopped by a signal, or killed, is unfinished: a resume continues it.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from trainer.config import Config, resume_changes

# What a run folder holds of its run: what train.resume = "overwrite" replaces and "never" refuses to
RUN_FILES = ("resume", "checkpoint.pt", "metrics.jsonl", "summary.json", "log.txt", "config.toml", "loss.png")
# summary.json's statuses (train.py's StopReason) of a run stopped by a signal: saved to be continued
STOPPED_BY_SIGNAL = ("sigterm", "interrupted")


def done_path(run_dir: Path) -> Path:
    """The marker of the run's last complete resume state (resume/done.json), beside the step folders."""
    return run_dir / "resume" / "done.json"


def checkpoint_path(run_dir: Path, configured: str) -> Path:
    """Where the run in `run_dir` saves checkpoint.pt: train.checkpoint_path (`configured`), else the run folder."""
    return Path(configured or run_dir / "checkpoint.pt")


def saved_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config the run in `run_dir` wrote (its config.toml), {} before it wrote one. OSError or
    ValueError where the file is unreadable."""
    config = run_dir / "config.toml"
    return tomllib.loads(config.read_text()) if config.is_file() else {}


def saved_checkpoint(run_dir: Path) -> Path:
    """Where the run in `run_dir` saved its checkpoint: summary.json's checkpoint_path, but the folder's own
    checkpoint.pt where the run saved into its run folder (wherever that stood: it has been moved or copied since);
    for a run that has not finished, where its config.toml (if written yet) says it saves. OSError or ValueError
    where a file is unreadable."""
    summary = run_dir / "summary.json"
    recorded = json.loads(summary.read_text()).get("checkpoint_path") if summary.is_file() else None
    if recorded:
        own = checkpoint_path(run_dir, "")
        return own if Path(recorded).parts[-2:] == own.parts[-2:] and own.is_file() else Path(recorded)
    return checkpoint_path(run_dir, saved_config(run_dir).get("train", {}).get("checkpoint_path", ""))


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """done.json of `run_dir` with its "config" (None if there is none), and "finished": the run's summary.json
    if that state is where the run ended, else None."""
    done = done_path(run_dir)
    if not done.exists():
        return None
    marker = json.loads(done.read_text())
    marker["finished"] = ended_summary(run_dir, marker["step"])
    return marker


def ended_summary(run_dir: Path, step: int | None = None) -> dict[str, Any] | None:
    """summary.json of `run_dir` where it says the run ended (not stopped by a signal), at `step` if given (a
    summary of an earlier stretch, a crash after a resume saved later steps, is not that state's end)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else None
    ended = summary and summary["status"] not in STOPPED_BY_SIGNAL and step in (None, summary["steps"])
    return summary if ended else None


def unfinished_run(log_dir: Path, pattern: str, cfg: Config, world_size: int) -> tuple[Path, int, list[str]] | None:
    """The newest run folder under `log_dir` matching `pattern` whose run is unfinished (stopped by a signal, or
    killed): (folder, saved step, the settings in which `cfg` at `world_size` differs from it: [] = it resumes
    that run); None if there is none."""
    def saved_at(run_dir: Path) -> float:
        return done_path(run_dir).stat().st_mtime if done_path(run_dir).exists() else 0.0

    for run_dir in sorted(log_dir.glob(pattern), key=saved_at, reverse=True):
        marker = read_marker(run_dir)
        if marker is None or marker["finished"]:
            continue
        # model.vocab_size = 0 is meta.json's value, which train.py reads (and compares) at its setup
        differ = [str(change) for change in resume_changes(marker["config"], cfg)[1]
                  if (change.key, change.now) != ("model.vocab_size", 0)]
        if marker["world_size"] != world_size:
            differ.append(f"processes: saved {marker['world_size']}, now {world_size}")
        return run_dir, marker["step"], differ
    return None
