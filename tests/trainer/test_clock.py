"""trainer/clock.py: the LR schedule's shape and the pausable budget clock."""
from types import SimpleNamespace

import pytest

import trainer.clock
from trainer.clock import Clock, lr_multiplier
from trainer.config import TrainConfig


@pytest.mark.parametrize("progress, mult", [
    (0.0, 0.0), (0.05, 0.5), (0.1, 1.0), (0.5, 1.0), (0.7, 1.0), (0.85, 0.55), (1.0, 0.1), (1.5, 0.1), (-1, 0.0)])
def test_lr_multiplier_warms_up_holds_and_decays_to_the_final_fraction(progress, mult):
    assert lr_multiplier(progress, warmup_frac=0.1, decay_frac=0.3, final_frac=0.1) == pytest.approx(mult)


def test_lr_multiplier_without_warmup_or_decay_is_flat():
    assert [lr_multiplier(p, 0.0, 0.0, 0.0) for p in (0.0, 0.5, 1.0)] == [1.0, 1.0, 1.0]


def test_time_schedule_follows_the_budget_and_pauses(monkeypatch):
    now = [64.0]  # a clock the test moves: no sleep whose overrun on a loaded machine could spend the budget
    monkeypatch.setattr(trainer.clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = Clock(TrainConfig(budget_s=0.25, schedule="time", lr_decay_frac=1.0, lr_final_frac=0.0))
    assert clock.elapsed() == 0.0 and clock.lr_mult(0) == 1.0 and not clock.time_up()
    clock.start()
    now[0] += 0.125  # binary fractions: exact sums
    with clock.paused():
        now[0] += 0.25
        assert clock.elapsed() == 0.125  # nothing charged while paused
    assert clock.elapsed() == 0.125 and clock.lr_mult(0) == 1.0  # the LR moves with the agreed time
    clock.sync(clock.elapsed())
    assert clock.lr_mult(0) == 0.5
    now[0] += 0.125
    clock.sync(clock.elapsed())
    assert clock.time_up() and clock.lr_mult(0) == 0.0
    clock.pause()
    restored = Clock(clock.cfg)
    restored.load_state_dict(clock.state_dict())
    assert restored.elapsed() == clock.elapsed() and restored.started_at is None and restored.lr_mult(0) == 0.0


def test_step_schedule_ignores_the_clock():
    clock = Clock(TrainConfig(schedule="step", max_steps=100, lr_warmup_frac=0.1, lr_decay_frac=0.5,
                              lr_final_frac=0.2))
    assert [clock.lr_mult(s) for s in (0, 5, 10, 50, 75, 100)] == pytest.approx([0.0, 0.5, 1.0, 1.0, 0.6, 0.2])
    assert not clock.time_up()  # no budget: only max_steps ends the run


def test_time_schedule_ends_on_whichever_limit_comes_first():
    """A reachable max_steps (the hackathon starter passes 5000) still gets a decayed LR at its last step;
    an unreachable one leaves the time schedule alone."""
    clock = Clock(TrainConfig(budget_s=3600.0, schedule="time", max_steps=100, lr_decay_frac=0.5,
                              lr_final_frac=0.0))
    clock.start()
    assert clock.lr_mult(0) == 1.0 and clock.lr_mult(75) == pytest.approx(0.5, abs=1e-3)
    assert clock.lr_mult(100) == pytest.approx(0.0, abs=1e-3)
    unreachable = Clock(TrainConfig(budget_s=3600.0, schedule="time", max_steps=10**9, lr_decay_frac=0.5))
    unreachable.start()
    unreachable.sync(1800.0)
    assert unreachable.progress(100) == 0.5
