"""What a user gets at each budget: separate runs of configs/cpu.toml, each planned for its own budget, against
nanoGPT's CPU recipe trained to its end.

    python -m scripts.bench.budgets --repeats 3 --json budgets.json     # the table in docs/PERFORMANCE.md
    python -m scripts.bench.budgets --fractions 0.1,0.2 --override model.n_embd=96   # a candidate shape

Per repeat: configs/baseline_cpu.toml for its 2,000 steps (time T_b, final val loss L_b), then configs/cpu.toml at
budgets of each --fraction of T_b, launched as `bash run.sh` launches the CPU track (one process per core, one thread
each, the budget given as BUDGET gives it, so each run trains the config's [[plan]] row for its budget), all scored
on the same val tokens. Every run evaluates, off its clock, at each shorter budget of the list too: the lower
envelope check, that a run planned for B ends at least as low as every longer run was at B. Reported per budget:
the median over the repeats of the final val loss and of its ratio to L_b (each repeat's own baseline); the
crossing, the smallest budget whose median is at or below L_b, interpolated linearly between the two budgets
around it (a fraction of T_b); and one plot, final loss against budget with the baseline's loss as a line.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from scripts.bench.recipe import RECIPES, ensure_data, train_all, train_args
from trainer.plots import plot_budgets, read_run
from util.atomic import write_json

FRACTIONS = (0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m scripts.bench.budgets", description=__doc__.split("\n\n")[0])
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                   help="the budgets, as fractions of the baseline's training time")
    p.add_argument("--repeats", type=int, default=1, help="the whole set this many times; medians are reported")
    p.add_argument("--baseline-steps", type=int, default=0,
                   help="train the baseline for this many steps instead of its config's 2,000 (a quick look)")
    p.add_argument("--baseline-run", type=Path, metavar="RUN_DIR",
                   help="take the baseline from this earlier run folder instead of training it (a sweep of shapes "
                        "on one machine; with --repeats 1)")
    p.add_argument("--data", type=Path, default=Path("shards/demo"), help="folder of *_train_*/*_val_* shards")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to every run of configs/cpu.toml as --SECTION.KEY=VALUE (repeatable)")
    p.add_argument("--runs", type=Path, default=Path("runs"), help="log.dir of the runs")
    p.add_argument("--json", type=Path, help="also write the results here (the plot goes beside it)")
    args = p.parse_args(argv)
    try:
        args.fractions = sorted({float(f) for f in args.fractions.split(",")})
    except ValueError:
        p.error(f"--fractions {args.fractions!r}: give fractions of the baseline's time, e.g. 0.1,0.2,1")
    if any(abs(f * 100 - round(f * 100)) > 1e-9 for f in args.fractions):
        p.error(f"--fractions {args.fractions}: give hundredths at most (0.15, not 0.125)")
    if args.fractions[0] <= 0 or args.repeats < 1 or args.baseline_steps < 0:
        p.error("--fractions must be > 0, --repeats >= 1, --baseline-steps >= 0")
    if args.baseline_run and (args.repeats > 1 or not (args.baseline_run / "summary.json").is_file()):
        p.error(f"--baseline-run {args.baseline_run}: needs a finished run folder (its summary.json) and --repeats 1")
    args.data, args.runs = args.data.resolve(), args.runs.resolve()  # the runs start in the repository root
    # what scripts.bench.recipe's helpers read: one recipe's run at a time, each planned for its budget
    args.ab, args.recipes, args.planned = [], RECIPES, True
    return args


def run_one(args: argparse.Namespace, recipe: str, run_id: str, budget_s: float = 0.0, eval_every: float = 0.0) -> dict:
    """Train one recipe's run (as scripts.bench.recipe launches it) and return its summary.json."""
    train_all(args, {recipe: train_args(args, recipe, run_id, budget_s, eval_every)}, {recipe: run_id})
    return json.loads((args.runs / run_id / "summary.json").read_text())


