"""`python -m data.prepare` on inputs that are not what they seem: binary files, empty files, a folder for
--files, and failures that must leave no half-made output folder behind."""
import json
import os
import re
import sys

import numpy as np
import pytest

from data.prepare import main
from data.shards import open_shard
from tests.helpers import run
from tests.data.test_prepare import documents_of, token_stream, write_corpus


def prepare_cli(capsys, *argv: str) -> tuple[str, str]:
    """main() in this process: (the exit message or "", stderr); the message is what the user sees last."""
    try:
        main(["--workers", "1", "--tokenizer", "bytes", *argv])
        code = None
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return (code if isinstance(code, str) else err.strip().splitlines()[-1] if code else ""), err


def text_files(folder, contents: dict[str, bytes]):
    folder.mkdir(parents=True, exist_ok=True)
    for name, raw in contents.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(raw)


def test_a_binary_file_is_refused_and_counted_by_its_real_bytes(tmp_path, capsys):
    noise = np.random.default_rng(0).bytes(20_000)
    text_files(tmp_path / "c", {"noise.txt": noise, "ok.txt": b"plain text\n" * 20})
    out = tmp_path / "out"
    common = ["--files", str(tmp_path / "c" / "*.txt"), "--out", str(out), "--val-tokens", "0"]
    message, _ = prepare_cli(capsys, *common)
    assert message.startswith(f"prepare: error: {tmp_path / 'c' / 'noise.txt'}: ")
    for needle in ("of its 20,000 bytes are not UTF-8 text", "binary", "--allow-binary"):
        assert needle in message, (needle, message)
    assert not out.exists()

    message, err = prepare_cli(capsys, *common, "--allow-binary")
    assert message == ""
    noise_path = re.escape(str(tmp_path / "c" / "noise.txt"))
    assert re.search(rf"warning: [\d,]+ bytes not UTF-8 text .* the most in {noise_path} \(4\d\.\d% of its bytes\)",
                     err), err
    meta = json.loads((out / "meta.json").read_text())
    # the metric's denominator is the files' real size, not their decoded-and-re-encoded text (36,241 bytes)
    assert meta["text_bytes"] == 20_000 + 220 and meta["bytes_per_token"] == 20_220 / meta["tokens"]


def test_a_few_undecodable_bytes_are_replaced_and_said(tmp_path, capsys):
    latin1 = "une élève à l'école, ".encode("latin-1") * 10 + "ça va ".encode() * 1000  # 40 of 7,210 bytes bad
    text_files(tmp_path / "c", {"fr.txt": latin1})
    out = tmp_path / "out"
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "c" / "*.txt"), "--out", str(out),
                               "--val-tokens", "0")
    assert message == "" and (f"prepare: warning: 40 bytes not UTF-8 text (undecodable ones became U+FFFD); "
                              f"the most in {tmp_path / 'c' / 'fr.txt'} (0.6% of its bytes)") in err, err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["text_bytes"] == len(latin1) and meta["binary_bytes"] == 40
    text = documents_of(token_stream(out))[0]
    assert text.count("\ufffd") == 40 and text.endswith("ça va ")  # one U+FFFD per undecodable byte


def test_empty_documents_are_skipped_and_counted(tmp_path, capsys):
    text_files(tmp_path / "c", {"a.txt": b"", "b.txt": b"hello", "c.txt": b""})
    out = tmp_path / "out"
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "c" / "*.txt"), "--out", str(out),
                               "--val-tokens", "0", "--no-shuffle")
    assert message == "" and "prepare: 1 document (2 empty, skipped), 6 tokens in 1 shard ->" in err, err
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["documents"], meta["empty_documents"], meta["tokens"]) == (1, 2, 6)
    assert documents_of(token_stream(out)) == ["hello"]


@pytest.mark.parametrize("val", [[], ["--val-tokens", "0"]], ids=["default-split", "no-val"])
def test_a_corpus_with_no_text_is_refused_plainly(tmp_path, capsys, val):
    text_files(tmp_path / "c", {"a.txt": b"", "b.txt": b""})
    out = tmp_path / "out"
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c" / "*.txt"), "--out", str(out), *val)
    assert message == "prepare: error: the corpus has no text: its 2 documents are all empty", message
    assert not out.exists()  # no stub meta.json either


