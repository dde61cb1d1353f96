"""Leaderboard: mean ± std of time-to-target and final val loss over runs, grouped by (track, config).

    python -m scripts.leaderboard runs/                       # every summary.json below runs/
    python -m scripts.leaderboard runs/a runs/b --target 3.28 --markdown

A record claim needs p < 0.01 that the mean final val loss is <= the target (one-sided one-sample
t-test, the speedrun's rule, computed by scipy.stats.ttest_1samp).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from scipy import stats

# The summary.json keys this table reads (train.py writes them all, null when not applicable).
NEEDED_KEYS = ("run_id", "config_name", "track", "final_val_loss", "target_loss", "time_to_target_s",
               "hardware", "torch_version")
COLUMNS = ("track", "config", "runs", "reached", "time to target (s)", "final val loss", "target",
           "p(mean<=target)", "hardware", "torch")


class SummaryError(ValueError):
    """A summary.json that cannot be used; the message names the file and the fix."""


def find_summaries(paths: list[str | Path]) -> list[Path]:
    """Every summary.json named by `paths` (a summary file, a run folder, or a folder searched recursively)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            hits = sorted(p.rglob("summary.json"))
            if not hits:
                raise SummaryError(f"{p}: no summary.json in this folder or below it; pass a run folder "
                                   f"(runs/<run_id>) or a folder of runs")
            found.extend(hits)
        else:
            raise SummaryError(f"{p}: no such file or folder; pass a run folder or a summary.json path")
    return list(dict.fromkeys(found))  # overlapping arguments (runs/ and runs/a) must not count a run twice


def load_summary(path: Path) -> dict:
    """Read one summary.json, checking it is a JSON object holding the keys the table needs."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SummaryError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise SummaryError(f"{path}: not valid JSON ({e}); train.py writes it atomically, so it was "
                           f"edited or copied incompletely — restore it from the run folder or remove it") from None
    if not isinstance(summary, dict):
        raise SummaryError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    missing = [k for k in NEEDED_KEYS if k not in summary]
    if missing:
        raise SummaryError(f"{path}: missing key(s) {', '.join(missing)}; it was not written by train.py "
                           f"(which writes every key, null when not applicable)")
    for key in ("final_val_loss", "target_loss", "time_to_target_s"):
        value = summary[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SummaryError(f"{path}: {key} must be a number or null, got {value!r}")
    return summary


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; nan for a single value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan


def t_test_below(xs: list[float], target: float) -> tuple[float, float]:
    """One-sample t statistic and one-sided p-value for H1: mean(xs) < target (H0: mean >= target).

    Needs two or more values. With zero spread the mean either is below the target or is not: p is 0 or 1.
    """
    if len(xs) < 2:
        raise ValueError(f"a t-test needs at least 2 values, got {len(xs)}")
    if len(set(xs)) == 1:  # scipy warns of catastrophic cancellation and answers nan here
        return (-math.inf, 0.0) if xs[0] < target else (math.inf, 1.0)
    result = stats.ttest_1samp(xs, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def _distinct(values) -> str:
    return "; ".join(sorted({str(v) for v in values if v is not None})) or "-"


def _mean_std_text(xs: list[float], digits: int) -> str:
    if not xs:
        return "-"
    mean, std = mean_std(xs)
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def group_rows(summaries: list[dict], target: float | None = None) -> list[dict]:
    """One table row per (track, config_name): counts, mean ± std, p-value, hardware and torch versions.

    `target` overrides each run's own target_loss for the p-value.
    """
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for s in summaries:
        groups[(str(s["track"]), str(s["config_name"]))].append(s)
    rows = []
    for (track, config), runs in sorted(groups.items()):
        losses = [float(r["final_val_loss"]) for r in runs if r["final_val_loss"] is not None]
        times = [float(r["time_to_target_s"]) for r in runs if r["time_to_target_s"] is not None]
        targets = {float(r["target_loss"]) for r in runs if r["target_loss"] is not None}
        goal = target if target is not None else (next(iter(targets)) if len(targets) == 1 else None)
        p = t_test_below(losses, goal)[1] if goal is not None and len(losses) > 1 else None
        rows.append({
            "track": track, "config": config, "runs": len(runs), "reached": len(times),
            "time to target (s)": _mean_std_text(times, 1),
            "final val loss": _mean_std_text(losses, 4),
            "target": f"{goal:g}" if goal is not None else ("mixed: pass --target" if targets else "-"),
            "p(mean<=target)": "n/a" if p is None else f"{p:.3g}",
            "hardware": _distinct(r["hardware"] for r in runs),
            "torch": _distinct(r["torch_version"] for r in runs),
        })
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """The rows as aligned plain text, or as a Markdown table."""
    cells = [list(COLUMNS)] + [[str(r[c]) for c in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "|".join("---" for _ in COLUMNS) + "|")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the leaderboard of the summaries found under the given paths."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run folders, summary.json files, or folders searched recursively")
    ap.add_argument("--target", type=float, default=None,
                    help="val loss target for the p-value (default: the runs' own target_loss; "
                         "time to target is always the runs' own)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for records/README.md)")
    args = ap.parse_args(argv)
    try:
        summaries = [load_summary(p) for p in find_summaries(args.paths)]
    except SummaryError as e:
        print(f"leaderboard: {e}", file=sys.stderr)
        return 2
    print(format_table(group_rows(summaries, args.target), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
