"""TokenLoader and val_batches on real shard files: exact token accounting, BOS alignment, resume, errors.

Most tests use "coded" uint32 shards whose token j of file f is f * STRIDE + j, so every window a loader
yields maps back to (file, start) and any read across a file end or any overlap shows.
"""
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data.loader
from data.loader import TokenLoader, val_batches
from data.shards import ShardError, write_shard
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


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_split_every_epoch_exactly(tmp_path, world):
    coded_shards(tmp_path, SIZES)
    steps = 2 * WINDOWS_PER_EPOCH // (world * B)
    per_rank = [stream(TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=3), steps)
                for r in range(world)]
    got = interleave(per_rank)
    every = sorted((f, k * L) for f, n in enumerate(SIZES) for k in range(n // L))
    first, second = got[:WINDOWS_PER_EPOCH], got[WINDOWS_PER_EPOCH:]
    assert sorted(first) == every and sorted(second) == every  # each window once per epoch, none across ends
    assert first != second  # shard order reshuffled for epoch 1
    single = stream(TokenLoader(sorted(tmp_path.glob("*.bin")), B * world, T, seed=3), steps)
    assert got == [w for step in single for w in step]  # the same global stream for any world size


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
        with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=4, bos_id=BOS) as loader:
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
            with TokenLoader(str(tmp_path / "*.bin"), B, T, rank=r, world_size=world, seed=5) as loader:
                per_rank.append([(windows(*next(loader)), loader.state_dict()) for _ in range(steps)])
        assert all(state == per_rank[0][i][1] for got in per_rank for i, (_, state) in enumerate(got))
        return interleave([[w for w, _ in got] for got in per_rank]), [state for _, state in per_rank[0]]
    fast = global_stream()
    monkeypatch.setattr(data.loader._Stream, "take_adjacent", lambda self, count: None)
    assert fast == global_stream()


@pytest.mark.parametrize("bos_id,consumed", [(None, 0), (None, 5), (None, 37), (7, 3), (7, 29)])
def test_resume_continues_exactly(tmp_path, bos_id, consumed):
    make_shards(tmp_path, [300, 200, 500], vocab=50)  # ~15 steps an epoch: 29 and 37 cross epochs
    def new():
        return TokenLoader(str(tmp_path / "*.bin"), B, T, rank=1, world_size=2, seed=9, bos_id=bos_id, prefetch=3)
    old = new()
    for _ in range(consumed):
        next(old)
    time.sleep(0.05)  # let the thread run ahead of the consumer
    state_path = tmp_path / "state.pt"
    torch.save(old.state_dict(), state_path)
    expected = [torch.stack(next(old)) for _ in range(25)]
    old.close()
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
    with TokenLoader([path], 16, 127, fmt="raw", raw_dtype="uint16") as loader:
        for _ in range(3):
            x, y = next(loader)
            assert torch.equal(torch.cat([x, y[:, -1:]], dim=1).flatten(), torch.arange(2048))


def test_resume_refuses_another_stream(tmp_path):
    make_shards(tmp_path, [300])
    with TokenLoader(str(tmp_path / "*.bin"), B, T, seed=1) as a, TokenLoader(str(tmp_path / "*.bin"), B, T) as b:
        with pytest.raises(ValueError, match="seed was 1"):
            b.load_state_dict(a.state_dict())


def test_holdout_is_never_trained_on_and_is_the_val_tail(tmp_path):
    coded_shards(tmp_path, [30 * L, 20 * L + 9])
    files, holdout = str(tmp_path / "*.bin"), 100
    cut = STRIDE + 20 * L + 9 - holdout
    seen = {w for s in stream(TokenLoader(files, B, T, holdout_tokens=holdout), 60) for w in s}
    assert max(s + L for f, s in seen if f == 1) <= cut % STRIDE
    assert len(seen) == 30 + (20 * L + 9 - holdout) // L
    val = list(val_batches(files, 4, T, holdout, tail_tokens=holdout))
    rows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in val]).flatten()
    assert rows.tolist() == list(range(cut, cut + holdout // L * L))


def test_val_batches_are_the_same_set_for_any_world_size(tmp_path):
    coded_shards(tmp_path, [150, 100, 400])  # first 500 tokens: 9 + 6 + 15 windows
    files = str(tmp_path / "*.bin")

    def per_rank(world: int) -> list[list[list]]:
        return [[windows(x, y) if len(x) else [] for x, y in val_batches(files, 4, T, 500, rank=r,
                                                                         world_size=world)] for r in range(world)]
    one = per_rank(1)[0]
    expected = [(0, k * L) for k in range(9)] + [(1, k * L) for k in range(6)] + [(2, k * L) for k in range(15)]
    assert [w for b in one for w in b] == expected
    for world in (2, 3):
        ranks = per_rank(world)
        assert len({len(r) for r in ranks}) == 1  # same number of batches on every rank
        assert interleave(ranks) == expected
    assert per_rank(3) == per_rank(3)
    x, y = list(val_batches(files, 4, T, 500, rank=2, world_size=3))[-1]
    assert x.shape == y.shape == (0, T)


def test_bad_inputs_are_refused_with_the_fix(tmp_path):
    paths = make_shards(tmp_path, [10, 20], vocab=1000)
    with pytest.raises(ShardError, match=r"no file matches '.*nothing\*\.bin'"):
        TokenLoader(str(tmp_path / "nothing*.bin"), B, T)
    with pytest.raises(ShardError, match=rf"longer than every file: the largest, {re.escape(str(paths[1]))}, has 20 "):
        TokenLoader(str(tmp_path / "*.bin"), B, 20)
    with pytest.raises(ShardError, match=r"holds 30 tokens in 2 files but eval.tokens = 31; lower eval.tokens to "):
        val_batches(str(tmp_path / "*.bin"), B, 4, 31)
    with pytest.raises(ShardError, match=r"tail \(data.val = 'holdout'\) of eval.tokens = 20 must be between 1 and"):
        TokenLoader(str(tmp_path / "*.bin"), B, 4, holdout_tokens=20)
    with pytest.raises(ShardError, match=r"no window of 5 tokens starting with bos_id=5000 in 2 files"):
        next(TokenLoader(paths, B, 4, bos_id=5000))


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
    per_rank = [[windows(*torch.from_numpy(step)) for step in g["train"]] for g in got]
    single = stream(TokenLoader(pattern, 2 * B, T, seed=5), 18)
    assert interleave(per_rank) == [w for step in single for w in step]
    assert len(set(interleave(per_rank)[:WINDOWS_PER_EPOCH])) == WINDOWS_PER_EPOCH
    val = [windows(*torch.from_numpy(g["val"])) for g in got]
    one = [w for x, y in val_batches(pattern, B, T, 40 * L) for w in windows(x, y)]
    assert sorted(val[0] + val[1]) == sorted(one) and not set(val[0]) & set(val[1])


@pytest.mark.slow  # 8-12 s, most of it importing torch on a busy 2-core machine
def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, "-m", "scripts.bench_loader", "--size-gb", "0.01", "--skip-big", "--seconds", "0.1",
                "--tmp", str(tmp_path), "--json", str(out)], timeout=120)
    result = json.loads(out.read_text())
    assert "| loader |" in proc.stdout and result["ours"]["tokens_per_s"] > 0
    assert result["starter"]["tokens_per_s"] > 0 and result["memcpy"]["tokens_per_s"] > 0
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
