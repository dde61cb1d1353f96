"""Shared by test_faults, test_bad_input and test_security: tiny real shards and train.py's command line."""
from __future__ import annotations

from pathlib import Path

from tests.helpers import ROOT, make_shards

VOCAB = 257  # the bytes tokenizer's size: the tiny model trains on random ids below it
TRAIN = str(ROOT / "train.py")


def tiny_data(folder: Path, train_sizes: tuple[int, ...] = (20000, 20000), val_tokens: int = 3000) -> Path:
    """Train and val shards of random ids < VOCAB, without meta.json (so the loader checks every id)."""
    make_shards(folder, list(train_sizes), vocab=VOCAB)
    make_shards(folder, [val_tokens], vocab=VOCAB, pattern="test_val_{:06d}.bin")
    return folder


def train_args(data: Path, runs: Path, run_id: str, *extra: str) -> list[str]:
    """train.py with configs/tiny.toml on `data`, logging to runs/run_id; `extra` overrides come last."""
    return [TRAIN, "--config", "configs/tiny.toml", f"--model.vocab_size={VOCAB}", f"--data.train={data}/*_train_*.bin",
            f"--data.val={data}/*_val_*.bin", "--eval.tokens=2048", f"--log.dir={runs}", f"--log.run_id={run_id}",
            *extra]
