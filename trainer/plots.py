"""Loss curves and leaderboard figures (matplotlib, Agg backend, no display; PNG unless a name says otherwise).

plot_runs draws the val loss (points and line) and smoothed train loss of one or more run folders from their
metrics.jsonl and, once a run has finished, its summary.json: a run that is still going, or was killed, plots
what it has logged. train.py draws runs/<run_id>/loss.png with plot_or_warn at the end of every run;
scripts/plot.py is the command line, and scripts/bench/recipe.py, scripts/bench/budgets.py and
`scripts/leaderboard.py --plot` draw theirs with this module too. matplotlib is imported only to draw, so importing
this module costs nothing.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.runs import STOPPED_BY_SIGNAL
from util.atomic import atomic_path
from util.optional import import_optional

if TYPE_CHECKING:
    from matplotlib.axes import Axes

X_AXES = {"time": "training time (s)", "tokens": "tokens", "steps": "step"}
SIZE_IN, DPI = (10.0, 6.0), 100  # 1000 x 600 pixels per panel row: readable in a README at full width
SMOOTH_POINTS = 30  # the EMA's half-life is 1/30 of a run's train points: per-step noise goes, the shape stays
# log.txt's last line where train.py stopped the run at a loss, gradient or state that is not finite
# (trainer/state.py's _stop); the run then writes no summary.json
DIVERGED = re.compile(r"train\.py: step (\d+): .*not finite, so ")


class PlotError(ValueError):
    """A run folder that cannot be plotted; the message names the file and the fix."""


@dataclass
class Run:
    """What one run folder has logged so far: its records with a finite loss (a diverged run logs the step that
    was not), to draw."""
    folder: Path
    train: list[dict]
    evals: list[dict]
    summary: dict | None  # None while the run is going, or after it was killed or diverged
    diverged_at: int | None = None  # the step at which train.py stopped it, not finite, as its log.txt says

    @property
    def run_id(self) -> str:
        return self.summary["run_id"] if self.summary else self.folder.name

    def tokens_per_step(self) -> float | None:
        """Tokens per optimizer step: from the summary, else from a train record (tok_s x step time)."""
        if self.summary and self.summary.get("steps"):
            return self.summary["tokens_seen"] / self.summary["steps"]
        timed = [r for r in self.train if r.get("tok_s") and r.get("step_ms")]
        return round(timed[-1]["tok_s"] * timed[-1]["step_ms"] / 1000) if timed else None

    def label(self) -> str:
        """Legend text: config name, run id, final val loss, hardware."""
        if self.summary is None:
            last = f"last val {self.evals[-1]['val_loss']:.4f}" if self.evals else "no eval yet"
            if self.diverged_at is not None:
                return f"{self.run_id} | diverged at step {self.diverged_at} (log.txt): {last}"
            return f"{self.run_id} | unfinished (no summary.json): {last} at step {self.last_step()}"
        s = self.summary
        final = "no final eval" if s["final_val_loss"] is None else f"final val {s['final_val_loss']:.4f}"
        return f"{s['config_name']} | {s['run_id']} | {final} | {s['hardware']}"

    def last_step(self) -> int:
        return max((r["step"] for r in self.train + self.evals), default=0)


def read_run(folder: str | Path) -> Run:
    """Read a run folder's metrics.jsonl (a partial last line, as a kill leaves it, is dropped; so are losses that
    are not finite), summary.json and, without one, whether log.txt ends where the run diverged."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not folder.is_dir():
        raise PlotError(f"{folder}: no such folder; pass a run folder (runs/<run_id>) of a run train.py started")
    if not metrics.is_file():
        raise PlotError(f"{folder}: no metrics.jsonl; pass a run folder (runs/<run_id>) of a run train.py started")
    lines = metrics.read_text().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break  # the line being written when the run was killed
            raise PlotError(f"{metrics}:{n}: not a JSON line; train.py writes one record per line, "
                            f"so the file was edited: restore or remove that line") from None
    summary_path = folder / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    except json.JSONDecodeError as e:
        raise PlotError(f"{summary_path}: not valid JSON ({e}); restore it or remove it to plot the metrics "
                        f"alone") from None
    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    finite = ([r for r in train if math.isfinite(r["loss"])], [r for r in evals if math.isfinite(r["val_loss"])])
    if (train or evals) and not any(finite):
        raise PlotError(f"{metrics}: no finite loss to draw (the losses of its {len(train) + len(evals)} records are "
                        f"all nan or inf: the run diverged from its start); log.txt beside it says where and what to "
                        f"try")
    log = folder / "log.txt"
    last = log.read_text(errors="replace").rstrip().rpartition("\n")[2] if summary is None and log.is_file() else ""
    diverged = DIVERGED.match(last)
    return Run(folder, *finite, summary, int(diverged[1]) if diverged else None)


