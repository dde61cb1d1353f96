"""The validation reader: fixed batches that score every one of `num_tokens` targets exactly once, on any world
size."""
from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

from util.plural import plural
from data.regions import Region, check_vocabulary, meta_vouches, names, open_regions, resolve_files, split_tail
from data.shards import ShardError

PAD_TARGET = -100  # F.cross_entropy's default ignore_index: the model's loss skips these targets


class ValBatches(Iterator):
    """val_batches' answer: an iterator of this rank's validation batches that says how many it yields (len)."""

    def __init__(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int):
        self._batches, self._count = batches, count

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self._batches)

    def __len__(self) -> int:
        return self._count


def val_batches(files: str | Sequence[str | os.PathLike], batch_size: int, seq_len: int, num_tokens: int, *,
                rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu", fmt: str = "auto",
                raw_dtype: npt.DTypeLike = None, tail_tokens: int = 0, vocab_size: int | None = None) -> ValBatches:
    """This rank's fixed validation batches: `num_tokens` targets of the files' first tokens, each scored once
    (docs/DESIGN.md). Every rank yields as many [B, T] batches, as FSDP and a compiled model's one shape need:
    targets past num_tokens are PAD_TARGET. Ids >= vocab_size are refused here, before any batch, unless a
    meta.json vouches for the files; every rank checks the whole stream, so that all name the same token."""
    if min(batch_size, seq_len, world_size, num_tokens) < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need batch_size, seq_len, world_size, num_tokens >= 1 and 0 <= rank < world_size; got "
                         f"{batch_size=}, {seq_len=}, {world_size=}, {num_tokens=}, {rank=}")
    regions = open_regions(resolve_files(files), fmt, raw_dtype)
    if tail_tokens:
        tail = split_tail(regions, tail_tokens)[1]  # starts after the file's first token
        regions = [tail.cut(tail.lo - 1, tail.hi)]  # + the input of its first target
    regions = _first_tokens(regions, num_tokens)
    if vocab_size is not None and not meta_vouches([r.path for r in regions], vocab_size):
        for r in regions:  # a max per region: fast where every id is good
            check_vocabulary(r.array[r.lo:r.hi], vocab_size, r.path, r.lo)
    sequences, per_step = -(-num_tokens // seq_len), world_size * batch_size

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(0, sequences, per_step):
            out = torch.full((batch_size, seq_len + 1), PAD_TARGET, dtype=torch.int64)
            first = step + rank * batch_size
            for row, k in enumerate(range(first, min(first + batch_size, sequences))):
                start = k * seq_len
                _read_stream(regions, start, min(start + seq_len, num_tokens) + 1, out[row].numpy())
            out = out.to(device, non_blocking=True)  # pageable memory: safe to drop right after
            # A copy of the inputs in every batch, not just where padding needs it: a view in some batches
            # and a copy in others have other strides, and a compiled model would compile each.
            yield out[:, :-1].clamp(min=0), out[:, 1:]

    return ValBatches(batches(), -(-sequences // per_step))


def _read_stream(regions: list[Region], start: int, stop: int, out: np.ndarray) -> None:
    """Copy tokens [start, stop) of the regions laid end to end to out."""
    for r in regions:
        lo, hi = max(start, 0), min(stop, len(r))
        if lo < hi:
            out[:hi - lo] = r.array[r.lo + lo:r.lo + hi]
            out = out[hi - lo:]
        start, stop = start - len(r), stop - len(r)


def _first_tokens(regions: list[Region], num_tokens: int) -> list[Region]:
    """The regions cut down to their first num_tokens + 1 tokens in order (num_tokens targets and the input of
    the first); fewer is an error."""
    have, need = sum(len(r) for r in regions), num_tokens + 1
    if have < need:
        raise ShardError(f"validation data ({names(regions)}) holds {plural(have, 'token')} in "
                         f"{plural(len(regions), 'file')}, but eval.tokens = {num_tokens} targets need {need} (the "
                         f"first token is only an input); lower eval.tokens to at most {have - 1} or add validation "
                         f"data")
    cut, left = [], need
    for r in regions:
        if left <= 0:
            break
        cut.append(r.cut(r.lo, min(r.hi, r.lo + left)))
        left -= len(cut[-1])
    return cut

