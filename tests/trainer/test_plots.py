"""Loss curves from real runs: the PNG decodes, has its size, shows one curve per run, and a killed run plots."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from tests.helpers import ROOT, demo_data, run, tiny_args, tiny_data, train_args
from trainer.plots import DPI, SIZE_IN, PlotError, Run, plot_runs, read_run, x_values

TARGET = 3.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two finished tiny runs on real text (one with a target), and one killed while it trained."""
    runs = tmp_path_factory.mktemp("runs")
    demo = demo_data(tmp_path_factory.mktemp("demo"), tokens=150_000, val_tokens=20_000, shard_tokens=65_000)

    def train(run_id: str, *extra: str) -> list[str]:
        return [sys.executable, *train_args(demo, runs, run_id, "--eval.every_steps=5", *extra)]

    killed = subprocess.Popen(train("k", "--train.max_steps=100000"), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (runs / "a.out").write_text(run(train("a", f"--eval.target_loss={TARGET}")).stdout)
    (runs / "b" / "loss.png").mkdir(parents=True)  # in the picture's way: drawing it fails
    (runs / "b.out").write_text(run(train("b", "--optim.lr=1e-3")).stdout)
    metrics, deadline = runs / "k" / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count('"eval"') >= 2):
        assert killed.poll() is None and time.time() < deadline, "the run to kill ended or never logged two evals"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    with open(metrics, "a") as f:
        f.write('{"type": "train", "step": 9')  # and the line it was writing, cut as a kill mid-write cuts it
    return runs


def image(path: Path) -> np.ndarray:
    """The PNG's pixels as 0-255 RGB (a file that does not decode fails here)."""
    return (imread(path)[..., :3] * 255).round()


def plot_area(fig, pixels: np.ndarray) -> np.ndarray:
    """The pixels inside the first panel's axes, without its legend (image rows run top-down)."""
    ax, height = fig.axes[0], pixels.shape[0]
    (x0, y0), (x1, y1) = ax.get_window_extent().get_points().astype(int)
    area = pixels.copy()
    (lx0, ly0), (lx1, ly1) = ax.get_legend().get_window_extent().get_points().astype(int)
    area[height - ly1:height - ly0, lx0:lx1] = 255  # the legend's markers carry the run colours too
    return area[height - y1 + 2:height - y0 - 2, x0 + 2:x1 - 2]


def colour_pixels(area: np.ndarray, colour: str) -> int:
    return int((np.abs(area - np.array(to_rgb(colour)) * 255).max(axis=-1) <= 10).sum())


def lines(fig, kind: str) -> list:
    return [line for line in fig.axes[0].get_lines() if str(line.get_gid()).startswith(kind)]


def test_train_py_draws_loss_png_and_names_it_last(runs):
    png = runs / "a" / "loss.png"
    pixels = image(png)
    assert pixels.shape == (SIZE_IN[1] * DPI, SIZE_IN[0] * DPI, 3)
    last = (runs / "a.out").read_text().strip().splitlines()[-1]
    assert last.startswith("done: completed") and last.endswith(f"| curves {png}")


