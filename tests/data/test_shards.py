"""The shard format on real files: round trips, every corruption refused, atomic writes."""
import subprocess
import sys

import numpy as np
import pytest

from data.shards import HEADER_BYTES, ShardError, open_shard, write_shard
from tests.helpers import ROOT


def header(magic: int, version: int, count: int) -> bytes:
    head = np.zeros(256, dtype="<i4")
    head[:3] = magic, version, count
    return head.tobytes()


@pytest.mark.parametrize("dtype,is_header,magic", [
    (np.uint16, True, 20240520), (np.uint32, True, 20240801), (np.uint16, False, None), (np.uint32, False, None)])
def test_round_trip_is_a_read_only_memmap(tmp_path, dtype, is_header, magic):
    hi = np.iinfo(dtype).max
    tokens = np.random.default_rng(1).integers(0, hi, size=1001, endpoint=True).astype(dtype)
    tokens[-1] = hi
    path = tmp_path / "x.bin"
    write_shard(path, tokens, dtype=dtype, header=is_header)
    got = open_shard(path, raw_dtype=None if is_header else dtype)
    assert isinstance(got, np.memmap) and not got.flags.writeable
    assert got.dtype == np.dtype(dtype).newbyteorder("<") and np.array_equal(got, tokens)
    with pytest.raises(ValueError):
        got[0] = 1
    raw = path.read_bytes()
    if is_header:
        assert raw[:12] == np.array([magic, 1 if dtype == np.uint16 else 7, 1001], "<i4").tobytes()
        assert len(raw) == HEADER_BYTES + 1001 * np.dtype(dtype).itemsize
    else:
        assert raw == tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def test_default_dtype_follows_the_largest_id(tmp_path):
    write_shard(tmp_path / "a.bin", [0, 65535])
    write_shard(tmp_path / "b.bin", [0, 65536])
    assert open_shard(tmp_path / "a.bin").dtype == np.uint16
    assert open_shard(tmp_path / "b.bin").dtype == np.uint32
    assert list(open_shard(tmp_path / "b.bin")) == [0, 65536]


def test_raw_files_smaller_than_a_header_and_forced_formats(tmp_path):
    path = tmp_path / "tiny.bin"
    write_shard(path, [7, 8, 9], dtype=np.uint16, header=False)  # 6 bytes
    assert list(open_shard(path, raw_dtype="uint16")) == [7, 8, 9]
    write_shard(path, [5, 6], dtype=np.uint16)
    # fmt="raw" reads even a headered file as raw tokens: the header's int32s become uint16 pairs.
    raw = open_shard(path, raw_dtype=np.uint16, fmt="raw")
    assert len(raw) == HEADER_BYTES // 2 + 2 and list(raw[-2:]) == [5, 6]


GOOD_BODY = np.arange(10, dtype="<u2").tobytes()
CORRUPTIONS = {
    "bad magic": (header(12345, 1, 10) + GOOD_BODY, {"fmt": "header"}, "bad magic 12345"),
    "no magic, no raw dtype": (header(12345, 1, 10) + GOOD_BODY, {}, "no llm.c shard header"),
    "bad version": (header(20240520, 7, 10) + GOOD_BODY, {}, "needs version 1, found version 7"),
    "u32 bad version": (header(20240801, 1, 10) + GOOD_BODY * 2, {}, "needs version 7, found version 1"),
    "truncated": (header(20240520, 1, 10) + GOOD_BODY[:-2], {}, "truncated"),
    "trailing bytes": (header(20240520, 1, 10) + GOOD_BODY + b"\0\0", {}, "trailing bytes"),
    "short header": (header(20240520, 1, 10)[:100], {}, "shorter than the 1024-byte header"),
    "empty": (b"", {"raw_dtype": np.uint16}, "empty file"),
    "odd raw": (b"\1\2\3", {"raw_dtype": np.uint16}, "not a multiple of 2"),
    "raw u32 size": (b"\0" * 6, {"raw_dtype": np.uint32}, "not a multiple of 4"),
    "count 0": (header(20240520, 1, 0), {}, "header says 0 tokens"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_files_are_refused_naming_the_file(tmp_path, case):
    content, kwargs, message = CORRUPTIONS[case]
    path = tmp_path / f"bad_{case.replace(' ', '_')}.bin"
    path.write_bytes(content)
    with pytest.raises(ShardError, match=message) as err:
        open_shard(path, **kwargs)
    assert str(path) in str(err.value)


def test_missing_file_and_bad_inputs(tmp_path):
    with pytest.raises(ShardError, match="no such shard file"):
        open_shard(tmp_path / "nope.bin")
    for tokens, message in [([], "non-empty"), ([[1, 2]], "1-D"), ([1.5], "integers"), ([-1, 2], ">= 0")]:
        with pytest.raises(ShardError, match=message):
            write_shard(tmp_path / "w.bin", np.array(tokens))
    with pytest.raises(ShardError, match="uint16 or uint32"):
        write_shard(tmp_path / "w.bin", [1], dtype=np.int64)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_previous_file_and_no_temp(tmp_path):
    path = tmp_path / "keep.bin"
    write_shard(path, [1, 2, 3])
    before = path.read_bytes()
    with pytest.raises(ShardError, match="does not fit in uint16"):
        write_shard(path, [1, 70000], dtype=np.uint16)
    # A failure in the middle of the write itself: the OS refuses bytes past a file-size limit (EFBIG).
    code = ("import resource, signal, numpy as np; from data.shards import write_shard\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            f"write_shard({str(path)!r}, np.arange(100_000) % 60000)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.bin"]
    assert list(open_shard(path)) == [1, 2, 3]
