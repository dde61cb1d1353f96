"""`python -m data.prepare` and `python -m scripts.fetch_fineweb` end to end on real files."""
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import sources
from data.prepare import PrepareError, parse_args, prepare
from data.shards import open_shard, write_shard
from scripts import fetch_fineweb
from tests.helpers import ROOT, run

DOCS = ["first document\nwith two lines\n", "héllo wörld ✓ 🙂\r\nwindows line", "x <|endoftext|> y",
        "  spaces  ", "short", "a longer one " * 9]
EOT = 256  # the bytes tokenizer's <|endoftext|>


def run_prepare(*argv: str) -> dict:
    """prepare in this process (workers=1 unless given); returns meta.json as written."""
    args = parse_args(["--workers", "1", *argv] if "--workers" not in argv else list(argv))
    prepare(args)
    return json.loads((args.out / "meta.json").read_text())


def token_stream(out: Path) -> np.ndarray:
    """All shards listed in meta.json, concatenated in order."""
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([open_shard(out / s["file"]) for s in meta["shards"]])


def documents_of(tokens: np.ndarray) -> list[str]:
    """Split a bytes-tokenizer stream on <|endoftext|> (which starts it) and decode each document."""
    assert tokens[0] == EOT
    cuts = np.flatnonzero(tokens == EOT)
    return [bytes(tokens[a + 1:b].astype(np.uint8)).decode() for a, b in zip(cuts, [*cuts[1:], len(tokens)])]


def all_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def write_corpus(folder: Path, kind: str, field: str = "text", docs: list[str] = DOCS, files: int = 2) -> str:
    """`docs` as files of one kind in `folder` (rows split over `files` files); returns the glob for --files."""
    folder.mkdir()
    rows = [{"id": i, field: d} for i, d in enumerate(docs)]
    parts = np.array_split(np.arange(len(docs)), files)  # several files, to check the order across files
    if kind == "txt":  # one document per file; names sort in document order
        for i, d in enumerate(docs):
            (folder / f"doc{i:02d}.txt").write_bytes(d.encode())
    elif kind == "jsonl":
        for n, part in enumerate(parts):
            (folder / f"{n:02d}.jsonl").write_text("".join(json.dumps(rows[i]) + "\n" for i in part))
    else:
        for n, part in enumerate(parts):
            pq.write_table(pa.Table.from_pylist([rows[i] for i in part]), folder / f"{n:02d}.parquet")
    return str(folder / f"*.{kind}")


