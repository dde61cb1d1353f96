"""Leaderboard: the t-test against hand-computed values, grouping and statistics on real summary files."""
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matplotlib.image import imread

import scripts.leaderboard
from util.atomic import write_json
from scripts.leaderboard import (COLUMNS, RESULT_NEUTRAL, RUN_SPECIFIC, SummaryError, find_summaries, format_table,
                                 group_rows, load_summary, main, mean_std, moves_result, t_test_below)
from tests.helpers import ROOT, run, tiny_args, tiny_data
from trainer.config import RESUME_BUDGET, RESUME_SAFE, keys_in, parse_args, to_toml
from trainer.plots import plot_leaderboard

TARGET = 3.28


def summary(run_id, loss, *, ttt=None, track="speedrun", config="speedrun_8xh100", hardware="8x H100",
            torch_version="2.6.0", target=TARGET, resumed=()):
    """A summary.json dict in train.py's contract form (null where not applicable); `resumed`: its resumes'
    changes, (step, key, saved, now) each."""
    return {"run_id": run_id, "config_name": config, "track": track, "status": "ok", "final_val_loss": loss,
            "best_val_loss": loss, "final_val_bpb": None, "target_loss": target, "time_to_target_s": ttt,
            "steps": 100, "tokens_seen": 1000, "tokens_per_s": 10.0, "train_time_s": 100.0, "budget_s": None,
            "mfu": None, "peak_mem_gb": None, "data_wait_frac": 0.0, "world_size": 8, "hardware": hardware,
            "torch_version": torch_version, "git_commit": None,
            "wall": {"init_s": 1.0, "warmup_s": 2.0, "train_s": 100.0, "eval_s": 1.0, "checkpoint_s": 1.0},
            "resume_changes": [dict(zip(("step", "key", "saved", "now"), c)) for c in resumed]}


def resolved(s: dict, *overrides: str) -> dict:
    """The config.toml train.py writes for summary `s`'s run: its config file (tiny.toml, which names no data, on
    shards/x) with the run's track and target, plus overrides."""
    data = ["--data.train=shards/x/*.bin"] if s["config_name"] == "tiny" else []
    return parse_args(["--config", f"configs/{s['config_name']}.toml", *data, f"--log.track={s['track']}",
                       f"--eval.target_loss={s['target_loss'] or 0}", f"--log.run_id={s['run_id']}",
                       *overrides]).to_dict()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A folder holding runs/d3, a finished 3-step tiny run, as a checkout holds its runs."""
    home = tmp_path_factory.mktemp("home")
    run([sys.executable, *tiny_args(tiny_data(tmp_path_factory.mktemp("data")), home / "runs", "d3",
                                    "--train.max_steps=3")])
    return home


def write_runs(folder, summaries, *overrides: str):
    """Each summary.json with its run's config.toml beside it, as train.py leaves a run folder."""
    for s in summaries:
        write_json(folder / s["run_id"] / "summary.json", s)
        (folder / s["run_id"] / "config.toml").write_text(to_toml(resolved(s, *overrides)))


# (values, target, t, p) as the hand-written incomplete-beta t distribution (commit 442e489) computed them,
# before scipy.stats.ttest_1samp replaced it: the same numbers to rounding.
HAND_WRITTEN = [
    ([3.270, 3.275, 3.279, 3.272], 3.28, -3.0645235107313966, 0.027398850418949284),
    ([3.277, 3.279, 3.278], 3.28, -3.464101615137754, 0.03708995011372426),
    ([3.270, 3.275, 3.279, 3.272], 3.2745, -0.2553769592277109, 0.40746981400654697),
    ([3.2781, 3.2779, 3.2795, 3.2770, 3.2788, 3.2776, 3.2783, 3.2769, 3.2791, 3.2774], 3.28, -7.0044266751428985,
     3.146957389737978e-05),
    ([3.30, 3.29], 3.28, 3.000000000000089, 0.8975836176504361),
    ([1.9722, 1.9810, 1.9654, 1.9701, 1.9766], 2.0, -10.048601910523171, 0.00027577550674984203),
]


