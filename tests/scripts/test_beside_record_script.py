"""The record's script and log read as text: its code, its Hyperparameters read and rewritten byte for byte, its
schedule and eval steps, its log lines."""
import pytest

from scripts.beside.record_script import (RecordError, eval_steps, hyperparameters, parse_log, record_code, rewrite,
                                          step_tokens)
from tests.scripts.beside_fixtures import RECORD, record_log, record_script


def test_the_code_comes_from_a_log_or_a_script_and_nothing_else(tmp_path):
    assert record_code(record_script(tmp_path)) == RECORD
    assert record_code(record_log(tmp_path / "run.txt", {0: (10.8, 0)}, 2)) == RECORD
    (tmp_path / "notes.txt").write_text("a log without its code\n")
    with pytest.raises(RecordError, match="notes.txt: no line of 100 '='.*train_gpt.py"):
        record_code(tmp_path / "notes.txt")


def test_hyperparameters_are_read_with_their_arithmetic():
    hp = hyperparameters(RECORD, "x.py")
    assert hp["train_bs_schedule"] == (2560, 5120, 7680) and hp["val_batch_size"] == 2560
    assert hp["num_iterations"] == 100 and hp["run_id"] is None  # a uuid is no plain value


def test_a_rewrite_changes_the_named_defaults_only():
    new = rewrite(RECORD, {"num_scheduled_iterations": 12, "num_extension_iterations": 0, "val_tokens": 2560}, "x.py")
    changed = [(a, b) for a, b in zip(RECORD.splitlines(), new.splitlines()) if a != b]
    assert changed == [
        ("    val_tokens: int = 4 * 2560  # several val batches", "    val_tokens: int = 2560  # several val batches"),
        ("    num_scheduled_iterations: int = 90  # steps of the schedule",
         "    num_scheduled_iterations: int = 12  # steps of the schedule"),
        ("    num_extension_iterations: int = 10", "    num_extension_iterations: int = 0")]
    assert hyperparameters(new, "x.py")["num_iterations"] == 12  # the derived field follows
    with pytest.raises(RecordError, match="x.py: its Hyperparameters have no field warmup_iters"):
        rewrite(RECORD, {"warmup_iters": 3}, "x.py")
    with pytest.raises(RecordError, match="no class Hyperparameters"):
        rewrite("x = 1\n", {"val_tokens": 1}, "x.py")


def test_the_schedule_and_eval_steps_are_the_records():
    hp = hyperparameters(rewrite(RECORD, {"num_scheduled_iterations": 12, "num_extension_iterations": 0,
                                          "val_loss_every": 5}, "x.py"), "x.py")
    assert [step_tokens(hp, s) for s in range(12)] == [2560] * 4 + [5120] * 4 + [7680] * 4
    assert eval_steps(hp) == [0, 5, 10, 12]
    full = hyperparameters(RECORD, "x.py")
    assert step_tokens(full, 89) == 7680 and step_tokens(full, 90) == 7680 and eval_steps(full) == [0, 25, 50, 75, 100]


def test_the_log_lines_are_read(tmp_path):
    run = parse_log(record_log(tmp_path / "log.txt", {0: (10.8258, 0), 3: (7.5, 31)}, 3).read_text())
    assert run.evals == [(0, 10.8258, 0), (3, 7.5, 31)] and run.steps == 3
    assert run.step_ms == {1: 10, 2: 20, 3: 30}
    assert (run.peak_allocated_mib, run.peak_reserved_mib) == (1234, 2345)
    assert parse_log("step:1/5 train_time:99ms step_avg:99.00ms\n").step_ms == {1: 99}  # a log cut short
