"""torchrun worker for tests/trainer/test_distributed.py: trainer/distributed.py's collectives and error reporting
across real gloo ranks.

usage: torchrun --nproc_per_node=W tests/workers/collective_worker.py OUT.pt
Rank 0 saves a list with each rank's dict of results (the keys of `results`); the test says what each should be.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as tdist

from tests.helpers import save_on_rank_0
from trainer import distributed
from trainer.distributed import Dist, LateMax
from trainer.exits import exiting_without_teardown


def late(dist: Dist) -> list:
    """collect() after each start(): rank 0 raises the device flag at call 1, the last rank a host flag at call 2."""
    flags, got = LateMax(2, 1, dist.device), []
    for call in range(4):
        got.append(flags.collect())
        on_device = torch.tensor([float(call == 1 and dist.rank == 0)], dtype=torch.float64)
        flags.start([float(10 * dist.rank + call), float(call == 2 and dist.rank == dist.world_size - 1)], on_device)
    return got + [flags.collect(), flags.collect()]


def results(dist: Dist, reported_before: bool) -> dict:
    """This rank's view of each collective, its values chosen to differ by rank."""
    r = dist.rank
    return {
        "sum": distributed.all_reduce(torch.tensor([r + 1.0, 2.0])).tolist(),
        "max": distributed.all_reduce(torch.tensor([float(r), -float(r)]), "max").tolist(),
        "max_over_ranks": distributed.max_over_ranks([float(r), 5.0 - r, 0.5], dist.device),
        "any_rank": distributed.any_rank([r == 0, r == dist.world_size - 1, False], dist.device),
        "broadcast": distributed.broadcast({"from": r}),
        "late": late(dist),
        # the same error on every rank, then this rank's own error, then the first one again
        "report": [reported_before, distributed.first_to_report("loss is nan"),
                   distributed.first_to_report(f"rank {r} lost its data"), distributed.first_to_report("loss is nan")],
    }


def main(out: str) -> None:
    reported_before = distributed.first_to_report("loss is nan")  # before the group: only rank 0 says it
    dist = distributed.init(60)
    every = [None] * dist.world_size
    tdist.all_gather_object(every, results(dist, reported_before))
    distributed.barrier()
    save_on_rank_0(every, out, dist.rank)
    distributed.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
