"""Train a GPT on token shards under a time budget; write checkpoint.pt and runs/<run_id>/.

    python train.py --config configs/cpu.toml                                  # one process
    torchrun --standalone --nproc_per_node=8 train.py --config configs/speedrun_8xh100.toml
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29517 \\
        train.py --config configs/hackathon_32gpu.toml
    python train.py --config configs/tiny.toml --train.budget_s=30 --model.n_layer=4 --log.run_id=x
    python train.py --config configs/tiny.toml --log.run_id=x --resume         # continue run x
    python train.py --config configs/tiny.toml --log.run_id=x --train.max_steps=60 --extend-budget  # train x on

The hackathon starter's flags (--data_dir --checkpoint_path --seq_len --batch_size --grad_accum_steps
--max_steps --time_limit_min) are accepted as its submit.sh passes them; trainer/starter.py says how each maps,
and the run's first lines say which were applied and which the config file overrode.
"""
from __future__ import annotations

import os
import signal
import sys

from trainer.config import Config, ConfigError, parse_args
from trainer.exits import (exiting_without_teardown, fail, ignore_stop_signals, interrupted, report,
                           watch_stop_signals)

if __name__ == "__main__":
    # Read when torch starts, so set here, in each process torchrun starts too. Expandable segments let the eval's
    # large logits reuse the memory training's allocations left fragmented. The user's own setting (or torch's
    # newer name for it) wins.
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    # until the loop can stop cleanly, Ctrl-C has nothing to save: it ends the run at once, without a traceback
    signal.signal(signal.SIGINT, lambda *_: interrupted("train.py: interrupted before training started; nothing "
                                                        "was saved"))
    # before the imports below (torch takes seconds to import): a config error is answered at once;
    # every rank parses the same command line, so rank 0 says it
    try:
        CONFIG = parse_args(sys.argv[1:])
    except ConfigError as e:
        fail(f"train.py: config error: {e}", first=os.environ.get("RANK", "0") == "0")


import copy  # noqa: E402  (the imports after the early parse above)
import gc  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from data.shards import ShardError  # noqa: E402
from model.gpt import GPT  # noqa: E402
from optim.groups import adamw_params, build_optimizers, set_lr, step_optimizers, untie_when_due  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.checkpoint import (load_resume, record_end, restore, save_checkpoint, save_resume,  # noqa: E402
                                training_state, warn_if_the_saves_do_not_fit)
from trainer.clock import Clock, next_multiple  # noqa: E402
from trainer.data import prefix_targets, resolve_data, train_loader, val_loader  # noqa: E402
from trainer.distributed import Dist  # noqa: E402
from trainer.evaluate import eval_and_record  # noqa: E402
from trainer.flags import Flags  # noqa: E402
from trainer.memory import check_memory  # noqa: E402
from trainer.metrics import open_log  # noqa: E402
from trainer.parallel import autocast, check_kernels, parallelize  # noqa: E402
from trainer.plots import plot_or_warn  # noqa: E402
from trainer.report import done_line, log_step, summarize  # noqa: E402
from trainer.resume import (RunFinished, default_run_id, open_run_folder, reopen, restore_run,  # noqa: E402
                            resume_command, seek_loader)
from trainer.state import Diverged, Hooks, Run, StopReason, diverged, refuse_nonfinite_state  # noqa: E402
from trainer.runs import STOPPED_BY_SIGNAL  # noqa: E402
from util.atomic import DiskFullError  # noqa: E402
from util.plural import plural  # noqa: E402


def main(cfg: Config, hooks: Hooks | None = None) -> None:
    """Join the process group, train under `cfg` (parse_args' answer) with `hooks` watching, and always leave
    the group."""
    dist = distributed.init(cfg.train.dist_timeout_s, group_of_one=cfg.train.ddp_always)
    hooks = hooks or Hooks()
    try:
        run = hooks.setup(setup, cfg, dist)
        run.hooks = hooks
        watch_stop_signals(run.stop_requested)  # here, not in setup: a test calling setup alone keeps its handlers
        hooks.warm_up(warm_up, run)
        status = hooks.train(train, run)
        finish(run, status)
        # saved, but a script that ran train.py stops as if Ctrl-C had ended it; so after a Ctrl-C in the final
        # eval, which ends the run as planned (run.sh then skips its sample)
        if status == StopReason.INTERRUPTED or signal.SIGINT in run.stop_requested:
            raise SystemExit(130)
    finally:
        distributed.close()


