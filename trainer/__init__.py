"""The trainer's helpers: config, distributed setup, parallelism, clock, checkpoints, metrics (see train.py)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: configs/, records/ and the git tree
