"""A writer that dies mid-write, for tests/e2e/test_faults.py.

usage: python tests/workers/fault_writer.py checkpoint PATH    # save_checkpoint, dying between the write and the rename
       python tests/workers/fault_writer.py shard PATH TOKENS  # write_shard of TOKENS ids, killed by the kernel mid-write
"""
from __future__ import annotations

import os
import resource
import signal
import sys

import numpy as np
import torch

from data.shards import write_shard
from model import get_model
from trainer.checkpoint import save_checkpoint

CONFIG = {"model": {"vocab_size": 257, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 16}}
DIED_AT_RENAME = 3
FILE_LIMIT = 1 << 20  # bytes: the kernel kills the shard writer when a write would pass this


def die(*_args, **_kwargs) -> None:
    """Stand-in for os.replace: the process is gone before the new file takes the old one's name."""
    os._exit(DIED_AT_RENAME)


def main(mode: str, path: str, *rest: str) -> None:
    """Write one file the way the project does, and die before it is complete."""
    if mode == "checkpoint":
        torch.manual_seed(1)  # other weights than the good checkpoint the test wrote with seed 0
        model = get_model(CONFIG)
        os.replace = die
        save_checkpoint(path, CONFIG, model.state_dict(), step=99)
    else:
        # a kill sent from outside can come after a fast disk finished the write; a file-size limit stops it
        # at a known byte on any machine. Python ignores SIGXFSZ, so restore its default action: death.
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        write_shard(path, np.arange(int(rest[0]), dtype=np.uint16) % 50000)


if __name__ == "__main__":
    main(*sys.argv[1:])
