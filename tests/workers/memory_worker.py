"""One process: two real training steps of a config, then print its peak RSS growth and the estimate as JSON.

usage: python tests/workers/memory_worker.py --config configs/X.toml [--section.key=value ...]
The growth is VmHWM (peak resident memory) minus the resident memory before the model was built, after a tiny
copy of the model has run its first steps.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from model import get_model
from optim.groups import build_optimizers
from trainer.config import Config, parse_args
from trainer.memory import estimate


def status_bytes(key: str) -> int:
    """A `key: N kB` line of /proc/self/status, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


TINY = ["--model.n_layer=2", "--model.n_embd=32", "--model.n_head=1", "--model.vocab_size=64", "--model.bigram_dim=0",
        "--model.block_size=16", "--train.seq_len=16"]


def steps(cfg: Config, batch_size: int) -> None:
    """Two training steps of cfg's model at `batch_size` (the second with the optimizer state in place)."""
    model = get_model(cfg.to_dict())
    optimizers = build_optimizers(model, cfg.optim)
    shape, vocab = (batch_size, cfg.train.seq_len), cfg.model.vocab_size
    for _ in range(2):
        _, loss = model(torch.randint(0, vocab, shape), torch.randint(0, vocab, shape))
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = parse_args(["--data.train=unused", *argv])
    # The first steps of a process page in the kernels' code and set up their libraries: tens of MB that are no
    # part of a step's memory, which the estimate counts. A copy of the model too small to leave freed memory
    # worth reusing runs them first.
    steps(parse_args(["--data.train=unused", *argv, *TINY]), 1)
    before = status_bytes("VmRSS")
    steps(cfg, cfg.train.batch_size)
    print(json.dumps({"measured": status_bytes("VmHWM") - before, "estimate": sum(estimate(cfg, 1, False).values())}))


if __name__ == "__main__":
    main(sys.argv[1:])
