"""One-shot check of the GPU recipes on one GPU, offline: compile time, tokens/s, MFU, loader wait, memory, loss.

    bash scripts/gpu_check.sh --json $OUT/gpu_check.json        # one H100/H200, under 8 minutes, no network
    bash scripts/gpu_check.sh --cpu --json /tmp/gpu_check.json  # tiny sizes, the same code paths (tests)

Builds its data first: random-token llm.c shards (GPT-2 vocabulary, a document every ~1,000 tokens as in
FineWeb) and raw uint16 chunks (vocabulary 32,000) for throughput, and the stdlib demo corpus (bytes
tokenizer, `python -m data.prepare`) for a loss that must fall. Then it trains through train.py, one process,
one subprocess per check, each under its own timeout and all under one deadline:
    speedrun   configs/speedrun_8xh100.toml at world size 1 (a rank's share of the 8-GPU run) on random tokens
    text       the same recipe on the demo corpus: the loss must fall, but not to ~0 (a leaking mask would)
    hackathon  configs/hackathon_32gpu.toml (its model and per-GPU batch) on random raw chunks
Compile time is the untimed warm-up (timing = exclude_warmup); tokens/s and MFU are medians over the second
half of the logged steps; MFU assumes 989 TFLOP/s dense bf16 per H100/H200 SXM (trainer/metrics.py). On random
tokens the val loss must stay near ln(vocab): nothing in them is predictable unless the model sees the future.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run by path (python scripts/x.py), not as python -m scripts.x: the root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atomic import write_json
from data.shards import write_shard
from trainer.config import parse_args as parse_train_args
from trainer.metrics import PEAK_BF16_FLOPS

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB, GPT2_EOT, HACKATHON_VOCAB, BYTES_EOT = 50257, 50256, 32000, 256
MEAN_DOC_TOKENS = 1000  # FineWeb documents average about this many GPT-2 tokens
LEAK_FLOOR = 0.3  # nats per byte: a causal byte model cannot get this low in seconds; one that sees targets can
KILL_GRACE_S = 15  # after SIGTERM, for train.py's final checkpoint before SIGKILL


@dataclass
class Sizes:
    """How big each part of the check is: real sizes on a GPU, tiny ones for the CPU rehearsal."""
    train_tokens: int  # per random shard (two of them)
    val_tokens: int
    demo_args: list[str]
    budget_s: dict[str, float]
    timeout_s: dict[str, float]
    deadline_s: float
    eval_batches: int  # full batches per eval: a partial one would compile another shape
    text_max_loss: float  # the demo corpus' val loss must fall below this (ln(257) = 5.55 at init)
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # for the subprocesses, on top of ours


GPU = Sizes(train_tokens=16_000_000, val_tokens=1_100_000,
            demo_args=["--max-tokens", "21000000", "--shard-tokens", "10000000", "--val-tokens", "1048576"],
            budget_s={"speedrun": 30, "text": 30, "hackathon": 20},
            timeout_s={"data": 120, "speedrun": 200, "text": 130, "hackathon": 130}, deadline_s=450, eval_batches=4,
            text_max_loss=2.5)
CPU = Sizes(train_tokens=200_000, val_tokens=20_000,
            demo_args=["--max-tokens", "300000", "--shard-tokens", "140000", "--val-tokens", "20000", "--workers", "1"],
            budget_s={"speedrun": 5, "text": 5, "hackathon": 5},
            timeout_s={"data": 120, "speedrun": 150, "text": 150, "hackathon": 150}, deadline_s=450, eval_batches=2,
            text_max_loss=5.0,
            # compile is off: inductor on CPU takes minutes per shape, and these sizes test the plumbing.
            overrides=["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.value_embeds=1",
                       "--model.block_size=128", "--train.seq_len=128", "--train.batch_size=2",
                       "--eval.seq_len=0", "--eval.batch_size=0",  # not the speedrun's 262,144-token eval sequences
                       "--train.compile=false", "--train.warmup_steps=2", "--log.every_steps=1"],
            env={"CUDA_VISIBLE_DEVICES": ""})  # a rehearsal on a GPU machine still runs on the CPU


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU: rehearse every step without a GPU")
    p.add_argument("--work", type=Path, default=Path("runs/gpu_check"), help="data and run folders go here")
    return p.parse_args(argv)


def random_documents(n: int, vocab: int, eot: int, rng: np.random.Generator) -> np.ndarray:
    """n random ids below `vocab` (never `eot`), with `eot` opening documents of ~MEAN_DOC_TOKENS tokens."""
    tokens = rng.integers(0, eot, size=n)
    tokens[np.flatnonzero(rng.random(n) < 1 / MEAN_DOC_TOKENS)] = eot
    tokens[0] = eot
    return tokens


def build_data(work: Path, sizes: Sizes, deadline: float) -> dict[str, str]:
    """Write the random shards and chunks and prepare the demo corpus; return an error per part that failed."""
    rng = np.random.default_rng(0)
    rand, raw = work / "data" / "random", work / "data" / "raw"
    write_shard(rand / "random_val_000000.bin", random_documents(sizes.val_tokens, GPT2_VOCAB, GPT2_EOT, rng))
    for i in (1, 2):
        write_shard(rand / f"random_train_{i:06d}.bin",
                    random_documents(sizes.train_tokens, GPT2_VOCAB, GPT2_EOT, rng))
        write_shard(raw / f"chunk_{i:04d}.bin", rng.integers(0, HACKATHON_VOCAB, size=sizes.train_tokens),
                    dtype=np.uint16, header=False)
    cmd = [sys.executable, "-m", "data.prepare", "--demo", "--tokenizer", "bytes", "--out", str(work / "data" / "demo"),
           *sizes.demo_args]
    rc, tail = run_bounded(cmd, work / "data" / "prepare.out", min(sizes.timeout_s["data"], deadline - time.time()),
                           sizes)
    return {} if rc == 0 else {"text": f"data.prepare exited {rc}: {tail[-600:]}"}


def run_bounded(cmd: list[str], log: Path, timeout: float, sizes: Sizes) -> tuple[int | str, str]:
    """Run `cmd` in its own process group with output to `log`; (exit code or "timeout", output tail).

    A new session, so that stopping it takes the whole group, inductor's compile workers included: on its
    timeout, and when this script ends early (the shell's outer timeout sends SIGTERM: see main)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **sizes.env}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return rc, log.read_text()[-3000:]


def check_args(name: str, work: Path, sizes: Sizes) -> tuple[list[str], float]:
    """train.py's arguments for one check, and the val loss expected at init (ln of the vocabulary)."""
    data = work / "data"
    common = [f"--train.budget_s={sizes.budget_s[name]}", "--train.timing=exclude_warmup", "--eval.every_s=0",
              "--eval.every_steps=0", "--eval.target_loss=0", "--eval.stop_at_target=false", "--log.every_steps=5",
              f"--log.dir={work / 'runs'}", f"--log.run_id={name}", "--train.resume=never", *sizes.overrides]
    if name == "hackathon":
        return (["--config", "configs/hackathon_32gpu.toml", f"--data.train={data}/raw/chunk_*.bin",
                 "--train.warmup_steps=3", "--train.checkpoint_path=", *common], math.log(HACKATHON_VOCAB))
    speedrun = ["--config", "configs/speedrun_8xh100.toml", *common]
    if name == "text":
        # Not BOS-aligned: stdlib files average ~17,600 bytes, so aligned windows would skip ~90% of the text and
        # repeat the rest until the model memorised it. The document mask still applies where files meet.
        return ([*speedrun, f"--data.train={data}/demo/demo_train_*.bin", f"--data.val={data}/demo/demo_val_*.bin",
                 "--data.bos_aligned=false", "--model.vocab_size=0", f"--model.bos_id={BYTES_EOT}"],
                math.log(BYTES_EOT + 1))
    return ([*speedrun, f"--data.train={data}/random/random_train_*.bin",
             f"--data.val={data}/random/random_val_*.bin"], math.log(GPT2_VOCAB))


def eval_tokens(argv: list[str], batches: int) -> int:
    """Val tokens for exactly `batches` full eval batches of this run (one compiled shape)."""
    t = parse_train_args(argv).train
    return batches * t.batch_size * (t.seq_len + 1)


def steady(run_dir: Path) -> tuple[float | None, float | None]:
    """Median tokens/s and MFU over the second half of the logged training steps."""
    path = run_dir / "metrics.jsonl"
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "train"] \
        if path.exists() else []
    late = records[len(records) // 2:]
    if not late:
        return None, None
    mfus = [r["mfu"] for r in late if r["mfu"] is not None]
    return statistics.median(r["tok_s"] for r in late), statistics.median(mfus) if mfus else None


def verdict(name: str, val: float | None, init: float, text_max: float) -> str:
    """"ok" or what is wrong with the final val loss (text: must fall; random tokens: must not)."""
    if val is None or not math.isfinite(val):
        return f"no val loss ({val})"
    if name == "text":
        return "ok" if LEAK_FLOOR < val < text_max else f"val loss {val:.3f} outside ({LEAK_FLOOR}, {text_max})"
    # Random tokens hold no information: a loss well below ln(vocab) means the model saw targets.
    return "ok" if val > init - 0.1 else f"val loss {val:.3f} < ln(vocab) - 0.1 = {init - 0.1:.3f}: future leaks"


def run_check(name: str, work: Path, sizes: Sizes, deadline: float) -> dict:
    """Train one check and collect its numbers from summary.json and metrics.jsonl."""
    argv, init = check_args(name, work, sizes)
    argv.append(f"--eval.tokens={eval_tokens(argv, sizes.eval_batches)}")
    timeout = min(sizes.timeout_s[name], deadline - time.time())
    row = {"check": name, "args": argv}
    if timeout < 30:
        return {**row, "status": "skipped: out of time"}
    t0, run_dir = time.time(), work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder left by an earlier check would be appended to
    rc, tail = run_bounded([sys.executable, "train.py", *argv], work / "runs" / f"{name}.out", timeout, sizes)
    row["seconds"] = round(time.time() - t0, 1)
    if rc != 0 or not (run_dir / "summary.json").exists():
        return {**row, "status": f"FAILED: exit {rc}", "output_tail": tail}
    s = json.loads((run_dir / "summary.json").read_text())
    tok_s, mfu = steady(run_dir)
    status = verdict(name, s["final_val_loss"], init, sizes.text_max_loss)
    return {**row, "status": status, "compile_s": s["wall"]["warmup_s"], "tok_s": tok_s, "mfu": mfu,
            "data_wait_frac": s["data_wait_frac"], "peak_mem_gb": s["peak_mem_gb"], "steps": s["steps"],
            "tokens_seen": s["tokens_seen"], "train_time_s": s["train_time_s"], "val_loss": s["final_val_loss"],
            "init_loss": init, "hardware": s["hardware"]}


def environment() -> dict:
    """What this check ran on."""
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    peak = [f for key, f in PEAK_BF16_FLOPS.items() if key in name] if cuda else []
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "peak_bf16_flops_assumed": max(peak) if peak else None}


