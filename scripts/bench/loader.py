"""Benchmark the TokenLoader against what the tracks need, side by side with the loader it replaced.

    python -m scripts.bench.loader                       # ~2 GB of random uint16 shards in a temp dir
    python -m scripts.bench.loader --data 'shards/fineweb/*train*.bin' --skip-big --json bench.json
    python -m scripts.bench.loader --track-s 0           # without the two short CPU-track training runs

"before" is data/loader.py of commit BEFORE, read from git into a module of its own (a loader with two
background threads); "after" is this tree's. Each row prints its target, judged on "after":
  - data wait on the CPU track: summary.json's data_wait_frac of a short train.py run of configs/cpu.toml on
    the stdlib demo corpus;
  - the slowdown of a main thread that runs a Python-heavy loop of STEP_MS (standing for a step's kernel
    launches) while the loader delivers the speedrun's per-rank batch (1 x 49,152 tokens, BOS-aligned,
    shuffled) once per step, against the loop alone;
  - tokens/s at B=16, T=1024 (device cpu) shuffled and sequential, warm (the loaders take turns in short
    rounds, each reports its median) and cold (the files' pages dropped first), beside a memcpy ceiling
    (uint16 tokens cast-copied into a preallocated int64 buffer), a hackathon-starter-style loader and
    nanoGPT's get_batch;
  - the time to the first batch on 1 GB, 4 GB and the hackathon's 49 x 1e9 tokens (sparse raw files);
  - the growth of anonymous RSS over a whole pass in each order.
Generated data is removed at the end.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import operator
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

import data.loader
from data.regions import resolve_files
from data.shards import open_shard, write_shard
from trainer import ROOT
from trainer.memory import kb_fields
from util.atomic import write_json

BEFORE = "f4d8184"  # the last commit of the two-thread loader
B, T = 16, 1024
SHARD_TOKENS = 10**8  # llm.c / modded-nanogpt shard size
HACKATHON = (49, 10**9)  # files, tokens per file
SPEEDRUN = {"batch_size": 1, "seq_len": 49152, "bos_id": 50256}  # record 46's row in its last batch stage
STEP_MS = 100.0  # about one speedrun step
TARGETS = {"data_wait_frac": ("<=", 0.01), "main_thread_slowdown": ("<=", 0.02), "shuffled_warm": (">=", 50e6),
           "shuffled_cold": (">=", 20e6), "first_batch_ms": ("<", 50.0), "shuffled_rss_anon_growth_mb": ("<", 16.0),
           "sequential_rss_anon_growth_mb": ("<", 16.0)}
COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt}


def before_module() -> types.ModuleType:
    """data/loader.py of commit BEFORE, as a module of its own (its imports are this tree's data.shards etc.; its
    `plural` import is read from util/, where plural.py lives in this tree)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:data/loader.py"], capture_output=True,
                            text=True, check=True).stdout.replace("from plural import", "from util.plural import")
    path = Path(tempfile.mkdtemp(prefix="shardrun-bench-")) / "loader_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("loader_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Today(module.TokenLoader):
        """The old loader as today's train.py calls it: the keys it predates taken at their off values."""

        def __init__(self, files, batch_size: int, seq_len: int, *, doc_cut: int = 0, max_seq_len: int = 0,
                     **kwargs):
            if doc_cut or max_seq_len > seq_len:
                raise ValueError(f"the loader of {BEFORE} has no doc_cut or rows of other lengths")
            super().__init__(files, batch_size, seq_len, **kwargs)
            self.seq_len = seq_len

        def set_seq_len(self, seq_len: int) -> None:
            if seq_len != self.seq_len:
                raise ValueError(f"the loader of {BEFORE} has rows of {self.seq_len} tokens only")
    module.TokenLoader = Today
    return module


def make_data(folder: Path, size_gb: float, shard_tokens: int = SHARD_TOKENS) -> list[Path]:
    """Random uint16 llm.c shards of shard_tokens totalling size_gb (2 bytes a token).

    Shard i is one random block rotated by i tokens times a prime: distinct files at disk speed (drawing
    fresh random numbers for each shard runs at a third of it, which makes a 30 GB set slow to write).
    """
    block = np.random.default_rng(0).integers(0, 50257, size=shard_tokens, dtype=np.uint16)
    left, paths = int(size_gb * 1e9 / 2), []
    while left > 0:
        n = min(shard_tokens, left)
        paths.append(folder / f"bench_train_{len(paths):06d}.bin")
        write_shard(paths[-1], np.roll(block, len(paths) * 7919)[:n], dtype=np.uint16)
        left -= n
    return paths