@pytest.mark.parametrize("xs, target, t_before, p_before", HAND_WRITTEN)
def test_scipy_t_test_equals_the_hand_written_one(xs, target, t_before, p_before):
    t, p = t_test_below(xs, target)
    assert t == pytest.approx(t_before, rel=1e-9) and p == pytest.approx(p_before, rel=1e-9)


def test_mean_std_is_the_sample_std():
    mean, std = mean_std([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert std == pytest.approx(math.sqrt(5 / 3))  # squared deviations 2.25+0.25+0.25+2.25 over n-1 = 3
    assert math.isnan(mean_std([7.0])[1])


@pytest.mark.parametrize("n, t_expected, p_expected", [(6, -2.0, 0.0510), (11, -3.0, 0.00667)])
def test_t_test_below_hand_computed(n, t_expected, p_expected):
    # Deviations ±a (and a 0 when n is odd) sum to zero: mean = target + shift, sample std = a*sqrt(2*(n//2)/(n-1)).
    a = 0.002
    std = a * math.sqrt(2 * (n // 2) / (n - 1))
    shift = t_expected * std / math.sqrt(n)
    xs = [TARGET + shift + a * (-1) ** i for i in range(n - n % 2)] + [TARGET + shift] * (n % 2)
    assert mean_std(xs) == pytest.approx((TARGET + shift, std))
    t, p = t_test_below(xs, TARGET)
    assert t == pytest.approx(t_expected)
    assert p == pytest.approx(p_expected, rel=2e-3)


def test_t_test_below_edge_cases():
    assert t_test_below([3.0, 3.0, 3.0], TARGET)[1] == 0.0
    assert t_test_below([3.5, 3.5], TARGET)[1] == 1.0
    assert t_test_below([3.1, 3.5, 3.9], 3.5)[1] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2"):
        t_test_below([3.0], TARGET)


def test_group_rows_statistics_and_distinct_environment(tmp_path):
    losses = [3.270, 3.275, 3.279, 3.272]
    write_runs(tmp_path, [summary(f"s{i}", x, ttt=[100.0, 110.0, None, 120.0][i], hardware=["8x H100", "8x H100",
               "8x H100", "8x H100 SXM"][i], torch_version="2.6.0" if i else "2.7.1") for i, x in enumerate(losses)])
    write_runs(tmp_path, [summary("c0", 1.91, track="cpu", config="cpu", hardware="2 cpu cores", target=None)])
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])])
    assert [(r["track"], r["runs"]) for r in rows] == [("cpu", 1), ("speedrun", 4)]
    cpu, speed = rows
    # By hand: mean 3.274, deviations -.004 .001 .005 -.002, sum of squares 46e-6 / 3 -> std 0.0039158;
    # t = -0.006 / (0.0039158 / 2) = -3.0645 with 3 degrees of freedom -> one-sided p = 0.0273.
    assert speed["final val loss"] == "3.2740 ± 0.0039"
    assert speed["reached"] == 3 and speed["time to target (s)"] == "110.0 ± 10.0"
    assert speed["target"] == "3.28" and float(speed["p(mean<=target)"]) == pytest.approx(0.0273, abs=5e-4)
    assert speed["hardware"] == "8x H100; 8x H100 SXM" and speed["torch"] == "2.6.0; 2.7.1"
    assert cpu["final val loss"] == "1.9100" and cpu["p(mean<=target)"] == "n/a" and cpu["target"] == "-"
    assert cpu["reached"] == 0 and cpu["time to target (s)"] == "-"
    header, *lines = format_table(rows).splitlines()
    at = header.index("final val loss")
    assert [line[at:at + 6] for line in lines] == ["1.9100", "3.2740"]  # plain text: columns aligned
    # An explicit target overrides the runs' own; one run still has no p-value.
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])], target=3.2745)
    assert float(rows[1]["p(mean<=target)"]) == pytest.approx(0.41, abs=0.01)  # t = -0.255, df 3
    assert rows[0]["p(mean<=target)"] == "n/a"
    # The target is part of the config (eval.target_loss): a run aiming at another one is another row.
    write_runs(tmp_path, [summary("m1", 3.3, target=3.5)])
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])])
    assert [(r["runs"], r["target"], r["differs"]) for r in rows[1:]] == [(4, "3.28", "-"),
                                                                        (1, "3.5", "eval.target_loss=3.5")]


