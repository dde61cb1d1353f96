"""Corpus -> token shards: `python -m data.prepare`.

    python -m data.prepare --demo --out shards/demo           # offline: the stdlib's .py files, bytes tokenizer
    python -m data.prepare --dataset HuggingFaceFW/fineweb --subset sample-10BT --streaming \\
        --tokenizer gpt2 --out shards/fineweb
    python -m data.prepare --files 'corpus/*.jsonl' --text-field text --name mine --out shards/mine

The token stream is every non-empty document preceded by <|endoftext|>, in an order shuffled by --seed
(the whole corpus: a permutation of the files, or of a dataset's rows; a streamed dataset within a buffer of
--shuffle-buffer rows) or, with --no-shuffle, as stored. It is cut exactly, even inside a document (as llm.c
and modded-nanogpt do): the first --val-tokens tokens go to DIR/<name>_val_000000.bin, a random sample of the
documents (without --val-tokens, a tenth of a corpus smaller than its default), the rest to
DIR/<name>_train_000001.bin, ... of --shard-tokens tokens each (the last one shorter).
DIR/meta.json describes them: tokenizer, vocab_size, eot_token, dtype, shards (file and token count),
documents, empty_documents (skipped: no text, or a null), tokens, text_bytes (the source's bytes), binary_bytes,
bytes_per_token, and "settings" (what determines the output).
It is rewritten after every shard with "complete": false and the resume point, so a killed run, started
again with the same arguments, continues after its last shard and ends with the same bytes as an
uninterrupted run; it first reads the documents before that point, which must be those written (input_sha256).
Another run's shards in DIR are refused unless --overwrite, which replaces them only once the
new corpus has given its first shard. A run that fails before its first shard, or refuses its input (a binary file,
too little text), leaves nothing behind; one whose reading fails part-way (the network, the disk) keeps its shards.
It exits 2 on bad arguments, 1 on an error, 130 when interrupted (Ctrl-C), and 3 where DIR holds shards it cannot
continue (run.sh remakes its derived demo shards then, and only then).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from util.atomic import DiskFullError, remove_left_behind, write_json
from data import sources
from data.meta import META, MetaError, read_meta
from data.shards import ShardError, dtype_for_vocab, open_shard, write_shard
from data.tokenizer import TokenizerError, eot_token, get_tokenizer, recorded_name
from util.plural import plural

BATCH_DOCS = 64  # documents per worker task: large enough to amortize pickling, small enough to balance
# A document is tokenized a piece at a time: a token list of the whole would take ~36 bytes a character
# (a 60 MB text file took 2.3 GB)
PIECE_CHARS = 2**20
CUT = re.compile(r"[^\W_][\r\n]")
# More than 1% of a file's bytes not UTF-8 text is not a UTF-8 text file (measured: random or compressed data
# 43%, /bin/ls 53%, UTF-16 text 50%, latin-1 French prose 7%); a few bad bytes are a typo's worth.
BINARY_SHARE = 0.01
VAL_TOKENS = 10 * 2**20 + 1  # --val-tokens' default: the speedrun's eval (configs/speedrun_8xh100.toml)
OUR_SHARDS = ("*_val_[0-9][0-9][0-9][0-9][0-9][0-9].bin", "*_train_[0-9][0-9][0-9][0-9][0-9][0-9].bin")


class PrepareError(ValueError):
    """An output directory or argument that prepare cannot use; the message says the fix."""


class OtherShards(PrepareError):
    """--out holds shards prepare cannot continue (of other settings, unknown ones, or not as meta.json lists
    them): replaced only under --overwrite."""


OTHER_SHARDS_STATUS = 3  # the exit status that says so (OtherShards)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="Hugging Face dataset, e.g. HuggingFaceFW/fineweb")
    src.add_argument("--files", help="glob of local .txt (one document per file), .jsonl or .parquet files, "
                                     "or a folder (its files of the one kind it holds, subfolders included)")
    src.add_argument("--demo", dest="source", action="store_const", const="stdlib",
                     help="offline demo corpus: this Python's standard library sources (same as --source stdlib)")
    src.add_argument("--source", choices=["stdlib"])
    p.add_argument("--subset", help="dataset config name, e.g. sample-10BT")
    p.add_argument("--split", default="train")
    p.add_argument("--text-field", default="text", help="column holding the text (.jsonl, .parquet, datasets)")
    p.add_argument("--streaming", action="store_true",
                   help="stream the dataset (or local .jsonl/.parquet) instead of making an Arrow copy first; "
                        "it is then shuffled within --shuffle-buffer rows, not as a whole")
    p.add_argument("--seed", type=int, default=0, help="the documents' shuffled order")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                   help="keep the stored order (a corpus shuffled already; the val split is then its start)")
    p.add_argument("--shuffle-buffer", type=int, default=sources.SHUFFLE_BUFFER,
                   help="rows held to shuffle a streamed dataset")
    p.add_argument("--allow-binary", action="store_true",
                   help=f"keep files of which over {BINARY_SHARE:.0%}% of the bytes are not UTF-8 text "
                        f"(undecodable bytes become U+FFFD)")
    p.add_argument("--tokenizer", help="bytes | gpt2 | any tiktoken name | a .tiktoken file "
                                       "(default: bytes for the demo corpus, else gpt2)")
    p.add_argument("--name", help="shard file prefix (default: demo, or a slug of the dataset/folder name)")
    p.add_argument("--out", help="output directory (default: shards/NAME)")
    p.add_argument("--shard-tokens", type=int, default=10**8)
    p.add_argument("--val-tokens", type=int,
                   help=f"the first N tokens form the val shard (0: none); the default, {VAL_TOKENS:,}, covers the "
                        f"speedrun's eval (10,485,760 targets and the token before the first), and a smaller "
                        f"corpus gives a tenth of its tokens instead")
    p.add_argument("--max-docs", type=int, help="stop after this many (non-empty) documents")
    p.add_argument("--max-tokens", type=int, help="stop after this many tokens (cut exactly)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),  # the CPUs a SLURM job may use
                   help="tokenizer processes (1: inline; default: the CPUs this process may run on)")
    p.add_argument("--overwrite", action="store_true", help="replace shards of other settings in --out")
    args = p.parse_args(argv)
    for flag in ("shard_tokens", "workers", "max_docs", "max_tokens", "shuffle_buffer"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("shard_tokens", "val_tokens"):  # the llm.c header stores the count as an int32
        if getattr(args, flag) is not None and getattr(args, flag) > 2**31 - 1:
            p.error(f"--{flag.replace('_', '-')} must be < 2**31 (the shard header's int32 token count)")
    args.fit_val = args.val_tokens is None  # a corpus smaller than the default split keeps a tenth (_tokenize)
    args.val_tokens = VAL_TOKENS if args.fit_val else args.val_tokens
    if args.val_tokens < 0 or args.val_tokens == 1:
        p.error("--val-tokens must be 0 (no val shard) or at least 2 (a target and the token before it)")
    args.tokenizer = recorded_name(args.tokenizer or ("bytes" if args.source else "gpt2"))
    args.name = args.name or _slug(args)
    args.out = Path(args.out or Path("shards") / args.name)
    return args


def open_source(args: argparse.Namespace) -> tuple[dict, sources.Corpus]:
    """A description of the corpus (it goes into meta.json) and its documents, in the order they are written."""
    seed = args.seed if args.shuffle else None
    if args.source == "stdlib":
        files = sources.stdlib_files()
        return ({"kind": "stdlib", "python": sys.version.split()[0], **_file_stats(files)},
                sources.text_corpus(files, seed))
    if args.files:
        pattern = args.files
        if os.path.isdir(os.path.expanduser(pattern)):
            pattern = sources.folder_glob(pattern, skip=args.out / META)
        files = sources.local_files(pattern, skip=args.out / META)
        if pattern != args.files:
            print(f"prepare: --files {args.files} is a folder: reading its "
                  f"{plural(len(files), files[0].suffix + ' file')} ({pattern})", file=sys.stderr)
        description = {"kind": "files", "pattern": pattern, "text_field": args.text_field, **_file_stats(files)}
        if sources.BUILDERS[files[0].suffix] is None:
            return description, sources.text_corpus(files, seed)
        # Unshuffled rows are streamed in place: only a shuffle as a whole needs datasets' Arrow copy.
        return description, sources.row_corpus(files, args.text_field, seed, args.streaming or seed is None,
                                               args.shuffle_buffer, given=args.files)
    # --streaming changes how the rows arrive, not which: not part of the description (its buffer's order is).
    return ({"kind": "huggingface", "dataset": args.dataset, "subset": args.subset, "split": args.split,
             "text_field": args.text_field},
            sources.hub_corpus(args.dataset, args.subset, args.split, args.text_field, seed, args.streaming,
                               args.shuffle_buffer))


def _file_stats(files: list[Path]) -> dict:
    # Count and size stand for the content: a resumed run must not continue on a changed corpus.
    return {"folder": str(Path(os.path.commonpath([p.parent for p in files])).resolve()), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files)}


def _slug(args: argparse.Namespace) -> str:
    if args.source:
        return "demo"
    folder = args.files and os.path.isdir(os.path.expanduser(args.files))
    base = (args.dataset.rsplit("/", 1)[-1] if args.dataset else
            Path(args.files).name if folder else Path(args.files).parent.name)
    return re.sub(r"[^a-z0-9]+", "_", base.lower()).strip("_") or "corpus"


def start_meta(out: Path, settings: dict, overwrite: bool) -> tuple[dict, list[Path]]:
    """meta.json to continue from (a fresh one, or the one a run with the same settings left in `out`), and under
    `overwrite` the files of `out` that the first new shard replaces (meta.json first)."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file, not a folder; name a folder for the shards")
    remove_left_behind(out)  # by a killed writer (atomic_path cleans up only on exceptions)
    found = sorted({p.name for pattern in OUR_SHARDS for p in out.glob(pattern)})
    old = _read_meta(out) if (out / META).exists() and not overwrite else None
    fresh = {"complete": False, "settings": settings, "shards": [], "documents": 0, "empty_documents": 0,
             "partial_doc_tokens": 0, "tokens": 0, "text_bytes": 0, "binary_bytes": 0}
    if overwrite:  # meta.json first: it must never list shards that are gone
        return fresh, [out / name for name in [META, *found] if (out / name).exists()]
    if old is not None and old["settings"] != settings and old["shards"]:  # without shards: nothing to keep
        diffs = [f"{key}: {_value(there)} there, {_value(now)} now"
                 for key, there, now in _differences(old["settings"], settings)]
        raise OtherShards(f"{out} holds shards made with other settings: {'; '.join(diffs)}; write to another "
                          f"--out directory, or pass --overwrite to replace them")
    elif old is not None and old["settings"] == settings:
        _check_listed_shards(out, old)
        return old, []
    elif found:
        raise OtherShards(f"{out} holds shards ({found[0]} ...) that no {META} lists, so their settings are "
                          f"unknown; write to another --out directory or pass --overwrite to replace them")
    return fresh, []


