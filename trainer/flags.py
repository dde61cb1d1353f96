"""What the ranks agree on after each step (stop, eval, save, the time the LR follows), read without stalling a GPU.

Reading a device value at once waits for all the work queued before it, so on a GPU each step's exchange is
started after its step and read after the next step is queued: an ordinary step waits for nothing, and a stop
lands one step late, on every rank the same step. A step that will act anyway (an eval, a save, a stop) reads its
own exchange at once and acts on the newest state. On CPU the exchange has finished when it starts, so every step
reads its own. The LR of step N+1 follows the time agreed after step N-1 on a GPU (after step N if step N acted),
after step N on CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.clock import Clock
from trainer.distributed import LateMax


class Flags(NamedTuple):
    """What every rank agrees on after a step: the maximum over the ranks of each one's clock and wishes."""
    elapsed: float               # the time the LR schedule follows (trainer/clock.py `sync`)
    time_up: bool
    sigterm: bool
    eval_due: bool               # by eval.every_s (every_steps needs no exchange: the step count is the same)
    save_due: bool
    nonfinite: bool              # the step's loss or gradient norm (where computed) was nan or inf, on the device

    def act(self) -> bool:
        """True if these flags call for a stop, an eval or a save."""
        return any(self[1:])


class FlagExchange:
    """One MAX all-reduce of a step's Flags, started after the step and collected after the next one is queued.

    `reduce` (a trainer/distributed.py LateMax) does the communication; an observer may wrap it to time it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reduce = LateMax(len(Flags._fields) - 1, 1, device)  # nonfinite is computed on the device

    def start(self, clock: Clock, stop: bool, eval_due: bool, save_due: bool, loss: torch.Tensor,
              norm: torch.Tensor | None) -> None:
        """Start this step's exchange (`norm`: None where the step computed none); `collect` reads it, after the
        next step on a GPU."""
        finite = torch.isfinite(loss) if norm is None else torch.isfinite(loss) & torch.isfinite(norm)
        nonfinite = (~finite).to(torch.float64).reshape(1)
        self.reduce.start([clock.elapsed(), clock.time_up(), stop, eval_due, save_due], nonfinite)

    def collect(self) -> Flags | None:
        """The Flags of the exchange started last (waiting for it if it is still running), or None if none is."""
        values = self.reduce.collect()
        return None if values is None else Flags(values[0], *(v > 0 for v in values[1:]))

    def agree(self, clock: Clock, previous: Flags | None, step_eval: bool) -> Flags | None:
        """On GPU: None when the step before's Flags (`previous`) and the step count (`step_eval`) ask for nothing;
        else those Flags merged with this step's, waiting for them. On CPU this step's Flags (`previous` is None
        there: it was collected before this step's exchange started). Either way `clock` adopts the newest
        agreed time."""
        if self.cuda and not (step_eval or (previous and previous.act())):
            if previous:
                clock.sync(previous.elapsed)
            return None
        now = self.collect()
        flags = Flags(*map(max, previous, now)) if previous else now
        clock.sync(flags.elapsed)
        return flags
