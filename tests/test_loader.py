"""TokenLoader and val_batches on real shard files: exact token accounting, BOS alignment, resume, errors.

Most tests use "coded" uint32 shards whose token j of file f is f * STRIDE + j, so every window a loader
yields maps back to (file, start) and any read across a file end or any overlap shows.
"""
import json
import os
import queue
import re
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

import data.loader
from data.loader import PAD_TARGET, TokenLoader, val_batches
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
    monkeypatch.setattr(data.loader, "BOS_SCAN_TOKENS", 37)  # many incremental scans per file
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


@pytest.mark.parametrize("world", [1, 3])
def test_whole_group_arithmetic_equals_window_by_window(tmp_path, world, monkeypatch):
    sizes = [230 * L + 5, 10, 97 * L + 7, 150 * L]  # groups of 16 batches fit in some files, not in others
    coded_shards(tmp_path, sizes)
    steps = 2 * (sum(sizes) // L) // (world * B) + 5  # past two epoch ends

    def global_stream() -> tuple[list, list]:
        """The windows of all ranks in global order, and the resume state after every step."""
        per_rank = []
        for r in range(world):
            with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=5, shuffle=False) as loader:
                per_rank.append([(windows(*next(loader)), loader.state_dict()) for _ in range(steps)])
        assert all(state == per_rank[0][i][1] for got in per_rank for i, (_, state) in enumerate(got))
        return interleave([[w for w, _ in got] for got in per_rank]), [state for _, state in per_rank[0]]
    fast = global_stream()
    monkeypatch.setattr(data.loader._Stream, "take_adjacent", lambda self, count: None)
    assert fast == global_stream()


@pytest.mark.parametrize("world", [1, 3])
def test_bos_slots_looked_at_a_few_at_a_time_give_the_same_stream(tmp_path, world, monkeypatch):
    """The shuffled BOS stream looks for the bos_id of a vector of slots at a time; vectors of 3 slots, which
    split the global batches and the stretches of slots without a document start, give the same batches and states."""
    tokens = coded_shards(tmp_path, [60 * L, 30 * L + 9], bos_seed=1)
    tokens[1][tokens[1] == BOS] = 7  # file 1: no document start (long stretches of slots without a window)
    write_shard(tmp_path / "coded_train_000001.bin", tokens[1], dtype=np.uint32)

    def run() -> list:
        got = []
        for r in range(world):
            with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=2, bos_id=BOS) as loader:
                got += [(torch.cat([x, y[:, -1:]], dim=1).clone(), loader.state_dict())
                        for x, y in (next(loader) for _ in range(50))]
        return got
    whole = run()
    monkeypatch.setattr(data.loader, "BOS_SCAN_SLOTS", 3)
    assert all(torch.equal(a, c) and b == d for (a, b), (c, d) in zip(whole, run(), strict=True))
    tokens[0][tokens[0] == BOS] = 7  # no document start left: an error, though no vector holds a whole epoch
    write_shard(tmp_path / "coded_train_000000.bin", tokens[0], dtype=np.uint32)
    with pytest.raises(ShardError, match="no window of 16 tokens starting with bos_id"):
        TokenLoader(str(tmp_path / "*.bin"), B, T, bos_id=BOS)._stream.plan(1)  # here: a bug would hang, not fail


@pytest.mark.parametrize("world,bos_id,holdout,mixed", [(1, None, 0, False), (3, None, 37, True), (1, BOS, 0, False),
                                                       (3, BOS, 37, False)])