def x_values(run: Run, records: list[dict], x: str) -> list[float]:
    """The x coordinate of each record: training seconds, steps, or tokens seen (each record's own count; a run
    logged before records had one: steps x the run's mean tokens per step)."""
    if x == "time":
        return [r["elapsed_s"] for r in records]
    if x == "steps":
        return [r["step"] for r in records]
    if all("tokens" in r for r in records):
        return [r["tokens"] for r in records]
    per_step = run.tokens_per_step()
    if per_step is None:
        raise PlotError(f"{run.folder}: --x tokens needs tokens per step, from summary.json or a train record "
                        f"of metrics.jsonl, and it has neither; use --x time or --x steps")
    return [r["step"] * per_step for r in records]


def smooth(values: Sequence[float], half_life: float) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled towards zero."""
    decay = 0.5 ** (1.0 / max(half_life, 1e-9))
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        avg, weight = decay * avg + (1 - decay) * v, decay * weight + (1 - decay)
        out.append(avg / weight)
    return out


def _canvas() -> Any:
    """matplotlib's Agg canvas class: it renders every format without any display."""
    return import_optional("matplotlib.backends.backend_agg", "drawing loss curves", PlotError).FigureCanvasAgg


def _figure(ncols: int):
    """A blank Agg figure of `ncols` panels side by side."""
    canvas = _canvas()  # first: where matplotlib is missing, it says so in one line
    from matplotlib.figure import Figure

    fig = Figure(figsize=(SIZE_IN[0] * ncols, SIZE_IN[1]), dpi=DPI)
    canvas(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def image_format(out: str | Path) -> str:
    """The picture format that the name `out` asks for by its suffix (png without one), or a PlotError naming the
    formats matplotlib writes."""
    suffix, formats = Path(out).suffix.lower().lstrip("."), _canvas().get_supported_filetypes()
    if suffix and suffix not in formats:
        raise PlotError(f"{out}: matplotlib cannot write a .{suffix} picture; end the name with one it writes: "
                        f"{' '.join('.' + f for f in formats)}")
    return suffix or "png"


def _save(fig, out: str | Path) -> Path:
    """Write the figure to `out` in the format its suffix names, atomically (a reader never sees half a picture;
    the temporary file's own suffix says nothing)."""
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format=image_format(out), dpi=DPI)
    return out


def _scale(ax, low: float, high: float, logy: bool) -> None:
    """The loss axis from `low` to `high` plus 5% of the range each way, on a linear or log scale."""
    if not logy:
        pad = (high - low) * 0.05 or 0.05
        ax.set_ylim(low - pad, high + pad)
        return
    from matplotlib.ticker import ScalarFormatter

    ax.set_yscale("log")
    ratio = (high / low) ** 0.05 if high > low else 1.02
    ax.set_ylim(low / ratio, high * ratio)
    for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        set_formatter(ScalarFormatter())  # 3.2, not 3.2 x 10^0: losses span less than a decade


