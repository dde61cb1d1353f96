"""The window streams: which windows of L = seq_len + 1 tokens, each inside one file, each global batch holds.
A global batch is the next world_size * batch_size windows, rank r's the r-th batch_size of them; the cursor
after it is the same on every rank, so a run may resume with another world size or batch size.

Sequential: each epoch walks the files (data.order.file_order) front to back; a window starts where the last
ended or, with bos_id, at the next bos_id from there. Cursor: (epoch, file index, position).

Shuffled: slot k of a file is tokens [kL, (k+1)L). An epoch's files are taken shuffle_shards at a time (0: all)
and a block's slots visited in data.order's keyed order. With bos_id a slot's window starts at its first
bos_id and may run into the next slot; a slot without one, or whose window passes the file's end, is skipped
(every rank looks at every slot, to know where the others' windows are). Blocks smaller than the data are read
ahead whole, this one and the next: on a network filesystem each random page costs a round trip.
Cursor: (epoch, block, position in the block's order).
"""
from __future__ import annotations

from collections import deque
from itertools import pairwise, repeat
from typing import Iterator

import numpy as np

from data.order import Block, file_order
from data.regions import Region, no_window, read_ahead

ORDER_CHUNK = 1 << 12  # positions of a block's order computed at a time: 0.5 ms, few enough for a first batch

Window = tuple[Region, int]  # a region and the token its window starts at
Slot = tuple[int, int, int, int, int]  # epoch, block, position in the block's order, file, its first token


class Sequential:
    """The sequential stream (see the module doc)."""

    def __init__(self, regions: list[Region], length: int, seed: int | None, bos_id: int | None,
                 rank: int, world_size: int, batch_size: int):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self._windowless: set[int] = set()  # files found to hold no window at all (e.g. no BOS token)
        self.seek((0, 0, None))

    def seek(self, state: tuple[int, int, int | None]) -> None:
        """Move the cursor to (epoch, file index in the epoch's order, position; None: the file's start)."""
        self.epoch, self.index, pos = state
        self.order = file_order(self.seed, self.epoch, len(self.regions))
        self.pos = self.region.lo if pos is None else pos

    def state(self) -> tuple[int, int, int]:
        """The cursor (epoch, index, pos)."""
        return self.epoch, self.index, self.pos

    @property
    def region(self) -> Region:
        return self.regions[self.order[self.index]]

    def next_batch(self, ahead: int) -> tuple[list[Window], tuple[int, int, int]]:
        """This rank's windows of the next global batch, and the cursor after it (the kernel's own read-ahead
        serves a sequential read: `ahead` is not needed)."""
        mine: list[Window] = []
        self._take(self.rank * self.batch_size, None)
        self._take(self.batch_size, mine)
        self._take((self.world_size - self.rank - 1) * self.batch_size, None)
        return mine, self.state()

    def _take(self, count: int, out: list[Window] | None) -> None:
        """Advance by `count` windows, appending them to `out` (None: skip them)."""
        while count > 0:
            region = self.region
            start = region.window_start(self.pos, self.length, self.bos_id)
            if start is None:
                self._next_region()
                continue
            n = 1 if self.bos_id is not None else min(count, (region.hi - start) // self.length)
            if out is not None:
                out.extend((region, start + i * self.length) for i in range(n))
            self.pos, count = start + n * self.length, count - n

    def _next_region(self) -> None:
        if self.pos == self.region.lo:  # not a single window in this file, now or in any later epoch
            self._windowless.add(int(self.order[self.index]))
        if len(self._windowless) == len(self.regions):
            raise no_window(self.regions, self.length, self.bos_id)
        last = self.index + 1 == len(self.regions)
        self.seek((self.epoch + last, 0 if last else self.index + 1, None))


class Shuffled:
    """The shuffled stream (see the module doc)."""

    def __init__(self, regions: list[Region], length: int, seed: int, bos_id: int | None, shards: int,
                 rank: int, world_size: int, batch_size: int):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.first, self.batch_size, self.per_step = rank * batch_size, batch_size, world_size * batch_size
        self.shards = shards if 0 < shards < len(regions) else len(regions)  # files per block
        self.counts = np.array([len(r) // length for r in regions], dtype=np.int64)  # slots per file
        self.starts = np.array([r.lo for r in regions], dtype=np.int64)
        self.total = int(self.counts.sum())
        self.seek((0, 0, 0))

    def seek(self, state: tuple[int, int, int]) -> None:
        """Move the cursor to (epoch, block, position in the block's order)."""
        self._cursor = tuple(state)
        self._order = self._slots(*state)
        self._ahead: deque[Slot] = deque()  # slots computed, and their pages hinted, but not taken yet
        self._dry = 0  # slots in a row without a window (bos_id set)

    def state(self) -> tuple[int, int, int]:
        """The cursor after the last batch taken: (epoch, block, position)."""
        return self._cursor

    def _blocks(self, epoch: int, index: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """The blocks from (epoch, index) on: (epoch, index, its files)."""
        while True:
            files = file_order(self.seed, epoch, len(self.regions))
            for i in range(index, -(-len(files) // self.shards)):
                yield epoch, i, files[i * self.shards:(i + 1) * self.shards]
            epoch, index = epoch + 1, 0

    def _slots(self, epoch: int, index: int, begin: int) -> Iterator[Slot]:
        """The slots from a cursor on, the order computed ORDER_CHUNK positions at a time."""
        for i, ((epoch, index, files), (_, _, after)) in enumerate(pairwise(self._blocks(epoch, index))):
            if self.shards < len(self.regions):  # this block is read ahead already, unless it is the first
                read_ahead([self.regions[f] for f in (after if i else np.concatenate([files, after]))])
            block = Block(self.seed, epoch, index, files, self.counts)
            for lo in range(begin, block.size, ORDER_CHUNK):
                pos, file, slot = block.slots(lo, min(block.size, lo + ORDER_CHUNK))
                starts = self.starts[file] + slot * self.length
                yield from zip(repeat(epoch), repeat(index), pos.tolist(), file.tolist(), starts.tolist())
            begin = 0

    def next_batch(self, ahead: int) -> tuple[list[Window], tuple[int, int, int]]:
        """This rank's windows of the next global batch (the slots up to the per_step-th that holds a window),
        and the cursor after it; then the pages of the slots of the next `ahead` batches are hinted."""
        mine, taken = [], 0
        while taken < self.per_step:
            epoch, index, pos, f, start = self._ahead.popleft() if self._ahead else next(self._order)
            start = self.regions[f].window_start(start, self.length, self.bos_id, start + self.length)
            if start is None:
                self._dry += 1
                if self._dry > self.total:  # a whole epoch's slots without a window
                    raise no_window(self.regions, self.length, self.bos_id)
                continue
            self._dry = 0
            if self.first <= taken < self.first + self.batch_size:
                mine.append((self.regions[f], start))
            taken += 1
        self._cursor = epoch, index, pos + 1
        while len(self._ahead) < ahead * self.per_step:
            self._hint(len(self._ahead) % self.per_step, next(self._order))
        return mine, self._cursor

    def _hint(self, place: int, slot: Slot) -> None:
        """Hint the pages of a slot `place` slots into its batch and queue it. Without bos_id a slot is a window:
        only this rank's are hinted; with bos_id whose window a slot holds is not known yet: every slot is hinted,
        and the next one, which its window may run into."""
        _, _, _, f, start = slot
        if self.bos_id is not None:
            self.regions[f].hint(start, start + 2 * self.length)
        elif self.first <= place < self.first + self.batch_size:
            self.regions[f].hint(start, start + self.length)
        self._ahead.append(slot)
