"""TokenLoader and val_batches on real shard files: exact token accounting, BOS alignment, resume, errors.

Most tests use "coded" uint32 shards whose token j of file f is f * STRIDE + j, so every window a loader
yields maps back to (file, start) and any read across a file end or any overlap shows.
"""
import ctypes
import json
import mmap
import os
import re
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import data.regions
from data.loader import TokenLoader
from data.val import PAD_TARGET, val_batches
from data.shards import ShardError, write_shard
from tests import stream_digests
from tests.helpers import ROOT, make_shards, run, torchrun

T = 15            # seq_len
L = T + 1         # tokens per window
B = 2             # batch_size
STRIDE = 10**6
BOS = 2**32 - 1
SIZES = [20 * L + 5, 10, 13 * L + 15, 15 * L]  # 48 windows an epoch; the 10-token file holds none
WINDOWS_PER_EPOCH = 48


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


@pytest.mark.parametrize("shuffle,shards", [(False, 0), (True, 0), (True, 2)])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_split_every_epoch_exactly(tmp_path, world, shuffle, shards):
    coded_shards(tmp_path, SIZES)
    steps = 3 * WINDOWS_PER_EPOCH // (world * B)
    kw = {"seed": 3, "shuffle": shuffle, "shuffle_shards": shards}
    per_rank = [stream(TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, **kw), steps)
                for r in range(world)]
    got = interleave(per_rank)
    every = sorted((f, k * L) for f, n in enumerate(SIZES) for k in range(n // L))
    epochs = [got[e * WINDOWS_PER_EPOCH:(e + 1) * WINDOWS_PER_EPOCH] for e in range(3)]
    assert all(sorted(epoch) == every for epoch in epochs)  # each window once per epoch, none across ends
    assert len({tuple(epoch) for epoch in epochs}) == 3  # another order every epoch
    single = stream(TokenLoader(sorted(tmp_path.glob("*.bin")), B * world, T, **kw), steps)
    assert got == [w for step in single for w in step]  # the same global stream for any world size
    for epoch in epochs:
        files = [f for f, _ in epoch]
        if not shuffle:  # file by file, front to back
            assert all(a == b and s < t or a != b for (a, s), (b, t) in zip(epoch, epoch[1:]))
        elif shards:  # block by block: the 3 files with windows, as 2 blocks of 2 (one holds no window)
            cut = next(i for i in range(len(files)) if not set(files[:i]) & set(files[i:]) and i and
                       set(files[:i]) != set(files))
            assert len(set(files[:cut])) <= 2 and len(set(files[cut:])) <= 2
        else:  # all files from the start: no stretch of windows from one file in file order
            assert len(set(files[:8])) >= 2 and epoch[:4] != sorted(epoch[:4])


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


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bos_aligned_windows_start_at_documents(tmp_path, world, monkeypatch):
    tokens = coded_shards(tmp_path, [120 * L, 7 * L + 3, 80 * L], bos_seed=0)  # > 72 windows: one epoch
    monkeypatch.setattr(data.regions, "BOS_SCAN", 5)  # many scans per file
    steps = 12
    per_rank = []
    for r in range(world):
        with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=4, bos_id=BOS,
                         shuffle=False) as loader:
            batches = [[t.clone() for t in next(loader)] for _ in range(steps)]  # a batch lives until next()
        assert all(bool((x[:, 0] == BOS).all()) for x, _ in batches)
        per_rank.append([windows(x, y) for x, y in batches])
    got = interleave(per_rank)
    assert len(set(got)) == len(got)
    for (f, start), (g, nxt) in zip(got, got[1:]):  # greedy: the next window starts at the first BOS it may
        if f == g:
            bos_between = np.flatnonzero(tokens[f][start + L:nxt] == BOS)
            assert nxt >= start + L and len(bos_between) == 0
    long_docs = any(np.flatnonzero(tokens[f][s + 1:s + L + 1] == BOS).size == 0 for f, s in got)
    assert long_docs, "the data should hold documents longer than a window (cut)"
    monkeypatch.undo()
    single = stream(TokenLoader(str(tmp_path / "*.bin"), B * world, T, seed=4, bos_id=BOS, shuffle=False), steps)
    assert got == [w for step in single for w in step]


@pytest.mark.parametrize("world", [1, 3])
def test_bos_aligned_shuffled_windows_start_at_the_first_document_of_their_slot(tmp_path, world):
    tokens = coded_shards(tmp_path, [120 * L, 7 * L + 3, 80 * L], bos_seed=0)
    slots = {}  # (file, slot) -> where its window starts, for the slots that have one
    for f, t in enumerate(tokens):
        for k in range(len(t) // L):
            bos = np.flatnonzero(t[k * L:(k + 1) * L] == BOS)
            if len(bos) and k * L + bos[0] + L <= len(t):
                slots[f, k] = k * L + int(bos[0])
    epoch = len(slots)
    steps = -(-2 * epoch // (world * B))
    per_rank = []
    for r in range(world):
        with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=4, bos_id=BOS) as loader:
            batches = [[t.clone() for t in next(loader)] for _ in range(steps)]  # a batch lives until next()
        assert all(bool((x[:, 0] == BOS).all()) for x, _ in batches)
        per_rank.append([windows(x, y) for x, y in batches])
    got = interleave(per_rank)
    for e in range(2):  # every slot with a document start gives its window once per epoch
        assert sorted(got[e * epoch:(e + 1) * epoch]) == sorted((f, s) for (f, _), s in slots.items())
    assert got[:epoch] != got[epoch:2 * epoch]
    assert got[:8] != sorted(got[:8]) and len({f for f, _ in got[:8]}) >= 2  # not in file order
    overlaps = sum(f == g and s < t < s + L for f, s in got[:epoch] for g, t in got[:epoch])
    assert 0 < overlaps < epoch // 2  # a window may run into the next slot's: those tokens are read twice
    single = stream(TokenLoader(str(tmp_path / "*.bin"), B * world, T, seed=4, bos_id=BOS), steps)
    assert got == [w for step in single for w in step]


def test_bos_aligned_shuffled_stream_without_any_document_start_is_refused(tmp_path):
    """Two files, one without a document start: the stream runs on the other; none left: an error, not a hang."""
    tokens = coded_shards(tmp_path, [60 * L, 30 * L + 9], bos_seed=1)
    tokens[1][tokens[1] == BOS] = 7
    write_shard(tmp_path / "coded_train_000001.bin", tokens[1], dtype=np.uint32)
    assert {f for step in stream(TokenLoader(str(tmp_path / "*.bin"), B, T, bos_id=BOS), 50) for f, _ in step} == {0}
    tokens[0][tokens[0] == BOS] = 7
    write_shard(tmp_path / "coded_train_000000.bin", tokens[0], dtype=np.uint32)
    with pytest.raises(ShardError, match="no window of 16 tokens starting with bos_id"):
        next(TokenLoader(str(tmp_path / "*.bin"), B, T, bos_id=BOS))


@pytest.mark.parametrize("shuffle,shards", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("bos_id,consumed", [(None, 0), (None, 5), (None, 37), (7, 3), (7, 29)])
def test_resume_continues_exactly(tmp_path, bos_id, consumed, shuffle, shards):
    make_shards(tmp_path, [300, 200, 500], vocab=50)  # ~15 steps an epoch: 29 and 37 cross epochs
    def new():
        return TokenLoader(str(tmp_path / "*.bin"), B, T, rank=1, world_size=2, seed=9, bos_id=bos_id, prefetch=3,
                           shuffle=shuffle, shuffle_shards=shards)
    old = new()
    for _ in range(consumed):
        next(old)
    state_path = tmp_path / "state.pt"
    torch.save(old.state_dict(), state_path)
    expected = [torch.stack(next(old)) for _ in range(25)]
    resumed = new()
    resumed.load_state_dict(torch.load(state_path, weights_only=True))
    assert all(torch.equal(torch.stack(next(resumed)), e) for e in expected)
    for _ in range(3):  # and both go on alike
        assert torch.equal(torch.stack(next(old)), torch.stack(next(resumed)))


def test_a_batch_ending_exactly_at_a_page_aligned_end_of_file(tmp_path):
    path = tmp_path / "chunk_0001.bin"
    write_shard(path, np.arange(2048), dtype=np.uint16, header=False)  # 4096 bytes: one page, 16 windows
    with TokenLoader([path], 16, 127, fmt="raw", raw_dtype="uint16", shuffle=False) as loader:
        for _ in range(3):
            x, y = next(loader)
            assert torch.equal(torch.cat([x, y[:, -1:]], dim=1).flatten(), torch.arange(2048))


def test_resume_refuses_another_stream(tmp_path):
    make_shards(tmp_path, [300, 200])
    files = str(tmp_path / "*.bin")
    with TokenLoader(files, B, T, seed=1) as a, TokenLoader(files, B, T) as b:
        with pytest.raises(ValueError, match="seed was 1"):
            b.load_state_dict(a.state_dict())
    with TokenLoader(files, B, T, shuffle_shards=1) as a, TokenLoader(files, B, T) as b:
        with pytest.raises(ValueError, match="shuffle_shards was 1 but this loader has 0"):
            b.load_state_dict(a.state_dict())
    with TokenLoader(files, B, T, shuffle=False) as old, TokenLoader(files, B, T) as shuffled:
        with pytest.raises(ValueError, match="shuffle was False but this loader has True"):
            shuffled.load_state_dict(old.state_dict())


def test_holdout_is_never_trained_on_and_is_the_val_tail(tmp_path):
    coded_shards(tmp_path, [30 * L, 20 * L + 9])
    files, holdout = str(tmp_path / "*.bin"), 100
    cut = STRIDE + 20 * L + 9 - holdout
    seen = {w for s in stream(TokenLoader(files, B, T, holdout_tokens=holdout), 60) for w in s}
    assert max(s + L for f, s in seen if f == 1) <= cut % STRIDE
    assert len(seen) == 30 + (20 * L + 9 - holdout) // L
    val = list(val_batches(files, 4, T, holdout, tail_tokens=holdout))
    assert int(val[0][0][0, 0]) == cut - 1  # the last trained token: only the input of the first target
    assert torch.cat([y[y != PAD_TARGET] for _, y in val]).tolist() == list(range(cut, cut + holdout))


def test_val_batches_score_every_token_once_in_the_same_sequences_for_any_world_size(tmp_path):
    coded = np.concatenate(coded_shards(tmp_path, [150, 100, 400]))[:501]  # 500 targets, read across file ends
    files = str(tmp_path / "*.bin")
    for world in (1, 2, 3):
        ranks = [list(val_batches(files, 4, T, 500, rank=r, world_size=world)) for r in range(world)]
        assert len({len(r) for r in ranks}) == 1  # the same calls on every rank,
        assert {(x.shape, x.stride(), y.shape, y.stride()) for r in ranks for x, y in r} == {  # of one layout
            ((4, T), (T, 1), (4, T), (T + 1, 1))}
        rows = interleave([[list(zip(x, y)) for x, y in r] for r in ranks])  # sequences in stream order
        x, y = torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])
        scored = y != PAD_TARGET
        # sequence k: inputs are tokens [k*T, (k+1)*T), each target the token after its input, so the last
        # target of a sequence is the first input of the next; padding is ignored targets after token 500
        assert y[scored].tolist() == coded[1:].tolist()
        assert scored.flatten().tolist() == [True] * 500 + [False] * (len(rows) * T - 500)
        assert x.flatten()[:501].tolist() == coded.tolist() and not x.flatten()[501:].any()  # padding inputs: 0


def test_bad_inputs_are_refused_with_the_fix(tmp_path):
    paths = make_shards(tmp_path, [10, 20], vocab=1000)
    with pytest.raises(ShardError, match=r"no file matches '.*nothing\*\.bin'"):
        TokenLoader(str(tmp_path / "nothing*.bin"), B, T)
    with pytest.raises(ShardError, match=rf"longer than every file: the largest, {re.escape(str(paths[1]))}, has 20 "):
        TokenLoader(str(tmp_path / "*.bin"), B, 20)
    with pytest.raises(ShardError, match=r"holds 30 tokens in 2 files, but eval.tokens = 30 targets need 31 .*lower "
                                         r"eval.tokens to at most 29"):
        val_batches(str(tmp_path / "*.bin"), B, 4, 30)
    with pytest.raises(ShardError, match=r"tail \(data.val = 'holdout'\) of eval.tokens = 20 must be between 1 and"):
        TokenLoader(str(tmp_path / "*.bin"), B, 4, holdout_tokens=20)
    with pytest.raises(ShardError, match=r"no window of 5 tokens starting with bos_id=5000 in 2 files"):
        next(TokenLoader(paths, B, 4, bos_id=5000, shuffle=False))
    with pytest.raises(ShardError, match=r"no window of 5 tokens starting with bos_id=5000 in 2 files"):
        next(TokenLoader(paths, B, 4, bos_id=5000))
    with pytest.raises(ValueError, match=r"shuffle_shards must be >= 0 \(0: shuffle over all files\), got -1"):
        TokenLoader(paths, B, 4, shuffle_shards=-1)


def test_token_ids_beyond_the_vocabulary_name_the_file_and_position(tmp_path):
    path = tmp_path / "big_train_000000.bin"
    tokens = np.arange(400) % 50
    tokens[333] = 12345
    write_shard(path, tokens)
    loader = TokenLoader([path], B, T, seed=None, vocab_size=50)
    with pytest.raises(ShardError, match=rf"{path}: token id 12345 at token 333 is >= vocab_size 50"):
        for _ in range(40):
            next(loader)
    state = loader.state_dict()
    with pytest.raises(ShardError, match="at token 333"):
        next(loader)  # the same batch again, not the one after it
    assert loader.state_dict() == state
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 20000}))
    with pytest.raises(ShardError, match="token id 12345"), TokenLoader([path], B, T, vocab_size=50) as loader:
        for _ in range(40):
            next(loader)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    with TokenLoader([path], B, T, vocab_size=50) as loader:  # meta.json is trusted: no per-batch check
        assert max(int(next(loader)[1].max()) for _ in range(40)) == 12345


