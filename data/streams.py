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

import numpy as np

from data.order import Block, file_order
from data.regions import Region, no_window, read_ahead

ORDER_CHUNK = 1 << 12  # positions of a block's order computed at a time: 0.5 ms, few enough for a first batch

Window = tuple[Region, int]  # a region and the token its window starts at


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
        """This rank's windows of the next global batch, and the cursor after it."""
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
        self.index += 1
        if self.index == len(self.regions):
            self.epoch, self.index = self.epoch + 1, 0
            self.order = file_order(self.seed, self.epoch, len(self.regions))
        self.pos = self.region.lo


class Shuffled:
    """The shuffled stream (see the module doc)."""

    def __init__(self, regions: list[Region], length: int, seed: int, bos_id: int | None, shards: int,
                 rank: int, world_size: int, batch_size: int):
        self.regions, self.length, self.seed, self.bos_id = regions, length, seed, bos_id
        self.rank, self.batch_size, self.per_step = rank, batch_size, world_size * batch_size
        self.shards = shards if 0 < shards < len(regions) else len(regions)  # files per block
        self.counts = np.array([len(r) // length for r in regions], dtype=np.int64)  # slots per file
        self.starts = np.array([r.lo for r in regions], dtype=np.int64)
        self.total = int(self.counts.sum())
        self._blocks: dict[tuple[int, int], Block] = {}
        self._swept: deque = deque(maxlen=4)  # blocks whose files were read ahead
        self.seek((0, 0, 0))

    def seek(self, state: tuple[int, int, int]) -> None:
        """Move the cursor to (epoch, block, position in the block's order)."""
        self._cursor = self._next = tuple(state)  # after the last batch; where the order is computed next
        self._slots: list[tuple[int, int, int, int, int]] = []  # computed: epoch, block, position, file, token
        self._head = self._hinted = 0  # the next slot to take, and the first not hinted yet
        self._dry = 0  # slots in a row without a window (bos_id set)

    def state(self) -> tuple[int, int, int]:
        """The cursor after the last batch taken: (epoch, block, position)."""
        return self._cursor

    def _block(self, epoch: int, index: int) -> Block:
        if (epoch, index) not in self._blocks:
            if len(self._blocks) > 2:  # only the block being taken and the one being computed are in use
                self._blocks.clear()
            files = file_order(self.seed, epoch, len(self.regions))[index * self.shards:(index + 1) * self.shards]
            self._blocks[epoch, index] = Block(self.seed, epoch, index, files, self.counts)
        return self._blocks[epoch, index]

    def _after(self, epoch: int, index: int) -> tuple[int, int]:
        """The block after (epoch, index)."""
        return (epoch, index + 1) if (index + 1) * self.shards < len(self.regions) else (epoch + 1, 0)

    def _compute(self, slots: int) -> None:
        """Compute the order until at least `slots` slots are ahead of the next one to take."""
        if self._head >= ORDER_CHUNK:  # drop the slots taken, now and then: not a list copy per batch
            self._slots, self._hinted, self._head = self._slots[self._head:], max(0, self._hinted - self._head), 0
        while len(self._slots) - self._head < slots:
            epoch, index, begin = self._next
            block = self._block(epoch, index)
            if begin >= block.size:
                self._next = (*self._after(epoch, index), 0)
                continue
            end = min(block.size, begin + ORDER_CHUNK)
            pos, file, slot = block.slots(begin, end)
            self._slots += zip([epoch] * len(pos), [index] * len(pos), pos.tolist(), file.tolist(),
                               (self.starts[file] + slot * self.length).tolist())
            self._next = (epoch, index, end)

    def next_batch(self, ahead: int) -> tuple[list[Window], tuple[int, int, int]]:
        """This rank's windows of the next global batch (the slots up to the per_step-th that holds a window),
        and the cursor after it."""
        self._compute((ahead + 1) * self.per_step)
        mine, taken, first = [], 0, self.rank * self.batch_size
        while taken < self.per_step:
            if self._head == len(self._slots):
                self._compute(1)
            epoch, index, pos, f, start = self._slots[self._head]
            self._head += 1
            start = self._window(self.regions[f], start)
            if start is None:
                self._dry += 1
                if self._dry > self.total:  # a whole epoch's slots without a window
                    raise no_window(self.regions, self.length, self.bos_id)
                continue
            self._dry = 0
            if first <= taken < first + self.batch_size:
                mine.append((self.regions[f], start))
            taken += 1
        self._cursor = epoch, index, pos + 1
        self._hint(ahead)
        return mine, self._cursor

    def _window(self, region: Region, slot: int) -> int | None:
        """Where the window of the slot starting at token `slot` starts, or None if it has none."""
        if self.bos_id is None:
            return slot
        hit = np.flatnonzero(region.array[slot:slot + self.length] == self.bos_id)
        return slot + int(hit[0]) if len(hit) and slot + int(hit[0]) + self.length <= region.hi else None

    def _hint(self, ahead: int) -> None:
        """Hint the pages of the slots up to `ahead` batches on: this rank's windows, or with bos_id every slot
        and the next one (which slots hold whose window is not known yet)."""
        lo, stop = max(self._hinted, self._head), min(len(self._slots), self._head + ahead * self.per_step)
        first, span = self.rank * self.batch_size, self.length * (1 if self.bos_id is None else 2)
        for i in range(lo, stop):  # without bos_id, the slot at _head starts a global batch
            if self.bos_id is None and not first <= (i - self._head) % self.per_step < first + self.batch_size:
                continue
            _, _, _, f, s = self._slots[i]
            self.regions[f].hint(s, s + span)
        self._hinted = max(self._hinted, stop)
        if self.shards < len(self.regions):
            self._read_blocks()

    def _read_blocks(self) -> None:
        """Once the order reaches a block, read the files of that block and of the next one ahead."""
        here = self._next[:2]
        todo = [key for key in (here, self._after(*here)) if key not in self._swept]
        if todo:
            self._swept.extend(todo)
            read_ahead([self.regions[f] for key in todo for f in self._block(*key).files])
