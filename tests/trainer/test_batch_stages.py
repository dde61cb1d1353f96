"""The batch schedule (train.batch_stages, train.batch_stage_lr): the stage of each step under a step and a time
schedule, its micro-steps and LR multiplier, the checks of the keys, and what a resume does with them; the loss
scaled with the stage's tokens (train.stage_loss_scale) in a real run."""
import dataclasses
import sys
from types import SimpleNamespace

import pytest

import trainer.clock
from tests.helpers import ROOT, run, tiny_args, tiny_data, train_values
from trainer.clock import Clock, lr_multiplier, stage_of
from trainer.config import ConfigError, TrainConfig, check_resume, parse_args
from trainer.resume import change_lines

TINY = str(ROOT / "configs" / "tiny.toml")


@pytest.mark.parametrize("progress, stage", [
    (0.0, 0), (0.3333, 0), (1 / 3, 1), (0.5, 1), (0.6666, 1), (2 / 3, 2), (1.0, 2), (1.5, 2), (-0.1, 0)])
def test_three_equal_stages_start_at_each_third_and_the_last_runs_on(progress, stage):
    assert stage_of(progress, 3) == stage


def test_one_stage_or_none_is_stage_zero_throughout():
    assert [stage_of(p, n) for n in (0, 1) for p in (0.0, 0.5, 1.0, 2.0)] == [0] * 8


