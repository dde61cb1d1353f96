"""torchrun worker: train.py's run whose rank 1 starts its warm-up SLOW_S seconds late, as a rank still compiling
its first graphs does while the others wait for it in the first collective.

usage: torchrun --nproc_per_node=2 tests/workers/slow_rank_worker.py SLOW_S TRAIN.PY ARGS...
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import train
from trainer.config import parse_args
from trainer.exits import exiting_without_teardown
from trainer.state import Hooks, Run


class SlowRank(Hooks):
    """Rank 1 sleeps before its warm-up."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def warm_up(self, stage: Callable[[Run], None], run: Run) -> None:
        if run.dist.rank == 1:
            time.sleep(self.seconds)
        stage(run)


if __name__ == "__main__":
    with exiting_without_teardown():
        train.main(parse_args(sys.argv[2:]), hooks=SlowRank(float(sys.argv[1])))