def _differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) of each setting that differs, nested ones (the source's) by their own
    keys."""
    diffs = []
    for key in dict.fromkeys([*old, *new]):
        there, now = old.get(key), new.get(key)
        if isinstance(there, dict) and isinstance(now, dict):
            diffs += _differences(there, now, f"{prefix}{key}.")
        elif there != now:
            diffs.append((prefix + key, there, now))
    return diffs


def _value(value: object) -> str:
    """A setting as the mismatch message shows it: counts with thousands separators."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else repr(value)


def _read_meta(out: Path) -> dict:
    try:
        meta = read_meta(out)
    except MetaError as e:
        meta = e.problem
    if not isinstance(meta, dict) or not {"settings", "shards", "complete"} <= meta.keys():
        raise OtherShards(f"{out / META}: not a meta.json written by data.prepare ({str(meta)[:100]}); "
                          f"write to another --out directory or pass --overwrite")
    return meta


def _check_listed_shards(out: Path, meta: dict) -> None:
    for shard in meta["shards"]:
        try:
            n = len(open_shard(out / shard["file"]))
        except ShardError as e:
            n = str(e)
        if n != shard["tokens"]:
            raise OtherShards(f"{out / shard['file']}: {META} lists {shard['tokens']} tokens, found {n}; "
                              f"the directory was changed by hand: pass --overwrite to re-create it")


_ENC = None  # each worker process builds its tokenizer once, in _init_worker


def _init_worker(tokenizer: str, dtype: str) -> None:
    global _ENC
    enc = get_tokenizer(tokenizer)
    _ENC = enc, eot_token(enc), np.dtype(dtype)


def _init_pool_worker(tokenizer: str, dtype: str) -> None:
    # a terminal's Ctrl-C reaches every process of its group: the parent alone stops, after the tasks in flight
    # (a worker stopped while it sends a result would leave the pool's reader waiting for the rest)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer, dtype)


def _encode(docs: list[str | bytes]) -> list[tuple[np.ndarray, int, int, bytes]]:
    enc, eot, dtype = _ENC
    out = []
    for doc in docs:
        digest = doc_digest(doc)
        if isinstance(doc, bytes):  # a whole file: its real size counts, not that of its decoded text
            text, binary = sources.decode(doc)
            nbytes = len(doc)
        else:
            text, binary, nbytes = doc, 0, len(doc.encode("utf-8", errors="replace"))
        # ordinary: a literal "<|endoftext|>" in a document is just text
        ids = [np.array(enc.encode_ordinary(piece), dtype=dtype) for piece in pieces(text)]
        out.append((np.concatenate([np.array([eot], dtype=dtype), *ids]), nbytes, binary, digest))
    return out


def doc_digest(doc: str | bytes) -> bytes:
    """The sha256 of a document as the corpus gives it (a file's bytes, a row's text)."""
    return hashlib.sha256(doc if isinstance(doc, bytes) else doc.encode("utf-8", "surrogatepass")).digest()


def chained(chain: bytes, digest: bytes) -> bytes:
    """The digest of the documents so far (`chain`: those before) and one more (its `digest`)."""
    return hashlib.sha256(chain + digest).digest()


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters or more, cut only where a letter or digit meets a line end:
    every tokenizer here (GPT-2's, tiktoken's, bytes) starts a piece of its own pattern there, so the pieces'
    tokens are the whole text's."""
    start = 0
    while len(text) - start > size:
        cut = CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start:cut.end() - 1]
        start = cut.end() - 1
    yield text[start:]


