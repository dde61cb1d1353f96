"""The matrices a Muon parameter fuses along its rows: its param group's `split`.

`split` is an int k, k equal row blocks (the qkv weight at 3: Q, K and V), or a tuple of row counts, one per
matrix in row order (optim.muon_qk_pairs: each pair of adjacent heads of Q and of K, [2 * head_dim, d], then V
whole). Muon orthogonalises each matrix on its own and NorMuon keeps each one's second moment; matrices of one
size in a row form a Block, a [count, rows, cols] stack that goes through Newton-Schulz in one batch.
"""
from __future__ import annotations

from itertools import groupby
from typing import NamedTuple, Sequence

Split = int | tuple[int, ...]  # what a param group's `split` holds


class Block(NamedTuple):
    """`count` matrices of `rows` rows each, from row `start` of their parameter on."""
    start: int
    count: int
    rows: int

    @property
    def stop(self) -> int:
        """The row after the block's last."""
        return self.start + self.count * self.rows


def view_rows(shape: Sequence[int], split: int | Sequence[int]) -> tuple[int, ...]:
    """The row count of each matrix of a parameter of `shape` under `split`; ValueError if they are not its rows."""
    rows = shape[0]
    if isinstance(split, int):
        if split < 1 or rows % split:
            raise ValueError(f"Muon split={split} must divide the rows of the parameter of shape {tuple(shape)} "
                             f"into equal matrices; use a divisor of {rows}")
        return (rows // split,) * split
    if not split or min(split) < 1 or sum(split) != rows:
        raise ValueError(f"Muon split={tuple(split)} must be positive row counts adding up to the {rows} rows of "
                         f"the parameter of shape {tuple(shape)}")
    return tuple(split)


def blocks(shape: Sequence[int], split: int | Sequence[int]) -> list[Block]:
    """The Blocks of a parameter of `shape` under `split`, in row order."""
    out, start = [], 0
    for rows, run in groupby(view_rows(shape, split)):
        out.append(Block(start, len(list(run)), rows))
        start = out[-1].stop
    return out