def test_start_up_does_not_scan_the_data(tmp_path):
    big = tmp_path / "huge.bin"
    with open(big, "wb") as f:
        f.truncate(16 << 30)  # sparse: 8G zero tokens, every one a "BOS" for bos_id=0; scanning all takes >5 s
    t0 = time.perf_counter()
    with TokenLoader([big], 16, 1024, fmt="raw", raw_dtype="uint16", bos_id=0, vocab_size=50257) as loader:
        x, y = next(loader)
    assert time.perf_counter() - t0 < 1.0
    assert x.shape == (16, 1024) and int(x.sum()) == 0 and loader.wait_s > 0
    assert loader.tokens_per_step == 16 * 1024


def test_two_ranks_under_torchrun(tmp_path):
    coded_shards(tmp_path, SIZES)
    out = tmp_path / "out"
    pattern = str(tmp_path / "*.bin")
    torchrun([ROOT / "tests" / "workers" / "loader_worker.py", pattern, out, 18, B, T], env={"PYTHONPATH": str(ROOT)})
    got = [np.load(out / f"rank{r}.npz") for r in range(2)]
    for key, shuffle in (("train", True), ("sequential", False)):
        per_rank = [[windows(*torch.from_numpy(step)) for step in g[key]] for g in got]
        single = stream(TokenLoader(pattern, 2 * B, T, seed=5, shuffle=shuffle), 18)
        assert interleave(per_rank) == [w for step in single for w in step]
        assert len(set(interleave(per_rank)[:WINDOWS_PER_EPOCH])) == WINDOWS_PER_EPOCH
    assert all(np.array_equal(g["resumed"], g["train"][9:]) for g in got)  # saved at step 9, 18 steps in all
    # rows as inputs + targets; the rows of padding only (first target ignored) depend on the world size
    val = [[tuple(row) for row in g["val"].transpose(1, 0, 2).reshape(-1, 2 * T)] for g in got]
    one = [tuple(row) for x, y in val_batches(pattern, B, T, 40 * L) for row in torch.cat([x, y], 1).tolist()]
    two = interleave([[r[i:i + B] for i in range(0, len(r), B)] for r in val])
    assert [r for r in two if r[T] != PAD_TARGET] == [r for r in one if r[T] != PAD_TARGET]


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
    assert first < 1.0


