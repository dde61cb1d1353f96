"""torchrun worker for tests/trainer/test_parallel.py: clipped gradients under DDP and FSDP2 (eager and compiled), on
gloo.

usage: torchrun --nproc_per_node=W tests/workers/step_worker.py OUT.pt
Rank 0 saves {"clip": {case: (norm, loss, full clipped gradients)}, "compiled": {case: (Block.forward compiled,
GPT.head_loss compiled)}}. The test compares with one process.
"""
from __future__ import annotations

import sys

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from model import get_model
from model.block import Block
from model.gpt import GPT
from tests.helpers import save_on_rank_0
from trainer import distributed
from trainer.config import TrainConfig
from trainer.distributed import Dist
from trainer.exits import exiting_without_teardown
from trainer.parallel import parallelize

# with the later tokens' loss term (model.mtp_weights) at its first weights, which the compiled tail computes too
GPT_CONFIG = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=24, bias=False, logit_softcap=15.0,
                  mtp_weights=[1.0, 0.5])
CLIP = 0.1  # well below the norm at init (~1.5), so clipping acts
CASES = {"ddp": dict(parallel="ddp"), "fsdp": dict(parallel="fsdp"), "fsdp_compiled": dict(parallel="fsdp",
                                                                                         compile=True)}


def clipped(case: str, dist: Dist) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(gradient norm, mean loss, full clipped gradients) of one backward on this rank's share of a fixed batch."""
    torch.manual_seed(0)
    model = parallelize(get_model(GPT_CONFIG), TrainConfig(**CASES[case]), dist)
    model.module.set_progress(0.0)
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(1))
    idx = idx.chunk(dist.world_size)[dist.rank]
    loss = model(idx[:, :-1], idx[:, 1:])[1]
    loss.backward()
    norm = model.clip_grads(CLIP)
    grads = {name.removeprefix("module."): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in model.wrapped.named_parameters()}
    loss = distributed.all_reduce(loss.detach().clone()) / dist.world_size
    return norm.item(), loss.item(), grads


def main(out: str) -> None:
    dist = distributed.init(60)
    results: dict = {"clip": {}, "compiled": {}}
    for case in CASES:
        torch._dynamo.reset()
        results["clip"][case] = clipped(case, dist)
        # dynamo's compiled entries per function (a debug API, but the plain way to ask what was compiled)
        results["compiled"][case] = tuple(len(_debug_get_cache_entry_list(f.__code__)) > 0
                                          for f in (Block.forward, GPT.head_loss))
    save_on_rank_0(results, out, dist.rank)
    distributed.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