def test_a_folder_for_files_takes_its_known_files_and_says_so(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    text_files(corpus, {"a.txt": b"one", "sub/b.txt": b"two", "notes.md": b"not taken", ".hidden.txt": b"no"})
    out = tmp_path / "out"
    message, err = prepare_cli(capsys, "--files", str(corpus), "--out", str(out), "--val-tokens", "0")
    assert message == "" and f"prepare: --files {corpus} is a folder: reading its 2 .txt files ({corpus}/**/*.txt)" \
        in err, err
    assert sorted(documents_of(token_stream(out))) == ["one", "two"]
    assert json.loads((out / "meta.json").read_text())["settings"]["name"] == "corpus"

    (corpus / "c.jsonl").write_text('{"text": "three"}\n')
    message, _ = prepare_cli(capsys, "--files", str(corpus), "--out", str(tmp_path / "out2"))
    assert message == (f"prepare: error: --files {str(corpus)!r} is a folder holding .jsonl and .txt files; "
                       f"pass one kind, e.g. --files '{corpus}/**/*.jsonl'"), message
    (tmp_path / "nothing").mkdir()
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "nothing"), "--out", str(tmp_path / "out3"))
    assert message.startswith(f"prepare: error: --files {str(tmp_path / 'nothing')!r} is a folder with no "
                              f".json, .jsonl, .parquet or .txt file"), message


def test_counts_of_one_are_singular(tmp_path, capsys):
    text_files(tmp_path / "c", {"a.txt": b"x"})
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "c" / "a.txt"), "--out", str(tmp_path / "o1"),
                               "--val-tokens", "0")
    assert message == "" and "prepare: 1 document, 2 tokens in 1 shard ->" in err, err
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c" / "a.txt"), "--out", str(tmp_path / "o2"),
                             "--max-tokens", "1")
    assert "the corpus gave only 1 token," in message and message.endswith("or raise --max-tokens (1)"), message
    bad = tmp_path / "j" / "x.jsonl"
    bad.parent.mkdir()
    bad.write_text("")
    message, _ = prepare_cli(capsys, "--files", str(bad), "--out", str(tmp_path / "o3"))
    assert f"--files {str(bad)!r} (1 file): cannot read" in message, message


def test_a_failed_prepare_leaves_nothing_behind(tmp_path, capsys):
    pattern = write_corpus(tmp_path / "corpus", "jsonl", field="body")
    out = tmp_path / "deep" / "out"
    message, _ = prepare_cli(capsys, "--files", pattern, "--text-field", "content", "--out", str(out))
    assert "no column 'content'" in message and not (tmp_path / "deep").exists()
    message, _ = prepare_cli(capsys, "--files", pattern, "--text-field", "body", "--out", str(out),
                             "--val-tokens", "100000")
    assert "none left for training" in message and not (tmp_path / "deep").exists()
    # a folder that was there before stays, empty as it was
    out.mkdir(parents=True)
    message, _ = prepare_cli(capsys, "--files", pattern, "--text-field", "content", "--out", str(out))
    assert "no column 'content'" in message and os.listdir(out) == []


def test_a_refused_binary_file_leaves_nothing_that_blocks_the_corrected_run(tmp_path, capsys):
    # the text files come first (--no-shuffle: sorted), so the val shard is written before the binary file is met
    corpus = tmp_path / "c"
    text_files(corpus, {"a.txt": b"first text file\n" * 50, "b.txt": b"second text file\n" * 50,
                        "z.txt": np.random.default_rng(0).bytes(5_000)})
    out = tmp_path / "out"
    common = ["--files", str(corpus), "--out", str(out), "--val-tokens", "100", "--no-shuffle"]
    message, _ = prepare_cli(capsys, *common)
    assert message.startswith(f"prepare: error: {corpus / 'z.txt'}: ") and "not UTF-8" in message
    assert not out.exists()  # its val shard and meta.json are gone with it
    (corpus / "z.txt").unlink()
    message, _ = prepare_cli(capsys, *common)
    assert message == "" and json.loads((out / "meta.json").read_text())["complete"]