def demo_documents(n: int, seed: int | None = 0) -> list[str]:
    """The demo corpus's first `n` documents (its non-empty files, in their order for `seed`)."""
    texts = (p.read_bytes().decode("utf-8", errors="replace")
             for p in sources.text_corpus(sources.stdlib_files(), seed).files)
    return list(islice(filter(None, texts), n))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_files_give_back_the_documents_in_order(tmp_path, kind):
    pattern = write_corpus(tmp_path / "corpus", kind, field="body")
    out = tmp_path / "out"
    meta = run_prepare("--files", pattern, "--text-field", "body", "--tokenizer", "bytes", "--out", str(out),
                       "--shard-tokens", "50", "--val-tokens", "30", "--no-shuffle")
    tokens = token_stream(out)
    assert documents_of(tokens) == DOCS
    total = sum(len(d.encode()) + 1 for d in DOCS)
    sizes = [30] + [50] * ((total - 30) // 50) + ([(total - 30) % 50] if (total - 30) % 50 else [])
    assert [s["tokens"] for s in meta["shards"]] == sizes
    assert [s["file"] for s in meta["shards"]] == ["corpus_val_000000.bin"] + [
        f"corpus_train_{i:06d}.bin" for i in range(1, len(sizes))]
    assert sorted(p.name for p in out.iterdir()) == sorted([*(s["file"] for s in meta["shards"]), "meta.json"])
    assert meta["complete"] and meta["documents"] == len(DOCS) and meta["tokens"] == total == len(tokens)
    text_bytes = sum(len(d.encode()) for d in DOCS)
    assert meta["text_bytes"] == text_bytes and meta["bytes_per_token"] == text_bytes / total
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"], meta["dtype"]) == ("bytes", 257, 256, "uint16")
    assert meta["settings"]["source"]["kind"] == "files" and meta["settings"]["source"]["pattern"] == pattern
    assert meta["settings"]["shard_tokens"] == 50 and meta["settings"]["val_tokens"] == 30
    assert (meta["settings"]["shuffle"], meta["settings"]["seed"], meta["settings"]["shuffle_buffer"]) == (
        False, None, None)


MANY = [f"document {i:02d} " * (1 + i % 4) for i in range(40)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "jsonl-streaming"])
def test_local_files_are_shuffled_as_a_whole(tmp_path, kind):
    pattern = write_corpus(tmp_path / "corpus", kind.split("-")[0], docs=MANY, files=4)
    common = ["--files", pattern, "--tokenizer", "bytes", "--val-tokens", "300", "--shard-tokens", "500",
              *(["--streaming"] if "streaming" in kind else [])]
    orders = []
    for seed in (0, 1):
        meta = run_prepare(*common, "--seed", str(seed), "--out", str(tmp_path / f"seed{seed}"))
        docs = documents_of(token_stream(tmp_path / f"seed{seed}"))
        assert sorted(docs) == sorted(MANY) and docs != MANY
        orders.append(docs)
        # the val shard samples the whole corpus: its documents come from at least 3 of the 4 quarters
        val = documents_of(open_shard(tmp_path / f"seed{seed}" / "corpus_val_000000.bin"))[:-1]  # last: cut
        assert len(val) >= 8 and len({MANY.index(d) // 10 for d in val}) >= 3, val
        assert (meta["settings"]["shuffle"], meta["settings"]["seed"], meta["settings"]["shuffle_buffer"]) == (
            True, seed, 10_000 if "streaming" in kind else None)
    assert orders[0] != orders[1]
    again = run_prepare(*common, "--out", str(tmp_path / "again"))  # --seed 0 is the default
    assert all_bytes(tmp_path / "again") == all_bytes(tmp_path / "seed0") and again["settings"]["seed"] == 0
    with pytest.raises(PrepareError, match="seed: 0 there, 2 now"):
        run_prepare(*common, "--seed", "2", "--out", str(tmp_path / "seed0"))


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    common = ["--demo", "--max-docs", "150", "--val-tokens", "100000", "--shard-tokens", "300000"]
    run_prepare(*common, "--workers", "1", "--out", str(tmp_path / "w1"))
    run_prepare(*common, "--workers", "2", "--out", str(tmp_path / "w2"))
    assert all_bytes(tmp_path / "w1") == all_bytes(tmp_path / "w2")


def test_killed_runs_resume_to_the_same_output(tmp_path):
    common = ["--demo", "--max-docs", "200", "--val-tokens", "10000", "--shard-tokens", "100000", "--workers", "1"]
    out = tmp_path / "killed"
    for shards in (3, 2):  # SIGKILLed right after its 3rd (then 2nd) shard is renamed, before meta.json lists it
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "die_at.py"), "data.shards:write_shard",
                               str(shards), "-m", "data.prepare", *common, "--out", str(out)], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        assert not json.loads((out / "meta.json").read_text())["complete"]
    run_prepare(*common, "--out", str(out))
    whole = run_prepare(*common, "--out", str(tmp_path / "whole"))
    # meta.json is among the bytes compared: documents and text_bytes were counted once across the kills.
    assert all_bytes(out) == all_bytes(tmp_path / "whole")
    assert whole["documents"] == 200 and whole["text_bytes"] == sum(
        len(d.encode()) for d in demo_documents(200))
    assert whole["empty_documents"] > 0  # the stdlib's empty __init__.py files, skipped


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_a_long_document_tokenized_in_pieces_gives_the_whole_texts_tokens(tokenizer):
    from data.prepare import pieces
    from data.tokenizer import get_tokenizer
    from tests.helpers import gpt2_bpe

    enc = get_tokenizer(str(gpt2_bpe()) if tokenizer == "gpt2" else "bytes")
    text = "".join(p.read_text(errors="replace") for p in sources.stdlib_files()[:60])
    text += "ünï 123\n\n  x.\n\n中文\n٣٤٥\nabc'\ns\nABC\r\nDé\n\u0301x\n1234567\n\n\n½\n"
    whole = enc.encode_ordinary(text)
    for size in (1, 50, 10_000):  # 1: a piece at every letter or digit before a newline
        parts = list(pieces(text, size))
        assert "".join(parts) == text and len(parts) > len(text) // (size + 10_000)
        assert [t for part in parts for t in enc.encode_ordinary(part)] == whole
    assert len(list(pieces("a line\r\n" * 100, 50))) > 1  # Windows line ends cut too


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_stops_prepare_at_once_and_keeps_the_shards(tmp_path, workers):
    # a terminal's Ctrl-C: SIGINT to the whole process group, the workers included
    out = tmp_path / "out"
    run_prepare("--demo", "--max-docs", "3", "--val-tokens", "10", "--out", str(tmp_path / "inline"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as a caller in this process had it
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", "--demo", "--workers", workers, "--val-tokens",
                             "10000", "--shard-tokens", "20000", "--out", str(out)], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        while not (out / "meta.json").exists() or len(json.loads((out / "meta.json").read_text())["shards"]) < 3:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    kept = json.loads((out / "meta.json").read_text())
    assert time.monotonic() - sent < 10 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"prepare: interrupted; kept {len(kept['shards'])} shards written so far: "
                                            f"the same command, run again, continues after the last"), err
    assert not kept["complete"] and proc.returncode == 130  # the shell's Ctrl-C status: run.sh stops there too


