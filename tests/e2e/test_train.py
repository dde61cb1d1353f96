"""train.py end to end: real torchrun processes on gloo, real shards from data.prepare, tiny model."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from data.loader import TokenLoader
from data.val import PAD_TARGET, val_batches
from model import get_model
from tests.helpers import (ROOT, TRAIN, demo_data, free_port, growing_window_run, make_shards, run,
                           short_docs_data, ten_second_steps, torchrun, train_args)
from trainer.clock import lr_multiplier
from trainer.report import summarize


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Path:
    """Real text (the stdlib's sources, bytes tokenizer) cut into a val shard and two train shards."""
    return demo_data(tmp_path_factory.mktemp("demo"), tokens=300_000, val_tokens=40_000, shard_tokens=130_000)


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_learns(run_dir: Path) -> None:
    losses = [r["loss"] for r in records(run_dir)]
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses  # ln(257) = 5.55 at init on real bytes


def check_checkpoint(run_dir: Path, demo: Path, trained: dict) -> None:
    """checkpoint.pt loads per the eval contract, equals the trained weights, and reproduces the run's val loss."""
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert set(ckpt) == {"config", "model", "step"} and ckpt["step"] == summary(run_dir)["steps"]
    assert ckpt["config"] == tomllib.loads((run_dir / "config.toml").read_text())
    assert not [k for k in ckpt["model"] if k.startswith(("module.", "_orig_mod.")) or "._orig_mod." in k]
    model = get_model(ckpt["config"])
    model.load_state_dict(ckpt["model"])
    reference = get_model(ckpt["config"])
    reference.load_state_dict(trained)
    idx = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        logits, _ = model(idx)
        assert logits.shape == (2, 64, 257)
        assert torch.equal(logits, reference(idx)[0])
        # the run's final val loss, recomputed from the checkpoint over the same per-rank val batches
        cfg, world = ckpt["config"], summary(run_dir)["world_size"]
        batches = [b for rank in range(world) for b in val_batches(
            sorted(demo.glob("*_val_*.bin")), cfg["train"]["batch_size"], cfg["train"]["seq_len"],
            cfg["eval"]["tokens"], rank=rank, world_size=world)]
        counts = [int((y != PAD_TARGET).sum()) for _, y in batches]
        # tiny.toml's eval.tokens: a short last sequence, then padding; rank 1's last batch is padding only
        assert sum(counts) == cfg["eval"]["tokens"] and (world == 1 or 0 in counts)
        sums = [(float(model(x, y)[1]) * n, n) for (x, y), n in zip(batches, counts) if n]
    loss, count = np.sum(sums, axis=0)
    assert loss / count == pytest.approx(summary(run_dir)["final_val_loss"], abs=1e-5)


def rank_states(run_dir: Path) -> list[dict]:
    done = json.loads((run_dir / "resume" / "done.json").read_text())
    folder = run_dir / "resume" / done["dir"]
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(done["world_size"])]


