"""TokenLoader (data.loader): resume checks, refused inputs, vocabulary checks, torchrun, the caller's batches.

Most tests use tests.data.coded's shards, whose every window maps back to (file, start)."""
import json
import re

import numpy as np
import pytest
import torch

from data.loader import TokenLoader
from data.shards import ShardError, write_shard
from data.val import PAD_TARGET, val_batches
from tests.data.coded import (
    BOS,
    SIZES,
    WINDOWS_PER_EPOCH,
    B,
    L,
    T,
    coded_shards,
    interleave,
    stream,
    windows,
)
from tests.helpers import ROOT, make_shards, torchrun


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


def test_resume_refuses_shards_remade_under_the_same_names_and_takes_an_older_state(tmp_path):
    make_shards(tmp_path, [300, 200])
    files = str(tmp_path / "*.bin")
    with TokenLoader(files, B, T, seed=1) as a:
        next(a)
        state = a.state_dict()
    make_shards(tmp_path, [300, 260], seed=1)  # the second file re-made, longer
    with TokenLoader(files, B, T, seed=1) as b:
        with pytest.raises(ValueError, match="test_train_000001.bin held 200 tokens at the save and holds 260 now"):
            b.load_state_dict(state)
        older = {k: v for k, v in state.items() if k not in ("tokens", "ends")}  # saved before they were kept
        b.load_state_dict(older)
        assert b.state_dict() == {**older, "tokens": [300, 260], "ends": b.state_dict()["ends"]}
    make_shards(tmp_path, [300, 200], seed=2)  # as many tokens as at the save, other ones
    with TokenLoader(files, B, T, seed=1) as b:
        with pytest.raises(ValueError, match="test_train_000000.bin holds other tokens than at the save: the data "
                                             "files were re-made or changed since"):
            b.load_state_dict(state)


def test_bad_inputs_are_refused_with_the_fix(tmp_path):
    paths = make_shards(tmp_path, [10, 20], vocab=1000)
    with pytest.raises(ShardError, match=r"no file matches '.*nothing\*\.bin'"):
        TokenLoader(str(tmp_path / "nothing*.bin"), B, T)
    with pytest.raises(ShardError, match=rf"longer than every file: the largest, {re.escape(str(paths[1]))}, has 20 "):
        TokenLoader(str(tmp_path / "*.bin"), B, 20)
    with pytest.raises(ShardError, match=r"holds 30 tokens in 2 files, but eval.tokens = 30 targets need 31 .*lower "
                                         r"eval.tokens to at most 29"):
        val_batches(str(tmp_path / "*.bin"), B, 4, 30)
    with pytest.raises(ShardError, match=r"tail \(data.val = 'holdout'\) of eval.tokens = 20 must be between 1 and "
                                         r"19, leaving training at least one of the last file's 20 tokens; lower"):
        TokenLoader(str(tmp_path / "*.bin"), B, 4, holdout_tokens=20)
    with pytest.raises(ShardError, match=r"the largest, .*, has 1 usable token; lower seq_len"):
        TokenLoader(paths[1:], B, 4, holdout_tokens=19)  # the 20-token file less its 19-token tail
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
    # a meta.json that does not list the file (one copied in beside data.prepare's) does not vouch for it
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50, "shards": [{"file": "x.bin", "tokens": 9}]}))
    with pytest.raises(ShardError, match="token id 12345"), TokenLoader([path], B, T, vocab_size=50) as loader:
        for _ in range(40):
            next(loader)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50, "shards": [{"file": path.name, "tokens": 400}]}))
    with TokenLoader([path], B, T, vocab_size=50) as loader:  # meta.json is trusted: no per-batch check
        assert max(int(next(loader)[1].max()) for _ in range(40)) == 12345


@pytest.mark.parametrize("fmt", ["auto", "raw"])
def test_a_listed_shard_that_reads_as_other_tokens_is_refused(tmp_path, fmt):
    # a damaged magic reads as a raw file (its header as 512 tokens); so does an llm.c shard under data.format "raw"
    path = tmp_path / "d_train_000001.bin"
    write_shard(path, np.arange(400) % 50)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50, "shards": [{"file": path.name, "tokens": 400}]}))
    if fmt == "auto":
        with open(path, "r+b") as f:
            f.write(b"\0\0\0\0")
    with pytest.raises(ShardError, match=rf"{path}: the meta.json beside it lists 400 tokens, but data.format = "
                                         rf"'{fmt}' reads 912: its llm.c header is damaged"):
        TokenLoader([path], B, T, vocab_size=50, fmt=fmt, raw_dtype="uint16")
    with pytest.raises(ShardError, match="lists 400 tokens"):
        val_batches([path], 1, T, 100, fmt=fmt, raw_dtype="uint16")


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


@pytest.mark.parametrize("kw", [{"shuffle": False, "bos_id": BOS}, {"bos_id": BOS}, {"seed": None}])
def test_next_places_are_where_the_batches_come_from_and_move_the_stream_alike(tmp_path, kw):
    coded_shards(tmp_path, [120 * L, 7 * L + 3, 80 * L], bos_seed=0)
    paths = sorted(tmp_path.glob("*.bin"))
    with TokenLoader(paths, B, T, rank=1, world_size=2, **kw) as read, \
            TokenLoader(paths, B, T, rank=1, world_size=2, **kw) as placed:
        for _ in range(60):  # past an epoch's end
            where = placed.next_places()
            assert all(hi == lo + L for _, [(lo, hi)] in where)  # one range a row, a whole window
            places = [(paths.index(f), lo) for f, [(lo, _)] in where]
            assert places == windows(*next(read)) and placed.state_dict() == read.state_dict()
        assert read.state_dict()["epoch"] >= 1


@pytest.mark.parametrize("kw", [{}, {"bos_id": BOS}])
def test_rows_may_lengthen_between_batches_and_a_resume_goes_on_at_the_new_length(tmp_path, kw):
    """set_seq_len (train.batch_stage_rows): the stream goes on from where it was, at the new length, and a loader
    built afresh at the base length resumes it once told the length."""
    coded_shards(tmp_path, SIZES, bos_seed=0 if kw else None)
    files = str(tmp_path / "*.bin")
    with TokenLoader(files, B, T, shuffle=False, max_seq_len=3 * T, **kw) as loader:
        first = windows(*next(loader))
        loader.set_seq_len(2 * T)
        state, batch = loader.state_dict(), next(loader)
        assert batch[0].shape == (B, 2 * T) and loader.tokens_per_step == B * 2 * T
        (_, end), (_, start) = first[-1], windows(*batch)[0]
        # consecutive tokens go on where the last row ended; with bos_id, at the first document from there
        assert start == end + L if not kw else end + L <= start < end + L + 3 * L
        with TokenLoader(files, B, T, shuffle=False, max_seq_len=3 * T, **kw) as again:
            again.load_state_dict(state)
            again.set_seq_len(2 * T)
            assert all(torch.equal(a, b) for a, b in zip(next(again), batch))
        with pytest.raises(ValueError, match=r"seq_len = 46: this loader's rows are 1 to 45 tokens long"):
            loader.set_seq_len(3 * T + 1)
    with pytest.raises(ValueError, match="max_seq_len = 45: rows of other lengths need shuffle off"):
        TokenLoader(files, B, T, max_seq_len=3 * T, **kw)
    with pytest.raises(ShardError, match=r"seq_len \+ 1 = 1001 tokens is longer than every file"):
        TokenLoader(files, B, T, shuffle=False, max_seq_len=1000, **kw)