def test_fancy_index_gather_equals_window_by_window(tmp_path, world, bos_id, holdout, mixed, monkeypatch):
    """The shuffled stream copies a group's windows from all files with one fancy index (per dtype); a copy per
    window gives the same batches: rows in the planned order, from every file, at file ends and the holdout cut."""
    tokens = coded_shards(tmp_path, [40 * L + 7, 10, 25 * L + 3, 31 * L], bos_seed=None if mixed else 0)
    if mixed:  # file 0's codes fit in uint16: a second span
        write_shard(tmp_path / "coded_train_000000.bin", tokens[0], dtype=np.uint16)
    steps = 2 * 96 // (world * B) + 3  # past two epoch ends (96 slots an epoch)

    def batches() -> list[torch.Tensor]:
        got = []
        for r in range(world):
            with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=6, bos_id=bos_id,
                             holdout_tokens=holdout) as loader:
                assert len(loader._stream.spans) == 1 + mixed
                got += [torch.cat([x, y[:, -1:]], dim=1).clone() for x, y in (next(loader) for _ in range(steps))]
        return got

    def window_by_window(self, windows, vocab_size):
        return [(slice(None), np.stack([self.regions[r].array[start:start + self.length]
                                        for r, start in zip(*(w.tolist() for w in windows))]))]
    fancy = batches()
    monkeypatch.setattr(data.loader._Shuffled, "read", window_by_window)
    assert all(torch.equal(a, b) for a, b in zip(fancy, batches(), strict=True))
    assert {int(row[row != BOS][0]) // STRIDE for b in fancy for row in b} == {0, 2, 3}  # every file with slots


def test_a_window_outside_its_file_raises_instead_of_reading_other_memory(tmp_path):
    """The one-index gather reads through a view that spans more than the files: a start the plan got wrong must
    be refused before it is read (a start one token into the next file, or past the region's end)."""
    coded_shards(tmp_path, [40 * L + 7, 31 * L])
    with TokenLoader(str(tmp_path / "*.bin"), B, T, holdout_tokens=5) as loader:
        stream = loader._stream
        for region, start in ((0, -1), (0, stream.ends[0] - L + 1), (1, stream.ends[1] - L + 1)):  # 1: the holdout
            with pytest.raises(RuntimeError, match="outside its file"):
                stream.read((np.array([region]), np.array([start])), None)
        stream.read((np.array([1]), np.array([stream.ends[1] - L])), None)  # the last window that fits

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
    time.sleep(0.05)  # let the thread run ahead of the consumer
    state_path = tmp_path / "state.pt"
    torch.save(old.state_dict(), state_path)
    expected = [torch.stack(next(old)) for _ in range(25)]
    time.sleep(0.05)  # both stages blocked on full queues: close() must stop them there
    old.close()
    assert not [t.name for t in threading.enumerate() if t.name in ("TokenLoader read", "TokenLoader fill")]
    resumed = new()
    resumed.load_state_dict(torch.load(state_path, weights_only=True))
    assert all(torch.equal(torch.stack(next(resumed)), e) for e in expected)
    resumed.close()
    for _ in range(3):  # iterating after close() restarts where the consumer stopped
        assert torch.equal(torch.stack(next(old)), torch.stack(next(resumed)))
    old.close()
    resumed.close()


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
    with TokenLoader(files, B, T, shuffle=False) as old, TokenLoader(files, B, T, shuffle=False) as same, \
            TokenLoader(files, B, T) as shuffled:
        next(old)
        saved = {k: v for k, v in old.state_dict().items() if k not in ("shuffle", "shuffle_shards")}
        same.load_state_dict(saved)  # a state saved before the shuffle keys existed: the sequential stream
        assert torch.equal(torch.stack(next(same)), torch.stack(next(old)))
        with pytest.raises(ValueError, match="shuffle was False but this loader has True"):
            shuffled.load_state_dict(saved)


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


def test_token_ids_beyond_the_vocabulary_surface_from_the_thread(tmp_path):
    path = tmp_path / "big_train_000000.bin"
    tokens = np.arange(400) % 50
    tokens[333] = 12345
    write_shard(path, tokens)
    loader = TokenLoader([path], B, T, seed=None, vocab_size=50)
    with pytest.raises(ShardError, match=rf"{path}: token id 12345 at token 333 is >= vocab_size 50"):
        for _ in range(40):
            next(loader)
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
    torchrun([ROOT / "tests" / "loader_worker.py", pattern, out, 18, B, T], env={"PYTHONPATH": str(ROOT)})
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


def test_a_working_set_is_read_ahead_whole_and_the_next_one_too(tmp_path):
    """shuffle_shards=1: once the stream is in a shard, that shard and the next are read into the page cache
    whole, though a hint reads at most read_ahead_kb (8 MiB on this disk) at a time; the third is not."""
    paths = make_shards(tmp_path, [12 << 20] * 3)  # 24 MiB each
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written through atomic_path: clean, so dropped
        os.close(fd)
    regions = data.loader._open_regions(paths, "auto", None)

    def resident() -> list[bool]:
        return [r.cached(r.lo, r.hi) for r in regions]
    assert not any(resident())
    with TokenLoader(paths, B, T, shuffle_shards=1) as loader:
        next(loader)
        deadline = time.time() + 20
        while sum(resident()) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sum(resident()) == 2
    rest = next(r for r, whole in zip(regions, resident()) if not whole)
    pages = [rest.cached(p, p + 2048) for p in range(rest.lo, rest.hi - 2048, 2048)]
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


@pytest.mark.slow  # 8-12 s, most of it importing torch on a busy 2-core machine
def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, "-m", "scripts.bench_loader", "--size-gb", "0.01", "--skip-big", "--seconds", "0.1",
                "--tmp", str(tmp_path), "--json", str(out)], timeout=120)
    result = json.loads(out.read_text())
    assert "| loader |" in proc.stdout and result["ours"]["tokens_per_s"] > 0
    assert result["starter"]["tokens_per_s"] > 0 and result["memcpy"]["tokens_per_s"] > 0
    assert min(result[k]["tokens_per_s"] for k in ("shuffled", "shuffled_cold", "shuffled_k1_cold", "random_copy")) > 0
    assert "1GB_shuffled_bos" in result["first_batch_ms"] and result["shuffled_rss_anon_growth_mb"] < 100
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


