"""Tokenizers: the byte-level one, local .tiktoken files, and gpt2 failing fast when offline."""
import base64
import json
import os
import socket
import sys
import time

import numpy as np
import pytest

from data import tokenizer
from data.tokenizer import TokenizerError, eot_token, get_tokenizer
from tests.helpers import ROOT, run

TEXTS = ["", "hello world", "héllo wörld ✓ 🙂 中文", "a\r\nb\rc\n\n\t\0 end", "x <|endoftext|> y", "  lead  trail  "]


def test_bytes_tokenizer_is_utf8_bytes_and_round_trips():
    enc = get_tokenizer("bytes")
    assert (enc.n_vocab, eot_token(enc), enc.name) == (257, 256, "bytes")
    for text in TEXTS:
        ids = enc.encode_ordinary(text)
        assert ids == list(text.encode("utf-8"))
        assert enc.decode(ids) == text
    raw = np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8).tobytes()
    assert enc.decode_bytes(list(raw)) == raw
    assert enc.encode_ordinary(raw.decode("utf-8", errors="replace")) == list(
        raw.decode("utf-8", errors="replace").encode("utf-8"))


def write_ranks(path, ranks: dict[bytes, int]) -> None:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items()))


def test_local_tiktoken_file_splits_with_the_gpt2_pattern(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"o ": 256, b"he": 257, b"ll": 258, b"hell": 259, b"hello": 260, b" w": 261})
    path = tmp_path / "tiny.tiktoken"
    write_ranks(path, ranks)
    enc = get_tokenizer(str(path))
    assert (enc.n_vocab, eot_token(enc), enc.name) == (263, 262, "tiny")
    # GPT-2's pattern cuts "hello| world" before the space, so the cheaper merge "o " never applies.
    assert enc.encode_ordinary("hello world") == [260, 261, *b"orld"]
    assert enc.decode(enc.encode_ordinary("hello world")) == "hello world"


@pytest.mark.parametrize("content,message", [
    (b"not base64! 1\n", ":1: not a .tiktoken rank file"),
    (b"aGk= 1 2\n", ":1: not a .tiktoken rank file"),
    (b"aGk= one\n", ":1: not a .tiktoken rank file"),
    (b"aGk= 1\naGo= -5\n", r":2: rank -5 is not in \[0, 2\*\*32 - 1\)"),
    (b"aGk= 1099511627776\n", r":1: rank 1099511627776 is not in"),
    (b"aGk= 1\n", "256 single bytes have no rank"),
    (b"", "256 single bytes have no rank"),
])
def test_bad_tiktoken_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as err:
        get_tokenizer(str(path))
    assert str(path) in str(err.value)


def test_repeated_ranks_and_missing_or_unknown_names(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 3
    write_ranks(tmp_path / "dup.tiktoken", ranks)
    with pytest.raises(TokenizerError, match="ranks repeat"):
        get_tokenizer(str(tmp_path / "dup.tiktoken"))
    with pytest.raises(TokenizerError, match="no such .tiktoken file"):
        get_tokenizer(str(tmp_path / "absent.tiktoken"))
    with pytest.raises(TokenizerError, match="unknown tokenizer 'gpt3'.*gpt2"):
        get_tokenizer("gpt3")
    # cl100k_base's ranks with GPT-2's pattern and end-of-text id would be another tokenizer under its name
    del ranks[b"ab"]
    write_ranks(tmp_path / "cl100k_base.tiktoken", ranks)
    with pytest.raises(TokenizerError, match="not tokenize like tiktoken's cl100k_base; use the name --tokenizer"):
        get_tokenizer(str(tmp_path / "cl100k_base.tiktoken"))


# A proxy on a closed port makes any download fail at once, whatever network the test machine has.
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}


def test_gpt2_offline_fails_fast_with_the_offline_hint(tmp_path):
    code = "from data.tokenizer import get_tokenizer; get_tokenizer('gpt2')"
    t0 = time.time()
    proc = run([sys.executable, "-c", code], env={"TIKTOKEN_CACHE_DIR": str(tmp_path), **NO_NETWORK},
               check=False, timeout=60)
    assert time.time() - t0 < 10
    assert proc.returncode != 0 and "TokenizerError" in proc.stderr
    assert "TIKTOKEN_CACHE_DIR" in proc.stderr and ".tiktoken" in proc.stderr
    assert "python -m scripts.gpt2_bpe --out DIR" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_a_download_that_hangs_is_cut_off(tmp_path, monkeypatch):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        proxy = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for key, value in NO_NETWORK.items():
            monkeypatch.setenv(key, proxy if value else "")
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(tokenizer, "DOWNLOAD_DEADLINE_S", 1.0)
        t0 = time.time()
        with pytest.raises(TokenizerError, match="no answer within 1 s.*TIKTOKEN_CACHE_DIR"):
            get_tokenizer("r50k_base")
        assert time.time() - t0 < 5