@pytest.mark.parametrize("max_steps", [7, 10, 30, 31, 100])
def test_under_a_step_schedule_stage_k_starts_at_the_first_step_past_k_thirds(max_steps):
    """Step s (s steps done) is in stage k from the first s with s / max_steps >= k / 3, the integer ceiling of
    k * max_steps / 3: exactly at 10 and 20 of 30, no float rounding a step early or late."""
    clock = Clock(TrainConfig(schedule="step", max_steps=max_steps, grad_accum=2, batch_stages=[1, 2, 3]))
    starts = [-(-k * max_steps // 3) for k in range(3)]
    want = [2 * (1 + sum(s >= start for start in starts[1:])) for s in range(max_steps)]
    assert [clock.micro_steps(s) for s in range(max_steps)] == want
    assert clock.cfg.stage_shapes() == [(2, 1024), (4, 1024), (6, 1024)]
    assert {clock.seq_len(s) for s in range(max_steps)} == {1024} and clock.rows_ahead(0) == [1024]


def test_batch_stage_rows_lengthen_each_stages_rows_instead_of_adding_micro_steps():
    clock = Clock(TrainConfig(schedule="step", max_steps=30, grad_accum=2, seq_len=64, batch_stages=[1, 2, 3],
                              batch_stage_rows=True))
    assert clock.cfg.stage_shapes() == [(2, 64), (2, 128), (2, 192)] and clock.cfg.longest_row == 192
    assert [(clock.micro_steps(s), clock.seq_len(s)) for s in (9, 10, 19, 20, 35)] == [
        (2, 64), (2, 128), (2, 128), (2, 192), (2, 192)]
    # what a warm-up compiles: the shapes still ahead of the step, each once
    assert (clock.rows_ahead(0), clock.rows_ahead(15), clock.rows_ahead(29)) == ([64, 128, 192], [128, 192], [192])
    assert Clock(TrainConfig(schedule="step", max_steps=40, batch_stages=[1, 2, 2, 1],
                             batch_stage_rows=True)).rows_ahead(0) == [1024, 2048]


def test_without_a_batch_schedule_every_step_is_grad_accum_and_the_lr_the_schedules_own():
    cfg = TrainConfig(schedule="step", max_steps=40, grad_accum=3, lr_warmup_frac=0.1, lr_decay_frac=0.5,
                      lr_final_frac=0.1)
    clock = Clock(cfg)
    assert cfg.stage_shapes() == [(3, 1024)] and {clock.micro_steps(s) for s in range(41)} == {3}
    # bit for bit what it was before the batch schedule: the schedule's multiplier itself
    assert [clock.lr_mult(s) for s in range(41)] == [lr_multiplier(s / 40, 0.1, 0.5, 0.1) for s in range(41)]


def test_each_stages_lr_multiplier_scales_the_schedules():
    """Thirds of 30 steps, flat to the half, then a linear decay to 0: steps 0-9 are stage 0, 10-19 stage 1,
    20-29 stage 2; step 15 ends the flat part, step 18 is at 0.8 of the rate, 21 at 0.6, 24 at 0.4, 30 at 0."""
    clock = Clock(TrainConfig(schedule="step", max_steps=30, lr_decay_frac=0.5, lr_final_frac=0.0,
                              batch_stages=[1, 2, 3], batch_stage_lr=[1.0, 1.52, 1.73]))
    assert [clock.lr_mult(s) for s in (0, 5, 9, 10, 15, 18, 21, 24, 30)] == pytest.approx(
        [1.0, 1.0, 1.0, 1.52, 1.52, 1.52 * 0.8, 1.73 * 0.6, 1.73 * 0.4, 0.0])
    # stages without multipliers keep the schedule's rate
    plain = Clock(TrainConfig(schedule="step", max_steps=30, lr_decay_frac=0.5, batch_stages=[1, 2, 3]))
    assert [plain.lr_mult(s) for s in (5, 15, 24)] == pytest.approx([1.0, 1.0, 0.4])


def test_under_a_time_schedule_the_stage_follows_the_agreed_time_only(monkeypatch):
    """The stage moves with `synced`, the time every rank agreed on, not with this rank's own stopwatch."""
    now = [100.0]
    monkeypatch.setattr(trainer.clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = Clock(TrainConfig(schedule="time", budget_s=9.0, batch_stages=[1, 2, 4], batch_stage_lr=[1, 2, 3],
                              lr_decay_frac=0.0))
    clock.start()
    now[0] += 8.0
    assert clock.elapsed() == 8.0 and (clock.micro_steps(0), clock.lr_mult(0)) == (1, 1)  # not agreed yet
    stages = []
    for agreed in (0.0, 2.9, 3.0, 5.9, 6.0, 9.0, 20.0):
        clock.sync(agreed)
        stages.append((clock.micro_steps(0), clock.lr_mult(0)))
    assert stages == [(1, 1), (1, 1), (2, 2), (2, 2), (4, 3), (4, 3), (4, 3)]


@pytest.mark.parametrize("args, needle", [
    (["--train.batch_stages=[1, 0]"], "train.batch_stages = [1, 0] must hold positive integers"),
    (["--train.batch_stages=[1, 1.5]"], "train.batch_stages = [1, 1.5] must hold positive integers"),
    (["--train.batch_stages=[true, 2]"], "train.batch_stages = [True, 2] must hold positive integers"),
    (["--train.batch_stages=[1, 2]", "--train.batch_stage_lr=[1.0, -1.0]"],
     "train.batch_stage_lr = [1.0, -1.0] must hold positive numbers"),
    (["--train.batch_stages=[1, 2]", "--train.batch_stage_lr=[1.0, \"x\"]"],
     "train.batch_stage_lr = [1.0, 'x'] must hold positive numbers"),
    (["--train.batch_stages=[1, 2, 3]", "--train.batch_stage_lr=[1.0, 1.5]"],
     "train.batch_stage_lr = [1.0, 1.5] must give one LR multiplier for each stage of train.batch_stages = "
     "[1, 2, 3], or be [] for 1.0 in every stage"),
    (["--train.batch_stage_lr=[2.0]"], "train.batch_stage_lr = [2.0] must give one LR multiplier for each stage "
                                       "of train.batch_stages = []"),
    (["--train.batch_stages=3"], "train.batch_stages must be list"),
    (["--train.batch_stage_rows=true", "--data.shuffle=false"],
     "train.batch_stage_rows = true lengthens each batch stage's rows, and train.batch_stages = [] has no stages"),
    (["--train.batch_stages=[1, 2]", "--train.batch_stage_rows=true"],
     "train.batch_stage_rows = true lengthens the rows stage by stage, and the shuffled stream's slots have one "
     "length: set data.shuffle = false"),
    (["--train.batch_stages=[1, 3]", "--train.batch_stage_rows=true", "--data.shuffle=false", "--train.seq_len=64",
      "--model.rotary=false", "--model.block_size=128"],
     "train.seq_len x max(train.batch_stages) = 192 (train.batch_stage_rows) is longer than model.block_size = 128"),
])
def test_bad_batch_stages_are_refused_naming_the_key_and_the_fix(args, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", TINY, "--data.train=x", *args])
    assert needle in str(e.value)


def test_the_records_schedule_is_accepted_and_written_as_given():
    cfg = parse_args(["--config", TINY, "--data.train=x", "--train.batch_stages=[1, 2, 3]",
                      "--train.batch_stage_lr=[1, 1.52, 1.73]"])
    assert cfg.to_dict()["train"]["batch_stages"] == [1, 2, 3]
    assert [m for m, _ in cfg.train.stage_shapes()] == [2, 4, 6]  # tiny.toml's grad_accum = 2 times each stage


def test_a_resume_refuses_a_changed_batch_schedule():
    base = ["--config", TINY, "--data.train=x"]
    saved = parse_args(base).to_dict()
    for key, value in (("batch_stages", "[1, 2]"), ("batch_stage_lr", "[1.0]")):
        extra = [] if key == "batch_stages" else ["--train.batch_stages=[2]"]
        with pytest.raises(ConfigError, match=f"train.{key}: saved"):
            check_resume(saved, parse_args([*base, *extra, f"--train.{key}={value}"]), "runs/r")


def test_an_extended_budget_says_when_it_moves_the_next_step_to_another_stage():
    base = ["--config", TINY, "--data.train=x", "--train.batch_stages=[1, 2, 3]", "--train.lr_warmup_frac=0"]
    saved = parse_args([*base, "--train.max_steps=30"]).to_dict()
    cfg = parse_args([*base, "--train.max_steps=60", "--extend-budget"])
    lines = change_lines(cfg.train, saved["train"], Clock(cfg.train), 30, check_resume(saved, cfg, "runs/r"))
    # step 31 was past the end (the last stage: 3 x grad_accum 2 micro-steps, LR 0.1); now it is halfway (the
    # second stage, 2 x 2, and a flat LR)
    assert "step 31 runs at LR multiplier 1.000 instead of 0.100 and 4 micro-steps instead of 6 " \
           "(train.batch_stages)" in lines[-1]


def test_an_extended_budget_says_when_it_moves_the_next_step_to_longer_rows():
    base = ["--config", TINY, "--data.train=x", "--train.batch_stages=[1, 2, 3]", "--train.lr_warmup_frac=0",
            "--train.batch_stage_rows=true", "--data.shuffle=false", "--model.block_size=192"]
    saved = parse_args([*base, "--train.max_steps=30"]).to_dict()
    cfg = parse_args([*base, "--train.max_steps=60", "--extend-budget"])
    lines = change_lines(cfg.train, saved["train"], Clock(cfg.train), 30, check_resume(saved, cfg, "runs/r"))
    rows = cfg.train.seq_len
    assert f"and rows of {2 * rows} tokens instead of {3 * rows} (train.batch_stage_rows)" in lines[-1]


def test_lr_stages_may_start_where_batch_stage_lr_at_says_and_decay_to_a_floor_of_the_base_rate():
    """Two stages of 20 steps, the second's rate x 2 past 40% of them (from step 9: record 46's rate rises where
    step / steps > 0.33) while its batch waits for step 10; the decay over the last half runs from each stage's rate
    down to 0.1 of the base rate (lr_final_of = "base"): at step 15, halfway, 2 x 0.5 + 0.1 x 0.5."""
    cfg = TrainConfig(schedule="step", max_steps=20, batch_stages=[1, 2], batch_stage_lr=[1.0, 2.0],
                      batch_stage_lr_at=[0.4], lr_decay_frac=0.5, lr_final_frac=0.1, lr_final_of="base")
    clock = Clock(cfg)
    assert [clock.micro_steps(s) for s in (7, 8, 9, 10)] == [1, 1, 1, 2]
    assert [clock.lr_mult(s) for s in (0, 8, 9, 10, 15, 20)] == pytest.approx([1.0, 1.0, 2.0, 2.0, 1.05, 0.1])
    # a fraction of the stage's rate, as before: the same decay ends at 0.1 x 2
    stage = Clock(dataclasses.replace(cfg, lr_final_of="stage"))
    assert [stage.lr_mult(s) for s in (15, 20)] == pytest.approx([2 * 0.55, 0.2])


@pytest.mark.parametrize("value", ["[0.33]", "[0.66, 0.33]", "[0.0, 0.66]", "[0.33, 1.0]"])
def test_lr_stage_starts_that_do_not_rise_within_the_run_one_per_later_stage_are_refused(value):
    with pytest.raises(ConfigError, match=r"train.batch_stage_lr_at = .* must give, for train.batch_stage_lr = "
                                          r"\[1.0, 1.5, 2.0\], the progress at which each stage after the first"):
        parse_args(["--config", TINY, "--data.train=x", "--train.batch_stages=[1, 2, 3]",
                    "--train.batch_stage_lr=[1.0, 1.5, 2.0]", f"--train.batch_stage_lr_at={value}"])


@pytest.mark.parametrize("key, value", [("batch_stage_lr_at", "[0.4]"), ("lr_final_of", "base"),
                                        ("extension_steps", "5")])
def test_a_resume_refuses_a_change_of_where_the_stages_fall(key, value):
    base = ["--config", TINY, "--data.train=x", "--train.batch_stages=[1, 2]", "--train.batch_stage_lr=[1, 2]"]
    saved = parse_args(base).to_dict()
    with pytest.raises(ConfigError, match=f"train.{key}: saved"):
        check_resume(saved, parse_args([*base, f"--train.{key}={value}"]), "runs/r")


@pytest.mark.parametrize("stages, rows, scales", [
    ([1, 2, 3], False, [1.0, 2.0, 3.0]), ([1, 2, 3], True, [1.0, 2.0, 3.0]), ([2, 3], True, [1.0, 1.5]),
    ([2, 3], False, [1.0, 1.5]), ([1, 2, 2, 1], True, [1.0, 2.0, 2.0, 1.0])])
def test_the_stage_loss_scale_is_each_stages_tokens_over_the_first_stages(stages, rows, scales):
    """More micro-steps (rows = false) or longer rows (true): the tokens decide, not the micro-steps or the stage."""
    cfg = TrainConfig(grad_accum=8, seq_len=64, batch_stages=stages, batch_stage_rows=rows)
    assert cfg.loss_scales() == [1.0] * len(stages)  # the key off
    assert dataclasses.replace(cfg, stage_loss_scale=True).loss_scales() == scales


@pytest.mark.parametrize("rows", [False, True])
def test_the_stage_loss_scale_doubles_the_gradient_of_a_stage_twice_as_large(tmp_path, rows):
    """train.stage_loss_scale, as record 46's summed loss: a step of the second stage (twice the first's tokens, in
    twice the micro-steps or in rows twice as long) backpropagates twice its mean loss. Against the run without the
    key, the first stage's steps are the same; the second stage's first step, on the same weights and batch, has the
    same loss and exactly twice the gradient norm (doubling is exact); AdamW's next steps differ, its moments
    having seen the smaller gradients."""
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    common = ["--train.max_steps=6", "--train.batch_stages=[1, 2]", "--train.lr_warmup_frac=0", "--eval.every_s=0"]
    if rows:
        common += ["--train.batch_stage_rows=true", "--data.shuffle=false", "--model.block_size=128"]
    for run_id, extra in (("mean", []), ("scaled", ["--train.stage_loss_scale=true"])):
        run([sys.executable, *tiny_args(data, runs, run_id, *common, *extra)])
    (mean, scaled), (mean_norm, scaled_norm) = ([train_values(runs / r, key) for r in ("mean", "scaled")]
                                                for key in ("loss", "grad_norm"))
    assert len(mean) == len(scaled) == 6  # steps 0-2 in the first stage, 3-5 in the second
    assert mean[:4] == scaled[:4] and mean_norm[:3] == scaled_norm[:3]
    assert scaled_norm[3] == 2 * mean_norm[3]
    assert all(a != b for a, b in zip(mean[4:], scaled[4:]))


def test_the_stage_loss_scale_needs_batch_stages():
    with pytest.raises(ConfigError, match=r"train.stage_loss_scale = true scales each step's loss by its batch "
                                          r"stage's tokens, and train.batch_stages = \[\] has one stage"):
        parse_args(["--config", TINY, "--data.train=x", "--train.stage_loss_scale=true"])
