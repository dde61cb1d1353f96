"""Corpus sources on real files: a local dataset folder through HF datasets, the stdlib demo corpus."""
import sysconfig

import numpy as np

from data import sources
from tests.data.test_prepare import (
    MANY,
    demo_documents,
    documents_of,
    run_prepare,
    token_stream,
    write_corpus,
)


def test_a_local_dataset_folder_through_datasets(tmp_path):
    write_corpus(tmp_path / "ds", "parquet", docs=MANY, files=4)
    common = ["--dataset", str(tmp_path / "ds"), "--tokenizer", "bytes", "--val-tokens", "0", "--shard-tokens",
              "5000"]
    meta = run_prepare(*common, "--no-shuffle", "--out", str(tmp_path / "stored"))
    assert documents_of(token_stream(tmp_path / "stored")) == MANY
    assert [s["file"] for s in meta["shards"]] == ["ds_train_000001.bin"]
    assert meta["settings"]["source"] == {"kind": "huggingface", "dataset": str(tmp_path / "ds"), "subset": None,
                                          "split": "train", "text_field": "text"}
    # Dataset.shuffle (a permutation of the rows), and IterableDataset.shuffle within a buffer of 5 rows
    whole = run_prepare(*common, "--out", str(tmp_path / "whole"))
    streamed = run_prepare(*common, "--streaming", "--shuffle-buffer", "5", "--out", str(tmp_path / "streamed"))
    assert whole["settings"]["shuffle_buffer"] is None and streamed["settings"]["shuffle_buffer"] == 5
    orders = [documents_of(token_stream(tmp_path / name)) for name in ("whole", "streamed")]
    assert all(sorted(o) == sorted(MANY) and o != MANY for o in orders) and orders[0] != orders[1]
    import datasets
    rows = datasets.load_dataset(str(tmp_path / "ds"), split="train", streaming=True)
    assert orders[1] == [r["text"] for r in rows.shuffle(seed=0, buffer_size=5)]  # the seed and buffer reach it


def test_demo_corpus_is_the_stdlib_sources(tmp_path):
    out = tmp_path / "demo"
    meta = run_prepare("--demo", "--max-docs", "12", "--out", str(out), "--val-tokens", "5000",
                       "--shard-tokens", "20000")
    assert documents_of(token_stream(out)) == demo_documents(12)
    assert meta["tokenizer"] == "bytes" and meta["documents"] == 12
    names = [p.relative_to(sysconfig.get_paths()["stdlib"]).as_posix() for p in sources.stdlib_files()]
    assert names == sorted(names) and "os.py" in names and not any("site-packages" in n for n in names)
    shuffled = [sources.text_corpus(sources.stdlib_files(), seed).files for seed in (0, 0, 1)]
    assert shuffled[0] == shuffled[1] != shuffled[2] and sorted(shuffled[2]) == sorted(shuffled[0])
    assert shuffled[0] != sorted(shuffled[0])
    run_prepare("--demo", "--max-docs", "12", "--no-shuffle", "--out", str(tmp_path / "stored"),
                "--val-tokens", "5000", "--shard-tokens", "20000")
    assert documents_of(token_stream(tmp_path / "stored")) == demo_documents(12, seed=None)
    # --max-tokens cuts the same stream exactly
    cut = run_prepare("--demo", "--max-docs", "12", "--max-tokens", "12345", "--out", str(tmp_path / "cut"),
                      "--val-tokens", "5000", "--shard-tokens", "20000")
    assert cut["tokens"] == 12345 and np.array_equal(token_stream(tmp_path / "cut"), token_stream(out)[:12345])
    # bytes tokenizer: one token per byte plus one EOT per document, also when the last document is cut short
    assert 0.99 < cut["bytes_per_token"] < 1 and 0.99 < meta["bytes_per_token"] < 1


def test_each_file_is_read_once_through_links_and_a_name_with_brackets_is_a_name(tmp_path):
    corpus = tmp_path / "c"
    (corpus / "v2").mkdir(parents=True)
    (corpus / "v2" / "a.txt").write_text("one")
    (corpus / "notes[1].txt").write_text("two")
    (corpus / "latest").symlink_to("v2")  # a linked folder: its files again
    (corpus / "self").symlink_to(".")     # a link to the folder itself: the glob walks it ~40 levels deep
    found = sources.local_files(sources.folder_glob(str(corpus)))
    assert found == [corpus / "latest" / "a.txt", corpus / "notes[1].txt"]
    assert sources.local_files(str(corpus / "notes[1].txt")) == [corpus / "notes[1].txt"]