def test_rows_never_pool_unlike_configs(tmp_path):
    # The case reported in issue 15: a 30-step run, a time-scheduled one and a wandb run, all "tiny", made one
    # row with one mean and one std; so would the README's --model.n_layer=16 override with unmodified runs.
    step = ["--train.schedule=step", "--train.max_steps=30"]
    timed = ["--train.schedule=time", "--train.budget_s=20"]
    runs = {"s1": (0.19, step), "s2": (0.20, [*step, "--log.wandb=true", "--log.every_steps=5"]),
            "s3": (0.21, [*step, "--train.checkpoint_every_s=60", "--log.dir=elsewhere"]),
            "t1": (2.10, timed), "n16": (1.50, [*step, "--model.n_layer=16"]),
            "seed1": (0.22, [*step, "--train.seed=1"]),
            "wide": (0.30, [*step, "--model.n_embd=128", "--model.n_head=4", "--optim.lr=0.01", "--train.batch_size=8",
                            "--train.seq_len=32", "--eval.tokens=4096"])}
    for run_id, (loss, overrides) in runs.items():
        write_runs(tmp_path, [summary(run_id, loss, track="tiny", config="tiny", target=0.5)], *overrides)
    loaded = [load_summary(p) for p in find_summaries([tmp_path])]
    rows = {r["runs"]: r for r in group_rows(loaded)}
    assert sorted(r["runs"] for r in group_rows(loaded)) == [1, 1, 1, 1, 3]
    pooled = rows[3]  # the log settings, where checkpoints go and how often they are saved change nothing trained
    assert pooled["final val loss"] == "0.2000 ± 0.0100" and pooled["config"] == "tiny"
    assert float(pooled["p(mean<=target)"]) < 0.01
    fingerprints = [r["fingerprint"] for r in group_rows(loaded)]
    assert len(set(fingerprints)) == 5 and all(re.fullmatch(r"[0-9a-f]{8}", f) for f in fingerprints)
    # What each row's runs set unlike tiny.toml: budget, shape and batch first, clipped at 80 characters
    # unless --all; every row here names its data and target (tiny.toml has neither)
    by_loss = {r["final val loss"]: r for r in group_rows(loaded)}
    everything = {r["final val loss"]: r for r in group_rows(loaded, show_all=True)}
    own = "data.train=shards/x/*.bin, eval.target_loss=0.5"
    assert by_loss["0.2000 ± 0.0100"]["differs"] == everything["0.2000 ± 0.0100"]["differs"] == own
    assert by_loss["1.5000"]["differs"] == f"model.n_layer=16, {own}"
    assert by_loss["2.1000"]["differs"] == ("train.budget_s=20.0, train.schedule=time, data.train=shards/x/*.bin, "
                                            "... (1 more)")
    assert everything["2.1000"]["differs"] == f"train.budget_s=20.0, train.schedule=time, {own}"
    assert by_loss["0.3000"]["differs"] == ("model.n_embd=128, model.n_head=4, train.seq_len=32, train.batch_size=8, "
                                            "... (4 more)")
    assert everything["0.3000"]["differs"] == ("model.n_embd=128, model.n_head=4, train.seq_len=32, "
                                               f"train.batch_size=8, {own}, eval.tokens=4096, optim.lr=0.01")
    assert by_loss["0.2000 ± 0.0100"]["run ids"] == "s1, s2, s3" and by_loss["0.2200"]["run ids"] == "seed1"
    # Seeds pool only when asked: then the seed-1 run joins the three.
    pooled = [r for r in group_rows(loaded, pool_seeds=True) if r["runs"] > 1]
    assert [r["runs"] for r in pooled] == [4] and pooled[0]["final val loss"] == "0.2050 ± 0.0129"


