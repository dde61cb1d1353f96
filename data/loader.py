"""Token batches from memory-mapped shards: rank-disjoint, deterministic, resumable, prefetched.

Files are sorted; epoch e visits them in an order shuffled by (seed, e) (sorted order every epoch, and the
sequential stream, when seed is None). A window is L = seq_len + 1 tokens of one file, never across files;
with holdout_tokens the last file ends where the held-out tokens begin.

The shuffled stream (shuffle=True, the default). A file is cut into slots of L tokens, slot k being tokens
[kL, (k+1)L); the few tokens after its last whole slot are never read. The epoch's files are taken K at a
time (shuffle_shards=K; K=0: all files in one block), and a block's slots, numbered 0..n-1 in file order,
are visited in the order E(0), E(1), ..., E(2^b - 1) with the values >= n left out: E is a bijection of
[0, 2^b), 2^b the smallest power of two >= max(n, 4), keyed by (seed, e, block): a 4-round Feistel network
with splitmix64 as its round function. So every slot comes once per epoch and the windows of a batch come
from unrelated places of the whole block, while the order is never materialised: it costs memory per file,
not per window (48M windows as an int64 permutation would be 384 MB per rank), and a few vector operations
per slot, evaluated a chunk ahead. A Feistel network rather than an affine map a*i + c mod n: consecutive
outputs of an affine map are a fixed stride apart, so the windows of one batch would lie on a lattice and
the next batch on the same lattice shifted; a keyed Feistel network relates no two outputs. The cursor is
(epoch, block, position in [0, 2^b]). With bos_id=None a slot is a window. With bos_id set, the window of
slot k starts at the first bos_id in [kL, (k+1)L) and runs L tokens, so it reads up to L - 1 tokens of
slot k + 1; a slot with no bos_id, or whose window would run past the end of the file, has no window and is
skipped. So windows start at document starts, at most one a slot, and run on through the documents after
that one as in the sequential stream; tokens no window covers (the rest of a document longer than a
window, a document that starts after another in the same slot and outlasts its window) are skipped; and a
token may be read twice in an epoch, at the end of one slot's window and in the next slot's, never more.
A slot's bos_id is looked for only when the reading thread gets to the slot, in the slot alone (a
vector of slots at a time).

The sequential stream (shuffle=False). Each epoch visits the files front to back. With bos_id=None a
window starts where the previous one ended; with bos_id set, at the next bos_id at or after that point, so
a document longer than a window is cut and its rest is skipped. When the next window does not fit in the
file, the stream moves on to the next file (the few tokens left over are skipped), and after the last file
to the next epoch, forever. Every token is read at most once per epoch. BOS positions are found one region
of the file at a time.

The ranks (both streams). A global batch is the next world_size * batch_size windows of the stream; rank r
takes windows [r * batch_size, (r + 1) * batch_size) of it; a window gives inputs = window[:-1], targets =
window[1:]. The state is the stream position before the next global batch: the same on every rank, so a
run may even resume with another world size or batch size and still never repeat a window within the
epoch. With bos_id set every rank looks for the bos_id of all the global batch's slots (to know where the
other ranks' windows are), so every node reads the pages of the whole global batch.

The copies (both streams). Two background threads make a group of batches at a time: the first plans the group
and reads its windows (read()), the second casts them to int64 (fill()) into a fresh tensor, or for CUDA into
the next slot of a ring of pinned buffers, so that one group's reads overlap the previous group's cast.
Sequential: a group's windows lie back to back in a file, and fill() cast-copies each stretch of them straight
from the map. Shuffled: the files of one dtype are seen through one strided view, no copy, whose row s is the
window from token s of the lowest map (every map lies at a fixed offset from it, see _Span), so one fancy
index gathers all of a group's windows, from every file, in row order, in the files' dtype; one slice-copy per
2 KiB window cost more in numpy's per-call overhead than in copying, and one fancy index per file as much when
there are ~100 files. The first token of every window is read just before, so that their cache misses overlap.

Nothing is read at construction beyond the file headers. The reading thread asks the kernel for the
pages ahead of the copies (MADV_WILLNEED): in the sequential stream the next READAHEAD_TOKENS of the file;
in the shuffled one each window (with bos_id: each slot and the next) of the next HINT_BATCHES global
batches, unless a sample of them is in the page cache already, and it marks its maps MADV_RANDOM so that a
page fault reads one page, not read_ahead_kb around it. With shuffle_shards=K > 0 it also reads a block's
files ahead whole, in large sequential requests, together with the next block's, when the stream enters
the block: on a network filesystem each random 4 KiB page costs a round trip, a large read does not.
"""
from __future__ import annotations

import collections
import ctypes
import glob
import itertools
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from data.meta import MetaError, read_meta
from data.shards import ShardError, open_shard
from plural import plural

try:  # mincore(2): which pages of a map are in the page cache; no Python binding
    _MINCORE = ctypes.CDLL(None, use_errno=True).mincore
    _MINCORE.argtypes, _MINCORE.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int
except (OSError, AttributeError, TypeError):  # not a POSIX libc
    _MINCORE = None

BOS_SCAN_TOKENS = 1 << 16   # BOS positions are searched this many tokens at a time (memory stays bounded)
READAHEAD_TOKENS = 1 << 24  # ask the kernel for this much of the file ahead of the stream (32 MiB of uint16)
GROUP_BATCHES = 16          # the threads fill and hand over this many batches at once,
GROUP_TOKENS = 1 << 18      # or fewer, to keep a group under this many tokens (2 MiB of int64)
CURSOR = ("epoch", "index", "pos")  # the stream position, as state_dict() names it (shuffled: index = block)
LEGACY = {"shuffle": False, "shuffle_shards": 0}  # what a state saved before these keys existed meant
ORDER_ROUNDS = 4            # Feistel rounds: 4 make a keyed bijection whose outputs look independent
ORDER_CHUNK = 1 << 16       # positions of a block's order evaluated per call: few calls, each long enough
                            # that numpy lets go of the GIL the copying threads wait for (2.6 MB at a time),