def test_shards_of_other_settings_are_refused_naming_each_difference(tmp_path, capsys):
    corpus = tmp_path / "c"
    text_files(corpus, {"a.txt": b"some text\n" * 100})
    out = tmp_path / "out"
    common = ["--files", str(corpus / "*.txt"), "--out", str(out), "--val-tokens", "100"]
    assert prepare_cli(capsys, *common)[0] == ""
    text_files(corpus, {"b.txt": b"more text\n" * 100})
    with pytest.raises(SystemExit) as refused:
        main(["--workers", "1", "--tokenizer", "bytes", *common, "--seed", "3"])
    assert refused.value.code == 3  # the status that tells run.sh to remake its demo shards
    message = capsys.readouterr().err.strip()
    assert message == (f"prepare: error: {out} holds shards made with other settings: seed: 0 there, 3 now; "
                       f"source.bytes: 1,000 there, 2,000 now; source.files: 1 there, 2 now; write to another "
                       f"--out directory, or pass --overwrite to replace them")


def test_local_rows_are_read_without_datasets_progress_bars(tmp_path):
    # a process of its own: datasets' switch is process-wide, and another test may have turned it off
    pattern = write_corpus(tmp_path / "corpus", "jsonl")
    proc = run([sys.executable, "-m", "data.prepare", "--files", pattern, "--tokenizer", "bytes", "--workers", "1",
                "--val-tokens", "10", "--out", str(tmp_path / "out")])
    assert [line[:9] for line in proc.stderr.splitlines()] == ["prepare: "], proc.stderr


def test_a_corpus_smaller_than_the_default_val_split_keeps_a_tenth_for_val(tmp_path, capsys):
    text_files(tmp_path / "c", {f"{i}.txt": f"document {i} holds a few words of text".encode() for i in range(20)})
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert message == "" and "fewer than the default val split (--val-tokens 10,485,761)" in err, err
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    (val, val_n), (train, train_n) = [(s["file"], s["tokens"]) for s in meta["shards"]]
    assert "_val_" in val and "_train_" in train and val_n == meta["tokens"] // 10 and val_n + train_n == meta["tokens"]
    # the same command again finds its folder complete; a val split asked for is never shrunk
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert message == "" and "already complete" in err, err
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "o2"),
                             "--val-tokens", "100000")
    assert "none left for training after the val split (--val-tokens 100,000)" in message, message
    # what the val split leaves may be more than a shard: every token goes into the train shards, none is dropped
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "o3"),
                             "--shard-tokens", "100")
    small = json.loads((tmp_path / "o3" / "meta.json").read_text())
    assert message == "" and len(small["shards"]) == 1 + -(-train_n // 100) and small["tokens"] == meta["tokens"]
    assert np.array_equal(np.concatenate([open_shard(tmp_path / "o3" / s["file"]) for s in small["shards"]]),
                          np.concatenate([open_shard(tmp_path / "o" / s["file"]) for s in meta["shards"]]))
    assert small["bytes_per_token"] == meta["bytes_per_token"]


def test_overwrite_replaces_the_shards_only_once_the_new_input_gives_one(tmp_path, capsys):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"body": f"row {i} " * 20}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    common = ["--files", str(corpus / "*.jsonl"), "--out", str(out), "--val-tokens", "100", "--text-field", "body"]
    assert prepare_cli(capsys, *common)[0] == ""
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    message, _ = prepare_cli(capsys, *common[:-1], "text", "--overwrite", "--shard-tokens", "500")
    assert "no column 'text'" in message and {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert prepare_cli(capsys, *common, "--overwrite", "--shard-tokens", "500")[0] == ""
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["shard_tokens"] == 500 and sorted(p.name for p in out.iterdir()) == sorted(
        ["meta.json", *(s["file"] for s in meta["shards"])])


def test_an_out_inside_the_corpus_folder_is_not_read_as_corpus(tmp_path, capsys):
    rows = "".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(50))
    for case, out in enumerate(("c/shards", "c", ".")):  # below the corpus, the corpus's own folder, above it
        root = tmp_path / str(case)
        text_files(root / "c", {"a.jsonl": rows.encode()})
        common = ["--files", str(root / "c"), "--out", str(root / out), "--val-tokens", "100"]
        assert prepare_cli(capsys, *common)[0] == ""
        message, err = prepare_cli(capsys, *common)  # its meta.json now lies in the folder it reads
        assert message == "" and "already complete" in err, (out, message, err)


