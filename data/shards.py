"""The on-disk token shard format, shared with llm.c and modded-nanogpt.

A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens:
    header[0] = magic, header[1] = version, header[2] = number of tokens
    20240520 / 1 -> uint16 tokens (GPT-2 and any vocabulary < 65,536)
    20240801 / 7 -> uint32 tokens (llm.c's Llama-3 variant, vocabularies >= 65,536)
Headerless raw token files (the GPU MODE hackathon's `chunk_0001.bin`, 1e9 uint16 each) are read
when the caller names their dtype. Shards are opened as read-only memory maps, never read whole.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from util.atomic import atomic_path

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic -> (version, token dtype)
FORMATS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}
MAGIC_FOR_DTYPE = {np.dtype("<u2"): 20240520, np.dtype("<u4"): 20240801}


class ShardError(ValueError):
    """A token file that is not what its reader expects; the message names the file and the fix."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest shard dtype that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_shard(path: str | os.PathLike, tokens: npt.ArrayLike, *, dtype: npt.DTypeLike = None,
                header: bool = True) -> None:
    """Write `tokens` as one shard (llm.c header unless `header=False`), atomically.

    `dtype` defaults to uint16 when every id fits, else uint32.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0:
        raise ShardError(f"{path}: expected a non-empty 1-D token array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ShardError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ShardError(f"{path}: token ids must be >= 0, found {lo}")
    dtype = np.dtype(dtype).newbyteorder("<") if dtype is not None else dtype_for_vocab(hi + 1)
    if dtype not in MAGIC_FOR_DTYPE:
        raise ShardError(f"{path}: shard dtype must be uint16 or uint32, got {dtype}")
    if hi > np.iinfo(dtype).max:
        raise ShardError(f"{path}: token id {hi} does not fit in {dtype.name}; use dtype=np.uint32")
    with atomic_path(path, size=HEADER_BYTES * header + arr.size * dtype.itemsize) as tmp, open(tmp, "wb") as f:
        if header:
            magic = MAGIC_FOR_DTYPE[dtype]
            head = np.zeros(HEADER_INTS, dtype="<i4")
            head[:3] = magic, FORMATS[magic][0], arr.size
            f.write(head.tobytes())
        f.write(arr.astype(dtype, copy=False).tobytes())


def open_shard(path: str | os.PathLike, *, raw_dtype: npt.DTypeLike = None, fmt: str = "auto") -> np.memmap:
    """Open a shard as a read-only memory map of its tokens (no copy), validating it first.

    fmt="auto": an llm.c header if the file starts with a known magic, else a raw file of
    `raw_dtype` (an error if none is given). fmt="header" or fmt="raw" forces one reading.
    """
    path = Path(path)
    if fmt not in ("auto", "header", "raw"):
        raise ValueError(f"fmt must be 'auto', 'header' or 'raw', got {fmt!r}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: no such shard file") from None
    if size == 0:
        raise ShardError(f"{path}: empty file (0 bytes); expected a token shard — re-create it")
    with open(path, "rb") as f:
        # Zero-padded: a file shorter than the header (a small raw file) still reads as 256 int32.
        head = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype="<i4")
    magic = int(head[0])
    if fmt == "header" or (fmt == "auto" and magic in FORMATS):
        return _open_with_header(path, size, head)
    if raw_dtype is None:
        raise ShardError(
            f"{path}: no llm.c shard header (first int32 is {magic}, expected magic 20240520 or "
            f"20240801); if this is a headerless token file, read it as raw with its dtype "
            f"(config: data.format = \"raw\", data.raw_dtype = \"uint16\")"
        )
    dtype = np.dtype(raw_dtype).newbyteorder("<")
    if size % dtype.itemsize:
        raise ShardError(
            f"{path}: {size} bytes is not a multiple of {dtype.itemsize} ({dtype.name} tokens); "
            f"the file is truncated or not a raw {dtype.name} token file"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(size // dtype.itemsize,))


def _open_with_header(path: Path, size: int, head: np.ndarray) -> np.memmap:
    magic, version, count = (int(x) for x in head[:3])
    if magic not in FORMATS:
        raise ShardError(f"{path}: bad magic {magic}; expected 20240520 (uint16) or 20240801 (uint32)")
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise ShardError(f"{path}: magic {magic} needs version {want_version}, found version {version}")
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header; truncated")
    if count <= 0:
        raise ShardError(f"{path}: header says {count} tokens; expected a positive count (empty shard)")
    expected = HEADER_BYTES + dtype.itemsize * count
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise ShardError(
            f"{path}: {what}: {size} bytes, expected {expected} "
            f"({HEADER_BYTES}-byte header + {count} tokens x {dtype.itemsize} bytes); re-create or re-download it"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
