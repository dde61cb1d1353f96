"""scripts/data_coverage.py: how often one epoch of each stream reads each token, on shards data.prepare wrote."""
import numpy as np

from data.shards import open_shard
from scripts.data_coverage import FINEWEB_LIKE, coverage, fineweb_like, main
from tests.helpers import short_docs_data

T = 64


def test_the_sequential_streams_read_no_token_twice_and_the_shuffled_one_reads_some_twice_and_skips_more(tmp_path):
    data = short_docs_data(tmp_path / "docs", tokens=60_000, val_tokens=6_000, shard_tokens=20_000)
    files = sorted(data.glob("*_train_*.bin"))
    tokens = [np.asarray(open_shard(f)) for f in files]
    rows = 0  # the greedy rows: each at the first BOS (256) at or past the end of the one before
    for t in tokens:
        starts, end = np.flatnonzero(t == 256), 0
        for start in starts[starts + T + 1 <= len(t)]:
            if start >= end:
                rows, end = rows + 1, start + T + 1
    total = sum(len(t) for t in tokens)

    ordered = coverage(files, T, 256, seed=None, shuffle=False)
    assert ordered.rows == rows and ordered.again == 0
    assert ordered.once == rows * (T + 1) / total and ordered.never == 1 - ordered.once
    assert coverage(files, T, 256, seed=3, shuffle=False) == ordered  # each file's rows alike in any file order
    shuffled = coverage(files, T, 256, seed=3, shuffle=True)
    assert shuffled.again > 0.05 and shuffled.never > 0.05 and shuffled.rows > ordered.rows
    assert shuffled.never + shuffled.once + shuffled.again == 1


def test_the_command_prints_each_stream_with_the_bos_id_of_meta_json(tmp_path, capsys):
    data = short_docs_data(tmp_path / "docs", tokens=30_000, val_tokens=3_000, shard_tokens=20_000)
    main(["--train", str(data / "*_train_*.bin"), "--seq-len", str(T), "--record-row", str(8 * T),
          "--record-cut", str(T)])
    out = capsys.readouterr().out
    assert "2 files, 27,000 tokens, rows of 65 tokens from bos_id 256" in out
    lines = [line.split() for line in out.splitlines()[2:]]
    assert [line[0] for line in lines] == ["shuffled", "sequential", "sorted", "cut", "record", "record", "record"]
    assert [line[1] for line in lines[4:]] == ["512", "1,024", "1,536"]  # the record's micro-batches, in tokens
    assert all(line[-1] == "0.00%" for line in lines[1:])  # none of them reads a token twice


def test_fineweb_like_documents_have_fineweb_lengths_and_the_command_counts_on_them(tmp_path, capsys):
    files = fineweb_like(tmp_path, 400_000, 50256, seed=1)
    ids = np.concatenate([np.asarray(open_shard(f)) for f in files])
    assert len(ids) >= 400_000 and ids.max() == 50256 and ids[0] == 50256
    lengths = np.diff([*np.flatnonzero(ids == 50256), len(ids)])
    assert abs(np.median(lengths) / FINEWEB_LIKE["median"] - 1) < 0.1  # ~700 documents
    assert 0.03 < np.mean(lengths > 2048) < 0.07  # 4.9% expected
    main(["--fineweb-like", "100000", "--seq-len", "2048"])
    out = capsys.readouterr().out
    assert "rows of 2,049 tokens from bos_id 50256" in out and "record 16,384" in out
