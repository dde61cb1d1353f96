"""train.py's timed loop in this process, on a clock the test moves: where a budget stops a CPU run, and what
the console shows of steps and evals."""
from tests.helpers import growing_window_run, ten_second_steps


def test_a_cpu_run_stops_on_the_step_that_spends_the_budget(tmp_path, monkeypatch, capsys):
    """25 s in 10-s steps: step 3 ends at 30 s and sees the budget spent; on CPU, where reading the step's
    flags costs nothing, no fourth step runs. The first step has its line whatever log.every_steps, and the
    time left is never negative."""
    import train
    ten_second_steps(monkeypatch)
    run = growing_window_run(tmp_path, "--train.schedule=time", "--train.budget_s=25", "--train.max_steps=0",
                             "--log.every_steps=3")
    try:
        status = train.train(run)
    finally:
        run.loader.close()
        run.log.close()
    assert (status, run.progress.step, run.clock.elapsed()) == ("budget", 3, 30.0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 3"]
    assert lines[0].endswith("10.0s elapsed, 15.0s left") and lines[1].endswith("30.0s elapsed, 0.0s left")


def test_an_eval_says_when_it_starts_and_how_far_it_got(tmp_path, monkeypatch, capsys):
    import train
    run = growing_window_run(tmp_path, "--data.val=holdout", "--eval.tokens=2048")
    monkeypatch.setattr(train, "EVAL_PROGRESS_S", 0.0)  # a progress line after every batch
    try:
        val = train.eval_and_record(run, on_clock=False)
    finally:
        run.loader.close()
        run.log.close()
    # 2,048 targets in sequences of 64, 4 rows a batch: 8 batches
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("step 0 | eval of 2,048 tokens: 8 batches per rank")
    progress = [line.split(",")[0] for line in lines[start + 1:] if line.startswith("eval: ")]
    assert progress == [f"eval: {k}/8 batches" for k in range(1, 9)]
    assert f"step 0 | val loss {val:.4f}" in lines[-1]