@pytest.fixture(scope="module")
def ddp_run(demo, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    torchrun(train_args(demo, runs, "ddp", "--train.parallel=ddp"))
    return runs / "ddp"


def test_ddp_trains_and_saves_the_eval_contract(ddp_run, demo):
    s = summary(ddp_run)
    assert (s["status"], s["steps"], s["world_size"], s["config_name"]) == ("completed", 30, 2, "tiny")
    assert s["tokens_seen"] == 30 * 4 * 64 * 2 * 2
    bytes_per_token = json.loads((demo / "meta.json").read_text())["bytes_per_token"]  # ~1: EOTs add tokens
    assert 0.99 < bytes_per_token < 1
    assert s["final_val_bpb"] == pytest.approx(s["final_val_loss"] / math.log(2) / bytes_per_token)
    assert_learns(ddp_run)
    check_checkpoint(ddp_run, demo, rank_states(ddp_run)[0]["model"])
    log = (ddp_run / "log.txt").read_text()
    assert "torch 2." in log and "command: " in log and "done: completed" in log and " | grad norm " in log
    assert all(0 < r["grad_norm"] < 100 for r in records(ddp_run))


def test_fsdp_trains_like_ddp_and_gathers_a_full_checkpoint(ddp_run, demo, tmp_path):
    torchrun(train_args(demo, tmp_path, "fsdp", "--train.parallel=fsdp"))
    run_dir = tmp_path / "fsdp"
    assert summary(run_dir)["status"] == "completed"
    # same data, same init, same math: FSDP2 and DDP agree up to reduction order
    fsdp, ddp = [r["loss"] for r in records(run_dir)], [r["loss"] for r in records(ddp_run)]
    assert fsdp == pytest.approx(ddp, rel=1e-3)
    # the gradient norm of the whole model, not of a rank's shards
    fsdp, ddp = [r["grad_norm"] for r in records(run_dir)], [r["grad_norm"] for r in records(ddp_run)]
    assert fsdp == pytest.approx(ddp, rel=1e-3)
    # evals too, although rank 1's last val batch is padding only (FSDP runs it like any other, counting nothing)
    fsdp, ddp = [r["val_loss"] for r in records(run_dir, "eval")], [r["val_loss"] for r in records(ddp_run, "eval")]
    assert fsdp and fsdp == pytest.approx(ddp, rel=1e-3)
    # the full checkpoint is the two ranks' dim-0 shards put together
    shards = [s["model"] for s in rank_states(run_dir)]
    # each rank saved only its shard of the weights; the windows, a buffer, whole
    assert [k for k, v in shards[0].items() if not isinstance(v, DTensor)] == ["windows"]
    trained = {k: torch.cat([s[k].to_local() for s in shards]) if isinstance(v, DTensor) else v
               for k, v in shards[0].items()}
    check_checkpoint(run_dir, demo, trained)


def test_a_rank_that_cannot_see_the_resume_state_stops_with_the_fix(ddp_run, demo, tmp_path):
    # as if log.dir were node-local: rank 0 resumes, rank 1 finds no state of its own
    shutil.copytree(ddp_run, tmp_path / "ddp")
    done = json.loads((tmp_path / "ddp" / "resume" / "done.json").read_text())
    (tmp_path / "ddp" / "resume" / done["dir"] / "rank1.pt").unlink()
    proc = torchrun(train_args(demo, tmp_path, "ddp", "--train.max_steps=40", "--extend-budget"), check=False)
    assert proc.returncode != 0
    assert "rank1.pt is missing, though rank 0 resumes from" in proc.stderr and "shared filesystem" in proc.stderr


@pytest.mark.slow
def test_resume_after_a_crash_repeats_the_uninterrupted_losses(ddp_run, demo, tmp_path):
    # a lost node: every rank SIGKILLs itself right after the resume state of step 8 is saved (tests/workers/die_at.py)
    die = [ROOT / "tests" / "workers" / "die_at.py", "trainer.checkpoint:save_resume", "step=8"]
    proc = torchrun([*die, *train_args(demo, tmp_path, "crash", "--train.checkpoint_every_s=1e-9")], check=False,
                    env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "exitcode: -9" in proc.stderr, proc.stderr[-5000:]
    saved = json.loads((tmp_path / "crash" / "resume" / "done.json").read_text())["step"]
    assert saved == 8
    torchrun(train_args(demo, tmp_path, "crash"))
    log = (tmp_path / "crash" / "log.txt").read_text()
    assert f"resumed at step {saved}" in log
    steps = [r["step"] for r in records(tmp_path / "crash")]
    assert steps == list(range(1, 31))  # nothing logged twice after the cut
    assert [r["loss"] for r in records(tmp_path / "crash")] == [r["loss"] for r in records(ddp_run)]


ROWS = ["--train.batch_stage_rows=true", "--model.block_size=192", "--train.timing=exclude_warmup",
        "--train.warmup_steps=1"]


@pytest.mark.parametrize("rows", [[], ROWS], ids=["micro_steps", "rows"])
def test_the_records_order_resumes_a_killed_run_on_its_next_row_through_the_batch_stages(tmp_path, rows):
    """data.sorted_shards and data.doc_cut (record 46's rows: documents in order, each cut at 32 tokens here) on 2
    ranks, tiny.toml's 2 micro-steps in stages [1, 2, 3] (or, train.batch_stage_rows, rows of 64, 128 and 192
    tokens, each length warmed up first): every rank SIGKILLed right after the resume state of step 15 (mid
    second stage) is saved, then relaunched, trains the rows the uninterrupted run trains: the same losses, step
    by step, and the same loader state at the end."""
    data = short_docs_data(tmp_path / "docs", tokens=200_000, val_tokens=20_000, shard_tokens=70_000)
    order = ["--data.bos_aligned=true", "--data.shuffle=false", "--data.sorted_shards=true", "--data.doc_cut=32",
             "--train.batch_stages=[1, 2, 3]", *rows]
    torchrun(train_args(data, tmp_path, "straight", *order))
    die = [ROOT / "tests" / "workers" / "die_at.py", "trainer.checkpoint:save_resume", "step=15"]
    proc = torchrun([*die, *train_args(data, tmp_path, "crash", *order, "--train.checkpoint_every_s=1e-9")],
                    check=False, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and "exitcode: -9" in proc.stderr, proc.stderr[-5000:]
    torchrun(train_args(data, tmp_path, "crash", *order))
    assert "resumed at step 15" in (tmp_path / "crash" / "log.txt").read_text()
    straight, crash = records(tmp_path / "straight"), records(tmp_path / "crash")
    assert [r["step"] for r in crash] == list(range(1, 31))
    assert crash[-1]["tokens"] == (10 * 2 + 10 * 4 + 10 * 6) * 512  # micro-steps by stage x 2 ranks x 4 x 64 tokens
    if rows:  # the same tokens in longer rows; the resumed run warms up the lengths still ahead
        logs = [(tmp_path / run / "log.txt").read_text() for run in ("straight", "crash")]
        assert "warm-up: 1 step of each of 3 row lengths" in logs[0] and "of each of 2 row lengths" in logs[1]
    assert [r["loss"] for r in crash] == [r["loss"] for r in straight]
    loaders = [[state["loader"] for state in rank_states(tmp_path / run)] for run in ("straight", "crash")]
    assert loaders[0] == loaders[1] and loaders[0][0]["seed"] is None and loaders[0][0]["epoch"] == 0
    assert loaders[0][0]["doc_cut"] == 32


def test_starter_flags_run_end_to_end_on_raw_chunks(tmp_path):
    data = tmp_path / "data"
    make_shards(data, [40000, 40000], vocab=512, header=False, pattern="chunk_{:04d}.bin", start=1)
    ckpt = tmp_path / "checkpoint.pt"
    torchrun([TRAIN, "--config", "configs/tiny.toml", "--model.vocab_size=512", f"--log.dir={tmp_path / 'runs'}",
              "--data_dir", str(data), "--checkpoint_path", str(ckpt), "--seq_len", "64", "--batch_size", "2",
              "--grad_accum_steps", "2", "--max_steps", "5000", "--time_limit_min", "0.1",
              "--train.max_steps=0"])  # as configs/hackathon_32gpu.toml: the clock alone ends it (tiny.toml: 30)
    [run_dir] = (tmp_path / "runs").iterdir()
    s = summary(run_dir)
    assert s["status"] == "budget" and s["budget_s"] == pytest.approx(6.0) and s["final_val_loss"] > 0
    assert s["run_id"].startswith("tiny-") and s["steps"] < 5000
    state = torch.load(ckpt, weights_only=True)
    get_model(state["config"]).load_state_dict(state["model"])
    assert state["config"]["data"]["format"] == "raw" and state["config"]["train"]["schedule"] == "time"


def test_budget_stops_within_a_step_and_decays_to_the_end(demo, tmp_path):
    torchrun(train_args(demo, tmp_path, "budget", "--train.schedule=time", "--train.budget_s=4",
                        "--train.max_steps=0", "--train.lr_final_frac=0.1", "--train.lr_decay_frac=0.5",
                        "--log.wandb=true"))  # WANDB_MODE=disabled (conftest): no network needed
    # the LR is a function of the step and the time all ranks agreed on (not each one's own stopwatch, which
    # made the DDP replicas drift apart); rank 0 alone saves the replicated model and optimizer state
    states = rank_states(tmp_path / "budget")
    assert states[0]["clock"]["synced"] == states[1]["clock"]["synced"] >= 4.0
    assert "model" in states[0] and not {"model", "optim"} & states[1].keys()
    s, last = summary(tmp_path / "budget"), records(tmp_path / "budget")[-1]
    assert s["status"] == "budget" and s["steps"] == last["step"]
    [final] = records(tmp_path / "budget", "eval")  # after the clock stopped: not charged
    assert final["step"] == s["steps"] and final["val_loss"] == s["final_val_loss"]
    # on CPU the step that saw the budget spent reads its flags at once (on GPU a step late, so that no step
    # waits for the GPU): the run ends within that step, and its LR, from the time agreed after the step before,
    # is within a step's share of the decay (0.9 over the last 2 s) of its final 0.1
    step_s = max(r["step_ms"] for r in records(tmp_path / "budget")[-3:]) / 1000
    assert 4.0 <= s["train_time_s"] <= 4.0 + step_s + 0.25
    assert 0.1 - 1e-9 <= last["lr_mult"] <= 0.1 + 0.45 * step_s + 0.01


def test_relaunching_a_finished_budget_run_says_so_and_touches_nothing(demo, tmp_path):
    cmd = [sys.executable, *train_args(demo, tmp_path, "again", "--train.schedule=time", "--train.budget_s=2",
                                       "--train.max_steps=0")]
    run(cmd)
    first = summary(tmp_path / "again")
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "again").rglob("*") if p.is_file()}
    out = run(cmd).stdout  # the same run id: its last save is where it ended
    assert out.strip() == (f"{tmp_path / 'again'}: this run finished (budget, step {first['steps']}, final val loss "
                           f"{first['final_val_loss']:.4f}); nothing to do (a larger train.budget_s with "
                           f"--extend-budget trains it on)")
    # no eval again, summary.json's wall times kept, nothing saved
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "again").rglob("*") if p.is_file()} == files


