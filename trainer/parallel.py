"""Parallelism, compile and precision, applied from outside a plain nn.Module.

`parallelize` returns the module to call; the caller keeps the original module for state dicts, so
saved keys never carry `module.` (DDP) or `_orig_mod.` (compile) prefixes: nn.Module.compile() compiles
in place, unlike torch.compile(module), which wraps.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config import TrainConfig
from trainer.distributed import Dist


def parallelize(model: nn.Module, cfg: TrainConfig, d: Dist) -> nn.Module:
    """Move `model` to d.device and wrap it for cfg.parallel (DDP or FSDP2) and cfg.compile."""
    model.to(d.device)
    if d.world_size > 1 and cfg.parallel == "fsdp":
        return _fully_shard(model, cfg, d)
    if cfg.compile:
        # In place, so that evals (which call the plain module) run compiled too; under DDP dynamo still splits
        # the graph at DDP's bucket boundaries, since it compiles inside DDP's forward.
        model.compile()
    # The only buffer (GPT.windows) is set alike on every rank from the agreed schedule: broadcasting it from
    # rank 0 before every forward, DDP's default, would be a collective for nothing.
    return model if d.world_size == 1 else DDP(model, device_ids=[d.local_rank] if d.cuda else None,
                                               broadcast_buffers=False)


def _fully_shard(model: nn.Module, cfg: TrainConfig, d: Dist) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if d.cuda and cfg.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # One FSDP unit per block, so only one block's full weights are gathered at a time. Each block is compiled
    # before it is sharded, as torchtitan does (models/llama3/parallelize.py: compile, then fully_shard): FSDP2's
    # hooks then run around the compiled block, and its all-gathers stay out of the graph.
    for block in model.blocks:
        if cfg.compile:
            block.compile()
        fully_shard(block, **kwargs)
    if cfg.compile:
        # The tail (final norm, head, fp32 cast, softcap, cross-entropy) works on [tokens x vocab] fp32 logits:
        # eager, each op is a full pass over them; compiled, they fuse. It runs inside the root unit's forward,
        # after the root's all-gather, like a block.
        model.head_loss = torch.compile(model.head_loss)
    fully_shard(model, **kwargs)
    return model


def clip_grads(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (before clipping); with max_norm > 0 they are scaled to at most that.

    Under FSDP2 each rank holds DTensor shards of the gradients, and their norm is a DTensor (a partial result
    on some torch versions, already reduced on others): full_tensor() makes it the whole gradient's norm, the
    same on every rank (as torchtitan's clip_grad_norm_ does). DDP's gradients are equal on every rank already.
    A device tensor: nothing here waits for the GPU. (get_total_norm and clip_grads_with_norm_: torch >= 2.6.)
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def grad_sync(model: nn.Module, sync: bool) -> ContextManager:
    """A context for one micro-step's backward that skips the gradient all-reduce unless `sync`."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def autocast(d: Dist, dtype: str) -> ContextManager:
    """bf16 autocast on GPU; CPU runs in fp32 (CPU autocast is slow and changes results)."""
    if d.cuda and dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
