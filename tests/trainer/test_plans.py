"""A config's [[plan]] rows: the row for the run's budget applies over the file's keys and under the command line's,
a base's rows serve the files built on it, and a row that cannot apply is refused naming the file and the fix."""
import pytest

from tests.helpers import ROOT
from trainer.config import ConfigError, parse_args
from trainer.plans import PlanError, describe, pick, read_plans

ROWS = """
[[plan]]
up_to_s = 30
model.n_embd = 48
train.batch_size = 2

[[plan]]
up_to_s = 10
model.n_embd = 32
model.n_layer = 1
"""


def config(tmp_path, rows: str = ROWS, name: str = "planned.toml"):
    """A config file `name` in tmp_path: tiny.toml with a 100-s time budget (written beside it), and `rows`."""
    base = tmp_path / "tiny_timed.toml"
    base.write_text((ROOT / "configs" / "tiny.toml").read_text().replace('schedule = "step"',
                                                                          'schedule = "time"\nbudget_s = 100'))
    path = tmp_path / name
    path.write_text(f'base = "{base}"\n{rows}')
    return path


@pytest.fixture
def planned(tmp_path):
    return config(tmp_path)


def cfg_of(path, *extra: str):
    return parse_args(["--config", str(path), "--data.train=x", *extra])


@pytest.mark.parametrize("budget, n_embd, n_layer, batch", [
    (5, 32, 1, 4), (10, 32, 1, 4),   # the shortest row, up to and at its budget (tiny.toml: 64 wide, 2 layers, batch 4)
    (10.5, 48, 2, 2), (30, 48, 2, 2),  # the next
    (31, 64, 2, 4),                  # longer than every row: the file's own keys
])
def test_the_row_for_the_budget_applies_over_the_files_keys(planned, budget, n_embd, n_layer, batch):
    cfg = cfg_of(planned, f"--train.budget_s={budget}")
    assert (cfg.model.n_embd, cfg.model.n_layer, cfg.train.batch_size) == (n_embd, n_layer, batch)
    assert cfg.plan.startswith(f"plan: budget {budget:g} s -> " + ("the row" if budget <= 30 else "longer"))


def test_the_command_line_overrides_a_rows_key_and_the_run_says_so(planned):
    cfg = cfg_of(planned, "--train.budget_s=20", "--train.batch_size=3")
    assert (cfg.model.n_embd, cfg.train.batch_size) == (48, 3)
    assert cfg.plan == ("plan: budget 20 s -> the row up to 30 s: model.n_embd = 48 (the command line's "
                        "train.batch_size instead)")
    # longer than every row: the line says what the file's own keys are, the command line's among them
    assert cfg_of(planned, "--train.budget_s=31", "--model.n_layer=3").plan == (
        "plan: budget 31 s -> longer than every row (up to 30 s): the file's model.n_embd = 64, model.n_layer = 3, "
        "train.batch_size = 4")
    unplanned = cfg_of(planned, "--train.budget_s=5", "--train.plan=false")  # the file's own keys at any budget
    assert (unplanned.model.n_embd, unplanned.plan) == (64, "")


def test_a_file_on_a_planned_base_plans_with_the_bases_rows(tmp_path, planned):
    child = tmp_path / "child.toml"
    child.write_text(f'base = "{planned}"\n[model]\nn_head = 1\n')
    cfg = cfg_of(child, "--train.budget_s=8")
    assert (cfg.model.n_embd, cfg.model.n_head) == (32, 1)


@pytest.mark.parametrize("rows, message", [
    ("[[plan]]\nmodel.n_embd = 32\n", "row 1 needs up_to_s = the longest budget in seconds it plans"),
    ("[[plan]]\nup_to_s = -1\nmodel.n_embd = 32\n", "row 1 needs up_to_s"),
    ("[[plan]]\nup_to_s = 5\n", r"row 1 \(up_to_s = 5\) sets no key"),
    ("[[plan]]\nup_to_s = 5\nn_embd = 32\n", "row 1: n_embd = 32 is not a key; write section.key = value"),
    ("[[plan]]\nup_to_s = 5\nmodel.n_embd = 32\n[[plan]]\nup_to_s = 5\nmodel.n_layer = 1\n",
     "two \\[\\[plan\\]\\] rows have the same up_to_s"),
    ("[[plan]]\nup_to_s = 5\nmodel.n_emb = 32\n", r"\[\[plan\]\] up to 5 s: unknown key model.n_emb"),
    ("[[plan]]\nup_to_s = 5\nmodel.n_embd = \"wide\"\n", r"\[\[plan\]\] up to 5 s: model.n_embd must be"),
    ("plan = 3\n", "plan must be an array of tables"),
])
def test_a_row_that_cannot_apply_is_refused_naming_the_file(tmp_path, planned, rows, message):
    bad = config(tmp_path, rows, "bad.toml")
    with pytest.raises(ConfigError, match=message) as refused:
        cfg_of(bad, "--train.budget_s=5")
    assert str(bad) in str(refused.value)


def test_rows_are_read_in_budget_order_and_picked_by_the_first_that_covers_the_budget(tmp_path):
    rows = read_plans(tmp_path, [{"up_to_s": 30, "model": {"n_embd": 48}}, {"up_to_s": 10, "model": {"n_embd": 32}}])
    assert [row["up_to_s"] for row in rows] == [10.0, 30.0]
    assert pick(rows, 0) is None and pick(rows, 10)["keys"] == {"model.n_embd": 32} and pick(rows, 30.01) is None
    assert describe(rows[0], 7.5, set()) == "plan: budget 7.5 s -> the row up to 10 s: model.n_embd = 32"
    with pytest.raises(PlanError, match="row 1 needs up_to_s"):
        read_plans(tmp_path, [{"up_to_s": True, "model": {"n_embd": 1}}])
