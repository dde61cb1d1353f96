"""Benchmark the TokenLoader against the loaders it replaces, on the same shards.

    python -m scripts.bench_loader                       # ~2 GB of random uint16 shards in a temp dir
    python -m scripts.bench_loader --data 'shards/fineweb/*train*.bin' --skip-big --json bench.json
    python -m scripts.bench_loader --shard-tokens 10000000  # the same 1e9 tokens in 100 files

Host-side tokens/s at B=16, T=1024 (device cpu) of: a memcpy ceiling (uint16 tokens cast-copied into a
preallocated int64 buffer), the same copy of B windows from random places with one slice-copy per window
(how the shuffled loader first did it), our loader sequential (shuffle=False) and shuffled (the default),
each with a warm and a cold page cache, shuffled with the last HELD batches held (as a gradient-accumulation
loop holds its micro-batches; a batch is the caller's, never reused by the loader), shuffled within working
sets of one shard (shuffle_shards=1) cold, a hackathon-starter-style loader (per-sample Python loop over
np.memmap, astype(int64), torch.stack) and nanoGPT's get_batch (memmap re-created every batch, random offsets). The warm-cache loaders take turns in
short rounds and each reports its median round, so that all of them see the same load on a shared host,
and the CPUs the process kept busy meanwhile: the shuffled loader's two threads need two, and a virtual
machine whose host takes one of them away shows it there, not in the single-threaded ceiling.
Then the time to the first batch on 1 GB and 4 GB datasets and on the hackathon's layout, 49 files of 1e9
tokens (sparse raw files: only the file count and sizes matter at start-up), and the growth of anonymous
RSS while streaming the whole set once in each order (the warm loaders' own first pass, so that their maps
hold every page before they are timed). Generated data is removed at the end.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

if not __package__:  # run by path (python scripts/x.py), not as python -m scripts.x: the root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atomic import write_json
from data.loader import TokenLoader, resolve_files
from data.shards import open_shard, write_shard

B, T = 16, 1024
SHARD_TOKENS = 10**8  # llm.c / modded-nanogpt shard size
TARGETS = {"vs_memcpy": 0.5, "vs_starter": 10.0, "first_batch_ms": 50.0, "rss_anon_mb": 100.0,
           "shuffled_cold_tokens_per_s": 20e6}
HACKATHON = (49, 10**9)  # files, tokens per file
HELD = 8  # batches the "held" row keeps alive


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


def rates(loaders: dict[str, Callable[[], object]], seconds: float, rounds: int) -> dict[str, dict]:
    """Median tokens/s of each loader over `rounds` turns of seconds / rounds each, taken in turn, and the
    median number of CPUs the process kept busy meanwhile (CPU seconds of all its threads per second)."""
    got: dict[str, list[float]] = {name: [] for name in loaders}
    cpus: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(rounds):  # one loader after another for seconds each swung 2x with the load of other jobs
        for name, next_batch in loaders.items():
            cpu, wall = time.process_time(), time.perf_counter()
            got[name].append(rate(next_batch, seconds / rounds))
            cpus[name].append((time.process_time() - cpu) / (time.perf_counter() - wall))
    return {name: {"tokens_per_s": statistics.median(v), "rounds": v, "cpus_busy": statistics.median(cpus[name])}
            for name, v in got.items()}


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


def random_copy_loader(arrays: list[np.ndarray]) -> Callable[[], None]:
    """The same copy, of B windows of T + 1 tokens from random files and offsets, one slice-copy per window."""
    rng, out = np.random.default_rng(0), np.empty((B, T + 1), dtype=np.int64)

    def next_batch():
        files, starts = rng.integers(len(arrays), size=B), rng.random(B)
        for row, (f, s) in enumerate(zip(files.tolist(), starts.tolist())):
            a = arrays[f]
            p = int(s * (len(a) - T)) // (T + 1) * (T + 1)
            out[row] = a[p:p + T + 1]
    return next_batch


def held_loader(loader: TokenLoader) -> Callable[[], None]:
    """The loader's batches, each held until HELD newer ones have come."""
    held: collections.deque = collections.deque(maxlen=HELD)

    def next_batch():
        held.append(next(loader))
    return next_batch


def rss_anon_mb() -> float:
    """Anonymous resident memory of this process (file pages of the memory maps are not counted)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pass_rss_growth_mb(loader: TokenLoader, batches: int) -> float:
    """Growth of anonymous RSS over `batches` batches of a new TokenLoader (one pass over the data)."""
    before = rss_anon_mb()
    for _ in range(batches):
        next(loader)
    return rss_anon_mb() - before


def cold_rate(paths: list[Path], seconds: float, **kwargs) -> dict:
    """Tokens/s of a TokenLoader right after the files' pages were dropped from the page cache."""
    evict(paths)
    with TokenLoader(paths, B, T, **kwargs) as loader:
        return {"tokens_per_s": rate(loader.__next__, seconds)}


