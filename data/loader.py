"""Token batches from memory-mapped shards: rank-disjoint, deterministic, resumable, prefetched.

The global stream. Files are sorted; each epoch visits them in an order shuffled by (seed, epoch)
(sorted order every epoch when seed is None). A file is cut into windows of seq_len + 1 tokens that
never overlap: with bos_id=None a window starts where the previous one ended; with bos_id set it starts
at the next bos_id at or after that point, so a document longer than a window is cut and its rest is
skipped. A window never reads past the end of its file: when the next one does not fit, the stream moves
on to the next file (the few tokens left over are skipped), and after the last file to the next epoch,
forever. Every token is therefore read at most once per epoch, by one rank.

The ranks. A global batch is the next world_size * batch_size windows of the stream; rank r takes windows
[r * batch_size, (r + 1) * batch_size) of it; a window gives inputs = window[:-1], targets = window[1:].
The state is the stream position before the next global batch: the same on every rank, so a run may
even resume with another world size or batch size and still never repeat a token within the epoch.

Nothing is read at construction beyond the file headers: BOS positions are found one region of the
file at a time by the background thread, which also asks the kernel to read ahead (MADV_WILLNEED).
"""
from __future__ import annotations

import collections
import glob
import itertools
import json
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from data.shards import ShardError, open_shard
from plural import plural

BOS_SCAN_TOKENS = 1 << 16   # BOS positions are searched this many tokens at a time (memory stays bounded)
READAHEAD_TOKENS = 1 << 24  # ask the kernel for this much of the file ahead of the stream (32 MiB of uint16)
GROUP_BATCHES = 16          # the thread fills and hands over this many batches at once,
GROUP_TOKENS = 1 << 18      # or fewer, to keep a group under this many tokens (2 MiB of int64)
CURSOR = ("epoch", "index", "pos")  # the stream position, as state_dict() names it


