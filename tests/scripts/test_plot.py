"""The plot command on a real run folder: where the PNG goes by default and with -o, its axes options, and a
folder that is not a run's named in one line."""
import os
import shutil
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from scripts.leaderboard import main as leaderboard
from scripts.plot import main
from tests.helpers import ROOT, run, tiny_args, tiny_data
from trainer.plots import DPI, SIZE_IN

PNG_SHAPE = (SIZE_IN[1] * DPI, SIZE_IN[0] * DPI)  # rows, columns of one panel


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A finished tiny run with two evals ("a"), its picture removed, and a copy of its folder as a second run."""
    runs = tmp_path_factory.mktemp("runs")
    data = tiny_data(tmp_path_factory.mktemp("data"))
    run([sys.executable, *tiny_args(data, runs, "a", "--train.max_steps=6", "--eval.every_steps=3")])
    (runs / "a" / "loss.png").unlink()  # train.py drew it: the command must draw it again
    shutil.copytree(runs / "a", runs / "b")
    return runs


def test_cli_writes_beside_the_run_and_names_bad_folders(runs, tmp_path):
    out = run([sys.executable, "-m", "scripts.plot", str(runs / "a"), "--x", "steps"]).stdout
    assert out.strip() == str(runs / "a" / "loss.png") and imread(runs / "a" / "loss.png").shape[:2] == PNG_SHAPE
    proc = run([sys.executable, "scripts/plot.py", str(tmp_path)], check=False)
    assert proc.returncode == 2 and f"plot: {tmp_path}: no metrics.jsonl" in proc.stderr
    proc = run([sys.executable, "scripts/plot.py", str(tmp_path / "nope")], check=False)
    assert proc.returncode == 2 and f"plot: {tmp_path / 'nope'}: no such folder;" in proc.stderr


def test_several_runs_are_drawn_into_the_first_ones_folder(runs):
    # run.sh runs in the repository root: a figure of several runs written "here" landed among its files
    assert not (ROOT / "curves.png").exists()
    out = run(["bash", "run.sh", "plot", str(runs / "a"), str(runs / "b")], env={"SHARDRUN_VENV": sys.prefix})
    try:
        assert out.stdout.strip() == str(runs / "a" / "curves.png") and imread(runs / "a" / "curves.png").size
        assert not (ROOT / "curves.png").exists()
    finally:
        (ROOT / "curves.png").unlink(missing_ok=True)


def test_run_sh_reads_the_folders_named_from_where_it_was_called(runs, tmp_path):
    # run.sh works in the checkout: the names are the caller's, and a scripts/ package of the caller's is not ours
    here = tmp_path / "here"
    shutil.copytree(runs, here)
    (here / "scripts").mkdir()
    (here / "scripts" / "__init__.py").write_text("raise SystemExit('the caller folder was imported')\n")
    # a relative SHARDRUN_VENV is the checkout's, wherever the command runs
    out = run(["bash", str(ROOT / "run.sh"), "plot", "a", "b", "-o", "ab.png"], cwd=here,
              env={"SHARDRUN_VENV": os.path.relpath(sys.prefix, ROOT)})
    assert out.stdout.strip() == "ab.png" and imread(here / "ab.png").size
    out = run(["bash", str(ROOT / "run.sh"), "leaderboard", "a"], cwd=here, env={"SHARDRUN_VENV": sys.prefix})
    assert out.stdout.splitlines()[1].split()[:2] == ["tiny", "tiny"]


def test_out_and_axis_options_draw_where_they_are_told(runs, tmp_path, capsys):
    out, before = tmp_path / "ab.png", sorted(runs.rglob("*"))
    assert main([str(runs / "a"), str(runs / "b"), "-o", str(out), "--x", "tokens", "--logy"]) == 0
    assert capsys.readouterr().out == f"{out}\n" and imread(out).shape[:2] == PNG_SHAPE
    assert sorted(runs.rglob("*")) == before  # nothing drawn beside the runs


def test_an_unknown_x_axis_is_refused_with_the_choices(runs, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(runs / "a"), "--x", "wall"])
    assert e.value.code == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert "argument --x: invalid choice: 'wall'" in said and all(axis in said for axis in ("time", "tokens", "steps"))


def test_the_out_suffix_names_the_format_and_one_matplotlib_cannot_write_is_refused(runs, tmp_path, capsys):
    # -o x.svg wrote PNG bytes under the .svg name
    assert main([str(runs / "a"), "-o", str(tmp_path / "a.svg")]) == 0
    assert (tmp_path / "a.svg").read_bytes().startswith(b"<?xml") and b"<svg" in (tmp_path / "a.svg").read_bytes()
    assert main([str(runs / "a"), "-o", str(tmp_path / "a.pdf")]) == 0
    assert (tmp_path / "a.pdf").read_bytes().startswith(b"%PDF")
    capsys.readouterr()
    for command in (main, leaderboard):
        assert command([str(runs / "a"), "-o" if command is main else "--plot", str(tmp_path / "a.xyz")]) == 2
        out, err = capsys.readouterr()
        assert out == "" and f"{tmp_path / 'a.xyz'}: matplotlib cannot write a .xyz picture; end the name with " \
                             f"one it writes: .eps" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf", "a.svg"]
