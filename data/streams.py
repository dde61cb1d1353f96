"""The window streams: which windows of L = seq_len + 1 tokens, each inside one file, each global batch holds.
A global batch is the next world_size * batch_size windows, rank r's the r-th batch_size of them; the cursor
after it is the same on every rank, so a run may resume with another world size or batch size.

Sequential: each epoch walks the files (data.order.file_order) front to back; a window starts where the last
ended or, with bos_id, at the next bos_id from there. With a cut as well, a window is documents in order, each cut
at `cut` tokens, the next window starting at the document after its last (Region.cut_window), and a global batch
comes from one file, whose last batch is skipped if it cannot give it whole: record 46's rows, which then depend on
world_size * batch_size at the files' ends. Cursor: (epoch, file index, position), a place in a file whatever
the windows' length: the length may change between batches (set_length).

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
from data.regions import Region, Spans, no_batch, no_window, read_ahead

ORDER_CHUNK = 1 << 12  # positions of a block's order computed at a time: few enough that a first batch is quick

Window = tuple[Region, Spans]  # a region and the token ranges its window reads
Cursor = tuple[int, int, int]
START: Cursor = (0, 0, 0)  # where a stream starts: its files' windows start at token 0 (a holdout cuts an end)
Slot = tuple[int, int, int, int, int]  # epoch, block, position in the block's order, file, its first token


class Stream:
    """What both streams share: a global batch is the next per_step windows of windows(*cursor), a subclass's
    generator of every window from a cursor on, each with the cursor after it; rank r's are its r-th batch_size."""

    def __init__(self, regions: list[Region], length: int, seed: int | None, bos_id: int | None,
                 rank: int, world_size: int, batch_size: int):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.first, self.batch_size, self.per_step = rank * batch_size, batch_size, world_size * batch_size
        self.seek(START)

    def seek(self, cursor: Cursor) -> None:
        """Move to START or to a cursor that next_batch returned."""
        self._windows = self.windows(*cursor)

    def next_batch(self, ahead: int) -> tuple[list[Window], Cursor]:
        """This rank's windows of the next global batch, and the cursor after it (`ahead`: how many batches on
        a stream that hints pages hints them)."""
        mine = []
        for i in range(self.per_step):
            cursor, window = next(self._windows)
            if self.first <= i < self.first + self.batch_size:
                mine.append(window)
        return mine, cursor


class Sequential(Stream):
    """The sequential stream (see the module doc). No hints: the kernel's own read-ahead serves it."""

    def __init__(self, regions: list[Region], length: int, seed: int | None, bos_id: int | None, cut: int,
                 rank: int, world_size: int, batch_size: int):
        self.cut = cut
        super().__init__(regions, length, seed, bos_id, rank, world_size, batch_size)

    def set_length(self, length: int, cursor: Cursor) -> None:
        """Windows of `length` tokens from `cursor` on: a place in a file, whatever the windows' length."""
        self.length = length
        self.seek(cursor)

    def window(self, region: Region, pos: int) -> tuple[Spans, int] | None:
        """The next window of `region` at or after `pos`, and where the one after it is searched from."""
        if self.cut:
            return region.cut_window(pos, self.length, self.bos_id, self.cut)
        start = region.window_start(pos, self.length, self.bos_id)
        return None if start is None else ([(start, start + self.length)], start + self.length)

    def taken(self, region: Region, pos: int) -> list[tuple[Spans, int]]:
        """The windows of `region` from `pos` that the stream takes together: the next one; with a cut, the next
        global batch's, all of them or none (a file's last batch that it cannot give whole is skipped, as record
        46's loader skips it)."""
        found = []
        for _ in range(self.per_step if self.cut else 1):
            window = self.window(region, found[-1][1] if found else pos)
            if window is None:
                return []
            found.append(window)
        return found

    def windows(self, epoch: int, index: int, pos: int | None) -> Iterator[tuple[Cursor, Window]]:
        windowless = set()  # files found to hold no window at all (e.g. no BOS token)
        while True:
            order = file_order(self.seed, epoch, len(self.regions))
            for index in range(index, len(order)):
                region = self.regions[order[index]]
                pos = region.lo if pos is None else pos
                while found := self.taken(region, pos):
                    for spans, pos in found:
                        yield (epoch, index, pos), (region, spans)
                if pos == region.lo:  # not a window in this file, now or in any later epoch
                    windowless.add(int(order[index]))
                    if len(windowless) == len(self.regions):
                        raise no_batch(self.regions, self.per_step) if self.cut else no_window(
                            self.regions, self.length, self.bos_id)
                pos = None
            epoch, index = epoch + 1, 0


