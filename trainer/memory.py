"""Will the config fit? Each process's memory, estimated before the first step, against what it has.

Counted per process: parameters, gradients (under DDP they are views of its buckets: no second copy) and
optimizer state (a 1/world shard of each under FSDP2, plus the blocks it gathers at a time), and the activations
backward keeps for one micro-batch of train.batch_size rows of train.seq_len tokens (the longest stage's under
train.batch_stage_rows): the tensors the model (model/) saves in eager mode, counted one by one below, and the
logits. torch.compile's fused kernels keep fewer: a compiled run on a GPU counts COMPILED of them.
The limit: MemAvailable divided by the node's processes on CPU (page cache counts as available: the shards'
pages are reclaimable), the device's free memory on CUDA. An estimate above the limit is refused with the
numbers and the keys to change; one above NEAR of it gets a warning. SHARDRUN_MEMORY_CHECK=warn turns the
refusal into a warning.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.mudd import mudd_width
from optim.groups import param_roles
from trainer import distributed
from trainer.config import Config, ConfigError
from trainer.distributed import Dist

GB = 1e9
# Warn well below the limit: the estimate counts tensors only, while a process's resident memory also holds the
# allocator's slack and the libraries' pages.
NEAR = 0.6
# The GPU check's compiled warm-up peaks (which also hold a copy of the state), less the states this module counts,
# were 0.53 (the speedrun, 1 x 49,152 tokens) and 0.46 (the hackathon, 32 x 1,024) of the eager activations and
# logits it counts (records/gpu_check/2026-12-04_NVIDIA-H200, one H200); a margin over both
COMPILED = 0.6


def activation_bytes(model_cfg: GPTConfig, tokens: int, dtype_bytes: int, logit_bytes: int = 4) -> dict[str, float]:
    """What backward keeps for `tokens` tokens of one micro-batch: the blocks' saved tensors (at `dtype_bytes`, as
    if the residual stream had autocast's dtype; without train.bf16_stream it is fp32, a little more) and the
    logits (at `logit_bytes`: 2 under train.bf16_stream)."""
    C, hidden = model_cfg.n_embd, model_cfg.mlp_ratio * model_cfg.n_embd
    # Per block with attention and token: in units of C, the norm input and output, q/k/v, the attention output
    # and its contiguous copy (7), the normalised and rotated q and k (2 each), the value-embedding mix (2, below;
    # with ve_gate also the gated value embedding and its n_head gates); and the n_head gates of attn_gate.
    attn = (7 + 2 * model_cfg.qk_norm + 2 * model_cfg.rotary) * C + model_cfg.n_head * model_cfg.attn_gate
    # XSA: the attention's output before it and the unit values (2 C), and per head |v|, its clamp, the component
    # along v and its scaled copy
    xsa = 2 * C + 4 * model_cfg.n_head
    # norm in/out; fc out, activation (relu, square)
    mlp = 2 * C + hidden * (3 if model_cfg.activation == "relu2" else 2)
    ve_layers, ve_mix = len(model_cfg.value_embed_layers), 2 * C + (C + model_cfg.n_head) * model_cfg.ve_gate
    # value_scale: the other attention layers' scaled values
    scaled = (len(model_cfg.attention_layers) - ve_layers) * model_cfg.value_scale
    # the last terms: the value tables' rows; the token embedding the smear's mix keeps beside its output; the
    # bigram table's output, widened to C, which every block's lambda reads, and its sign patterns
    bigram = (C + model_cfg.bigram_signs * model_cfg.bigram_width) if model_cfg.bigram_hash else 0
    per_token = (len(model_cfg.attention_layers) * attn + len(model_cfg.mlp_layers) * mlp + ve_layers * ve_mix
                 + scaled * C + model_cfg.value_embeds * C + model_cfg.smear * C + len(model_cfg.xsa) * xsa + bigram)
    for i in model_cfg.mudd:
        # a MUDD connection: the block output its MLP reads (the residual goes on from h + sum), the MLP's hidden
        # before and after GELU, its weights; with the value channel, the values it makes a copy of, unless a value
        # embedding already did
        values = model_cfg.mudd_feeds_values(i)
        outputs = (1 + values) * (1 + len(model_cfg.mudd_reads(i)))
        copy = values and i + 1 not in model_cfg.value_embed_layers
        per_token += (1 + copy) * C + 2 * mudd_width(outputs) + outputs
    parts = {"activations": per_token * tokens * dtype_bytes}
    # The logits: the head's output, its softcap (tanh output and the scaled copy) and log_softmax's output, one
    # more in backward; where bf16 autocast's head output is cast to fp32 logits, also that bf16 output.
    copies = (4 if model_cfg.logit_softcap else 3) + (0.5 if dtype_bytes == 2 and logit_bytes == 4 else 0)
    parts["logits"] = copies * tokens * model_cfg.padded_vocab * logit_bytes
    return parts


def estimate(cfg: Config, world_size: int, cuda: bool, batch_size: int | None = None) -> dict[str, float]:
    """Bytes of each part of one process's memory for `cfg` (at `batch_size`, default train.batch_size)."""
    train, model_cfg = cfg.train, cfg.model
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = GPT(cfg.model)
    roles = param_roles(model, cfg.optim.name == "muon" and cfg.optim.muon_gates)
    sizes = {role: sum(p.numel() for p in params) for role, params in roles.items()}
    total = sum(sizes.values())
    fsdp = train.parallel == "fsdp" and world_size > 1
    shard = world_size if fsdp else 1
    adam = total - sizes["matrix"] if cfg.optim.name == "muon" else total
    parts = {"parameters": 4 * total / shard, "gradients": 4 * total / shard,
             # AdamW keeps two fp32 moments per parameter; Muon one momentum buffer per matrix
             "optimizer": (8 * adam + (4 * sizes["matrix"] if cfg.optim.name == "muon" else 0)) / shard}
    if fsdp:
        # the root's own parameters (embeddings, head) stay gathered; blocks are gathered two at a time (the
        # largest: a block without attention is smaller)
        blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
        gathered = total - sum(blocks) + 2 * max(blocks)
        parts["gathered"] = 2 * gathered * (2 if cuda and train.dtype == "bfloat16" else 4)  # weights and grads
    tokens = (batch_size or train.batch_size) * train.longest_row
    bf16 = cuda and train.dtype == "bfloat16"  # CPU runs fp32 (trainer/parallel.py's autocast)
    saved = activation_bytes(model_cfg, tokens, 2 if bf16 else 4, 2 if bf16 and train.bf16_stream else 4)
    parts.update({name: value * (COMPILED if cuda and train.compile else 1) for name, value in saved.items()})
    if (model_cfg.window or model_cfg.doc_causal) and not (cuda and model_cfg.attention == "flex"):
        # SDPA with an explicit mask (no FlexAttention) keeps it as B x H x T x T floats (measured on CPU)
        parts["mask"] = (batch_size or train.batch_size) * model_cfg.n_head * train.longest_row ** 2 * 4
    return parts


