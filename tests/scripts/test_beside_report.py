"""scripts/beside/report.py: the record's log kept without its code, the shared timed steps, the mask builds'
cost, and a report from one side alone."""
import json

import pytest

from scripts.beside import report
from scripts.beside.record_script import hyperparameters, parse_log, rewrite
from tests.scripts.beside_fixtures import RECORD, record_log

HP = hyperparameters(rewrite(RECORD, {"num_scheduled_iterations": 9, "num_extension_iterations": 0,
                                      "val_loss_every": 3}, "x.py"), "x.py")


def test_the_kept_log_has_the_codes_hash_in_place_of_the_code(tmp_path):
    kept = report.without_code(record_log(tmp_path / "log.txt", {0: (10.8, 0)}, 1).read_text())
    assert kept.startswith(f"(the record's code, {RECORD.count(chr(10))} lines, sha256 ")
    assert "Hyperparameters" not in kept and "step:0/1 val_loss:10.8000" in kept
    assert report.without_code("no code here\n") == "no code here\n"


def test_the_timed_steps_run_from_the_first_shared_eval_after_step_0_to_the_last():
    assert report.window([0, 3, 6, 9]) == (3, 9) and report.window([0, 9]) is None and report.window([]) is None
    rec = parse_log(record_log_text({0: (10.8, 0), 3: (8.0, 300), 9: (7.0, 900)}, 9))
    ours = {3: {"val_loss": 8.1, "tokens": 7680, "elapsed_s": 0.6}, 9: {"val_loss": 7.1, "tokens": 46080,
                                                                      "elapsed_s": 1.8}}
    speed = report.speeds(HP, rec, ours, (3, 9))
    # steps 3-5 of 5,120 tokens and 6-8 of 7,680: 38,400 tokens, in 0.6 s and 1.2 s
    assert speed["record"] == {"tokens": 38400, "s": 0.6, "tok_s": pytest.approx(64000)}
    assert speed["ours"]["tok_s"] == pytest.approx(32000)


def record_log_text(evals, steps):
    lines = [f"step:{s}/{steps} val_loss:{v:.4f} train_time:{ms}ms step_avg:1.00ms" for s, (v, ms) in evals.items()]
    return "\n".join(lines) + "\n"


def test_the_mask_builds_cost_each_record_step_its_attention_calls_times_its_micro_steps():
    standin = {"mask_ms": {"320": 0.5, "640": 1.0}}  # as JSON gives it back: keys are strings
    mask = report.mask_cost(HP, standin, (3, 6), record_s=1.0)
    # 8 micro-steps x 10 attention calls x 1 ms at 640-token rows (steps 3 to 5)
    assert mask["ms_per_step"] == {320: 40.0, 640: 80.0}
    assert mask["s"] == pytest.approx(3 * 80 / 1000) and mask["share"] == pytest.approx(0.24)
    assert report.mask_cost(HP, {}, (3, 6), 1.0) is None


def test_a_report_of_the_record_alone_says_what_it_lacks(tmp_path):
    work = tmp_path / "work"
    record_log(work / "record" / "logs" / "a.txt", {0: (10.8, 0), 3: (9.5, 300)}, 3)
    profile = {"time": "device", "step_ms": 10.0, "rows": [
        {"category": c, "ms": ms, "share": ms / 10, "top": []} for c, ms in
        [("matmul", 6.0), ("attention", 2.0), ("optimizer", 1.0), ("communication", 0.0), ("elementwise", 0.5),
         ("other", 0.5)]]}
    (work / "record" / "probe.json").write_text(json.dumps({"compile_s": 99.5, "peak_allocated_mib": 2048.0,
                                                            "profile": profile}))
    text = report.write(tmp_path / "out", work, HP, ["plan"], {"record": "ok"})
    assert "status: record ok" in text and "| compile s | 99.5 | n/a | n/a |" in text
    assert "| matmul | 6.0 | 60.0% | n/a | n/a |" in text and "| step |" in text
    assert (tmp_path / "out" / "loss.png").is_file() and not (tmp_path / "out" / "ours_log.txt").exists()
