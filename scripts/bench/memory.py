"""Memory of many processes streaming the same shards through TokenLoader: shared file pages, flat heap.

    python -m scripts.bench.memory                          # 4 GB of shards, 8 processes
    python -m scripts.bench.memory --big --json mem.json    # also a data set larger than the free memory

Part 1 (shared): --procs processes each stream the whole --size-gb data set once (each is world_size=1:
the worst case for memory, every process maps every page of every shard). Per process: anonymous RSS
(RssAnon, /proc/<pid>/status), PSS split into anon and file (/proc/<pid>/smaps_rollup), and the Rss/Pss of
the shard mappings alone (/proc/<pid>/smaps). The shard pages sit once in the page cache: the shard Pss
summed over processes is the data touched, while their Rss summed is --procs times it.
Part 2 (--big): one process streams a data set larger than MemAvailable (at least 30 GB, if the disk has
room), evicted from the page cache first, so every page comes from disk and the cache must drop pages as
it goes; it samples its rate and RssAnon 100 times (once per 1% of the stream): both stay flat.
Generated data lives in a temporary folder under --tmp and is removed at the end.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path


from util.atomic import write_json
from data.loader import TokenLoader
from data.shards import open_shard
from scripts.bench.loader import B, T, evict, make_data, rss_anon_mb
from trainer.memory import kb_fields

GB = 1e9
BIG_MIN_GB = 30.0
SAMPLES = 100  # rate and RssAnon samples per stream, whatever its length


def mapped(pid: int, folder: Path) -> dict[str, int]:
    """Rss and Pss (bytes) of the memory maps of files under `folder` in process `pid`."""
    total, inside = {"Rss": 0, "Pss": 0}, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line: its path is last
            inside = len(parts) >= 6 and parts[-1].startswith(str(folder))
        elif inside and parts[0] in ("Rss:", "Pss:"):
            total[parts[0][:-1]] += int(parts[1]) * 1024
    return total


def batches_per_epoch(files: list[Path]) -> int:
    """Batches of B windows of T + 1 tokens that one pass over the files holds."""
    return sum(len(open_shard(f)) // (T + 1) for f in files) // B


def stream(files: list[Path], results: mp.Queue, release: mp.Event) -> None:
    """One process: stream one epoch, sampling (seconds, tokens, RssAnon) 100 times; report; wait."""
    steps, samples = batches_per_epoch(files), []
    every = max(1, steps // SAMPLES)
    with TokenLoader(files, B, T, seed=0, shuffle=False) as loader:  # the sequential stream it measures
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            next(loader)
            if i % every == 0 or i == steps:
                samples.append((time.perf_counter() - t0, i * B * T, rss_anon_mb() * 2**20))
    results.put((mp.current_process().pid, steps * B * (T + 1) * 2, samples))
    release.wait()  # stay alive, maps intact, until the parent has read our memory


def run_procs(files: list[Path], procs: int) -> list[dict]:
    """Stream `files` in `procs` processes at once; each one's rate, RssAnon and PSS once it is done."""
    ctx = mp.get_context("spawn")  # fork would share the parent's pages and muddy the PSS split
    results, release = ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=stream, args=(files, results, release)) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        done = [results.get(timeout=3600) for _ in workers]
        # read every process only once all have mapped everything: Pss divides a page by its current mappers
        rows = [measure(pid, touched, samples, files[0].parent) for pid, touched, samples in done]
    finally:
        release.set()
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    return rows


def measure(pid: int, touched: int, samples: list[tuple], folder: Path) -> dict:
    """One process's rate, RssAnon over time, PSS split, and its shard maps' Rss/Pss (bytes)."""
    rollup, shard = kb_fields(f"/proc/{pid}/smaps_rollup"), mapped(pid, folder)
    seconds, tokens, _ = samples[-1]
    return {"pid": pid, "tokens_per_s": tokens / seconds, "data_touched": touched,
            "rss_anon_max": max(s[2] for s in samples), "rss": rollup["Rss"], "pss": rollup["Pss"],
            "pss_anon": rollup["Pss_Anon"], "pss_file": rollup["Pss_File"], "shard_rss": shard["Rss"],
            "shard_pss": shard["Pss"], "samples": samples}


def mb(n: float) -> str:
    """Bytes as whole MiB with thousands separators."""
    return f"{n / 2**20:,.0f}"