def test_a_picture_that_fails_is_one_warning_and_the_run_succeeds(runs):
    out = (runs / "b.out").read_text().strip().splitlines()
    warnings = [line for line in out if "loss.png" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: could not draw {runs / 'b' / 'loss.png'} (")
    assert out[-1].startswith("done: completed") and "curves" not in out[-1]
    assert json.loads((runs / "b" / "summary.json").read_text())["status"] == "completed"


def test_one_curve_per_run_that_changes_the_plot_area(runs, tmp_path):
    out = tmp_path / "ab.png"
    fig = plot_runs([runs / "a", runs / "b"], out)
    assert len(lines(fig, "val:")) == 2 and len(lines(fig, "train:")) == 2 and len(lines(fig, "target")) == 1
    assert lines(fig, "target")[0].get_ydata()[0] == TARGET  # only run a set a target
    evals = read_run(runs / "a").evals
    assert list(lines(fig, "val:0")[0].get_ydata()) == [r["val_loss"] for r in evals] and len(evals) == 6
    area = plot_area(fig, image(out))
    assert (area.min(axis=-1) < 250).mean() > 0.01  # not blank: curves cover part of the area
    # Each run's colour is drawn in the plot area, and no third one: two runs, two curves.
    assert colour_pixels(area, "C0") > 300 and colour_pixels(area, "C1") > 300 and colour_pixels(area, "C2") == 0


def test_x_axes_and_log_scale(runs, tmp_path):
    summary = json.loads((runs / "a" / "summary.json").read_text())
    per_step = summary["tokens_seen"] / summary["steps"]
    steps = [r["step"] for r in read_run(runs / "a").evals]
    fig = plot_runs([runs / "a"], tmp_path / "tokens.png", x="tokens", logy=True)
    # each record's own count of tokens, which a batch of one size throughout makes steps x tokens per step
    assert list(lines(fig, "val:0")[0].get_xdata()) == [s * per_step for s in steps]
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_xlabel() == "tokens"
    fig = plot_runs([runs / "a"], tmp_path / "both.png", x=("time", "steps"))
    assert image(tmp_path / "both.png").shape[:2] == (SIZE_IN[1] * DPI, 2 * SIZE_IN[0] * DPI)
    assert list(fig.axes[1].get_lines()[1].get_xdata()) == steps


def test_the_tokens_axis_reads_each_records_count_else_steps_times_the_mean_batch(tmp_path):
    staged = [{"step": 1, "tokens": 100}, {"step": 2, "tokens": 300}]  # a batch schedule: 100, then 200 a step
    summary = {"tokens_seen": 300, "steps": 2}
    assert x_values(Run(tmp_path, staged, [], summary), staged, "tokens") == [100, 300]
    older = [{"step": 1}, {"step": 2}]  # logged before records counted their tokens
    assert x_values(Run(tmp_path, older, [], summary), older, "tokens") == [150, 300]


def test_an_eval_at_step_0_is_drawn_but_does_not_set_the_top(tmp_path):
    """eval.at_start scores the untrained model (~ln V): the axis keeps to the trained losses, as it does for the
    train curve's first tenth."""
    records = [{"type": "train", "step": s, "loss": 6.0 - s / 10, "tokens": 100 * s} for s in range(1, 21)]
    records += [{"type": "eval", "step": s, "val_loss": v, "tokens": 100 * s} for s, v in ((0, 10.8), (10, 5.0),
                                                                                         (20, 4.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = plot_runs([tmp_path], tmp_path / "start.png", x="steps")
    assert list(lines(fig, "val:0")[0].get_ydata()) == [10.8, 5.0, 4.0]
    assert 5.0 < fig.axes[0].get_ylim()[1] < 6.0


def test_a_killed_run_plots_what_it_logged(runs, tmp_path):
    killed = read_run(runs / "k")  # the cut last line is dropped
    assert killed.summary is None and len(killed.evals) >= 2 and killed.train
    fig = plot_runs([runs / "k"], tmp_path / "k.png", x="tokens")  # tokens per step from the train records
    assert fig.axes[0].get_legend().get_texts()[0].get_text().startswith("k | unfinished (no summary.json)")
    assert colour_pixels(plot_area(fig, image(tmp_path / "k.png")), "C0") > 100
    assert not (runs / "k" / "loss.png").exists()


def test_a_line_that_is_not_json_is_named_with_its_number(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"type": "eval"\n{"type": "train", "step": 1}\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:1: not a JSON line"):
        read_run(tmp_path)


def test_a_diverged_run_plots_its_finite_losses_and_says_it_diverged(tmp_path):
    # lr 1e10: step 3's loss is nan; train.py stops there, logs it, says so in log.txt and writes no summary.json
    run([sys.executable, *tiny_args(tiny_data(tmp_path / "data"), tmp_path, "nan", "--optim.lr=1e10",
                                    "--train.max_steps=10")], check=False)
    folder = tmp_path / "nan"
    logged = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert math.isnan(logged[-1]["loss"]) and not (folder / "summary.json").exists()
    fig = plot_runs([folder], tmp_path / "nan.png")
    drawn = lines(fig, "train:0")[0].get_ydata()
    assert len(drawn) == len(logged) - 1 and all(map(math.isfinite, [*drawn, *fig.axes[0].get_ylim()]))
    legend = fig.axes[0].get_legend().get_texts()[0].get_text()
    assert legend == f"nan | diverged at step {logged[-1]['step']} (log.txt): no eval yet"
    # nothing finite to draw: named, not matplotlib's "Axis limits cannot be NaN or Inf"
    (folder / "metrics.jsonl").write_text(json.dumps({**logged[0], "type": "eval", "val_loss": math.nan}) + "\n")
    with pytest.raises(PlotError, match=re.escape(f"{folder / 'metrics.jsonl'}: no finite loss to draw (the losses "
                                                  f"of its 1 records are all nan or inf")):
        plot_runs([folder], tmp_path / "none.png")
