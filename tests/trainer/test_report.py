"""What a run says about itself: summary.json's values (its MFU at the FLOPs each step spent, at its own window),
and the last line, which names the final val loss, its bits per byte, the tokens and their rate where it has them."""
import statistics
from pathlib import Path

import pytest

import train
import trainer.mfu
from model.masks import window_at
from tests.helpers import growing_window_run
from trainer.metrics import Summary
from trainer.report import done_line, summarize


def test_the_summarys_mfu_counts_each_steps_flops_at_its_own_window(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer.mfu, "peak_flops", lambda dist: 1e12)  # CPU has no peak of its own
    run = growing_window_run(tmp_path, "--train.max_steps=6")
    try:
        status = train.train(run)
    finally:
        run.loader.close()
        run.log.close()
    summary = summarize(run, status, None)
    gpt = run.model.module
    windows = [window_at(gpt.cfg, step / 6) for step in range(6)]  # a step schedule: step s at progress s / 6
    assert windows == [8, 13, 19, 24, 29, 35] and summary.steps == 6
    spent = statistics.fmean(gpt.flops_per_token(run.cfg.train.seq_len, w) for w in windows)
    assert summary.mfu == pytest.approx(trainer.mfu.mfu(spent, summary.tokens_per_s, 1e12, 1), rel=1e-12)
    assert run.mfu(summary.tokens_per_s) > 1.01 * summary.mfu  # what the last step's window alone read


def summary(**values) -> Summary:
    """A Summary of a run that stopped on its budget after 120 steps, with `values` on top."""
    fields = dict.fromkeys(Summary.__dataclass_fields__) | dict(
        status="budget", steps=120, train_time_s=61.25, tokens_seen=983_040, final_val_loss=None,
        final_val_bpb=None, tokens_per_s=None)
    return Summary(**(fields | values))


def test_the_last_line_says_why_it_stopped_and_what_it_reached_with_what_it_has():
    runs = Path("runs/cpu-1")
    assert done_line(summary(), runs, None) == ("done: budget | step 120 | 61.2s | no final eval | 983,040 tokens | "
                                                "runs/cpu-1")
    line = done_line(summary(final_val_loss=1.11694, final_val_bpb=1.6114, tokens_per_s=16049.6), runs,
                     runs / "loss.png")
    assert line == ("done: budget | step 120 | 61.2s | final val loss 1.1169 (1.611 bits/byte) | 983,040 tokens at "
                    "16,050 tok/s | runs/cpu-1 | curves runs/cpu-1/loss.png")