def kb_fields(path: str | Path) -> dict[str, int]:
    """The `Key: N kB` lines of a /proc file (meminfo, a process's status or smaps_rollup), in bytes; {} where there
    is no such file."""
    path = Path(path)
    if not path.exists():
        return {}
    return {parts[0].rstrip(":"): int(parts[1]) * 1024 for parts in map(str.split, path.read_text().splitlines())
            if len(parts) == 3 and parts[2] == "kB"}


def available(dist: Dist) -> tuple[float, str] | None:
    """Bytes this process may use and where that number comes from; None where it cannot be known."""
    if dist.cuda:
        free, _ = torch.cuda.mem_get_info(dist.device)
        return free, source_of(dist, free)
    node = kb_fields("/proc/meminfo").get("MemAvailable")
    if node is None:
        return None
    limit = node / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return limit, source_of(dist, limit)


def source_of(dist: Dist, limit: float) -> str:
    """Where a process's `limit` bytes come from, in words that depend on nothing else: every rank describes the
    tightest rank's limit alike, so that their refusals are one message, which train.py prints once."""
    if dist.cuda:
        return f"free on {torch.cuda.get_device_name(dist.device)}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node = "this node" if local == dist.world_size else "the tightest node"
    return f"MemAvailable {limit * local / GB:.1f} GB / {local} process(es) on {node}"


def _advice(cfg: Config, world_size: int, cuda: bool, limit: float) -> str:
    """The keys to change, with a batch size that would fit comfortably when one does."""
    train = cfg.train
    fits = [b for b in range(train.batch_size - 1, 0, -1)
            if train.batch_size % b == 0 and sum(estimate(cfg, world_size, cuda, b).values()) <= NEAR * limit]
    if fits:
        keys = (f"lower train.batch_size to {fits[0]} and raise train.grad_accum to "
                f"{train.grad_accum * train.batch_size // fits[0]} (the same tokens per step)")
    else:
        batch = "train.batch_size is 1 already" if train.batch_size == 1 else "even train.batch_size = 1 would not fit"
        keys = f"{batch}: shrink the model (model.n_layer, model.n_embd)"
    keys += ", or lower train.seq_len"
    if train.batch_stage_rows:
        keys += " (or set train.batch_stage_rows = false: the later stages in more micro-steps of seq_len tokens)"
    if world_size > 1 and train.parallel != "fsdp":
        keys += "; train.parallel = 'fsdp' shards the parameters, gradients and optimizer state"
    if not cuda:
        keys += "; fewer processes per node (NPROC) leave each one more memory"
    return keys


def verdict(cfg: Config, world_size: int, cuda: bool, limit: float, source: str) -> tuple[str, str] | None:
    """("refuse" or "warn", the message) for a process that has `limit` bytes, or None when the config fits."""
    parts = estimate(cfg, world_size, cuda)
    need = sum(parts.values())
    if need <= NEAR * limit:
        return None
    train = cfg.train
    what = (f"this config needs about {need / GB:.1f} GB per process ("
            + " + ".join(f"{name} {value / GB:.2f}" for name, value in parts.items() if value)
            + f" GB, at {train.batch_size} x {train.longest_row} tokens per micro-step), and a process has "
              f"{limit / GB:.1f} GB"
            + (f" ({source})" if source else ""))
    advice = _advice(cfg, world_size, cuda, limit)
    if need > limit:
        return "refuse", (f"{what}: it would be killed for memory (torchrun reports only 'exitcode: -9'). "
                          f"To fit, {advice}. SHARDRUN_MEMORY_CHECK=warn starts it anyway.")
    return "warn", f"{what}: {need / limit:.0%} of it, a near fit. If it is killed, {advice}."


def check_memory(cfg: Config, dist: Dist) -> None:
    """Refuse (ConfigError) a config that cannot fit in the tightest process's memory; warn on a near fit."""
    limit, _ = available(dist) or (math.inf, "")
    # every rank judges by the tightest one, so that all of them stop, or go on, together
    tightest = -distributed.max_over_ranks([-limit], dist.device)[0]
    if math.isinf(tightest):
        return
    found = verdict(cfg, dist.world_size, dist.cuda, tightest, source_of(dist, tightest))
    if found is None:
        return
    level, message = found
    if level == "refuse" and os.environ.get("SHARDRUN_MEMORY_CHECK") != "warn":
        raise ConfigError(message)
    if dist.master:
        print(f"train.py: warning: {message}", file=sys.stderr)
