"""Helpers shared by the tests: token files on disk and real multi-process runs."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from data.shards import write_shard

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_shards(folder: Path, sizes: list[int], *, vocab: int = 50257, seed: int = 0,
                header: bool = True, pattern: str = "test_train_{:06d}.bin", start: int = 0) -> list[Path]:
    """Write one shard of random ids per entry of `sizes`; return their paths in order."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, n in enumerate(sizes):
        p = Path(folder) / pattern.format(i + start)
        write_shard(p, rng.integers(0, vocab, size=n), dtype=np.uint16 if vocab <= 65536 else np.uint32,
                    header=header)
        paths.append(p)
    return paths


def run(cmd: list[str], *, timeout: float = 300, env: dict | None = None, cwd: Path = ROOT,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the test environment; on failure show its whole output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def torchrun(args: list[str], *, nproc: int = 2, timeout: float = 300, env: dict | None = None,
             check: bool = True, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    """Launch `args` (a script path and its arguments) under a real standalone torchrun on CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *(extra or []), *map(str, args)]
    return run(cmd, timeout=timeout, env=env, check=check)