def test_a_resumed_run_is_set_apart_only_by_changes_that_can_move_its_result(tmp_path):
    # every run ends with the same config; how their resumes got there differs
    extended = [(60, "train.budget_s", 20.0, 25.0)]
    runs = {"fresh": (), "logged": [(50, "eval.every_s", 5.0, 10.0), (50, "log.every_steps", 1, 5),
                                    (50, "eval.batch_size", 4, 8), (50, "data.vocab_check", True, False)],
            "compiled": [(50, "train.compile", False, True)], "ext1": extended,
            "ext2": [(64, *extended[0][1:])]}  # the same extension, resumed at the end of the same budget
    for run_id, resumed in runs.items():
        write_runs(tmp_path, [summary(run_id, 0.2, track="tiny", config="tiny", target=None, resumed=resumed)],
                   "--train.timing=exclude_warmup")
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])], show_all=True)
    own = "data.train=shards/x/*.bin, train.timing=exclude_warmup"  # what every run sets unlike tiny.toml
    assert sorted((sorted(s["run_id"] for s in r["summaries"]), r["differs"]) for r in rows) == [
        (["compiled"], f"resumed=train.compile False->True, {own}"),
        (["ext1", "ext2"], f"resumed=train.budget_s 20.0->25.0, {own}"), (["fresh", "logged"], own)]
    # where evals run on the training clock (train.timing's default), their frequency takes time from training: apart
    on_clock = tmp_path / "on_clock"
    write_runs(on_clock, [summary("fresh", 0.2, track="tiny", config="tiny", target=None),
                          summary("logged", 0.2, track="tiny", config="tiny", target=None,
                                  resumed=runs["logged"][:1])])
    rows = group_rows([load_summary(p) for p in find_summaries([on_clock])])
    assert sorted(r["differs"] for r in rows) == ["data.train=shards/x/*.bin",
                                                  "resumed=eval.every_s 5.0->10.0, data.train=shards/x/*.bin"]


def test_differs_is_measured_from_the_config_file_with_its_base(tmp_path):
    # speedrun_1gpu.toml sets what it changes of its base, speedrun_8xh100.toml: a run of it as the file says
    # differs in nothing, and a run of a config file this checkout lacks is measured from the code's defaults
    write_runs(tmp_path, [summary("one", 3.3, config="speedrun_1gpu"), summary("mine", 3.4, config="tiny")])
    write_runs(tmp_path, [summary("short", 3.5, config="speedrun_1gpu")], "--train.budget_s=60", "--optim.lr=0.01",
               "--train.grad_accum=4")
    (tmp_path / "mine" / "summary.json").write_text((tmp_path / "mine" / "summary.json").read_text()
                                                    .replace('"tiny"', '"mine"'))
    proc = run([sys.executable, "-m", "scripts.leaderboard", str(tmp_path), "--all"])
    header, *lines, note = proc.stdout.strip().splitlines()
    at = header.index("differs")
    # by run id: two rows of one config and track are in the order of their fingerprints, hashes of every key
    differs = {line.split()[COLUMNS.index("run ids")]: line[at:] for line in lines}
    mine, one, short = differs["mine"], differs["one"], differs["short"]
    assert one == "-" and short == "train.budget_s=60.0, train.grad_accum=4, optim.lr=0.01"
    assert mine.startswith("train.max_steps=30, train.schedule=step, model.n_layer=2, model.n_embd=64, ")
    assert mine.endswith(", optim.lr=0.003, optim.weight_decay=0.0, train.dtype=float32, train.lr_decay_frac=0.5, "
                         "train.lr_final_frac=0.1, train.lr_warmup_frac=0.1")  # --all: every one
    assert note.endswith("from mine: the code's defaults (no configs/mine.toml here); speedrun_1gpu: "
                         "configs/speedrun_1gpu.toml over its base configs/speedrun_8xh100.toml")


