"""TokenLoader: this rank's training batches from memory-mapped shards, deterministic and exactly resumable.

data.streams says which windows a batch holds; the caller's thread copies them into a fresh int64 tensor of
windows (inputs = window[:-1], targets = window[1:]). On CUDA the rows go through one of two pinned buffers,
each reused once its last copy to the device has run. Construction reads only the file headers.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch

from data.regions import check_fits, meta_vouches, open_regions, out_of_vocabulary, resolve_files, split_tail
from data.shards import ShardError
from data.streams import Sequential, Shuffled, Window
from data.plural import plural

CURSOR = ("epoch", "index", "pos")  # the stream position, as state_dict() names it (shuffled: index = block)


class TokenLoader:
    """Infinite iterator of (inputs, targets) int64 [batch_size, seq_len] batches on `device`.

    inputs and targets are views of one [batch_size, seq_len + 1] tensor of windows (not contiguous: use
    reshape, not view). shuffle=False, or seed=None, gives the sequential stream; shuffle_shards=K shuffles
    within K files at a time (0, or K at least the number of files: all of them at once). `prefetch`: how many
    batches ahead the kernel is asked for pages. `wait_s` accumulates the seconds __next__ took;
    `tokens_per_step` counts the target tokens of one global batch (all ranks).
    """

    def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, seq_len: int, *,
                 rank: int = 0, world_size: int = 1, seed: int | None = 0, bos_id: int | None = None,
                 device: str | torch.device = "cpu", fmt: str = "auto", raw_dtype=None, vocab_size: int | None = None,
                 holdout_tokens: int = 0, prefetch: int = 4, shuffle: bool = True, shuffle_shards: int = 0):
        if min(batch_size, seq_len, world_size, prefetch) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size, seq_len, world_size, prefetch >= 1 and 0 <= rank < world_size; got "
                             f"{batch_size=}, {seq_len=}, {world_size=}, {prefetch=}, {rank=}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0 or None, got {seed}")
        if shuffle_shards < 0:
            raise ValueError(f"shuffle_shards must be >= 0 (0: shuffle over all files), got {shuffle_shards}")
        self.files = resolve_files(files)
        regions = open_regions(self.files, fmt, raw_dtype)
        if holdout_tokens:
            regions = split_tail(regions, holdout_tokens)[0]
        check_fits(regions, seq_len + 1)
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device, self.prefetch = torch.device(device), prefetch
        self.tokens_per_step = world_size * batch_size * seq_len
        self.wait_s = 0.0
        shuffle = shuffle and seed is not None
        self._spec = {"files": [p.name for p in self.files], "seed": seed, "seq_len": seq_len, "bos_id": bos_id,
                      "holdout_tokens": holdout_tokens, "shuffle": shuffle,
                      "shuffle_shards": shuffle_shards if shuffle else 0}
        self._vocab = None if vocab_size is None or meta_vouches(self.files, vocab_size) else vocab_size
        place = rank, world_size, batch_size
        self._stream = (Shuffled(regions, seq_len + 1, seed, bos_id, shuffle_shards, *place) if shuffle else
                        Sequential(regions, seq_len + 1, seed, bos_id, *place))
        self._state = self._stream.state()
        # Two pinned buffers, so that one batch is copied while the device copy of the previous one runs.
        cuda = self.device.type == "cuda"
        self._staging = [torch.empty((batch_size, seq_len + 1), dtype=torch.int64, pin_memory=True)
                         for _ in range(2 * cuda)]
        self._copied = [torch.cuda.Event() for _ in self._staging]  # a never recorded one is done already
        self._turn = 0

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            windows, state = self._stream.next_batch(self.prefetch)
            out = self._copy(windows)
        except BaseException:
            self._stream.seek(self._state)  # the next call tries the same batch again
            raise
        self._state = state
        self.wait_s += time.perf_counter() - t0
        return out[:, :-1], out[:, 1:]

    def _copy(self, windows: list[Window]) -> torch.Tensor:
        """The windows as the rows of a new int64 tensor on the device."""
        if self._staging:
            turn = self._turn = 1 - self._turn
            self._copied[turn].synchronize()  # the device copy that last read this buffer has run
            out = self._staging[turn]
        else:
            out = torch.empty((self.batch_size, self.seq_len + 1), dtype=torch.int64)
        rows = out.numpy()
        for row, (region, start) in zip(rows, windows):
            row[:] = region.array[start:start + self.seq_len + 1]
        if self._vocab is not None and rows.max() >= self._vocab:
            raise _out_of_vocabulary(windows, rows, self._vocab)
        if not self._staging:
            return out
        moved = out.to(self.device, non_blocking=True)
        self._copied[turn].record(torch.cuda.current_stream(self.device))
        return moved

    def close(self) -> None:
        """Nothing to release: the loader holds no thread; kept so that callers may use `with`."""

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        """Where the next batch comes from, plus what defines the stream (plain Python types only)."""
        return {**self._spec, **dict(zip(CURSOR, self._state))}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): the next batch is the one the saved loader would have yielded."""
        for key, want in self._spec.items():
            had = state.get(key)
            if had != want:
                shown = plural(len(want), "file") if key == "files" else repr(want)
                raise ValueError(f"loader state: {key} was {str(had)[:200]} but this loader has {shown}; resume "
                                 f"with the same data files, seed, seq_len, bos_id, holdout and shuffle settings")
        self._state = tuple(int(state[k]) for k in CURSOR)
        self._stream.seek(self._state)


def _out_of_vocabulary(windows: list[Window], rows: np.ndarray, vocab_size: int) -> ShardError:
    """The error naming the first token id >= vocab_size, in row order: its file and position."""
    row, at = divmod(int(np.flatnonzero(rows >= vocab_size)[0]), rows.shape[1])
    region, start = windows[row]
    return out_of_vocabulary(region.path, int(rows[row, at]), start + at, vocab_size)