@pytest.mark.slow  # ~30 s, most of it importing torch on a busy 2-core machine
def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, "-m", "scripts.bench.loader", "--size-gb", "0.01", "--skip-big", "--seconds", "0.1",
                "--rounds", "1", "--pairs", "2", "--track-s", "0", "--tmp", str(tmp_path), "--json", str(out)],
               timeout=300)
    result = json.loads(out.read_text())
    assert "| measure | before | after | target |" in proc.stdout and "PASS" in proc.stdout
    for name in ("before", "after"):  # today's loader and the one it replaced, side by side
        r = result[name]
        assert min(r[k] for k in ("shuffled_warm", "shuffled_cold", "sequential_warm", "shuffled_k1_cold")) > 0
        assert "1GB_shuffled_bos" in r["first_batch_ms"] and "main_thread_slowdown" in r
    assert result["reference"]["memcpy"] > 0
    assert not [p for p in tmp_path.iterdir() if p != out], "the generated shards must be removed"


def test_a_file_without_documents_is_skipped_in_every_epoch(tmp_path):
    """One shard inside a single long document (no BOS at all) must not stop a BOS-aligned stream that still
    has documents in the other shard, whatever order each epoch shuffles them into."""
    rng = np.random.default_rng(0)
    docs = rng.integers(1, 300, size=4000)
    docs[::50] = 0  # a document every 50 tokens
    write_shard(tmp_path / "a.bin", docs)
    write_shard(tmp_path / "b.bin", rng.integers(1, 300, size=3000))  # the middle of one long document
    with TokenLoader(str(tmp_path / "*.bin"), 2, 16, seed=0, bos_id=0) as loader:
        for _ in range(300):  # 160 windows per epoch: several epochs and orders
            x, _ = next(loader)
            assert (x[:, 0] == 0).all()