def test_plot_draws_each_run_against_its_target(tmp_path):
    write_runs(tmp_path, [summary(f"s{i}", x, ttt=[90.0, None, 95.0][i]) for i, x in enumerate([3.277, 3.281, 3.278])])
    write_runs(tmp_path, [summary("n16", 3.25, ttt=80.0)], "--model.n_layer=16")
    out = tmp_path / "board.png"
    proc = run([sys.executable, "-m", "scripts.leaderboard", str(tmp_path), "--plot", str(out)])
    assert f"plot: {out}" in proc.stderr
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])])
    fig = plot_leaderboard([{"name": r["fingerprint"], "target": r["goal"], "runs": r["summaries"]} for r in rows],
                           tmp_path / "again.png")
    ax_time, ax_loss = fig.axes
    assert imread(out).shape[:2] == imread(tmp_path / "again.png").shape[:2] == (600, 2000)
    points = {line.get_gid(): sorted(line.get_ydata()) for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    assert points == {"time:0": [90.0, 95.0], "loss:0": [3.277, 3.278, 3.281], "target:0": [3.28, 3.28],
                      "time:1": [80.0], "loss:1": [3.25], "target:1": [3.28, 3.28]}
    assert [t.get_text() for t in ax_time.texts] == ["1 not reached"]


def test_plot_leaves_rows_without_a_target_out_of_the_time_panel_and_says_stopped(home, tmp_path):
    # real runs: d3 aims at no target; "a" ran to its end short of one; "s" was stopped by SIGTERM (a scheduler)
    data = tiny_data(tmp_path / "data")
    aim = "--eval.target_loss=1.0"  # far below what 3 steps on random ids reach
    run([sys.executable, *tiny_args(data, tmp_path / "runs", "a", "--train.max_steps=3", aim)])
    stopped = subprocess.Popen([sys.executable, *tiny_args(data, tmp_path / "runs", "s", aim)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics, deadline = tmp_path / "runs" / "s" / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and '"train"' in metrics.read_text()):
        assert stopped.poll() is None and time.time() < deadline, "the run to stop ended or never logged a step"
        time.sleep(0.05)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 0
    shutil.copytree(home / "runs" / "d3", tmp_path / "runs" / "d3")
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path / "runs"])])
    out = tmp_path / "board.png"
    fig = plot_leaderboard([{"name": r["run ids"], "target": r["goal"], "runs": r["summaries"]}
                            for r in sorted(rows, key=lambda r: r["run ids"])], out)
    ax_time, ax_loss = fig.axes
    assert [t.get_text() for t in ax_loss.get_xticklabels()] == ["a", "d3", "s"]
    assert [t.get_text() for t in ax_time.get_xticklabels()] == ["a", "s"]  # d3 has no time to target
    assert [t.get_text() for t in ax_time.texts] == ["1 not reached", "1 stopped"]
    assert [t.get_text() for t in ax_time.get_legend().get_texts()] == ["a: 0/1 reached", "s: 0/1 reached, 1 stopped"]
    assert imread(out).shape[:2] == (600, 2000)


def test_plot_without_a_target_has_no_time_to_target_panel(tmp_path):
    write_runs(tmp_path, [summary(f"c{i}", x, track="cpu", config="cpu", target=None)
                          for i, x in enumerate([1.9, 2.0])])
    out = tmp_path / "board.png"
    run([sys.executable, "-m", "scripts.leaderboard", str(tmp_path), "--plot", str(out)])
    assert imread(out).shape[:2] == (600, 1000)  # one panel
    rows = group_rows([load_summary(p) for p in find_summaries([tmp_path])])
    fig = plot_leaderboard([{"name": r["fingerprint"], "target": r["goal"], "runs": r["summaries"]} for r in rows],
                           tmp_path / "again.png")
    (ax_loss,) = fig.axes
    assert ax_loss.get_title() == "final val loss per run (no run has a target)"
    assert sorted(ax_loss.get_lines()[0].get_ydata()) == [1.9, 2.0]


def test_find_summaries_accepts_files_run_dirs_and_trees(tmp_path):
    write_runs(tmp_path / "a", [summary("r1", 3.3), summary("r2", 3.2)])
    one = tmp_path / "a" / "r1" / "summary.json"
    assert find_summaries([one]) == [one]
    assert find_summaries([tmp_path / "a" / "r2"]) == [tmp_path / "a" / "r2" / "summary.json"]
    assert len(find_summaries([tmp_path])) == 2
    assert len(find_summaries([tmp_path, tmp_path / "a" / "r1", one])) == 2