def test_prefix_tokens_are_the_longest_proper_prefix_that_is_a_token(tmp_path):
    """As record 88 builds its table: the longest proper prefix of a token's bytes that is itself a token; none
    for a single byte and for <|endoftext|>; a token at or past vocab_size is never a target, so the next
    shorter prefix stands in."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"ab": 256, b"abc": 257, b"abcd": 258, b"bcd": 259, b"abcde": 260, b"xy": 261})
    write_ranks(tmp_path / "tiny.tiktoken", ranks)
    enc = get_tokenizer(str(tmp_path / "tiny.tiktoken"))  # <|endoftext|> = 262
    table = tokenizer.prefix_tokens(enc, 263)
    a, b, x = ord("a"), ord("b"), ord("x")
    assert table[256:] == [a, 256, 257, b, 258, x, -1]  # "bcd": "bc" is no token, so "b"
    assert table[:256] == [-1] * 256
    assert tokenizer.prefix_tokens(enc, 258)[256:] == [a, 256]  # below the model's vocabulary
    assert tokenizer.prefix_tokens(enc, 300)[258:] == [257, b, 258, x, -1] + [-1] * 37
    assert tokenizer.prefix_tokens(get_tokenizer("bytes"), 257) == [-1] * 257


def data_gym_files(folder, merges: list[tuple[str, str]]) -> dict[str, str]:
    """vocab.bpe and encoder.json of a tiny vocabulary in GPT-2's published format, written to `folder`: the 256
    bytes as GPT-2 spells them (printable ones as themselves, the rest as chr(256 + n)), then `merges` in rank
    order; returns their sha256 values, as check_bpe_folder takes them."""
    import hashlib
    import json

    order = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    spelled = {b: chr(b) for b in order}
    for n, b in enumerate(b for b in range(256) if b not in spelled):
        order.append(b)
        spelled[b] = chr(256 + n)
    table = {spelled[b]: rank for rank, b in enumerate(order)}
    for first, second in merges:
        table[first + second] = len(table)
    (folder / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (folder / "encoder.json").write_text(json.dumps(table))
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in ("vocab.bpe", "encoder.json")}


def test_a_bpe_folder_loads_with_its_hashes_and_refuses_other_files(tmp_path, monkeypatch):
    hashes = data_gym_files(tmp_path, [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w")])
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    enc = tokenizer.load_bpe_folder(tmp_path, hashes)
    # the files are read where they are: nothing copied into tiktoken's cache, and its setting left as it was
    assert os.listdir(tmp_path / "cache") == [] and os.environ["TIKTOKEN_CACHE_DIR"] == str(tmp_path / "cache")
    assert (enc.n_vocab, eot_token(enc)) == (262, 261)
    # "Ġ" is how GPT-2 spells a space; a single printable byte's rank counts from "!" (33) on
    assert enc.encode_ordinary("hello world") == [259, 260, *(c - 33 for c in b"orld")]
    assert enc.decode(enc.encode_ordinary("hello world")) == "hello world"
    with pytest.raises(TokenizerError, match="vocab.bpe: sha256 .*not GPT-2's file") as err:
        get_tokenizer(str(tmp_path))  # a folder is taken as GPT-2's: these are not its files
    assert str(tmp_path / "vocab.bpe") in str(err.value) and "python -m scripts.gpt2_bpe" in str(err.value)
    (tmp_path / "encoder.json").unlink()
    with pytest.raises(TokenizerError, match="encoder.json: missing"):
        tokenizer.load_bpe_folder(tmp_path, hashes)


def test_a_bpe_folder_whose_two_files_disagree_is_refused(tmp_path):
    hashes = data_gym_files(tmp_path, [("h", "e"), ("l", "l")])
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nl l\nh e\n")  # the same merges, ranks swapped
    hashes["vocab.bpe"] = __import__("hashlib").sha256((tmp_path / "vocab.bpe").read_bytes()).hexdigest()
    with pytest.raises(TokenizerError, match="do not make one vocabulary"):
        tokenizer.load_bpe_folder(tmp_path, hashes)


def test_gpt2s_real_files_give_gpt2(tmp_path):
    from tests.helpers import gpt2_bpe

    enc = get_tokenizer(str(gpt2_bpe()))
    assert (enc.name, enc.n_vocab, eot_token(enc)) == ("gpt2", 50257, 50256)
    assert enc.encode_ordinary("Hello world") == [15496, 995] and enc.encode_ordinary(" the") == [262]
    for text in TEXTS:
        assert enc.decode(enc.encode_ordinary(text)) == text


def test_a_tokenizer_file_or_folder_is_recorded_by_its_absolute_path(tmp_path):
    # prepare run where the file is, its meta.json read from elsewhere (sample.py, train.py's prefix targets)
    write_ranks(tmp_path / "mine.tiktoken", {bytes([b]): b for b in range(256)})
    (tmp_path / "corpus.txt").write_text("some text to tokenize\n" * 50)
    run([sys.executable, "-m", "data.prepare", "--files", "corpus.txt", "--tokenizer", "mine.tiktoken", "--val-tokens",
         "100", "--out", "shards"], cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    recorded = json.loads((tmp_path / "shards" / "meta.json").read_text())["tokenizer"]
    assert recorded == str(tmp_path / "mine.tiktoken") and get_tokenizer(recorded).n_vocab == 257
    assert tokenizer.recorded_name("gpt2") == "gpt2" and tokenizer.recorded_name("bytes") == "bytes"
