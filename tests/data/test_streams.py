"""The window streams (data.streams): ranks split every epoch exactly, BOS alignment, exact resume, the recorded
stream.

Most tests use tests.data.coded's shards, whose every window maps back to (file, start)."""

import numpy as np
import pytest
import torch

import data.regions
from data.loader import TokenLoader
from data.shards import ShardError, write_shard
from tests import stream_digests
from tests.helpers import make_shards
from tests.data.coded import RECORDED, B, BOS, L, SIZES, T, WINDOWS_PER_EPOCH, coded_shards, interleave, stream, windows


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


@pytest.mark.parametrize("name", sorted(stream_digests.CONFIGS))


def test_the_stream_is_the_recorded_one(digest_data, name):
    """For a fixed seed the batches and states are bit for bit those recorded (tests/stream_digests.py)."""
    assert RECORDED["batches"] == stream_digests.BATCHES
    assert stream_digests.stream_digest(digest_data, name) == RECORDED["stream"][name]


@pytest.mark.parametrize("world", [1, 3])


def test_cut_rows_are_documents_in_order_each_cut_and_the_ranks_split_them(tmp_path, world):
    """doc_cut (record 46's rows): a row is documents in order, each from its BOS to the next, cut at doc_cut
    tokens or where the row is full, the rest skipped; the next row starts at the document after the last; the
    ranks take consecutive rows, and a resume goes on exactly."""
    tokens = coded_shards(tmp_path, [120 * L, 7 * L + 3, 80 * L], bos_seed=0)  # documents of 3 to 3L tokens
    cut, steps, files = L // 2, 40, sorted(tmp_path.glob("*.bin"))
    kw = {"seed": None, "bos_id": BOS, "doc_cut": cut}

    def rows(world: int, batch: int, rank: int = 0) -> list:
        with TokenLoader(files, batch, T, rank=rank, world_size=world, **kw) as loader:
            return [row for _ in range(steps) for row in loader.next_places()]
    single = rows(1, B * world)
    assert interleave([[rows(world, B, r)[s * B:(s + 1) * B] for s in range(steps)] for r in range(world)]) == single
    bos = {f: np.flatnonzero(t == BOS) for f, t in zip(files, tokens)}
    cuts = 0
    for row, after in zip(single, single[1:] + [None]):
        path, spans = row
        starts = bos[path]
        assert sum(hi - lo for lo, hi in spans) == L
        for k, (lo, hi) in enumerate(spans):
            nxt = starts[starts > lo]
            doc_end = int(nxt[0]) if len(nxt) else len(tokens[files.index(path)])
            last = k == len(spans) - 1
            assert lo in starts and (hi == min(doc_end, lo + cut) or last and hi < min(doc_end, lo + cut))
            if not last:  # the next range is the next document: only a cut document's rest skipped
                assert spans[k + 1][0] == doc_end
            cuts += hi < doc_end
        if after is not None and after[0] == path:  # the next row: at the first document past this one's last
            assert after[1][0][0] == starts[starts > spans[-1][0]][0]
    assert cuts > len(single)  # documents were cut inside rows, not only at their ends
    with TokenLoader(files, B, T, **kw) as loader:
        for _ in range(3):
            next(loader)
        state = loader.state_dict()
        coming = [torch.cat(next(loader), dim=1) for _ in range(20)]
    with TokenLoader(files, B, T, **kw) as resumed, TokenLoader(files, B, T, **kw) as placed:
        resumed.load_state_dict(state)
        placed.load_state_dict(state)
        for want in coming:
            got, where = torch.cat(next(resumed), dim=1), placed.next_places()
            assert torch.equal(got, want)
            for (path, spans), row in zip(where, torch.cat([got[:, :T], got[:, -1:]], dim=1)):
                read = np.concatenate([tokens[files.index(path)][lo:hi] for lo, hi in spans])
                assert np.array_equal(row.numpy(), read)  # the tokens are those of the ranges


def test_cut_rows_need_a_bos_id_and_the_order_of_the_files(tmp_path):
    coded_shards(tmp_path, [20 * L], bos_seed=0)
    for kw in [{"shuffle": False}, {"bos_id": BOS}, {"bos_id": BOS, "shuffle": False, "doc_cut": -1}]:
        with pytest.raises(ValueError, match="cuts documents inside rows read in order"):
            TokenLoader(str(tmp_path / "*.bin"), B, T, **{"doc_cut": 8, **kw})
    with TokenLoader(str(tmp_path / "*.bin"), B, T, bos_id=BOS, shuffle=False, doc_cut=8) as loader:
        state = loader.state_dict()
    with TokenLoader(str(tmp_path / "*.bin"), B, T, bos_id=BOS, shuffle=False) as whole:
        with pytest.raises(ValueError, match="doc_cut was 8 but this loader has 0"):
            whole.load_state_dict(state)
        whole.load_state_dict({k: v for k, v in state.items() if k != "doc_cut"})  # a state of rows uncut


def test_cut_rows_a_batch_no_file_can_give_whole_is_named_as_such(tmp_path):
    coded_shards(tmp_path, [20 * L, 10 * L], bos_seed=0)  # rows in plenty, but fewer than 40 in any file
    with pytest.raises(ShardError, match="no file gives a whole global batch of 40 rows .*lower train.batch_size"):
        with TokenLoader(str(tmp_path / "*.bin"), 20, T, world_size=2, bos_id=BOS, shuffle=False, doc_cut=8) as loader:
            next(loader)
