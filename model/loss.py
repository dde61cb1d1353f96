"""The training loss's terms beyond the next token, each a record's piece behind its key: the tokens after the next
one (record 53, model.mtp_weights) and the target's prefix token (record 88, model.prefix_weight), and how their
weights fade over training. Without them the loss is model/gpt.py's plain cross-entropy, and evals always are."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.config import GPTConfig, stage_of


def loss_weights_at(cfg: GPTConfig, progress: float) -> list[float]:
    """The weights of the training loss's terms at `progress` in [0, 1] of training: each position's next token,
    the tokens after it (mtp_weights) and its target's prefix token (prefix_weight); [] for the next token alone.

    With n mtp_weights the run is n equal stages, and the weight of the token k + 1 ahead fades linearly to 0
    across stage n - 1 - k: record 53's [1, 0.5, 0.25 -> 0], [1, 0.5 -> 0], [1] for [1.0, 0.5, 0.25]. The prefix
    term holds over the first third and fades across the second, as record 88's."""
    if cfg.tokens_ahead + bool(cfg.prefix_weight) <= 1:
        return []
    ahead = [float(w) for w in cfg.mtp_weights] or [1.0]
    n = len(ahead)
    weights = [ahead[0]] + [fading(w, progress, n, n - 1 - k) for k, w in enumerate(ahead[1:], 1)]
    return weights + ([fading(cfg.prefix_weight, progress, 3, 1)] if cfg.prefix_weight else [])


def fading(weight: float, progress: float, stages: int, stage: int) -> float:
    """`weight` before stage `stage` of `stages` equal stages of the run, falling linearly to 0 across it, 0
    after it (stage_of's stages, the batch schedule's)."""
    now = stage_of(progress, stages)
    if now != stage:
        return weight if now < stage else 0.0
    return weight * (1.0 - min(max(progress * stages - stage, 0.0), 1.0))


def weighted_loss(logits: Tensor, targets: Tensor, weights: Tensor, tokens_ahead: int,
                  prefix_targets: Tensor | None) -> Tensor:
    """At each position the cross-entropies of its logits [B, T, V] against the next token, the tokens after it
    in its row (`tokens_ahead` in all) and, given `prefix_targets` (each token's prefix token, -1 for none), its
    target's prefix token; weighted by `weights` (one per term), summed and divided by the count of next-token
    targets, so that with the other weights at 0 it is the plain mean. A position whose token k ahead lies past
    its row's end (or is padding, -100), or whose target has no prefix token, leaves that term out. Same head,
    same logits: no new parameter or matmul."""
    aims = [F.pad(targets[:, k:], (0, k), value=-100) for k in range(tokens_ahead)]
    if prefix_targets is not None:
        aims.append(torch.where(targets >= 0, prefix_targets[targets.clamp(min=0)], -1))
    aims = torch.stack(aims, dim=-1)  # [B, T, terms]
    # log_softmax keeps what F.cross_entropy keeps: one [B, T, V] tensor for the backward
    picked = F.log_softmax(logits, dim=-1).gather(-1, aims.clamp(min=0))
    return -(picked * torch.where(aims >= 0, weights, 0.0)).sum() / (targets != -100).sum()
