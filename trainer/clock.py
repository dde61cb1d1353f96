"""The training clock: a time budget, a pausable stopwatch, and the LR and batch schedules that follow it.

Stop rule: a rank wants to stop once elapsed >= budget, checked after every step. The wish is all-reduced (MAX)
with the step's other flags (trainer/flags.py); on GPU it is read one step later, so that no step waits for the GPU:
all ranks stop after the same step, the one after the step that saw the budget spent (the hackathon counts "from the
first forward pass to the last"; a step in flight may finish). On CPU it is read at once: the run stops on the step
that saw it. The time LR schedule follows the elapsed time all ranks agreed on (`sync`), not each rank's own
stopwatch: DDP replicas stay identical only if every rank uses the same LR. The batch schedule (train.batch_stages)
follows the same progress, so every rank runs the same micro-steps of the same rows.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterator

from model.config import stage_of  # the model's loss schedule uses the same stages
from trainer.config import TrainConfig


def lr_multiplier(progress: float, warmup_frac: float, decay_frac: float, final_frac: float) -> float:
    """LR multiplier at `progress` in [0, 1]: linear warm-up, flat, then linear decay to final_frac."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and progress < warmup_frac:
        return progress / warmup_frac
    if decay_frac > 0 and progress > 1 - decay_frac:
        return final_frac + (1 - final_frac) * (1 - progress) / decay_frac
    return 1.0


class Clock:
    """Training time charged to the budget: started at the first timed forward, pausable for evals."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.charged = 0.0           # seconds accumulated before the current running stretch
        self.started_at: float | None = None
        self.synced = 0.0            # elapsed seconds as all ranks agreed at the last check (the LR follows it)

    def start(self) -> None:
        """Start (or resume after a pause) charging time to the budget."""
        if self.started_at is None:
            self.started_at = time.perf_counter()

    def pause(self) -> None:
        """Stop charging time (evals in exclude_warmup mode, checkpoints)."""
        if self.started_at is not None:
            self.charged += time.perf_counter() - self.started_at
            self.started_at = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Charge nothing inside the block; the clock runs again after it only if it ran before."""
        running = self.started_at is not None
        self.pause()
        try:
            yield
        finally:
            if running:
                self.start()

    def elapsed(self) -> float:
        """Seconds charged so far."""
        running = time.perf_counter() - self.started_at if self.started_at is not None else 0.0
        return self.charged + running

    def run_time(self) -> float:
        """The training time of a run that has stopped: at least the time all ranks agreed on, which stopped it
        (this rank's own clock may have started later)."""
        return max(self.elapsed(), self.synced)

    def progress(self, step: int) -> float:
        """Fraction of the run done: of max_steps for a step schedule (past 1 in its extension_steps, which keep
        its end's LR, batch stage and window); for a time schedule, of whichever limit ends the run first, the
        budget or max_steps (so a reachable step cap, such as the hackathon starter's --max_steps, still ends on a
        decayed LR, and an unreachable one changes nothing)."""
        by_steps = step / self.cfg.max_steps if self.cfg.max_steps else 0.0
        if self.cfg.schedule == "step":
            return by_steps
        return max(self.synced / self.cfg.budget_s, by_steps)

    def lr_mult(self, step: int) -> float:
        """The LR multiplier for the step about to run (`step` steps done so far): the schedule's, times its LR
        stage's train.batch_stage_lr entry; under lr_final_of = "base" the decay ends at lr_final_frac itself."""
        train, progress = self.cfg, self.progress(step)
        stage_lr = train.batch_stage_lr[self.lr_stage(step)] if train.batch_stage_lr else 1.0
        final = train.lr_final_frac / stage_lr if train.lr_final_of == "base" else train.lr_final_frac
        return stage_lr * lr_multiplier(progress, train.lr_warmup_frac, train.lr_decay_frac, final)

    def lr_stage(self, step: int) -> int:
        """Whose train.batch_stage_lr entry the step about to run takes: its batch stage's, or the stage whose
        train.batch_stage_lr_at start it has passed (past it, not at it: record 46's `step / steps > 0.33`)."""
        starts = self.cfg.batch_stage_lr_at
        return sum(self.progress(step) > at for at in starts) if starts else self.stage(step)

    def stage(self, step: int) -> int:
        """The batch schedule's stage of the step about to run (0 without one). It follows the progress the LR
        does, hence the agreed time under a time schedule: every rank's step is in the same stage."""
        return stage_of(self.progress(step), len(self.cfg.batch_stages))

    def micro_steps(self, step: int) -> int:
        """The micro-batches the step about to run accumulates (`step` steps done so far)."""
        return self.cfg.stage_shapes()[self.stage(step)][0]

    def seq_len(self, step: int) -> int:
        """The tokens of each row of the step about to run (train.seq_len, or more under batch_stage_rows)."""
        return self.cfg.stage_shapes()[self.stage(step)][1]

    def rows_ahead(self, step: int) -> list[int]:
        """The row lengths of the step about to run and of the later stages, each once: the shapes a warm-up
        compiles."""
        return list(dict.fromkeys(row for _, row in self.cfg.stage_shapes()[self.stage(step):]))

    def warmup_steps(self, step: int) -> int:
        """The untimed steps train.py's warm-up runs before `step` (exclude_warmup): warmup_steps of each row
        length ahead."""
        if self.cfg.timing != "exclude_warmup":
            return 0
        return self.cfg.warmup_steps * len(self.rows_ahead(step))

    def sync(self, elapsed: float) -> None:
        """Adopt `elapsed`, the same on every rank (the max of their clocks), as the schedule's time."""
        self.synced = elapsed

    def time_up(self) -> bool:
        """True once the budget (if any) is spent."""
        return self.cfg.budget_s > 0 and self.elapsed() >= self.cfg.budget_s

    def state_dict(self) -> dict:
        """The charged time and the agreed time, for resume."""
        return {"elapsed": self.elapsed(), "synced": self.synced}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved charged time (the clock stays stopped until start())."""
        self.charged, self.started_at = float(state["elapsed"]), None
        self.synced = float(state["synced"])


def next_multiple(elapsed: float, every: float) -> float:
    """The first multiple of `every` after `elapsed` (inf when periodic evals are off)."""
    return (math.floor(elapsed / every) + 1) * every if every > 0 else math.inf
