"""The GPT: GPT-2 by default, with the NanoGPT speedrun records' pieces behind config keys, off by default.

Read the default path first: token (+ position) embeddings -> blocks (model/block.py: attention, MLP) -> final
norm -> head -> cross-entropy. Each record piece enters at one named place below, and its file says which record it
comes from and which key turns it on: the embedding's extras (model/embeddings.py), masks and windows
(model/masks.py), rotary and YaRN (model/rotary.py), U-net skips, the one skip connection, backout and MUDD
connections on the residual stream (here, and model/mudd.py), the head that unties from the embedding (here), the
loss's extra terms (model/loss.py), the head's float8 matmul in training (model/fp8.py).
The model is a plain nn.Module: DDP/FSDP2, compile and precision are applied from outside (trainer/parallel.py).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model.attention import Attention
from model.block import Block
from model.config import GPTConfig
from model.embeddings import BigramHash, Smear
from model.fp8 import fp8_head
from model.layers import Gate, Norm
from model.loss import loss_weights_at, weighted_loss
from model.masks import layer_masks, mean_keys, short_window, window_at
from model.mudd import Mudd


# Tokens an eval scores at a time: 3.3 GB of fp32 logits at GPT-2's vocabulary, whatever the eval sequence's length
LOSS_CHUNK = 16_384


class GPT(nn.Module):
    """Token (+ position) embeddings -> blocks -> final norm -> head over the padded vocabulary."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        V = cfg.padded_vocab
        self.wte = nn.Embedding(V, cfg.n_embd)
        self.smear = Smear(cfg) if cfg.smear else None
        self.wpe = None if cfg.rotary else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, cfg.n_embd) for _ in range(cfg.value_embeds))
        self.bigram = BigramHash(cfg) if cfg.bigram_hash else None
        self.blocks = nn.ModuleList(Block(cfg, has_ve=i in cfg.value_embed_layers, attention=i in cfg.attention_layers,
                                          mlp=i in cfg.mlp_layers, xsa=i in cfg.xsa) for i in range(cfg.n_layer))
        # unet_skips: the second half's blocks add the first half's outputs, last first, each times a weight
        self.skip_weights = nn.Parameter(torch.empty(cfg.n_layer // 2)) if cfg.unet_skips else None
        # skip_gate (record 55): skip j also times twice a gate read from the embedding x0: 1 at init, as without it
        self.skip_gate = Gate(cfg, cfg.n_layer // 2) if cfg.skip_gate else None
        # skip_connection (record 46): one skip, its weight sigmoid(w) in (0, 1), from a small one (w = -1.5)
        self.skip_lambda = nn.Parameter(torch.empty(1)) if cfg.skip_connection else None
        # backout (record 40): a learned share of an early residual is taken back before the head, so that what the
        # early layers wrote for the later ones alone need not reach the prediction
        self.backout_lambda = nn.Parameter(torch.empty(1)) if cfg.backout else None
        # mudd (record 81): a connection after each layer listed, over x0 and the mudd_sources outputs up to it
        self.mudd = nn.ModuleList(Mudd(cfg, i) for i in cfg.mudd)
        self.norm_f = Norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, V, bias=False)
        if cfg.tie_embeddings and not cfg.untie_at:
            self.lm_head.weight = self.wte.weight
        # untie_at (record 53): the head is a parameter of its own from the start, so that DDP, FSDP2 and the
        # optimizer see one set of parameters throughout, and follows the embedding until the untie (tie_grads,
        # tie_weights). Whether it still does is saved with the weights; `tied` is its copy on the host, read each
        # step without a sync.
        self.tied = bool(cfg.untie_at)
        # train.bf16_stream, set from outside (trainer/parallel.py): under autocast the residual stream, the head
        # and the training loss run in autocast's dtype, as record 46's bf16 tables and head make them
        self.autocast_stream = False
        if cfg.untie_at:
            self.register_buffer("head_tied", torch.ones((), dtype=torch.long))
        # The (long, short) window as a tensor the forward reads: a new size is a new value of a graph input,
        # never a recompile. It follows training progress (set_progress), and is saved: a checkpoint is scored at
        # the windows of the eval it was saved for (train.py saves the last one inside `widened`).
        self.register_buffer("windows", torch.zeros(2, dtype=torch.long))
        # YaRN's window, apart from the L layers' own: an eval may widen those alone (`widened`)
        self.register_buffer("yarn_window", torch.zeros((), dtype=torch.long) if cfg.yarn else None)
        self.register_load_state_dict_post_hook(_after_load)
        # The training loss's weights (model/loss.py), likewise a tensor that follows the progress; None where the
        # loss is the next token's alone.
        terms = cfg.tokens_ahead + bool(cfg.prefix_weight)
        self.register_buffer("loss_weights", torch.zeros(terms) if terms > 1 else None, persistent=False)
        self._weights_now: list[float] = []
        # Each token's prefix token, -1 for none (the tokenizer's: train.py fills it, set_prefix_targets); the
        # checkpoint needs none of it, since evals score the next token alone.
        if cfg.prefix_weight:
            self.register_buffer("prefix_targets", torch.full((cfg.vocab_size,), -1, dtype=torch.long),
                                 persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every parameter (also after `to_empty` from the meta device), GPT-2 style.

        Matrices N(0, init_std) (uniform of that std under init = "uniform"), tables normal too (or N(0,
        embed_init_std)), residual projections scaled by 1/sqrt(2 n_layer) (or zero); each of our modules sets the
        rest of its own (gains 1, gates 0, MUDD's fc as nn.Linear's default, ...); skip weights 1
        (skip_lambda -1.5), backout's lambda 0.5, the MUDD MLPs last (as modded-nanogpt starts them); under
        untie_at the head tied, and the embedding its copy, the value a shared matrix ends with; the window and the
        loss's weights the final ones (set_progress(1)).
        """
        cfg = self.cfg
        tables = {id(self.wte), *map(id, self.value_embeds)}
        for m in self.modules():  # module order: the default model's draws keep their order as options add modules
            if isinstance(m, (nn.Linear, nn.Embedding)) and not isinstance(m, BigramHash):
                # a head that starts as the token table (tied, or until untie_at) is drawn as a table: normal
                table = isinstance(m, nn.Embedding) or (m is self.lm_head and cfg.tie_embeddings)
                std = (cfg.embed_init_std or cfg.init_std) if id(m) in tables else cfg.init_std
                draw(m.weight, std, "normal" if table else cfg.init)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (Norm, Gate, Smear, BigramHash, Attention, Block)):
                m.reset_parameters()
        if self.skip_weights is not None:
            nn.init.ones_(self.skip_weights)
        if self.skip_lambda is not None:
            nn.init.constant_(self.skip_lambda, -1.5)
        if self.backout_lambda is not None:
            nn.init.constant_(self.backout_lambda, 0.5)
        projections = [m.proj.weight for b in self.blocks for m in (b.attn, b.mlp) if m is not None]
        if cfg.zero_init_proj and not cfg.tie_embeddings:
            projections.append(self.lm_head.weight)
        for w in projections:
            if cfg.zero_init_proj:
                nn.init.zeros_(w)
            else:
                draw(w, cfg.init_std / math.sqrt(2 * cfg.n_layer), cfg.init)
        for m in self.mudd:  # last: the other parameters draw as without them
            m.reset_parameters()
        if cfg.untie_at:
            with torch.no_grad():
                self.wte.weight.copy_(self.lm_head.weight)
                self.head_tied.fill_(1)
            self.tied = True
        self._use_window(window_at(self.cfg, 1.0))
        self._weights_now = []
        self._use_loss_weights(loss_weights_at(cfg, 1.0))

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                keep_logits: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """idx [B, T] -> (logits [B, T, vocab_size] float, None); with targets -> (logits, loss), the checkpoint
        contract's answer to an evaluator: in eval mode the mean cross-entropy over the targets that are not -100,
        in training mode the training loss (its extra terms too, model/loss.py).

        With keep_logits=False (train.py's steps and evals) it returns (None, loss): no [B, T, V] copy is kept past
        the call, and an eval without gradients computes its loss a chunk of the tokens at a time (scored_loss).
        """
        cfg, dtype = self.cfg, self.stream_dtype(idx.device)
        x = x0 = self.embed(idx, dtype)
        # the tables' fp32 rows in the stream's dtype, as the record's bf16 tables give them
        bigram = None if self.bigram is None else self.bigram(idx).to(dtype)
        tables = [ve(idx).to(dtype) for ve in self.value_embeds]
        ves = [None if (j := cfg.layer_table(i)) is None else tables[j] for i in range(cfg.n_layer)]
        masks = layer_masks(cfg, idx, self.windows)
        # the blocks get the window, not its frequencies: FSDP2's mixed precision casts floating-point block inputs
        yarn_window = self.yarn_window
        half, skips, (skip_from, skip_to) = cfg.n_layer // 2, [], cfg.skip_connection or (-1, -1)
        skip_gates = 2 * self.skip_gate(x0) if self.skip_gate is not None else None
        mudd, outputs, value = dict(zip(cfg.mudd, self.mudd)), {}, None
        for i, block in enumerate(self.blocks):
            if self.skip_weights is not None and i >= cfg.n_layer - half:
                j = i - (cfg.n_layer - half)
                weight = self.skip_weights[j] if skip_gates is None else self.skip_weights[j] * skip_gates[..., j:j + 1]
                x = x + weight * skips.pop()
            if i == skip_to:
                # the [1]-shaped fp32 scalars times a bf16 stream would make it fp32: they take its dtype
                x = x + torch.sigmoid(self.skip_lambda).to(x.dtype) * skipped
            x = block(x, x0, ves[i], masks[i], yarn_window, bigram, value)
            if i in cfg.mudd_sources:
                outputs[i] = x
            value = None
            if i in mudd:
                x, value = mudd[i](x, [x0, *(outputs[j] for j in cfg.mudd_reads(i))])
            if self.skip_weights is not None and i < half:
                skips.append(x)
            if i == skip_from:
                skipped = x
            if i == cfg.backout - 1:
                early = x
        if self.backout_lambda is not None:
            x = x - self.backout_lambda.to(x.dtype) * early
        return self.head_loss(x, targets, keep_logits)

    def stream_dtype(self, device: torch.device) -> torch.dtype | None:
        """The residual stream's dtype: autocast's where it runs on `device` and autocast_stream is on (the key
        train.bf16_stream); else None, for which x.to(None) is x: every tensor keeps the dtype it comes with."""
        if self.autocast_stream and torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return None

    def embed(self, idx: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """idx [B, T] -> the residual stream's start x0 [B, T, C]: the token table's rows (smeared), plus the
        learned positions where there is no rotary, RMS-normalised under embed_norm; in `dtype` (stream_dtype)."""
        cfg, T = self.cfg, idx.size(1)
        if self.wpe is not None and T > cfg.block_size:  # rotary positions take any length
            raise ValueError(f"sequence length {T} exceeds model block_size={cfg.block_size}, the size of the learned "
                             f"position table; raise [model] block_size or use rotary = true")
        x = self.wte(idx).to(dtype)  # the smear mixes in the stream's dtype, as in the record
        if self.smear is not None:
            x = self.smear(x)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        # again: the fp32 position table, or a norm autocast runs in fp32, would promote it
        return (F.rms_norm(x, (x.size(-1),)) if cfg.embed_norm else x).to(dtype)

    def head_loss(self, x: Tensor, targets: Tensor | None,
                  keep_logits: bool = True) -> tuple[Tensor | None, Tensor | None]:
        """forward's tail on the blocks' output: final norm, head, (softcapped) logits, cross-entropy; the logits
        fp32, but for the training loss in the stream's dtype under train.bf16_stream.

        A method of its own so that trainer/parallel.py can compile it where the whole forward is not (FSDP2)."""
        if targets is None:
            return self.logits(x), None
        if keep_logits and not self.training:
            logits = self.logits(x)
            return logits, self.loss(logits, targets)
        if not keep_logits and not torch.is_grad_enabled():
            return None, self.scored_loss(x, targets)
        dtype = self.stream_dtype(x.device)
        logits = self.logits(x, dtype)
        # autocast would cast bf16 logits back to fp32 for the loss (log_softmax and cross_entropy are on its fp32
        # list): a [tokens x vocab] copy, the traffic they save
        with contextlib.nullcontext() if dtype is None else torch.autocast(x.device.type, enabled=False):
            return logits if keep_logits else None, self.loss(logits, targets)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The training loss of logits [B, T, V]: the next token's mean cross-entropy, or its weighted terms."""
        cfg = self.cfg
        if self.loss_weights is not None and self.training:  # in this order: no training guard without the terms
            prefixes = self.prefix_targets if cfg.prefix_weight else None
            return weighted_loss(logits, targets, self.loss_weights, cfg.tokens_ahead, prefixes)
        # targets of -100 (padding) are skipped: the mean is over the others, NaN if there are none
        flat = logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)
        if logits.dtype == torch.float32:
            return F.cross_entropy(*flat, ignore_index=-100)
        # bf16: each token's loss rounded once, their mean in fp32 (a bf16 mean would log 3.28 in steps of 1/64)
        return F.cross_entropy(*flat, ignore_index=-100, reduction="none").float().sum() / (targets != -100).sum()

    def logits(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The blocks' output [..., C] -> logits [..., vocab_size]: final norm, head (in float8 while training under
        fp8_head; evals score the head's own weights), softcap; fp32, or in `dtype` from the head's input on (the
        training loss's under train.bf16_stream)."""
        x = self.norm_f(x).to(dtype)
        head = fp8_head(x, self.lm_head.weight) if self.cfg.fp8_head and self.training else self.lm_head(x)
        logits = head[..., :self.cfg.vocab_size].to(dtype or torch.float32)
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def scored_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """The mean cross-entropy of an eval (no gradients), the head and loss LOSS_CHUNK tokens at a time: a
        262,144-token eval sequence's whole logits would be 50 GB of fp32 at GPT-2's vocabulary."""
        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        total = x.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), LOSS_CHUNK):
            chunk = slice(start, start + LOSS_CHUNK)
            total += F.cross_entropy(self.logits(x[chunk]), targets[chunk], ignore_index=-100, reduction="sum")
        return total / (targets != -100).sum()  # NaN for padding alone, as the mean over no target is

    def set_progress(self, progress: float) -> None:
        """Use the window and the loss's weights of `progress` (train.py: the LR schedule's, each step; its evals
        keep the last step's window and score the next token alone)."""
        window = window_at(self.cfg, progress)
        if window != self.window:
            self._use_window(window)
        self._use_loss_weights(loss_weights_at(self.cfg, progress))

    def _use_window(self, window: int) -> None:
        self._fill_windows(window, window)
        self.window = window

    def _fill_windows(self, long: int, last: int) -> None:
        # fill_ passes the number as a kernel argument: no host-device sync
        self.windows[0].fill_(long)
        self.windows[1].fill_(short_window(last, self.cfg.window_block))
        if self.yarn_window is not None:
            self.yarn_window.fill_(last)

    @contextlib.contextmanager
    def widened(self, long: int) -> Iterator[None]:
        """Inside the block the windows are a final eval's: the S layers and YaRN at the run's last window
        (window_at progress 1), the L layers at `long`; 0: no change. Record 46's final eval: 2,560 tokens with 768
        and YaRN at 1,664, its last step moving to 1,664 even where its schedule was cut before the extension
        steps that train at it (scripts/bench/beside_record.py)."""
        if not long:
            yield
            return
        held = [t for t in (self.windows, self.yarn_window) if t is not None]
        before = [t.clone() for t in held]
        self._fill_windows(long, window_at(self.cfg, 1.0))
        try:
            yield
        finally:
            for t, then in zip(held, before):
                t.copy_(then)

    def _use_loss_weights(self, weights: list[float]) -> None:
        # only the entries that changed, one fill_ each (no host-device sync): one a step while a term fades
        for i, (new, old) in enumerate(itertools.zip_longest(weights, self._weights_now)):
            if new != old:
                self.loss_weights[i].fill_(new)
        self._weights_now = weights

    def set_prefix_targets(self, targets: list[int]) -> None:
        """The prefix token of each token id (-1: none) that prefix_weight trains towards (data/tokenizer.py's
        prefix_tokens for the data's tokenizer)."""
        self.prefix_targets.copy_(torch.tensor(targets, dtype=torch.long))

    def tie_grads(self) -> None:
        """While the head follows the embedding (untie_at): add its gradient to the embedding's and drop it, so
        that the embedding gets what one shared matrix would and the optimizer steps it alone (the head's own
        optimizer state starts at the untie). Call after the backward's gradient sync, before clipping."""
        if self.tied and self.lm_head.weight.grad is not None:
            self.wte.weight.grad.add_(self.lm_head.weight.grad)
            self.lm_head.weight.grad = None

    @torch.no_grad()
    def tie_weights(self) -> None:
        """While the head follows the embedding: give it the embedding's weights (after each optimizer step)."""
        if self.tied:
            self.lm_head.weight.copy_(self.wte.weight)

    def untie(self) -> None:
        """The head stops following the embedding: from now on it keeps the weights it has and gets a gradient
        of its own (optim/groups.py's untie_head also gives it the embedding's optimizer state)."""
        self.tie_weights()
        self.head_tied.fill_(0)
        self.tied = False

    def num_params(self) -> int:
        """Number of distinct parameters (a shared head counted once; under untie_at the head is one of its own)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, window: int | None = None) -> float:
        """Training FLOPs per token of a seq_len-token sequence: 6 per matmul weight, plus the attention's
        (`attention_flops_per_token`), plus 6 x n_embd per weight a MUDD connection gives a source (its weighted
        sums)."""
        mixed = sum(m.proj.size(0) for m in self.mudd)
        return (6.0 * self.matmul_weights + self.attention_flops_per_token(seq_len, window)
                + 6.0 * self.cfg.n_embd * mixed)

    def attention_flops_per_token(self, seq_len: int, window: int | None = None) -> float:
        """12 x n_embd per layer with attention for each key a query attends to (QK^T and AV, forward and backward;
        PaLM's count, made causal). A token at position p attends to min(p + 1, w) keys, w being its layer's
        window at `window` (default: the current one; S layers half of it; one more under model.window_past).
        Document boundaries are ignored: with doc_causal it is an upper bound, the FLOPs of the window alone."""
        cfg = self.cfg
        long = window if window is not None else self.window
        if long is None:  # loaded since the last set_progress: the window it was saved at (one sync)
            long = int(self.windows[0])
        kinds = [cfg.layer_windows[i] for i in cfg.attention_layers]
        layers = [long if kind == "L" else short_window(long, cfg.window_block) for kind in kinds]
        return 12.0 * cfg.n_embd * sum(mean_keys(seq_len, w + int(cfg.window_past)) for w in layers)

    @functools.cached_property
    def matmul_weights(self) -> int:
        """Parameters that multiply an activation: all but the embedding tables, a tied head counted as the head."""
        # Cached: train.py counts FLOPs every step, and walking the modules each time costs more than the count.
        lookup_only = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        shared = self.lm_head.weight is self.wte.weight  # a tied head under untie_at is a parameter of its own
        return self.num_params() - lookup_only + (self.lm_head.weight.numel() if shared else 0)


def draw(weight: Tensor, std: float, init: str) -> None:
    """Fill `weight` at mean 0 and `std`: N(0, std), or under init = "uniform" U(-sqrt(3) std, sqrt(3) std), whose
    std it is (record 46 starts its qkv and fc so: bounded, no tail)."""
    if init == "uniform":
        nn.init.uniform_(weight, -math.sqrt(3) * std, math.sqrt(3) * std)
    else:
        nn.init.normal_(weight, std=std)


def _after_load(model: GPT, keys: Any) -> None:
    """After load_state_dict: a checkpoint saved before the windows were keeps the model's own (progress 1's); the
    host's copy of the window is unknown until set_progress sets it again, and that of head_tied is read (one sync,
    at load only)."""
    for key in [k for k in keys.missing_keys if k.rpartition(".")[2] in ("windows", "yarn_window")]:
        keys.missing_keys.remove(key)
    model.window = None
    if model.cfg.untie_at:
        model.tied = bool(model.head_tied)