@pytest.mark.parametrize("content, message", [
    ("{\"run_id\": ", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ("{\"run_id\": \"x\"}", "missing key(s) config_name, track"),
])
def test_bad_summary_names_the_file(tmp_path, content, message):
    path = tmp_path / "run" / "summary.json"
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(SummaryError, match=re.escape(f"{path}: ")) as e:
        load_summary(path)
    assert message in str(e.value)


def test_a_run_without_its_config_is_refused(tmp_path):
    write_runs(tmp_path, [summary("r", 3.2)])
    (tmp_path / "r" / "config.toml").unlink()
    with pytest.raises(SummaryError, match=re.escape(f"{tmp_path / 'r' / 'config.toml'}: missing; train.py writes")):
        load_summary(tmp_path / "r" / "summary.json")


def test_non_numeric_loss_is_refused(tmp_path):
    write_runs(tmp_path, [summary("r", "3.2")])
    with pytest.raises(SummaryError, match="final_val_loss must be a number or null"):
        load_summary(tmp_path / "r" / "summary.json")


def test_bad_resume_changes_are_refused(tmp_path):
    write_runs(tmp_path, [{**summary("r", 3.2), "resume_changes": [{"key": "train.max_steps"}]}])
    with pytest.raises(SummaryError, match=re.escape(f"{tmp_path / 'r' / 'summary.json'}: resume_changes must be")):
        load_summary(tmp_path / "r" / "summary.json")
    write_runs(tmp_path, [{k: v for k, v in summary("old", 3.2).items() if k != "resume_changes"}])
    assert load_summary(tmp_path / "old" / "summary.json")["resume_changes"] == []  # written before the key was


def test_a_tree_leaves_out_a_summary_kept_without_its_config_and_says_so(tmp_path, capsys):
    write_runs(tmp_path / "a", [summary("r1", 3.3), summary("r2", 3.2)])
    (tmp_path / "a" / "r2" / "config.toml").unlink()
    assert find_summaries([tmp_path]) == [tmp_path / "a" / "r1" / "summary.json"]
    assert f"left out 1 of the 2 summary.json below {tmp_path} that have no config.toml" in capsys.readouterr().err
    assert find_summaries([tmp_path / "a" / "r2"]) == [tmp_path / "a" / "r2" / "summary.json"]  # named: refused


def test_a_folder_whose_runs_are_still_training_is_left_out_and_said(tmp_path, capsys):
    # run.sh's default: runs/ (a first run still training: config.toml and metrics.jsonl, no summary.json yet)
    # beside records/
    going = tmp_path / "runs" / "cpu-1"
    going.mkdir(parents=True)
    (going / "metrics.jsonl").write_text("")
    write_runs(tmp_path / "records", [summary("r1", 3.3)])
    assert main([str(tmp_path / "runs"), str(tmp_path / "records")]) == 0
    out, err = capsys.readouterr()
    assert "r1" in out and f"leaderboard: {tmp_path / 'runs'}: no summary.json in this folder or below it yet" in err
    with pytest.raises(SummaryError, match=re.escape(f"{tmp_path / 'runs'}: no summary.json in this folder or below "
                                                     f"it yet (a run writes it when it stops); nothing to rank")):
        find_summaries([tmp_path / "runs"])


def test_the_records_rank_as_the_readme_says(capsys):
    assert main([str(ROOT / "records"), "--markdown"]) == 0, capsys.readouterr().err
    assert "| cpu |" in capsys.readouterr().out


def test_a_row_says_how_many_of_its_runs_have_a_final_loss(tmp_path):
    write_runs(tmp_path, [summary("r1", 3.3), summary("r2", None)])
    [row] = group_rows([load_summary(p) for p in find_summaries([tmp_path])])
    assert (row["runs"], row["final val loss"]) == (2, "3.3000 (1 of 2 runs)")


def test_missing_paths_are_refused(tmp_path):
    with pytest.raises(SummaryError, match="no such file or folder"):
        find_summaries([tmp_path / "nope"])
    with pytest.raises(SummaryError, match="no summary.json in this folder"):
        find_summaries([tmp_path])


def test_cli_markdown_table_and_error(tmp_path):
    write_runs(tmp_path, [summary(f"s{i}", x, ttt=90.0 + i) for i, x in enumerate([3.277, 3.279, 3.278])])
    out = run([sys.executable, "-m", "scripts.leaderboard", str(tmp_path), "--target", "3.28", "--markdown"]).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("| track | config | fingerprint | runs |") and lines[1].startswith("|---|")
    # mean 3.278, std 0.001, t = -0.002/(0.001/sqrt 3) = -3.4641 with df 2 -> p = 0.0371
    assert re.match(r"\| speedrun \| speedrun_8xh100 \| [0-9a-f]{8} \| 3 \| s0, s1, s2 \| 3 \| 91.0 ± 1.0 \| "
                    r"3.2780 ± 0.0010 \| 3.28 \| 0.0371 \|.* \| - \|$", lines[2])
    # under the table: what "differs" is measured from (here: nothing, the runs are the config file's own)
    assert lines[4] == ("differs: settings the runs set unlike their config file's own values (budget, shape and "
                        "batch first; --all lists every one), from speedrun_8xh100: configs/speedrun_8xh100.toml")
    (tmp_path / "s1" / "summary.json").write_text("not json")
    proc = run([sys.executable, "scripts/leaderboard.py", str(tmp_path)], check=False)
    assert proc.returncode == 2 and f"{tmp_path / 's1' / 'summary.json'}: not valid JSON" in proc.stderr


def test_the_groups_declared_on_the_config_fields_decide_what_a_resume_change_does_to_a_row():
    # a change a resume cannot make never meets the leaderboard, so only the resume-safe keys need a verdict
    assert RUN_SPECIFIC == keys_in("run") and RUN_SPECIFIC <= RESULT_NEUTRAL <= RESUME_SAFE
    for timing in ("exclude_warmup", "from_first_forward"):
        config = {"train.timing": timing}
        moving = {key for key in RESUME_SAFE | RESUME_BUDGET if moves_result(key, config)}
        on_clock = keys_in("eval") if timing == "from_first_forward" else frozenset()
        assert moving == keys_in("speed", "budget") | on_clock
    assert moves_result("model.n_layer", {"train.timing": "exclude_warmup"})  # a key with no group


def test_a_run_copied_into_records_or_named_twice_counts_once(home, tmp_path):
    # records/README.md's copy of a run, beside the run itself: one row of 2 runs "d3, d3" was a false record claim
    shutil.copytree(home, tmp_path, dirs_exist_ok=True)
    kept = tmp_path / "records" / "tiny" / "X"
    kept.mkdir(parents=True)
    for name in ("log.txt", "summary.json", "config.toml", "loss.png"):
        shutil.copy(tmp_path / "runs" / "d3" / name, kept)
    proc = run([sys.executable, "-m", "scripts.leaderboard", "runs", "records"], cwd=tmp_path)
    assert proc.stdout.splitlines()[1].split()[3:5] == ["1", "d3"]  # runs, run ids
    assert proc.stderr == ("leaderboard: records/tiny/X/summary.json is a copy of runs/d3/summary.json (the same "
                           "bytes): counted once\n")
    proc = run([sys.executable, "-m", "scripts.leaderboard", "runs/d3", str(tmp_path / "runs" / "d3")], cwd=tmp_path)
    assert proc.stdout.splitlines()[1].split()[3:5] == ["1", "d3"] and proc.stderr == ""
    # one run id on two machines is two runs: their summaries differ
    write_runs(tmp_path / "a", [summary("r", 3.3)])
    write_runs(tmp_path / "b", [summary("r", 3.2)])
    assert len(find_summaries([tmp_path / "a", tmp_path / "b"])) == 2


def test_options_alone_read_the_checkouts_runs_and_records(home, tmp_path, monkeypatch, capsys):
    # run.sh passed runs/ and records/ only when given no argument: `--target 2.5` alone found no folder
    proc = run(["bash", "run.sh", "leaderboard", "--target", "2.5", "--markdown"], env={"SHARDRUN_VENV": sys.prefix})
    assert "| cpu |" in proc.stdout and "| 2.5 |" in proc.stdout
    # named as run.sh names them: relative in the checkout, else whole
    checkout = shutil.copytree(home, tmp_path / "checkout")
    (checkout / "records").mkdir()
    monkeypatch.setattr(scripts.leaderboard, "ROOT", checkout)
    for here, records in ((checkout, "records"), (tmp_path, str(checkout / "records"))):
        monkeypatch.chdir(here)
        assert main(["--target", "2.5"]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines()[1].split()[3:5] == ["1", "d3"]
        assert err.startswith(f"leaderboard: {records}: no summary.json in this folder or below it yet")
    monkeypatch.setattr(scripts.leaderboard, "ROOT", tmp_path / "bare")
    assert main([]) == 2
    assert capsys.readouterr().err == (f"leaderboard: no runs/ or records/ folder in {tmp_path / 'bare'} yet; train "
                                       f"first or name folders\n")