@pytest.mark.parametrize("kw", [{"shuffle": False}, {}, {"bos_id": BOS}])
def test_a_batch_stays_intact_for_as_long_as_its_holder_keeps_it(tmp_path, kw):
    """100 batches held as they came equal their clones taken when each came: no buffer behind them is reused."""
    coded_shards(tmp_path, SIZES, bos_seed=0 if kw.get("bos_id") == BOS else None)
    with TokenLoader(str(tmp_path / "*.bin"), B, T, **kw) as loader:
        held, clones = [], []
        for _ in range(100):
            batch = next(loader)
            held.append(batch)
            clones.append([t.clone() for t in batch])
    assert all(torch.equal(a, b) for h, c in zip(held, clones) for a, b in zip(h, c))
    assert len({tuple(windows(*h)) for h in held}) > 20  # the batches differ: a reused buffer would show


@pytest.fixture(scope="module")
def digest_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("digests")
    stream_digests.write_data(root)
    return root


RECORDED = json.loads((ROOT / "tests" / "data" / "loader_digests.json").read_text())


@pytest.mark.parametrize("name", sorted(stream_digests.CONFIGS))
def test_the_stream_is_the_recorded_one(digest_data, name):
    """For a fixed seed the batches and states are bit for bit those recorded (tests/stream_digests.py)."""
    assert RECORDED["batches"] == stream_digests.BATCHES
    assert stream_digests.stream_digest(digest_data, name) == RECORDED["stream"][name]


@pytest.mark.parametrize("name", sorted(stream_digests.VAL))
def test_the_val_batches_are_the_recorded_ones(digest_data, name):
    assert stream_digests.val_digest(digest_data, name) == RECORDED["val"][name]


def test_val_ids_beyond_the_vocabulary_are_refused_before_any_batch(tmp_path):
    """The validation stream is checked whole when it is opened (every rank names the same first bad token),
    the holdout tail too; a meta.json that vouches for the ids is trusted, as for training."""
    path = tmp_path / "big_train_000000.bin"
    tokens = np.arange(400) % 50
    tokens[[350, 390]] = 12345
    write_shard(path, tokens)
    val_batches([path], B, T, 300, vocab_size=50)  # the first 301 tokens: clean
    for kw in ({"num_tokens": 360}, {"num_tokens": 100, "tail_tokens": 100}):
        with pytest.raises(ShardError, match=rf"{path}: token id 12345 at token 350 is >= vocab_size 50"):
            val_batches([path], B, T, vocab_size=50, **kw)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    assert max(int(y.max()) for _, y in val_batches([path], B, T, 360, vocab_size=50)) == 12345
