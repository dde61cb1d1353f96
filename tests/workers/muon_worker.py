"""torchrun worker: two optimizer steps under DDP, then FSDP2, on gloo; rank 0 saves the full final weights and
the collectives and Newton-Schulz work of every rank's optimizer steps.

usage: torchrun --nproc_per_node=W tests/workers/muon_worker.py OUT.pt
    (saves {"weights": {mode: {case: state}}, "work": {mode: {case: [Work as a dict, per rank]}}})
The test runs the same steps in one process (`train` with no wrapping) and compares.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from model import get_model
from optim import muon
from optim.config import OptimConfig
from optim.groups import build_optimizers, step_optimizers
from optim.muon import Muon, ns_flops
from trainer.exits import exiting_without_teardown
from util.atomic import atomic_path

STEPS = 2  # the second step also checks the momentum buffers
GPT_CONFIG = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=24, bias=False, norm="rmsnorm",
                  activation="relu2", rotary=True, qk_norm=True, tie_embeddings=False, value_embeds=1,
                  unet_skips=True)


def mlp() -> nn.Sequential:
    """Matrices with rows that 2 ranks cannot split evenly (33, 5), tall and wide; the first fuses 3 [11, 16]."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33, bias=False), nn.Tanh(), nn.Linear(33, 5, bias=False), nn.Tanh(),
                         nn.Linear(5, 16, bias=False))


def mlp_loss(model: nn.Module, rank: int, world: int) -> torch.Tensor:
    """Mean squared error on this rank's share of a fixed batch of 6 (equal shares on 1, 2 or 3 ranks, so the
    mean of the ranks' means is the batch mean)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    return (model(x.chunk(world)[rank]) - y.chunk(world)[rank]).square().mean()


def gpt(**changes) -> nn.Module:
    torch.manual_seed(0)
    return get_model({**GPT_CONFIG, **changes})


def newer() -> nn.Module:
    """The newer records' pieces: 4 heads (2 pairs in each of Q and K), the gates (2-D weights that AdamW steps,
    sharded by FSDP2 like the rest: of the attention, the value embedding and the skip), the smear, a block
    without attention, the bigram table (50 rows, which 3 ranks cannot split evenly) with its sign patterns (a
    buffer), XSA, backout, YaRN at twice its start window (the blocks' window input), and MUDD connections on 3
    layers (their MLPs AdamW's, among the root's parameters under FSDP2; the one after layer 1 feeds layer 2's
    values, a block input)."""
    return gpt(n_layer=3, n_head=4, attn_gate=True, smear=True, no_attention=[1], bigram_hash=50, bigram_dim=12,
               bigram_signs=True, xsa=[0], ve_gate=True, skip_gate=True, backout=1, window=8, window_start=4,
               yarn=True, mudd=[1, 2], mudd_sources=[0, 1])


def record46() -> nn.Module:
    """Record 46's init pieces; its optimizer (optimizers_for) has Muon step the attention and smear gates (2 and 1
    rows, which 3 ranks cannot all hold a row of) and NorMuon the attention by columns."""
    return gpt(n_layer=3, attn_gate=True, smear=True, x0_mix=True, x0_mix_init=1.1, value_embed_skip=1,
               value_scale=True, skip_connection=[0, 2], embed_init_std=1.0, unet_skips=False)


def gpt_loss(model: nn.Module, rank: int, world: int) -> torch.Tensor:
    """Next-token loss on this rank's share of a fixed batch of 6 sequences (equal shares on 1, 2 or 3 ranks)."""
    idx = torch.randint(0, GPT_CONFIG["vocab_size"], (6, 17), generator=torch.Generator().manual_seed(1))
    idx = idx.chunk(world)[rank]
    return model(idx[:, :-1], idx[:, 1:])[1]


# those of this torch: all_gather_single is torch 2.13's name for all_gather_into_tensor
COLLECTIVES = tuple(name for name in (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single", "broadcast",
    "gather", "scatter", "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier") if hasattr(dist, name))


@dataclass
class Work:
    """What one process's optimizer steps did: torch.distributed calls per step, Newton-Schulz flops in total."""
    collectives: list[list[str]] = field(default_factory=list)
    ns_flops: int = 0


