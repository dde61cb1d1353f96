"""scripts/predict_speedrun.py: the predicted table in docs/PERFORMANCE.md and the speedrun budgets are its output."""
import json
import re
import sys
import tomllib

import pytest

from scripts import predict_speedrun
from scripts.beside import report
from scripts.beside.record_script import parse_log
from tests.scripts.test_beside_report import HP, record_log_text
from tests.helpers import ROOT, run
from trainer.config import parse_args


def test_the_performance_table_and_the_budgets_come_from_the_script(tmp_path):
    # the table is the script's output with the newest GPU check's measurement, which the document names
    newest = sorted((ROOT / "records" / "gpu_check").glob("*/gpu_check.json"))[-1]
    performance = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    assert f"--measured {newest.relative_to(ROOT)}" in performance
    text, budget = predict_speedrun.table(predict_speedrun.ASSUMED_MFU, predict_speedrun.measured(newest))
    assert text in performance
    # the README quotes the predicted time, as a prediction
    seconds = re.search(r"\| time to 3\.28 \| (\d+) s \|", text)[1]
    assert f"(predicted: {seconds} s on 8 x H100 at an assumed 30% MFU" in (ROOT / "README.md").read_text()
    budgets = [tomllib.loads((ROOT / "configs" / f"{name}.toml").read_text())["train"]["budget_s"]
               for name in ("speedrun_8xh100", "speedrun_1gpu")]
    assert budgets == [budget, 8 * budget]
    # what scripts/gpu_check.sh measured on one GPU fills the measured column, for the config's model and shape
    cfg = parse_args(["--config", predict_speedrun.CONFIG])
    shape = {"params": predict_speedrun.params(cfg), "seq_len": cfg.train.seq_len}
    row = {"check": "speedrun", "tok_s": 400_000.0, "mfu": 0.31, "probe": {"shape": shape}}
    (tmp_path / "check.json").write_text(json.dumps({"checks": [row]}))
    filled, _ = predict_speedrun.table(0.3, predict_speedrun.measured(tmp_path / "check.json"))
    assert "| 3.20M |" in filled and "not yet" not in filled
    # another shape's tokens/s say nothing of this one's: only its MFU is shown, named as another shape's
    other = {**row, "probe": {"shape": {**shape, "seq_len": 4096}}}
    (tmp_path / "check.json").write_text(json.dumps({"checks": [other]}))
    other_shape, _ = predict_speedrun.table(0.3, predict_speedrun.measured(tmp_path / "check.json"))
    assert "| 31% (" in other_shape and "seq 4096) |" in other_shape and "3.20M" not in other_shape
    (tmp_path / "check.json").write_text(json.dumps({"checks": [{"check": "speedrun", "status": "FAILED"}]}))
    with pytest.raises(SystemExit, match="no speedrun check with a tokens/s figure"):
        predict_speedrun.measured(tmp_path / "check.json")



def test_the_ratio_beside_the_record_predicts_the_time_from_the_records(tmp_path):
    """beside.json's speed, as scripts/beside/report.py writes it: ours at 0.8 of the record's tokens/s on one GPU
    predicts 132.194 / 0.8 = 165 s on 8, since the config takes the record's steps and tokens."""
    rec = parse_log(record_log_text({0: (10.8, 0), 3: (8.0, 300), 9: (7.0, 900)}, 9))
    ours = {3: {"val_loss": 8.1, "tokens": 7680, "elapsed_s": 0.375}, 9: {"val_loss": 7.1, "tokens": 46080,
                                                                        "elapsed_s": 1.125}}
    speed = report.speeds(HP, rec, ours, (3, 9))
    (tmp_path / "beside.json").write_text(json.dumps({"speed": speed}))
    out = run([sys.executable, "-m", "scripts.predict_speedrun", "--beside", str(tmp_path / "beside.json")]).stdout
    assert "| time to 3.28, beside the record | 165 s |  | the record's 132.2 s / " in out and "0.800" in out
    (tmp_path / "beside.json").write_text(json.dumps({"speed": None}))  # no shared eval on one side
    with pytest.raises(SystemExit, match="no tokens/s of both sides"):
        predict_speedrun.beside(tmp_path / "beside.json")


def test_run_sh_fetches_the_shards_the_budget_trains_on_with_a_margin(monkeypatch):
    cfg = parse_args(["--config", predict_speedrun.CONFIG])
    tok_s = predict_speedrun.tokens_per_s(predict_speedrun.flops_per_token(cfg)[0], predict_speedrun.ASSUMED_MFU)
    # 25% more than the budget trains on at the predicted speed, in the rows that read 91% of a shard
    need = cfg.train.budget_s * tok_s * 1.25 / 0.91
    # gpu_track's own line, run as run.sh runs it
    line = next(line.strip() for line in (ROOT / "run.sh").read_text().splitlines()
                if line.strip().startswith("shards="))
    script = f"set -euo pipefail; PY={sys.executable}; {line}; echo $shards"
    monkeypatch.delenv("FINEWEB_SHARDS", raising=False)
    shards = int(run(["bash", "-c", script]).stdout)
    assert shards * 100_000_000 >= need > (shards - 1) * 100_000_000, (shards, need)
    assert run(["bash", "-c", script], env={"FINEWEB_SHARDS": "3"}).stdout.strip() == "3"  # the user's choice