def _fmt(value, spec: str, scale: int = 1) -> str:
    return "-" if value is None else format(scale * value, spec)


def table(res: dict) -> str:
    """The results as one Markdown table."""
    rows = [f"device: {res['env']['device']} | torch {res['env']['torch']} | assumed peak "
            f"{_fmt(res['env']['peak_bf16_flops_assumed'], '.3g')} FLOP/s | total {res['total_s']:.0f} s", "",
            "| check | compile s | tok/s | MFU % | data wait % | peak GB | steps | val loss | ln(V) | status |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["checks"]:
        rows.append(f"| {r['check']} | {_fmt(r.get('compile_s'), '.1f')} | {_fmt(r.get('tok_s'), ',.0f')} | "
                    f"{_fmt(r.get('mfu'), '.1f', 100)} | {_fmt(r.get('data_wait_frac'), '.2f', 100)} | "
                    f"{_fmt(r.get('peak_mem_gb'), '.1f')} | {_fmt(r.get('steps'), 'd')} | "
                    f"{_fmt(r.get('val_loss'), '.3f')} | {_fmt(r.get('init_loss'), '.2f')} | {r['status']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `bash scripts/gpu_check.sh`; returns 0 when every check is ok."""
    args = parse_args(argv)
    start = time.time()
    # gpu_check.sh's outer timeout sends SIGTERM: unwind, so run_bounded stops the check in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu_check: terminated"))
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch; on a machine without a GPU use --cpu")
    sizes = CPU if args.cpu else GPU
    deadline = start + sizes.deadline_s
    work = args.work if args.work.is_absolute() else ROOT / args.work
    env = environment()
    print(f"gpu_check: {env} | work folder {work}", flush=True)
    broken = build_data(work, sizes, deadline)
    checks = []
    for name in ("speedrun", "text", "hackathon"):
        result = {"check": name, "status": f"skipped: {broken[name]}"} if name in broken \
            else run_check(name, work, sizes, deadline)
        checks.append(result)
        print(f"gpu_check: {name}: {result['status']} ({result.get('seconds', 0)} s)", flush=True)
    res = {"env": env, "cpu_rehearsal": args.cpu, "total_s": time.time() - start, "checks": checks}
    print(table(res))
    for r in checks:
        if "output_tail" in r:
            print(f"\n--- {r['check']}: end of its output ---\n{r['output_tail']}")
    if args.json:
        write_json(args.json, res)
    return 0 if all(r["status"] == "ok" for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
