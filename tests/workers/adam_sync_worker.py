"""torchrun worker for tests/trainer/test_adam_sync.py: train.adam_sync = "adam_steps" under DDP on gloo, two steps
of optim.adam_every = 2 with each train.reduce_dtype ("storage": the bf16-stored tables in bf16, the rest in fp32).

usage: torchrun --nproc_per_node=2 tests/workers/adam_sync_worker.py OUT.pt
Rank 0 saves, per reduce_dtype, every rank's gradients: "local" (each backward in a plain model: what the rank
adds up), "held" (after the first step's backward, which AdamW does not take), "muon" (the Muon matrices' after the
second backward, which DDP synced), "synced" (AdamW's after the second step's sync_apart), "apart" (the names
of AdamW's parameters) and "marked" (whether each is marked for torch.compile's DDPOptimizer to leave out); and
"stored", the names of the bf16-stored weights.
"""
from __future__ import annotations

import sys

import torch

from model import get_model
from optim.bf16_storage import stored_in_bf16
from optim.config import OptimConfig
from optim.groups import adamw_params
from tests.helpers import save_on_rank_0
from tests.workers.step_worker import GPT_CONFIG
from trainer import distributed
from trainer.config import TrainConfig
from trainer.distributed import Dist
from trainer.exits import exiting_without_teardown
from trainer import parallel
from trainer.parallel import parallelize

OPTIM = OptimConfig(name="muon", adam_every=2)
# with the GPT's own parameters (the skip's and the backout's scalars), which DDP names apart from the blocks'
CONFIG = {**GPT_CONFIG, "skip_connection": [0, 1], "backout": 1}
parallel.COALESCE = 1000  # the table (97 x 24) crosses in place, the norms and scalars in one buffer


def batch(rank: int, step: int) -> torch.Tensor:
    """`rank`'s rows (inputs and targets in one [2, 17] tensor) of step `step`'s fixed batch."""
    world = torch.distributed.get_world_size()
    idx = torch.randint(0, CONFIG["vocab_size"], (world * 2, 17), generator=torch.Generator().manual_seed(step))
    return idx.chunk(world)[rank]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def local(rank: int) -> list[dict[str, torch.Tensor]]:
    """The gradients of each step's backward on `rank`'s rows, by a plain model in this process."""
    torch.manual_seed(0)
    model = get_model(CONFIG)
    model.set_progress(0.0)
    out = []
    for step in range(2):
        idx = batch(rank, step)
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        out.append(grads(model))
        model.zero_grad(set_to_none=True)
    return out


def two_steps(reduce_dtype: str, dist: Dist) -> dict:
    """Two backwards of the same weights under DDP with AdamW's parameters apart: the gradients after each."""
    torch.manual_seed(0)
    gpt = get_model(CONFIG)
    gpt.set_progress(0.0)
    apart = adamw_params(gpt, OPTIM)
    model = parallelize(gpt, TrainConfig(adam_sync="adam_steps", reduce_dtype=reduce_dtype), dist, apart=apart)
    names = {name for name, p in gpt.named_parameters() if any(p is q for q in apart)}
    # what torch.compile's DDPOptimizer reads to leave them out of its buckets, as DDP's reducer does
    out = {"apart": sorted(names), "marked": all(getattr(p, "_ddp_ignored", False) for p in apart)}
    for step in range(2):
        idx = batch(dist.rank, step)
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        if step == 0:  # not AdamW's step: Muon's gradients are dropped, AdamW's held as this rank's own
            out["held"] = {k: v for k, v in grads(gpt).items() if k in names}
            for name, p in gpt.named_parameters():
                p.grad = p.grad if name in names else None
    out["muon"] = {k: v for k, v in grads(gpt).items() if k not in names}
    model.sync_apart()()
    out["synced"] = {k: v for k, v in grads(gpt).items() if k in names}
    return out


def main(out: str) -> None:
    dist = distributed.init(60)
    gpt = get_model(CONFIG)
    stored = set(stored_in_bf16(gpt))
    results: dict = {"local": [local(r) for r in range(dist.world_size)],
                     "stored": [name for name, p in gpt.named_parameters() if p in stored]}
    for reduce_dtype in ("float32", "bfloat16", "storage"):
        mine = two_steps(reduce_dtype, dist)
        everyone = [None] * dist.world_size
        torch.distributed.all_gather_object(everyone, mine)
        results[reduce_dtype] = everyone
    save_on_rank_0(results, out, dist.rank)
    distributed.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