def encode_documents(docs: Iterable[str | bytes], tokenizer: str, dtype: np.dtype,
                     workers: int) -> Iterator[tuple[np.ndarray, int, int, bytes]]:
    """Each document's tokens (<|endoftext|> first), its size in bytes, how many of those are not UTF-8
    text and its doc_digest, in order, tokenized by `workers` processes."""
    docs = iter(docs)
    batches = iter(lambda: list(islice(docs, BATCH_DOCS)), [])
    if workers == 1:
        _init_worker(tokenizer, dtype.str)
        for batch in batches:
            yield from _encode(batch)
        return
    # A bounded queue of tasks instead of Pool.imap: imap's feeder thread would read the whole corpus ahead.
    pool, pending = multiprocessing.Pool(workers, _init_pool_worker, (tokenizer, dtype.str)), deque()
    try:
        for batch in batches:
            pending.append(pool.apply_async(_encode, (batch,)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()
    finally:
        # Not Pool.terminate (what `with` does): a worker killed while it sends a big result leaves the pool's
        # reader thread waiting for the rest of the message for ever (a --max-docs run that stopped reading early
        # hung here for 10 minutes). The tasks in flight are a few batches: let them finish (a task that a dead
        # worker took never does: then terminate after all).
        deadline = time.monotonic() + 60
        for task in pending:
            task.wait(max(0.0, deadline - time.monotonic()))
        if all(task.ready() for task in pending):
            pool.close()
        else:
            pool.terminate()
        pool.join()


def shard_file(meta: dict) -> tuple[str, int]:
    """The name and token count of the next shard: the val shard first (if any), then train shards."""
    name, val = meta["settings"]["name"], meta["settings"]["val_tokens"]
    if val and not meta["shards"]:
        return f"{name}_val_000000.bin", val
    index = len(meta["shards"]) + (0 if val else 1)
    return f"{name}_train_{index:06d}.bin", meta["settings"]["shard_tokens"]


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize the corpus into shards in args.out (resuming a killed run); return the final meta.json."""
    source, corpus = open_source(args)
    enc = get_tokenizer(args.tokenizer)
    dtype = dtype_for_vocab(enc.n_vocab)
    settings = {"name": args.name, "tokenizer": args.tokenizer, "vocab_size": enc.n_vocab, "source": source,
                "shard_tokens": args.shard_tokens, "val_tokens": args.val_tokens, "max_docs": args.max_docs,
                "max_tokens": args.max_tokens, "shuffle": args.shuffle, "seed": args.seed if args.shuffle else None,
                "shuffle_buffer": corpus.shuffle_buffer}
    made = [p for p in (args.out, *args.out.parents) if not p.exists()]  # deepest first
    meta, replaced = start_meta(args.out, settings, args.overwrite)
    meta.update(tokenizer=args.tokenizer, vocab_size=enc.n_vocab, eot_token=eot_token(enc), dtype=dtype.name)
    if meta["complete"]:
        print(f"prepare: {args.out} is already complete ({plural(meta['tokens'], 'token')}); "
              f"nothing to do", file=sys.stderr)
        return meta
    try:
        return _tokenize(args, corpus, meta, dtype, replaced)
    except (Exception, KeyboardInterrupt) as e:
        # --overwrite's old files are still all there: nothing of this run was written; or its shards are another
        # input's, kept until --overwrite replaces them
        if replaced or isinstance(e, OtherShards):
            raise
        # A refused local input: the corrected corpus has other settings, so no re-run could continue these
        # shards (a hub dataset's settings are its names: its shards wait for a re-run). A folder holding only
        # meta.json would look like a prepare in progress.
        refused = isinstance(e, (PrepareError, sources.SourceError)) and not isinstance(e, sources.ReadError)
        if refused and source["kind"] != "huggingface" or not meta["shards"]:
            _remove(args.out, meta, made)
        else:
            # for main's last line: what a re-run continues after, the shards meta.json lists (a stop that came
            # as a shard was written finds it not listed yet)
            e.kept = len(_read_meta(args.out)["shards"])
        raise


def _remove(out: Path, meta: dict, made: list[Path]) -> None:
    """Delete meta.json, the shards it lists and the folders `made` for them (deepest first)."""
    with contextlib.suppress(OSError):  # an --out that could not be made: nothing there, and its error stands
        (out / META).unlink(missing_ok=True)  # first: it must never list shards that are gone
        for shard in meta["shards"]:
            (out / shard["file"]).unlink(missing_ok=True)
    for folder in made:
        with contextlib.suppress(OSError):  # not empty: someone else's files, keep them
            folder.rmdir()


def _tokenize(args: argparse.Namespace, corpus: sources.Corpus, meta: dict, dtype: np.dtype,
              replaced: list[Path]) -> dict:
    """Write the corpus's documents, from where `meta` stopped, into shards, the files `replaced` (emptied then)
    deleted before the first; return meta.json's final values."""
    # One loop, long: its resume state (documents done, the partial document's written tokens, the byte counts)
    # goes into meta.json at every shard written, so pieces of it would pass all of that back and forth.
    def write(tokens: np.ndarray, size: int | None = None) -> np.ndarray:
        if replaced:  # --overwrite: the old files go once the corpus has given a shard, not on a wrong argument
            for path in replaced:
                path.unlink(missing_ok=True)
            replaced.clear()
            write_json(args.out / META, meta)
        return _write_next(args.out, meta, tokens, size)

    if not replaced:
        write_json(args.out / META, meta)  # before any shard: a shard whose settings are unknown blocks a re-run
    # The demo's stdlib holds encoding test files (test/encoded_modules/module_koi8_r.py: 42% not UTF-8)
    allow_binary = args.allow_binary or args.source == "stdlib"
    # Documents resume at the first not fully written, `skip` of its tokens already in the shards.
    done, empty, skip = meta["documents"], meta["empty_documents"], meta["partial_doc_tokens"]
    first = done + empty
    docs, chain = _read_past(corpus, meta, args.out)
    stream = encode_documents(docs, args.tokenizer, dtype, args.workers)
    t0, written = time.time(), meta["tokens"]
    bar = tqdm(unit="tok", unit_scale=True, initial=written, file=sys.stderr, disable=None, desc="prepare")
    # byte counts of the documents done; a document's own are added once it is written to its end
    counts = {"text_bytes": meta["text_bytes"], "binary_bytes": meta["binary_bytes"]}
    buf, buffered, worst, doc = [], 0, (0.0, None), first - 1  # doc: the last document read
    for doc, (toks, nbytes, binary, digest) in enumerate(stream, first):
        if args.max_docs is not None and done >= args.max_docs:
            break
        if doc == first and skip and meta.get("partial_doc_sha256", digest.hex()) != digest.hex():
            raise _changed(args.out, first + 1)
        chain, before = chained(chain, digest), chain  # the documents' digest with this one, and without
        if nbytes == 0:
            empty += 1
            continue
        if binary and binary / nbytes > worst[0]:
            worst = binary / nbytes, corpus.files[doc]
        if binary > BINARY_SHARE * nbytes and not allow_binary:
            raise _binary_error(corpus.files[doc], binary, nbytes)
        full, offset = len(toks), skip if doc == first else 0  # offset: its tokens written before a resume
        toks = toks[offset:]
        if args.max_tokens is not None and len(toks) > args.max_tokens - meta["tokens"] - buffered:
            toks = toks[:args.max_tokens - meta["tokens"] - buffered]
            # a document cut short counts the share of its bytes that its kept tokens stand for
            nbytes = nbytes * (offset + len(toks)) // full
        buf.append(toks)
        buffered += len(toks)
        bar.update(len(toks))
        bar.set_postfix_str(f"docs={done + 1:,}", refresh=False)
        while buffered >= shard_file(meta)[1]:
            rest = write(np.concatenate(buf))
            buf, buffered = [rest], len(rest)
            # The rest, if any, is the tail of this document: resume re-tokenizes it and skips what is written
            # (counted from the document's start: a --max-tokens cut may have dropped its end).
            finished = not len(rest)
            meta.update(documents=done + finished, empty_documents=empty,
                        partial_doc_tokens=0 if finished else offset + len(toks) - len(rest),
                        input_sha256=(chain if finished else before).hex(),
                        partial_doc_sha256=None if finished else digest.hex(),
                        text_bytes=counts["text_bytes"] + nbytes * finished,
                        binary_bytes=counts["binary_bytes"] + binary * finished)
            write_json(args.out / META, meta)
        done += 1
        counts["text_bytes"] += nbytes
        counts["binary_bytes"] += binary
        if args.max_tokens is not None and meta["tokens"] + buffered >= args.max_tokens:
            break
    bar.close()
    if skip and doc < first:  # the document written in part is no longer in the input
        raise _changed(args.out, first + 1)
    if args.fit_val and not meta["shards"] and 3 <= buffered <= args.val_tokens:
        val = max(2, buffered // 10)  # a target and the token before it, and at least one token to train on
        print(f"prepare: the corpus gave {plural(buffered, 'token')}, fewer than the default val split "
              f"(--val-tokens {args.val_tokens:,}): its first {val:,} form the val shard, the rest the train data",
              file=sys.stderr)
        rest = write(np.concatenate(buf), size=val)
        buf, buffered = [rest], len(rest)
    cut = args.max_tokens is not None and meta["tokens"] + buffered >= args.max_tokens
    _check_training_left(meta, buffered, empty, args.val_tokens, args.max_tokens if cut else None)
    rest = np.concatenate(buf) if buf else np.empty(0, dtype)  # none: a resume that found no document left
    while len(rest):  # after the small corpus's val split, more than a shard's worth can be left
        rest = write(rest)
    meta.update(documents=done, empty_documents=empty, partial_doc_tokens=0, **counts, complete=True,
                input_sha256=chain.hex(), partial_doc_sha256=None)
    # For bits per byte: the loss is a mean over every token, <|endoftext|> included.
    meta["bytes_per_token"] = meta["text_bytes"] / meta["tokens"]
    write_json(args.out / META, meta)
    _report(args.out, meta, done, empty, (meta["tokens"] - written) / max(time.time() - t0, 1e-9), worst)
    return meta


def _read_past(corpus: sources.Corpus, meta: dict, out: Path) -> tuple[Iterator[str | bytes], bytes]:
    """The corpus's documents from the resume point on, and the chained digest of those before it, which must be
    the one meta.json keeps (where it keeps one): an input changed since the last shard would be continued on
    other documents (a row mended in a shuffled corpus moves the others)."""
    first = meta["documents"] + meta["empty_documents"]
    docs, chain = corpus.documents(), hashlib.sha256().digest()  # no document yet: the digest of nothing
    if first:
        print(f"prepare: continuing {out} at document {first:,}: reading the ones before it, to check that they "
              f"are those its shards hold", file=sys.stderr)
    for doc in islice(docs, first):
        chain = chained(chain, doc_digest(doc))
    if meta.get("input_sha256", chain.hex()) != chain.hex():
        raise _changed(out, first)
    return docs, chain


def _changed(out: Path, documents: int) -> OtherShards:
    return OtherShards(f"{out} holds shards of other documents than the input's first {documents:,} now (it changed "
                       f"since they were written): restore the input, write to another --out, or pass --overwrite to "
                       f"re-create them")


def _binary_error(path: Path, binary: int, nbytes: int) -> PrepareError:
    """The error for the document at `path`, `binary` of whose `nbytes` bytes are not UTF-8 text."""
    return PrepareError(f"{path}: {binary / nbytes:.1%} of its {nbytes:,} bytes are not UTF-8 "
                        f"text (undecodable or NUL): a binary file, or text in another encoding. Remove it "
                        f"(or narrow --files), convert it to UTF-8 (iconv -f ENCODING -t UTF-8 ...), or "
                        f"pass --allow-binary to keep it (undecodable bytes become U+FFFD)")


def _check_training_left(meta: dict, buffered: int, empty: int, val_tokens: int, max_tokens: int | None) -> None:
    """Refuse a corpus with no text, or with none left for a train shard after the val split (`buffered`
    tokens not yet written; `empty` documents skipped; `max_tokens`: --max-tokens where it cut the corpus)."""
    if not meta["tokens"] + buffered:
        raise PrepareError("the corpus has no text: " + ("it has no documents" if not empty else
                           "its one document is empty" if empty == 1 else f"its {empty:,} documents are all empty"))
    if not any("_train_" in s["file"] for s in meta["shards"]) and (not buffered or "_val_" in shard_file(meta)[0]):
        # checked before the last write: a val shard alone would be a finished-looking folder with no train data
        raise PrepareError(f"the corpus gave only {plural(meta['tokens'] + buffered, 'token')}, none left "
                           f"for training after the val split (--val-tokens {val_tokens:,}); lower --val-tokens or "
                           + (f"raise --max-tokens ({max_tokens:,})" if max_tokens else "add documents"))


def _report(out: Path, meta: dict, done: int, empty: int, rate: float, worst: tuple[float, Path | None]) -> None:
    """The closing lines on stderr: what was written and how fast, and the bytes that were not UTF-8 text (the
    most in the document `worst` names, with its share)."""
    skipped = f" ({empty:,} empty, skipped)" if empty else ""
    print(f"prepare: {plural(done, 'document')}{skipped}, {plural(meta['tokens'], 'token')} in "
          f"{plural(len(meta['shards']), 'shard')} -> {out} ({rate:,.0f} tokens/s)", file=sys.stderr)
    if meta["binary_bytes"]:
        most = f"; the most in {worst[1]} ({worst[0]:.1%} of its bytes)" if worst[1] else ""
        print(f"prepare: warning: {plural(meta['binary_bytes'], 'byte')} not UTF-8 text (undecodable "
              f"ones became U+FFFD){most}", file=sys.stderr)


def _write_next(out: Path, meta: dict, tokens: np.ndarray, size: int | None = None) -> np.ndarray:
    """Write the next shard from the head of `tokens` (at most `size`, default its own size); return the tokens
    left over."""
    name, own = shard_file(meta)
    size = size or own
    write_shard(out / name, tokens[:size], dtype=meta["dtype"])
    n = min(size, len(tokens))
    meta["shards"].append({"file": name, "tokens": n})
    meta["tokens"] += n
    return tokens[size:]


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m data.prepare`."""
    args = parse_args(argv)
    try:
        prepare(args)
    except OtherShards as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        sys.exit(OTHER_SHARDS_STATUS)
    except (PrepareError, TokenizerError, sources.SourceError, DiskFullError) as e:
        sys.exit(f"prepare: error: {e}{_kept(e, args.overwrite)}")
    except OSError as e:  # a file it cannot read, or an --out it cannot make or write (a file in the way)
        where = Path(e.filename or "")
        if where == args.out or args.out in where.parents:
            sys.exit(f"prepare: error: --out {args.out}: cannot write there ({e.strerror}); choose another "
                     f"--out{_kept(e, args.overwrite)}")
        sys.exit(f"prepare: error: {e.filename or 'a read'}: {e.strerror or e}{_kept(e, args.overwrite)}")
    except KeyboardInterrupt as e:
        print(f"prepare: interrupted{_kept(e, args.overwrite)}", file=sys.stderr)
        sys.exit(130)


def _kept(error: BaseException, overwrite: bool) -> str:
    """The end of a failed run's last line: the shards it kept for a re-run to continue from (prepare's `kept`),
    where it kept some; `overwrite`: the run had --overwrite, which a re-run must leave out to continue."""
    kept = getattr(error, "kept", 0)
    # a dataset's row it refused stops a re-run at the same place, until the dataset is mended
    when = " once the input is mended" if isinstance(error, sources.SourceError) and not isinstance(
        error, sources.ReadError) else ""
    command = "the same command without --overwrite" if overwrite else "the same command"
    return (f"; kept {plural(kept, 'shard')} written so far: {command}, run again, continues after the "
            f"last{when}" if kept else "")


if __name__ == "__main__":
    main()