def setup(cfg: Config, dist: Dist) -> Run:
    """Data, run folder, log, model, optimizers, loader; restore the resume state if there is one."""
    t0 = time.perf_counter()
    files, val_files, meta = resolve_data(cfg)
    check_memory(cfg, dist)  # a config that cannot fit is refused here, not killed by the OS at its first step
    check_kernels(cfg, dist.device)
    prefixes = prefix_targets(cfg, meta) if cfg.model.prefix_weight else None  # the tokenizer's, before the folder
    if val_files:
        val_loader(cfg, dist, val_files)  # a val set too small for eval.tokens fails now, not after training
    loader = train_loader(cfg, dist, files, meta)  # shards it cannot read are refused before the run folder is made
    if not cfg.log.run_id:
        cfg.log.run_id = distributed.broadcast(default_run_id(cfg.name))
    run_dir = Path(cfg.log.dir) / cfg.log.run_id
    marker, changes = open_run_folder(cfg, dist, run_dir)
    resumed = load_resume(run_dir, dist, marker) if marker else None
    if resumed:
        seek_loader(loader, resumed, run_dir)  # data changed since the save is refused here, before the log opens
        reopen(run_dir, dist, marker)
    # a fresh run in an existing folder starts metrics.jsonl over; a resumed one cuts it back to the saved step
    log = open_log(cfg, dist, run_dir, resumed["metrics_bytes"] if resumed else 0)

    torch.manual_seed(cfg.train.seed)  # the same on every rank: FSDP2 shards whatever each rank initialised
    gpt = GPT(cfg.model)
    if prefixes:
        gpt.set_prefix_targets(prefixes)
    model = parallelize(gpt, cfg.train, dist, apart=adamw_params(gpt, cfg.optim))
    run = Run(cfg, dist, run_dir, val_files, meta, log, model, build_optimizers(model.module, cfg.optim),
              loader, Clock(cfg.train))
    if resumed:
        restore_run(run, resumed, marker, changes)
    per_step = " -> ".join(f"{tokens:,}" for tokens in run.tokens_by_stage())
    log.print(f"run {cfg.log.run_id} | {model.module.num_params() / 1e6:.2f}M params | {per_step} "
              f"tokens/step | {plural(dist.world_size, 'process', 'processes')}, "
              f"{model.kind} | compile {cfg.train.compile}"
              + (f" | resumed at step {run.progress.step}" if resumed else ""))
    warn_if_the_saves_do_not_fit(run)
    run.progress.wall["init_s"] += time.perf_counter() - t0
    return run


def train_step(run: Run, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], seq_len: int = 0,
               norm_wanted: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """One optimizer step over the micro-batches of its batch stage (grad_accum without train.batch_stages), of
    its rows (`seq_len` > 0: rows that long instead, for a warm-up): (mean loss, gradient norm before clipping,
    seconds waiting for data: what the loader counted in its wait_s). The two tensors stay on the device: nothing
    in a step waits for the GPU. Without optim.grad_clip the norm is computed only if `norm_wanted` (None else).

    Phases, in order: per micro-batch the data, then forward + backward (of the loss x Run.loss_scale); the
    gradient norm (and clipping); the optimizer steps (each drops the gradients it applied: AdamW's wait for its
    step under optim.adam_every), AdamW's last: under train.adam_sync = "adam_steps" its gradients cross the ranks
    while Muon steps. Under model.untie_at the head follows the embedding until the untie: its gradient joins the
    embedding's before the norm, and it takes the embedding's weights after the optimizers. The flag exchange
    follows in train()."""
    step, gpt, adam_every = run.progress.step, run.model.module, run.cfg.optim.adam_every
    accum, dist, scale = run.clock.micro_steps(step), run.dist, run.loss_scale(step)
    run.loader.set_seq_len(seq_len or run.clock.seq_len(step))
    total, waited = torch.zeros((), device=dist.device), run.loader.wait_s
    set_lr(run.optimizers, run.clock.lr_mult(step), step, run.cfg.train.steps)
    # the attention window, the loss's weights and the head's untie follow the LR's clock
    progress = run.trained_at = run.clock.progress(step)
    gpt.set_progress(progress)
    untie_when_due(gpt, run.optimizers, progress, step, adam_every)
    for micro in range(accum):
        x, y = next(batches)
        with run.model.grad_sync(micro == accum - 1), autocast(dist, run.cfg.train.dtype):
            _, loss = run.model(x, y, keep_logits=False)  # no [B, T, V] logits held through the backward
            (loss * (scale / accum)).backward()
        total += loss.detach()

    gpt.tie_grads()  # a head that follows the embedding: its gradient is the embedding's
    norm = run.model.clip_grads(run.cfg.optim.grad_clip, norm_wanted)

    step_optimizers(run.optimizers, step, adam_every, adam_sync=run.model.sync_apart)
    gpt.tie_weights()
    return total / accum, norm, run.loader.wait_s - waited