def test_a_channel_holds_at_most_its_size_and_a_stopped_put_gives_up():
    channel, stop, done = data.loader._Channel(2), threading.Event(), []
    assert channel.put("a", stop) and channel.put("b", stop)
    third = threading.Thread(target=lambda: done.append(channel.put("c", stop)))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive() and not done  # no room: the producer waits
    assert channel.get() == "a"
    third.join(timeout=5)
    assert done == [True] and [channel.get(timeout=0), channel.get(timeout=0)] == ["b", "c"]
    with pytest.raises(queue.Empty):
        channel.get(timeout=0)
    assert channel.put("d", stop) and channel.put("e", stop)
    stop.set()  # the consumer closed: a put waiting for room returns False instead of waiting forever
    assert channel.put("f", stop) is False


def test_the_fill_thread_sets_the_consumers_cuda_device_before_its_first_item(tmp_path, monkeypatch):
    # CPU has no CUDA device to check which one a thread uses, so record the call: thread and device, and when
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))

    def items():
        for item in "ab":
            calls.append(item)
            yield item
    for device in (3, None):  # a CUDA loader's fill thread, then its read thread (and both of a CPU loader)
        channel = data.loader._Channel(2)
        thread = threading.Thread(target=data.loader._pump, args=(items(), channel, threading.Event(), device),
                                  name=f"pump {device}")
        thread.start()
        thread.join()
        assert [channel.get(timeout=0) for _ in "ab"] == ["a", "b"]
    assert calls == [("pump 3", 3), "a", "b", "a", "b"]
    coded_shards(tmp_path, SIZES)
    with TokenLoader(str(tmp_path / "*.bin"), B, T) as loader:
        next(loader)
        assert sorted(t.name for t in loader._threads) == ["TokenLoader fill", "TokenLoader read"]
    assert calls == [("pump 3", 3), "a", "b", "a", "b"]  # a CPU loader's threads set no device


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
