"""The record's loader, restated: what shards give its steps, where they run out, documents over its table; our
loader's rows with data.doc_cut are its rows."""
import itertools

import pytest

from data.loader import TokenLoader
from data.shards import open_shard
from scripts.beside.record_data import docs_limit, most_val_documents, record_coverage, record_rows, repeated
from scripts import data_coverage
from scripts.data_coverage import fineweb_like
from scripts.beside.record_script import RecordError
from tests.scripts.beside_fixtures import record_shards


def files(data):
    return sorted((data / "data" / "fineweb10B").glob("fineweb_train_*.bin"))


def test_steps_are_counted_until_a_micro_batch_finds_no_more_documents(tmp_path):
    # micro-batches of 400 tokens read 401: documents of 250 tokens give one and 151 of the next each (its rest
    # skipped), so a shard of 10 documents gives 5 micro-batches, two shards 5 steps of 2
    data = record_shards(tmp_path, [[250] * 10, [250] * 10], val_tokens=500)
    cover = record_coverage(files(data), lambda s: 800, 100, 2, 2048, 50256)
    assert (cover.steps, cover.short_at, cover.most_docs, cover.over_limit) == (5, 5, 2, 0)
    assert record_coverage(files(data), lambda s: 800, 5, 2, 2048, 50256).short_at is None


def test_long_documents_are_cut_at_max_seq_len(tmp_path):
    data = record_shards(tmp_path, [[1000] * 4], val_tokens=500)
    # 301 tokens from 1,000-token documents at max_seq_len 100: 100 + 100 + 100 + 1 from four documents
    cover = record_coverage(files(data), lambda s: 300, 10, 1, 100, 50256)
    assert (cover.steps, cover.most_docs) == (1, 4)


def test_the_table_takes_a_128th_of_the_tokens_over_300_rounded_up_to_128_less_one():
    assert docs_limit(16384) == 127 and docs_limit(49152) == 255 and docs_limit(299) == -1


def test_many_short_documents_overflow_the_table(tmp_path):
    data = record_shards(tmp_path, [[3] * 400], val_tokens=500)
    cover = record_coverage(files(data), lambda s: 400, 2, 1, 2048, 50256)  # 401 tokens: 134 documents of 3
    assert cover.most_docs == 134 and cover.over_limit == 2


def test_val_rows_count_the_documents_that_start_in_them(tmp_path):
    data = record_shards(tmp_path, [[300] * 4], val_tokens=1000)
    val = data / "data" / "fineweb10B" / "fineweb_val_000000.bin"
    tokens = open_shard(val, fmt="header")
    want = max(int((tokens[k * 400:(k + 1) * 400] == 50256).sum()) for k in range(2))
    assert most_val_documents(val, 400, 2, 50256) == want > 0


def test_repeated_shards_give_the_loader_each_epoch_in_the_same_order(tmp_path):
    data = record_shards(tmp_path / "data", [[250] * 10, [250] * 10], val_tokens=500)
    source = data / "data" / "fineweb10B"
    (source / "meta.json").write_text('{"vocab_size": 50257}')
    into = repeated(files(data), [source / "fineweb_val_000000.bin"], tmp_path / "three", 3)
    linked = files(into)
    assert [p.name for p in linked] == [f"fineweb_train_{n:06d}.bin" for n in range(1, 7)]
    assert [p.resolve() for p in linked] == files(data) * 3
    assert (into / "data" / "fineweb10B" / "fineweb_val_000000.bin").resolve() == source / "fineweb_val_000000.bin"
    assert (into / "data" / "fineweb10B" / "meta.json").read_text() == '{"vocab_size": 50257}'
    # one epoch gives 5 steps of 800 tokens (test above); three give 15, and the 16th runs out
    cover = record_coverage(linked, lambda s: 800, 100, 2, 2048, 50256)
    assert (cover.steps, cover.short_at) == (15, 15)
    # fewer epochs leave no link of the earlier count behind; a file that is not a link is refused, and kept
    assert len(files(repeated(files(data), [], tmp_path / "three", 2))) == 4
    (into / "data" / "fineweb10B" / "notes.txt").write_text("mine")
    with pytest.raises(RecordError, match="notes.txt: not a link to a shard"):
        repeated(files(data), [], into, 2)
    assert (into / "data" / "fineweb10B" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("world", [1, 3])
def test_our_loader_with_doc_cut_reads_the_records_rows(tmp_path, monkeypatch, world):
    """data.doc_cut's rows are those of the record's loader, range for range, rank by rank, FineWeb-like documents
    cut too, and where a shard cannot give every rank's row of a step (its last rows skipped)."""
    monkeypatch.setattr(data_coverage, "FINEWEB_LIKE_SHARD", 100_000)
    shards = fineweb_like(tmp_path, 400_000, 50256, seed=2)  # 4 shards of ~170 documents, near half over the cut
    n, cut = 1000, 600
    record = list(record_rows(shards, itertools.repeat(n), cut, 50256, world))
    loaders = [TokenLoader(shards, 1, n, rank=r, world_size=world, seed=None, bos_id=50256, shuffle=False,
                           doc_cut=cut) for r in range(world)]
    for path, rows in record:
        assert [loader.next_places() for loader in loaders] == [[(path, spans)] for spans in rows]
    assert len(record) * world > 150 and len({path for path, _ in record}) == 4
    assert sum(hi - lo == cut for _, rows in record for spans in rows for lo, hi in spans) > 100  # documents cut


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("every", [20, 1], ids=["by_stage", "each_batch"])
def test_rows_that_grow_by_stage_are_the_records_rows(tmp_path, monkeypatch, world, every):
    """train.batch_stage_rows: the row grows from n to 2n and 3n tokens between steps (by stage, or at every
    batch, so that a length changes where a shard ends too), and each rank's rows stay the record's, whose loader
    goes on from the document after the last row's at the new length."""
    monkeypatch.setattr(data_coverage, "FINEWEB_LIKE_SHARD", 100_000)
    shards = fineweb_like(tmp_path, 300_000 * world, 50256, seed=3)
    n, cut = 600, 500
    lengths = [n * (1 + i // every % 3) for i in range(60)]
    record = list(record_rows(shards, lengths, cut, 50256, world))
    loaders = [TokenLoader(shards, 1, n, rank=r, world_size=world, seed=None, bos_id=50256, shuffle=False,
                           doc_cut=cut, max_seq_len=3 * n) for r in range(world)]
    for length, (path, rows) in zip(lengths, record):
        for loader in loaders:
            loader.set_seq_len(length)
        assert [loader.next_places() for loader in loaders] == [[(path, spans)] for spans in rows]
    assert len(record) == len(lengths) and len({path for path, _ in record}) > 1
    assert {sum(hi - lo for lo, hi in rows[0]) for _, rows in record} == {601, 1201, 1801}
