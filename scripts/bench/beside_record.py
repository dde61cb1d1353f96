"""A modded-nanogpt record's own script beside ours on ONE GPU, offline: the same shards, steps, tokens per step, val
tokens and eval steps. Prints and writes the val loss at every shared eval, tokens/s over the same timed steps,
compile seconds, peak memory, the ratios ours/record, and each side's step by kernel category.

    python -m scripts.gpt2_bpe --out gpt2_bpe && python -m scripts.prose_shards --tokenizer gpt2_bpe --out shards/prose
    python -m scripts.bench.beside_record --record upstream/10e8f7c6-....txt --data shards/prose --steps 30 \\
        --eval-every 10 --out records/beside_record/<date>_<gpu>
    python -m scripts.bench.beside_record ... --side ours      # on CPU: our side and the report, no record side

--record is the record's log (its code above a line of 100 "=") or its train_gpt.py, fetched by you into a folder
git ignores (upstream/): its code is never copied into the output. Its `Hyperparameters` are rewritten for the
run (each change printed), the copy written to --work; it runs under torchrun's variables at world size 1, as its
`grad_accum_steps = 8 // world_size` makes one GPU train its 8-GPU batches, with DATA_PATH = --data and, on its
PYTHONPATH, scripts/beside/standin/kernels.py in place of the kernel hub's FlashAttention 3 (FlexAttention). Ours
is train.py with --ours-config and the overrides printed. Both run under scripts/beside/side_probe.py, which
measures them alike; scripts/beside/report.py reads what they left. Ours runs first (its compile time is known),
then the stand-in's GPU check, then the record with the time left of --timeout-s.

Both schedules are cut to --steps alike: the record's num_scheduled_iterations is --steps with no extension steps
and ours runs train.max_steps = --steps under train.schedule = "step" with no train.extension_steps, so each side's
LR, window and batch stages fall at the same fractions of the run as in its full one; the Muon momentum warm-up stays
300 steps on both (and holds while it lasts, before any cooldown).

The record's loader reads each shard once and then waits for ever, so --steps is bounded by what one epoch of the
shards holds (the harness counts it and refuses more). --epochs N gives both sides the train shards N times in a
row, as links in --work (scripts/beside/record_data.py `repeated`): the same tokens in the same order on both.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from data.shards import open_shard
from scripts.beside import report
from scripts.beside.record_data import docs_limit, most_val_documents, record_coverage, repeated
from scripts.beside.record_script import RecordError, eval_steps, hyperparameters, record_code, rewrite, step_tokens
from trainer.clock import Clock
from trainer.config import Config, ConfigError, parse_args as parse_config
from util.atomic import write_json, write_text
from util.process import run_group

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "scripts" / "beside" / "standin"
RECORD_WORLD = 1        # both sides run on one GPU
RECORD_GRAD_ACCUM = 8   # the record's grad_accum_steps = 8 // world_size, at world size 1
BOS = 50256             # GPT-2's <|endoftext|>, which opens every document of the shards
PROFILE_SKIP = 2        # timed steps before the profiled ones: the first step of a loop warms its caches
TERM_GRACE_S = 15.0     # a side told to stop at its timeout has this long to write what it measured


@dataclasses.dataclass
class Plan:
    """Everything both sides run with, decided before either starts."""
    code: str                    # the record's script with its Hyperparameters rewritten
    hp: dict                     # its Hyperparameters after the rewrite
    changes: dict                # field -> (old, new)
    ours: list[str]              # train.py's arguments
    cfg: Config                  # ours, parsed
    record_warmup_steps: int     # the record's Muon steps before its timed loop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m scripts.bench.beside_record", description=__doc__.split("\n")[0])
    p.add_argument("--record", type=Path, required=True, help="the record's log .txt or train_gpt.py")
    p.add_argument("--data", type=Path, required=True,
                   help="DATA_PATH: shards in DATA/data/fineweb10B/ (python -m scripts.prose_shards)")
    p.add_argument("--steps", type=int, required=True, help="training steps of each side")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evals (default: a third of --steps)")
    p.add_argument("--epochs", type=int, default=1,
                   help="read the train shards this many times in a row, both sides (links in --work)")
    p.add_argument("--out", type=Path, help="results (default runs/beside_record/<date>_<device>)")
    p.add_argument("--work", type=Path, default=Path(".cache/beside_record"),
                   help="the rewritten record script and both sides' run folders (outside git)")
    p.add_argument("--side", choices=["both", "record", "ours", "report"], default="both",
                   help="run both sides, one of them, or only write the report from what --work holds")
    p.add_argument("--timeout-s", type=float, default=520.0,
                   help="the whole run's limit: ours first, then the stand-in's check and the record's side with the "
                        "time left; a side cut short reports what it logged")
    p.add_argument("--ours-timeout-s", type=float, default=200.0, help="our side's own limit within it")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--ours-config", default="configs/speedrun_1gpu.toml")
    p.add_argument("--ours-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="one more override of our side (repeat)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    args.eval_every = args.eval_every or max(args.steps // 3, 1)
    args.data, args.work = args.data.resolve(), args.work.resolve()  # the sides run in other folders
    if args.eval_every <= PROFILE_SKIP + args.profile_steps:
        p.error(f"--eval-every must be > {PROFILE_SKIP + args.profile_steps}: the profiled steps come before the "
                f"first eval after step 0, outside the timed steps that tokens/s counts")
    if args.steps < 2 * args.eval_every:
        p.error("--steps must be at least twice --eval-every: tokens/s counts the steps from the first eval after "
                "step 0 to the last")
    return args


def shard_files(data: Path, split: str) -> list[Path]:
    """The record's glob of a split: DATA/data/fineweb10B/fineweb_<split>_*.bin, sorted."""
    files = sorted((data / "data" / "fineweb10B").glob(f"fineweb_{split}_*.bin"))
    if not files:
        raise RecordError(f"{data / 'data' / 'fineweb10B'}: no fineweb_{split}_*.bin; make the shards with python -m "
                          f"scripts.prose_shards --out {data}")
    return files


