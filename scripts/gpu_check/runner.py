"""One-shot check of the GPU recipes on one GPU, offline, within 540 s from a cold compile cache: every open
question in one device call.

    bash scripts/gpu_check.sh --json $OUT/gpu_check.json        # one H100/H200, no network
    bash scripts/gpu_check.sh --json $OUT/gpu_check.json --record   # and records/gpu_check/<date>_<gpu>/
    bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json  # tiny sizes, the same code paths (tests)
    bash scripts/gpu_check.sh --checks hackathon --json $OUT/gpu_check.json  # one check again, after a fix

Builds its data first: random-token llm.c shards (GPT-2 vocabulary, a document every ~1,000 tokens as in
FineWeb) and raw uint16 chunks (vocabulary 32,000) for throughput, and the stdlib demo corpus (bytes
tokenizer, `python -m data.prepare`, its end-of-text then renumbered as GPT-2's) for a loss that must fall.
Then one subprocess per check, in this order (most needed first), each under its own timeout; the timeouts,
their kill grace and the data's add up to the deadline, so every check gets its full share even if all before
it ran out:
    speedrun   configs/speedrun_8xh100.toml at world size 1 (a rank's share of the 8-GPU run), random tokens,
               wrapped in DDP as the 8-GPU run is (train.ddp_always)
    text       the same run on the demo corpus: the loss must fall, but not to ~0 (a leaking mask would). Its
               model, vocabulary and shapes are the speedrun's, so it loads the speedrun's compiled graphs
    kernels    scripts/gpu_check/kernels.py: FlexAttention vs SDPA in bf16 (output and gradients, head size 128,
               document mask + window), its backward's compile, the pinned loader ring vs the CPU path, and the
               FP8 head's matmul (model.fp8_head) against float64, eager and compiled, and its speed against bf16's;
               the symmetric-product kernel (optim.muon_symmetric) against float64, and Polar Express with it
    hackathon  configs/hackathon_32gpu.toml (its model and per-GPU batch) on random raw chunks
The training checks save no checkpoint (train.save_checkpoint = false): that is not what they measure. They run
train.py under scripts/gpu_check/probe.py, which times the phases of ~30 real steps with CUDA events
(forward+backward, each optimizer, the flag exchange, the GPU's idle gap, data wait), counts graph breaks,
recompiles and dynamic (symbolic-size) graphs in training, in two back-to-back evals halfway through the
budget and in the training after them, and times the compiles; it rewrites its JSON after every stage, and
metrics.jsonl is read too, so a check stopped by its timeout still reports what it measured (for a compile in
flight: how long it had run). Every check shares one inductor cache, fresh at the start (compile figures are
cold ones; a later check reuses kernels).
Compile time is the untimed warm-up less its steps (timing = exclude_warmup). MFU assumes 989 TFLOP/s dense
bf16 per H100/H200 SXM (trainer/metrics.py). On random tokens the val loss must stay near ln(vocab): nothing
in them is predictable unless the model sees the future. Each finding gets a verdict line: PASS, FAIL or SLOW
with its threshold (n/a where the CPU cannot say); the exit code is 1 if any is FAIL.
"""
from __future__ import annotations

import time

STARTED = time.time()  # before torch's import, which can take seconds on a cold node: the deadline counts it

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from data.meta import META, read_meta
from data.shards import open_shard, write_shard
from scripts.gpu_check.sizes import CHECKS, CPU, GPU, KILL_GRACE_S, Sizes
from util.process import run_group
from scripts.gpu_check.verdicts import compile_cell, first_given, fmt, judged
from trainer import ROOT
from util.atomic import atomic_path, write_json
from trainer.config import parse_args as parse_train_args
from trainer.data import GPT2_VOCAB
from trainer.mfu import gpu_peak_flops
from trainer.plots import PlotError, read_run