def shared_table(rows: list[dict]) -> str:
    """Markdown: one row per process and a total row."""
    cols = ["rss_anon_max", "rss", "pss", "pss_anon", "pss_file", "shard_rss", "shard_pss"]
    lines = ["| process | tokens/s | RssAnon max MB | Rss MB | Pss MB | Pss_Anon MB | Pss_File MB | shard Rss MB | "
             "shard Pss MB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(rows):
        lines.append(f"| {i} | {r['tokens_per_s']:,.0f} | " + " | ".join(mb(r[c]) for c in cols) + " |")
    lines.append(f"| total | {sum(r['tokens_per_s'] for r in rows):,.0f} | "
                 + " | ".join(mb(sum(r[c] for r in rows)) for c in cols) + " |")
    return "\n".join(lines)


def shared_part(folder: Path, size_gb: float, procs: int) -> dict:
    """Part 1: `procs` processes over the same `size_gb` of shards."""
    files = make_data(folder, size_gb)
    rows = run_procs(files, procs)
    touched = rows[0]["data_touched"]
    result = {"size_gb": size_gb, "procs": procs, "data_touched": touched, "processes": rows,
              "shard_rss_over_data": sum(r["shard_rss"] for r in rows) / touched,
              "shard_pss_over_data": sum(r["shard_pss"] for r in rows) / touched}
    print(f"\n## {procs} processes, each streaming the same {size_gb:g} GB ({touched / GB:.2f} GB touched)\n")
    print(shared_table(rows))
    print(f"\nshard pages: Rss summed over processes = {result['shard_rss_over_data']:.2f} x the data touched, "
          f"Pss summed = {result['shard_pss_over_data']:.2f} x: one copy in the page cache, shared by all")
    return result


def big_size_gb(folder: Path) -> tuple[float, str | None]:
    """Size of the larger-than-memory set: max(30 GB, 1.25 x MemAvailable); (size, why not) if the disk is short."""
    size = max(BIG_MIN_GB, 1.25 * kb_fields("/proc/meminfo")["MemAvailable"] / GB)
    free = shutil.disk_usage(folder).free / GB
    return size, None if free > size + 5 else f"needs {size:.0f} GB + 5 GB spare on {folder}, {free:.0f} GB free"


def by_tenth(samples: list[tuple]) -> list[float]:
    """Mean tokens/s over each tenth of a stream, from its (seconds, tokens, RssAnon) samples."""
    points = [(0.0, 0)] + [s[:2] for s in samples]
    cuts = [round(k * (len(points) - 1) / 10) for k in range(11)]
    return [(points[b][1] - points[a][1]) / (points[b][0] - points[a][0]) for a, b in zip(cuts, cuts[1:])]


def big_part(folder: Path) -> dict:
    """Part 2: one process streams more data than the page cache can hold."""
    folder.mkdir(parents=True, exist_ok=True)  # disk_usage needs an existing folder
    size, short = big_size_gb(folder)
    if short:
        print(f"\n## larger than memory: skipped ({short})")
        return {"skipped": short}
    files = make_data(folder, size)
    evict(files)  # the files written last would still be cached and stream at memory speed
    [row] = run_procs(files, 1)
    steady = row["samples"][len(row["samples"]) // 10:]  # past the first tenth: start-up and first faults
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(steady, steady[1:])]
    result = {"size_gb": size, "mem_available_gb": kb_fields("/proc/meminfo")["MemAvailable"] / GB,
              "tokens_per_s": row["tokens_per_s"], "rate_min": min(rates), "rate_median": statistics.median(rates),
              "rate_max": max(rates), "rss_anon_first": steady[0][2], "rss_anon_last": steady[-1][2],
              "rss_anon_max": row["rss_anon_max"], "by_tenth": by_tenth(row["samples"]), "samples": row["samples"]}
    print(f"\n## one process streaming {size:.2f} GB (more than the {result['mem_available_gb']:.0f} GB available)\n")
    print("| tokens/s mean | tokens/s per 1% of the stream: min / median / max | RssAnon first / last / max MB |\n"
          "|---:|---|---|")
    print(f"| {row['tokens_per_s']:,.0f} | {result['rate_min']:,.0f} / {result['rate_median']:,.0f} / "
          f"{result['rate_max']:,.0f} | {mb(steady[0][2])} / {mb(steady[-1][2])} / {mb(row['rss_anon_max'])} |")
    print("\nmillion tokens/s in each tenth of the stream: " + ", ".join(f"{r / 1e6:,.0f}" for r in result["by_tenth"]))
    return result


def main(argv: list[str] | None = None) -> None:
    """Run the parts asked for, print their tables, write --json."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=4.0, help="data set of part 1, GB")
    p.add_argument("--procs", type=int, default=8, help="processes of part 1")
    p.add_argument("--big", action="store_true", help="also part 2: a data set larger than MemAvailable")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where to generate the data")
    args = p.parse_args(argv)
    if args.size_gb <= 0 or args.procs < 1:
        p.error(f"--size-gb must be > 0 and --procs >= 1, got {args.size_gb} and {args.procs}")
    folder = Path(tempfile.mkdtemp(prefix="bench_memory_", dir=args.tmp))
    try:
        results = {"shared": shared_part(folder / "shared", args.size_gb, args.procs)}
        shutil.rmtree(folder / "shared")
        if args.big:
            results["big"] = big_part(folder / "big")
        else:
            print("\n## larger than memory: skipped (pass --big: writes max(30 GB, 1.25 x MemAvailable) to --tmp)")
            results["big"] = {"skipped": "not asked (--big)"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
