"""trainer/resume.py: which run a launch is, and resuming under a changed config: refused before anything is
written, unless the keys are safe to change or the budget is extended on purpose; the command that resumes a
stopped run. Real train.py runs on tiny shards; a real run folder is compared byte for byte."""
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Iterator

import pytest
import torch

from scripts.leaderboard import find_summaries, group_rows, load_summary
from tests.helpers import ROOT, VOCAB, make_shards, run, tiny_args, tiny_data, torchrun
from trainer.config import ConfigError, check_resume, parse_args
from trainer.clock import Clock
from trainer.distributed import Dist
from trainer.resume import LOCK, change_lines, default_run_id, hold, resume_command
from trainer.runs import unfinished_run


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, run folder) of a completed 30-step tiny run."""
    tmp = tmp_path_factory.mktemp("resume")
    data = tiny_data(tmp / "data")
    run([sys.executable, *tiny_args(data, tmp / "runs", "r1")])
    return data, tmp / "runs" / "r1"


def relaunch(data: Path, run_dir: Path, *extra: str, check: bool = True):
    """train.py on `run_dir` again (same data and run id) with `extra` arguments."""
    return run([sys.executable, *tiny_args(data, run_dir.parent, run_dir.name, *extra)], check=check)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder below `folder`: its sha256, or "dir"; not the lock, which says who last held it."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.name != LOCK}


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run folder under tmp_path/runs, with the same run id."""
    return Path(shutil.copytree(run_dir, tmp_path / "runs" / run_dir.name))