def test_an_out_that_is_a_file_is_refused_and_kept(tmp_path, capsys):
    text_files(tmp_path / "c", {"a.txt": b"some text\n" * 100})
    (tmp_path / "taken").write_text("mine")
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "taken"))
    assert message == (f"prepare: error: --out {tmp_path / 'taken'} is a file, not a folder; name a folder for the "
                       f"shards")
    assert (tmp_path / "taken").read_text() == "mine"


def test_a_dataset_that_fails_part_way_keeps_its_shards_and_resumes(tmp_path, capsys):
    # a local dataset folder, streamed (datasets' own reader, as for the hub): its second file breaks at a row
    folder = tmp_path / "ds"
    folder.mkdir()
    texts = [f"document {i} " * 10 for i in range(400)]
    rows = [json.dumps({"text": text}) + "\n" for text in texts]
    (folder / "a.jsonl").write_text("".join(rows[:300]))
    (folder / "b.jsonl").write_text("".join(rows[300:350]) + "{bad json\n" + "".join(rows[350:]))
    out = tmp_path / "out"
    common = ["--dataset", str(folder), "--streaming", "--no-shuffle", "--out", str(out),
              "--val-tokens", "1000", "--shard-tokens", "5000"]
    message, _ = prepare_cli(capsys, *common)
    kept = json.loads((out / "meta.json").read_text())
    assert not kept["complete"] and len(kept["shards"]) >= 3
    assert "cannot read a row" in message and message.endswith(
        f"; kept {len(kept['shards'])} shards written so far: the same command, run again, continues after the "
        f"last once the input is mended"), message
    # an error before any reading (a setting that differs) says nothing of what an earlier run left
    message, _ = prepare_cli(capsys, *common, "--shard-tokens", "6000")
    assert "holds shards made with other settings" in message and "kept" not in message, message
    assert all((out / s["file"]).exists() for s in kept["shards"])
    (folder / "b.jsonl").write_text("".join(rows[300:]))  # the file mended, the same command continues
    assert prepare_cli(capsys, *common)[0] == ""
    whole = json.loads((out / "meta.json").read_text())
    assert whole["complete"] and whole["shards"][:len(kept["shards"])] == kept["shards"]
    assert whole["documents"] == 400 and whole["tokens"] == sum(len(text) + 1 for text in texts)  # and a BOS each


def test_an_overwrite_that_fails_part_way_is_continued_without_overwrite(tmp_path, capsys):
    # --overwrite again would replace what it wrote: the command to continue is the one without it
    folder, out = tmp_path / "ds", tmp_path / "out"
    folder.mkdir()
    rows = [json.dumps({"text": f"document {i} " * 10}) + "\n" for i in range(400)]
    (folder / "a.jsonl").write_text("".join(rows[:300]))
    (folder / "b.jsonl").write_text("{bad json\n" + "".join(rows[300:]))  # read a file at a time: a's are written
    common = ["--dataset", str(folder), "--streaming", "--no-shuffle", "--out", str(out), "--val-tokens", "1000"]
    assert prepare_cli(capsys, "--demo", "--max-docs", "3", "--val-tokens", "100", "--out", str(out))[0] == ""
    message, _ = prepare_cli(capsys, *common, "--shard-tokens", "5000", "--overwrite")
    kept = json.loads((out / "meta.json").read_text())
    assert message.endswith(f"; kept {len(kept['shards'])} shards written so far: the same command without "
                            f"--overwrite, run again, continues after the last once the input is mended"), message
    (folder / "b.jsonl").write_text("".join(rows[300:]))
    assert prepare_cli(capsys, *common, "--shard-tokens", "5000")[0] == ""
    whole = json.loads((out / "meta.json").read_text())
    assert whole["complete"] and whole["shards"][:len(kept["shards"])] == kept["shards"] and whole["documents"] == 400


