"""How a record's script reads its training shards, restated to count what shards hold for it before a GPU runs it.

The rule (record 46's BOSFinder): the shards are read in sorted order, each once. A rank's micro-batch of n tokens
is n + 1 consecutive tokens gathered from documents in order, each starting at a BOS token and cut at the next BOS,
at max_seq_len tokens, or where the n + 1 are complete; the rest of a cut document is skipped, the next micro-batch
starting at the next BOS. The ranks' micro-batches of a step are consecutive rows of one shard: where a shard cannot
give them all, they all start over at the next shard. Past the last shard the script does not stop: its loader
thread has no file to give and the run waits for ever. A micro-batch's document starts go into a table of
next_multiple(n // 300, 128) entries, the first being 0, so more documents than that minus one fail the run. Its val
set is read otherwise: rows of consecutive tokens from the val shard's start, a document starting at each BOS in
them, into the same kind of table.
Since the loader stops at its last shard, a run longer than the shards' one epoch reads them again from links
numbered on (`repeated`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from data.meta import META
from data.regions import Spans
from data.shards import open_shard
from scripts.beside.record_script import RecordError


@dataclass
class Coverage:
    """What the shards give a record's run: complete steps, the first step they cannot give (None: all asked
    for were given), the most documents in one micro-batch, and the micro-batches holding more than docs_limit."""
    steps: int
    short_at: int | None
    most_docs: int
    over_limit: int


def docs_limit(tokens: int) -> int:
    """The most documents a micro-batch of `tokens` may hold: its start table's size, next_multiple(tokens // 300,
    128), less the leading 0."""
    return -(-(tokens // 300) // 128) * 128 - 1


def record_rows(files: list[Path], lengths: Iterable[int], max_seq_len: int, bos: int,
                world: int = 1) -> Iterator[tuple[Path, list[Spans]]]:
    """The record's micro-batches by the rule above, one for each n of `lengths`: its shard and each of `world`
    ranks' token ranges of n + 1 tokens, consecutive rows, all from one shard (a shard that cannot give every
    rank's row gives none). Ends where the shards can give no more."""
    shards = iter(sorted(files))
    starts, size, i, path = np.empty(0, dtype=np.int64), 0, 0, None
    for n in lengths:
        while True:
            rows, j = [], i
            while len(rows) < world:
                spans, taken = [], 0
                while taken < n + 1 and j < len(starts):
                    end = starts[j + 1] if j + 1 < len(starts) else size
                    spans.append((int(starts[j]), int(starts[j] + min(end - starts[j], max_seq_len, n + 1 - taken))))
                    taken, j = taken + spans[-1][1] - spans[-1][0], j + 1
                if taken < n + 1:
                    break
                rows.append(spans)
            if len(rows) == world:
                break
            path = next(shards, None)
            if path is None:
                return
            tokens = open_shard(path, fmt="header")
            starts, size, i = np.flatnonzero(tokens == bos), len(tokens), 0
        i = j
        yield path, rows


def record_coverage(files: list[Path], step_tokens: Callable[[int], int], steps: int, grad_accum: int,
                    max_seq_len: int, bos: int) -> Coverage:
    """How many of `steps` steps (each of step_tokens(step) tokens in grad_accum micro-batches) the record's loader
    can read from `files` by the rule above."""
    lengths = (step_tokens(step) // grad_accum for step in range(steps) for _ in range(grad_accum))
    micro, most, over = 0, 0, 0
    for micro, (_, [spans]) in enumerate(record_rows(files, lengths, max_seq_len, bos), start=1):
        n = sum(hi - lo for lo, hi in spans) - 1
        most, over = max(most, len(spans)), over + (len(spans) > docs_limit(n))
    done = micro // grad_accum
    return Coverage(done, None if done == steps else done, most, over)


def most_val_documents(val_file: Path, rows: int, batches: int, bos: int) -> int:
    """The most document starts (BOS tokens) in one of the record's `batches` val rows of `rows` tokens."""
    tokens = open_shard(val_file, fmt="header")
    return max(int(np.count_nonzero(tokens[k * rows:(k + 1) * rows] == bos)) for k in range(batches))


def repeated(train: list[Path], val: list[Path], into: Path, epochs: int) -> Path:
    """A DATA_PATH at `into` that holds the `train` shards `epochs` times in a row and the `val` shards once, as
    links to them named fineweb_<split>_NNNNNN.bin, and the train shards' meta.json: the record's sorted glob, and
    ours, read them epoch after epoch, in the same order each time. The links of an earlier call go first; anything
    else there is refused, not removed."""
    shards, train = into / "data" / "fineweb10B", sorted(train)
    shards.mkdir(parents=True, exist_ok=True)
    for old in shards.iterdir():
        if not old.is_symlink():
            raise RecordError(f"{old}: not a link to a shard: --work's {into.name}/ is the harness's own, give --work "
                              f"a folder of its own")
        old.unlink()
    for n, shard in enumerate(train * epochs, start=1):
        (shards / f"fineweb_train_{n:06d}.bin").symlink_to(shard.resolve())
    for shard in val:
        (shards / shard.name).symlink_to(shard.resolve())
    meta = train[0].parent / META  # what our side reads of the shards (tokenizer, vocab_size, ...)
    if meta.is_file():
        (shards / META).symlink_to(meta.resolve())
    return into
