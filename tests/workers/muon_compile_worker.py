"""torchrun worker: Muon's steps with optim.muon_compile off, then on, under DDP and then FSDP2 on gloo; rank 0
saves the final weights of each run and the graphs dynamo had compiled on each rank after each of its steps.

usage: torchrun --nproc_per_node=W tests/workers/muon_compile_worker.py OUT.pt
    (saves {"weights": {(mode, compile): state},
            "graphs": {(mode, compile): [[graphs compiled so far, after each step] per rank]}})
tests/optim/test_compiled.py compares the runs, and runs `optimizer` and `schedule` in one process too.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from optim.muon import Muon
from tests.helpers import save_on_rank_0
from tests.workers.muon_worker import full_state, mlp, mlp_loss, wrap
from trainer.exits import exiting_without_teardown

STEPS = 3


def optimizer(params: list[torch.Tensor], compile: bool) -> Muon:
    """Muon on the worker MLP's matrices: the first split in 3 (as a qkv into Q, K and V) under Polar Express,
    NorMuon and cautious decay that follows the rate squared; the others Newton-Schulz with plain decay."""
    fused, *rest = params
    return Muon([{"params": [fused], "split": 3, "ns_coefficients": "polar_express", "normuon": True,
                  "cautious_wd": True, "wd_lr_squared": True}, {"params": rest}],
                lr=0.05, momentum=0.9, weight_decay=0.1, compile=compile)


def schedule(opt: Muon, step: int) -> None:
    """A new rate and momentum at every step, as the trainer's schedule, warm-up and cooldown set them."""
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * (1 - 0.2 * step)
        g["momentum"] = 0.85 + 0.03 * step


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"weights": {}, "graphs": {}}
    for mode in ("ddp", "fsdp"):
        for compile in (False, True):
            model = wrap(mlp(), "mlp", mode, world)
            opt = optimizer(list(model.parameters()), compile)
            graphs = []
            for step in range(STEPS):
                mlp_loss(model, rank, world).backward()
                schedule(opt, step)
                opt.step()
                opt.zero_grad(set_to_none=True)
                graphs.append(counters["stats"]["unique_graphs"])
            results["weights"][mode, compile] = full_state(model)
            results["graphs"][mode, compile] = [None] * world
            dist.all_gather_object(results["graphs"][mode, compile], graphs)
    save_on_rank_0(results, out, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
