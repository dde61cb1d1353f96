"""optim.bf16_storage: record 46's bf16 storage, in fp32 tensors. Its nn.Embedding and nn.Linear modules (the token
and value tables, the head, the gates) hold bf16 weights, so their gradients are bf16 too, and its Adam keeps both
moments of every parameter in bf16; its block matrices, their Muon state and its scalars are fp32. Its compiled steps
compute in fp32 and round once, at the store. Here the weights, gradients and moments stay fp32 tensors, rounded to
bf16 where the record's are bf16: the weights at the start, each gradient a backward gives them and the sum it joins
(over micro-steps, and over AdamW's held steps under optim.adam_every: a bf16 sum, as the record's .grad), and around
each step of an optimizer the weights and moments it wrote. The sum over the ranks of each rank's bf16 sum is in
bf16 under train.reduce_dtype = "storage" (the record's rule), else in the wire's dtype; under FSDP2 the micro-steps
add up in fp32: its sharded weights see only the hook after the sum, which rounds the ranks' average as it joins
.grad. No dtype changes, so DDP, FSDP2 and checkpoints see fp32 as without the key.
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


def add_in_bf16(weight: nn.Parameter) -> None:
    """Every gradient a backward gives `weight` is rounded to bf16 before it joins the sum in .grad, and the sum is
    rounded after: a bf16 add, each rank's sum rounded before DDP's all-reduce, as the record's bf16 .grad."""
    weight.register_hook(lambda grad: grad.to(torch.bfloat16).to(grad.dtype))
    weight.register_post_accumulate_grad_hook(lambda p: round_to_bf16([p.grad]))


def keep_in_bf16(optimizers: list[torch.optim.Optimizer], model: nn.Module) -> None:
    """Round the bf16-stored weights now and sum their gradients in bf16; before every step of an optimizer round
    the gradients of those it steps, and after it AdamW's moments and the bf16-stored weights it moved with their
    Muon state (the gates under optim.muon_gates: NorMuon's momentum and second moment, bf16 in the record as their
    gradients are)."""
    stored = stored_in_bf16(model)
    round_to_bf16(stored)
    for weight in stored:
        add_in_bf16(weight)
    ids = {id(p) for p in stored}

    def owned(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in opt.param_groups for p in group["params"] if id(p) in ids]

    def before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
        round_to_bf16([p.grad for p in owned(opt) if p.grad is not None])

    def after_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
        if isinstance(opt, torch.optim.AdamW):
            round_to_bf16([s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s])
        else:
            states = [opt.state[p] for p in owned(opt) if p in opt.state]
            round_to_bf16([s[k] for s in states for k in ("momentum_buffer", "second_moment") if k in s])
        round_to_bf16(owned(opt))
    for opt in optimizers:
        opt.register_step_pre_hook(before_step)
        opt.register_step_post_hook(after_step)
