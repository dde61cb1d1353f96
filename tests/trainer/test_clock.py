"""trainer/clock.py: the LR schedule's shape and the pausable budget clock."""
from types import SimpleNamespace

import pytest

import trainer.clock
from trainer.clock import Clock, lr_multiplier
from trainer.config import ConfigError, TrainConfig, parse_args


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


def test_extension_steps_run_after_a_step_schedule_at_its_end():
    cfg = TrainConfig(schedule="step", max_steps=10, extension_steps=3, lr_decay_frac=0.5, lr_final_frac=0.1,
                      batch_stages=[1, 2])
    clock = Clock(cfg)
    assert cfg.steps == 13 and TrainConfig(max_steps=10).steps == 10 and TrainConfig().steps == 0
    assert [clock.lr_mult(s) for s in (9, 10, 11, 12)] == pytest.approx([0.28, 0.1, 0.1, 0.1])
    assert {clock.micro_steps(s) for s in (10, 11, 12)} == {2} and clock.progress(12) == 1.2
    with pytest.raises(ConfigError, match="train.extension_steps = 5 extends a step schedule past its end"):
        parse_args(["--config", "configs/tiny.toml", "--data.train=x", "--train.schedule=time", "--train.budget_s=9",
                    "--train.extension_steps=5"])


def record_46_lr(step: int) -> float:
    """Record 46's get_lr, restated: the rate steps up after 33% and 66% of its 2,120 scheduled steps (x 1.51,
    x 1.93), and from 45% on falls linearly from there to 0.1 at the schedule's end, where it stays."""
    if step > 2120:
        return 0.1
    x = step / 2120
    peak = 1.93 if x > 0.66 else 1.51 if x > 0.33 else 1.0
    if x < 1 - 0.55:
        return peak
    w = (1 - x) / 0.55
    return w * peak + (1 - w) * 0.1


def test_the_speedrun_config_steps_its_lr_and_batch_as_record_46_at_every_step():
    cfg = parse_args(["--config", "configs/speedrun_8xh100.toml"]).train
    clock = Clock(cfg)
    assert cfg.steps == 2160 and cfg.schedule == "step"
    for step in range(2160):
        assert clock.lr_mult(step) == pytest.approx(record_46_lr(step), rel=1e-12), step
        # its get_bs: 8, 16, 24 sequences of 2,048 a GPU by thirds of the scheduled steps, 24 in the extension:
        # one row of 16,384, 32,768, 49,152 tokens
        assert (clock.micro_steps(step), clock.seq_len(step)) == (1, 16384 * (1, 2, 3)[min(3 * step // 2120, 2)]), step
    # where the record's stages fall: the rate moves at steps 700 and 1,400, the batch at 707 and 1,414
    assert [clock.lr_mult(s) for s in (699, 700, 1399, 1400)] == pytest.approx([1.0, 1.51, 0.9719, 1.2300],
                                                                                  abs=1e-4)
    assert [clock.seq_len(s) // 16384 for s in (706, 707, 1413, 1414)] == [1, 2, 2, 3]
