"""Token files as regions of memory maps: the tokens [lo, hi) of one shard, where its windows may start, and the
hints that ask the kernel for its pages before they are read."""
from __future__ import annotations

import glob
import mmap
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import numpy.typing as npt

from data.meta import META, MetaError, listed, read_meta, vouches
from data.shards import ShardError, open_shard
from util.plural import plural

Spans = list[tuple[int, int]]  # the [lo, hi) token ranges of one window, in order
BOS_SCAN = 1 << 12  # tokens searched for the next BOS at a time: bounded memory, few calls per document
READ_AHEAD = 128 << 10  # bytes per WILLNEED request: the kernel reads at most read_ahead_kb of one (Linux's default)


def match_files(pattern: str | os.PathLike) -> list[Path]:
    """The files a glob pattern matches, sorted: the one order every reader of a data glob sees."""
    return sorted(Path(p) for p in glob.glob(str(pattern)))


def resolve_files(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A glob pattern or a list of paths -> the sorted list of files; no match is an error."""
    pattern = isinstance(files, (str, os.PathLike))
    found = match_files(files) if pattern else sorted(Path(p) for p in files)
    if not found:
        raise ShardError(f"no file matches {str(files)!r}; check the data path/glob (data.train / data.val)" if pattern
                         else "the list of token files is empty; give at least one shard")
    return found


class Region:
    """Tokens [lo, hi) of one memory-mapped shard."""

    def __init__(self, path: Path, tokens: np.memmap, lo: int = 0, hi: int | None = None):
        self.path, self.tokens, self.lo, self.hi = path, tokens, lo, len(tokens) if hi is None else hi
        self.array = tokens.view(np.ndarray)  # slicing a plain ndarray skips np.memmap's per-slice overhead
        self._mmap = getattr(tokens, "_mmap", None) if hasattr(mmap, "MADV_WILLNEED") else None  # numpy's own
        self._base = tokens.offset % mmap.ALLOCATIONGRANULARITY  # np.memmap maps from the offset rounded down

    def __len__(self) -> int:
        return self.hi - self.lo

    def cut(self, lo: int, hi: int) -> Region:
        """Tokens [lo, hi) of the same file."""
        return Region(self.path, self.tokens, lo, hi)

    def window_start(self, pos: int, length: int, bos_id: int | None, stop: int | None = None) -> int | None:
        """Where the next window at or after `pos` starts (with bos_id: at a bos_id before `stop`), or None if none
        fits before `hi`."""
        start = pos if bos_id is None else self._next_bos(pos, bos_id, stop or self.hi)
        return start if start is not None and start + length <= self.hi else None

    def cut_window(self, pos: int, length: int, bos_id: int, cut: int) -> tuple[Spans, int] | None:
        """The next window of `length` tokens at or after `pos` made of whole documents in order, each starting at
        a bos_id and cut at `cut` tokens (the rest skipped), the last where the window is full: its spans, and where
        the next window is searched from (past the last document's start). None if none fits before `hi`."""
        spans, taken = [], 0
        start = self._next_bos(pos, bos_id, self.hi)
        while start is not None:
            end = min(self.hi, start + min(cut, length - taken))
            after = self._next_bos(start + 1, bos_id, end)  # the next document, if it starts before the cut
            end = end if after is None else after
            spans.append((start, end))
            taken += end - start
            if taken == length:
                return spans, start + 1
            start = self._next_bos(end, bos_id, self.hi) if after is None else after
        return None

    def _next_bos(self, pos: int, bos_id: int, stop: int) -> int | None:
        for at in range(pos, stop, BOS_SCAN):
            found = np.flatnonzero(self.array[at:min(at + BOS_SCAN, stop)] == bos_id)
            if len(found):
                return at + int(found[0])
        return None

    def hint(self, start: int, stop: int) -> None:
        """Ask the kernel to read tokens [start, stop) in the background (MADV_WILLNEED), if it can."""
        if self._mmap is not None:
            size = self.array.itemsize
            begin, end = self._base + start * size, self._base + min(stop, self.hi) * size
            begin -= begin % mmap.PAGESIZE
            self._mmap.madvise(mmap.MADV_WILLNEED, begin, end - begin)


def open_regions(paths: list[Path], fmt: str, raw_dtype: npt.DTypeLike) -> list[Region]:
    """Every file whole, opened (and its header checked) by data.shards; one that the meta.json beside it lists
    must read as the tokens listed there."""
    regions = [Region(p, open_shard(p, raw_dtype=raw_dtype, fmt=fmt)) for p in paths]
    shards = {folder: listed(_meta(folder)) for folder in {p.parent for p in paths}}
    for region in regions:
        want = shards[region.path.parent].get(region.path.name)
        if want is not None and want != len(region.tokens):
            raise ShardError(f"{region.path}: the {META} beside it lists {want:,} tokens, but data.format = {fmt!r} "
                             f"reads {len(region.tokens):,}: its llm.c header is damaged (re-create the shard with "
                             f"data.prepare), or data.format does not read the header data.prepare wrote (\"auto\" "
                             f"and \"header\" do)")
    return regions


def _meta(folder: Path) -> dict:
    """The meta.json in `folder` ({} where there is none); a broken one is a ShardError, as the files' own errors."""
    try:
        return read_meta(folder)
    except MetaError as e:
        raise ShardError(str(e)) from None


def names(regions: list[Region]) -> str:
    """The first few files, for a message."""
    return ", ".join(str(r.path) for r in regions[:3]) + (" ..." if len(regions) > 3 else "")


def split_tail(regions: list[Region], n: int) -> tuple[list[Region], Region]:
    """(regions without the last n tokens of the last file, a region of those n tokens)."""
    last = regions[-1]
    if not 0 < n < len(last):
        raise ShardError(f"{last.path}: the held-out tail (data.val = 'holdout') of eval.tokens = {n} must be "
                         f"between 1 and {len(last) - 1}, leaving training at least one of the last file's "
                         f"{plural(len(last), 'token')}; lower eval.tokens or use a separate validation set")
    cut = last.hi - n
    return regions[:-1] + [last.cut(last.lo, cut)], last.cut(cut, last.hi)


def check_fits(regions: list[Region], length: int) -> None:
    """A window of `length` tokens must fit in some file."""
    biggest = max(regions, key=len)
    if len(biggest) < length:
        raise ShardError(f"seq_len + 1 = {length} tokens is longer than every file: the largest, {biggest.path}, "
                         f"has {plural(len(biggest), 'usable token')}; lower seq_len or use bigger shards")


def no_window(regions: list[Region], length: int, bos_id: int | None) -> ShardError:
    """The error of a BOS-aligned stream whose files hold no window at all."""
    return ShardError(f"no window of {length} tokens starting with bos_id={bos_id} in "
                      f"{plural(len(regions), 'file')} ({names(regions)}); check bos_id (meta.json eot_token) or "
                      f"turn off data.bos_aligned")


def no_batch(regions: list[Region], rows: int) -> ShardError:
    """The error of a cut stream (data.doc_cut) none of whose files gives a whole global batch of `rows` rows."""
    return ShardError(f"{names(regions)}: no file gives a whole global batch of {rows} rows (the rows of a step "
                      f"under data.doc_cut come from one file): lower train.batch_size (x the ranks), use larger "
                      f"shards, or check bos_id (meta.json eot_token) if the files hold no document token")


def read_ahead(regions: list[Region]) -> None:
    """Ask the kernel to read the regions whole, in order (POSIX_FADV_WILLNEED). In a thread of its own: a request
    returns once its reads are queued, which blocks when cold, and releases the GIL."""
    def run() -> None:
        try:  # only hints: an error ends them quietly
            for region in regions:
                with open(region.path, "rb") as f:
                    size, offset = region.array.itemsize, region.tokens.offset
                    end = offset + region.hi * size
                    for at in range(offset + region.lo * size, end, READ_AHEAD):  # the kernel rounds to pages
                        os.posix_fadvise(f.fileno(), at, min(READ_AHEAD, end - at), os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # no posix_fadvise on this platform, or the file went away
            pass
    threading.Thread(target=run, daemon=True, name="TokenLoader read-ahead").start()


def meta_vouches(paths: list[Path], vocab_size: int) -> bool:
    """True when the meta.json beside every file (data.prepare writes one) lists it and promises ids < vocab_size."""
    folders = {p.parent for p in paths}
    return all(vouches(_meta(folder), vocab_size, [p.name for p in paths if p.parent == folder]) for folder in folders)


def check_vocabulary(tokens: np.ndarray, vocab_size: int, path: Path, offset: int) -> None:
    """Refuse the first id >= vocab_size in `tokens`, the file `path`'s from token `offset` on."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        at = int(np.flatnonzero(tokens >= vocab_size)[0])
        raise ShardError(f"{path}: token id {tokens[at]} at token {offset + at} is >= vocab_size {vocab_size}; the "
                         f"data was tokenized with another tokenizer: use its vocabulary (model.vocab_size) or "
                         f"re-tokenize (a headerless file: or it holds another dtype than data.raw_dtype)")