def val_tokens(hp: dict, val_file: Path) -> int:
    """The most whole val_batch_size batches, up to the record's own val_tokens, that the val shard holds with
    the two tokens the record's val loader reads past them."""
    batch, have = hp["val_batch_size"], len(open_shard(val_file, fmt="header"))
    batches = min((have - 2) // batch, hp["val_tokens"] // batch)
    if batches < 1:
        raise RecordError(f"{val_file}: {have:,} tokens; the record scores val_batch_size = {batch:,} at least and "
                          f"reads 2 more: make it with python -m scripts.prose_shards --val-tokens {batch + 2}")
    return batches * batch


def plan(args: argparse.Namespace) -> Plan:
    """Read the record, rewrite its Hyperparameters, derive our overrides; refuse a pair that would not train
    alike, or data its loader would run out of."""
    code = record_code(args.record)
    hp = hyperparameters(code, args.record)
    val = val_tokens(hp, shard_files(args.data, "val")[0])
    new = {"num_scheduled_iterations": args.steps, "num_extension_iterations": 0, "val_loss_every": args.eval_every,
           "val_tokens": val}
    code = rewrite(code, new, args.record)
    changes = {k: (hp[k], v) for k, v in new.items() if hp[k] != v}
    hp = hyperparameters(code, args.record)
    warmup = re.search(r"^warmup_steps = (\d+)", code, re.M)
    if warmup is None:
        raise RecordError(f"{args.record}: no top-level line 'warmup_steps = N': the harness counts the record's "
                          f"warm-up steps to know where its timed steps start")
    fineweb = args.data / "data" / "fineweb10B"
    ours = ["--config", args.ours_config, f"--data.train={fineweb}/fineweb_train_*.bin",
            f"--data.val={fineweb}/fineweb_val_*.bin", f"--train.max_steps={args.steps}", "--train.schedule=step",
            "--train.extension_steps=0", "--train.budget_s=0", f"--eval.every_steps={args.eval_every}",
            "--eval.every_s=0", f"--eval.tokens={val}", "--eval.stop_at_target=false",
            "--train.save_checkpoint=false", "--train.resume=overwrite", f"--log.dir={args.work / 'ours'}",
            "--log.run_id=run",
            *(f"--{kv}" for kv in args.ours_set)]
    try:
        cfg = parse_config(ours)
    except ConfigError as e:
        raise RecordError(f"our side ({args.ours_config}): {e}") from None
    check_alike(hp, cfg, args.record)
    # the record's warm-up runs its warmup_steps at each (batch, window) pair of its schedule, the extension's too
    return Plan(code, hp, changes, ours, cfg, int(warmup[1]) * (len(hp["ws_schedule"]) + 1))


def check_alike(hp: dict, cfg: Config, record: Path) -> None:
    """Refuse sides whose steps hold different tokens or whose evals score different cuts of the val set."""
    train, data, cut = cfg.train, cfg.data, hp["train_max_seq_len"]
    if not (data.sorted_shards and data.bos_aligned and data.doc_cut == cut):
        raise RecordError(f"{record}: the record's rows are documents from its shards in sorted order, each cut at "
                          f"{cut} tokens; ours has data.sorted_shards = {data.sorted_shards}, bos_aligned = "
                          f"{data.bos_aligned}, doc_cut = {data.doc_cut}: give our side data.shuffle=false, "
                          f"data.sorted_shards=true, data.bos_aligned=true and data.doc_cut={cut} with --ours-set")
    ours = train.tokens_by_stage(RECORD_WORLD)
    if list(hp["train_bs_schedule"]) != ours:
        raise RecordError(f"{record}: the record's steps hold {list(hp['train_bs_schedule'])} tokens by stage, ours "
                          f"{ours} (train.batch_size x seq_len x grad_accum x batch_stages): give our side the "
                          f"record's with --ours-set")
    record_rows = hp["val_batch_size"] // RECORD_GRAD_ACCUM
    if (cfg.eval.seq_len or train.seq_len) * (cfg.eval.batch_size or train.batch_size) != record_rows:
        raise RecordError(f"{record}: the record scores its val set in forwards of {record_rows:,} tokens, ours of "
                          f"eval.seq_len x eval.batch_size: set them to match with --ours-set")


def say_plan(args: argparse.Namespace, p: Plan) -> list[str]:
    """The lines that say what each side runs with."""
    lines = [f"record: {args.record.name}, its Hyperparameters rewritten:"]
    lines += [f"  {k}: {old!r} -> {new!r}" for k, (old, new) in p.changes.items()]
    ours_from = 0 if p.cfg.eval.at_start else args.eval_every
    lines += [f"ours: python train.py {' '.join(p.ours)}",
              f"both: {args.steps} steps, tokens by stage {list(p.hp['train_bs_schedule'])}, the stages in thirds of "
              f"the {args.steps} steps; evals after steps {eval_steps(p.hp)} (ours from {ours_from} on) on "
              f"{p.hp['val_tokens']:,} val tokens",
              f"both: schedules cut alike to {args.steps} steps, without extension steps (ours under "
              f"train.schedule = 'step'); Muon's momentum warm-up stays the record's 300 steps, ours "
              f"{p.cfg.optim.muon_momentum_warmup_steps}",
              f"record: {RECORD_GRAD_ACCUM} micro-batches a step of one row of 1/{RECORD_GRAD_ACCUM} of the step's "
              f"tokens, growing by stage; ours "
              + " -> ".join(f"{micro_steps} micro-batches of {p.cfg.train.batch_size} x {row}"
                            for micro_steps, row in p.cfg.train.stage_shapes())]
    return lines


def coverage_line(args: argparse.Namespace, p: Plan) -> str:
    """How many of the steps the shards give the record's loader; RecordError if fewer than asked."""
    cover = record_coverage(shard_files(args.data, "train"), lambda s: step_tokens(p.hp, s), args.steps,
                            RECORD_GRAD_ACCUM, p.hp["train_max_seq_len"], BOS)
    if cover.short_at is not None:
        raise RecordError(f"{args.data}: the record's loader gets {cover.steps} of the {args.steps} steps from these "
                          f"shards ({args.epochs} epoch(s)) and would then wait for ever: lower --steps, raise "
                          f"--epochs or make more shards")
    rows = p.hp["val_batch_size"] // RECORD_GRAD_ACCUM
    val_docs = most_val_documents(shard_files(args.data, "val")[0], rows, p.hp["val_tokens"] // rows, BOS)
    if cover.over_limit or val_docs > docs_limit(rows):
        raise RecordError(f"{args.data}: {cover.over_limit} of the record's training micro-batches hold more "
                          f"documents than its table takes (most {cover.most_docs}), its val rows {val_docs} of "
                          f"{docs_limit(rows)}: documents this short make it fail")
    epochs = f" read {args.epochs} times in a row" if args.epochs > 1 else ""
    return f"data: the record's loader reads all {args.steps} steps from the shards{epochs} (at most " \
           f"{cover.most_docs} documents in a micro-batch, {val_docs} in a val row)"


def run_side(cmd: list[str], cwd: Path, env: dict, console: Path, timeout: float) -> str:
    """Run one side to its end or its timeout; 'ok', 'exit N' or 'timeout'. At the timeout its process group gets
    SIGTERM, so that the probe writes what it measured, and SIGKILL TERM_GRACE_S later."""
    code = run_group(cmd, cwd=cwd, env={**os.environ, **env}, log=console, timeout=timeout, grace=TERM_GRACE_S)
    return "ok" if code == 0 else code if code == "timeout" else f"exit {code}"


def probe_cmd(json_path: Path, profile_from: int, profile_steps: int, script: Path, *script_args: str) -> list[str]:
    """scripts/beside/side_probe.py around `script`."""
    return [sys.executable, "-m", "scripts.beside.side_probe", "--json", str(json_path), "--profile-from",
            str(profile_from), "--profile-steps", str(profile_steps), str(script), *script_args]


def require_cuda() -> None:
    """Refuse the record's side where there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RecordError("the record's script needs CUDA (NCCL, Triton kernels, torch.cuda at import): run the "
                          "record's side on a GPU machine; on CPU, --side ours rehearses our side and the report")


def run_record(args: argparse.Namespace, p: Plan, timeout: float) -> str:
    """The record's side, for at most `timeout` seconds."""
    work = args.work / "record"
    script = work / "train_gpt.py"
    write_text(script, p.code)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29517 + os.getpid() % 1000), "DATA_PATH": str(args.data),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(STANDIN), str(ROOT), os.environ.get("PYTHONPATH")]))}
    print("record: runs on the kernels stand-in (FlexAttention for FlashAttention 3, "
          "scripts/beside/standin/kernels.py)", flush=True)
    cmd = probe_cmd(work / "probe.json", p.record_warmup_steps + PROFILE_SKIP, args.profile_steps, script)
    return run_side(cmd, work, env, work / "console.txt", timeout)


