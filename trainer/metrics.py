"""What a run leaves behind: runs/<run_id>/ with log.txt, metrics.jsonl, summary.json, and wandb if asked.

Only rank 0 writes. log.txt and metrics.jsonl are append-only streams (one line per event, flushed);
a resumed run first cuts metrics.jsonl back to its length at the saved state, so no step appears twice
(a fresh run cuts it to nothing; a finished run trained on keeps its final eval, which done.json records).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from trainer import ROOT
from trainer.config import Config, ConfigError, to_toml
from trainer.distributed import Dist
from trainer.mfu import peak_flops
from util.atomic import reporting_full_disk, write_json, write_text
from util.optional import import_optional


@dataclass
class Summary:
    """summary.json: a run's result, these keys (null: not measured, or not applicable to the run). The
    leaderboard (scripts/leaderboard.py), records/ and the GPU check read them: keep the names."""
    run_id: str
    config_name: str
    track: str
    status: str                      # why the loop stopped: train.py's StopReason
    final_val_loss: float | None
    best_val_loss: float | None
    final_val_bpb: float | None      # bits per byte of text, where meta.json tells the bytes per token
    target_loss: float | None
    time_to_target_s: float | None
    steps: int
    tokens_seen: int
    tokens_per_s: float | None
    train_time_s: float
    budget_s: float | None
    mfu: float | None                # of the whole run: each step's FLOPs at its own attention window
    peak_mem_gb: float
    data_wait_frac: float | None
    world_size: int
    hardware: str
    torch_version: str
    git_commit: str | None
    checkpoint_path: str             # where checkpoint.pt went: train.checkpoint_path, else in the run folder
    wall: dict[str, float]           # seconds by phase: init, warmup, train, eval, checkpoint
    resume_changes: list[dict]       # each key a resume changed: {"step", "key", "saved", "now"}, in order


def hardware(dist: Dist) -> str:
    """A short description of the devices the run uses."""
    if dist.cuda:
        return f"{dist.world_size} x {torch.cuda.get_device_name(dist.device)}"
    return f"{dist.world_size} x CPU process ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def peak_mem_gb(dist: Dist) -> float:
    """Peak memory of this rank: allocated GPU memory, or the process's max RSS on CPU."""
    if dist.cuda:
        return torch.cuda.max_memory_allocated(dist.device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def git_commit() -> str | None:
    """The repository's HEAD commit (with '+dirty' for local changes), or None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def _append(file: TextIO, line: str) -> None:
    """Write `line` to `file` and flush it; a full disk raises DiskFullError naming the file."""
    with reporting_full_disk(file.name, len(line.encode())):
        file.write(line)
        file.flush()


class RunLog:
    """Rank 0's console + log.txt + metrics.jsonl (+ wandb); every method is a no-op on other ranks."""

    def __init__(self, run_dir: Path, dist: Dist, *, metrics_bytes: int = 0, wandb_cfg: dict | None = None):
        self.run_dir, self.master = run_dir, dist.master
        self.wandb = None
        if not self.master:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            os.truncate(metrics, min(metrics_bytes, metrics.stat().st_size))  # never pad a shorter file
        self.log_file = open(run_dir / "log.txt", "a")
        self.metrics_file = open(metrics, "a")
        if wandb_cfg is not None:
            wandb = import_optional("wandb", "log.wandb = true", ConfigError)
            self.wandb = wandb.init(**wandb_cfg)

    def print(self, msg: str) -> None:
        """Print on rank 0 and append to log.txt."""
        if self.master:
            print(msg, flush=True)
            _append(self.log_file, msg + "\n")

    def metric(self, record: dict[str, Any]) -> None:
        """Append one JSON line to metrics.jsonl (and log it to wandb)."""
        if self.master:
            _append(self.metrics_file, json.dumps(record) + "\n")
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def metrics_bytes(self) -> int:
        """Current length of metrics.jsonl (saved with the resume state)."""
        return self.metrics_file.tell() if self.master else 0

    def environment(self, dist: Dist) -> None:
        """Record versions, hardware, code version and command line at the top of the run's log."""
        cuda = f"CUDA {torch.version.cuda}" if torch.cuda.is_available() else "no CUDA"
        self.print(f"python {sys.version.split()[0]} | torch {torch.__version__} | {cuda} | {platform.platform()}")
        self.print(f"hardware: {hardware(dist)} | git commit: {git_commit()}")
        self.print("command: " + " ".join(sys.argv))
        if peak_flops(dist):
            self.print(f"MFU assumes {peak_flops(dist) / 1e12:.0f} TFLOP/s dense bf16 peak per GPU")

    def summary(self, summary: Summary) -> None:
        """Write summary.json."""
        if self.master:
            write_json(self.run_dir / "summary.json", asdict(summary))

    def close(self) -> None:
        """Flush and close the files (and finish wandb)."""
        if self.master:
            self.log_file.close()
            self.metrics_file.close()
            if self.wandb is not None:
                self.wandb.finish()


def open_log(cfg: Config, dist: Dist, run_dir: Path, metrics_bytes: int) -> RunLog:
    """The run's RunLog (metrics.jsonl cut to `metrics_bytes`, wandb if asked), its config.toml written, and the
    log's first lines: the environment, which starter flags were applied and the budget's plan."""
    config = cfg.to_dict()
    wandb_cfg = dict(project=cfg.log.wandb_project, name=cfg.log.wandb_run or cfg.log.run_id, config=config,
                     dir=str(run_dir)) if cfg.log.wandb else None
    log = RunLog(run_dir, dist, metrics_bytes=metrics_bytes, wandb_cfg=wandb_cfg)
    if dist.master:
        write_text(run_dir / "config.toml", to_toml(config))
    log.environment(dist)
    for line in (cfg.starter, cfg.plan):
        if line:
            log.print(line)
    return log
