"""The trainer's helpers: config, distributed setup, parallelism, clock, checkpoints, metrics (see train.py)."""
