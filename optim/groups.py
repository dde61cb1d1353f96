"""The optimizers for the GPT's parameter groups: AdamW alone (baseline) or Muon for hidden matrices + AdamW for
the rest.

Learning-rate contract with the trainer: every param group stores its base rate in `group["initial_lr"]`;
the schedule sets `group["lr"] = group["initial_lr"] * mult` on every group of every optimizer, each step.
Muon's groups also carry their momentum warm-up and cooldown (`initial_momentum`, `momentum_start`,
`momentum_warmup_steps`, `momentum_cooldown_steps`), and the trainer sets `group["momentum"] =
momentum_at(group, step, steps)` next to the rate: a function of the step and the run's length alone, so a
resumed run gets the same values.
The trainer steps them with `step_optimizers`, which also drops the gradients they applied (AdamW may keep
its own for a later step: optim.adam_every); under optim.eps_before_correction AdamW's groups carry that eps as
`group["eps_before_correction"]`, and step_optimizers gives torch's AdamW the eps that places it so.
All optimizers returned support `state_dict()` / `load_state_dict()` for resume (through trainer/checkpoint.py's
`restore`, which gives a state saved before a group key existed the key as this run built it).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from model.attention import Attention
from model.config import GPTConfig
from model.embeddings import Smear
from model.gpt import GPT
from model.layers import MLP, Gate
from model.mudd import Mudd
from optim.bf16_storage import keep_in_bf16
from optim.config import OptimConfig, check_qk_pairs
from optim.muon import Muon
from optim.views import Split


# Record 81's MUDD parameters: Adam at a quarter of its base rate, a twentieth of what its scalars get (our
# scalar_lr), with a slower second moment than its other Adam groups.
MUDD_LR_SCALE = 0.05
MUDD_BETAS = (0.9, 0.99)


def param_roles(model: nn.Module, muon_gates: bool = False) -> dict[str, list[nn.Parameter]]:
    """Split the GPT's parameters into "matrix" (2-D in blocks), "embed", "head" (untied), "mudd" and "scalar".

    The gates' weights (attn_gate, smear, ve_gate, skip_gate) are 2-D but "scalar": AdamW's, as the records' (since
    2025-12-31); with `muon_gates` the attention and smear gates' are "matrix", as record 46's (optim.muon_gates).
    The MUDD connections' MLPs are AdamW's too, at a rate of their own (MUDD_LR_SCALE)."""
    gpt = next((m for m in model.modules() if isinstance(m, GPT)), None)
    if gpt is None:
        raise TypeError(f"build_optimizers needs a model containing a GPT, got {type(model).__name__}")
    embeds = {id(m.weight) for m in gpt.modules() if isinstance(m, nn.Embedding)}
    gates = {id(m.weight) for m in gpt.modules() if isinstance(m, Gate)}
    hidden = {id(p) for p in gpt.blocks.parameters() if p.ndim >= 2 and id(p) not in gates}
    if muon_gates:
        hidden |= {id(m.gate.weight) for m in gpt.modules() if isinstance(m, (Attention, Smear)) and m.gate is not None}
    mudd = {id(p) for m in gpt.modules() if isinstance(m, Mudd) for p in m.parameters()}
    roles = {"matrix": [], "embed": [], "head": [], "mudd": [], "scalar": []}
    for p in gpt.parameters():
        if id(p) in mudd:
            roles["mudd"].append(p)
        elif id(p) in embeds:
            roles["embed"].append(p)
        elif p is gpt.lm_head.weight:
            roles["head"].append(p)
        else:
            roles["matrix" if id(p) in hidden else "scalar"].append(p)
    return roles


def adamw_params(model: nn.Module, cfg: OptimConfig) -> list[nn.Parameter]:
    """The parameters build_optimizers gives AdamW: every one under optim.name = "adamw", else all but Muon's."""
    roles = param_roles(model, cfg.name == "muon" and cfg.muon_gates)
    return [p for role, params in roles.items() if cfg.name == "adamw" or role != "matrix" for p in params]


