"""What one training run holds (`Run`), its counters (`Progress`), why its loop stopped (`StopReason`), and the
`Hooks` through which an observer from outside joins it: train.py's steps read as plain functions of a Run."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from data.loader import TokenLoader
from trainer import distributed
from trainer.clock import Clock
from trainer.config import Config
from trainer.distributed import Dist
from trainer.flags import FlagExchange
from trainer.metrics import RunLog
from trainer.mfu import mfu_of
from trainer.parallel import ParallelModel
from trainer.runs import checkpoint_path


@dataclass
class Progress:
    """The run's counters; saved with the resume state."""
    step: int = 0
    tokens: int = 0
    flops: float = 0.0           # the training FLOPs of those tokens, each step's at its own attention window
    best_val: float | None = None
    last_val: float | None = None
    last_val_step: int = -1
    final_val_step: int = -1     # the step of the last final eval (finish's): done.json's "ended" counters hold it
    time_to_target: float | None = None
    # a stop signal came at a step whose eval was due: the training progress that step ran at (its window), where
    # the resumed run holds that eval before its first step; None: no eval due
    eval_pending: float | None = None
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
    trained_at: float = 0.0      # the clock's progress the last step ran at: its window, at which its evals score
    stop_requested: list = field(default_factory=list)   # the stop signals received (watch_stop_signals)
    saved_step: int = -1         # the step of the last complete save (or of the state resumed from)
    flags: FlagExchange = field(init=False)   # each step's stop/eval/save exchange (on GPU read a step late)
    hooks: Hooks = field(default_factory=lambda: Hooks())

    def __post_init__(self) -> None:
        self.flags = FlagExchange(self.dist.device)

    def tokens_by_stage(self) -> list[int]:
        """Training tokens of a step in each batch stage, over all ranks."""
        return self.cfg.train.tokens_by_stage(self.dist.world_size)

    def loss_scale(self, step: int) -> float:
        """What step `step`'s mean loss is multiplied by before its backward (TrainConfig.loss_scales)."""
        return self.cfg.train.loss_scales()[self.clock.stage(step)]

    @property
    def tokens_per_step(self) -> int:
        """Training tokens of the step about to run, over all ranks: its batch stage's micro-steps and rows."""
        return self.tokens_by_stage()[self.clock.stage(self.progress.step)]

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoint.pt goes: train.checkpoint_path, else the run folder."""
        return checkpoint_path(self.run_dir, self.cfg.train.checkpoint_path)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token of rows of `seq_len` tokens (default: the rows of the last step done, or of
        the first before it) at the attention window the model has now."""
        return self.model.module.flops_per_token(seq_len or self.clock.seq_len(max(self.progress.step - 1, 0)))

    def mfu(self, tok_s: float) -> float | None:
        """Model FLOPs utilisation at `tok_s` tokens/s over all ranks (GPU with known peak only), at the
        attention window the model has now."""
        return mfu_of(self.flops_per_token(), tok_s, self.dist)



class StopReason(StrEnum):
    """Why the timed loop stopped: summary.json's "status" and the last line's "done: <status>"."""
    COMPLETED = "completed"      # the end of a step schedule (train.schedule = "step")
    BUDGET = "budget"            # train.budget_s spent
    MAX_STEPS = "max_steps"      # train.max_steps reached under a time schedule
    TARGET = "target"            # eval.stop_at_target, and an eval reached eval.target_loss
    SIGTERM = "sigterm"          # the job is being stopped (a scheduler's time limit, a preemption)
    INTERRUPTED = "interrupted"  # Ctrl-C (SIGINT)


class Diverged(RuntimeError):
    """A step's loss or gradient norm, or the state before a save, was not finite: the run stopped without saving."""


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


def diverged(run: Run, step: int, loss: torch.Tensor, norm: torch.Tensor | None) -> None:
    """Stop the run at the non-finite step `step` (its loss and gradient norm given, where it computed one), saving
    nothing."""
    loss, *norm = distributed.mean_over_ranks(loss, *([] if norm is None else [norm]))
    said = "".join(f", gradient norm {n:.4g}" for n in norm) or " (no gradient norm taken: the cause may be earlier)"
    _stop(run, f"step {step}: loss {loss:.4g}{said}: not finite")


def refuse_nonfinite_state(run: Run) -> None:
    """Before a save, and at the end of a run that saves nothing: stop the run, saving nothing, if a weight, a held
    gradient (optim.adam_every) or an optimizer's state is not finite. A step that took no gradient norm
    (optim.grad_clip = 0, no log due) checked its loss alone: a gradient that went non-finite with a finite loss
    shows here (one pass over the state, on each rank: FSDP2's shards, each rank's own held gradients; the first
    bad parameter on any rank named)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    device, states = run.dist.device, {id(p): s for opt in run.optimizers for p, s in opt.state.items()}
    named, checks = [], []
    for name, p in run.model.module.named_parameters():
        tensors = [local(t) for t in (p, p.grad, *states.get(id(p), {}).values()) if isinstance(t, torch.Tensor)]
        named.append(name)
        # .to(device): an optimizer may keep a 0-dim step counter on the host
        checks += [torch.stack([torch.isfinite(t).all().to(device) for t in tensors if t.numel()]
                               or [torch.ones((), dtype=torch.bool, device=device)]).all()]
    first_bad = next((i for i, ok in enumerate(torch.stack(checks).tolist()) if not ok), len(named))
    first_bad = int(-distributed.max_over_ranks([-first_bad], device)[0])  # the least over the ranks
    if first_bad == len(named):
        return
    _stop(run, f"step {run.progress.step}: {named[first_bad]} (its weight, gradient or optimizer state) is not finite",
          "" if run.cfg.train.save_checkpoint
          else "so the run fails without its final eval (train.save_checkpoint = false: nothing to save)")


def _stop(run: Run, what: str, outcome: str = "") -> None:
    kept = f"the checkpoint of step {run.saved_step} is untouched" if run.saved_step >= 0 else "no checkpoint exists"
    clip = "" if run.cfg.optim.adam_every == 1 else ", with optim.adam_every = 1"  # a clip needs it
    msg = (f"{what}, {outcome or f'so training stopped without saving ({kept})'}. Try a lower learning rate "
           f"(optim.lr, or optim.muon_lr and the other *_lr keys for muon), gradient clipping (optim.grad_clip = "
           f"1.0{clip}), and check the data (data.vocab_check)")
    run.log.print(f"train.py: {msg}")  # log.txt's last line, by which trainer/plots.py labels the run diverged
    raise Diverged(msg)
