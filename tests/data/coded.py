"""Coded shards for the loader's tests: token j of file f is f * STRIDE + j, so every window a loader yields maps
back to (file, start) and any read across a file end or any overlap shows."""
import json
from pathlib import Path

import numpy as np
import torch

from data.loader import TokenLoader
from data.shards import write_shard
from tests.helpers import ROOT

T = 15            # seq_len
L = T + 1         # tokens per window
B = 2             # batch_size
STRIDE = 10**6
BOS = 2**32 - 1
SIZES = [20 * L + 5, 10, 13 * L + 15, 15 * L]  # 48 windows an epoch; the 10-token file holds none
WINDOWS_PER_EPOCH = 48
RECORDED = json.loads((ROOT / "tests" / "data" / "loader_digests.json").read_text())  # tests/stream_digests.py's digests


def coded_shards(folder: Path, sizes: list[int], *, bos_seed: int | None = None) -> list[np.ndarray]:
    """Write coded shards (with bos_seed: documents of 3 to 3L tokens, each starting with BOS); return them."""
    rng = np.random.default_rng(bos_seed)
    written = []
    for f, n in enumerate(sizes):
        tokens = f * STRIDE + np.arange(n, dtype=np.int64)
        if bos_seed is not None:
            starts = np.cumsum(rng.integers(3, 3 * L, size=n))
            tokens[np.concatenate([[0], starts[starts < n]])] = BOS
        write_shard(folder / f"coded_train_{f:06d}.bin", tokens, dtype=np.uint32)
        written.append(tokens)
    return written


def windows(x: torch.Tensor, y: torch.Tensor) -> list[tuple[int, int]]:
    """(file, start) of each row of a coded batch; asserts the row is one unbroken piece of one file."""
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and torch.equal(x[:, 1:], y[:, :-1])
    found = []
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
        codes = row[row != BOS]
        start = int(codes[0]) - int(np.flatnonzero(row != BOS)[0])
        positions = start + np.flatnonzero(row != BOS)
        assert np.array_equal(codes, positions), f"window {row} is not one contiguous piece of a file"
        assert positions[-1] // STRIDE == start // STRIDE
        found.append((start // STRIDE, start % STRIDE))
    return found


def stream(loader: TokenLoader, steps: int) -> list[list[tuple[int, int]]]:
    """The windows of `steps` batches, per step; closes the loader."""
    with loader:
        return [windows(*next(loader)) for _ in range(steps)]


def interleave(per_rank: list[list[list]]) -> list:
    """Global order: step by step, rank by rank."""
    return [w for step in zip(*per_rank) for part in step for w in part]