class Killed(BaseException):
    """Stands for a kill between two writes (a BaseException: like a real kill, it skips prepare's clean-up)."""


@pytest.mark.parametrize("kind, extra", [("txt", []), ("txt", ["--max-tokens", "75"]),
                                         ("txt", ["--max-tokens", "90"]), ("jsonl", []), ("jsonl", ["--streaming"])],
                         ids=["whole", "cut", "cut-across-a-shard-end", "datasets", "datasets-streaming"])
def test_a_kill_before_any_write_resumes_to_the_same_output(tmp_path, monkeypatch, kind, extra):
    # documents of 5, 3, 1 (empty: skipped), 3, 42 and 122 tokens, shuffled: shards end inside documents, and
    # --max-tokens cuts one short; the last .txt ends in a byte that is not UTF-8 (counted in binary_bytes)
    docs = ["a" * 4, "b" * 2, "", "c" * 2, "d" * 41, "e" * 120 + "\udcff"]
    pattern = write_corpus(tmp_path / "corpus", kind, docs=docs[:-1] + ["e" * 121] * (kind != "txt"), files=3)
    if kind == "txt":
        (tmp_path / "corpus" / "doc05.txt").write_bytes(docs[-1].encode("utf-8", errors="surrogateescape"))
    common = ["--files", pattern, "--tokenizer", "bytes", "--shard-tokens", "30", "--val-tokens", "20", *extra]
    whole = run_prepare(*common, "--out", str(tmp_path / "whole"))
    assert documents_of(token_stream(tmp_path / "whole")) != [d for d in docs if d][:whole["documents"]]
    assert whole["empty_documents"] == 1
    assert whole["binary_bytes"] == (kind == "txt") or "--max-tokens" in extra  # a cut may end before it
    want = all_bytes(tmp_path / "whole")
    writes = {"n": 0}

    def dying(write):
        def wrapped(*args, **kwargs):
            writes["n"] -= 1
            if writes["n"] < 0:
                raise Killed
            return write(*args, **kwargs)
        return wrapped
    import data.prepare
    for name in ("write_shard", "write_json"):
        monkeypatch.setattr(data.prepare, name, dying(getattr(data.prepare, name)))
    for kill_at in itertools.count():
        out, writes["n"] = tmp_path / f"killed{kill_at}", kill_at
        try:
            run_prepare(*common, "--out", str(out))
            break  # fewer writes than kill_at: every kill point is covered
        except Killed:
            pass
        writes["n"] = 10**6
        run_prepare(*common, "--out", str(out))  # the same arguments again
        assert all_bytes(out) == want, f"killed before write {kill_at}"
    assert kill_at >= 6


def test_a_corpus_too_small_for_the_val_split_leaves_nothing_and_reruns(tmp_path):
    common = ["--demo", "--max-docs", "2", "--out", str(tmp_path / "out")]
    for _ in range(2):  # the same error again, not "shards but no meta.json"
        with pytest.raises(PrepareError, match="none left for training after the val split.*lower --val-tokens or "
                                               "add documents$"):
            run_prepare(*common, "--val-tokens", "100000")
        assert not (tmp_path / "out").exists()
    meta = run_prepare(*common, "--val-tokens", "1000")
    assert meta["complete"] and any("_train_" in s["file"] for s in meta["shards"])


