"""The GPU MODE hackathon starter's flags, which the organizers' submit.sh passes unchanged.

Any of them selects the hackathon setup: base config configs/hackathon_32gpu.toml when no --config is given
(and it exists), and the flags map as
    --data_dir D          data.train = "D/chunk_*.bin", data.format = "raw", data.val = "holdout"
    --checkpoint_path P   train.checkpoint_path = P
    --time_limit_min M    train.budget_s = 60 * M, train.schedule = "time": the LR decays on that clock
    --seq_len/--batch_size/--grad_accum_steps/--max_steps
                          honoured only where the config file does not set them: the file holds
                          the tuned recipe, the starter's is generic (configs/hackathon_32gpu.toml sets
                          max_steps = 0: 5,000 of its steps would end a fast run before its 600 s)
trainer/config.py applies the keys (its docstring gives the precedence); `report` is the line train.py prints.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import ROOT

HACKATHON_CONFIG = ROOT / "configs" / "hackathon_32gpu.toml"

# flag: (its type, the keys it sets with their values, from the flag's value)
FLAGS: dict[str, tuple[type, Callable[[Any], dict[str, Any]]]] = {
    "data_dir": (str, lambda d: {"data.train": str(Path(d) / "chunk_*.bin"), "data.format": "raw",
                                 "data.val": "holdout"}),
    "checkpoint_path": (str, lambda p: {"train.checkpoint_path": p}),
    "seq_len": (int, lambda n: {"train.seq_len": n}),
    "batch_size": (int, lambda n: {"train.batch_size": n}),
    "grad_accum_steps": (int, lambda n: {"train.grad_accum": n}),
    "max_steps": (int, lambda n: {"train.max_steps": n}),
    "time_limit_min": (float, lambda m: {"train.budget_s": 60.0 * m, "train.schedule": "time"}),
}
RECIPE = ("seq_len", "batch_size", "grad_accum_steps", "max_steps")  # below the config file; the rest above


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The starter's flags as their own group of `parser`."""
    group = parser.add_argument_group("GPU MODE hackathon starter flags (see trainer/starter.py)")
    for flag, (kind, _) in FLAGS.items():
        group.add_argument(f"--{flag}", type=kind)


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{flag: the keys it sets and their values} for each starter flag on the command line, in FLAGS order."""
    return {flag: keys(getattr(args, flag)) for flag, (_, keys) in FLAGS.items() if getattr(args, flag) is not None}


def default_config(flags: dict[str, dict[str, Any]]) -> Path | None:
    """The config a run with starter `flags` and no --config uses: the hackathon's, where it exists."""
    return HACKATHON_CONFIG if flags and HACKATHON_CONFIG.exists() else None


def report(cfg: Any, args: argparse.Namespace, flags: dict[str, dict[str, Any]], path: str | Path | None,
           from_file: set[str], from_command_line: set[str]) -> str:
    """One line: the starter flags given, each applied or overridden (and why), with the values they led to."""
    applied, by_file, by_command_line = [], [], []
    for flag, keys in flags.items():
        values = ", ".join(f"{k} = {getattr(getattr(cfg, k.split('.')[0]), k.split('.')[1])!r}" for k in keys)
        said = f"--{flag} {getattr(args, flag)} ({values})"
        if from_command_line & set(keys):
            by_command_line.append(said)
        elif flag in RECIPE and set(keys) <= from_file:
            by_file.append(said)
        else:
            applied.append(said)
    parts = [f"applied {', '.join(applied)}"] if applied else []
    if by_file:
        shown = Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path
        parts.append(f"overridden by {shown}, whose tuned recipe wins over the starter's generic one: "
                     f"{', '.join(by_file)}")
    if by_command_line:
        parts.append(f"overridden by a --section.key=value on the command line: {', '.join(by_command_line)}")
    return "hackathon starter flags: " + "; ".join(parts)