def repeat(args: argparse.Namespace, k: int) -> dict:
    """One repeat: the baseline, then a planned run per budget; their losses, and each run's evals on the way."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = (json.loads((args.baseline_run / "summary.json").read_text()) if args.baseline_run else
            run_one(args, "baseline", f"budgets-baseline-{stamp}"))
    t_b, rows = base["train_time_s"], []
    # every budget a whole number of one step of time, so that evals every step fall on each shorter budget
    hundredths = [round(f * 100) for f in args.fractions]
    unit = math.gcd(*hundredths) / 100 * t_b
    budgets = [h // math.gcd(*hundredths) * unit for h in hundredths]
    for f, budget in zip(args.fractions, budgets):
        run_id = f"budgets-{f:g}-{stamp}"
        # evals at the shorter budgets, off the clock (train.timing = exclude_warmup): the envelope check
        marks = [b for b in budgets if b < budget]
        summary = run_one(args, "modern", run_id, budget, unit if marks else 0.0)
        evals = {e["elapsed_s"]: e["val_loss"] for e in read_run(args.runs / run_id).evals}
        plan = next((line for line in (args.runs / run_id / "log.txt").read_text().splitlines()
                     if line.startswith("plan: ")), "plan: none (the config's own keys)")
        rows.append({"fraction": f, "budget_s": budget, "final_val_loss": summary["final_val_loss"],
                     "steps": summary["steps"], "tokens": summary["tokens_seen"], "plan": plan,
                     "at_shorter_budgets": {b: _at(evals, b) for b in marks}})
        print(f"budgets: repeat {k + 1}: {f:g} x {t_b:.1f} s = {budget:.1f} s -> {summary['final_val_loss']:.4f} "
              f"({plan})", file=sys.stderr)
    return {"baseline": {"train_time_s": t_b, "final_val_loss": base["final_val_loss"], "steps": base["steps"]},
            "runs": rows}


def _at(evals: dict[float, float], budget: float) -> float | None:
    """The val loss of the eval at `budget` seconds of training (the first at or after it), or None."""
    after = [t for t in evals if t >= budget - 1e-6]
    return evals[min(after)] if after else None


def summarize(args: argparse.Namespace, repeats: list[dict]) -> dict:
    """Medians over the repeats per budget, the crossing, and the envelope check."""
    base_loss = statistics.median(r["baseline"]["final_val_loss"] for r in repeats)
    base_time = statistics.median(r["baseline"]["train_time_s"] for r in repeats)
    table = []
    for i, f in enumerate(args.fractions):
        runs = [r["runs"][i] for r in repeats]
        ratios = [run["final_val_loss"] / r["baseline"]["final_val_loss"] for run, r in zip(runs, repeats)]
        table.append({"fraction": f, "budget_s": statistics.median(run["budget_s"] for run in runs),
                      "final_val_loss": statistics.median(run["final_val_loss"] for run in runs),
                      "losses": [run["final_val_loss"] for run in runs], "ratio": statistics.median(ratios),
                      "steps": statistics.median(run["steps"] for run in runs),
                      # repeats whose budgets fall on both sides of a row's up_to_s trained two rows
                      "plans": list(dict.fromkeys(run["plan"].removeprefix("plan: ").split(" -> ", 1)[-1]
                                                  for run in runs))})
    return {"fractions": args.fractions, "repeats": len(repeats), "overrides": args.override,
            "baseline_final_val_loss": base_loss, "baseline_time_s": base_time,
            "baseline_steps": repeats[0]["baseline"]["steps"], "table": table,
            "crossing": crossing([(row["fraction"], row["ratio"]) for row in table]),
            "envelope_violations": envelope(repeats), "raw": repeats}


def crossing(points: list[tuple[float, float]]) -> float | None:
    """The smallest fraction whose loss ratio is <= 1, interpolated linearly from the point before it; None if
    no budget reaches the baseline's loss."""
    for i, (f, ratio) in enumerate(points):
        if ratio <= 1:
            if i == 0:
                return f
            f0, r0 = points[i - 1]
            return f0 + (f - f0) * (r0 - 1) / (r0 - ratio)
    return None


def envelope(repeats: list[dict]) -> list[str]:
    """Where a longer run was lower at budget B than the run planned for B (each repeat's own runs)."""
    found = []
    for k, rep in enumerate(repeats):
        final = {run["budget_s"]: run["final_val_loss"] for run in rep["runs"]}
        for run in rep["runs"]:
            for budget, loss in run["at_shorter_budgets"].items():
                if loss is not None and loss < final[budget]:
                    found.append(f"repeat {k + 1}: the {run['budget_s']:.1f}-s run was at {loss:.4f} after "
                                 f"{budget:.1f} s, below the {final[budget]:.4f} of the run planned for {budget:.1f} s")
    return found


def report(res: dict) -> str:
    """The table (Markdown) and the headline lines."""
    lines = [f"| budget (x T_b) | s | steps | final val loss (median of {res['repeats']}) | / baseline | plan |",
             "|---:|---:|---:|---:|---:|---|"]
    for row in res["table"]:
        lines.append(f"| {row['fraction']:g} | {row['budget_s']:.1f} | {row['steps']:.0f} | "
                     f"{row['final_val_loss']:.4f} | {row['ratio']:.3f} | {' or '.join(row['plans'])} |")
    cross, shortest = res["crossing"], res["fractions"][0]
    if cross is None:
        crossed = "no budget reached the baseline's loss"
    elif cross == shortest:
        crossed = f"at most {cross:g} x the baseline's time: the shortest budget measured already reaches its loss"
    else:
        crossed = (f"{cross:.3f} x the baseline's time (interpolated linearly between the two budgets around it; each "
                   f"run planned for its own budget)")
    lines += ["", f"baseline (nanoGPT's recipe, {RECIPES['baseline']}): {res['baseline_final_val_loss']:.4f} after "
                  f"{res['baseline_time_s']:.1f} s (medians)",
              "crossing: " + crossed,
              "lower envelope: " + ("holds at every budget" if not res["envelope_violations"] else
                                    "; ".join(res["envelope_violations"]))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.bench.budgets`."""
    args = parse_args(argv)
    ensure_data(args.data)
    repeats = [repeat(args, k) for k in range(args.repeats)]
    res = summarize(args, repeats)
    res["figure"] = str(args.json.with_suffix(".png") if args.json else
                        args.runs / f"budgets-{time.strftime('%Y%m%d-%H%M%S')}.png")
    plot_budgets(res, res["figure"])
    print(report(res) + f"plot: {res['figure']}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