def draw_curves(ax: Axes, runs: list[Run], x: str, logy: bool) -> None:
    """Each run's val loss (points and line) and smoothed train loss on `ax`, the targets dashed."""
    tops, bottoms = [], []
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        if run.train:
            losses = [r["loss"] for r in run.train]
            smoothed = smooth(losses, len(losses) / SMOOTH_POINTS)
            ax.plot(x_values(run, run.train, x), smoothed, color=color, lw=1.2, alpha=0.55, gid=f"train:{i}")
            tops.append(max(smoothed[len(smoothed) // 10:]))  # after the first tenth: the start would flatten it
            bottoms.append(min(smoothed))
        if run.evals:
            vals = [r["val_loss"] for r in run.evals]
            ax.plot(x_values(run, run.evals, x), vals, color=color, lw=2.0, marker="o", ms=4, gid=f"val:{i}")
            # an eval before the first step (eval.at_start) scores the untrained model: above the top, as the
            # train curve's start
            tops.append(max([r["val_loss"] for r in run.evals if r["step"] > 0] or vals))
            bottoms.append(min(vals))
        ax.plot([], [], color=color, lw=2.0, marker="o", ms=4, label=run.label())  # one legend entry per run
    targets = sorted({r.summary["target_loss"] for r in runs if r.summary and r.summary.get("target_loss")})
    for target in targets:
        ax.axhline(target, color="0.3", ls="--", lw=1.2, gid="target", label=f"target {target:g}")
    if tops:
        _scale(ax, min(bottoms + targets), max(tops + targets), logy)
    if x == "tokens":
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter())  # 400 M, not 4e8 at the corner
    ax.set_xlabel(X_AXES[x])
    ax.set_ylabel("loss")
    ax.set_title("val loss (points and line), train loss (smoothed, faint)")
    ax.grid(alpha=0.3, which="both" if logy else "major")
    ax.legend(fontsize=8, loc="upper right")


def plot_runs(folders: Sequence[str | Path], out: str | Path, *, x: str | Sequence[str] = "time",
              logy: bool = False) -> Any:
    """Draw the runs' curves into the PNG `out`, one panel per x axis; returns the matplotlib Figure."""
    axes_x = [x] if isinstance(x, str) else list(x)
    unknown = [a for a in axes_x if a not in X_AXES]
    if unknown:
        raise PlotError(f"x axis {unknown[0]!r} is not one of {', '.join(X_AXES)}")
    runs = [read_run(f) for f in folders]
    if not any(r.train or r.evals for r in runs):
        raise PlotError(f"{', '.join(str(r.folder) for r in runs)}: metrics.jsonl holds no record yet; "
                        f"wait for the first logged step (log.every_steps)")
    fig, axes = _figure(len(axes_x))
    for ax, axis in zip(axes, axes_x):
        draw_curves(ax, runs, axis, logy)
    fig.tight_layout()
    _save(fig, out)
    return fig


def plot_or_warn(folder: Path, warn: Callable[[str], None]) -> Path | None:
    """folder/loss.png, or None after one warning line: a picture must never fail the run that drew it."""
    try:
        out = folder / "loss.png"
        plot_runs([folder], out)
        return out
    except Exception as e:  # whatever went wrong, the run itself succeeded
        warn(f"warning: could not draw {folder / 'loss.png'} ({type(e).__name__}: {e})")
        return None


def plot_budgets(res: dict, out: str | Path) -> Any:
    """scripts/bench/budgets.py's figure: each planned run's final val loss against its budget (a fraction of the
    baseline's time; the median joined by a line, every repeat a point) and the baseline's final loss as a line."""
    fig, (ax,) = _figure(1)
    table = res["table"]
    fractions = [row["fraction"] for row in table]
    for row in table:
        ax.plot([row["fraction"]] * len(row["losses"]), row["losses"], "o", color="C0", alpha=0.4, ms=4)
    ax.plot(fractions, [row["final_val_loss"] for row in table], "-o", color="C0", gid="planned",
            label=f"configs/cpu.toml, each run planned for its budget (median of {res['repeats']})")
    ax.axhline(res["baseline_final_val_loss"], color="0.3", ls="--", lw=1.2, gid="baseline",
               label=f"nanoGPT's recipe after {res['baseline_steps']:,} steps ({res['baseline_time_s']:.0f} s)")
    if res["crossing"] is not None:
        ax.axvline(res["crossing"], color="C3", ls=":", lw=1.2, label=f"crossing: {res['crossing']:.2f} x")
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("budget, as a fraction of the baseline's training time")
    ax.set_ylabel("final val loss (same val tokens)")
    ax.set_title("the run you get at each budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    _save(fig, out)
    return fig


def _spread(center: int, n: int) -> list[float]:
    """x positions of n points around `center`, side by side so that equal values stay visible."""
    return [center + 0.3 * (k / (n - 1) - 0.5) if n > 1 else center for k in range(n)]


def plot_leaderboard(rows: list[dict], out: str | Path) -> Any:
    """Time to target and final val loss of each run, one column of points per leaderboard row, the target
    dashed; `rows` are dicts with "name", "target" (or None) and "runs" (their summary.json dicts). A row without a
    target has no time to target: it is left out of that panel, and without a target in any row there is the loss
    panel alone."""
    targeted = [i for i, row in enumerate(rows) if row["target"] is not None]
    timed = bool(targeted)
    fig, axes = _figure(2 if timed else 1)
    ax_loss = axes[-1]
    for i, row in enumerate(rows):
        color = f"C{i % 10}"
        if i in targeted:
            _draw_times(axes[0], i, row, color)
        losses = [r["final_val_loss"] for r in row["runs"] if r["final_val_loss"] is not None]
        ax_loss.plot(_spread(i, len(losses)), losses, "o", color=color, gid=f"loss:{i}")
        if row["target"] is not None:
            ax_loss.plot([i - 0.4, i + 0.4], [row["target"]] * 2, color="0.3", ls="--", lw=1.2, gid=f"target:{i}")
    for ax in axes:
        columns = range(len(rows)) if ax is ax_loss else targeted
        ax.set_xticks(columns, [rows[i]["name"] for i in columns], rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.grid(alpha=0.3, axis="y")
    if timed:
        axes[0].set_ylim(bottom=0)
        axes[0].set_ylabel("time to target (s)")
        axes[0].set_title("time to target per run (bar: mean)")
        axes[0].legend(fontsize=8, loc="upper right")
    ax_loss.set_ylabel("final val loss (target dashed)" if timed else "final val loss")
    ax_loss.set_title("final val loss per run against its target" if timed else
                      "final val loss per run (no run has a target)")
    fig.tight_layout()
    _save(fig, out)
    return fig


def _draw_times(ax, i: int, row: dict, color: str) -> None:
    """Row `i`'s times to target on `ax` (points, their mean as a bar), and how many runs missed it: the runs
    stopped by a signal before it (summary.json's status) apart from those that ran to their end."""
    times = [r["time_to_target_s"] for r in row["runs"] if r["time_to_target_s"] is not None]
    missed = [r for r in row["runs"] if r["time_to_target_s"] is None]
    stopped = sum(r.get("status") in STOPPED_BY_SIGNAL for r in missed)
    said = ", ".join(f"{n} {what}" for n, what in ((len(missed) - stopped, "not reached"), (stopped, "stopped")) if n)
    reached = f"{len(times)}/{len(row['runs'])} reached" + (f", {stopped} stopped" if stopped else "")
    ax.plot(_spread(i, len(times)), times, "o", color=color, gid=f"time:{i}", label=f"{row['name']}: {reached}")
    if times:
        ax.plot([i - 0.25, i + 0.25], [sum(times) / len(times)] * 2, color=color, lw=2)
    if said:
        ax.annotate(said, (i, 0), xycoords=("data", "axes fraction"), xytext=(0, 4), textcoords="offset points",
                    ha="center", fontsize=8, color=color)