def warm_up(run: Run) -> None:
    """exclude_warmup: run warmup_steps real steps of each row length still ahead (compiling every shape), then
    restore the state from before."""
    train_cfg, rows = run.cfg.train, run.clock.rows_ahead(run.progress.step)
    if not run.clock.warmup_steps(run.progress.step):
        return
    t0 = time.perf_counter()
    initial = copy.deepcopy(training_state(run.model.module, run.optimizers, run.loader, run.model.apart))
    batches = iter(run.loader)
    with distributed.timeout(train_cfg.warmup_timeout_s, after=train_cfg.dist_timeout_s):  # they compile
        for seq_len in rows:
            for _ in range(train_cfg.warmup_steps):
                train_step(run, batches, seq_len)
        restore(run.model.module, run.optimizers, run.loader, initial)
        distributed.barrier()
    run.progress.wall["warmup_s"] += time.perf_counter() - t0
    shapes = f" of each of {len(rows)} row lengths" if len(rows) > 1 else ""
    run.log.print(f"warm-up: {plural(train_cfg.warmup_steps, 'step')}{shapes} in {time.perf_counter() - t0:.1f}s; "
                  f"state restored")


def save(run: Run) -> None:
    """checkpoint.pt (rank 0) and every rank's resume state; not charged to the training clock. Nothing with
    train.save_checkpoint = false: the periodic, final and SIGTERM saves all come here. A state that is not finite
    stops the run instead (Diverged), whatever the steps since the last save checked, also where nothing is saved:
    finish comes here at the end of every run."""
    t0, cfg, dist = time.perf_counter(), run.cfg, run.dist
    refuse_nonfinite_state(run)
    if not cfg.train.save_checkpoint:
        return
    model_state = run.model.full_state()  # every rank: FSDP2 gathers the full state from them all
    if dist.master:
        save_checkpoint(run.checkpoint_path, cfg.to_dict(), model_state, run.progress.step)
    state = {**training_state(run.model.module, run.optimizers, run.loader, run.model.apart),
             "clock": run.clock.state_dict(), "progress": asdict(run.progress),
             "metrics_bytes": run.log.metrics_bytes()}
    save_resume(run.run_dir, dist, run.progress.step, state, cfg.to_dict(), replicated=not run.model.sharded)
    run.saved_step = run.progress.step
    run.progress.wall["checkpoint_s"] += time.perf_counter() - t0


@dataclass
class Loop:
    """What the timed loop carries from one step to the next."""
    next_eval_s: float           # the clock time of the next eval by eval.every_s (inf: none)
    last_save: float             # perf_counter() at the last periodic save, or at the loop's start
    since: tuple[int, float, int]  # (step, elapsed, tokens) at the last log line: the next one averages from there
    recent: list = field(default_factory=lambda: [None, None])  # (step, loss, norm) of the step before, this one