def first_batch_ms(paths: list[Path], **kwargs) -> float:
    """Milliseconds from constructing a TokenLoader to holding its first batch (median of 3 tries)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with TokenLoader(paths, B, T, **kwargs) as loader:
            next(loader)
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def measure(paths: list[Path], seconds: float, rounds: int, tmp: Path, skip_big: bool) -> dict:
    """Every number of the report."""
    arrays = [open_shard(p).view(np.ndarray) for p in paths]
    total = sum(len(a) for a in arrays)
    result = {"cpus": os.cpu_count(), "tokens": total}
    epoch = total // (B * (T + 1))
    with TokenLoader(paths, B, T, shuffle=False) as ours, TokenLoader(paths, B, T) as shuffled:
        # One whole pass in each order: measures memory, warms the page cache, and maps every page into the
        # loaders' own maps (a new map faults on the first touch of each part of it, ~7 us a fault on this
        # VM: paid once per process, so it is kept out of the warm rates).
        result["rss_anon_growth_mb"] = pass_rss_growth_mb(ours, epoch)
        result["shuffled_rss_anon_growth_mb"] = pass_rss_growth_mb(shuffled, epoch)
        result.update(rates({"memcpy": memcpy_loader(arrays), "random_copy": random_copy_loader(arrays),
                             "ours": ours.__next__, "shuffled": shuffled.__next__, "shuffled_held": held_loader(shuffled),
                             "starter": starter_loader(arrays),
                             "nanogpt": nanogpt_loader(paths)}, seconds, rounds))
    result["ours_cold"] = cold_rate(paths, seconds, shuffle=False)
    result["shuffled_cold"] = cold_rate(paths, seconds)
    result["shuffled_k1_cold"] = cold_rate(paths, seconds, shuffle_shards=1)
    result["first_batch_ms"] = {}
    sets = [("1GB", 10, SHARD_TOKENS // 2)] + ([] if skip_big else [("4GB", 20, SHARD_TOKENS), ("49x1e9", *HACKATHON)])
    for name, files, tokens in sets:
        sparse = make_sparse(tmp / f"sparse_{name}", files, tokens)
        for order, shuffle in (("seq", False), ("shuffled", True)):
            for mode, bos in (("plain", None), ("bos", 0)):
                ms = first_batch_ms(sparse, fmt="raw", raw_dtype="uint16", bos_id=bos, shuffle=shuffle)
                result["first_batch_ms"][f"{name}_{order}_{mode}"] = ms
    result["load_avg_end"] = os.getloadavg()[0]
    return result


def report(r: dict) -> str:
    """The markdown tables."""
    ceiling = r["memcpy"]["tokens_per_s"]
    lines = [f"B={B}, T={T}, {r['tokens']:,} tokens, {r['cpus']} CPUs, load average {r['load_avg_start']:.2f} "
             f"before, {r['load_avg_end']:.2f} after (this benchmark included)", "",
             "| loader | tokens/s | / memcpy ceiling | CPUs busy |", "|---|---:|---:|---:|"]
    for key, name in (("memcpy", "memcpy ceiling"), ("random_copy", "memcpy of B random windows, a slice each"),
                      ("ours", "TokenLoader sequential (warm cache)"),
                      ("shuffled", "TokenLoader shuffled (warm cache)"),
                      ("shuffled_held", f"TokenLoader shuffled, the last {HELD} batches held (warm cache)"),
                      ("ours_cold", "TokenLoader sequential (cold cache)"),
                      ("shuffled_cold", "TokenLoader shuffled (cold cache)"),
                      ("shuffled_k1_cold", "TokenLoader shuffled, shuffle_shards=1 (cold cache)"),
                      ("starter", "starter-style loop"), ("nanogpt", "nanoGPT get_batch")):
        tps = r[key]["tokens_per_s"]
        busy = f"{r[key]['cpus_busy']:.2f}" if "cpus_busy" in r[key] else "-"  # warm rows only
        lines.append(f"| {name} | {tps / 1e6:,.1f}M | {tps / ceiling:.2f} | {busy} |")
    ours, shuffled = r["ours"]["tokens_per_s"], r["shuffled"]["tokens_per_s"]
    first = max(r["first_batch_ms"].values())
    checks = [("TokenLoader sequential / memcpy", ours / ceiling, TARGETS["vs_memcpy"], ">="),
              ("TokenLoader shuffled / memcpy", shuffled / ceiling, TARGETS["vs_memcpy"], ">="),
              ("TokenLoader sequential / starter", ours / r["starter"]["tokens_per_s"], TARGETS["vs_starter"], ">="),
              ("TokenLoader shuffled, cold, tokens/s", r["shuffled_cold"]["tokens_per_s"],
               TARGETS["shuffled_cold_tokens_per_s"], ">="),
              ("first batch, ms, slowest of " + ", ".join(f"{k} {v:.1f}" for k, v in r["first_batch_ms"].items()),
               first, TARGETS["first_batch_ms"], "<"),
              ("anon RSS growth over a full pass, sequential, MB", r["rss_anon_growth_mb"],
               TARGETS["rss_anon_mb"], "<"),
              ("anon RSS growth over a full pass, shuffled, MB", r["shuffled_rss_anon_growth_mb"],
               TARGETS["rss_anon_mb"], "<")]
    lines += ["", "| check | value | target | ok |", "|---|---:|---:|---|"]
    for name, value, target, op in checks:
        ok = value >= target if op == ">=" else value < target
        shown = f"{value / 1e6:.1f}M" if target >= 1e6 else f"{value:.2f}"
        lines.append(f"| {name} | {shown} | {op} {target:g} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, build or find the data, measure, print (and save) the report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="glob of llm.c uint16 shards to use instead of generated ones")
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of the generated data")
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per generated shard")
    ap.add_argument("--tmp", default=None, help="where to put generated data (default: the system temp dir)")
    ap.add_argument("--skip-big", action="store_true", help="skip the 4 GB time-to-first-batch dataset")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long each throughput measurement runs")
    ap.add_argument("--rounds", type=int, default=6, help="turns the warm-cache loaders take (median reported)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    tmp, load = Path(tempfile.mkdtemp(prefix="bench_loader_", dir=args.tmp)), os.getloadavg()[0]
    try:
        paths = resolve_files(args.data) if args.data else make_data(tmp, args.size_gb, args.shard_tokens)
        result = {"load_avg_start": load, **measure(paths, args.seconds, args.rounds, tmp, args.skip_big)}
    finally:
        shutil.rmtree(tmp)
    print(report(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