GPT2_EOT, HACKATHON_VOCAB, BYTES_EOT = 50256, 32000, 256
MEAN_DOC_TOKENS = 1000  # FineWeb documents average about this many GPT-2 tokens
TRAINING = ("speedrun", "hackathon", "text")
PHASES = ("data", "forward+backward", "adamw", "muon", "other", "flags", "idle")  # the probe's, in step order
# Thresholds of the verdicts
FIT_MARGIN = 0.90  # the share of device memory a re-tuned batch may plan for


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU: rehearse every step without a GPU")
    p.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="data and run folders go here")
    p.add_argument("--record", nargs="?", const="auto", type=str, metavar="DIR",
                   help="also write gpu_check.json and table.md to DIR (default: records/gpu_check/<date>_<gpu>/)")
    p.add_argument("--checks", default=",".join(CHECKS), metavar="NAMES",
                   help=f"run only these, in the usual order (default: {','.join(CHECKS)}); e.g. one check again "
                        "after a fix, in less device time (the text check reuses the speedrun's compiled graphs)")
    args = p.parse_args(argv)
    args.checks = args.checks.split(",")
    unknown = set(args.checks) - set(CHECKS)
    if unknown:
        p.error(f"--checks: no check {', '.join(sorted(unknown))}; the checks are {', '.join(CHECKS)}")
    return args


# --- data ---------------------------------------------------------------------------------------------------
def random_documents(n: int, eot: int, rng: np.random.Generator) -> np.ndarray:
    """n random ids below `eot` (GPT-2's last id), with `eot` opening documents of ~MEAN_DOC_TOKENS tokens."""
    tokens = rng.integers(0, eot, size=n)
    tokens[np.flatnonzero(rng.random(n) < 1 / MEAN_DOC_TOKENS)] = eot
    tokens[0] = eot
    return tokens


def build_data(work: Path, sizes: Sizes) -> dict[str, str]:
    """Write the random shards and chunks and prepare the demo corpus at GPT-2's ids; return an error per part
    that failed."""
    rng = np.random.default_rng(0)
    rand, raw = work / "data" / "random", work / "data" / "raw"
    write_shard(rand / "random_val_000000.bin", random_documents(sizes.val_tokens, GPT2_EOT, rng))
    for i in (1, 2):
        write_shard(rand / f"random_train_{i:06d}.bin",
                    random_documents(sizes.train_tokens, GPT2_EOT, rng))
        write_shard(raw / f"chunk_{i:04d}.bin", rng.integers(0, HACKATHON_VOCAB, size=sizes.train_tokens),
                    dtype=np.uint16, header=False)
    prepared = work / "data" / "demo_bytes"
    cmd = [sys.executable, "-m", "data.prepare", "--demo", "--tokenizer", "bytes", "--out", str(prepared),
           *sizes.demo_args]
    rc, tail = run_bounded(cmd, work / "data" / "prepare.out", sizes.timeout_s["data"], sizes, work)
    if rc != 0:
        return {"text": f"data.prepare exited {rc}: {tail[-600:]}"}
    at_gpt2_ids(prepared, work / "data" / "demo")
    return {}


def at_gpt2_ids(prepared: Path, out: Path) -> None:
    """data.prepare's bytes-tokenizer shards in `prepared`, written to `out` with their end-of-text (256) as GPT-2's
    (50,256), and a meta.json that says so: the text check then trains the speedrun's model, vocabulary and all.

    Bytes keep their ids (0..255), so the text's bytes per token stay as prepare measured them. meta.json drops
    what would no longer hold: the tokenizer (the bytes one does not decode 50,256) and prepare's settings (they
    would make a data.prepare run take `out` for its own)."""
    meta = read_meta(prepared, missing_ok=False)
    shutil.rmtree(out, ignore_errors=True)  # no shard of an earlier, larger build may match the check's globs
    for shard in meta["shards"]:
        tokens = np.array(open_shard(prepared / shard["file"], fmt="header"))
        tokens[tokens == BYTES_EOT] = GPT2_EOT
        write_shard(out / shard["file"], tokens, dtype=np.uint16)
    derived = {k: v for k, v in meta.items() if k not in ("tokenizer", "settings")}
    write_json(out / META, {**derived, "vocab_size": GPT2_VOCAB, "eot_token": GPT2_EOT,
                            "source": f"{prepared} (bytes tokenizer), end-of-text {BYTES_EOT} -> {GPT2_EOT}"})


