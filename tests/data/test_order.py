"""The shuffled order (data.order) as the loader uses it: seeded file orders, batches from all over the data, O(1)
memory.

Most tests use tests.data.coded's shards, whose every window maps back to (file, start)."""
import time
import tracemalloc
from pathlib import Path

import numpy as np

from data.loader import TokenLoader
from tests.data.coded import B, L, SIZES, T, WINDOWS_PER_EPOCH, coded_shards, stream


def test_same_seed_same_order_other_seed_other_order(tmp_path):
    coded_shards(tmp_path, SIZES)
    files = str(tmp_path / "*.bin")
    first = stream(TokenLoader(files, B, T, seed=7), 30)
    assert stream(TokenLoader(files, B, T, seed=7), 30) == first
    other = stream(TokenLoader(files, B, T, seed=8), 30)
    assert other != first and sorted(map(tuple, other[:24])) != sorted(map(tuple, first[:24]))


def test_no_seed_keeps_file_order_and_seeds_differ(tmp_path):
    coded_shards(tmp_path, SIZES)
    files = str(tmp_path / "*.bin")
    ordered = [w for s in stream(TokenLoader(files, B, T, seed=None), 48) for w in s]
    assert ordered[:20] == [(0, k * L) for k in range(20)] and ordered[20] == (2, 0)
    assert ordered[:WINDOWS_PER_EPOCH] == ordered[WINDOWS_PER_EPOCH:]
    assert stream(TokenLoader(files, B, T, seed=1), 24) != stream(TokenLoader(files, B, T, seed=2), 24)


def test_a_global_batch_comes_from_all_over_the_data(tmp_path):
    """With tokens whose value is their position, the windows of one global batch come from many distinct
    8K-token regions, and within a few steps from every shard; the sequential stream reads one region."""
    coded_shards(tmp_path, [200_000] * 6)  # 146 regions of 8,192 tokens
    files, world, batch, seq_len, steps = str(tmp_path / "*.bin"), 4, 4, 63, 6

    def global_batches(shuffle: bool) -> list[list[tuple[int, int]]]:
        per_rank = [stream(TokenLoader(files, batch, seq_len, rank=r, world_size=world, shuffle=shuffle), steps)
                    for r in range(world)]
        return [[w for part in step for w in part] for step in zip(*per_rank)]

    def regions(batch_windows: list[tuple[int, int]]) -> int:
        return len({(f, start // 8192) for f, start in batch_windows})
    shuffled, sequential = global_batches(True), global_batches(False)
    assert np.mean([regions(b) for b in shuffled]) >= 0.8 * world * batch  # 16 windows: ~15 regions
    assert {f for b in shuffled[:3] for f, _ in b} == set(range(6))
    assert np.mean([regions(b) for b in sequential]) <= 1.5 and len({f for b in sequential for f, _ in b}) == 1


def test_memory_does_not_grow_with_the_number_of_windows(tmp_path):
    """The shuffled order over 48M windows (the hackathon's 49 x 1e9 tokens, as sparse files) allocates no
    more than over 191K: an int64 permutation of them would be 384 MB. And the first batch comes at once. (The
    smaller set still spans several chunks of the order's evaluation, so that both peaks hold a whole one.)"""
    def traced_peak(folder: Path, tokens: int) -> tuple[int, float]:
        folder.mkdir()
        for i in range(49):
            with open(folder / f"chunk_{i:04d}.bin", "wb") as f:
                f.truncate(2 * tokens)
        tracemalloc.start()
        t0 = time.perf_counter()
        with TokenLoader(str(folder / "*.bin"), 8, 1023, fmt="raw", raw_dtype="uint16") as loader:
            next(loader)
            first = time.perf_counter() - t0
            for _ in range(200):
                next(loader)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak, first
    small, _ = traced_peak(tmp_path / "small", 4 * 10**6)
    big, first = traced_peak(tmp_path / "big", 10**9)
    assert big < small + (256 << 10), (small, big)
    assert first < 3.0  # the first batch at once, with room for a busy machine