def test_warmup_is_untimed_and_target_stops_the_run(demo, tmp_path):
    run([sys.executable, *train_args(demo, tmp_path, "target", "--train.timing=exclude_warmup",
                                     "--train.warmup_steps=3", "--train.lr_warmup_frac=0", "--train.max_steps=200",
                                     "--eval.every_steps=5", "--eval.target_loss=3.5", "--eval.stop_at_target=true")])
    s, trained = summary(tmp_path / "target"), records(tmp_path / "target")
    assert s["status"] == "target" and s["time_to_target_s"] <= s["train_time_s"]
    assert s["steps"] % 5 == 0 and s["steps"] < 200 and s["best_val_loss"] <= 3.5
    assert s["wall"]["warmup_s"] > 0 and trained[0]["step"] == 1
    # the 3 warm-up steps (at full LR) were undone: step 1 saw the initial weights and the first batches
    config = tomllib.loads((tmp_path / "target" / "config.toml").read_text())
    torch.manual_seed(config["train"]["seed"])
    model = get_model(config)
    with TokenLoader(sorted(demo.glob("*_train_*.bin")), 4, 64, seed=config["data"]["seed"]) as batches, \
            torch.no_grad():
        first = torch.stack([model(*next(batches))[1] for _ in range(2)]).mean()
    assert trained[0]["loss"] == pytest.approx(float(first), rel=1e-5)