# --- running one check --------------------------------------------------------------------------------------
def run_bounded(cmd: list[str], log: Path, timeout: float, sizes: Sizes, work: Path) -> tuple[int | str, str]:
    """Run `cmd` in its own process group with output to `log`; (exit code or "timeout", output tail).

    A new session, so that stopping it takes the whole group, inductor's compile workers included: on its
    timeout, and when this script ends early (the shell's outer timeout sends SIGTERM: see main)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
           # one compile cache for every check: a shape compiled once is loaded, not compiled, the next time
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache"),
           # the reasons, in the check's output (the probe counts them from dynamo's books)
           "TORCH_LOGS": "recompiles,graph_breaks",
           # train.py's memory estimate (trainer/memory.py) warns instead of refusing: the check
           # measures the real peak, and an out-of-memory error is its answer
           "SHARDRUN_MEMORY_CHECK": "warn", **sizes.env}
    rc = run_group(cmd, cwd=ROOT, env=env, log=log, timeout=timeout, grace=KILL_GRACE_S)
    return rc, log.read_text(errors="replace")[-3000:]


def check_args(name: str, work: Path, sizes: Sizes) -> tuple[list[str], float]:
    """train.py's arguments for one training check, and the val loss expected at init: its head is zero, so ln of
    the width of its softmax, the config's model.vocab_size (the speedrun's is the record's, GPT-2's padded)."""
    data = work / "data"
    budget, steps = sizes.budget_s[name], sizes.steps.get(name)
    # evals halfway through the run, so that training resumes after them (off the clock: exclude_warmup); none at
    # step 0, so that the first eval, which compiles, is the one the probe watches halfway
    halfway = ([f"--train.max_steps={steps}", "--train.schedule=step", f"--eval.every_steps={steps // 2}",
                "--eval.every_s=0"] if steps else [f"--eval.every_s={budget / 2}", "--eval.every_steps=0"])
    common = [f"--train.budget_s={budget}", "--train.timing=exclude_warmup", *halfway, "--eval.at_start=false",
              "--eval.target_loss=0", "--eval.stop_at_target=false",
              f"--log.dir={work / 'runs'}", f"--log.run_id={name}", "--train.resume=never",
              "--train.save_checkpoint=false", *sizes.overrides]
    if name == "hackathon":
        return at_init(["--config", "configs/hackathon_32gpu.toml", f"--data.train={data}/raw/chunk_*.bin",
                        "--train.warmup_steps=3", *common, *sizes.recipe_overrides.get("hackathon", [])])
    # DDP at world size 1: its graph split, bucket hooks and collectives meet the GPU before an 8-GPU job does. The
    # schedule in time (in the CPU rehearsal's steps), so that the check passes every batch stage and window, not
    # the first of 2,160 steps; the stages in more micro-steps of one row length, since each longer row would be
    # one more cold compile than the check's time holds (the run beside the record compiles them)
    speedrun = ["--config", "configs/speedrun_8xh100.toml", "--train.ddp_always=true", "--train.schedule=time",
                "--train.max_steps=0", "--train.extension_steps=0", "--optim.muon_momentum_cooldown_steps=0",
                "--train.batch_stage_rows=false", *common, *sizes.recipe_overrides.get("speedrun", [])]
    if name == "text":
        # The speedrun's run in all that reaches its graphs (vocabulary, shapes, DDP), on at_gpt2_ids' shards.
        # Not BOS-aligned (so no document cut): stdlib files average ~17,600 bytes, so aligned windows would skip
        # ~90% of the text and repeat the rest until the model memorised it. The document mask still applies where
        # files meet.
        return at_init([*speedrun, f"--data.train={data}/demo/demo_train_*.bin",
                        f"--data.val={data}/demo/demo_val_*.bin", "--data.bos_aligned=false", "--data.doc_cut=0"])
    return at_init([*speedrun, f"--data.train={data}/random/random_train_*.bin",
                    f"--data.val={data}/random/random_val_*.bin"])


def at_init(argv: list[str]) -> tuple[list[str], float]:
    """`argv` and the val loss of its zero head: ln of its config's model.vocab_size."""
    return argv, math.log(parse_train_args(argv).model.vocab_size)


def eval_tokens(argv: list[str], batches: int) -> int:
    """Val tokens for `batches` full eval batches of this run (one compiled shape): val_batches cuts the stream
    every T tokens, T being the eval's sequence length (`Config.eval_shape`), so any more would start a batch of
    padding."""
    rows, tokens = parse_train_args(argv).eval_shape
    return batches * rows * tokens