def run_ours(args: argparse.Namespace, p: Plan, timeout: float) -> str:
    """Our side, for at most `timeout` seconds."""
    work = args.work / "ours"
    cmd = probe_cmd(work / "probe.json", Clock(p.cfg.train).warmup_steps(0) + PROFILE_SKIP, args.profile_steps,
                    ROOT / "train.py", *p.ours)
    return run_side(cmd, ROOT, {"PYTHONPATH": str(ROOT)}, work / "console.txt", timeout)


def standin_on_gpu(args: argparse.Namespace, p: Plan) -> dict:
    """The stand-in's forward and backward on the GPU against float64, and the milliseconds of one block-mask build
    at each micro-batch size of the run, with the documents of the val shard."""
    from scripts.beside.standin import kernels

    val = np.asarray(open_shard(shard_files(args.data, "val")[0], fmt="header"))
    out = {"check": kernels.gpu_check()}
    # create_block_mask evaluates every (query, key) pair whatever the window, so one window stands for all
    window = p.hp["ws_schedule"][-1] * p.hp["block_size"]
    out["mask_ms"] = {n: kernels.time_block_mask(np.flatnonzero(val[:n] == BOS), n, window)
                      for n in sorted({step_tokens(p.hp, s) // RECORD_GRAD_ACCUM for s in range(args.steps)})}
    return out


def default_out() -> Path:
    """runs/beside_record/<date>_<device>."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return Path("runs/beside_record") / f"{datetime.date.today()}_{re.sub(r'[^A-Za-z0-9]+', '-', device)}"


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.bench.beside_record`."""
    args = parse_args(argv)
    deadline = time.monotonic() + args.timeout_s
    try:
        if args.epochs > 1:
            args.data = repeated(shard_files(args.data, "train"), shard_files(args.data, "val"),
                                 args.work / "epoch_links", args.epochs)
        p = plan(args)
        lines = say_plan(args, p) + [coverage_line(args, p)]
        print("\n".join(lines), flush=True)
        if args.side in ("both", "record"):
            require_cuda()  # before our side runs: a CPU machine says so at once
        status = {}
        if args.side in ("both", "ours"):  # first: its compile time is known, the record's is not
            status["ours"] = run_ours(args, p, min(args.ours_timeout_s, left(deadline)))
        if args.side in ("both", "record"):
            try:
                standin = standin_on_gpu(args, p)
            except Exception as e:  # noqa: BLE001 - the check's failure is a finding; the record still runs
                standin = {"error": f"{type(e).__name__}: {e}"[:1000]}
            write_json(args.work / "record" / "standin.json", standin)
            status["record"] = run_record(args, p, left(deadline))
        out = args.out or default_out()
        print(report.write(out, args.work, p.hp, lines, status), flush=True)
    except RecordError as e:
        sys.exit(f"beside_record: error: {e}")
    failed = [f"the {side} side: {how} (its output: {args.work / side / 'console.txt'})"
              for side, how in status.items() if how != "ok"]
    if failed:
        sys.exit(f"beside_record: {'; '.join(failed)}; the report holds what it logged")


def left(deadline: float) -> float:
    """Seconds a side may run before `deadline`, its grace to stop kept aside."""
    return deadline - time.monotonic() - TERM_GRACE_S

if __name__ == "__main__":
    main()
