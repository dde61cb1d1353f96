"""Loss curves as a picture: val loss (points and line) and smoothed train loss of one or more runs.

    python -m scripts.plot runs/<run_id>                         # -> runs/<run_id>/loss.png
    python -m scripts.plot runs/a runs/b                         # -> runs/a/curves.png
    python -m scripts.plot runs/a runs/b -o ab.png --x tokens --logy
    bash run.sh plot runs/a runs/b

Reads each run folder's metrics.jsonl and, once the run has finished, its summary.json: a run that is
still going, or was killed, plots what it has logged. train.py draws runs/<run_id>/loss.png at the end of
every run, and scripts/bench/recipe.py and `scripts/leaderboard.py --plot` theirs, with the same functions
(trainer/plots.py; matplotlib's Agg backend, no display).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from trainer.plots import X_AXES, PlotError, plot_runs


def main(argv: list[str] | None = None) -> int:
    """Command line: draw the given run folders into one figure (its format by -o's suffix)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<run_id>)")
    ap.add_argument("-o", "--out", type=Path, help="picture to write, in the format of its suffix (.png, .svg, .pdf "
                                                     "...; default: loss.png in the only run folder, else curves.png "
                                                     "in the first one)")
    ap.add_argument("--x", choices=list(X_AXES), default="time", help="x axis (default: training time)")
    ap.add_argument("--logy", action="store_true", help="logarithmic loss axis")
    args = ap.parse_args(argv)
    # several runs' figure goes beside the first one's files, not into whatever folder the command ran in
    out = args.out or args.runs[0] / ("loss.png" if len(args.runs) == 1 else "curves.png")
    try:
        plot_runs(args.runs, out, x=args.x, logy=args.logy)
    except PlotError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