def read_json(path: Path) -> dict:
    """A JSON file, or {} if it is missing or cut short (a check killed while writing it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def steady(run_dir: Path) -> tuple[float | None, float | None]:
    """Median tokens/s and MFU over the second half of the logged training steps (a last line cut short by a kill
    skipped); (None, None) where none were logged."""
    try:
        records = read_run(run_dir).train
    except PlotError:  # no metrics.jsonl: the check ended before its first step
        return None, None
    late = records[len(records) // 2:]
    if not late:
        return None, None
    mfus = [r["mfu"] for r in late if r.get("mfu") is not None]
    return statistics.median(r["tok_s"] for r in late), statistics.median(mfus) if mfus else None


def run_training(name: str, work: Path, sizes: Sizes, deadline: float) -> dict:
    """Train one check under the probe; collect summary.json, the probe's JSON and metrics.jsonl, whatever
    the exit."""
    argv, init = check_args(name, work, sizes)
    argv.append(f"--eval.tokens={eval_tokens(argv, sizes.eval_batches)}")
    run_dir, probe_path = work / "runs" / name, work / "runs" / f"{name}.probe.json"
    # a rerun in the same --work folder starts afresh: train.resume = never refuses a folder holding a run
    shutil.rmtree(run_dir, ignore_errors=True)
    probe_path.unlink(missing_ok=True)
    skip, steps = sizes.probe
    cmd = [sys.executable, "-m", "scripts.gpu_check.probe", f"--probe-out={probe_path}", f"--probe-skip={skip}",
           f"--probe-steps={steps}", *argv]
    row = {"check": name, "args": argv, "init_loss": init}
    row.update(run_timed(name, cmd, work, sizes, deadline))
    if "skipped" in row["status"]:
        return row
    ended = time.time()
    summary, probe = read_json(run_dir / "summary.json"), read_json(probe_path)
    if row["status"] == "ok" and not summary:
        row["status"] = "exit 0 without summary.json"
    row.update(figures(summary, probe, *steady(run_dir)))
    row.update(compiles_cut_short(probe, ended))
    row["probe"] = probe
    return row


def compiles_cut_short(probe: dict, ended: float) -> dict:
    """For a check stopped inside its warm-up (the training compile) or its first eval (the eval's): the seconds
    that stage had run by then, the least its compile takes, which the next run's timeout must exceed."""
    started, out = probe.get("started") or {}, {}
    if "warm_up" in started and "warm_up" not in probe:
        out["compile_s_min"] = round(ended - started["warm_up"], 1)
    if "eval" in started and "first" not in (probe.get("eval") or {}):
        out["eval_compile_s_min"] = round(ended - started["eval"], 1)
    return out


def run_timed(name: str, cmd: list[str], work: Path, sizes: Sizes, deadline: float) -> dict:
    """Run one check's command within its timeout (and the deadline); its status, seconds and output tail."""
    timeout = min(sizes.timeout_s[name], deadline - time.time() - KILL_GRACE_S)
    if timeout < 10:
        return {"status": "skipped: out of time"}
    t0 = time.time()
    rc, tail = run_bounded(cmd, work / "runs" / f"{name}.out", timeout, sizes, work)
    status = "ok" if rc == 0 else f"timeout after {timeout:.0f} s" if rc == "timeout" else f"exit {rc}"
    return {"status": status, "seconds": round(time.time() - t0, 1), "timeout_s": round(timeout),
            **({} if rc == 0 else {"output_tail": tail})}


def figures(summary: dict, probe: dict, metrics_tok_s: float | None, metrics_mfu: float | None) -> dict:
    """The numbers of one training check, from the probe first, else summary.json and metrics.jsonl."""
    phases, warm, ev, shape = (probe.get(k) or {} for k in ("phases", "warm_up", "eval", "shape"))
    table = phases.get("phases") or {}
    step_s = phases.get("step_ms_mean", 0) / 1000 or None
    warmup_s = warm.get("seconds") or (summary.get("wall") or {}).get("warmup_s")
    # the warm-up's steps at the window's pace, the rest compiling (a CPU window's first step has the GC's pass)
    compile_s = max(warmup_s - warm.get("steps", 0) * step_s, 0.0) if warmup_s is not None and step_s else warmup_s
    peaks = [p for p in (warm.get("peak_gb"), phases.get("peak_gb"), summary.get("peak_mem_gb")) if p is not None]
    return {
        "compile_s": compile_s, "warmup_s": warmup_s, "eval_compile_s": ev.get("compile_s"),
        "eval_first_s": (ev.get("first") or {}).get("seconds"),  # compile included: its bound if the second is cut
        "tok_s": first_given(phases.get("tok_s"), metrics_tok_s, summary.get("tokens_per_s")),
        "mfu": first_given(phases.get("mfu"), metrics_mfu, summary.get("mfu")),
        "step_ms": phases.get("step_ms_mean"),
        "data_wait_frac": first_given((table.get("data") or {}).get("share"), summary.get("data_wait_frac")),
        "idle_frac": (table.get("idle") or {}).get("share"),
        "peak_mem_gb": max(peaks) if peaks else None,
        "steps": first_given(summary.get("steps"), (probe.get("train_loop") or {}).get("steps")),
        "val_loss": first_given(summary.get("final_val_loss"), (ev.get("first") or {}).get("val_loss")),
        "tokens_per_step": shape.get("tokens_per_step"), "hardware": summary.get("hardware"),
    }


def run_kernels(work: Path, sizes: Sizes, deadline: float, cpu: bool) -> dict:
    """scripts/gpu_check/kernels.py on the data built for the checks."""
    out = work / "runs" / "kernels.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "scripts.gpu_check.kernels", f"--out={out}", f"--data={work / 'data'}",
           *(["--cpu"] if cpu else [])]
    row = {"check": "kernels", **run_timed("kernels", cmd, work, sizes, deadline)}
    row["kernels"] = read_json(out)
    return row


