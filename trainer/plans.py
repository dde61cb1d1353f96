"""A run planned for its budget: a config file's `[[plan]]` rows, each the keys a run of at most `up_to_s` seconds
trains with (a smaller model, another batch, its schedule), so that a short run is not a long run cut short.

    [[plan]]
    up_to_s = 12
    model.n_embd = 96
    train.batch_size = 8

The first row (by up_to_s) whose up_to_s is at least train.budget_s applies its keys over the file's and under the
command line's; a budget above every row trains the file's own keys. Rows and their keys are checked when the file
is read; the run's first lines say which row applied and which of its keys the command line overrode.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


class PlanError(ValueError):
    """A [[plan]] row that cannot apply: the message names the file, the row and the fix."""


def read_plans(path: Path, rows: Any) -> list[dict[str, Any]]:
    """The file `path`'s [[plan]] rows as {"up_to_s": seconds, "keys": {"section.key": value}}, by up_to_s."""
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise PlanError(f"{path}: plan must be an array of tables: [[plan]] rows, each with up_to_s and the keys "
                        f"it sets")
    plans = []
    for i, row in enumerate(rows, 1):
        row = dict(row)
        up_to = row.pop("up_to_s", None)
        if isinstance(up_to, bool) or not isinstance(up_to, (int, float)) or not up_to > 0:
            raise PlanError(f"{path}: [[plan]] row {i} needs up_to_s = the longest budget in seconds it plans (> 0), "
                            f"got {up_to!r}")
        keys = {}
        for section, table in row.items():
            if not isinstance(table, dict) or not table:
                raise PlanError(f"{path}: [[plan]] row {i}: {section} = {table!r} is not a key; write section.key = "
                                f"value (e.g. model.n_embd = 96)")
            keys.update({f"{section}.{key}": value for key, value in table.items()})
        if not keys:
            raise PlanError(f"{path}: [[plan]] row {i} (up_to_s = {up_to}) sets no key")
        plans.append({"up_to_s": float(up_to), "keys": keys})
    budgets = [plan["up_to_s"] for plan in plans]
    if len(set(budgets)) < len(budgets):
        raise PlanError(f"{path}: two [[plan]] rows have the same up_to_s ({sorted(budgets)}); merge them")
    return sorted(plans, key=lambda plan: plan["up_to_s"])


def pick(plans: list[dict[str, Any]], budget_s: float) -> dict[str, Any] | None:
    """The row that plans a run of `budget_s` seconds, or None (no budget, or longer than every row)."""
    if budget_s <= 0:
        return None
    return next((plan for plan in plans if budget_s <= plan["up_to_s"]), None)


def describe(plan: dict[str, Any], budget_s: float, overridden: set[str]) -> str:
    """The run's line about its plan: the budget, the row and its keys, and those the command line overrode."""
    keys = ", ".join(f"{key} = {value}" for key, value in plan["keys"].items() if key not in overridden)
    line = f"plan: budget {budget_s:g} s -> the row up to {plan['up_to_s']:g} s: {keys}"
    kept = sorted(set(plan["keys"]) & overridden)
    return line + (f" (the command line's {', '.join(kept)} instead)" if kept else "")


def beyond(plans: list[dict[str, Any]], budget_s: float, values: dict[str, Any]) -> str:
    """The run's line when its budget is longer than every row: the keys the rows set, at the file's own `values`."""
    keys = ", ".join(f"{key} = {values[key]}" for key in sorted({k for plan in plans for k in plan["keys"]}))
    return f"plan: budget {budget_s:g} s -> longer than every row (up to {plans[-1]['up_to_s']:g} s): the file's {keys}"