@contextmanager
def recording(work: Work):
    """Record every torch.distributed collective and every newton_schulz call made inside into `work` (the real
    functions still run: these wrappers only count)."""
    real = {name: getattr(dist, name) for name in COLLECTIVES} | {"newton_schulz": muon.newton_schulz}
    work.collectives.append([])

    def collective(name):
        def call(*args, **kwargs):
            work.collectives[-1].append(name)
            return real[name](*args, **kwargs)
        return call

    def newton_schulz(g, steps=5, *args, **kwargs):
        work.ns_flops += g[..., 0, 0].numel() * ns_flops(*g.shape[-2:], steps)
        return real["newton_schulz"](g, steps, *args, **kwargs)

    for name in COLLECTIVES:
        setattr(dist, name, collective(name))
    muon.newton_schulz = newton_schulz
    try:
        yield
    finally:
        for name in COLLECTIVES:
            setattr(dist, name, real[name])
        muon.newton_schulz = real["newton_schulz"]


def train(model: nn.Module, loss_fn, optimizers: list[torch.optim.Optimizer], adam_every: int = 1, rank: int = 0,
          world: int = 1) -> Work:
    """STEPS steps on this process's share of the fixed global batch, the optimizers stepped as train.py does;
    what their steps did."""
    work = Work()
    for step in range(STEPS):
        loss_fn(model, rank, world).backward()
        with recording(work):
            step_optimizers(optimizers, step, adam_every)
    return work


# "recipe": the MLP under the newer records' options; NorMuon's neurons are the columns of the wide views, whose
# rows two or three ranks share under FSDP2. "newer": the GPT of the newer records' pieces under the muon recipe
# with Q and K in pairs of heads (NorMuon: wide pairs by column, square V by row) and AdamW every second step:
# step 0 holds its gradients (in DDP's buckets, in FSDP2's shards) and step 1 applies their sum. "record46": record
# 46's model and Muon keys.
CASES = {"mlp": (mlp, mlp_loss), "gpt": (gpt, gpt_loss), "recipe": (mlp, mlp_loss), "newer": (newer, gpt_loss),
         "record46": (record46, gpt_loss)}
RECIPE = dict(ns_coefficients="polar_express", cautious_wd=True, normuon=True)
ADAM_EVERY = {"newer": 2}


def optimizers_for(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """Plain Muon for the MLP (its first matrix split in 3), also with RECIPE; the muon recipe (Muon + AdamW
    groups) for the GPTs, "newer" with pairs of heads, NorMuon and AdamW every ADAM_EVERY steps, "record46" with
    record 46's Muon keys."""
    if name in ("mlp", "recipe"):
        fused, *rest = model.parameters()  # also through the DDP wrapper
        return [Muon([{"params": [fused], "split": 3}, {"params": rest}], lr=0.05, momentum=0.9, weight_decay=0.1,
                     **RECIPE if name == "recipe" else {})]
    newer = dict(muon_qk_pairs=True, normuon=True, adam_every=ADAM_EVERY[name]) if name == "newer" else {}
    if name == "record46":
        newer = dict(normuon=True, normuon_attn_columns=True, muon_gates=True, muon_fc_lr_scale=2.0,
                     muon_weight_decay=0.1, muon_cautious_wd=True, muon_wd_lr_squared=True)
    return build_optimizers(model, OptimConfig(name="muon", muon_lr=0.05, embed_lr=0.01, head_lr=0.01, **newer))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of the weights (DTensors gathered), without wrapper prefixes."""
    return {k.removeprefix("module."): v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in model.state_dict().items()}


def wrap(model: nn.Module, name: str, mode: str, world: int) -> nn.Module:
    """DDP (its gradients views of its buckets), or FSDP2 on every layer (GPT: every block) and then the root, as
    trainer/parallel.py does."""
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.blocks if name in ("gpt", "newer", "record46") else model[::2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"weights": {}, "work": {}}
    for mode in ("ddp", "fsdp"):
        for name, (build, loss_fn) in CASES.items():
            model = wrap(build(), name, mode, world)
            work = train(model, loss_fn, optimizers_for(name, model), ADAM_EVERY.get(name, 1), rank, world)
            results["weights"].setdefault(mode, {})[name] = full_state(model)
            every = [None] * world
            dist.all_gather_object(every, asdict(work))
            results["work"].setdefault(mode, {})[name] = every
    if rank == 0:
        with atomic_path(out) as tmp:
            torch.save(results, tmp)
    dist.destroy_process_group()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
