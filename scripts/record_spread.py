"""How far a record's own runs fall apart: at each eval step, the val loss's mean, standard deviation, lowest and
highest over the logs of its runs (modded-nanogpt keeps every run's log beside a record's README). A gap between the
record and ours, side by side (scripts/bench/beside_record.py), means something only against this spread.

    python -m scripts.record_spread upstream/2025-11-29_BatchSizeSchedule/*.txt
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from scripts.beside.record_script import parse_log


def spread(logs: dict[str, str]) -> list[dict]:
    """Per eval step any log reached (`logs`: name -> text): the runs that reached it, the mean, the sample
    standard deviation (None for one run), the lowest and the highest val loss. A log without a val loss line is
    refused by name: it is not a record's log, or its run died before its first eval."""
    by_step: dict[int, list[float]] = {}
    for name, text in logs.items():
        evals = parse_log(text).evals
        if not evals:
            raise SystemExit(f"record_spread: {name} has no 'step:S/N val_loss:...' line: give the logs of a "
                             f"record's runs (the .txt files beside its README)")
        for step, loss, _ in evals:
            by_step.setdefault(step, []).append(loss)
    return [{"step": step, "runs": len(losses), "mean": statistics.fmean(losses),
             "stdev": statistics.stdev(losses) if len(losses) > 1 else None, "low": min(losses), "high": max(losses)}
            for step, losses in sorted(by_step.items())]


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| step | runs | mean | stdev | lowest | highest |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        stdev = "-" if r["stdev"] is None else f"{r['stdev']:.4f}"
        lines.append(f"| {r['step']} | {r['runs']} | {r['mean']:.4f} | {stdev} | {r['low']:.4f} | {r['high']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="the logs of a record's runs")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        raise SystemExit(f"record_spread: no such file: {', '.join(missing)}")
    print(table(spread({str(p): p.read_text(encoding="utf-8", errors="replace") for p in args.logs})))


if __name__ == "__main__":
    main(sys.argv[1:])