ORDER_FIRST = 1 << 12       # but this many first after a seek: the first batch waits 0.5 ms for them, not 12
ORDER_TAG = 0x5EED0D        # in the order's key: SeedSequence([s, e]) == SeedSequence([s, e, 0]), keep apart
HINT_BATCHES = 32           # the shuffled stream hints the windows of this many global batches ahead,
HINT_SLOTS = 2048           # and at least this many slots,
HINT_SAMPLE = 8             # unless this many of the new ones, evenly spaced, are all in the page cache already
BOS_SCAN_SLOTS = 1024       # the shuffled stream looks for the bos_id of this many slots at a time (2 MiB of uint16)


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
        self._mmap = getattr(tokens, "_mmap", None) if hasattr(mmap, "MADV_WILLNEED") else None  # numpy's own
        # np.memmap maps from the offset rounded down to the allocation granularity
        self._base, self._itemsize = tokens.offset % mmap.ALLOCATIONGRANULARITY, tokens.itemsize
        self._address = self.array.ctypes.data  # of token 0

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
        self.hint(pos, stop)

    def cached(self, start: int, stop: int) -> bool:
        """Whether every page of tokens [start, stop) is in the page cache (False when that cannot be told)."""
        if _MINCORE is None:
            return False
        begin, end = self._address + start * self._itemsize, self._address + min(stop, self.hi) * self._itemsize
        begin -= begin % mmap.PAGESIZE
        pages = -(-(end - begin) // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        return _MINCORE(begin, end - begin, vec) == 0 and all(v & 1 for v in vec)

    def hint(self, start: int, stop: int) -> None:
        """Ask the kernel to read tokens [start, stop) in the background (MADV_WILLNEED), if it can."""
        if self._mmap is None:
            return
        begin, end = self._base + start * self._itemsize, self._base + min(stop, self.hi) * self._itemsize
        begin -= begin % mmap.PAGESIZE
        self._mmap.madvise(mmap.MADV_WILLNEED, begin, end - begin)

    def random_access(self) -> None:
        """Tell the kernel the map is read at random (MADV_RANDOM): a page fault then reads its page only. By
        default it reads read_ahead_kb around it: 8 MiB on this machine's disk, 35 ms a fault, for 2 KiB."""
        if self._mmap is not None and hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)

    def byte_range(self) -> tuple[int, int]:
        """(offset, length) of the region's tokens in its file."""
        return self.tokens.offset + self.lo * self._itemsize, self.tokens_count() * self._itemsize

    def tokens_count(self) -> int:
        """Number of tokens in the region."""
        return self.hi - self.lo


# A stretch of windows: (region, first start, number of windows), the windows back to back in the region, so
# that one copy reads them all (the sequential stream's plan is a list of them).
Stretch = tuple[_Region, int, int]
Part = tuple[slice | np.ndarray, np.ndarray]  # rows of a group, and their windows in the files' dtype


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


def _file_order(seed: int | None, epoch: int, files: int) -> np.ndarray:
    """The order an epoch visits the files in: shuffled by (seed, epoch), sorted when seed is None."""
    if seed is None:
        return np.arange(files)
    return np.random.default_rng([seed, epoch]).permutation(files)


def _no_window(regions: list[_Region], length: int, bos_id: int | None) -> ShardError:
    return ShardError(f"no window of {length} tokens starting with bos_id={bos_id} in "
                      f"{plural(len(regions), 'file')} ({_names(regions)}); check bos_id (meta.json eot_token) or "
                      f"turn off data.bos_aligned")


class _Stream:
    """The sequential window stream: a cursor (epoch, file index in the epoch's order, position); rank `rank`
    of world_size plans its windows of batch_size per global batch."""

    def __init__(self, regions: list[_Region], length: int, seed: int | None, bos_id: int | None,
                 rank: int = 0, world_size: int = 1, batch_size: int = 1):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self._windowless: set[int] = set()  # regions found to hold no window at all (e.g. no BOS token)
        self.seek((0, 0, None))

    def _order(self, epoch: int) -> np.ndarray:
        return _file_order(self.seed, epoch, len(self.regions))

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

    def take(self, count: int, stretches: list[Stretch]) -> None:
        """Advance by `count` windows; append them to `stretches`, extending the last one where they adjoin."""
        while count > 0:
            region = self.region
            start = region.window_start(self.pos, self.length, self.bos_id)
            if start is None:
                self._next_region()
                continue
            n = 1 if self.bos_id is not None else min(count, (region.hi - start) // self.length)
            if stretches and stretches[-1][0] is region and stretches[-1][1] + stretches[-1][2] * self.length == start:
                stretches[-1] = (region, stretches[-1][1], stretches[-1][2] + n)
            else:
                stretches.append((region, start, n))
            self.pos, count = start + n * self.length, count - n

    def take_adjacent(self, count: int) -> int | None:
        """Advance by `count` windows if they lie back to back in the current file from the cursor on (only
        with bos_id=None); return the first one's start. Otherwise None, and the cursor stays where it is."""
        end = self.pos + count * self.length
        if self.bos_id is not None or end > self.region.hi:
            return None
        start, self.pos = self.pos, end
        return start

    def plan(self, batches: int) -> tuple[list[Stretch], list[tuple[int, int, int]]]:
        """This rank's windows of the next `batches` global batches, as stretches, and the stream state after each."""
        rank, world_size, batch_size = self.rank, self.world_size, self.batch_size
        span = world_size * batch_size * self.length  # tokens of one global batch when its windows are adjacent
        start = self.take_adjacent(batches * world_size * batch_size)
        if start is not None:  # the common case, by arithmetic: ~0.7 us a batch instead of ~4.5 us through take()
            region, first = self.region, start + rank * batch_size * self.length
            stretches = ([(region, first, batches * batch_size)] if world_size == 1 else
                    [(region, first + b * span, batch_size) for b in range(batches)])
            return stretches, [(self.epoch, self.index, start + (b + 1) * span) for b in range(batches)]
        stretches: list[Stretch] = []
        states = []
        for _ in range(batches):
            _rank_stretches(self, rank * batch_size, batch_size, (world_size - rank - 1) * batch_size, stretches)
            states.append(self.state())
        return stretches, states

    def read(self, stretches: list[Stretch], vocab_size: int | None) -> list[Stretch]:
        """The planned windows, for fill(), after refusing token ids >= vocab_size (None: no check). Nothing is
        copied here: a stretch lies back to back in its file, and fill() casts it in one pass."""
        if vocab_size is not None:
            _check_vocab(stretches, self.length, vocab_size)
        return stretches

    def fill(self, stretches: list[Stretch], out: np.ndarray) -> None:
        """Cast-copy the windows read() returned into the rows of out."""
        _gather(stretches, self.length, out)

    def read_ahead(self) -> None:
        """Hint the pages ahead of the cursor (after a group is out: the first one should not wait for it)."""
        self.region.read_ahead(self.pos)

    def _next_region(self) -> None:
        if self.pos == self.region.lo:  # not a single window in this file, now or in any later epoch
            self._windowless.add(int(self.order[self.index]))
        if len(self._windowless) == len(self.regions):
            raise _no_window(self.regions, self.length, self.bos_id)
        self.index += 1
        if self.index == len(self.regions):
            self.epoch, self.index = self.epoch + 1, 0
            self.order = self._order(self.epoch)
        self.pos = self.region.lo


_MIX = (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9), np.uint64(27), np.uint64(0x94D049BB133111EB),
        np.uint64(31))  # splitmix64's finalizer