# --- verdicts -----------------------------------------------------------------------------------------------
def environment() -> dict:
    """What this check ran on."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "peak_bf16_flops_assumed": gpu_peak_flops(name) if cuda else None}


def retune(rows: list[dict]) -> dict:
    """Per recipe, what re-tuning train.budget_s and the batch needs (one GPU, the config's per-GPU shape): its
    tokens/s, step, compile seconds and memory, and how many rows per micro-batch would fit (an estimate:
    the activations of the measured batch scaled, beside the weights, optimizer state and gradients)."""
    out = {}
    for r in rows:
        if r["check"] not in ("speedrun", "hackathon"):
            continue
        probe = r.get("probe") or {}
        shape, device = probe.get("shape") or {}, probe.get("device") or {}
        static = (probe.get("memory_static") or {}).get("static_gb")
        peak, total = (probe.get("phases") or {}).get("peak_gb"), device.get("total_gb")
        fit = None
        if None not in (static, peak, total) and shape:
            activations = peak - static - shape["param_gb"]  # gradients: one per parameter, of its dtype
            if activations > 0:
                fit = int((FIT_MARGIN * total - static - shape["param_gb"]) / (activations / shape["batch_size"]))
        out[r["check"]] = {
            "config": r["args"][1], **{k: shape.get(k) for k in ("batch_size", "seq_len", "grad_accum",
                                                                  "tokens_per_step", "flops_per_token", "params")},
            "tokens_per_s": r.get("tok_s"), "mfu": r.get("mfu"), "step_ms": r.get("step_ms"),
            "compile_s": r.get("compile_s"), "eval_compile_s": r.get("eval_compile_s"),
            "static_gb": static, "peak_gb": peak, "peak_warmup_gb": (probe.get("warm_up") or {}).get("peak_gb"),
            "device_gb": total, "rows_fit_est": fit}
    return out


def table(res: dict) -> str:
    """The results as Markdown: figures, where a step's time goes, and the verdicts."""
    env, rows = res["env"], res["checks"]
    training = [r for r in rows if r["check"] in TRAINING]
    out = [f"device: {env['device']} | torch {env['torch']} | assumed peak "
           f"{fmt(env['peak_bf16_flops_assumed'], '.3g')} FLOP/s | total {res['total_s']:.0f} s of "
           f"{res['deadline_s']:.0f} s" + (" | CPU rehearsal" if res["cpu_rehearsal"] else ""), "",
           "| check | compile s | eval compile s | tok/s | MFU % | step ms | data wait % | GPU idle % | peak GB | "
           "steps | val loss | ln(V) | status |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in training:
        out.append(f"| {r['check']} | {compile_cell(r, 'compile_s')} | {compile_cell(r, 'eval_compile_s')} | "
                   f"{fmt(r.get('tok_s'), ',.0f')} | {fmt(r.get('mfu'), '.1f', 100)} | "
                   f"{fmt(r.get('step_ms'), '.1f')} | {fmt(r.get('data_wait_frac'), '.2f', 100)} | "
                   f"{fmt(r.get('idle_frac'), '.2f', 100)} | {fmt(r.get('peak_mem_gb'), '.1f')} | "
                   f"{fmt(r.get('steps'), 'd')} | {fmt(r.get('val_loss'), '.3f')} | "
                   f"{fmt(r.get('init_loss'), '.2f')} | {r['status']} |")
    phased = [r for r in training if ((r.get("probe") or {}).get("phases") or {}).get("phases")]
    if phased:
        out += ["", "Where a step's time goes (device ms, mean over the probe's window; share of the step):", "",
                "| phase | " + " | ".join(r["check"] for r in phased) + " |", "|---|" + "---:|" * len(phased)]
        names = [p for p in PHASES if any(p in r["probe"]["phases"]["phases"] for r in phased)]
        names += sorted({p for r in phased for p in r["probe"]["phases"]["phases"]} - set(names))
        for p in names:
            cells = [r["probe"]["phases"]["phases"].get(p) for r in phased]
            out.append(f"| {p} | " + " | ".join("-" if c is None else f"{c['device_ms_mean']:.2f} ({c['share']:.1%})"
                                                 for c in cells) + " |")
        out.append("| step | " + " | ".join(f"{r['probe']['phases']['step_ms_mean']:.2f}" for r in phased) + " |")
    out += ["", "| check | what | verdict | measured | threshold |", "|---|---|---|---|---|"]
    out += [f"| {v['check']} | {v['what']} | {v['verdict']} | {v['measured']} | {v['threshold']} |"
            for v in res["verdicts"]]
    return "\n".join(out)


def record_dir(arg: str, env: dict, cpu: bool) -> Path:
    """--record's folder: the one given, else records/gpu_check/<date>_<gpu>/ (not for a CPU rehearsal)."""
    if arg != "auto":
        return Path(arg)
    if cpu:
        sys.exit("gpu_check: a CPU rehearsal is no record; give --record DIR to write it somewhere else")
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-")
    return ROOT / "records" / "gpu_check" / f"{time.strftime('%Y-%m-%d')}_{gpu}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `bash scripts/gpu_check.sh`; returns 0 unless a verdict is FAIL."""
    args = parse_args(argv)
    start = STARTED
    # gpu_check.sh's outer timeout sends SIGTERM: unwind, so run_bounded stops the check in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu_check: terminated"))
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch; on a machine without a GPU use --cpu")
    sizes = CPU if args.cpu else GPU
    deadline = start + sizes.deadline_s
    work = args.work if args.work.is_absolute() else ROOT / args.work
    env = environment()
    record = record_dir(args.record, env, args.cpu) if args.record else None
    print(f"gpu_check: {env} | work folder {work}", flush=True)
    shutil.rmtree(work / "inductor_cache", ignore_errors=True)  # compile figures are cold-cache ones
    broken = build_data(work, sizes)
    res = {"env": env, "cpu_rehearsal": args.cpu, "deadline_s": sizes.deadline_s, "timeouts_s": sizes.timeout_s,
           "checks": [], "verdicts": []}
    for name in (n for n in CHECKS if n in args.checks):
        if name in broken:
            row = {"check": name, "status": f"skipped: {broken[name]}", "init_loss": None}
        elif name == "kernels":
            row = run_kernels(work, sizes, deadline, args.cpu)
        else:
            row = run_training(name, work, sizes, deadline)
        res["verdicts"] += judged(row, sizes, args.cpu, res["checks"])
        res["checks"].append(row)
        res["total_s"] = time.time() - start
        if args.json:  # after every check: what was measured survives a later crash or kill of this script
            write_json(args.json, res)
        print(f"gpu_check: {name}: {row['status']} ({row.get('seconds', 0)} s)", flush=True)
    res["retune"] = unfailing(retune, res["checks"])
    text = unfailing(table, res)
    print(text)
    for r in res["checks"]:
        if "output_tail" in r:
            print(f"\n--- {r['check']}: end of its output ---\n{r['output_tail']}")
    if args.json:
        write_json(args.json, res)
    if record:
        write_json(record / "gpu_check.json", res)
        with atomic_path(record / "table.md") as tmp:
            tmp.write_text(f"{text}\n")
        print(f"gpu_check: recorded in {record}")
    return 1 if any(v["verdict"] == "FAIL" for v in res["verdicts"]) else 0


def unfailing(summarise, *args):
    """summarise(*args), or the error it raised as text: the JSON of the checks is written either way."""
    try:
        return summarise(*args)
    except Exception as e:  # noqa: BLE001 - as in judged()
        return f"gpu_check: {summarise.__name__} failed: {type(e).__name__}: {e}"