def test_a_resume_on_input_changed_before_its_resume_point_is_refused_and_the_shards_kept(tmp_path, capsys):
    # the mend the message asks for, in a shuffled stream: the bad row removed moves the rows the buffer held, so
    # the re-run's first documents are not those written (it went on at the count: 18 of 600 twice, 18 never)
    folder, out = tmp_path / "ds", tmp_path / "out"
    folder.mkdir()
    texts = [f"document {i} " * 10 for i in range(600)]
    rows = [json.dumps({"text": text}) + "\n" for text in texts]
    (folder / "train.jsonl").write_text("".join(rows[:300]) + json.dumps({"text": 5}) + "\n" + "".join(rows[300:]))
    common = ["--dataset", str(folder), "--streaming", "--shuffle-buffer", "100", "--out", str(out),
              "--val-tokens", "1000", "--shard-tokens", "2000"]
    message, _ = prepare_cli(capsys, *common)
    kept = json.loads((out / "meta.json").read_text())
    assert "a row's 'text' is '5' (int)" in message and f"kept {len(kept['shards'])} shards" in message, message
    shards = {s["file"]: (out / s["file"]).read_bytes() for s in kept["shards"]}
    (folder / "train.jsonl").write_text("".join(rows))
    message, _ = prepare_cli(capsys, *common)
    assert message == (f"prepare: error: {out} holds shards of other documents than the input's first "
                       f"{kept['documents'] + kept['empty_documents']:,} now (it changed since they were written): "
                       f"restore the input, write to another --out, or pass --overwrite to re-create them"), message
    assert {name: (out / name).read_bytes() for name in shards} == shards
    assert json.loads((out / "meta.json").read_text()) == kept
    assert prepare_cli(capsys, *common, "--overwrite")[0] == ""
    assert sorted(documents_of(token_stream(out))) == sorted(texts)


@pytest.mark.parametrize("mend", ["changed", "gone"])
def test_a_resume_whose_document_written_in_part_changed_or_is_gone_is_refused(tmp_path, capsys, monkeypatch, mend):
    # killed after its first shard: document 0 written whole, 19 of document 1's 61 tokens with it
    import data.prepare
    from tests.data.test_prepare import Killed

    folder, out = tmp_path / "ds", tmp_path / "out"
    folder.mkdir()
    rows = [json.dumps({"text": text}) + "\n" for text in ("a" * 10, "b" * 60)]
    (folder / "train.jsonl").write_text("".join(rows))
    common = ["--dataset", str(folder), "--no-shuffle", "--out", str(out), "--val-tokens", "0", "--shard-tokens", "30"]
    shards, write_shard = [], data.prepare.write_shard

    def dying(*args, **kwargs):
        if shards:
            raise Killed
        shards.append(write_shard(*args, **kwargs))
    monkeypatch.setattr(data.prepare, "write_shard", dying)
    with pytest.raises(Killed):
        prepare_cli(capsys, *common)
    monkeypatch.undo()
    kept = json.loads((out / "meta.json").read_text())
    assert (kept["documents"], kept["partial_doc_tokens"]) == (1, 19)
    (folder / "train.jsonl").write_text(rows[0] + ("" if mend == "gone" else json.dumps({"text": "c" * 60}) + "\n"))
    message, _ = prepare_cli(capsys, *common)
    assert message.startswith(f"prepare: error: {out} holds shards of other documents than the input's first 2 now"), \
        message
    assert json.loads((out / "meta.json").read_text()) == kept


def test_parquet_files_without_rows_or_with_other_columns_are_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": "some text " * 20}]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": "more text " * 20, "id": 1}]), folder / "b.parquet")
    message, _ = prepare_cli(capsys, "--files", str(folder), "--out", str(tmp_path / "o"), "--val-tokens", "10")
    assert message == (f"prepare: error: {folder / 'b.parquet'}: column(s) ['id'] that {folder / 'a.parquet'} lacks "
                       f"(its columns: ['text']); the files are read by the first one's columns: give them the same "
                       f"ones, or narrow --files")
    # a later file with fewer columns than the first is read as the first's: prepared
    fewer = tmp_path / "q"
    fewer.mkdir()
    (folder / "b.parquet").rename(fewer / "a.parquet")
    (folder / "a.parquet").rename(fewer / "b.parquet")
    assert prepare_cli(capsys, "--files", str(fewer), "--out", str(tmp_path / "q_out"), "--val-tokens", "10")[0] == ""
    pq.write_table(pa.Table.from_pylist([{"text": "some text " * 20, "id": 1}]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("text", pa.string()), ("id", pa.int64())])),
                   folder / "b.parquet")
    message, _ = prepare_cli(capsys, "--files", str(folder), "--out", str(tmp_path / "o"), "--val-tokens", "10")
    assert message == (f"prepare: error: {folder / 'b.parquet'}: a .parquet file with no rows; remove it (or narrow "
                       f"--files)")
    assert not (tmp_path / "o").exists()