def _mix(z: np.ndarray) -> np.ndarray:
    s1, m1, s2, m2, s3 = _MIX
    z = (z ^ (z >> s1)) * m1  # uint64 arithmetic wraps, as the hash wants
    z = (z ^ (z >> s2)) * m2
    return z ^ (z >> s3)


class _Feistel:
    """A keyed bijection of [0, 2**bits): an unbalanced Feistel network whose halves swap widths each round."""

    def __init__(self, bits: int, key: list[int]):
        self.widths = bits // 2, bits - bits // 2
        self.keys = np.random.default_rng(key).integers(0, 2**64, size=ORDER_ROUNDS, dtype=np.uint64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        high, low = self.widths
        left, right = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
        for key in self.keys:  # (L, R) -> (R, L ^ F(R)): invertible whatever F is
            left, right = right, left ^ (_mix(right ^ key) & np.uint64((1 << high) - 1))
            high, low = low, high
        return (left << np.uint64(low)) | right


class _Block:
    """Files of one epoch visited together: their slots numbered in file order and the keyed order of them."""

    def __init__(self, files: np.ndarray, counts: np.ndarray, key: list[int]):
        self.files = files
        self.first = np.concatenate([[0], np.cumsum(counts[files])])  # number of the first slot of each file
        self.n = int(self.first[-1])
        bits = max(2, (self.n - 1).bit_length())
        self.size = 1 << bits if self.n else 0  # the positions of the order: [0, size)
        self.order = _Feistel(bits, key)

    def slots(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots at positions [begin, end) of the order: (position, region index, slot index in its file)."""
        pos = np.arange(begin, end, dtype=np.uint64)
        slot = self.order(pos)
        keep = slot < self.n  # the values past n are left out: the rest is a permutation of [0, n)
        pos, slot = pos[keep].astype(np.int64), slot[keep].astype(np.int64)
        file = np.searchsorted(self.first, slot, side="right") - 1
        return pos, self.files[file], slot - self.first[file]


class _Shuffled:
    """The shuffled window stream (see the module doc): a cursor (epoch, block, position in the block's
    order); rank `rank` of world_size plans its windows of batch_size per global batch."""

    def __init__(self, regions: list[_Region], length: int, seed: int, bos_id: int | None, shards: int,
                 rank: int, world_size: int, batch_size: int):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.rank, self.batch_size, self.per_step = rank, batch_size, world_size * batch_size
        self.shards = shards if 0 < shards < len(regions) else len(regions)  # files per block
        self.sweep = self.shards < len(regions)  # read whole blocks ahead (a working set smaller than the data)
        self.counts = np.array([r.tokens_count() // length for r in regions], dtype=np.int64)  # slots per file
        self.starts = np.array([r.lo for r in regions], dtype=np.int64)
        self.ahead = max(HINT_SLOTS, HINT_BATCHES * self.per_step)  # slots planned and hinted ahead
        for region in regions:
            region.random_access()
        self.spans, self.span_of, self.offset_of = _spans(regions, length)
        self.ends = np.array([r.hi for r in regions], dtype=np.int64)
        self._picked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._blocks: dict[tuple[int, int], _Block] = {}
        self._swept: collections.deque = collections.deque(maxlen=4)  # blocks whose files were read ahead
        self.seek((0, 0, 0))

    def seek(self, state: tuple[int, int, int]) -> None:
        """Move the cursor to (epoch, block, position in the block's order)."""
        self._cursor = self._next = tuple(state)  # after the last batch planned; where the order is evaluated next
        # The evaluated slots not taken yet, in order: epoch, block, position, region index, first token
        self._ahead = np.empty((5, 0), dtype=np.int64)
        self._taken = 0  # windows taken since the seek: global batch b is windows [b * per_step, (b + 1) * per_step)
        self._dry = 0    # slots in a row without a window (bos_id set)
        self._chunk = ORDER_FIRST  # positions to evaluate next (chunks do not change the order, only its cost)

    def state(self) -> tuple[int, int, int]:
        """The cursor after the last batch planned: (epoch, block, position)."""
        return self._cursor

    def _block(self, epoch: int, index: int) -> _Block:
        key = epoch, index
        if key not in self._blocks:
            if len(self._blocks) > 2:  # only the block being taken and the one being evaluated are in use
                self._blocks.clear()
            files = _file_order(self.seed, epoch, len(self.regions))[index * self.shards:(index + 1) * self.shards]
            self._blocks[key] = _Block(files, self.counts, [self.seed, epoch, index, ORDER_TAG])
        return self._blocks[key]

    def _after(self, epoch: int, index: int) -> tuple[int, int]:
        """The block after (epoch, index)."""
        return (epoch, index + 1) if (index + 1) * self.shards < len(self.regions) else (epoch + 1, 0)

    def _evaluate(self, slots: int) -> int:
        """Evaluate the order until at least `slots` slots are ahead of the taker; return how many were added."""
        added = []
        have = self._ahead.shape[1]
        while have < slots:
            epoch, index, begin = self._next
            block = self._block(epoch, index)
            if begin >= block.size:
                self._next = (*self._after(epoch, index), 0)
                continue
            end = min(block.size, begin + self._chunk)
            self._chunk = ORDER_CHUNK
            pos, region, slot = block.slots(begin, end)
            tag = np.broadcast_to(np.array([[epoch], [index]]), (2, len(pos)))
            added.append(np.concatenate([tag, np.stack([pos, region, self.starts[region] + slot * self.length])]))
            have += len(pos)
            self._next = (epoch, index, end)
        if not added:
            return 0
        new = np.concatenate(added, axis=1)
        self._ahead = np.concatenate([self._ahead, new], axis=1)
        return new.shape[1]

    def plan(self, batches: int) -> tuple[tuple[np.ndarray, np.ndarray], list[tuple[int, int, int]]]:
        """This rank's windows of the next `batches` global batches, as (region index, first token) arrays in
        row order, and the stream state after each batch."""
        if self.bos_id is not None:
            return self._plan_bos(batches)
        need = batches * self.per_step
        self._evaluate(need)
        mine, last = self._picks(batches)
        epoch, index, pos, region, start = self._ahead
        states = list(zip(epoch[last].tolist(), index[last].tolist(), (pos[last] + 1).tolist()))
        windows = region[mine], start[mine]
        self._ahead = self._ahead[:, need:]
        self._taken += need
        self._cursor = states[-1]
        return windows, states

    def _picks(self, batches: int) -> tuple[np.ndarray, np.ndarray]:
        """Among the next `batches` global batches' windows: this rank's, and the last one of each batch. Kept
        per count (1 or a group), since making them costs a third of plan()."""
        if batches not in self._picked:
            mine = (np.arange(batches)[:, None] * self.per_step + self.rank * self.batch_size
                    + np.arange(self.batch_size)).ravel()
            self._picked[batches] = mine, np.arange(1, batches + 1) * self.per_step - 1
        return self._picked[batches]

    def _plan_bos(self, batches: int) -> tuple[tuple[np.ndarray, np.ndarray], list[tuple[int, int, int]]]:
        """plan() with bos_id: every slot of the global batches is looked at to know which have a window, a
        vector of slots at a time (a slot each cost ~7 us of Python)."""
        which, starts, states = [], [], []
        need, total = batches * self.per_step, int(self.counts.sum())  # plan() starts at a global batch's start
        while need:
            scan = min(need, BOS_SCAN_SLOTS)  # a slot has one window at most: none is looked at in vain
            self._evaluate(scan)
            epoch, index, pos, region, slot = self._ahead[:, :scan]
            found = self._first_bos(region, slot)
            has = np.flatnonzero(found >= 0)  # the slots with a window
            dry = np.diff(np.concatenate([[-1 - self._dry], has, [scan]])) - 1  # slots without one in a row
            if dry.max() > total:  # a whole epoch's slots without one
                raise _no_window(self.regions, self.length, self.bos_id)
            self._dry = int(dry[-1])
            number = self._taken + np.arange(len(has))  # of each window in the stream
            mine = has[number % self.per_step // self.batch_size == self.rank]
            which.append(region[mine])
            starts.append(found[mine])
            last = has[(number + 1) % self.per_step == 0]  # completes a global batch
            states += zip(epoch[last].tolist(), index[last].tolist(), (pos[last] + 1).tolist())
            self._ahead = self._ahead[:, scan:]
            self._taken += len(has)
            need -= len(has)
        self._cursor = states[-1]
        return (np.concatenate(which), np.concatenate(starts)), states

    def _first_bos(self, region: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Where the window of each slot (region index, first token) starts: at its first bos_id, if a window
        from there fits in the region; -1 where none does."""
        found = np.full(len(slot), -1, dtype=np.int64)
        for rows, tokens in self._read(region, slot):
            hit = tokens == self.bos_id
            first = hit.argmax(axis=1)
            start = slot[rows] + first
            fits = hit[np.arange(len(first)), first] & (start + self.length <= self.ends[region[rows]])
            found[rows] = np.where(fits, start, -1)
        return found

    def read(self, windows: tuple[np.ndarray, np.ndarray], vocab_size: int | None) -> list[Part]:
        """Gather window i (of region which[i], from token starts[i]) as row i, in the files' dtype, for fill(),
        refusing token ids >= vocab_size (None: no check)."""
        which, starts = windows
        parts = list(self._read(which, starts))
        if vocab_size is not None and any(got.max() >= vocab_size for _, got in parts):  # a quarter of the bytes
            _check_vocab([(self.regions[r], s, 1) for r, s in zip(which.tolist(), starts.tolist())],
                         self.length, vocab_size)  # names the first bad token in row order
        return parts

    def fill(self, parts: list[Part], out: np.ndarray) -> None:
        """Cast-copy the windows read() returned into the rows of out."""
        for rows, got in parts:
            out[rows] = got

    def _read(self, which: np.ndarray, starts: np.ndarray) -> Iterator[Part]:
        """(rows, their windows) for the windows (region which[i], from token starts[i]), in the files' dtype: one
        fancy index for all the files (see _Span), or one per span where the files' dtypes differ."""
        # The spans reach memory that is not the files' (see _Span): a start outside its region must raise here,
        # not read other memory. Two comparisons over a group's starts, ~1 us.
        if ((starts < self.starts[which]) | (starts > self.ends[which] - self.length)).any():
            raise RuntimeError(f"loader bug: a planned window lies outside its file (starts {starts[:8]} ...)")
        at = self.offset_of[which] + starts
        if len(self.spans) == 1:
            parts = [(self.spans[0], slice(None))]
        else:
            kind = self.span_of[which]
            parts = [(self.spans[k], np.flatnonzero(kind == k)) for k in np.unique(kind).tolist()]
        for span, rows in parts:
            # The first token of every window, read before the copy: the cache and TLB misses of all the windows
            # then overlap instead of coming one window at a time (a fifth of the gather here).
            span.tokens[at[rows]]
            yield rows, span.windows[at[rows]]

    def read_ahead(self) -> None:
        """Evaluate the order `ahead` slots ahead and hint the new windows' pages (with bos_id: the slots, and
        every rank's, since which hold a window is not known yet); with blocks, read their files ahead."""
        added = self._evaluate(self.ahead)
        if added:  # not in most groups: the order is evaluated a chunk at a time
            self._hint(added)
        if self.sweep:
            self._read_blocks()

    def _hint(self, added: int) -> None:
        """Hint the pages of the last `added` slots evaluated, unless a sample of them is in the page cache."""
        _, _, _, region, start = self._ahead[:, self._ahead.shape[1] - added:]
        if self.bos_id is None:
            counter = self._taken + self._ahead.shape[1] - added + np.arange(added)
            mine = (counter % self.per_step) // self.batch_size == self.rank
            region, start = region[mine], start[mine]
        span = self.length if self.bos_id is None else 2 * self.length
        # No hints when the data is in memory: a madvise costs more than copying the window (0.85 vs 0.6 us here)
        step = max(1, len(region) // HINT_SAMPLE)
        sample = zip(region[::step].tolist(), start[::step].tolist())
        if not all(self.regions[r].cached(s, s + span) for r, s in sample):
            for r, s in zip(region.tolist(), start.tolist()):
                self.regions[r].hint(s, s + span)

    def _read_blocks(self) -> None:
        """Once the order reaches a block, read the files of that block and of the next one ahead, in order."""
        here = self._next[:2]
        todo = [key for key in (here, self._after(*here)) if key not in self._swept]
        if todo:
            self._swept.extend(todo)
            ranges = [(self.regions[f].path, *self.regions[f].byte_range()) for key in todo
                      for f in self._block(*key).files]
            threading.Thread(target=_read_ahead_files, args=(ranges,), daemon=True,
                             name="TokenLoader read-ahead").start()


class _Span:
    """Every window of several memory-mapped files of one dtype as the rows of one read-only view, no copy.

    numpy reads memory by address and strides, so a view that starts at the lowest map and steps one token at
    a time reaches every other map's tokens at a fixed offset: one fancy index gathers a group's windows from
    all the files. One per file costs ~1.5 us a call, as much as copying a 2 KiB window, and with 100 files a
    group holds ~2 windows of each: that was slower than a slice per window (29 vs 50 us a batch here). The
    view spans memory between the maps that is not the files': only windows of the regions, which lie inside
    their maps, are ever indexed (_Shuffled._read checks every start against its region first), and the maps
    it does not hold a reference to are kept alive by the regions of the same stream.
    """

    def __init__(self, arrays: list[np.ndarray], length: int):
        address = [a.ctypes.data for a in arrays]
        low, item = min(address), arrays[0].itemsize
        base = arrays[address.index(low)]
        self.offsets = [(a - low) // item for a in address]  # where each array's token 0 is in the view
        size = (max(a + x.nbytes for a, x in zip(address, arrays)) - low) // item
        self.tokens = np.lib.stride_tricks.as_strided(base, (size,), (item,), writeable=False)
        self.windows = np.lib.stride_tricks.as_strided(base, (max(size - length + 1, 0), length), (item, item),
                                                       writeable=False)


def _spans(regions: list[_Region], length: int) -> tuple[list[_Span], np.ndarray, np.ndarray]:
    """Spans over the regions' files (one, unless their dtypes differ), each region's span and its offset there."""
    kinds: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(regions):  # a span steps whole tokens: same dtype, same address modulo its size
        kinds.setdefault((r.array.dtype.str, r.array.ctypes.data % r.array.itemsize), []).append(i)
    spans, span_of, offset_of = [], np.zeros(len(regions), dtype=np.int64), np.zeros(len(regions), dtype=np.int64)
    for k, members in enumerate(kinds.values()):
        spans.append(_Span([regions[i].array for i in members], length))
        span_of[members], offset_of[members] = k, spans[-1].offsets
    return spans, span_of, offset_of


def _read_ahead_files(ranges: list[tuple[Path, int, int]]) -> None:
    """Ask the kernel to read these byte ranges of files, in order, in large requests (POSIX_FADV_WILLNEED).

    In a thread of its own: the calls return once the reads are queued, seconds for a large file (and
    os.posix_fadvise releases the GIL meanwhile). It is only a hint: errors end it quietly."""
    for path, offset, length in ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                step, end = _readahead_bytes(os.fstat(fd).st_dev), offset + length
                for at in range(offset - offset % mmap.PAGESIZE, end, step):  # whole pages: a step reads `step`
                    os.posix_fadvise(fd, at, min(step, end - at), os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no posix_fadvise on this platform, or the file went away
            return


def _readahead_bytes(device: int) -> int:
    """The most one WILLNEED hint reads on this device: the kernel reads the first read_ahead_kb of a larger
    range only (measured: a 190 MB file hinted whole got 8 MiB in the page cache, this disk's read_ahead_kb)."""
    try:
        kb = int(Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb").read_text())
        return max(mmap.PAGESIZE, kb << 10)
    except (OSError, ValueError):
        return 128 << 10  # Linux's default read_ahead_kb


def _check_fits(regions: list[_Region], length: int) -> None:
    biggest = max(regions, key=_Region.tokens_count)
    if biggest.tokens_count() < length:
        raise ShardError(f"seq_len + 1 = {length} tokens is longer than every file: the largest, {biggest.path}, "
                         f"has {biggest.tokens_count()} usable tokens; lower seq_len or use bigger shards")


def _gather(stretches: list[Stretch], length: int, out: np.ndarray) -> None:
    """Copy the windows into the rows of out [rows, length], one cast-copy per stretch of adjacent windows."""
    row = 0
    for region, start, n in stretches:
        if n == 1:  # the shuffled stream's every window: a third cheaper without the reshape
            out[row] = region.array[start:start + length]
        else:
            out[row:row + n] = region.array[start:start + n * length].reshape(n, length)
        row += n


def _check_vocab(stretches: list[Stretch], length: int, vocab_size: int) -> None:
    # on the source windows: a quarter of the bytes of the int64 copy with uint16 tokens
    for region, start, n in stretches:
        window = region.array[start:start + n * length]
        if window.max() >= vocab_size:
            bad = np.flatnonzero(window >= vocab_size)
            raise ShardError(f"{region.path}: token id {int(window[bad[0]])} at token {start + int(bad[0])} is >= "
                             f"vocab_size {vocab_size}; the data was tokenized with another tokenizer: use its "
                             f"vocabulary (model.vocab_size) or re-tokenize")


def _meta_vouches(paths: list[Path], vocab_size: int) -> bool:
    """True when a meta.json beside every file (data.prepare writes one) promises ids < vocab_size."""
    for folder in {p.parent for p in paths}:
        try:
            declared = read_meta(folder).get("vocab_size")  # None without a meta.json
        except MetaError as e:
            raise ShardError(str(e)) from None
        if not isinstance(declared, int) or declared > vocab_size:
            return False
    return True


def _reads(stream: _Stream | _Shuffled, group: int, vocab_size: int | None) -> Iterator[tuple[list, list]]:
    """The producer's first stage: read this rank's next `group` batches (the first time: one, so start-up
    and resume do not wait for a whole group); yield (what stream.read returned, the state after each batch)."""
    for step in itertools.count():
        windows, states = stream.plan(group if step else 1)
        yield stream.read(windows, vocab_size), states
        stream.read_ahead()


def _fills(reads: Iterator[tuple[list, list]], stream: _Stream | _Shuffled, ring: list[torch.Tensor],
           events: list, batch_size: int) -> Iterator[tuple[Sequence, int | None, list]]:
    """The producer's second stage: cast each group read into the next slot of the ring (the loader's pinned
    staging buffers, reused once `events` say their device copies are done) or, without a ring, into a fresh
    tensor that the caller keeps; yield (the group's batches: the rows to send from a slot, else the caller's
    (inputs, targets) views; the slot or None; the state after each)."""
    for step, (parts, states) in enumerate(reads):
        rows = len(states) * batch_size  # the first group is one batch, not a slot's worth
        if ring:
            slot = step % len(ring)
            events[slot].synchronize()  # the device copies of this slot's previous batches have finished
            out = ring[slot][:rows]
        else:
            slot, out = None, torch.empty((rows, stream.length), dtype=torch.int64)
        stream.fill(parts, out.numpy())
        if ring:
            yield out.split(batch_size), slot, states
        else:  # made here, off the consumer's path; two splits a group cost half of a slice pair a batch
            yield list(zip(out[:, :-1].split(batch_size), out[:, 1:].split(batch_size))), None, states


def _rank_stretches(stream: _Stream, before: int, rows: int, after: int, stretches: list[Stretch]) -> None:
    """Skip the windows of the ranks before this one, append this rank's rows to stretches, skip the ranks after."""
    stream.take(before, [])
    stream.take(rows, stretches)
    stream.take(after, [])


class _Channel:
    """A hand-over of at most `size` items at a time between two threads, made of C-level queue.SimpleQueue
    calls. queue.Queue runs Python code under a Condition in every put and get, and on 2 vCPUs the GIL it holds
    meanwhile kept the other threads from their copies: shuffled/memcpy medians 0.53-0.57 -> 0.55-0.61, three
    runs of 12 rounds side by side."""

    def __init__(self, size: int):
        self._items, self._room = queue.SimpleQueue(), queue.SimpleQueue()
        for _ in range(size):
            self._room.put(None)

    def put(self, item, stop: threading.Event) -> bool:
        """Put `item` once there is room, unless stopped first (a consumer that called close() takes no more)."""
        while not stop.is_set():
            try:
                self._room.get(timeout=0.1)
            except queue.Empty:
                continue
            self._items.put(item)
            return True
        return False

    def get(self, timeout: float | None = None):
        """The next item, waiting at most `timeout` seconds (then queue.Empty), or as long as it takes (None)."""
        item = self._items.get(timeout=timeout)
        self._room.put(None)
        return item


def _pump(items: Iterator, channel: _Channel, stop: threading.Event, cuda_device: int | None) -> None:
    """Background thread: move items into the channel until stopped; an exception is passed on to the next stage."""
    if cuda_device is not None:
        # A new thread starts on GPU 0: without this, its event waits can open a CUDA context there from every
        # rank. Set the consumer's device, as torch's own pin-memory thread does.
        torch.cuda.set_device(cuda_device)
    try:
        for item in items:
            if not channel.put(item, stop):
                return
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
        channel.put(e, stop)


def _drain(channel: _Channel, stop: threading.Event) -> Iterator:
    """The items a _pump thread puts in the channel, until stopped; an exception it passed on is raised here."""
    while not stop.is_set():
        try:
            item = channel.get(timeout=0.1)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):
            raise item
        yield item


class TokenLoader:
    """Infinite iterator of (inputs, targets) int64 [batch_size, seq_len] batches on `device` (see module doc).

    inputs and targets are views of one [batch_size, seq_len + 1] tensor of windows (not contiguous: use
    reshape, not view): one copy per batch instead of two. A batch is the caller's: nothing the loader does
    later changes it. The background threads cast a group of batches at a time, at most `prefetch` batches
    (rounded up to whole groups) ahead: on CPU into a fresh tensor whose views are the batches (a held batch
    keeps its group's tensor alive, at most GROUP_TOKENS tokens); for CUDA into a ring of reused pinned
    buffers, copied from there to the device, an event per buffer guarding its reuse.
    Call close() (or use `with`) when done: it stops the background threads. `wait_s` accumulates the
    seconds __next__ spent waiting for them; `tokens_per_step` counts the target tokens of
    one global batch (all ranks). shuffle=False, or seed=None, gives the sequential stream; shuffle_shards=K
    shuffles within K files at a time (0, or K at least the number of files: all of them at once).
    """

    _threads: list[threading.Thread] = []  # also what close() sees if __init__ failed

    def __init__(self, files, batch_size: int, seq_len: int, *, rank: int = 0, world_size: int = 1,
                 seed: int | None = 0, bos_id: int | None = None, device: str | torch.device = "cpu",
                 fmt: str = "auto", raw_dtype=None, vocab_size: int | None = None, holdout_tokens: int = 0,
                 prefetch: int = 4, shuffle: bool = True, shuffle_shards: int = 0):
        if min(batch_size, seq_len, world_size, prefetch) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size, seq_len, world_size, prefetch >= 1 and 0 <= rank < world_size; got "
                             f"{batch_size=}, {seq_len=}, {world_size=}, {prefetch=}, {rank=}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0 or None, got {seed}")
        if shuffle_shards < 0:
            raise ValueError(f"shuffle_shards must be >= 0 (0: shuffle over all files), got {shuffle_shards}")
        self.files = resolve_files(files)
        regions = _open_regions(self.files, fmt, raw_dtype)
        if holdout_tokens:
            regions = _split_tail(regions, holdout_tokens)[0]
        _check_fits(regions, seq_len + 1)
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.tokens_per_step = world_size * batch_size * seq_len
        self.wait_s = 0.0
        shuffle = shuffle and seed is not None
        self._spec = {"files": [p.name for p in self.files], "seed": seed, "seq_len": seq_len, "bos_id": bos_id,
                      "holdout_tokens": holdout_tokens, "shuffle": shuffle,
                      "shuffle_shards": shuffle_shards if shuffle else 0}
        self._vocab = None if vocab_size is None or _meta_vouches(self.files, vocab_size) else vocab_size
        place = rank, world_size, batch_size
        self._stream = (_Shuffled(regions, seq_len + 1, seed, bos_id, shuffle_shards, *place) if shuffle else
                        _Stream(regions, seq_len + 1, seed, bos_id, *place))
        self._state = self._stream.state()
        # A group of batches per hand-over and per gather, because a hand-over costs a thread wake-up and
        # GIL switches: at B=16, T=1024 the consumer spent 46 us of CPU a batch handed over one by one, 3 us
        # in groups of 16, while the copy itself takes ~16 us. The token cap bounds the (pinned) ring.
        self._group = max(1, min(GROUP_BATCHES, GROUP_TOKENS // (batch_size * (seq_len + 1))))
        self._queued_groups = -(-prefetch // self._group)
        # Pinned staging buffers for CUDA, the loader's own: the caller gets the device copy, so a buffer is
        # reused once its event says that copy is done. Slots: the queued groups + the group being filled + the
        # group the consumer is working through (its current batch included).
        cuda = self.device.type == "cuda"
        self._ring = [torch.empty((self._group * batch_size, seq_len + 1), dtype=torch.int64, pin_memory=True)
                      for _ in range(self._queued_groups + 2)] if cuda else []
        self._events = [torch.cuda.Event() for _ in self._ring]

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._threads:
            self._start()
        if not self._ready:
            t0 = time.perf_counter()
            got = self._queue.get()
            self.wait_s += time.perf_counter() - t0
            if isinstance(got, BaseException):
                self.close()
                raise got
            batches, slot, states = got
            self._ready = collections.deque(zip(batches, itertools.repeat(slot), states))
        batch, slot, self._state = self._ready.popleft()
        if slot is None:
            return batch
        out = batch.to(self.device, non_blocking=True)
        self._events[slot].record()
        return out[:, :-1], out[:, 1:]

    def _start(self) -> None:
        self._stream.seek(self._state)  # the producer restarts at the consumer's position, not its own
        self._queue = _Channel(self._queued_groups)
        self._ready: collections.deque = collections.deque()
        self._stop = threading.Event()
        # Two threads, so that the next group's random reads overlap this group's cast to int64. Shuffled,
        # B=16, T=1024, on 2 vCPUs: reading (plan, gather, hints) takes ~150 us a group of 15 batches and the
        # cast ~105 us when both run; one thread doing both delivered 0.36-0.37 of the memcpy ceiling, two
        # 0.52-0.58 (scripts/bench_loader.py, three runs each, side by side).
        read = _Channel(1)
        fills = _fills(_drain(read, self._stop), self._stream, self._ring, self._events, self.batch_size)
        cuda_device = torch.cuda.current_device() if self._events else None
        self._threads = [threading.Thread(target=_pump, args=args, daemon=True, name=f"TokenLoader {name}")
                         for name, args in (("read", (_reads(self._stream, self._group, self._vocab), read,
                                                       self._stop, None)),
                                            ("fill", (fills, self._queue, self._stop, cuda_device)))]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop the background threads; iterating again restarts them where the consumer stopped."""
        if not self._threads:
            return
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []

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
            had = state.get(key, LEGACY.get(key))
            if had != want:
                shown = plural(len(want), "file") if key == "files" else repr(want)
                raise ValueError(f"loader state: {key} was {str(had)[:200]} but this loader has {shown}; resume "
                                 f"with the same data files, seed, seq_len, bos_id, holdout and shuffle settings")
        self.close()
        self._state = tuple(int(state[k]) for k in CURSOR)


PAD_TARGET = -100  # F.cross_entropy's default ignore_index: the model's loss skips these targets


class ValBatches(Iterator):
    """val_batches' answer: an iterator of this rank's validation batches that says how many it yields (len)."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int):
        self._batches, self._count = batches, count

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self._batches)

    def __len__(self) -> int:
        return self._count


def val_batches(files, batch_size: int, seq_len: int, num_tokens: int, *, rank: int = 0, world_size: int = 1,
                device: str | torch.device = "cpu", fmt: str = "auto", raw_dtype=None, tail_tokens: int = 0,
                vocab_size: int | None = None) -> ValBatches:
    """This rank's fixed validation batches: `num_tokens` targets, every one scored exactly once.

    The stream is the first num_tokens + 1 tokens of the sorted files, read across file ends (with
    tail_tokens=N: the last N tokens of the last file, which TokenLoader(holdout_tokens=N) leaves out, after the
    one token before them). Sequence k takes stream tokens [k*T, (k+1)*T) as inputs and the token after each as
    its target, so the last input of a sequence predicts the first token of the next one and the targets are
    stream tokens 1 .. num_tokens: the NanoGPT speedrun records' accounting. Global batch g holds sequences
    [g*W*B, (g+1)*W*B); rank r takes rows [r*B, (r+1)*B) of it, so the cuts are the same for every world size.
    Every rank yields the same number of batches of one shape [B, T] (FSDP needs the same calls on every rank, a
    compiled model one shape): targets past num_tokens, in a last partial sequence or in rows past the last
    sequence, are PAD_TARGET (inputs 0). Average as sum(loss * n) / sum(n), n = (targets != PAD_TARGET).sum(),
    each summed over batches and all-reduced over ranks; a batch with n = 0 adds nothing (its mean is NaN).
    With vocab_size, token ids >= vocab_size are refused here, before any batch (as TokenLoader refuses them,
    and not where a meta.json vouches for the files): every rank checks the whole stream, so all name the
    same token.
    """
    if min(batch_size, seq_len, world_size, num_tokens) < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size, seq_len, world_size, num_tokens >= 1 and 0 <= rank < world_size; got "
                         f"{batch_size=}, {seq_len=}, {world_size=}, {num_tokens=}, {rank=}")
    regions = _open_regions(resolve_files(files), fmt, raw_dtype)
    if tail_tokens:
        tail = _split_tail(regions, tail_tokens)[1]  # starts after the file's first token
        regions = [_Region(tail.path, tail.tokens, tail.lo - 1, tail.hi)]  # + the input of its first target
    regions = _first_tokens(regions, num_tokens)
    if vocab_size is not None and not _meta_vouches([r.path for r in regions], vocab_size):
        _check_vocab([(r, r.lo, r.tokens_count()) for r in regions], 1, vocab_size)  # ~1 ms per 10M cached
    offsets = np.cumsum([0] + [r.tokens_count() for r in regions])  # where each region starts in the stream
    sequences, per_step = -(-num_tokens // seq_len), world_size * batch_size

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(0, sequences, per_step):
            out = torch.full((batch_size, seq_len + 1), PAD_TARGET, dtype=torch.int64)
            first = step + rank * batch_size
            for row, k in enumerate(range(first, min(first + batch_size, sequences))):
                start = k * seq_len
                _read_stream(regions, offsets, start, min(start + seq_len, num_tokens) + 1, out[row].numpy())
            out = out.to(device, non_blocking=True)  # pageable memory: safe to drop right after
            # A copy of the inputs in every batch, not just where padding needs it: a view in some batches
            # and a copy in others have other strides, and a compiled model would compile each.
            yield out[:, :-1].clamp(min=0), out[:, 1:]

    return ValBatches(batches(), -(-sequences // per_step))


def _read_stream(regions: list[_Region], offsets: np.ndarray, start: int, stop: int, out: np.ndarray) -> None:
    """Copy stream tokens [start, stop) of the regions laid end to end (region i starts at offsets[i]) to out."""
    i = int(np.searchsorted(offsets, start, side="right")) - 1
    while start < stop:
        region, n = regions[i], min(stop, int(offsets[i + 1])) - start
        lo = region.lo + start - int(offsets[i])
        out[:n] = region.array[lo:lo + n]
        out, start, i = out[n:], start + n, i + 1


def _first_tokens(regions: list[_Region], num_tokens: int) -> list[_Region]:
    """The regions cut down to their first num_tokens + 1 tokens in order (num_tokens targets and the input of
    the first); fewer is an error."""
    have, need = sum(r.tokens_count() for r in regions), num_tokens + 1
    if have < need:
        raise ShardError(f"validation data ({_names(regions)}) holds {plural(have, 'token')} in "
                         f"{plural(len(regions), 'file')}, but eval.tokens = {num_tokens} targets need {need} (the "
                         f"first token is only an input); lower eval.tokens to at most {have - 1} or add validation "
                         f"data")
    cut, left = [], need
    for r in regions:
        if left <= 0:
            break
        cut.append(_Region(r.path, r.tokens, r.lo, min(r.hi, r.lo + left)))
        left -= cut[-1].tokens_count()
    return cut
