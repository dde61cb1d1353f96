"""torchrun worker: each rank iterates its TokenLoaders and val_batches and saves what it got.

usage: torchrun --nproc_per_node=W tests/workers/loader_worker.py GLOB OUT_DIR STEPS BATCH SEQ_LEN
Writes OUT_DIR/rank{r}.npz with `train` (the shuffled stream), `sequential` (shuffle=False) and `resumed`
(the shuffled stream from a state saved after STEPS // 2 steps and loaded as train.py does), each
[steps, 2, B, T], and `val` [2, rows, T]; the test checks the union.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data.loader import TokenLoader
from data.val import val_batches
from trainer.exits import exiting_without_teardown
from util.atomic import atomic_path


def main(pattern: str, out: str, steps: int, batch: int, seq_len: int) -> None:
    """Run this rank's share and save it."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def loader(**kwargs) -> TokenLoader:
        return TokenLoader(pattern, batch, seq_len, rank=rank, world_size=world, seed=5, **kwargs)

    def take(it: TokenLoader, n: int) -> list[np.ndarray]:
        return [torch.stack(next(it)).numpy() for _ in range(n)]

    with loader() as shuffled, loader(shuffle=False) as sequential:
        train, seq = take(shuffled, steps), take(sequential, steps)
    state = Path(out) / f"state{rank}.pt"
    with loader() as first:
        take(first, steps // 2)
        with atomic_path(state) as tmp:
            torch.save(first.state_dict(), tmp)
    with loader() as again:
        again.load_state_dict(torch.load(state, weights_only=True))
        resumed = take(again, steps - steps // 2)
    val = [torch.stack(b).numpy() for b in val_batches(pattern, batch, seq_len, 40 * (seq_len + 1),
                                                      rank=rank, world_size=world)]
    counts = torch.tensor([len(val)])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    assert counts.item() == len(val), "every rank must yield the same number of val batches"
    with atomic_path(Path(out) / f"rank{rank}.npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, train=np.stack(train), sequential=np.stack(seq), resumed=np.stack(resumed),
                 val=np.concatenate(val, axis=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]))
