"""The shuffled order: the files of an epoch in a seeded order, and the slots of a block of files in a keyed
pseudo-random order that is computed, never stored (48M windows as an int64 permutation: 384 MB per rank).

A block's n slots are visited in the order E(0), E(1), ..., E(2^b - 1), the values >= n left out: E is a
bijection of [0, 2^b) (2^b >= max(n, 4)), a 4-round Feistel network keyed by (seed, epoch, block) with
splitmix64 as its round function. Not an affine map a*i + c mod n: its consecutive outputs are a fixed stride
apart, so a batch's windows would lie on a lattice; a keyed Feistel network relates no two outputs.
"""
from __future__ import annotations

import numpy as np

ROUNDS = 4       # Feistel rounds: 4 make a keyed bijection whose outputs look independent
TAG = 0x5EED0D   # in the order's key: SeedSequence([s, e]) == SeedSequence([s, e, 0]), so keep them apart


def file_order(seed: int | None, epoch: int, files: int) -> np.ndarray:
    """The order an epoch visits the files in: shuffled by (seed, epoch), sorted when seed is None."""
    if seed is None:
        return np.arange(files)
    return np.random.default_rng([seed, epoch]).permutation(files)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 arithmetic wraps, as the hash wants)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Feistel:
    """A keyed bijection of [0, 2**bits): an unbalanced Feistel network whose halves swap widths each round."""

    def __init__(self, bits: int, key: list[int]):
        self.widths = bits // 2, bits - bits // 2
        self.keys = np.random.default_rng(key).integers(0, 2**64, size=ROUNDS, dtype=np.uint64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        high, low = self.widths
        left, right = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
        for key in self.keys:  # (L, R) -> (R, L ^ F(R)): invertible whatever F is
            left, right = right, left ^ (_mix(right ^ key) & np.uint64((1 << high) - 1))
            high, low = low, high
        return (left << np.uint64(low)) | right


class Block:
    """Files of one epoch visited together: their slots numbered in file order, and the keyed order of them."""

    def __init__(self, seed: int, epoch: int, index: int, files: np.ndarray, counts: np.ndarray):
        self.files = files
        self.first = np.concatenate([[0], np.cumsum(counts[files])])  # number of the first slot of each file
        self.n = int(self.first[-1])
        bits = max(2, (self.n - 1).bit_length())
        self.size = 1 << bits if self.n else 0  # the positions of the order: [0, size)
        self.order = Feistel(bits, [seed, epoch, index, TAG])

    def slots(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots at positions [begin, end) of the order: (position, file index, slot index in its file)."""
        pos = np.arange(begin, end, dtype=np.uint64)
        slot = self.order(pos)
        keep = slot < self.n  # the values past n are left out: the rest is a permutation of [0, n)
        pos, slot = pos[keep].astype(np.int64), slot[keep].astype(np.int64)
        file = np.searchsorted(self.first, slot, side="right") - 1
        return pos, self.files[file], slot - self.first[file]
