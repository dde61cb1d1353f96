"""The val loss: every rank scores its share of the fixed val batches (data/val.py) and one all-reduce sums them;
eval_and_record logs it and keeps the best and the time to target (eval.target_time = "first_eval"; train.py's
finish keeps the "end" one)."""
from __future__ import annotations

import contextlib
import gc
import time
from typing import TYPE_CHECKING

import torch

from data.val import PAD_TARGET
from trainer import distributed
from trainer.data import val_loader
from trainer.parallel import autocast
from util.plural import plural

if TYPE_CHECKING:
    from trainer.state import Run

EVAL_PROGRESS_S = 5.0  # an eval prints how far it has got this often, so a long one is not silent


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean loss over the eval.tokens scored val targets (val_batches says which): sum of losses / their count.
    Rank 0 says when it starts and, every EVAL_PROGRESS_S, how many batches are done."""
    cfg, dist = run.cfg, run.dist
    # Every rank makes the same forward calls on batches of one shape (val_batches pads with ignored targets), as
    # FSDP2's all-gathers need, and a compiled model compiles one eval shape.
    model = run.model.eval_module
    model.eval()
    sums = torch.zeros(2, device=dist.device, dtype=torch.float64)  # the scored targets' summed loss, their count
    batches = val_loader(cfg, dist, run.val_files)
    run.log.print(f"step {run.progress.step} | eval of {plural(cfg.eval.tokens, 'token')}: "
                  f"{plural(len(batches), 'batch', 'batches')} per rank")
    t0 = shown = time.perf_counter()
    for done, (x, y) in enumerate(batches, 1):
        with autocast(dist, cfg.train.dtype):
            _, loss = model(x, y, keep_logits=False)  # the loss a chunk at a time: no [B, T, V] logits kept
        count = (y != PAD_TARGET).sum()
        sums[0] += torch.where(count > 0, loss.double() * count, 0.0)  # a padding-only batch's mean is NaN
        sums[1] += count
        # counted on the host, with no sync: on a GPU it is ahead by at most the work queued behind it
        if time.perf_counter() - shown >= EVAL_PROGRESS_S:
            shown = time.perf_counter()
            run.log.print(f"eval: {done}/{len(batches)} batches, {shown - t0:.0f}s")
    distributed.all_reduce(sums)
    model.train()
    return (sums[0] / sums[1]).item()


def eval_and_record(run: Run, on_clock: bool) -> float:
    """Evaluate, log it, track best and time-to-target; the clock keeps running only if `on_clock`."""
    t0, progress, target = time.perf_counter(), run.progress, run.cfg.eval.target_loss
    with contextlib.nullcontext() if on_clock else run.clock.paused():
        gc.collect()
        val = run.hooks.evaluate(evaluate, run)
    progress.best_val = val if progress.best_val is None else min(progress.best_val, val)
    progress.last_val, progress.last_val_step = val, progress.step
    if run.cfg.eval.target_time == "first_eval" and target and val <= target and progress.time_to_target is None:
        progress.time_to_target = run.clock.elapsed()
    progress.wall["eval_s"] += time.perf_counter() - t0
    run.log.metric({"type": "eval", "step": progress.step, "tokens": progress.tokens, "val_loss": val,
                    "elapsed_s": run.clock.elapsed()})
    run.log.print(f"step {progress.step} | val loss {val:.4f} | best {progress.best_val:.4f} | "
                  f"{run.clock.elapsed():.1f}s")
    return val