def resolve_files(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A glob pattern or a list of paths -> the sorted list of files; no match is an error."""
    if isinstance(files, (str, os.PathLike)):
        found = sorted(Path(p) for p in glob.glob(str(files)))
        if not found:
            raise ShardError(f"no file matches {str(files)!r}; check the data path/glob (data.train / data.val)")
        return found
    found = sorted(Path(p) for p in files)
    if not found:
        raise ShardError("the list of token files is empty; give at least one shard")
    return found


class _Region:
    """Tokens [lo, hi) of one memory-mapped file, with its BOS search and read-ahead state."""

    def __init__(self, path: Path, tokens: np.memmap, lo: int, hi: int):
        self.path, self.tokens, self.lo, self.hi = path, tokens, lo, hi
        self.array = tokens.view(np.ndarray)  # slicing a plain ndarray skips np.memmap's per-slice overhead
        self._bos = (0, 0, np.empty(0, dtype=np.int64))  # scanned [start, stop) and the BOS positions in it
        self._advised = (0, 0)

    def window_start(self, pos: int, length: int, bos_id: int | None) -> int | None:
        """Where the next window at or after `pos` starts, or None if none fits before `hi`."""
        start = pos if bos_id is None else self._next_bos(pos, bos_id)
        return start if start is not None and start + length <= self.hi else None

    def _next_bos(self, pos: int, bos_id: int) -> int | None:
        while pos < self.hi:
            start, stop, found = self._bos
            if not start <= pos < stop:
                start, stop = pos, min(pos + BOS_SCAN_TOKENS, self.hi)
                found = start + np.flatnonzero(self.array[start:stop] == bos_id)
                self._bos = start, stop, found
            i = int(np.searchsorted(found, pos))
            if i < len(found):
                return int(found[i])
            pos = stop
        return None

    def read_ahead(self, pos: int) -> None:
        """Hint the kernel to page in the file ahead of `pos`, so the copies do not wait on page faults."""
        start, stop = self._advised
        if pos >= self.hi or start <= pos and (pos + READAHEAD_TOKENS // 2 <= stop or stop == self.hi):
            return
        stop = min(self.hi, pos + READAHEAD_TOKENS)
        self._advised = pos, stop
        mm = getattr(self.tokens, "_mmap", None)  # numpy keeps the mmap object here (no public accessor)
        if mm is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        # np.memmap maps from the offset rounded down to the allocation granularity
        base, size = self.tokens.offset % mmap.ALLOCATIONGRANULARITY, self.tokens.itemsize
        begin = base + pos * size
        begin -= begin % mmap.PAGESIZE
        mm.madvise(mmap.MADV_WILLNEED, begin, min(len(mm), base + stop * size) - begin)

    def tokens_count(self) -> int:
        """Number of tokens in the region."""
        return self.hi - self.lo


def _open_regions(paths: list[Path], fmt: str, raw_dtype) -> list[_Region]:
    regions = []
    for p in paths:
        tokens = open_shard(p, raw_dtype=raw_dtype, fmt=fmt)
        regions.append(_Region(p, tokens, 0, len(tokens)))
    return regions


def _names(regions: list[_Region]) -> str:
    return ", ".join(str(r.path) for r in regions[:3]) + (" ..." if len(regions) > 3 else "")


def _split_tail(regions: list[_Region], n: int) -> tuple[list[_Region], _Region]:
    """(regions without the last n tokens of the last file, a region of those n tokens)."""
    last = regions[-1]
    if not 0 < n < last.tokens_count():
        raise ShardError(f"{last.path}: the held-out tail (data.val = 'holdout') of eval.tokens = {n} must be "
                         f"between 1 and the last file's {last.tokens_count()} tokens; lower eval.tokens or use a "
                         f"separate validation set")
    cut = last.hi - n
    head, tail = _Region(last.path, last.tokens, last.lo, cut), _Region(last.path, last.tokens, cut, last.hi)
    return regions[:-1] + [head], tail


class _Stream:
    """The global window stream over regions: a cursor (epoch, file index in the epoch's order, position)."""

    def __init__(self, regions: list[_Region], length: int, seed: int | None, bos_id: int | None):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self._windowless: set[int] = set()  # regions found to hold no window at all (e.g. no BOS token)
        self.seek((0, 0, None))

    def _order(self, epoch: int) -> np.ndarray:
        if self.seed is None:
            return np.arange(len(self.regions))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.regions))

    def seek(self, state: tuple[int, int, int | None]) -> None:
        """Move the cursor to (epoch, file index in the epoch's order, position; None: the file's start)."""
        self.epoch, self.index, pos = state
        self.order = self._order(self.epoch)
        self.pos = self.region.lo if pos is None else pos

    def state(self) -> tuple[int, int, int]:
        """The cursor (epoch, index, pos): a tuple, since one is taken per batch on the producer's hot path."""
        return self.epoch, self.index, self.pos

    @property
    def region(self) -> _Region:
        return self.regions[self.order[self.index]]

    def take(self, count: int, runs: list[tuple[_Region, int, int]]) -> None:
        """Advance by `count` windows; append them to runs (region, first start, number of adjacent windows)."""
        while count > 0:
            region = self.region
            start = region.window_start(self.pos, self.length, self.bos_id)
            if start is None:
                self._next_region()
                continue
            n = 1 if self.bos_id is not None else min(count, (region.hi - start) // self.length)
            if runs and runs[-1][0] is region and runs[-1][1] + runs[-1][2] * self.length == start:
                runs[-1] = (region, runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((region, start, n))
            self.pos, count = start + n * self.length, count - n

    def take_adjacent(self, count: int) -> int | None:
        """Advance by `count` windows if they lie back to back in the current file from the cursor on (only
        with bos_id=None); return the first one's start. Otherwise None, and the cursor stays where it is."""
        end = self.pos + count * self.length
        if self.bos_id is not None or end > self.region.hi:
            return None
        start, self.pos = self.pos, end
        return start

    def _next_region(self) -> None:
        if self.pos == self.region.lo:  # not a single window in this file, now or in any later epoch
            self._windowless.add(int(self.order[self.index]))
        if len(self._windowless) == len(self.regions):
            raise ShardError(f"no window of {self.length} tokens starting with bos_id={self.bos_id} in "
                             f"{plural(len(self.regions), 'file')} ({_names(self.regions)}); check bos_id (meta.json "
                             f"eot_token) or turn off data.bos_aligned")
        self.index += 1
        if self.index == len(self.regions):
            self.epoch, self.index = self.epoch + 1, 0
            self.order = self._order(self.epoch)
        self.pos = self.region.lo


def _check_fits(regions: list[_Region], length: int) -> None:
    biggest = max(regions, key=_Region.tokens_count)
    if biggest.tokens_count() < length:
        raise ShardError(f"seq_len + 1 = {length} tokens is longer than every file: the largest, {biggest.path}, "
                         f"has {biggest.tokens_count()} usable tokens; lower seq_len or use bigger shards")


def _gather(runs: list[tuple[_Region, int, int]], length: int, out: np.ndarray) -> None:
    """Copy the windows into the rows of out [rows, length], one cast-copy per run of adjacent windows."""
    row = 0
    for region, start, n in runs:
        out[row:row + n] = region.array[start:start + n * length].reshape(n, length)
        row += n


def _check_vocab(runs: list[tuple[_Region, int, int]], length: int, vocab_size: int) -> None:
    # on the source windows: a quarter of the bytes of the int64 copy with uint16 tokens
    for region, start, n in runs:
        window = region.array[start:start + n * length]
        if window.max() >= vocab_size:
            bad = np.flatnonzero(window >= vocab_size)
            raise ShardError(f"{region.path}: token id {int(window[bad[0]])} at token {start + int(bad[0])} is >= "
                             f"vocab_size {vocab_size}; the data was tokenized with another tokenizer: use its "
                             f"vocabulary (model.vocab_size) or re-tokenize")


def _meta_vouches(paths: list[Path], vocab_size: int) -> bool:
    """True when a meta.json beside every file (data.prepare writes one) promises ids < vocab_size."""
    for folder in {p.parent for p in paths}:
        meta = folder / "meta.json"
        if not meta.exists():
            return False
        try:
            declared = json.loads(meta.read_text()).get("vocab_size")
        except (ValueError, AttributeError) as e:
            raise ShardError(f"{meta}: not a JSON object ({e}); fix or delete it") from None
        if not isinstance(declared, int) or declared > vocab_size:
            return False
    return True


def _groups(stream: _Stream, rank: int, world_size: int, batch_size: int, group: int, vocab_size: int | None,
            ring: list[np.ndarray], events: list) -> Iterator[tuple[int, list[dict]]]:
    """The producer: fill the next ring slot with this rank's next `group` batches (the first time: one, so
    start-up and resume do not wait for a whole group); yield (slot, the stream state after each batch)."""
    for step in itertools.count():
        runs, states = _group_runs(stream, rank, world_size, batch_size, group if step else 1)
        if vocab_size is not None:
            _check_vocab(runs, stream.length, vocab_size)
        slot = step % len(ring)
        if events:
            events[slot].synchronize()  # the device copies of this slot's previous batches have finished
        _gather(runs, stream.length, ring[slot])
        yield slot, states
        stream.region.read_ahead(stream.pos)  # after the group is out: the first one should not wait for it


def _group_runs(stream: _Stream, rank: int, world_size: int, batch_size: int,
                batches: int) -> tuple[list[tuple[_Region, int, int]], list[tuple[int, int, int]]]:
    """This rank's windows of the next `batches` global batches, as runs, and the stream state after each."""
    span = world_size * batch_size * stream.length  # tokens of one global batch when its windows are adjacent
    start = stream.take_adjacent(batches * world_size * batch_size)
    if start is not None:  # the common case, by arithmetic: ~0.7 us a batch instead of ~4.5 us through take()
        region, first = stream.region, start + rank * batch_size * stream.length
        runs = ([(region, first, batches * batch_size)] if world_size == 1 else
                [(region, first + b * span, batch_size) for b in range(batches)])
        return runs, [(stream.epoch, stream.index, start + (b + 1) * span) for b in range(batches)]
    runs: list[tuple[_Region, int, int]] = []
    states = []
    for _ in range(batches):
        _rank_runs(stream, rank * batch_size, batch_size, (world_size - rank - 1) * batch_size, runs)
        states.append(stream.state())
    return runs, states


def _rank_runs(stream: _Stream, before: int, rows: int, after: int, runs: list[tuple[_Region, int, int]]) -> None:
    """Skip the windows of the ranks before this one, append this rank's rows to runs, skip the ranks after."""
    stream.take(before, [])
    stream.take(rows, runs)
    stream.take(after, [])


def _pump(items: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    """Background thread: move items into the queue until stopped; an exception is queued for the consumer."""
    try:
        for item in items:
            if not _put(q, item, stop):
                return
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
        _put(q, e, stop)


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` unless stopped first (a consumer that called close() no longer takes items)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


class TokenLoader:
    """Infinite iterator of (inputs, targets) int64 [batch_size, seq_len] batches on `device` (see module doc).

    inputs and targets are views of one [batch_size, seq_len + 1] tensor of windows (not contiguous: use
    reshape, not view): one copy per batch instead of two. The background thread fills a ring of reused host
    buffers of a group of batches each (pinned for CUDA, where an event per buffer guards its reuse) at most
    `prefetch` batches (rounded up to whole groups) ahead; on CPU the batch *is* a view of a ring buffer: it
    stays valid until the next __next__ call, clone it to keep it longer.
    Call close() (or use `with`) when done: it stops the background thread. `wait_s` accumulates the
    seconds __next__ spent waiting for the background thread; `tokens_per_step` counts the target tokens of
    one global batch (all ranks).
    """

    _thread: threading.Thread | None = None  # also what close() sees if __init__ failed

    def __init__(self, files, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1,
                 seed: int | None = 0, bos_id: int | None = None, device: str | torch.device = "cpu",
                 fmt: str = "auto", raw_dtype=None, vocab_size: int | None = None, holdout_tokens: int = 0,
                 prefetch: int = 4):
        if min(batch_size, seq_len, world_size, prefetch) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size, seq_len, world_size, prefetch >= 1 and 0 <= rank < world_size; got "
                             f"{batch_size=}, {seq_len=}, {world_size=}, {prefetch=}, {rank=}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0 or None, got {seed}")
        self.files = resolve_files(files)
        regions = _open_regions(self.files, fmt, raw_dtype)
        if holdout_tokens:
            regions = _split_tail(regions, holdout_tokens)[0]
        _check_fits(regions, seq_len + 1)
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.tokens_per_step = world_size * batch_size * seq_len
        self.wait_s = 0.0
        self._spec = {"files": [p.name for p in self.files], "seed": seed, "seq_len": seq_len, "bos_id": bos_id,
                      "holdout_tokens": holdout_tokens}
        self._vocab = None if vocab_size is None or _meta_vouches(self.files, vocab_size) else vocab_size
        self._stream = _Stream(regions, seq_len + 1, seed, bos_id)
        self._state = self._stream.state()
        # A group of batches per hand-over and per gather, because a hand-over costs a thread wake-up and
        # GIL switches: at B=16, T=1024 the consumer spent 46 us of CPU a batch handed over one by one, 3 us
        # in groups of 16, while the copy itself takes ~16 us. The token cap bounds the (pinned) ring.
        self._group = max(1, min(GROUP_BATCHES, GROUP_TOKENS // (batch_size * (seq_len + 1))))
        self._queued_groups = -(-prefetch // self._group)
        # Reused buffers, because a fresh 256 KB tensor per batch page-faults on every touch (measured 85 us
        # vs 19 us for the copy itself). Slots: the queued groups + the group being filled + the group the
        # consumer is working through (its current batch included).
        cuda = self.device.type == "cuda"
        self._ring = [torch.empty((self._group * batch_size, seq_len + 1), dtype=torch.int64, pin_memory=cuda)
                      for _ in range(self._queued_groups + 2)]
        self._events = [torch.cuda.Event() for _ in self._ring] if cuda else []
        # Made once per ring slot, since the same views come back every time the slot is reused: a torch
        # slice costs ~7 us of Python here, half the copy of a batch. On CUDA: the rows to send.
        blocks = [t.split(batch_size) for t in self._ring]
        self._views = [[b if cuda else (b[:, :-1], b[:, 1:]) for b in slot] for slot in blocks]

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._start()
        if not self._ready:
            t0 = time.perf_counter()
            got = self._queue.get()
            self.wait_s += time.perf_counter() - t0
            if isinstance(got, BaseException):
                self.close()
                raise got
            slot, states = got
            self._ready = collections.deque((batch, slot, s) for batch, s in zip(self._views[slot], states))
        batch, slot, self._state = self._ready.popleft()
        if not self._events:
            return batch
        out = batch.to(self.device, non_blocking=True)
        self._events[slot].record()
        return out[:, :-1], out[:, 1:]

    def _start(self) -> None:
        self._stream.seek(self._state)  # the producer restarts at the consumer's position, not its own
        self._queue: queue.Queue = queue.Queue(maxsize=self._queued_groups)
        self._ready: collections.deque = collections.deque()
        self._stop = threading.Event()
        items = _groups(self._stream, self.rank, self.world_size, self.batch_size, self._group, self._vocab,
                        [t.numpy() for t in self._ring], self._events)
        self._thread = threading.Thread(target=_pump, args=(items, self._queue, self._stop), daemon=True,
                                        name="TokenLoader")
        self._thread.start()

    def close(self) -> None:
        """Stop the background thread; iterating again restarts it where the consumer stopped."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def state_dict(self) -> dict:
        """Where the next batch comes from, plus what defines the stream (plain Python types only)."""
        return {**self._spec, **dict(zip(CURSOR, self._state))}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): the next batch is the one the saved loader would have yielded."""
        for key, want in self._spec.items():
            if state.get(key) != want:
                shown = plural(len(want), "file") if key == "files" else repr(want)
                raise ValueError(f"loader state: {key} was {str(state.get(key))[:200]} but this loader has "
                                 f"{shown}; resume with the same data files, seed, seq_len, bos_id and holdout")
        self.close()
        self._state = tuple(int(state[k]) for k in CURSOR)


def val_batches(files, batch_size: int, seq_len: int, num_tokens: int, *, rank: int = 0, world_size: int = 1,
                device: str | torch.device = "cpu", fmt: str = "auto", raw_dtype=None,
                tail_tokens: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's fixed validation batches: windows of seq_len + 1 tokens from the first `num_tokens` tokens.

    The tokens are the first num_tokens of the sorted files (with tail_tokens=N: of the last N tokens of the
    last file, which TokenLoader(holdout_tokens=N) leaves out), cut into windows as in training, never across
    files. Global batch g is windows [g*W*B, (g+1)*W*B); rank r takes [r*B, (r+1)*B) of it, so the union over
    ranks is the same for every world size. Every rank yields the same number of batches (FSDP needs the
    same number of forward calls); in the last one a rank may hold fewer rows, even none: shape (0, seq_len).
    Average as sum(loss * y.numel()) / sum(y.numel()), each summed over batches and all-reduced over ranks,
    leaving out the loss of an empty batch (it is NaN).
    """
    if min(batch_size, seq_len, world_size) < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size, seq_len, world_size >= 1 and 0 <= rank < world_size; got "
                         f"{batch_size=}, {seq_len=}, {world_size=}, {rank=}")
    regions = _open_regions(resolve_files(files), fmt, raw_dtype)
    if tail_tokens:
        regions = [_split_tail(regions, tail_tokens)[1]]
    regions, length = _first_tokens(regions, num_tokens), seq_len + 1
    total = sum(r.tokens_count() // length for r in regions)
    if total == 0:
        raise ShardError(f"eval.tokens = {num_tokens} holds no window of seq_len + 1 = {length} tokens; raise "
                         f"eval.tokens to at least {length}")
    stream, per_step = _Stream(regions, length, None, None), world_size * batch_size

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for done in range(0, total, per_step):
            first = min(total, done + rank * batch_size)
            rows = min(batch_size, total - first)
            runs: list[tuple[_Region, int, int]] = []
            _rank_runs(stream, first - done, rows, min(total, done + per_step) - first - rows, runs)
            out = torch.empty((rows, length), dtype=torch.int64)
            _gather(runs, length, out.numpy())
            out = out.to(device, non_blocking=True)  # pageable memory: safe to drop right after
            yield out[:, :-1], out[:, 1:]

    return batches()


def _first_tokens(regions: list[_Region], num_tokens: int) -> list[_Region]:
    """The regions cut down to their first num_tokens tokens in order; fewer tokens is an error."""
    have = sum(r.tokens_count() for r in regions)
    if have < num_tokens:
        raise ShardError(f"validation data ({_names(regions)}) holds {plural(have, 'token')} in "
                         f"{plural(len(regions), 'file')} but eval.tokens = {num_tokens}; lower eval.tokens to at "
                         f"most {have} or add validation data")
    cut, left = [], num_tokens
    for r in regions:
        if left <= 0:
            break
        cut.append(_Region(r.path, r.tokens, r.lo, min(r.hi, r.lo + left)))
        left -= cut[-1].tokens_count()
    return cut