def _adamw(groups: list[dict], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over non-empty groups, fused when every parameter is on CUDA."""
    groups = [g for g in groups if g["params"]]
    for g in groups:
        g["initial_lr"] = g["lr"]
        if cfg.eps_before_correction:
            g["eps_before_correction"] = cfg.eps
    fused = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


def build_optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    """The optimizers for `model` (a GPT, possibly wrapped by DDP/FSDP2/compile) under recipe `cfg.name`; under
    cfg.bf16_storage they keep record 46's bf16 values (optim/bf16_storage.py)."""
    optimizers = _optimizers(model, cfg)
    if cfg.bf16_storage:
        keep_in_bf16(optimizers, model)
    return optimizers


def _optimizers(model: nn.Module, cfg: OptimConfig) -> list[torch.optim.Optimizer]:
    roles = param_roles(model, cfg.name == "muon" and cfg.muon_gates)
    if cfg.name == "adamw":
        return [_adamw([
            {"params": roles["matrix"] + roles["head"], "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {"params": roles["embed"] + roles["scalar"] + roles["mudd"], "lr": cfg.lr, "weight_decay": 0.0},
        ], cfg)]
    adam = _adamw([
        {"params": roles["embed"], "lr": cfg.embed_lr, "weight_decay": 0.0},
        {"params": roles["head"], "lr": cfg.head_lr, "weight_decay": 0.0},
        {"params": roles["scalar"], "lr": cfg.scalar_lr, "weight_decay": 0.0},
        {"params": roles["mudd"], "lr": cfg.scalar_lr * MUDD_LR_SCALE, "betas": MUDD_BETAS, "weight_decay": 0.0},
    ], cfg)
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    fused = {id(m.qkv.weight) for m in attention}
    split = qkv_split(attention[0].cfg, cfg.muon_qk_pairs) if attention else 3
    # The record 46 groups below are only there when their key is set, so that saved optimizer states keep theirs:
    # normuon_attn_columns: the attention's output projection with its qkv, NorMuon's neurons their inputs
    proj = {id(m.proj.weight) for m in attention} if cfg.normuon_attn_columns else set()
    # muon_fc_lr_scale (record 46: 2, "for the transpose" of its [768, 3072] fc)
    fc = {id(m.fc.weight) for m in model.modules() if isinstance(m, MLP)} if cfg.muon_fc_lr_scale != 1 else set()

    def matrices(ids: set[int]) -> list[nn.Parameter]:
        return [p for p in roles["matrix"] if id(p) in ids]
    groups = [{"params": matrices(fused), "split": split, "normuon_columns": cfg.normuon_attn_columns},
              {"params": [p for p in roles["matrix"] if id(p) not in fused | proj | fc]},
              {"params": matrices(proj), "normuon_columns": True},
              {"params": matrices(fc), "lr": cfg.muon_lr * cfg.muon_fc_lr_scale}]
    muon = Muon([g for g in groups if g["params"]], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, ns_steps=cfg.ns_steps, adjust_lr=cfg.adjust_lr,
                ns_coefficients=cfg.ns_coefficients, cautious_wd=cfg.muon_cautious_wd, normuon=cfg.normuon,
                normuon_beta2=cfg.normuon_beta2, wd_lr_squared=cfg.muon_wd_lr_squared, compile=cfg.muon_compile,
                symmetric=cfg.muon_symmetric, ns_eps=cfg.ns_eps)
    for g in muon.param_groups:
        g.update(initial_lr=g["lr"], initial_momentum=g["momentum"], momentum_start=cfg.muon_momentum_start,
                 momentum_warmup_steps=cfg.muon_momentum_warmup_steps,
                 momentum_cooldown_steps=cfg.muon_momentum_cooldown_steps)
    return [adam, muon]


def qkv_split(model_cfg: GPTConfig, qk_pairs: bool) -> Split:
    """Muon's split of a qkv weight [3d, d]: Q, K and V apart (3, as the records), or with `qk_pairs` each pair
    of adjacent heads of Q and of K, [2 * head_dim, d], apart and V whole (as the newer records)."""
    if not qk_pairs:
        return 3
    check_qk_pairs(model_cfg.n_head)
    return (2 * model_cfg.head_dim,) * model_cfg.n_head + (model_cfg.n_embd,)


def step_optimizers(optimizers: list[torch.optim.Optimizer], step: int, adam_every: int = 1,
                    adam_sync: Callable[[], Callable[[], None]] | None = None) -> None:
    """Step the optimizers due at `step` (0-based) and drop the gradients they applied. Muon steps every step;
    AdamW only at steps adam_every - 1, 2 * adam_every - 1, ... (with 2, the odd ones, as the records), and keeps
    its gradients in between, which the next backwards add to: its step applies their sum. AdamW steps last: on its
    steps `adam_sync()` is called first and what it returns right before AdamW's step (train.adam_sync: its
    gradients cross the ranks while Muon steps). A group with an `eps_before_correction` steps with the eps that
    adds it to sqrt(v) before the bias correction (`torch_eps`)."""
    # Held gradients are averaged over the ranks already, the same on each: DDP's average of held + new is then
    # held + the average of the new gradients, and FSDP2 adds that average to the held shard itself. Under
    # train.adam_sync = "adam_steps" each rank holds its own sum, and AdamW's step averages it.
    adam_due = (step + 1) % adam_every == 0
    synced = adam_sync() if adam_due and adam_sync is not None else None
    for opt in sorted(optimizers, key=lambda o: isinstance(o, torch.optim.AdamW)):
        if isinstance(opt, torch.optim.AdamW):
            if not adam_due:
                continue
            if synced is not None:
                synced()
            for group in opt.param_groups:
                if "eps_before_correction" in group:
                    group["eps"] = torch_eps(group["eps_before_correction"], group["betas"][1],
                                             (step + 1) // adam_every)
        opt.step()
        opt.zero_grad(set_to_none=True)


def torch_eps(eps: float, beta2: float, t: int) -> float:
    """What torch's AdamW, which adds eps after the bias correction, must add at its t-th step (1-based) to step as
    an Adam that adds `eps` before it: m / (sqrt(v / c) + eps / sqrt(c)) = sqrt(c) m / (sqrt(v) + eps), where
    c = 1 - beta2^t. AdamW's t follows from the training step: it steps at fixed steps from a run's first (the
    warm-up's steps, undone after, count as the step the run starts or resumes at)."""
    return eps / math.sqrt(1 - beta2 ** t)


def untie_when_due(model: GPT, optimizers: list[torch.optim.Optimizer], progress: float, step: int,
                   adam_every: int = 1) -> None:
    """Untie the head that follows the embedding (model.untie_at) before the first step at or past that
    progress which starts with no AdamW gradients held (optim.adam_every): a held gradient mixes the two."""
    if model.tied and progress >= model.cfg.untie_at and step % adam_every == 0:
        untie_head(model, optimizers)


def untie_head(model: GPT, optimizers: list[torch.optim.Optimizer]) -> None:
    """The head leaves the embedding it followed: it keeps its weights (the embedding's) and starts from a copy of
    the embedding's AdamW state (moments and step count), so both go on from where the tied matrix was, each on
    its own gradient, as record 53 splits them."""
    embed, head = model.wte.weight, model.lm_head.weight
    for opt in optimizers:
        if embed in opt.state:
            opt.state[head] = {key: value.clone() for key, value in opt.state[embed].items()}
    model.untie()


def momentum_at(group: dict, step: int, steps: int) -> float:
    """Muon's momentum at `step` of a run of `steps` (0 = unknown): linear from `momentum_start` at step 0 to
    `initial_momentum` at `momentum_warmup_steps`, then constant, then back linearly towards `momentum_start`
    over the last `momentum_cooldown_steps` (the records: 0.85 -> 0.95 over 300 steps; record 46 back to 0.85
    over its last 50). The warm-up holds while it lasts, as record 46's: a run cut shorter keeps its warm-up."""
    warmup = group["momentum_warmup_steps"]
    cooldown = group["momentum_cooldown_steps"]
    if step < warmup:
        frac = step / warmup
    else:
        frac = 1 - max(step - (steps - cooldown), 0) / cooldown if cooldown and steps else 1.0
    return (1 - frac) * group["momentum_start"] + frac * group["initial_momentum"]  # exactly the target at 1


def set_lr(optimizers: list[torch.optim.Optimizer], mult: float, step: int, steps: int = 0) -> None:
    """Apply the schedule's multiplier to every group's base rate, and Muon's momentum at `step` of a run of
    `steps` (0 = unknown: no cooldown; optim/__init__.py's contract)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
            if "momentum_warmup_steps" in group:
                group["momentum"] = momentum_at(group, step, steps)
