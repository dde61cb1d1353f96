"""What a run says about itself as it goes and when it ends: each step's console line and metrics.jsonl record, the
values of summary.json, and the last line."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from trainer import distributed
from trainer.metrics import Summary, git_commit, hardware, peak_mem_gb
from trainer.mfu import mfu_of
from trainer.state import Run, StopReason
from util.plural import plural


def log_step(run: Run, loss: torch.Tensor, norm: torch.Tensor, since: tuple[int, float, int]) -> None:
    """Console line + metrics.jsonl record for the step just done (loss averaged over ranks, gradient norm
    before clipping: the same on every rank); its step time and tokens/s average the steps since `since`
    ((step, elapsed, tokens) at the last line)."""
    progress, clock, train_cfg = run.progress, run.clock, run.cfg.train
    loss, norm = distributed.mean_over_ranks(loss, norm)
    steps, seconds, tokens = progress.step - since[0], clock.elapsed() - since[1], progress.tokens - since[2]
    step_s = seconds / max(steps, 1)
    tok_s = tokens / seconds if seconds > 0 else 0.0
    mfu = run.mfu(tok_s)
    # never below 0: the step that spends the budget ends past it (and on GPU one more step runs)
    left = (f"{max(train_cfg.budget_s - clock.elapsed(), 0.0):.1f}s" if train_cfg.budget_s
            else plural(max(train_cfg.steps - progress.step, 0), "step"))
    group = run.optimizers[0].param_groups[0]  # the multiplier the step just done used, its batch stage's included
    run.log.metric({"type": "train", "step": progress.step, "tokens": progress.tokens, "loss": loss,
                    "grad_norm": norm, "lr_mult": group["lr"] / group["initial_lr"], "step_ms": 1000 * step_s,
                    "tok_s": tok_s, "mfu": mfu, "elapsed_s": clock.elapsed()})
    run.log.print(f"step {progress.step} | loss {loss:.4f} | grad norm {norm:.3f} | {1000 * step_s:.1f} ms | "
                  f"{tok_s:,.0f} tok/s"
                  + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else "")
                  + f" | {clock.elapsed():.1f}s elapsed, {left} left")


def summarize(run: Run, status: StopReason, final_val: float | None) -> Summary:
    """summary.json's values for the run that stopped for `status` with final val loss `final_val`."""
    cfg, progress, dist = run.cfg, run.progress, run.dist
    # text bytes per token, as prepare measured it (a bytes-tokenizer stream is slightly under 1: its EOT tokens)
    bytes_per_token = run.meta.get("bytes_per_token") or (1.0 if run.meta.get("tokenizer") == "bytes" else None)
    train_time = run.clock.run_time()
    tok_s = progress.tokens / train_time if train_time > 0 else None
    # at the FLOPs spent, each step's at its own window: the final window's count would overstate a growing one
    mfu = mfu_of(progress.flops / progress.tokens, tok_s, dist) if tok_s else None
    return Summary(
        run_id=cfg.log.run_id, config_name=cfg.name, track=cfg.log.track, status=status,
        final_val_loss=final_val, best_val_loss=progress.best_val,
        final_val_bpb=final_val / math.log(2) / bytes_per_token if final_val and bytes_per_token else None,
        target_loss=cfg.eval.target_loss or None, time_to_target_s=progress.time_to_target, steps=progress.step,
        tokens_seen=progress.tokens, tokens_per_s=tok_s, train_time_s=train_time,
        budget_s=cfg.train.budget_s or None, mfu=mfu,
        peak_mem_gb=peak_mem_gb(dist), data_wait_frac=progress.data_wait / train_time if train_time > 0 else None,
        world_size=dist.world_size, hardware=hardware(dist), torch_version=torch.__version__,
        git_commit=git_commit(), checkpoint_path=str(run.checkpoint_path.absolute()), wall=progress.wall,
        resume_changes=progress.resume_changes)


def done_line(summary: Summary, run_dir: Path, curves: Path | None) -> str:
    """The run's last console line: why it stopped, its steps and time, the final val loss, tokens and speed."""
    val = f"final val loss {summary.final_val_loss:.4f}" if summary.final_val_loss is not None else "no final eval"
    if summary.final_val_bpb is not None:
        val += f" ({summary.final_val_bpb:.3f} bits/byte)"
    speed = f" at {summary.tokens_per_s:,.0f} tok/s" if summary.tokens_per_s else ""
    return (f"done: {summary.status} | step {summary.steps} | {summary.train_time_s:.1f}s | {val} | "
            f"{summary.tokens_seen:,} tokens{speed} | {run_dir}" + (f" | curves {curves}" if curves else ""))
