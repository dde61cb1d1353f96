"""optim.bf16_storage: record 46's bf16 storage, in fp32 tensors. Its nn.Embedding and nn.Linear modules (the token
and value tables, the head, the gates) hold bf16 weights, and its Adam keeps both moments of every parameter in
bf16; its block matrices, their Muon momentum and its scalars are fp32. Its compiled steps compute in fp32 and round
once, at the store. Here the weights and moments stay fp32 tensors, rounded to bf16 at the start and after each
step of the optimizer that moved them: the same values, with no dtype for DDP, FSDP2 or a checkpoint to handle.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from model.gpt import GPT
from model.layers import Gate


def stored_in_bf16(model: nn.Module) -> list[nn.Parameter]:
    """The weights record 46 stores in bf16: every embedding table, every gate and the head (a tied head once)."""
    modules = [m for m in model.modules() if isinstance(m, (nn.Embedding, Gate))]
    modules += [m.lm_head for m in model.modules() if isinstance(m, GPT)]
    return list({id(m.weight): m.weight for m in modules}.values())


@torch.no_grad()
def round_to_bf16(tensors: Iterable[torch.Tensor]) -> None:
    """Round each fp32 tensor in place to the nearest bf16 value (ties to even), keeping its dtype."""
    for t in tensors:
        t.copy_(t.to(torch.bfloat16))


def keep_in_bf16(optimizers: list[torch.optim.Optimizer], model: nn.Module) -> None:
    """Round the bf16-stored weights now, and after every step of an optimizer: AdamW's moments, and the
    bf16-stored weights it moved with their Muon momentum (the gates under optim.muon_gates)."""
    stored = stored_in_bf16(model)
    round_to_bf16(stored)
    ids = {id(p) for p in stored}

    def after_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
        adam = isinstance(opt, torch.optim.AdamW)
        for p in (p for group in opt.param_groups for p in group["params"]):
            state = opt.state.get(p, {})
            moments = ["exp_avg", "exp_avg_sq"] if adam else ["momentum_buffer"] if id(p) in ids else []
            round_to_bf16([state[k] for k in moments if k in state] + ([p] if id(p) in ids else []))
    for opt in optimizers:
        opt.register_step_post_hook(after_step)
