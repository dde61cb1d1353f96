"""Regions and page hints (data.regions): file ends, a start-up that reads only headers, the windows hinted ahead,
the block read-ahead.

Most tests use tests.data.coded's shards, whose every window maps back to (file, start)."""
import ctypes
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from data.loader import TokenLoader
from data.regions import open_regions
from data.shards import write_shard
from data.streams import Shuffled
from tests.helpers import make_shards
from tests.data.coded import B, T


def test_a_batch_ending_exactly_at_a_page_aligned_end_of_file(tmp_path):
    path = tmp_path / "chunk_0001.bin"
    write_shard(path, np.arange(2048), dtype=np.uint16, header=False)  # 4096 bytes: one page, 16 windows
    with TokenLoader([path], 16, 127, fmt="raw", raw_dtype="uint16", shuffle=False) as loader:
        for _ in range(3):
            x, y = next(loader)
            assert torch.equal(torch.cat([x, y[:, -1:]], dim=1).flatten(), torch.arange(2048))


def test_start_up_does_not_scan_the_data(tmp_path):
    big = tmp_path / "huge.bin"
    with open(big, "wb") as f:
        f.truncate(16 << 30)  # sparse: 8G zero tokens, every one a "BOS" for bos_id=0; scanning all takes >5 s
    t0 = time.perf_counter()
    with TokenLoader([big], 16, 1024, fmt="raw", raw_dtype="uint16", bos_id=0, vocab_size=50257) as loader:
        x, y = next(loader)
    assert time.perf_counter() - t0 < 3.0  # below the scan's 5 s, with room for a busy machine
    assert x.shape == (16, 1024) and int(x.sum()) == 0 and loader.wait_s > 0
    assert loader.tokens_per_step == 16 * 1024


def resident(path: Path, start: int = 0, stop: int | None = None) -> bool:
    """Whether bytes [start, stop) of the file (default: all) are in the page cache: mincore(2) of a new map."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        stop = len(m) if stop is None else stop
        start -= start % mmap.PAGESIZE
        vec = (ctypes.c_ubyte * -(-(stop - start) // mmap.PAGESIZE))()
        view = np.frombuffer(m, dtype=np.uint8)
        assert mincore(view.ctypes.data + start, stop - start, vec) == 0
        del view
        return all(v & 1 for v in vec)


def test_the_windows_of_the_next_batches_are_hinted_ahead(tmp_path):
    """After a batch, the pages of this rank's windows of the next `prefetch` batches come into the page cache
    (MADV_WILLNEED, asynchronous), and most of the files do not (sparse files: nothing is read before)."""
    paths, seq_len, prefetch = [tmp_path / "chunk_0.bin", tmp_path / "chunk_1.bin"], 1023, 3  # a window: a page
    for path in paths:
        with open(path, "wb") as f:
            f.truncate(64 << 20)
    kw = {"fmt": "raw", "raw_dtype": "uint32", "rank": 1, "world_size": 2, "prefetch": prefetch}
    twin = Shuffled(open_regions(paths, "raw", "uint32"), seq_len + 1, 0, None, 0, 1, 2, B)  # reads no token
    coming = [(r, lo) for _ in range(prefetch + 1) for r, [(lo, _)] in twin.next_batch(0)[0]][B:]
    with TokenLoader(paths, B, seq_len, **kw) as loader:
        next(loader)
        deadline = time.time() + 20
        while not all(resident(r.path, 4 * s, 4 * (s + seq_len + 1)) for r, s in coming) and time.time() < deadline:
            time.sleep(0.05)
        assert all(resident(r.path, 4 * s, 4 * (s + seq_len + 1)) for r, s in coming)
    pages = [resident(p, at, at + 4096) for p in paths for at in range(0, 64 << 20, 64 << 10)]
    assert sum(pages) < len(pages) // 4


def test_a_working_set_is_read_ahead_whole_and_the_next_one_too(tmp_path):
    """shuffle_shards=1: once the stream is in a shard, that shard and the next are read into the page cache
    whole, though one request reads at most read_ahead_kb; the third is not."""
    paths = make_shards(tmp_path, [12 << 20] * 3)  # 24 MiB each
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written through atomic_path: clean, so dropped
        os.close(fd)
    assert not any(resident(p) for p in paths)
    with TokenLoader(paths, B, T, shuffle_shards=1) as loader:
        next(loader)
        deadline = time.time() + 20
        while sum(resident(p) for p in paths) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sum(resident(p) for p in paths) == 2
    rest = next(p for p in paths if not resident(p))
    pages = [resident(rest, at, at + 4096) for at in range(4096, (24 << 20) - 4096, 4096)]
    assert sum(pages) < len(pages) // 4
