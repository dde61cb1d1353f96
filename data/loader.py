"""TokenLoader: this rank's training batches from memory-mapped shards, deterministic and exactly resumable.
data.streams says which windows a batch holds (each one or more token ranges of a file); the caller's thread
copies them into a fresh tensor.
Construction reads only the file headers.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from util.plural import plural
from data.regions import (Region, Spans, check_fits, check_vocabulary, meta_vouches, open_regions, resolve_files,
                          split_tail)
from data.streams import START, Sequential, Shuffled, Window

T = TypeVar("T")
CURSOR = ("epoch", "index", "pos")  # the stream position, as state_dict() names it (shuffled: index = block)
DEFAULTS = {"doc_cut": 0}  # keys of the stream's definition that a state holds only when set otherwise
NEWER = {"tokens", "ends"}  # keys that states saved before them lack: those states are taken without the check
ENDS = 2048  # tokens at either end of a file whose digest the resume state keeps


def _ends_digest(region: Region) -> str:
    """A short digest of the first and last ENDS tokens of a file's region."""
    tokens = region.array[region.lo:region.hi]
    return hashlib.sha256(tokens[:ENDS].tobytes() + tokens[-ENDS:].tobytes()).hexdigest()[:16]


class TokenLoader:
    """Infinite iterator of (inputs, targets) int64 [batch_size, seq_len] batches on `device`: views of one
    [batch_size, seq_len + 1] tensor of windows (not contiguous: use reshape, not view). `prefetch`: how many
    batches ahead the kernel is asked for pages. `doc_cut` > 0 (with bos_id, shuffle off): each row is documents
    in order, each cut at doc_cut tokens. `max_seq_len`: the longest rows set_seq_len may ask for (shuffle off).
    `wait_s` adds up the seconds __next__ took."""

    def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, seq_len: int, *,
                 rank: int = 0, world_size: int = 1, seed: int | None = 0, bos_id: int | None = None,
                 device: str | torch.device = "cpu", fmt: str = "auto", raw_dtype: npt.DTypeLike = None,
                 vocab_size: int | None = None, holdout_tokens: int = 0, prefetch: int = 4, shuffle: bool = True,
                 shuffle_shards: int = 0, doc_cut: int = 0, max_seq_len: int = 0):
        if min(batch_size, seq_len, world_size, prefetch) < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need batch_size, seq_len, world_size, prefetch >= 1 and 0 <= rank < world_size; got "
                             f"{batch_size=}, {seq_len=}, {world_size=}, {prefetch=}, {rank=}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be >= 0 or None, got {seed}")
        if shuffle_shards < 0:
            raise ValueError(f"shuffle_shards must be >= 0 (0: shuffle over all files), got {shuffle_shards}")
        shuffle = shuffle and seed is not None
        if doc_cut and (doc_cut < 0 or bos_id is None or shuffle):
            raise ValueError(f"doc_cut = {doc_cut} cuts documents inside rows read in order: it needs doc_cut >= 0, "
                             f"a bos_id and shuffle off; got {bos_id=}, {shuffle=}")
        paths = resolve_files(files)
        regions = open_regions(paths, fmt, raw_dtype)
        self._files = regions  # whole, for the digests of their ends (_definition)
        if holdout_tokens:
            regions = split_tail(regions, holdout_tokens)[0]
        if max_seq_len > seq_len and shuffle:
            raise ValueError(f"max_seq_len = {max_seq_len}: rows of other lengths need shuffle off (the shuffled "
                             f"stream's slots have one length)")
        self.longest = max(seq_len, max_seq_len)
        check_fits(regions, self.longest + 1)
        self.shape, self.device, self.prefetch = (batch_size, seq_len + 1), torch.device(device), prefetch
        self.wait_s = 0.0
        self._spec = {"files": [p.name for p in paths], "seed": seed, "seq_len": seq_len, "bos_id": bos_id,
                      "holdout_tokens": holdout_tokens, "shuffle": shuffle,
                      "shuffle_shards": shuffle_shards if shuffle else 0, **({"doc_cut": doc_cut} if doc_cut else {}),
                      # last, each file's token count (and in _definition its ends): shards re-made under the same
                      # names are another stream, said as such where the settings are the same
                      "tokens": [len(r) for r in self._files]}
        self._vocab = None if vocab_size is None or meta_vouches(paths, vocab_size) else vocab_size
        place = rank, world_size, batch_size
        self._stream = (Shuffled(regions, seq_len + 1, seed, bos_id, shuffle_shards, *place) if shuffle else
                        Sequential(regions, seq_len + 1, seed, bos_id, doc_cut, *place))
        self._state = START
        # On CUDA two pinned buffers take turns: one is filled while the device copy of the other runs.
        self._staging = [torch.empty(self.shape, dtype=torch.int64, pin_memory=True)
                         for _ in range(2 * (self.device.type == "cuda"))]
        self._copied = [torch.cuda.Event() for _ in self._staging]  # a never recorded one is done already
        self._turn = 0

    @property
    def tokens_per_step(self) -> int:
        """Target tokens of a global batch."""
        return self._stream.per_step * (self.shape[1] - 1)

    def set_seq_len(self, seq_len: int) -> None:
        """Rows of `seq_len` tokens (at most max_seq_len) from the next batch on, the stream going on from where
        it is."""
        if seq_len + 1 == self.shape[1]:
            return
        if not 0 < seq_len <= self.longest or isinstance(self._stream, Shuffled):
            raise ValueError(f"seq_len = {seq_len}: this loader's rows are 1 to {self.longest} tokens long "
                             f"(max_seq_len), and all {self.shape[1] - 1} long when shuffled")
        self.shape = (self.shape[0], seq_len + 1)
        self._stream.set_length(seq_len + 1, self._state)
        for copied in self._copied:  # the device copies that read the old buffers have run
            copied.synchronize()
        self._staging = [torch.empty(self.shape, dtype=torch.int64, pin_memory=True) for _ in self._staging]

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = self._take(self._copy)
        self.wait_s += time.perf_counter() - t0
        return out[:, :-1], out[:, 1:]

    def next_places(self) -> list[tuple[Path, Spans]]:
        """Where this rank's next batch lies, (file, its token ranges) per row, the stream moved on as __next__
        moves it but no token read: for counting which tokens a stream reads (scripts/data_coverage.py)."""
        return self._take(lambda windows: [(region.path, spans) for region, spans in windows])

    def _take(self, read: Callable[[list[Window]], T]) -> T:
        """read(this rank's windows of the next global batch), the cursor moved past it only if read returns."""
        try:
            windows, state = self._stream.next_batch(self.prefetch)
            out = read(windows)
        except BaseException:
            self._stream.seek(self._state)  # the next call tries the same batch again
            raise
        self._state = state
        return out

    def _copy(self, windows: list[Window]) -> torch.Tensor:
        """The windows as the rows of a new int64 tensor on the device."""
        if self._staging:
            turn = self._turn = 1 - self._turn
            self._copied[turn].synchronize()  # the device copy that last read this buffer has run
            out = self._staging[turn]
        else:
            out = torch.empty(self.shape, dtype=torch.int64)
        rows = out.numpy()
        for row, (region, spans) in zip(rows, windows):
            np.concatenate([region.array[lo:hi] for lo, hi in spans], out=row)
        if self._vocab is not None and rows.max() >= self._vocab:
            for region, spans in windows:  # the first range that holds one names it
                for lo, hi in spans:
                    check_vocabulary(region.array[lo:hi], self._vocab, region.path, lo)
        if not self._staging:
            return out
        moved = out.to(self.device, non_blocking=True)
        self._copied[turn].record(torch.cuda.current_stream(self.device))
        return moved

    def close(self) -> None:
        """Nothing to release (the loader holds no thread); kept so that callers may use `with`."""

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _definition(self) -> dict:
        """What defines the stream: the settings, each file's token count and a digest of its ends (read at the
        first call, so that construction reads only the headers)."""
        if "ends" not in self._spec:
            self._spec["ends"] = [_ends_digest(r) for r in self._files]
        return self._spec

    def state_dict(self) -> dict:
        """Where the next batch comes from, plus what defines the stream (plain Python types only)."""
        return {**self._definition(), **dict(zip(CURSOR, self._state))}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict(): the next batch is the one the saved loader would have yielded."""
        spec = self._definition()
        for key in [*spec, *DEFAULTS.keys() - spec.keys()]:
            had, want = state.get(key, DEFAULTS.get(key)), spec.get(key, DEFAULTS.get(key))
            if had == want or key in NEWER and key not in state:
                continue
            if key in NEWER:
                name, was, now = next(c for c in zip(spec["files"], had, want) if c[1] != c[2])
                held = (f"held {plural(was, 'token')} at the save and holds {now:,} now" if key == "tokens" else
                        "holds other tokens than at the save")
                raise ValueError(f"loader state: {name} {held}: the data files were re-made or changed since; "
                                 f"resume on the data the run trained on, or start a new run")
            shown = plural(len(want), "file") if key == "files" else repr(want)
            raise ValueError(f"loader state: {key} was {str(had)[:200]} but this loader has {shown}; resume "
                             f"with the same data files, seed, seq_len, bos_id, holdout, shuffle and doc_cut "
                             f"settings")
        self._state = tuple(int(state[k]) for k in CURSOR)
        self._stream.seek(self._state)