def test_the_records_time_to_target_is_the_whole_run_where_its_final_eval_reaches_it(demo, tmp_path):
    """eval.target_time: "first_eval" times the first eval at or below the target; "end" (the speedrun's, as its
    records are timed) the whole run's training time, where its final eval reaches the target, and none where it
    does not, whatever the evals along the way scored."""
    times = {}
    for name, target in (("first_eval", 100.0), ("end", 100.0), ("end", 0.5)):
        run_id = f"{name}-{target:g}"
        run([sys.executable, *train_args(demo, tmp_path, run_id, "--train.max_steps=15", "--eval.every_steps=5",
                                         f"--eval.target_loss={target}", f"--eval.target_time={name}")])
        s, evals = summary(tmp_path / run_id), records(tmp_path / run_id, "eval")
        assert [e["step"] for e in evals] == [5, 10, 15]  # the last step's eval is the final one
        times[run_id] = s["time_to_target_s"], s["train_time_s"], evals
    got, _, evals = times["first_eval-100"]
    # step 5's: the eval reads the clock twice, a few statements apart (its time, then its record); 0.1 s holds
    # them on a loaded machine, and 5 training steps still lie between it and the next eval
    assert got == pytest.approx(evals[0]["elapsed_s"], abs=0.1) and got < evals[1]["elapsed_s"]
    got, whole, evals = times["end-100"]
    assert got == whole > evals[1]["elapsed_s"]
    got, _, evals = times["end-0.5"]
    assert got is None and min(e["val_loss"] for e in evals) > 0.5