def test_a_changed_model_data_or_optimizer_is_refused_and_nothing_changes(finished, tmp_path):
    data, run_dir = finished
    before = snapshot(run_dir)
    proc = relaunch(data, run_dir, "--model.n_layer=3", "--optim.lr=0.01", "--data.seed=4", "--train.max_steps=40",
                    check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = proc.stderr
    assert f"config error: {run_dir}: the run's resume state was saved under another config" in err
    for line in ("  data.seed: saved 0, now 4\n", "  model.n_layer: saved 2, now 3\n",
                 "  optim.lr: saved 0.003, now 0.01\n",
                 "  train.max_steps: saved 30, now 40 (or pass --extend-budget to train the saved run longer)\n"):
        assert line in err, err
    assert ("Either start a new run (another --log.run_id) or resume with the saved values (--data.seed=0 "
            "--model.n_layer=2 --optim.lr=0.003 --train.max_steps=30)") in err
    assert snapshot(run_dir) == before  # config.toml, log.txt, metrics.jsonl, checkpoint, resume state


def test_safe_keys_are_taken_and_said_and_a_budget_only_extends_on_purpose(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    out = relaunch(data, run_dir, "--train.max_steps=40", "--extend-budget", "--eval.every_steps=5",
                   "--model.attention=flex").stdout
    said = [line for line in out.splitlines() if line.startswith("resume: ")]
    # tiny.toml decays over the last half of max_steps to 0.1: step 31 of 40 is back at 0.1 + 0.9 * 0.25 / 0.5
    assert said == ["resume: model.attention: saved 'sdpa', now 'flex'",  # a speed key: the same attention
                    "resume: train.max_steps: saved 30, now 40",
                    "resume: eval.every_steps: saved 0, now 5",
                    f"resume: log.dir: saved '{finished[1].parent}', now '{run_dir.parent}'",  # the copy's folder
                    "resume: --extend-budget: the LR schedule now spans the new budget, so step 31 runs at LR "
                    "multiplier 0.550 instead of 0.100 (a decay that had ended rises again); this is not the run the "
                    "new budget gives from the start"]
    assert "resumed at step 30" in out and "done: completed | step 40 |" in out
    assert tomllib.loads((run_dir / "config.toml").read_text())["eval"]["every_steps"] == 5
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if r["type"] == "train"]
    assert steps == list(range(1, 41))
    evals = {r["step"]: r["val_loss"] for r in lines if r["type"] == "eval"}
    first = json.loads((finished[1] / "summary.json").read_text())["final_val_loss"]
    assert list(evals) == [30, 35, 40] and evals[30] == first  # the finished run's final eval, after its save, kept
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["best_val_loss"] == min(evals.values())
    # the state is now saved under the extended budget: the next resume compares with that
    assert json.loads((run_dir / "resume" / "done.json").read_text())["config"]["train"]["max_steps"] == 40


def test_a_finished_run_relaunched_says_so_and_touches_nothing(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    before, val = snapshot(run_dir), json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    for extra in [(), ("--eval.every_steps=5",), ("--extend-budget",)]:  # a safe key, or the same budget
        out = relaunch(data, run_dir, *extra).stdout
        assert out.strip() == (f"{run_dir}: this run finished (completed, step 30, final val loss {val:.4f}); nothing "
                               f"to do (a larger train.max_steps with --extend-budget trains it on)")
        assert snapshot(run_dir) == before  # no eval, no new summary, log line or checkpoint


def test_a_run_that_saved_its_state_is_not_trained_on_without_saving(finished, tmp_path):
    # it trained to step 40 past its state at 30, and each relaunch trained 30 to 40 again
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    before = snapshot(run_dir)
    proc = relaunch(data, run_dir, "--train.max_steps=40", "--extend-budget", "--train.save_checkpoint=false",
                    check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"config error: {run_dir}: this run saved its state (step 30), so it goes on saving it: with "
            f"train.save_checkpoint = false its end would lie past") in proc.stderr, proc.stderr[-3000:]
    assert snapshot(run_dir) == before


def test_a_launch_removes_what_saves_killed_mid_write_left_behind(finished, tmp_path):
    # a SIGKILL while a save writes leaves its temporary file, as large as the checkpoint, for ever
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    elsewhere = tmp_path / "saves"  # train.checkpoint_path, outside the run folder, a glob's brackets in its name
    elsewhere.mkdir()
    left = [run_dir / ".checkpoint.pt.tmp4242", run_dir / "resume" / ".done.json.tmp4242",
            elsewhere / ".ck[1].pt.tmp4242"]
    kept = [run_dir / ".notes.tmpfoo", run_dir / "notes.tmp4242", elsewhere / ".ck1.pt.tmp4242"]  # not our writes'
    for path in left + kept:
        path.write_bytes(b"partial")
    relaunch(data, run_dir, "--train.max_steps=32", "--extend-budget", f"--train.checkpoint_path={elsewhere}/ck[1].pt")
    assert [p for p in left if p.exists()] == [] and all(p.exists() for p in kept)


def test_a_finished_run_trained_on_keeps_what_its_final_eval_gave(tmp_path):
    # its state is saved before the final eval: done.json records the counters and metrics.jsonl after it
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    run([sys.executable, *tiny_args(data, runs, "t", "--eval.target_loss=20")])  # its final eval reaches it
    first = json.loads((runs / "t" / "summary.json").read_text())
    assert first["time_to_target_s"] is not None
    relaunch(data, runs / "t", "--eval.target_loss=20", "--train.max_steps=40", "--extend-budget")
    rows = [json.loads(line) for line in (runs / "t" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["val_loss"] for r in rows if r["type"] == "eval"}
    assert list(evals) == [30, 40] and evals[30] == first["final_val_loss"]
    assert [r["step"] for r in rows if r["type"] == "train"] == list(range(1, 41))
    summary = json.loads((runs / "t" / "summary.json").read_text())
    assert summary["best_val_loss"] == min(evals.values()) and summary["time_to_target_s"] == first["time_to_target_s"]
    assert summary["wall"]["eval_s"] > first["wall"]["eval_s"]  # both final evals


def test_a_launch_training_a_finished_run_on_that_is_killed_leaves_a_run_to_resume(finished, tmp_path):
    data, run_dir = finished
    original = json.loads((run_dir / "summary.json").read_text())
    for extra, steps in [((), 30), (("--train.max_steps=40", "--extend-budget"), 40)]:  # relaunched as it was, or on
        folder = copy_of(run_dir, tmp_path / str(steps))
        die = [ROOT / "tests" / "workers" / "die_at.py", "trainer.report:log_step", "5"]  # at step 35, before a save
        killed = run([sys.executable, *die, *tiny_args(data, folder.parent, folder.name, "--train.max_steps=40",
                                                       "--extend-budget")], check=False)
        assert killed.returncode == -9 and not (folder / "summary.json").exists()  # unfinished: not the 30 steps'
        relaunch(data, folder, *extra)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["type"] == "train"] == list(range(1, steps + 1))
        assert [r["step"] for r in rows if r["type"] == "eval"] == sorted({30, steps})  # the first end's eval once
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps"] == steps and (steps == 40 or summary["final_val_loss"] == original["final_val_loss"])


def test_a_finished_run_is_said_so_to_a_smaller_budget_and_another_world_size(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    before = snapshot(run_dir)
    smaller = relaunch(data, run_dir, "--train.max_steps=20", "--extend-budget").stdout
    other = relaunch(data, run_dir, "--train.budget_s=999", "--extend-budget").stdout  # not what stopped it
    proc = torchrun(tiny_args(data, run_dir.parent, run_dir.name), nproc=2)
    for out in (smaller, other, proc.stdout):
        assert out.strip().startswith(f"{run_dir}: this run finished (completed, step 30"), out
    assert snapshot(run_dir) == before
    proc = torchrun(tiny_args(data, run_dir.parent, run_dir.name, "--train.max_steps=40", "--extend-budget"),
                    nproc=2, check=False)
    assert proc.returncode == 1 and "saved with world size 1, this one has world size 2" in proc.stderr


def test_a_finished_run_that_saved_nothing_is_said_so_and_not_trained_over(tmp_path):
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    run([sys.executable, *tiny_args(data, runs, "n", "--train.save_checkpoint=false")])
    before, val = snapshot(runs / "n"), json.loads((runs / "n" / "summary.json").read_text())["final_val_loss"]
    out = relaunch(data, runs / "n", "--train.save_checkpoint=false").stdout
    assert out.strip() == (f"{runs / 'n'}: this run finished (completed, step 30, final val loss {val:.4f}) and saved "
                           f"no state to train on from (train.save_checkpoint = false); nothing to do (--overwrite "
                           f"trains it again from the start)")
    assert snapshot(runs / "n") == before
    relaunch(data, runs / "n", "--train.save_checkpoint=false", "--overwrite")


def test_a_resume_state_that_cannot_be_read_is_one_line(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    done = run_dir / "resume" / "done.json"
    [state] = done.parent.glob("step*/rank0.pt")
    for cut, why in ((1000, "it is incomplete (a copy cut short"), (0, "it is empty")):
        state.write_bytes(state.read_bytes()[:cut])
        proc = relaunch(data, run_dir, "--train.max_steps=40", "--extend-budget", check=False)
        assert proc.returncode == 1 and proc.stderr.strip().startswith(
            f"train.py: config error: {state}: this resume state cannot be read ({why}"), proc.stderr[-3000:]
        assert proc.stderr.strip().endswith("start a new log.run_id, or train this one from the start with "
                                            "--overwrite")
    done.write_text("{not json")
    proc = relaunch(data, run_dir, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().startswith(
        f"train.py: config error: {run_dir}: its resume marker cannot be read ("), proc.stderr[-3000:]


@pytest.fixture
def read_only(tmp_path) -> Iterator[Path]:
    """A folder this process cannot write: a read-only tmpfs for root (whom permissions do not stop), else one
    without write permission."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("root without mount (a container without CAP_SYS_ADMIN): no read-only folder to try")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_folder_the_saves_cannot_write_is_refused_before_the_first_step(read_only, tmp_path):
    data = tiny_data(tmp_path / "data")
    for extra, key in [((f"--train.checkpoint_path={read_only}/ck/checkpoint.pt",), "train.checkpoint_path"),
                       ((), "log.dir")]:
        runs = read_only / "runs" if key == "log.dir" else tmp_path / "runs"
        proc = run([sys.executable, *tiny_args(data, runs, "r", *extra)], check=False)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith(
            f"train.py: config error: {key} = "), proc.stderr[-3000:]
        assert f": {read_only} cannot be written by this process" in proc.stderr and "step 1 |" not in proc.stdout


def test_resume_never_refuses_a_folder_with_a_run_and_overwrite_replaces_it(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    before = snapshot(run_dir)
    proc = relaunch(data, run_dir, "--train.resume=never", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"train.py: config error: train.resume = 'never', but {run_dir} holds a run already (resume, checkpoint.pt, "
        f"metrics.jsonl, summary.json, log.txt, config.toml, loss.png); start a new run in another folder (another "
        f"log.run_id), or replace this one with --train.resume=overwrite (--overwrite)")
    assert snapshot(run_dir) == before
    # a fresh start under another config: nothing of the old run is resumed, kept or appended to
    relaunch(data, run_dir, "--overwrite", "--train.max_steps=10", "--model.n_layer=1")
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["type"] == "train"]
    assert steps == list(range(1, 11)) and json.loads((run_dir / "summary.json").read_text())["steps"] == 10
    assert json.loads((run_dir / "resume" / "done.json").read_text())["step"] == 10
    log = (run_dir / "log.txt").read_text()
    assert log.count(f"run {run_dir.name} |") == 1 and "resumed" not in log
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["config"]["model"]["n_layer"] == 1
    # --overwrite was this launch's: the run's own config.toml, launched again (a record rerun), keeps the run
    after = snapshot(run_dir)
    out = run([sys.executable, "train.py", "--config", str(run_dir / "config.toml")]).stdout
    assert out.startswith(f"{run_dir}: this run finished (completed, step 10, ") and snapshot(run_dir) == after, out


HOLD = """import sys, time
from pathlib import Path
from trainer.distributed import Dist
from trainer.resume import hold
hold(Path(sys.argv[1]), Dist())
print("held", flush=True)
time.sleep(600)
"""


def test_a_launch_into_a_run_folder_another_launch_trains_is_refused_and_changes_nothing(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    # a process holding the folder as a launch training it does (the same log.run_id launched twice)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(run_dir)
        proc = relaunch(data, run_dir, "--train.max_steps=40", "--extend-budget", check=False)
        assert proc.returncode == 1 and proc.stderr.strip() == (
            f"train.py: config error: {run_dir} is being trained by another launch (process {holder.pid} on "
            f"{socket.gethostname()}, .lock says): wait for it to end, or train this one under another log.run_id")
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    relaunch(data, run_dir, "--train.max_steps=40", "--extend-budget")  # killed, the holder let go


def test_a_process_that_holds_a_run_folder_may_run_it_again(tmp_path):
    hold(tmp_path / "r", Dist())  # train.main called twice in one process: a harness, a notebook
    hold(tmp_path / "r", Dist())


def test_keys_added_or_removed_since_the_save_are_not_differences():
    cfg = parse_args(["--config", "configs/tiny.toml", "--data.train=x", "--train.max_steps=50"])
    saved = cfg.to_dict()
    del saved["model"]["rope_base"]           # added to the code after the save: compared as its default
    saved["optim"]["retired_key"] = 1         # no longer in the code: nothing to compare it with
    saved["train"]["max_steps"] = 30
    with pytest.raises(ConfigError, match=r"train\.max_steps: saved 30, now 50 \(or pass --extend-budget"):
        check_resume(saved, cfg, "runs/x")
    cfg.extend_budget = True
    assert [str(c) for c in check_resume(saved, cfg, "runs/x")] == ["train.max_steps: saved 30, now 50"]
    saved["model"]["rope_base"] = 5.0         # a saved value that is not the default is a difference
    with pytest.raises(ConfigError, match=r"model\.rope_base: saved 5\.0, now 10000\.0"):
        check_resume(saved, cfg, "runs/x")


def test_a_run_whose_resume_changed_its_result_gets_its_own_leaderboard_row(finished, tmp_path):
    data, r1 = finished
    board = tmp_path / "runs"
    extended = copy_of(r1, tmp_path)
    relaunch(data, extended, "--train.max_steps=40", "--extend-budget")
    run([sys.executable, *tiny_args(data, board, "fresh40", "--train.max_steps=40")])
    # relaunched from another folder under another id: changes where it logs, not what it trained
    again = Path(shutil.copytree(r1, board / "again"))
    (again / "summary.json").unlink()  # as if killed in its final eval: a relaunch finishes it
    relaunch(data, again)
    saved = json.loads((extended / "summary.json").read_text())["resume_changes"]
    assert saved == [{"step": 30, "key": "train.max_steps", "saved": 30, "now": 40},
                     {"step": 30, "key": "log.dir", "saved": str(r1.parent), "now": str(board)}]
    assert json.loads((r1 / "summary.json").read_text())["resume_changes"] == []
    # the extended run's LR schedule was 30 steps' for 30 steps, then 40's: not a sample of fresh 40-step runs
    rows = group_rows([load_summary(p) for p in find_summaries([r1, board])], show_all=True)
    own = f"data.train={data}/*_train_*.bin, data.val={data}/*_val_*.bin, eval.tokens=2048"  # unlike tiny.toml
    assert sorted((r["runs"], r["differs"]) for r in rows) == [
        (1, f"train.max_steps=40, {own}"), (1, f"train.max_steps=40, resumed=train.max_steps 30->40, {own}"),
        (2, own)]
    assert {s["run_id"] for r in rows if r["runs"] == 2 for s in r["summaries"]} == {"r1", "again"}


def test_the_newest_unfinished_run_is_found_with_what_would_keep_it_from_continuing(finished, tmp_path):
    data, run_dir = finished
    run_dir = copy_of(run_dir, tmp_path)
    cfg = parse_args(tiny_args(data, run_dir.parent, "other")[1:])  # run.sh asks under a new run's id
    assert unfinished_run(run_dir.parent, "r*", cfg, 1) is None  # it finished
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    assert unfinished_run(run_dir.parent, "r*", cfg, 1) == (run_dir, 30, [])
    cfg.train.max_steps = 40
    assert unfinished_run(run_dir.parent, "r*", cfg, 2) == (run_dir, 30, ["train.max_steps: saved 30, now 40",
                                                                          "processes: saved 1, now 2"])


def test_a_run_id_is_torchruns_so_a_restart_finds_its_folder_else_new_each_launch(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    assert default_run_id("cpu") == "cpu-job42"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    first = default_run_id("cpu")
    assert first.startswith("cpu-") and first.endswith(f"-{os.getpid()}") and first != "cpu-none"


@pytest.mark.parametrize("argv, resume, env, want", [
    (["train.py", "--config", "c.toml"], "auto", {}, "cd {here} && {py} train.py --config c.toml --log.run_id=r1"),
    (["train.py", "--config", "c.toml", "--overwrite"], "overwrite", {},
     "cd {here} && {py} train.py --config c.toml --log.run_id=r1 --train.resume=auto"),
    (["train.py", "--log.run_id=r1", "--train.resume=never"], "never", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
     "cd {here} && {py} -m torch.distributed.run --standalone --nproc_per_node=2 train.py --log.run_id=r1 "
     "--train.resume=never --train.resume=auto"),
    (["train.py", "--data_dir", "my data"], "auto", {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"},
     "the same torchrun command on each node, launching train.py --data_dir 'my data' --log.run_id=r1"),
])
def test_the_resume_command_fixes_the_run_id_and_resumes_whatever_the_first_launch_said(monkeypatch, argv, resume,
                                                                                          env, want):
    monkeypatch.setattr(sys, "argv", argv)
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = parse_args(["--data.train=x", "--train.budget_s=1", "--log.run_id=r1", f"--train.resume={resume}"])
    assert resume_command(cfg) == want.format(py=shlex.quote(sys.executable), here=shlex.quote(os.getcwd()))


def test_an_extended_budget_says_what_it_does_to_the_next_steps_lr():
    base = ["--data.train=x", "--train.lr_decay_frac=0.5"]
    saved = parse_args([*base, "--train.budget_s=10"]).to_dict()
    cfg = parse_args([*base, "--train.budget_s=20", "--extend-budget"])
    clock = Clock(cfg.train)
    clock.load_state_dict({"elapsed": 10.0, "synced": 10.0})  # the first budget spent: its decay ended at 0
    changes = check_resume(saved, cfg, "runs/r")
    lines = change_lines(cfg.train, saved["train"], clock, 30, changes)
    assert lines[0] == f"resume: {changes[0]}" and "train.budget_s" in lines[0]
    assert lines[-1] == ("resume: --extend-budget: the LR schedule now spans the new budget, so step 31 runs at LR "
                         "multiplier 1.000 instead of 0.000 (a decay that had ended rises again); this is not the "
                         "run the new budget gives from the start")
    assert change_lines(cfg.train, saved["train"] | {"budget_s": 20.0}, clock, 30, []) == []


def test_a_data_file_added_or_remade_since_the_save_is_refused_and_nothing_changes(tmp_path):
    data, run_dir = tiny_data(tmp_path / "data"), tmp_path / "runs" / "r"
    run([sys.executable, *tiny_args(data, run_dir.parent, run_dir.name, "--train.max_steps=4")])
    before = snapshot(run_dir)

    def refused(message: str) -> None:
        proc = relaunch(data, run_dir, "--train.max_steps=8", "--extend-budget", check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"config error: {run_dir}: cannot resume: loader state: {message}" in proc.stderr, proc.stderr[-3000:]
        assert snapshot(run_dir) == before

    added = Path(shutil.copy(sorted(data.glob("*_train_*.bin"))[0], data / "zz_train_000009.bin"))  # the same glob
    refused("files was")
    added.unlink()
    make_shards(data, [19_000], vocab=VOCAB, seed=5, start=1)  # the second file re-made under its name
    refused("test_train_000001.bin held 20,000 tokens at the save and holds 19,000 now")


def test_a_log_dir_or_checkpoint_path_a_save_cannot_write_is_refused_before_training(finished, tmp_path):
    data, _ = finished
    (tmp_path / "taken").write_text("mine")
    shard = sorted(data.glob("*_train_*.bin"))[0]
    before = shard.read_bytes()
    cases = [(tmp_path / "taken", [], f"log.dir = '{tmp_path / 'taken'}': {tmp_path / 'taken'} is a file"),
             (tmp_path / "runs", [f"--train.checkpoint_path={tmp_path}"], "is a folder; name the file to write"),
             (tmp_path / "runs", [f"--train.checkpoint_path={tmp_path / 'taken' / 'ck.pt'}"],
              f"{tmp_path / 'taken'} is a file, so no folder can hold the checkpoint there"),
             (tmp_path / "runs", [f"--train.checkpoint_path={shard}"], "names a file that is not a checkpoint")]
    for runs, extra, message in cases:
        proc = run([sys.executable, *tiny_args(data, runs, "r", *extra)], check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert message in proc.stderr and "step 1 " not in proc.stdout, proc.stderr[-3000:]
    assert (tmp_path / "taken").read_text() == "mine" and shard.read_bytes() == before
    (tmp_path / "held.pt").touch()  # an empty file that holds the name: written over
    run([sys.executable, *tiny_args(data, tmp_path / "runs", "r", f"--train.checkpoint_path={tmp_path / 'held.pt'}",
                                    "--train.max_steps=2")])
    assert torch.load(tmp_path / "held.pt", weights_only=True)["step"] == 2