def make_sparse(folder: Path, files: int, tokens: int) -> list[Path]:
    """Headerless uint16 files (like the hackathon's chunks) of `tokens` each, without writing the data."""
    folder.mkdir()
    paths = [folder / f"chunk_{i:04d}.bin" for i in range(files)]
    for p in paths:
        with open(p, "wb") as f:
            f.truncate(2 * tokens)
    return paths


def rate(next_batch: Callable[[], object], seconds: float) -> float:
    """Tokens (B*T per batch) per second of calling next_batch for about `seconds`."""
    next_batch()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next_batch()
        n += 1
    return n * B * T / (time.perf_counter() - t0)


def rates(loaders: dict[str, Callable[[], object]], seconds: float, rounds: int) -> dict[str, float]:
    """Median tokens/s of each loader over `rounds` turns of seconds / rounds each, taken in turn, so that all of
    them see the same load of a shared host."""
    got: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):
        for name, next_batch in loaders.items():
            got[name].append(rate(next_batch, seconds / rounds))
    return {name: statistics.median(v) for name, v in got.items()}


def positions(arrays: list[np.ndarray], step: int) -> Iterator[tuple[np.ndarray, int]]:
    """(array, offset) of consecutive blocks of `step` tokens through all arrays, forever."""
    while True:
        for a in arrays:
            yield from ((a, p) for p in range(0, len(a) - step + 1, step))