def train(run: Run) -> StopReason:
    """The timed loop; returns why it stopped (a StopReason); raises Diverged at a non-finite loss or gradient
    norm.

    The host waits for the GPU only where it must, so that it queues step N+1 while the GPU runs step N: the
    Flags exchange (trainer/flags.py) is read a step late, log_step all-reduces loss and gradient norm every
    log.every_steps steps, and evals, saves and stops sync anyway. No other .item(), .tolist() or .cpu() runs in
    the loop (clip_grads and optim/muon.py read nothing on the host: tests/test_loop.py counts the scalar reads).
    """
    cfg, progress, clock = run.cfg, run.progress, run.clock
    loop = Loop(next_multiple(clock.elapsed(), cfg.eval.every_s), time.perf_counter(),
                (progress.step, clock.elapsed(), progress.tokens))
    t0, status, batches = time.perf_counter(), None, iter(run.loader)
    # a collective, so the ranks' clocks also start together (their max rules the schedule and the stop)
    if distributed.any_rank([clock.time_up()], run.dist.device)[0]:
        status = StopReason.BUDGET  # resumed after the budget was spent (a restart after the run ended): no steps
    clock.start()
    pending = progress.eval_pending
    if run.val_files and (pending is not None or cfg.eval.at_start and progress.step == 0) and status is None:
        # the window of the step the eval was due after (eval.at_start: step 0's, the first step's)
        run.model.module.set_progress(clock.progress(0) if pending is None else pending)
        progress.eval_pending = None
        time_up, status = loop_eval(run, loop)
        status = status or (StopReason.BUDGET if time_up else None)
    while status is None:
        if cfg.train.steps and progress.step >= cfg.train.steps:
            status = StopReason.COMPLETED if cfg.train.schedule == "step" else StopReason.MAX_STEPS
            break
        status = timed_step(run, loop, batches)
    last = run.flags.collect()  # the last step's, when it ended the loop: a non-finite step is never saved
    if last and last.nonfinite:
        diverged(run, *loop.recent[1])
    clock.pause()
    progress.wall["train_s"] += time.perf_counter() - t0
    gc.enable()
    return status