def test_a_resume_that_finds_no_document_left_finishes(tmp_path, capsys):
    # killed after its last shard was listed but before meta.json said complete: the re-run reads no document
    text_files(tmp_path / "c", {f"{i}.txt": b"12345678" for i in range(3)})  # 9 tokens each, with the BOS
    common = ["--files", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--val-tokens", "9", "--shard-tokens",
              "18", "--no-shuffle"]
    assert prepare_cli(capsys, *common)[0] == ""
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    (tmp_path / "o" / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    assert prepare_cli(capsys, *common)[0] == ""
    assert json.loads((tmp_path / "o" / "meta.json").read_text()) == meta


def test_a_later_json_file_is_checked_as_the_first_is_naming_the_file_and_row(tmp_path, capsys):
    """datasets reads every file by the first one's types: a later file's number became its digits, a list its
    JSON, and a file whose rows lack the field was dropped as empty documents, each without a word."""
    corpus = tmp_path / "j"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 10}) + "\n" for i in range(40)))
    good = "".join(json.dumps({"text": f"more {i} " * 10}) + "\n" for i in range(40))
    cases = [(good + '{"text": 12345}\n', ", line 41: its 'text' is a number, not text; fix or remove that row"),
             ("\n\n" + good + '{"text": [1, 2]}\n', ", line 43: its 'text' is an array, not text"),  # blank lines
             (good + "{bad json\n", ", line 41: not valid JSON (Missing a name for object member); fix or remove it"),
             (good + "[1, 2]\n", ", line 41: not a JSON object; fix or remove it"),
             ('{\n"text": "two lines"\n}\n{"text": 5}\n', ", row 2: its 'text' is a number"),  # no line per row
             ("".join(json.dumps({"id": i}) + "\n" for i in range(5)),
              " has no column 'text'; available columns: ['id']. Pass the right one with --text-field"),
             ('{"text": null}\n' * 3, ": every one of its 3 rows has 'text' null or missing")]
    cases.append((good + '{"text": "caf\udce9"}\n', ", line 41: its 'text' is not UTF-8 text; fix or remove that row"))
    for text, error in cases:
        (corpus / "b.jsonl").write_bytes(text.encode("utf-8", "surrogateescape"))  # a lone byte 0xe9
        message, _ = prepare_cli(capsys, "--files", str(corpus), "--out", str(tmp_path / "out"), "--val-tokens", "10")
        assert message.startswith(f"prepare: error: {corpus / 'b.jsonl'}{error}"), message
        assert not (tmp_path / "out").exists()
    arrays = tmp_path / "arrays"
    arrays.mkdir()
    (arrays / "a.json").write_text(json.dumps([{"text": "an item " * 10}] * 40))
    (arrays / "b.json").write_text(json.dumps([{"text": "an item " * 10}, None, {"text": 7.5}]))  # a null: no text
    message, _ = prepare_cli(capsys, "--files", str(arrays), "--out", str(tmp_path / "out"), "--val-tokens", "10")
    assert message == (f"prepare: error: {arrays / 'b.json'}: item 3's 'text' is '7.5' (float), not text; fix or "
                       f"remove it, or pass the text column with --text-field"), message
    (corpus / "b.jsonl").write_text("")  # an empty file gives no document, as before
    assert prepare_cli(capsys, "--files", str(corpus), "--out", str(tmp_path / "out"), "--val-tokens", "10")[0] == ""
    # a row longer than pyarrow's 1 MiB block (a book): read in larger blocks, not refused as "not valid JSON"
    (corpus / "b.jsonl").write_text(json.dumps({"text": "a long book " * 200_000}) + "\n")
    assert prepare_cli(capsys, "--files", str(corpus), "--out", str(tmp_path / "long"), "--val-tokens", "10")[0] == ""


