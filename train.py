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
import time
from typing import NoReturn

from trainer.config import Config, ConfigError, parse_args, to_toml


def fail(message: str, first: bool) -> None:
    """Exit 1; `message` goes to stderr only where `first` (the rank that reports it), so an error that every
    rank hits prints once."""
    if first:
        print(message, file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        # torchrun stops every rank once one exits: leave the first exit to the rank that prints, which may not
        # have got that far yet
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(10)
    sys.exit(1)


def interrupted(message: str) -> NoReturn:
    """Exit at once with 130, the shell's status for Ctrl-C; `message` on rank 0 only (every rank gets the
    signal). Raised from a signal handler, SystemExit still runs the `finally` blocks and atomic writes' cleanup."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"{message}\n".encode())  # not print(): the signal may have come while print held stdout
    raise SystemExit(130)


def watch_stop_signals(requested: list[int]) -> None:
    """From now on SIGTERM and a first Ctrl-C (SIGINT) append their number to `requested`: the loop stops after
    the step and saves. A signal after a Ctrl-C exits at once: a second Ctrl-C, or the SIGTERM that torchrun's
    agent sends its workers when Ctrl-C interrupts its own wait for them (it forwards the first as SIGINT)."""
    def on_signal(signum: int, _frame) -> None:
        if signal.SIGINT in requested:
            interrupted("train.py: interrupted again: stopped at once, without saving (the last save stays, and "
                        "the same command resumes from it)")
        requested.append(signum)
        if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
            os.write(2, b"train.py: Ctrl-C: stopping after this step to save the run (Ctrl-C again stops at once, "
                        b"without saving)\n")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


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

import contextlib  # noqa: E402  (the imports after the early parse above)
import copy  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from enum import StrEnum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from util.atomic import DiskFullError, write_text  # noqa: E402
from data.loader import TokenLoader  # noqa: E402
from data.val import PAD_TARGET  # noqa: E402
from data.shards import ShardError  # noqa: E402
from model.gpt import GPT  # noqa: E402
from optim.groups import build_optimizers, step_optimizers, untie_when_due, warmup_momentum  # noqa: E402
from util.plural import plural  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.checkpoint import (done_path, load_resume, restore, save_checkpoint, save_resume,  # noqa: E402
                                save_space, training_state)
from trainer.clock import Clock  # noqa: E402
from trainer.data import prefix_targets, resolve_data, train_loader, val_loader  # noqa: E402
from trainer.distributed import Dist  # noqa: E402
from trainer.flags import FlagExchange, Flags  # noqa: E402
from trainer.memory import check_memory  # noqa: E402
from trainer.metrics import RunLog, Summary, git_commit, hardware, peak_mem_gb  # noqa: E402
from trainer.mfu import mfu_of  # noqa: E402
from trainer.parallel import ParallelModel, autocast, parallelize  # noqa: E402
from trainer.plots import plot_or_warn  # noqa: E402
from trainer.resume import RunFinished, change_lines, default_run_id, open_run_folder, resume_command  # noqa: E402
from trainer.runs import STOPPED_BY_SIGNAL, checkpoint_path  # noqa: E402


@dataclass
class Progress:
    """The run's counters; saved with the resume state."""
    step: int = 0
    tokens: int = 0
    flops: float = 0.0           # the training FLOPs of those tokens, each step's at its own attention window
    best_val: float | None = None
    last_val: float | None = None
    last_val_step: int = -1
    time_to_target: float | None = None
    data_wait: float = 0.0
    wall: dict = field(default_factory=lambda: dict(init_s=0.0, warmup_s=0.0, train_s=0.0, eval_s=0.0,
                                                    checkpoint_s=0.0))
    # every key a resume changed, {"step", "key", "saved", "now"}: config.toml shows only the last values, and
    # the leaderboard keeps a run whose result a change can move apart from runs given those values from the start
    resume_changes: list = field(default_factory=list)


@dataclass
class Run:
    """Everything one training run holds, so the steps below read as plain functions of it."""
    cfg: Config
    dist: Dist
    run_dir: Path
    val_files: list[str]         # [] = no evals
    meta: dict
    log: RunLog
    model: ParallelModel         # what we call (DDP / FSDP2 / compiled) and its plain GPT, `model.module`
    optimizers: list[torch.optim.Optimizer]
    loader: TokenLoader
    clock: Clock
    progress: Progress = field(default_factory=Progress)
    stop_requested: list = field(default_factory=list)   # the stop signals received (watch_stop_signals)
    saved_step: int = -1         # the step of the last complete save (or of the state resumed from)
    flags: FlagExchange = field(init=False)   # each step's stop/eval/save exchange (on GPU read a step late)
    hooks: Hooks = field(default_factory=lambda: Hooks())

    def __post_init__(self) -> None:
        self.flags = FlagExchange(self.dist.device)

    @property
    def tokens_per_micro_step(self) -> int:
        """Training tokens of one micro-step, over all ranks."""
        return self.cfg.train.batch_size * self.cfg.train.seq_len * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:
        """Training tokens of the step about to run, over all ranks: its batch stage's micro-steps."""
        return self.tokens_per_micro_step * self.clock.micro_steps(self.progress.step)

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoint.pt goes: train.checkpoint_path, else the run folder."""
        return checkpoint_path(self.run_dir, self.cfg.train.checkpoint_path)

    def flops_per_token(self) -> float:
        """Training FLOPs per token of a step at the attention window the model has now."""
        return self.model.module.flops_per_token(self.cfg.train.seq_len)

    def mfu(self, tok_s: float) -> float | None:
        """Model FLOPs utilisation at `tok_s` tokens/s over all ranks (GPU with known peak only), at the
        attention window the model has now."""
        return mfu_of(self.flops_per_token(), tok_s, self.dist)


class Hooks:
    """How an observer from outside (scripts/gpu_check/probe.py) joins a run: each stage of the run is called
    through the method of its name, given the stage and its arguments, and by default just runs. An override may
    time the stage, look at what it returns, or run it again; train.py knows nothing of what it does."""

    def setup(self, stage: Callable[[Config, Dist], Run], cfg: Config, dist: Dist) -> Run:
        return stage(cfg, dist)

    def warm_up(self, stage: Callable[[Run], None], run: Run) -> None:
        stage(run)

    def train(self, stage: Callable[[Run], StopReason], run: Run) -> StopReason:
        return stage(run)

    def evaluate(self, stage: Callable[[Run], float], run: Run) -> float:
        return stage(run)


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
        if status == StopReason.INTERRUPTED:
            raise SystemExit(130)  # saved, but a script that ran train.py stops as if Ctrl-C had ended it
    finally:
        distributed.close()


def setup(cfg: Config, dist: Dist) -> Run:
    """Data, run folder, log, model, optimizers, loader; restore the resume state if there is one."""
    t0 = time.perf_counter()
    files, val_files, meta = resolve_data(cfg)
    check_memory(cfg, dist)  # a config that cannot fit is refused here, not killed by the OS at its first step
    prefixes = prefix_targets(cfg, meta) if cfg.model.prefix_weight else None  # the tokenizer's, before the folder
    if val_files:
        val_loader(cfg, dist, val_files)  # a val set too small for eval.tokens fails now, not after training
    if not cfg.log.run_id:
        cfg.log.run_id = distributed.broadcast(default_run_id(cfg.name))
    run_dir = Path(cfg.log.dir) / cfg.log.run_id
    marker, changes = open_run_folder(cfg, dist, run_dir)
    resumed = load_resume(run_dir, dist, marker) if marker else None
    config = cfg.to_dict()
    wandb_cfg = dict(project=cfg.log.wandb_project, name=cfg.log.wandb_run or cfg.log.run_id, config=config,
                     dir=str(run_dir)) if cfg.log.wandb else None
    # a fresh run in an existing folder starts metrics.jsonl over; a resumed one cuts it back to the saved step
    log = RunLog(run_dir, dist, metrics_bytes=resumed["metrics_bytes"] if resumed else 0, wandb_cfg=wandb_cfg)
    if dist.master:
        write_text(run_dir / "config.toml", to_toml(config))
    log.environment(dist)
    if cfg.starter:
        log.print(cfg.starter)

    torch.manual_seed(cfg.train.seed)  # the same on every rank: FSDP2 shards whatever each rank initialised
    gpt = GPT(cfg.model)
    if prefixes:
        gpt.set_prefix_targets(prefixes)
    model = parallelize(gpt, cfg.train, dist)
    run = Run(cfg, dist, run_dir, val_files, meta, log, model, build_optimizers(model.module, cfg.optim),
              train_loader(cfg, dist, files, meta), Clock(cfg.train))
    if resumed:
        restore(run.model.module, run.optimizers, run.loader, resumed)
        run.clock.load_state_dict(resumed["clock"])
        run.progress = Progress(**resumed["progress"])
        run.saved_step = run.progress.step
        run.progress.resume_changes += [{"step": run.progress.step, **c._asdict()} for c in changes]
        for line in change_lines(cfg.train, marker["config"]["train"], run.clock, run.progress.step, changes):
            log.print(line)
    per_step = " -> ".join(f"{run.tokens_per_micro_step * n:,}" for n in run.clock.micro_steps_by_stage())
    log.print(f"run {cfg.log.run_id} | {model.module.num_params() / 1e6:.2f}M params | {per_step} "
              f"tokens/step | {plural(dist.world_size, 'process', 'processes')}, "
              f"{model.kind} | compile {cfg.train.compile}"
              + (f" | resumed at step {run.progress.step}" if resumed else ""))
    warn_if_the_saves_do_not_fit(run)
    run.progress.wall["init_s"] += time.perf_counter() - t0
    return run


def warn_if_the_saves_do_not_fit(run: Run) -> None:
    """Rank 0 warns before the first step where the free space is short of what the run's saves will hold at
    their peak: checkpoint.pt holds the model's state dict, the resume state that and at most two optimizer
    moments per parameter (AdamW's), and each file's old copy stays until its new one is complete."""
    if not (run.dist.master and run.cfg.train.save_checkpoint):
        return
    # full sizes, also of DTensor shards; a tied head counts twice, as checkpoint.pt's CPU copies store it
    model = sum(v.numel() * v.element_size() for v in run.model.module.state_dict().values())
    moments = 2 * sum(p.numel() * p.element_size() for p in run.model.module.parameters())
    # in the order save() writes them; the resume state is on disk where its done.json is
    files = [(run.checkpoint_path, model), (done_path(run.run_dir), model + moments)]
    every, budget = run.cfg.train.checkpoint_every_s, run.cfg.train.budget_s
    # periodic saves, then the final one; a time budget that ends before the first periodic save leaves only the
    # final one (evals off the clock can stretch the wall time that periodic saves follow: then one more comes)
    saves = 2 if every > 0 and not 0 < budget <= every else 1
    first = save_space(files, 1)
    for folder, need in save_space(files, saves).items():
        free = shutil.disk_usage(folder).free
        if free < need:
            which = "first" if free < first[folder] else "second"
            run.log.print(f"warning: {folder} has {free:,} bytes free, but the run's saves need about {need:,} "
                          f"there (checkpoint.pt: the model's {model:,} bytes; the resume state: those and "
                          f"{moments:,} of optimizer moments; each file's old copy stays until its new one is "
                          f"complete); its {which} save will fail: free space or move log.dir / "
                          f"train.checkpoint_path")


def set_lr(optimizers: list[torch.optim.Optimizer], mult: float, step: int) -> None:
    """Apply the schedule's multiplier to every group's base rate, and Muon's momentum warm-up at `step`
    (optim/__init__.py's contract)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * mult
            if "momentum_warmup_steps" in group:
                group["momentum"] = warmup_momentum(group, step)


def train_step(run: Run, batches) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over the micro-batches of its batch stage (grad_accum without train.batch_stages): (mean
    loss, gradient norm before clipping, seconds waiting for data: what the loader counted in its wait_s). The two
    tensors stay on the device: nothing in a step waits for the GPU.

    Phases, in order: per micro-batch the data, then forward + backward; the gradient norm (and clipping);
    the optimizer steps (each drops the gradients it applied: AdamW's wait for its step under optim.adam_every).
    Under model.untie_at the head follows the embedding until the untie: its gradient joins the embedding's before
    the norm, and it takes the embedding's weights after the optimizers. The flag exchange follows in train()."""
    step, gpt, adam_every = run.progress.step, run.model.module, run.cfg.optim.adam_every
    accum, dist = run.clock.micro_steps(step), run.dist
    total, waited = torch.zeros((), device=dist.device), run.loader.wait_s
    set_lr(run.optimizers, run.clock.lr_mult(step), step)
    # the attention window, the loss's weights and the head's untie follow the LR's clock
    progress = run.clock.progress(step)
    gpt.set_progress(progress)
    untie_when_due(gpt, run.optimizers, progress, step, adam_every)
    for micro in range(accum):
        x, y = next(batches)
        with run.model.grad_sync(micro == accum - 1), autocast(dist, run.cfg.train.dtype):
            _, loss = run.model(x, y)
            (loss / accum).backward()
        total += loss.detach()

    gpt.tie_grads()  # a head that follows the embedding: its gradient is the embedding's
    norm = run.model.clip_grads(run.cfg.optim.grad_clip)

    step_optimizers(run.optimizers, step, adam_every)
    gpt.tie_weights()
    return total / accum, norm, run.loader.wait_s - waited


def warm_up(run: Run) -> None:
    """exclude_warmup: run warmup_steps real steps (compiling every shape), then restore the state from before."""
    train_cfg = run.cfg.train
    if train_cfg.timing != "exclude_warmup" or train_cfg.warmup_steps <= 0:
        return
    t0, initial = time.perf_counter(), copy.deepcopy(training_state(run.model.module, run.optimizers, run.loader))
    batches = iter(run.loader)
    for _ in range(train_cfg.warmup_steps):
        train_step(run, batches)
    restore(run.model.module, run.optimizers, run.loader, initial)
    distributed.barrier()
    run.progress.wall["warmup_s"] += time.perf_counter() - t0
    run.log.print(f"warm-up: {plural(train_cfg.warmup_steps, 'step')} in {time.perf_counter() - t0:.1f}s; "
                  f"state restored")


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
    run.log.print(f"step {run.progress.step} | eval of {cfg.eval.tokens:,} tokens: "
                  f"{plural(len(batches), 'batch', 'batches')} per rank")
    t0 = shown = time.perf_counter()
    for done, (x, y) in enumerate(batches, 1):
        with autocast(dist, cfg.train.dtype):
            _, loss = model(x, y)
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
    if target and val <= target and progress.time_to_target is None:
        progress.time_to_target = run.clock.elapsed()
    progress.wall["eval_s"] += time.perf_counter() - t0
    run.log.metric({"type": "eval", "step": progress.step, "tokens": progress.tokens, "val_loss": val,
                    "elapsed_s": run.clock.elapsed()})
    run.log.print(f"step {progress.step} | val loss {val:.4f} | best {progress.best_val:.4f} | "
                  f"{run.clock.elapsed():.1f}s")
    return val


def mean_over_ranks(run: Run, *values: torch.Tensor) -> list[float]:
    """Each 0-dim tensor's mean over the ranks, on the host: one all-reduce, and a wait for the GPU."""
    return (distributed.all_reduce(torch.stack([v.detach().double() for v in values])) / run.dist.world_size).tolist()


def log_step(run: Run, loss: torch.Tensor, norm: torch.Tensor, since: tuple[int, float, int]) -> None:
    """Console line + metrics.jsonl record for the step just done (loss averaged over ranks, gradient norm
    before clipping: the same on every rank); its step time and tokens/s average the steps since `since`
    ((step, elapsed, tokens) at the last line)."""
    progress, clock, train_cfg = run.progress, run.clock, run.cfg.train
    loss, norm = mean_over_ranks(run, loss, norm)
    steps, seconds, tokens = progress.step - since[0], clock.elapsed() - since[1], progress.tokens - since[2]
    step_s = seconds / max(steps, 1)
    tok_s = tokens / seconds if seconds > 0 else 0.0
    mfu = run.mfu(tok_s)
    # never below 0: the step that spends the budget ends past it (and on GPU one more step runs)
    left = (f"{max(train_cfg.budget_s - clock.elapsed(), 0.0):.1f}s" if train_cfg.budget_s
            else plural(max(train_cfg.max_steps - progress.step, 0), "step"))
    group = run.optimizers[0].param_groups[0]  # the multiplier the step just done used, its batch stage's included
    run.log.metric({"type": "train", "step": progress.step, "tokens": progress.tokens, "loss": loss,
                    "grad_norm": norm, "lr_mult": group["lr"] / group["initial_lr"], "step_ms": 1000 * step_s,
                    "tok_s": tok_s, "mfu": mfu, "elapsed_s": clock.elapsed()})
    run.log.print(f"step {progress.step} | loss {loss:.4f} | grad norm {norm:.3f} | {1000 * step_s:.1f} ms | "
                  f"{tok_s:,.0f} tok/s"
                  + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else "")
                  + f" | {clock.elapsed():.1f}s elapsed, {left} left")


def save(run: Run) -> None:
    """checkpoint.pt (rank 0) and every rank's resume state; not charged to the training clock. Nothing with
    train.save_checkpoint = false: the periodic, final and SIGTERM saves all come here."""
    t0, cfg, dist = time.perf_counter(), run.cfg, run.dist
    if not cfg.train.save_checkpoint:
        return
    model_state = run.model.full_state()  # every rank: FSDP2 gathers the full state from them all
    if dist.master:
        save_checkpoint(run.checkpoint_path, cfg.to_dict(), model_state, run.progress.step)
    state = {**training_state(run.model.module, run.optimizers, run.loader), "clock": run.clock.state_dict(),
             "progress": asdict(run.progress), "metrics_bytes": run.log.metrics_bytes()}
    save_resume(run.run_dir, dist, run.progress.step, state, cfg.to_dict(), replicated=not run.model.sharded)
    run.saved_step = run.progress.step
    run.progress.wall["checkpoint_s"] += time.perf_counter() - t0


class StopReason(StrEnum):
    """Why the timed loop stopped: summary.json's "status" and the last line's "done: <status>"."""
    COMPLETED = "completed"      # the end of a step schedule (train.schedule = "step")
    BUDGET = "budget"            # train.budget_s spent
    MAX_STEPS = "max_steps"      # train.max_steps reached under a time schedule
    TARGET = "target"            # eval.stop_at_target, and an eval reached eval.target_loss
    SIGTERM = "sigterm"          # the job is being stopped (a scheduler's time limit, a preemption)
    INTERRUPTED = "interrupted"  # Ctrl-C (SIGINT)


class Diverged(RuntimeError):
    """A step's loss or gradient norm was not finite: the run stopped without saving."""


def diverged(run: Run, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
    """Stop the run at the non-finite step `step` (its loss and gradient norm given), saving nothing."""
    loss, norm = mean_over_ranks(run, loss, norm)
    kept = f"the checkpoint of step {run.saved_step} is untouched" if run.saved_step >= 0 else "no checkpoint exists"
    msg = (f"step {step}: loss {loss:.4g}, gradient norm {norm:.4g}: not finite, so training stopped without saving "
           f"({kept}). Try a lower learning rate (optim.lr, or optim.muon_lr and the other *_lr keys for muon), "
           f"gradient clipping (optim.grad_clip = 1.0), and check the data (data.vocab_check)")
    run.log.print(f"train.py: {msg}")
    raise Diverged(msg)


@dataclass
class Loop:
    """What the timed loop carries from one step to the next."""
    next_eval_s: float           # the clock time of the next eval by eval.every_s (inf: none)
    last_save: float             # perf_counter() at the last periodic save, or at the loop's start
    since: tuple[int, float, int]  # (step, elapsed, tokens) at the last log line: the next one averages from there
    first_step: int              # the loop's first step, logged whatever log.every_steps: the pace shows at once
    recent: list = field(default_factory=lambda: [None, None])  # (step, loss, norm) of the step before, this one


def train(run: Run) -> StopReason:
    """The timed loop; returns why it stopped (a StopReason); raises Diverged at a non-finite loss or gradient
    norm.

    The host waits for the GPU only where it must, so that it queues step N+1 while the GPU runs step N: the
    Flags exchange (trainer/flags.py) is read a step late, log_step all-reduces loss and gradient norm every
    log.every_steps steps, and evals, saves and stops sync anyway. No other .item(), .tolist() or .cpu() runs in
    the loop (clip_grads and optim/muon.py read nothing on the host).
    """
    cfg, progress, clock = run.cfg, run.progress, run.clock
    loop = Loop(_next_multiple(clock.elapsed(), cfg.eval.every_s), time.perf_counter(),
                (progress.step, clock.elapsed(), progress.tokens), progress.step + 1)
    t0, status, batches = time.perf_counter(), None, iter(run.loader)
    # a collective, so the ranks' clocks also start together (their max rules the schedule and the stop)
    if distributed.any_rank([clock.time_up()], run.dist.device)[0]:
        status = StopReason.BUDGET  # resumed after the budget was spent (a restart after the run ended): no steps
    clock.start()
    while status is None:
        if cfg.train.max_steps and progress.step >= cfg.train.max_steps:
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


def timed_step(run: Run, loop: Loop, batches) -> StopReason | None:
    """One step of the loop: train, log, exchange the Flags, and act on them when they call for it; why the run
    stops after this step, or None."""
    cfg, progress = run.cfg, run.progress
    tokens = run.tokens_per_step  # before progress.step moves on: this step's batch stage, the one train_step runs
    loss, norm, wait = train_step(run, batches)
    progress.step += 1
    progress.tokens += tokens
    progress.flops += run.flops_per_token() * tokens  # train_step set this step's window
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
    every_log = cfg.log.every_steps
    if every_log and (progress.step % every_log == 0 or progress.step == loop.first_step):
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


def act(run: Run, loop: Loop, flags: Flags, step_eval: bool) -> StopReason | None:
    """Stop, evaluate (by `flags` or the step count: `step_eval`) and save as the agreed `flags` say; why the run
    stops, or None."""
    cfg, clock, status = run.cfg, run.clock, None
    if flags.sigterm:  # any rank's signal; this rank's own says which
        return StopReason.INTERRUPTED if signal.SIGINT in run.stop_requested else StopReason.SIGTERM
    # at the budget the final eval, off the clock, takes the place of this one
    if (flags.eval_due or step_eval) and not flags.time_up:
        on_clock = cfg.train.timing == "from_first_forward"  # the hackathon clock runs through evals
        eval_and_record(run, on_clock=on_clock)
        if on_clock:  # the eval may have spent the rest of the budget: start no step after it
            [time_up] = distributed.any_rank([clock.time_up()], run.dist.device)
            flags = flags._replace(time_up=time_up)
        loop.next_eval_s = _next_multiple(clock.elapsed(), cfg.eval.every_s)
        if cfg.eval.stop_at_target and run.progress.time_to_target is not None:
            status = StopReason.TARGET
    if flags.save_due and status is None:
        with clock.paused():
            save(run)
        loop.last_save = time.perf_counter()
    if flags.time_up and status is None:
        status = StopReason.BUDGET
    return status


def _next_multiple(elapsed: float, every: float) -> float:
    """The first multiple of `every` after `elapsed` (inf when periodic evals are off)."""
    return (math.floor(elapsed / every) + 1) * every if every > 0 else math.inf


def finish(run: Run, status: StopReason) -> None:
    """Save, then the final eval (after the clock stopped; skipped on SIGTERM to save the grace period), summary.

    The checkpoint goes first: a final eval that fails or runs into a job's time limit must not cost it."""
    progress = run.progress
    # else saved already: a periodic save on the last step, or a finished run relaunched
    if run.saved_step != progress.step:
        save(run)
    final_val = None
    if run.val_files and status not in STOPPED_BY_SIGNAL:
        evaluated_now = progress.last_val_step == progress.step
        final_val = progress.last_val if evaluated_now else eval_and_record(run, on_clock=False)
    run.loader.close()
    summary = summarize(run, status, final_val)
    run.log.summary(summary)
    curves = plot_or_warn(run.run_dir, run.log.print) if run.dist.master else None  # off the clock, which has stopped
    val = f"final val loss {final_val:.4f}" if final_val is not None else "no final eval"
    if summary.final_val_bpb is not None:
        val += f" ({summary.final_val_bpb:.3f} bits/byte)"
    speed = f" at {summary.tokens_per_s:,.0f} tok/s" if summary.tokens_per_s else ""
    run.log.print(f"done: {status} | step {progress.step} | {summary.train_time_s:.1f}s | {val} | {progress.tokens:,} "
                  f"tokens{speed} | {run.run_dir}" + (f" | curves {curves}" if curves else ""))
    if status in STOPPED_BY_SIGNAL and run.cfg.train.save_checkpoint:  # else nothing was saved to resume from
        run.log.print(f"resume: {resume_command(run.cfg)}")
    run.log.close()


def summarize(run: Run, status: StopReason, final_val: float | None) -> Summary:
    """summary.json's values for the run that stopped for `status` with final val loss `final_val`."""
    cfg, progress, dist = run.cfg, run.progress, run.dist
    # text bytes per token, as prepare measured it (a bytes-tokenizer stream is slightly under 1: its EOT tokens)
    bytes_per_token = run.meta.get("bytes_per_token") or (1.0 if run.meta.get("tokenizer") == "bytes" else None)
    # at least the time all ranks agreed on, which stopped the run: this rank's own clock may have started later
    train_time = max(run.clock.elapsed(), run.clock.synced)
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
        git_commit=git_commit(), checkpoint_path=str(run.checkpoint_path), wall=progress.wall,
        resume_changes=progress.resume_changes)


def report(kind: str, error: Exception) -> None:
    """fail() with "train.py: <kind>: <error>", printed by the first rank to report an error of that kind: after
    the early parse an error may be one rank's own, or every rank's in its own words (each rank reads other
    windows of the data, and may find another bad token first)."""
    fail(f"train.py: {kind}: {error}", distributed.first_to_report(kind))


if __name__ == "__main__":
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