def timed_step(run: Run, loop: Loop, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> StopReason | None:
    """One step of the loop: train, log, exchange the Flags, and act on them when they call for it; why the run
    stops after this step, or None."""
    cfg, progress = run.cfg, run.progress
    # before progress.step moves on: this step's batch stage, the one train_step runs
    tokens, seq_len = run.tokens_per_step, run.clock.seq_len(progress.step)
    every_log = cfg.log.every_steps
    # and a run's first step, so that its pace shows at once (not a resumed launch's: a row the run would lack)
    logs = bool(every_log) and ((progress.step + 1) % every_log == 0 or progress.step == 0)
    loss, norm, wait = train_step(run, batches, norm_wanted=logs)
    progress.step += 1
    progress.tokens += tokens
    progress.flops += run.flops_per_token(seq_len) * tokens  # train_step set this step's window
    progress.data_wait += wait
    if gc.isenabled():
        # a GC pass can stall a step for longer than the step takes: freeze what exists, collect in evals
        gc.collect()
        gc.freeze()
        gc.disable()
    previous = run.flags.collect()  # the step before's: done on the GPU while the host queued this one
    eval_due = bool(run.val_files) and run.clock.elapsed() >= loop.next_eval_s
    save_due = 0 < cfg.train.checkpoint_every_s <= time.perf_counter() - loop.last_save
    run.flags.start(run.clock, bool(run.stop_requested), eval_due, save_due, loss, norm)
    if logs:
        log_step(run, loss, norm, loop.since)
        loop.since = (progress.step, run.clock.elapsed(), progress.tokens)
    every = cfg.eval.every_steps
    step_eval = bool(run.val_files and every) and progress.step % every == 0
    loop.recent = [loop.recent[1], (progress.step, loss, norm)]
    flags = run.flags.agree(run.clock, previous, step_eval)
    if flags is None:
        return None
    if flags.nonfinite:
        diverged(run, *loop.recent[0 if previous and previous.nonfinite else 1])
    return act(run, loop, flags, step_eval)


def loop_eval(run: Run, loop: Loop) -> tuple[bool, StopReason | None]:
    """An eval of the timed loop (eval.at_start's included): (whether it spent the rest of the budget, TARGET
    where it reached the target and eval.stop_at_target stops there)."""
    cfg, clock, time_up = run.cfg, run.clock, False
    eval_and_record(run, on_clock=cfg.train.evals_on_clock)
    if cfg.train.evals_on_clock:  # the eval may have spent the rest of the budget: start no step after it
        [time_up] = distributed.any_rank([clock.time_up()], run.dist.device)
    loop.next_eval_s = next_multiple(clock.elapsed(), cfg.eval.every_s)
    reached = cfg.eval.stop_at_target and run.progress.time_to_target is not None
    return time_up, StopReason.TARGET if reached else None


def act(run: Run, loop: Loop, flags: Flags, step_eval: bool) -> StopReason | None:
    """Stop, evaluate (by `flags` or the step count: `step_eval`) and save as the agreed `flags` say; why the run
    stops, or None."""
    status = None
    if flags.sigterm:  # any rank's signal; this rank's own says which
        # an eval due now is saved as due: a resumed run holds it first, so the two halves log and stop as one run
        due = (flags.eval_due or step_eval) and not flags.time_up
        run.progress.eval_pending = run.trained_at if due else None
        return StopReason.INTERRUPTED if signal.SIGINT in run.stop_requested else StopReason.SIGTERM
    # at the budget the final eval, off the clock, takes the place of this one
    if (flags.eval_due or step_eval) and not flags.time_up:
        time_up, status = loop_eval(run, loop)
        flags = flags._replace(time_up=time_up)
    if flags.save_due and status is None:
        with run.clock.paused():
            save(run)
        loop.last_save = time.perf_counter()
    if flags.time_up and status is None:
        status = StopReason.BUDGET
    return status


def finish(run: Run, status: StopReason) -> None:
    """Save, then the final eval (after the clock stopped; skipped on SIGTERM to save the grace period) and under
    eval.target_time = "end" the time to target it decides, summary.

    The checkpoint goes first: a final eval that fails or runs into a job's time limit must not cost it. It is
    saved at the final eval's windows (eval.final_window), so that its evaluator scores what that eval did."""
    progress = run.progress
    final_eval = bool(run.val_files) and status not in STOPPED_BY_SIGNAL
    final_window = run.cfg.eval.final_window if final_eval else 0  # wider than the last eval's: a loss of its own
    final_val = None
    with run.model.module.widened(final_window):
        # else saved already: a periodic save on the last step, or a finished run relaunched
        if run.saved_step != progress.step or final_window:
            save(run)
        if final_eval:
            # a final eval done already (a run resumed from its end), or an eval at this step at the same windows
            evaluated_now = progress.final_val_step == progress.step or (
                progress.last_val_step == progress.step and not final_window)
            final_val = progress.last_val if evaluated_now else eval_and_record(run, on_clock=False)
            progress.final_val_step = progress.step
    if final_eval:
        target = run.cfg.eval.target_loss
        if run.cfg.eval.target_time == "end" and target and final_val <= target:
            progress.time_to_target = run.clock.run_time()  # summary.json's train_time_s
        # the state was saved before this eval: a budget extended later goes on from the counters after it
        record_end(run.run_dir, run.dist, progress.step, {"progress": asdict(progress),
                                                          "metrics_bytes": run.log.metrics_bytes()})
    run.loader.close()
    summary = summarize(run, status, final_val)
    run.log.summary(summary)
    curves = plot_or_warn(run.run_dir, run.log.print) if run.dist.master else None  # off the clock, which has stopped
    ignore_stop_signals()  # saved and summarised: a Ctrl-C from the last line on changes nothing
    run.log.print(done_line(summary, run.run_dir, curves))
    if status in STOPPED_BY_SIGNAL and run.cfg.train.save_checkpoint:  # else nothing was saved to resume from
        run.log.print(f"resume: {resume_command(run.cfg)}")
    run.log.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        try:
            main(CONFIG)
        except RunFinished as e:
            if os.environ.get("RANK", "0") == "0":
                print(e, flush=True)
        except ConfigError as e:
            report("config error", e)
        except ShardError as e:
            report("data error", e)
        except Diverged:
            sys.exit(1)  # rank 0 has printed why
        except DiskFullError as e:  # every file the run writes says so: the checkpoints, config.toml, the log's appends
            report("disk full", e)
        except RuntimeError as e:  # a collective's error where a peer died: one line, not each survivor's traceback
            if (lost := distributed.peer_gone(e)) is None:
                raise
            report("peer gone", lost)