def test_null_texts_are_empty_documents_and_other_values_are_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "j"
    corpus.mkdir()
    rows = [{"text": "first row " * 10}, {"text": None}, {"id": 3}, {"text": "last row " * 10}]
    (corpus / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for streaming in ([], ["--streaming"]):  # datasets' Arrow copy fills the missing field with a null too
        out = tmp_path / f"j_out{len(streaming)}"
        message, err = prepare_cli(capsys, "--files", str(corpus), "--out", str(out), "--val-tokens", "0",
                                   "--no-shuffle", *streaming)
        assert message == "" and "prepare: 2 documents (2 empty, skipped)" in err, err
        assert documents_of(token_stream(out)) == ["first row " * 10, "last row " * 10]
    (corpus / "a.jsonl").write_text(json.dumps({"text": "a row " * 10}) + "\n" + json.dumps({"text": 12345}) + "\n")
    message, _ = prepare_cli(capsys, "--files", str(corpus / "a.jsonl"), "--out", str(tmp_path / "bad"))
    assert message == (f"prepare: error: {corpus / 'a.jsonl'}, line 2: its 'text' is a number, not text; fix or "
                       f"remove that row, or pass the text column with --text-field"), message
    # parquet: datasets would read a later file's numbers as the first file's strings (their digits), or a file
    # without the column as nulls
    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["some text " * 20], "id": [1]}), folder / "a.parquet")
    for text in (pa.array(["more text " * 20]).dictionary_encode(), pa.array([None], pa.null())):  # read as text
        pq.write_table(pa.table({"text": text}), folder / "b.parquet")
        message, err = prepare_cli(capsys, "--files", str(folder), "--out", str(tmp_path / f"{text.type}"),
                                   "--val-tokens", "10")
        assert message == "", message
    for table, why in [(pa.table({"text": [7]}), "column 'text' holds int64, not text"),
                       (pa.table({"id": [2]}), "has no column 'text'; available columns: ['id']")]:
        pq.write_table(table, folder / "b.parquet")
        message, _ = prepare_cli(capsys, "--files", str(folder), "--out", str(tmp_path / "p_out"))
        assert message.startswith(f"prepare: error: {folder / 'b.parquet'}") and why in message, message
        assert not (tmp_path / "p_out").exists()


def test_folders_are_found_by_name_and_an_earlier_prepares_output_in_them_is_no_corpus(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus[v2]"  # a name that is also a glob
    text_files(corpus, {"a.txt": b"one " * 30, "b.txt": b"two " * 30})
    message, _ = prepare_cli(capsys, "--files", str(corpus), "--out", str(corpus / "shards"), "--val-tokens", "10")
    assert message == "" and sorted(documents_of(token_stream(corpus / "shards"))) == ["one " * 30, "two " * 30]
    # a second prepare of it beside the first: the first's meta.json is not a .json document
    message, err = prepare_cli(capsys, "--files", str(corpus), "--out", str(corpus / "again"), "--val-tokens", "10")
    assert message == "" and "reading its 2 .txt files" in err, err
    monkeypatch.setenv("HOME", str(tmp_path))
    message, _ = prepare_cli(capsys, "--files", "~/corpus[v2]", "--out", str(tmp_path / "home"), "--val-tokens", "10")
    assert message == "" and json.loads((tmp_path / "home" / "meta.json").read_text())["documents"] == 2


def test_an_out_that_cannot_be_made_is_one_line(tmp_path, capsys):
    text_files(tmp_path / "c", {"a.txt": b"some text\n" * 100})
    (tmp_path / "file").write_text("mine")
    out = tmp_path / "file" / "shards"
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(out), "--val-tokens", "10")
    assert message == f"prepare: error: --out {out}: cannot write there (Not a directory); choose another --out"
    assert (tmp_path / "file").read_text() == "mine"


def test_a_corpus_of_a_few_tokens_gets_a_val_shard_of_two(tmp_path, capsys):
    text_files(tmp_path / "c", {"a.txt": b"abcd"})  # 5 tokens with the BOS
    message, _ = prepare_cli(capsys, "--files", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert message == "" and [s["tokens"] for s in meta["shards"]] == [2, 3]
    text_files(tmp_path / "d", {"a.txt": b"a"})  # 2 tokens: a val shard leaves none to train on
    message, err = prepare_cli(capsys, "--files", str(tmp_path / "d"), "--out", str(tmp_path / "o2"))
    assert "the corpus gave only 2 tokens, none left for training" in message and "val shard" not in err