def starter_loader(arrays: list[np.ndarray]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The hackathon starter's way: one Python iteration, one astype and one tensor per sample."""
    walk = positions(arrays, B * (T + 1))

    def next_batch():
        a, p = next(walk)
        xs, ys = [], []
        for i in range(B):
            chunk = a[p + i * (T + 1):p + (i + 1) * (T + 1)].astype(np.int64)
            xs.append(torch.from_numpy(chunk[:-1]))
            ys.append(torch.from_numpy(chunk[1:]))
        return torch.stack(xs), torch.stack(ys)
    return next_batch


def nanogpt_loader(paths: list[Path]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """nanoGPT's get_batch: a fresh memmap every batch (its fix for growing RSS) and random offsets."""
    def next_batch():
        data = np.memmap(paths[np.random.randint(len(paths))], dtype=np.uint16, mode="r", offset=1024)
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y
    return next_batch


def memcpy_loader(arrays: list[np.ndarray]) -> Callable[[], None]:
    """The ceiling: B*T uint16 tokens cast-copied into one preallocated int64 buffer, nothing else."""
    walk, out = positions(arrays, B * T), np.empty(B * T, dtype=np.int64)

    def next_batch():
        a, p = next(walk)
        np.copyto(out, a[p:p + B * T])
    return next_batch


def rss_anon_mb() -> float:
    """Anonymous resident memory of this process (file pages of the memory maps are not counted)."""
    return kb_fields("/proc/self/status").get("RssAnon", float("nan")) / 2**20


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pass_rss_growth_mb(loader, batches: int) -> float:
    """Growth of anonymous RSS over `batches` batches of a new loader (one pass over the data)."""
    before = rss_anon_mb()
    for _ in range(batches):
        next(loader)
    return rss_anon_mb() - before


def cold_rate(make: Callable, paths: list[Path], seconds: float, **kwargs) -> float:
    """Tokens/s of a loader right after the files' pages were dropped from the page cache."""
    evict(paths)
    with make(paths, B, T, **kwargs) as loader:
        return rate(loader.__next__, seconds)


def first_batch_ms(make: Callable, paths: list[Path], **kwargs) -> float:
    """Milliseconds from constructing a loader to holding its first batch (median of 3 tries)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with make(paths, B, T, **kwargs) as loader:
            next(loader)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def python_step(n: int) -> int:
    """Python-heavy work standing for a step's kernel launches: calls, attribute and dict traffic."""
    table, total = {}, 0
    for i in range(n):
        table[i & 1023] = i
        total += len(table) + abs(-i)
    return total


def main_thread_slowdown(makers: dict[str, Callable], paths: list[Path], pairs: int) -> dict[str, float]:
    """How much longer a step of STEP_MS of python_step takes with one next(loader) in it, per loader: the median
    over `pairs` of the ratio of such a step to one alone just before or after it (the order alternates, so that
    neither side is always the second). One loader exists at a time: another's threads would run in this one's
    steps."""
    n, t0 = 20_000, time.perf_counter()
    python_step(n)
    n = int(n * STEP_MS / 1e3 / (time.perf_counter() - t0))

    def step(loader) -> float:
        t0 = time.perf_counter()
        python_step(n)
        if loader is not None:
            next(loader)
        return time.perf_counter() - t0

    slowdowns = {}
    for name, make in makers.items():
        with make(paths, **SPEEDRUN) as loader:
            next(loader)
            ratios = []
            for i in range(pairs):
                if i % 2:
                    loaded, alone = step(loader), step(None)
                else:
                    alone, loaded = step(None), step(loader)
                ratios.append(loaded / alone - 1)
        slowdowns[name] = statistics.median(ratios)
    return slowdowns


def track_wait(tmp: Path, before: bool, seconds: float) -> float:
    """summary.json's data_wait_frac of a configs/cpu.toml run of `seconds` on the demo corpus in tmp/demo
    (made the first time), with the "before" loader in place of data.loader where `before`."""
    demo = tmp / "demo"
    if not demo.exists():
        subprocess.run([sys.executable, "-m", "data.prepare", "--demo", "--tokenizer", "bytes", "--out", str(demo),
                        "--max-tokens", "4000000", "--val-tokens", "100000", "--shard-tokens", "2000000",
                        "--workers", "1"], cwd=ROOT, check=True, capture_output=True)
    name = "before" if before else "after"
    swap = "sys.modules['data.loader'] = before_module(); " if before else ""
    boot = (f"import runpy, sys; from scripts.bench.loader import before_module; {swap}"
            f"sys.argv = sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", boot, "train.py", "--config", "configs/cpu.toml",
                    f"--data.train={demo}/demo_train_*.bin", f"--data.val={demo}/demo_val_*.bin",
                    f"--train.budget_s={seconds}", "--eval.tokens=8192", f"--log.dir={tmp / 'runs'}",
                    f"--log.run_id={name}"], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((tmp / "runs" / name / "summary.json").read_text())["data_wait_frac"]


def measure(paths: list[Path], seconds: float, rounds: int, tmp: Path, skip_big: bool, track_s: float,
            pairs: int) -> dict:
    """Every number of the report: per loader ("before", "after") and for the reference loaders."""
    makers = {"before": before_module().TokenLoader, "after": data.loader.TokenLoader}
    arrays = [open_shard(p).view(np.ndarray) for p in paths]
    total = sum(len(a) for a in arrays)
    result: dict = {"cpus": os.cpu_count(), "tokens": total, **{name: {} for name in makers}}
    epoch = total // (B * (T + 1))
    loaders = {(name, order): make(paths, B, T, shuffle=order == "shuffled")
               for name, make in makers.items() for order in ("sequential", "shuffled")}
    for (name, order), loader in loaders.items():  # one pass each: memory, and every page in its maps
        result[name][f"{order}_rss_anon_growth_mb"] = pass_rss_growth_mb(loader, epoch)
    warm = rates({"memcpy": memcpy_loader(arrays), "starter": starter_loader(arrays), "nanogpt": nanogpt_loader(paths),
                  **{f"{name} {order}": loader.__next__ for (name, order), loader in loaders.items()}}, seconds, rounds)
    for loader in loaders.values():
        loader.close()
    result["reference"] = {k: warm[k] for k in ("memcpy", "starter", "nanogpt")}
    for name, make in makers.items():
        r = result[name]
        for order in ("sequential", "shuffled"):
            r[f"{order}_warm"] = warm[f"{name} {order}"]
        r["sequential_cold"] = cold_rate(make, paths, seconds, shuffle=False)
        r["shuffled_cold"] = cold_rate(make, paths, seconds)
        r["shuffled_k1_cold"] = cold_rate(make, paths, seconds, shuffle_shards=1)
        r["first_batch_ms"] = {}
    sets = [("1GB", 10, SHARD_TOKENS // 2)] + ([] if skip_big else [("4GB", 20, SHARD_TOKENS), ("49x1e9", *HACKATHON)])
    for set_name, files, tokens in sets:
        sparse = make_sparse(tmp / f"sparse_{set_name}", files, tokens)
        for name, make in makers.items():
            for order, shuffle in (("seq", False), ("shuffled", True)):
                for mode, bos in (("plain", None), ("bos", 0)):
                    ms = first_batch_ms(make, sparse, fmt="raw", raw_dtype="uint16", bos_id=bos, shuffle=shuffle)
                    result[name]["first_batch_ms"][f"{set_name}_{order}_{mode}"] = ms
    for name, slowdown in main_thread_slowdown(makers, paths, pairs).items():
        result[name]["main_thread_slowdown"] = slowdown
    if track_s:
        for name in makers:
            result[name]["data_wait_frac"] = track_wait(tmp, name == "before", track_s)
    result["load_avg_end"] = os.getloadavg()[0]
    return result


def report(r: dict) -> str:
    """The markdown table: each row with both loaders, its target and whether "after" meets it."""
    def shown(key: str, value: float) -> str:
        if key.endswith("_ms") or key.endswith("_mb"):
            return f"{value:.1f}"
        return f"{value:.2%}" if key in ("data_wait_frac", "main_thread_slowdown") else f"{value / 1e6:,.1f}M"
    lines = [f"B={B}, T={T}, {r['tokens']:,} tokens, {r['cpus']} CPUs, load average {r['load_avg_start']:.2f} "
             f"before, {r['load_avg_end']:.2f} after (this benchmark included); before = {BEFORE}:data/loader.py", "",
             "| measure | before | after | target | after meets it |", "|---|---:|---:|---:|---|"]
    rows = [("data wait, share of a configs/cpu.toml step", "data_wait_frac"),
            (f"slowdown of a {STEP_MS:.0f} ms Python step by one speedrun batch (1 x 49,152, BOS)",
             "main_thread_slowdown"),
            ("shuffled, warm, tokens/s", "shuffled_warm"), ("shuffled, cold, tokens/s", "shuffled_cold"),
            ("sequential, warm, tokens/s", "sequential_warm"), ("sequential, cold, tokens/s", "sequential_cold"),
            ("shuffled, shuffle_shards=1, cold, tokens/s", "shuffled_k1_cold"),
            ("first batch, ms, slowest of its sets", "first_batch_ms"),
            ("anon RSS growth over a full pass, shuffled, MB", "shuffled_rss_anon_growth_mb"),
            ("anon RSS growth over a full pass, sequential, MB", "sequential_rss_anon_growth_mb")]
    for label, key in rows:
        if key not in r["after"]:
            continue
        values = [r[name][key] for name in ("before", "after")]
        if key == "first_batch_ms":
            values = [max(v.values()) for v in values]
        goal, verdict = "-", "-"
        if key in TARGETS:
            op, target = TARGETS[key]
            goal, verdict = f"{op} {shown(key, target)}", "PASS" if COMPARE[op](values[1], target) else "FAIL"
        lines.append(f"| {label} | {shown(key, values[0])} | {shown(key, values[1])} | {goal} | {verdict} |")
    lines += ["", "| reference loader, warm | tokens/s |", "|---|---:|"]
    lines += [f"| {name} | {value / 1e6:,.1f}M |" for name, value in r["reference"].items()]
    lines += ["", "first batch, ms (after): " + ", ".join(f"{k} {v:.1f}" for k, v in r["after"]["first_batch_ms"].items())]
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, build or find the data, measure, print (and save) the report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="glob of llm.c uint16 shards to use instead of generated ones")
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of the generated data")
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per generated shard")
    ap.add_argument("--tmp", default=None, help="where to put generated data (default: the system temp dir)")
    ap.add_argument("--skip-big", action="store_true", help="skip the 4 GB and 49 x 1e9 first-batch datasets")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long each throughput measurement runs")
    ap.add_argument("--rounds", type=int, default=6, help="turns the warm loaders take (median reported)")
    ap.add_argument("--pairs", type=int, default=100, help="rounds of the main-thread measurement (median)")
    ap.add_argument("--track-s", type=float, default=30.0, help="seconds of each CPU-track run (0: skip them)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    tmp, load = Path(tempfile.mkdtemp(prefix="bench_loader_", dir=args.tmp)), os.getloadavg()[0]
    try:
        paths = resolve_files(args.data) if args.data else make_data(tmp, args.size_gb, args.shard_tokens)
        result = {"load_avg_start": load,
                  **measure(paths, args.seconds, args.rounds, tmp, args.skip_big, args.track_s, args.pairs)}
    finally:
        shutil.rmtree(tmp)
    print(report(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
