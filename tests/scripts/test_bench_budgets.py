"""scripts/bench/budgets.py: runs planned for their own budgets against the baseline, on a tiny shape for real; its
crossing (interpolated), the eval grid of the envelope check, and the check itself."""
import argparse
import json
import math
import sys

import pytest
from matplotlib.image import imread

from scripts.bench import budgets
from tests.helpers import ROOT, demo_data, run

# eager: the bench's mechanics, without a compile in each run
TINY = ["model.n_embd=64", "model.n_layer=2", "model.value_embeds=0", "model.bigram_hash=0", "model.bigram_dim=0",
        "model.block_size=64", "train.seq_len=64", "train.batch_size=4", "eval.tokens=4096", "train.compile=false"]


def test_the_crossing_is_interpolated_between_the_budgets_around_it():
    assert budgets.crossing([(0.1, 1.2), (0.2, 0.9), (0.3, 0.8)]) == pytest.approx(0.1 + 0.1 * 0.2 / 0.3)
    assert budgets.crossing([(0.1, 0.99), (0.2, 0.9)]) == 0.1  # the shortest budget already reaches it
    assert budgets.crossing([(0.1, 1.3), (0.2, 1.1)]) is None


def test_an_eval_after_a_budget_stands_for_it():
    evals = {3.8: 2.0, 7.6: 1.8, 11.3: 1.7}
    assert budgets._at(evals, 7.5) == 1.8 and budgets._at(evals, 11.25) == 1.7 and budgets._at(evals, 12) is None


def test_the_envelope_check_names_a_longer_run_that_was_lower_at_a_shorter_budget():
    rep = {"runs": [{"budget_s": 10.0, "final_val_loss": 1.5, "at_shorter_budgets": {}},
                    {"budget_s": 20.0, "final_val_loss": 1.3, "at_shorter_budgets": {10.0: 1.6}},
                    {"budget_s": 40.0, "final_val_loss": 1.2, "at_shorter_budgets": {10.0: 1.45, 20.0: 1.35}}]}
    assert budgets.envelope([rep]) == ["repeat 1: the 40.0-s run was at 1.4500 after 10.0 s, below the 1.5000 of the "
                                       "run planned for 10.0 s"]


def test_a_budget_whose_repeats_trained_two_plan_rows_names_both():
    """Budgets are fractions of each repeat's own baseline time: around a row's up_to_s they fall on both sides."""
    rows = {"small": "the row up to 40 s: model.n_layer = 2", "large": "the row up to 180 s: model.n_layer = 3"}
    repeats = [{"baseline": {"final_val_loss": 1.6, "train_time_s": t, "steps": 2000},
                "runs": [{"budget_s": 0.4 * t, "final_val_loss": 1.28, "steps": 800, "at_shorter_budgets": {},
                          "plan": f"plan: budget {0.4 * t:g} s -> {rows['small' if 0.4 * t <= 40 else 'large']}"}]}
               for t in (111.3, 97.0, 89.9)]
    res = budgets.summarize(argparse.Namespace(fractions=[0.4], override=[]), repeats)
    assert res["table"][0]["plans"] == [rows["large"], rows["small"]]
    assert budgets.report(res).splitlines()[2].endswith(f"| {rows['large']} or {rows['small']} |")


@pytest.mark.slow
def test_the_bench_plans_each_run_for_its_budget_for_real(tmp_path):
    data = demo_data(tmp_path / "demo", tokens=200_000, val_tokens=20_000, shard_tokens=100_000)
    out = tmp_path / "budgets.json"
    proc = run([sys.executable, "-m", "scripts.bench.budgets", "--fractions", "0.5,1", "--baseline-steps", "10",
                "--data", str(data), "--runs", str(tmp_path / "runs"), "--json", str(out),
                *(f"--override={o}" for o in TINY)], timeout=600, cwd=ROOT)
    res = json.loads(out.read_text())
    [rep] = res["raw"]
    t_b = rep["baseline"]["train_time_s"]
    assert rep["baseline"]["steps"] == 10 and res["baseline_steps"] == 10
    assert [row["budget_s"] for row in rep["runs"]] == pytest.approx([0.5 * t_b, t_b])
    for row in rep["runs"]:
        summary = json.loads(next((tmp_path / "runs").glob(f"budgets-{row['fraction']:g}-*/summary.json")).read_text())
        assert summary["final_val_loss"] == row["final_val_loss"] and math.isfinite(row["final_val_loss"])
        assert summary["train_time_s"] >= row["budget_s"] and summary["world_size"] >= 1
    # the full-budget run evaluated at the half budget on its way, for the envelope check, and only there
    assert list(rep["runs"][1]["at_shorter_budgets"]) == [str(rep["runs"][0]["budget_s"])]
    run_dir = next(p for p in (tmp_path / "runs").glob("budgets-1-*") if p.is_dir())
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # at the half budget, and the final one (the same one where the half budget fell on the last step)
    assert 1 <= sum(e["type"] == "eval" for e in evals) <= 2
    assert [loss is not None for loss in rep["runs"][1]["at_shorter_budgets"].values()] == [True]
    assert [row["fraction"] for row in res["table"]] == [0.5, 1.0]
    assert res["crossing"] is None or 0.5 <= res["crossing"] <= 1.0
    assert "| budget (x T_b) |" in proc.stdout and "crossing: " in proc.stdout and "lower envelope: " in proc.stdout
    assert imread(res["figure"]).shape[:2] == (600, 1000)
