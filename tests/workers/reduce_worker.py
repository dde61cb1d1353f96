"""torchrun worker for tests/trainer/test_reduce_dtype.py: the gradients DDP and FSDP2 sync under each
train.reduce_dtype, on gloo, beside every rank's own fp32 gradients of each micro-step; those both sync in fp32
when optim.bf16_storage adds up the bf16-stored weights' gradients in bf16; and DDP's under reduce_dtype = "storage",
in one bucket for all and in a bucket for each parameter.

usage: torchrun --nproc_per_node=W tests/workers/reduce_worker.py OUT.pt
Rank 0 saves {"synced": {(case, reduce_dtype, "bf16_storage" or "storage_each"): full synced gradients}, "local":
{case: [each rank's [each micro-step's fp32 gradients]]}, "stored": the names of the bf16-stored weights,
"nan_norm": the DDP bf16 gradient norm when one rank's loss is nan, "buckets": {"storage" or "storage_each": the
kinds of bucket the hook met, each the sorted set of whether its parameters cross in bf16}, "sent": {the same
variants: the bytes the hook's all-reduces sent}}. DDP takes two micro-steps (the first under no_sync), FSDP2 one
(train.reduce_dtype = "bfloat16" refuses its accumulation).
"""
from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from model import get_model
from optim.bf16_storage import add_in_bf16, stored_in_bf16
from tests.helpers import save_on_rank_0
from tests.workers.step_worker import GPT_CONFIG
from trainer import distributed
from trainer.config import TrainConfig
from trainer.distributed import Dist
from trainer.exits import exiting_without_teardown
from trainer import parallel
from trainer.parallel import ParallelModel, parallelize

MICRO_STEPS = {"ddp": 2, "fsdp": 1}
ROWS = 2  # sequences per micro-step per rank
BUCKETS: list[tuple[bool, ...]] = []  # each bucket the hook of reduce_dtype = "storage" met
by_dtype = parallel._all_reduce_by_dtype


def recorded(bf16_wire, bucket):
    """parallel's hook, noting first which parameters share the bucket (parallelize looks it up at its call)."""
    BUCKETS.append(tuple(sorted({id(p) in bf16_wire for p in bucket.parameters()})))
    return by_dtype(bf16_wire, bucket)


parallel._all_reduce_by_dtype = recorded
SENT: list[int] = []  # the bytes of each all-reduce the hook starts
all_reduce = torch.distributed.all_reduce


def counted(tensor: torch.Tensor, *args, **kwargs):
    """torch.distributed.all_reduce, noting first the bytes it sends (parallel looks it up at each call)."""
    SENT.append(tensor.numel() * tensor.element_size())
    return all_reduce(tensor, *args, **kwargs)


torch.distributed.all_reduce = counted


def micro_batches(rank: int, micro_steps: int) -> list[torch.Tensor]:
    """`rank`'s micro-batches of a fixed batch of token rows (inputs and targets in one [ROWS, 17] tensor each)."""
    world = torch.distributed.get_world_size()
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (world * micro_steps * ROWS, 17),
                        generator=torch.Generator().manual_seed(1))
    return list(idx.chunk(world)[rank].chunk(micro_steps))


def full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as the whole tensor: FSDP2's DTensor shard gathered, DDP's as it is."""
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def synced(case: str, reduce_dtype: str, dist: Dist, poison: bool = False, bf16_sums: bool = False,
           bucket_each: bool = False) -> tuple[dict, torch.Tensor]:
    """(the gradients after one step's micro-steps and their sync, their norm from clip_grads) under `case`
    (ddp or fsdp) and `reduce_dtype`; with `poison`, rank 1's loss is nan; with `bf16_sums`, the bf16-stored
    weights' gradients add up as under optim.bf16_storage; with `bucket_each`, DDP's buckets hold one parameter
    each (reduce_dtype = "storage")."""
    torch.manual_seed(0)
    gpt = get_model(GPT_CONFIG)
    if bucket_each:  # a cap below any parameter's bytes: each closes its bucket
        ddp = DDP(gpt, bucket_cap_mb=1e-6, gradient_as_bucket_view=True)
        ddp.register_comm_hook(frozenset(map(id, stored_in_bf16(gpt))), parallel._all_reduce_by_dtype)
        model = ParallelModel(gpt, ddp, sharded=False, master=dist.master)
        # DDP starts with every parameter in one bucket and cuts them by the cap after its first synced backward
        idx = micro_batches(dist.rank, 1)[0]
        model(idx[:, :-1], idx[:, 1:])[1].backward()
        gpt.zero_grad(set_to_none=True)
        BUCKETS.clear()
        SENT.clear()
    else:
        model = parallelize(gpt, TrainConfig(parallel=case, reduce_dtype=reduce_dtype), dist)
    for weight in stored_in_bf16(gpt) if bf16_sums else []:  # after FSDP2, whose shards are new parameters
        add_in_bf16(weight)
    gpt.set_progress(0.0)
    batches = micro_batches(dist.rank, MICRO_STEPS[case])
    for micro, idx in enumerate(batches):
        with model.grad_sync(micro == len(batches) - 1):
            loss = model(idx[:, :-1], idx[:, 1:])[1] / len(batches)
            (loss * float("nan") if poison and dist.rank == 1 else loss).backward()
    norm = model.clip_grads(0.0)
    return {name.removeprefix("module."): full(p.grad) for name, p in model.wrapped.named_parameters()}, norm


def local(case: str, rank: int) -> list[dict[str, torch.Tensor]]:
    """The fp32 gradients of each of `rank`'s micro-steps of `case`, by the plain model in this process."""
    torch.manual_seed(0)
    model = get_model(GPT_CONFIG)
    model.set_progress(0.0)
    batches, grads = micro_batches(rank, MICRO_STEPS[case]), []
    for idx in batches:
        model.zero_grad(set_to_none=True)
        (model(idx[:, :-1], idx[:, 1:])[1] / len(batches)).backward()
        grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
    return grads


def main(out: str) -> None:
    dist = distributed.init(60)
    results: dict = {"synced": {}, "local": {}}
    for case in MICRO_STEPS:
        results["local"][case] = [local(case, r) for r in range(dist.world_size)]
        for reduce_dtype in ("float32", "bfloat16"):
            results["synced"][case, reduce_dtype] = synced(case, reduce_dtype, dist)[0]
    for case in MICRO_STEPS:
        results["synced"][case, "bf16_storage"] = synced(case, "float32", dist, bf16_sums=True)[0]
    results["buckets"], results["sent"] = {}, {}
    for variant, bucket_each in (("storage", False), ("storage_each", True)):
        BUCKETS.clear()
        SENT.clear()
        results["synced"]["ddp", variant] = synced("ddp", "storage", dist, bf16_sums=True, bucket_each=bucket_each)[0]
        results["buckets"][variant], results["sent"][variant] = sorted(set(BUCKETS)), sum(SENT)
    model = get_model(GPT_CONFIG)
    stored = set(stored_in_bf16(model))
    results["stored"] = [name for name, p in model.named_parameters() if p in stored]
    results["nan_norm"] = synced("ddp", "bfloat16", dist, poison=True)[1].item()
    save_on_rank_0(results, out, dist.rank)
    distributed.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
