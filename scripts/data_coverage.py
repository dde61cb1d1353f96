"""How many times one epoch of each training stream reads each token of its shards: never, once, or twice and more.

    python -m scripts.data_coverage --train 'shards/fineweb10B/fineweb_train_*.bin' --seq-len 2048
    python -m scripts.data_coverage --fineweb-like 20000000 --seq-len 16384   # no shards needed

The streams are TokenLoader's own, BOS-aligned (the bos id is meta.json's eot_token unless --bos-id says):
shuffled (data.shuffle, the default), sequential (data.shuffle = false), sorted (with data.sorted_shards, the
record's order) and cut (sorted, each document cut at --record-cut: data.doc_cut, the record's rows). Each is run
for one epoch, one row a batch, through TokenLoader.next_places, which moves the stream as training does without
reading tokens; a row reads its seq_len + 1 tokens. Beside them, record 46's
loader (scripts/beside/record_data.py's restatement) at its micro-batches of 1, 2 and 3 times --record-row tokens
(16,384: its rows on a GPU in its three batch stages), each document cut at --record-cut: each reads its n + 1
tokens once, from the shards in sorted order.
--fineweb-like N counts on N tokens of random ids in documents of FineWeb-like lengths instead (FINEWEB_LIKE), made
in a temporary folder: what each stream reads depends on where documents start, not on their tokens.
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.loader import TokenLoader
from data.meta import read_meta
from data.regions import resolve_files
from data.shards import open_shard, write_shard
from scripts.beside.record_data import record_coverage

# name -> (uses data.seed, data.shuffle, cuts documents at --record-cut): TokenLoader reads the files in sorted
# order when its seed is None
STREAMS = {"shuffled": (True, True, False), "sequential": (True, False, False), "sorted": (False, False, False),
           "cut": (False, False, True)}
RECORD_STAGES = (1, 2, 3)  # record 46's micro-batch on a GPU in its three batch stages, in rows of --record-row
# FineWeb's document lengths in GPT-2 tokens, as a log-normal: median 550, 4.9% over 2,048 (sigma 0.795)
FINEWEB_LIKE = {"median": 550, "sigma": 0.795}
FINEWEB_LIKE_SHARD = 5_000_000  # tokens a shard, about (whole documents)


@dataclass
class Coverage:
    """One epoch of a stream: its rows, and the shares of the files' tokens it read 0, 1 and 2+ times."""
    rows: int
    never: float
    once: float
    again: float


def coverage(files: list[Path], seq_len: int, bos_id: int | None, *, seed: int | None = 0,
             shuffle: bool = True, doc_cut: int = 0) -> Coverage:
    """Run TokenLoader (seed, shuffle, doc_cut as it takes them) over one epoch and count each token's reads."""
    # +1 at a range's first token, -1 past its last: a running sum is then each token's count of reads
    marks = {path: np.zeros(len(open_shard(path)) + 1, dtype=np.int32)
             for path in files}
    rows = 0
    loader = TokenLoader(files, 1, seq_len, seed=seed, bos_id=bos_id, shuffle=shuffle, doc_cut=doc_cut)
    while True:
        [(path, spans)] = loader.next_places()
        if loader.state_dict()["epoch"] > 0:  # the first row of the next epoch
            break
        for lo, hi in spans:
            marks[path][lo] += 1
            marks[path][hi] -= 1
        rows += 1
    reads = np.concatenate([np.cumsum(m[:-1]) for m in marks.values()])
    total = len(reads)
    return Coverage(rows, np.count_nonzero(reads == 0) / total, np.count_nonzero(reads == 1) / total,
                    np.count_nonzero(reads > 1) / total)


def fineweb_like(folder: Path, tokens: int, bos_id: int, seed: int = 0) -> list[Path]:
    """Shards of about `tokens` random ids in documents of FINEWEB_LIKE lengths, each opening with bos_id."""
    rng = np.random.default_rng(seed)
    files, left = [], tokens
    while left > 0:
        lengths, size = [], 0
        while size < min(left, FINEWEB_LIKE_SHARD):
            lengths.append(max(2, int(rng.lognormal(np.log(FINEWEB_LIKE["median"]), FINEWEB_LIKE["sigma"]))))
            size += lengths[-1]
        ids = rng.integers(0, bos_id, size)
        ids[np.cumsum([0, *lengths[:-1]])] = bos_id
        files.append(folder / f"fineweb_train_{len(files) + 1:06d}.bin")
        write_shard(files[-1], ids, dtype=np.uint16)
        left -= len(ids)
    return files


def report(files: list[Path], bos_id: int, args: argparse.Namespace) -> None:
    """Print each stream's coverage of `files`, then the record's."""
    tokens = sum(len(open_shard(f)) for f in files)
    print(f"{len(files)} files, {tokens:,} tokens, rows of {args.seq_len + 1:,} tokens from bos_id {bos_id}")
    print(f"{'stream':<14} {'rows':>9} {'read 0x':>8} {'1x':>8} {'2x+':>8}")
    for name, (seeded, shuffle, cut) in STREAMS.items():
        c = coverage(files, args.seq_len, bos_id, seed=args.seed if seeded else None, shuffle=shuffle,
                     doc_cut=args.record_cut if cut else 0)
        print(f"{name:<14} {c.rows:>9,} {c.never:>8.2%} {c.once:>8.2%} {c.again:>8.2%}")
    for stage in RECORD_STAGES:
        n = stage * args.record_row
        micro = record_coverage(files, lambda step: n, tokens // n + 1, 1, args.record_cut, bos_id).steps
        once = micro * (n + 1) / tokens
        print(f"{f'record {n:,}':<14} {micro:>9,} {1 - once:>8.2%} {once:>8.2%} {0:>8.2%}")


def main(argv: list[str] | None = None) -> None:
    """Print each stream's coverage of the --train shards (or of --fineweb-like ones)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--train", help="glob of training shards")
    source.add_argument("--fineweb-like", type=int, metavar="TOKENS",
                        help="count on this many tokens of FineWeb-like documents instead (GPT-2's bos id)")
    p.add_argument("--seq-len", type=int, default=2048, help="train.seq_len")
    p.add_argument("--bos-id", type=int, default=None, help="the document token (default: meta.json's eot_token)")
    p.add_argument("--seed", type=int, default=0, help="data.seed")
    p.add_argument("--record-row", type=int, default=16384, help="the record's micro-batch in its first stage")
    p.add_argument("--record-cut", type=int, default=2048, help="the record's longest document (max_seq_len)")
    args = p.parse_args(argv)
    if args.fineweb_like:
        with tempfile.TemporaryDirectory() as tmp:
            bos_id = 50256 if args.bos_id is None else args.bos_id
            return report(fineweb_like(Path(tmp), args.fineweb_like, bos_id, args.seed), bos_id, args)
    files = resolve_files(args.train)
    bos_id = args.bos_id if args.bos_id is not None else read_meta(files[0].parent).get("eot_token")
    if bos_id is None:
        p.error(f"no meta.json beside {files[0]} names the eot_token: give --bos-id")
    report(files, bos_id, args)


if __name__ == "__main__":
    main()