def test_other_settings_in_the_directory_are_refused(tmp_path):
    out = tmp_path / "out"
    common = ["--demo", "--max-docs", "3", "--val-tokens", "100", "--out", str(out)]
    run_prepare(*common, "--shard-tokens", "1000")
    before = all_bytes(out)
    run_prepare(*common, "--shard-tokens", "1000")  # same settings, complete: nothing to do
    assert all_bytes(out) == before
    with pytest.raises(PrepareError, match=rf"{out} .*shard_tokens: 1,000 there, 5,000 now.*--overwrite"):
        run_prepare(*common, "--shard-tokens", "5000")
    assert all_bytes(out) == before
    for change, diff in ((["--seed", "1"], "seed: 0 there, 1 now"),
                         (["--no-shuffle"], "seed: 0 there, None now; shuffle: True there, False now")):
        with pytest.raises(PrepareError, match=diff):
            run_prepare(*common, "--shard-tokens", "1000", *change)
    assert all_bytes(out) == before
    meta = run_prepare(*common, "--shard-tokens", "5000", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == sorted([*(s["file"] for s in meta["shards"]), "meta.json"])
    assert documents_of(token_stream(out)) == demo_documents(3)

    foreign = tmp_path / "foreign"
    write_shard(foreign / "x_train_000001.bin", [1, 2, 3])
    with pytest.raises(PrepareError, match=rf"{foreign} holds shards .*that no meta.json lists.*--overwrite"):
        run_prepare(*common[:-1], str(foreign), "--shard-tokens", "1000")


def test_cli_errors_are_clear_and_fast(tmp_path):
    pattern = write_corpus(tmp_path / "corpus", "jsonl", field="body")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("this is not a rank file\n")
    malformed, empty = tmp_path / "malformed" / "x.jsonl", tmp_path / "empty" / "y.jsonl"
    for path, text in ((malformed, '{"text": "ok"}\n{bad json\n'), (empty, "")):
        path.parent.mkdir()
        path.write_text(text)
    typed = os.path.relpath(malformed, ROOT)
    cases = [
        (["--files", pattern, "--tokenizer", "bytes"], ["no column 'text'", "['body', 'id']", "--text-field"]),
        (["--files", pattern, "--text-field", "body", "--tokenizer", str(bad)], [str(bad), "not a .tiktoken"]),
        (["--demo", "--tokenizer", "gpt2"], ["TIKTOKEN_CACHE_DIR", ".tiktoken"]),
        (["--files", str(tmp_path / "none" / "*.txt")], ["matches no file"]),
        # the files as the user named them (here: relative to the folder prepare runs in)
        (["--files", typed, "--tokenizer", "bytes"], [f"{typed}, line 2: not valid JSON (", "fix or remove it"]),
        (["--files", str(malformed), "--tokenizer", "bytes", "--streaming"], [f"{malformed}, line 2: not valid JSON"]),
        (["--files", str(empty), "--tokenizer", "bytes"], [str(empty.parent), "cannot read them (no rows)"]),
        # the same file as a local dataset folder: datasets' own reader, as for the hub
        (["--dataset", str(malformed.parent), "--tokenizer", "bytes"], [f"dataset {str(malformed.parent)!r}: "
                                                                        "cannot read it", "fix or remove"]),
    ]
    for argv, needles in cases:
        t0 = time.time()
        proc = run([sys.executable, "-m", "data.prepare", *argv, "--out", str(tmp_path / "out")], check=False,
                   env={"HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}, timeout=120)
        # fast: an error at once, no retries; 90 s leaves a busy machine room for the imports
        assert time.time() - t0 < 90 and proc.returncode == 1, proc.stderr
        # one line of ours last (datasets may log its own line about the file first)
        assert proc.stderr.strip().splitlines()[-1].startswith("prepare: error: ") and "Traceback" not in proc.stderr
        for needle in needles:
            assert needle in proc.stderr, (needle, proc.stderr)


def fetch(out: Path, shards: int, env: dict) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "scripts.fetch_fineweb", "--shards", str(shards), "--out", str(out)],
               env=env, check=False, timeout=60)


def test_the_reachability_probe_goes_where_the_download_would(monkeypatch):
    for var in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert fetch_fineweb.first_hop("https://huggingface.co") == ("huggingface.co", 443, "")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")  # a cluster whose only way out is a proxy
    assert fetch_fineweb.first_hop("https://huggingface.co")[:2] == ("proxy.example", 3128)
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert fetch_fineweb.first_hop("https://huggingface.co")[:2] == ("huggingface.co", 443)
    monkeypatch.delenv("NO_PROXY")
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("ALL_PROXY", "http://proxy.example")
    assert fetch_fineweb.first_hop("https://huggingface.co") == ("proxy.example", 80, " through the proxy proxy.example:80")


def test_argument_defaults_and_checks(tmp_path):
    demo = parse_args(["--source", "stdlib"])
    assert (demo.source, demo.tokenizer, demo.name, demo.out) == ("stdlib", "bytes", "demo", Path("shards/demo"))
    assert (demo.shuffle, demo.seed, demo.shuffle_buffer, demo.allow_binary) == (True, 0, 10_000, False)
    web = parse_args(["--dataset", "HuggingFaceFW/fineweb", "--subset", "sample-10BT"])
    assert (web.tokenizer, web.name, web.out, web.shard_tokens, web.val_tokens) == (
        "gpt2", "fineweb", Path("shards/fineweb"), 10**8, 10_485_761)  # the speedrun's eval.tokens fit
    for argv in (["--demo", "--shard-tokens", "0"], ["--demo", "--files", "x"], ["--demo", "--val-tokens", "-1"],
                 ["--demo", "--val-tokens", "1"],  # no target: a val shard needs the token before its first
                 ["--demo", "--shard-tokens", str(2**31)],  # the header's int32 count
                 ["--demo", "--shuffle-buffer", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