def test_sigterm_stops_after_the_step_and_saves(demo, tmp_path):
    cmd = [sys.executable, *train_args(demo, tmp_path, "term", "--train.schedule=time", "--train.budget_s=600",
                                       "--train.max_steps=0", "--eval.every_s=0.5", "--eval.tokens=2048")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "term" / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count('"eval"') >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run never got to its second eval"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    s = summary(tmp_path / "term")
    assert s["status"] == "sigterm" and s["final_val_loss"] is None
    # evals every 0.5 s of training time, each at a later step; none at the end after a SIGTERM
    evals = records(tmp_path / "term", "eval")
    assert all(e["elapsed_s"] >= 0.5 * (i + 1) for i, e in enumerate(evals))
    assert [e["step"] for e in evals] == sorted({e["step"] for e in evals}) and evals[-1]["step"] <= s["steps"]
    assert torch.load(tmp_path / "term" / "checkpoint.pt", weights_only=True)["step"] == s["steps"]
    assert json.loads((tmp_path / "term" / "resume" / "done.json").read_text())["step"] == s["steps"]


def test_a_run_told_not_to_save_leaves_no_checkpoint_and_still_scores(demo, tmp_path):
    # periodic saves due every step and the final one: none of them writes
    run([sys.executable, *train_args(demo, tmp_path, "nosave", "--train.save_checkpoint=false", "--train.max_steps=6",
                                     "--train.checkpoint_every_s=0.001", "--eval.tokens=2048")])
    folder = tmp_path / "nosave"
    assert not (folder / "checkpoint.pt").exists() and not (folder / "resume").exists()
    s = summary(folder)
    assert s["steps"] == 6 and s["final_val_loss"] is not None and math.isfinite(s["final_val_loss"])
    assert s["wall"]["checkpoint_s"] == 0


@pytest.mark.slow
def test_two_nodes_meet_through_run_sh_multinode_variables(demo, tmp_path):
    """Two `bash run.sh train` launches on 127.0.0.1 with NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT: run.sh turns
    them into torchrun --nnodes=2 with a c10d rendezvous, and the two nodes train as one world of 2."""
    env = {**os.environ, "SHARDRUN_VENV": sys.prefix, "NNODES": "2", "NPROC": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RDZV_ID": "two-nodes"}
    overrides = train_args(demo, tmp_path, "nodes", "--train.max_steps=4")[3:]  # after train.py --config tiny.toml
    nodes = [subprocess.Popen(["bash", "run.sh", "train", "configs/tiny.toml", *overrides], cwd=ROOT,
                              env={**env, "NODE_RANK": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    s = summary(tmp_path / "nodes")
    assert (s["world_size"], s["steps"], s["status"]) == (2, 4, "completed")


def test_bad_config_is_refused_before_training(demo, tmp_path):
    proc = run([sys.executable, *train_args(demo, tmp_path, "bad", "--train.batch_sise=4")], check=False)
    assert proc.returncode != 0
    assert "config error: command line: unknown key train.batch_sise; valid keys in [train]: batch_size" in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_a_diverging_run_stops_at_once_and_keeps_the_last_good_checkpoint(demo, tmp_path):
    # lr 1e10: steps 1 (warm-up, lr 0) and 2 are finite, step 3 is not; a save is due after every step
    proc = torchrun(train_args(demo, tmp_path, "nan", "--optim.lr=1e10", "--train.checkpoint_every_s=1e-9"),
                    check=False)
    assert proc.returncode != 0
    trained = records(tmp_path / "nan")
    bad = next(r["step"] for r in trained if not math.isfinite(r["loss"] + r["grad_norm"]))
    assert bad > 1 and all(r["grad_norm"] > 0 for r in trained[:bad - 1])
    for part in (f"train.py: step {bad}: loss ", "not finite, so training stopped without saving",
                 f"the checkpoint of step {bad - 1} is untouched", "lower learning rate", "optim.grad_clip = 1.0"):
        assert part in proc.stdout, proc.stdout[-2000:]
    # on CPU every step reads its own flags at once (on GPU a step late, so that no step waits for the GPU)
    assert trained[-1]["step"] == bad
    ckpt = torch.load(tmp_path / "nan" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == bad - 1 and all(v.isfinite().all() for v in ckpt["model"].values())
    assert json.loads((tmp_path / "nan" / "resume" / "done.json").read_text())["step"] == bad - 1


def test_a_batch_schedule_trains_the_tokens_it_says_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Stages [1, 2, 3] of tiny.toml's 2 micro-steps over 6 steps of 10 s each (a clock the test moves): 2, 2, 4,
    4, 6, 6 micro-batches of 4 x 64 tokens, 24 in all. The loader gives exactly those, metrics.jsonl counts each
    step's tokens at its stage, and a run stopped after step 3 and resumed logs and ends as the straight one."""
    import train

    stop_at = []

    def sigterm_at(run) -> None:  # a SIGTERM during step N (progress.step counts it after): the loop stops after it
        if run.progress.step + 1 in stop_at:
            run.stop_requested.append(signal.SIGTERM)
    ten_second_steps(monkeypatch, sigterm_at)

    def trained(folder: Path):
        run = growing_window_run(folder, "--train.max_steps=6", "--train.batch_stages=[1, 2, 3]",
                                 "--train.batch_stage_lr=[1.0, 1.5, 2.0]")
        try:
            status = train.train(run)
            train.save(run)
        finally:
            run.loader.close()
            run.log.close()
        return run, status

    straight, status = trained(tmp_path / "straight")
    assert (status, straight.progress.step, straight.progress.tokens) == ("completed", 6, 24 * 4 * 64)
    summary = summarize(straight, status, None)
    assert (summary.tokens_seen, summary.tokens_per_s) == (6144, 6144 / 60)
    # the loader gave 24 micro-batches: a fresh loader moved on 24 batches stands where the run's does
    fresh = growing_window_run(tmp_path / "fresh")
    for _ in range(24):
        next(fresh.loader)
    assert fresh.loader.state_dict() == straight.loader.state_dict()
    fresh.log.close()
    assert " | 512 -> 1,024 -> 1,536 tokens/step | " in (tmp_path / "straight" / "runs" / "w" / "log.txt").read_text()
    logged = records(tmp_path / "straight" / "runs" / "w")
    assert [r["tokens"] for r in logged] == [512, 1024, 2048, 3072, 4608, 6144]
    assert [r["tok_s"] for r in logged] == [51.2, 51.2, 102.4, 102.4, 153.6, 153.6]
    # the logged multiplier is the stage's times the schedule's (tiny.toml: warm-up 0.1, decay 0.5 to 0.1)
    stage_lr = [1.0, 1.0, 1.5, 1.5, 2.0, 2.0]
    assert [r["lr_mult"] for r in logged] == pytest.approx(
        [m * lr_multiplier(s / 6, 0.1, 0.5, 0.1) for s, m in enumerate(stage_lr)])

    stop_at.append(3)
    stopped, status = trained(tmp_path / "resumed")
    assert (status, stopped.progress.step, stopped.progress.tokens) == ("sigterm", 3, 2048)
    stop_at.clear()
    resumed, status = trained(tmp_path / "resumed")
    assert (status, resumed.progress.step, resumed.progress.tokens) == ("completed", 6, 6144)
    assert resumed.loader.state_dict() == straight.loader.state_dict()
    assert records(tmp_path / "resumed" / "runs" / "w") == logged
    end, want = resumed.model.module.state_dict(), straight.model.module.state_dict()
    assert all(torch.equal(end[k], want[k]) for k in want)


def test_a_head_that_unties_trains_and_resumes_bit_for_bit_under_ddp_and_fsdp2(tmp_path):
    """tests/workers/untie_worker.py on 2 gloo ranks: train.py's loop with model.untie_at, model.mtp_weights and
    model.prefix_weight (a tokenizer whose token 256, "ab", has the prefix "a"), AdamW every second step. Every rank
    unties at the same step; a run stopped before the untie (with held AdamW gradients) or after it resumes to the
    straight run's losses and weights, and its checkpoint.pt loads, tied or not; DDP and FSDP2 train alike, up to
    float64 rounding."""
    import base64

    make_shards(tmp_path, [20_000], vocab=257)
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256}
    (tmp_path / "ab.tiktoken").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": str(tmp_path / "ab.tiktoken"), "vocab_size": 258}))
    out = tmp_path / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "untie_worker.py", tmp_path, out], env={"PYTHONPATH": str(ROOT)},
             timeout=600)
    results = torch.load(out, weights_only=True)
    for parallel, runs in results.items():
        straight = runs["straight"]
        assert straight["tied"] == [[True] * 4 + [False] * 4] * 2, parallel
        assert int(straight["state"]["head_tied"]) == 0 and straight["prefix_targets"] == [-1] * 256 + [97, -1]
        assert not torch.equal(straight["state"]["lm_head.weight"], straight["state"]["wte.weight"])
        for stop, tied in ((3, (True, True)), (6, (False, False))):
            assert runs[f"stopped{stop}"]["status"] == "sigterm" and runs[f"stopped{stop}"]["checkpoint_tied"] == tied
            resumed = runs[f"resumed{stop}"]
            assert resumed["status"] == "completed" and resumed["losses"] == straight["losses"], (parallel, stop)
            assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items()), (parallel, stop)
    # DDP and FSDP2 sum the ranks' gradients in other orders (FSDP2 adds the held AdamW gradient after the
    # average, DDP before), so their weights differ by rounding, which AdamW's step g / (|g| + eps) turns into up
    # to lr * rounding / eps: an entry whose gradient is near eps moves by a different fraction of lr. In float32
    # that is up to ~1e-3 on some CPUs' kernels and 0 on others, so the two paths are compared in float64: one
    # step's gradients (|g| < 1) rounded apart move an entry by at most lr * float64's eps / eps, and a real
    # difference (a step or a gradient applied twice, lost, or at another step) moves it by a good part of lr.
    ddp, fsdp = results["ddp"]["float64"], results["fsdp"]["float64"]
    assert ddp["tied"] == fsdp["tied"] == results["ddp"]["straight"]["tied"]
    lr, adam_eps, steps = 0.05, 1e-8, 8  # ARGS' largest rate (optim.embed_lr), optim.eps, train.max_steps
    atol = steps * lr * torch.finfo(torch.float64).eps / adam_eps
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=atol)
    for k, v in ddp["state"].items():
        assert v.dtype == torch.float64 or not v.is_floating_point(), k
        torch.testing.assert_close(fsdp["state"][k], v, atol=atol, rtol=0, msg=k)