class Shuffled(Stream):
    """The shuffled stream (see the module doc)."""

    def __init__(self, regions: list[Region], length: int, seed: int, bos_id: int | None, shards: int,
                 rank: int, world_size: int, batch_size: int):
        self.shards = shards if 0 < shards < len(regions) else len(regions)  # files per block
        self.counts = np.array([len(r) // length for r in regions], dtype=np.int64)  # slots per file
        self.starts = np.array([r.lo for r in regions], dtype=np.int64)
        self.span = length * (1 if bos_id is None else 2)  # tokens hinted per slot (see next_batch)
        super().__init__(regions, length, seed, bos_id, rank, world_size, batch_size)

    def seek(self, cursor: Cursor) -> None:
        self._slots = self.slots(*cursor)
        self._ahead: deque[Slot] = deque()  # slots computed, and their pages hinted, but not taken yet
        super().seek(cursor)

    def blocks(self, epoch: int, index: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """The blocks from (epoch, index) on: (epoch, index, its files), read ahead whole as they are made when
        smaller than the data."""
        while True:
            order = file_order(self.seed, epoch, len(self.regions))
            for i in range(index, -(-len(order) // self.shards)):
                files = order[i * self.shards:(i + 1) * self.shards]
                if self.shards < len(self.regions):
                    read_ahead([self.regions[f] for f in files])
                yield epoch, i, files
            epoch, index = epoch + 1, 0

    def slots(self, epoch: int, index: int, begin: int) -> Iterator[Slot]:
        """The slots from a cursor on, the order computed ORDER_CHUNK positions at a time (pairwise makes the
        next block, and so starts its read-ahead, as this one starts)."""
        for (epoch, index, files), _ in pairwise(self.blocks(epoch, index)):
            block = Block(self.seed, epoch, index, files, self.counts)
            for lo in range(begin, block.size, ORDER_CHUNK):
                pos, file, slot = block.slots(lo, min(block.size, lo + ORDER_CHUNK))
                starts = self.starts[file] + slot * self.length
                yield from zip(repeat(epoch), repeat(index), pos.tolist(), file.tolist(), starts.tolist())
            begin = 0

    def windows(self, *cursor: int) -> Iterator[tuple[Cursor, Window]]:
        """The windows of the slots that seek started at the cursor, each with the cursor after it."""
        dry, total = 0, int(self.counts.sum())  # slots in a row without a window (bos_id set), slots an epoch
        while True:
            epoch, index, pos, f, start = self._ahead.popleft() if self._ahead else next(self._slots)
            start = self.regions[f].window_start(start, self.length, self.bos_id, start + self.length)
            if start is not None:
                dry = 0
                yield (epoch, index, pos + 1), (self.regions[f], [(start, start + self.length)])
                continue
            dry += 1
            if dry > total:  # a whole epoch's slots without a window
                raise no_window(self.regions, self.length, self.bos_id)

    def next_batch(self, ahead: int) -> tuple[list[Window], Cursor]:
        batch = super().next_batch(ahead)
        # Hint the slots of the next `ahead` batches. Without bos_id a slot is a window, its place in the queue its
        # place in a batch: hint this rank's. With bos_id whose window a slot holds is not known yet: hint every
        # slot, and the next one, which its window may run into.
        while len(self._ahead) < ahead * self.per_step:
            _, _, _, f, start = slot = next(self._slots)
            if self.bos_id is not None or self.first <= len(self._ahead) % self.per_step < self.first + self.batch_size:
                self.regions[f].hint(start, start + self.span)
            self._ahead.append(slot)
        return batch
