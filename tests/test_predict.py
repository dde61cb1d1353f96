"""scripts/predict_speedrun.py: the predicted table in docs/PERFORMANCE.md and the speedrun budgets are its output."""
import json
import tomllib

import pytest

from scripts import predict_speedrun
from tests.helpers import ROOT


def test_the_performance_table_and_the_budgets_come_from_the_script(tmp_path):
    text, budget = predict_speedrun.table(predict_speedrun.ASSUMED_MFU)
    assert text in (ROOT / "docs" / "PERFORMANCE.md").read_text()
    budgets = [tomllib.loads((ROOT / "configs" / f"{name}.toml").read_text())["train"]["budget_s"]
               for name in ("speedrun_8xh100", "speedrun_1gpu")]
    assert budgets == [budget, 8 * budget]
    # what scripts/gpu_check.sh measured on one GPU fills the measured column
    (tmp_path / "check.json").write_text(json.dumps({"checks": [{"check": "speedrun", "tok_s": 400_000.0}]}))
    filled, _ = predict_speedrun.table(0.3, predict_speedrun.measured(tmp_path / "check.json"))
    assert "| 3.20M |" in filled and "not yet" not in filled
    (tmp_path / "check.json").write_text(json.dumps({"checks": [{"check": "speedrun", "status": "FAILED"}]}))
    with pytest.raises(SystemExit, match="no speedrun check with a tokens/s figure"):
        predict_speedrun.measured(tmp_path / "check.json")

