"""Corpus sources: each is a `Corpus` whose documents come in a fixed order (a permutation drawn from a
seed, or as stored; seed=None), so that a run can be resumed at the first document it did not write.

    text_corpus(stdlib_files())                     the running Python's standard library (offline demo)
    text_corpus(local_files("dir/*.txt"))           local .txt files, one document per file
    row_corpus(local_files("dir/*.jsonl"), "text")  a column of local .jsonl/.json/.parquet rows
    hub_corpus("HuggingFaceFW/fineweb", "sample-10BT", streaming=True)
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from util.optional import import_optional
from util.plural import plural

# file suffix -> the `datasets` builder that reads it (None: read here, one document per file)
BUILDERS = {".txt": None, ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
THIRD_PARTY = {"site-packages", "dist-packages"}
SHUFFLE_BUFFER = 10_000  # rows a streamed dataset is shuffled within, held in memory (datasets' default: 1,000)
TEXT_TYPES = {"string", "large_string", "string_view"}  # the Arrow types of a text column
BATCH_ROWS = 1000  # rows of a Dataset read per take: one at a time was 6x slower (50k shuffled 2-KB rows)
# surrogateescape decodes each byte that is not UTF-8 to one of these stand-ins, so they can be counted
ESCAPED = re.compile("[\udc80-\udcff]")


class SourceError(ValueError):
    """A corpus that cannot be read as asked; the message names it and the fix."""


class ReadError(SourceError):
    """A read that failed on the way (the network, the disk), not on what it read: the same corpus may read when
    the command runs again, so what was written from it so far is kept."""


READERS_NEED = "reading .jsonl/.json/.parquet files and hub datasets"  # what the datasets package serves here


@dataclass(frozen=True)
class Corpus:
    """A source's documents in their final order. `documents()` yields them: bytes for whole files (then
    `files` lists them, in the same order; `decode` turns them into text), str for the text of rows.
    `shuffle_buffer`: the rows a streamed dataset is shuffled within (None: shuffled as a whole, or not at all); it
    changes the order, so it is one of the output's settings."""
    documents: Callable[[], Iterator[str | bytes]]
    files: list[Path] | None = None
    shuffle_buffer: int | None = None


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library (no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in THIRD_PARTY]  # pruned, not filtered: site-packages can be huge
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_corpus(files: list[Path], seed: int | None = 0) -> Corpus:
    """One document per file, its raw bytes, in a permutation of `files` drawn from `seed` (None: as given)."""
    files = list(files)
    if seed is not None:
        random.Random(seed).shuffle(files)
    # Read as bytes: text mode (and datasets' "text" builder) would turn "\r\n" into "\n".
    return Corpus(lambda: (p.read_bytes() for p in files), files)


def decode(raw: bytes) -> tuple[str, int]:
    """A file's text (each byte that is not UTF-8 becomes U+FFFD) and how many of its bytes are not UTF-8 text:
    undecodable, or NUL (which no text holds, and which is half of a UTF-16 file)."""
    try:
        text, undecodable = raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text, undecodable = ESCAPED.subn("\ufffd", raw.decode("utf-8", errors="surrogateescape"))
    return text, undecodable + raw.count(0)


def _matches(pattern: str, skip: Path | None) -> list[Path]:
    """The files a glob matches (`**` allowed), or the one file it names (brackets in a name are no glob), sorted,
    each file once (a linked folder, or a link to a folder above, would give it again), less the file `skip`
    (prepare's own meta.json, where its output folder lies in the corpus's: no document)."""
    pattern = os.path.expanduser(pattern)
    found = [pattern] if os.path.isfile(pattern) else glob.glob(pattern, recursive=True)
    files = {}  # (device, inode): the first name of each file in sorted order (a link's, where it sorts first)
    for path in sorted(Path(p) for p in found if os.path.isfile(p)):
        files.setdefault(_identity(path), path)
    files.pop(_identity(skip) if skip is not None and skip.is_file() else None, None)
    return list(files.values())


def _identity(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


def folder_glob(folder: str, skip: Path | None = None) -> str:
    """The glob of the one known kind of file under `folder` (recursive; hidden files left out, as a shell's
    glob would; not the file `skip`, nor the meta.json of shards an earlier prepare wrote there); an error when
    it holds none or several kinds."""
    inside = os.path.join(glob.escape(os.path.expanduser(folder)), "**")  # a folder named "corpus[v2]" is no glob
    found = {p.suffix for p in _matches(os.path.join(inside, "*"), skip) if not _shards_meta(p)}
    kinds = sorted(found & BUILDERS.keys())
    if not kinds:
        raise SourceError(f"--files {folder!r} is a folder with no {_listed(sorted(BUILDERS), 'or')} file; "
                          f"pass a folder or a glob of those (quote the glob for the shell)")
    if len(kinds) > 1:
        raise SourceError(f"--files {folder!r} is a folder holding {_listed(kinds, 'and')} files; pass one kind, "
                          f"e.g. --files '{os.path.join(inside, '*' + kinds[0])}'")
    return os.path.join(inside, f"*{kinds[0]}")


def _shards_meta(path: Path) -> bool:
    """Whether `path` is the meta.json of token shards (prepare's output), not a document."""
    return path.name == "meta.json" and any(path.parent.glob("*.bin"))


def _listed(words: list[str], last: str) -> str:
    return f"{', '.join(words[:-1])} {last} {words[-1]}" if len(words) > 1 else words[0]


def local_files(pattern: str, skip: Path | None = None) -> list[Path]:
    """The files a glob matches (`**` allowed), sorted, not the file `skip` nor the meta.json of shards; all must
    share one supported suffix."""
    files = [p for p in _matches(pattern, skip) if not _shards_meta(p)]
    if not files:
        raise SourceError(f"--files {pattern!r} matches no file; check the path (quote the glob for the shell)")
    suffixes = sorted({p.suffix for p in files})
    if len(suffixes) > 1 or suffixes[0] not in BUILDERS:
        raise SourceError(f"--files {pattern!r} matches files with suffixes {suffixes}; expected one of "
                          f"{sorted(BUILDERS)} — narrow the glob to one kind of file per run")
    return files


def row_corpus(files: list[Path], text_field: str = "text", seed: int | None = 0, streaming: bool = False,
               buffer: int = SHUFFLE_BUFFER, given: str | None = None) -> Corpus:
    """The `text_field` of every row of local .jsonl/.json/.parquet files, read by `datasets`; `given`: how the
    user named them (--files), for the messages."""
    datasets = import_optional("datasets", READERS_NEED, SourceError)

    # its "Generating train split" bars would come between prepare's own lines; a hub dataset keeps them (and its
    # download bars), the one sign of life in a long download
    datasets.disable_progress_bars()
    named = f"--files {given!r}" if given else f"{files[0].parent}/*{files[0].suffix}"
    where = f"{named} ({plural(len(files), 'file')})"
    (_check_parquet if files[0].suffix == ".parquet" else _check_json)(files, text_field)

    def load():  # streaming reads the files in place; otherwise datasets builds its Arrow copy in HF_HOME
        try:
            return datasets.load_dataset(BUILDERS[files[0].suffix], data_files=[str(p) for p in files],
                                         split="train", streaming=streaming)
        except (StopIteration, ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
            why = " ".join(str(e.__cause__ or e).split())[:300] or "no rows"  # StopIteration: empty files
            raise SourceError(f"{where}: cannot read them ({why}); fix or remove the bad file") from None
    return _row_corpus(load, text_field, where, seed, streaming, buffer, malformed="fix or remove the bad file")


def _check_parquet(files: list[Path], field: str) -> None:
    """Refuse, naming the file, a .parquet file with no rows, with a column the first file lacks, or whose `field`
    is missing or not text: datasets reads the files by the first one's columns and types (a column of numbers
    would become their digits), and answers the others with an error that names no file."""
    pa = import_optional("pyarrow", READERS_NEED, SourceError)
    parquet = import_optional("pyarrow.parquet", READERS_NEED, SourceError)
    first = None
    for path in files:
        try:
            meta = parquet.read_metadata(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise SourceError(f"{path}: not a readable .parquet file ({str(e)[:200]}); fix or remove it") from None
        schema = meta.schema.to_arrow_schema()
        columns = sorted(schema.names)
        if meta.num_rows == 0:
            raise SourceError(f"{path}: a .parquet file with no rows; remove it (or narrow --files)")
        first = first or (path, columns)
        if extra := sorted(set(columns) - set(first[1])):
            raise SourceError(f"{path}: column(s) {extra} that {first[0]} lacks (its columns: {first[1]}); the files "
                              f"are read by the first one's columns: give them the same ones, or narrow --files")
        if field not in columns:
            raise _no_text(str(path), field, columns)
        kind = schema.field(field).type
        kind = kind.value_type if pa.types.is_dictionary(kind) else kind  # a categorical column's values
        if not (pa.types.is_null(kind) or str(kind) in TEXT_TYPES):  # null: every row empty
            raise SourceError(f"{path}: column {field!r} holds {kind}, not text; pass the text column with "
                              f"--text-field (its columns: {columns}), or narrow --files")


def _check_json(files: list[Path], field: str) -> None:
    """Refuse, naming the file and line, a .jsonl/.json row whose `field` is not text, and a file none of whose rows
    has it: datasets reads every file by the first one's types (a later file's numbers would become their digits,
    its rows without the field empty documents), and its errors name no file. Empty files are let through."""
    for path in files:
        with open(path, "rb") as f:
            array = f.read(64).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")  # one JSON array of rows
        (_check_json_array if array else _check_json_lines)(path, field)


def _check_json_lines(path: Path, field: str) -> None:
    """_check_json for a file of JSON lines: its `field` alone, read as text by pyarrow in blocks as large as its
    longest line needs (pyarrow's 1 MiB refuses a longer one)."""
    pa = import_optional("pyarrow", READERS_NEED, SourceError)
    pa_json = import_optional("pyarrow.json", READERS_NEED, SourceError)
    only_field = pa_json.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]),
                                      unexpected_field_behavior="ignore")
    block = 1 << 20
    while True:
        rows = texts = 0
        try:
            for batch in pa_json.open_json(path, pa_json.ReadOptions(block_size=block), only_field):
                _check_utf8(batch.column(0), path, field, rows)
                rows, texts = rows + batch.num_rows, texts + batch.num_rows - batch.column(0).null_count
            break
        except SourceError:
            raise
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            why = str(e).removeprefix("JSON parse error: ")
            if "straddl" in why and block < path.stat().st_size:
                block *= 4
                continue
            if why == "Empty JSON stream":
                return
            raise _json_error(path, field, why, rows) from None
    if rows and not texts:
        with open(path, "rb") as f:
            first = json.loads(next(line for line in f if line.strip()).lstrip(b"\xef\xbb\xbf"))
        raise _textless(path, field, first, rows, "row")


def _json_error(path: Path, field: str, why: str, before: int) -> SourceError:
    """The error for pyarrow's `why` (its "JSON parse error: " left out), met in the block after `before` rows of
    `path`: the line, and a row whose field is no text, or that is no JSON object, said as such."""
    where = re.search(r" in row (\d+)$", why)  # counted from the start of the block that failed
    line = _where(path, before + int(where[1]) + 1) if where else "a line"
    if kind := re.fullmatch(r"Column\(/.+\) changed from string to (\w+) in row \d+", why):
        return SourceError(f"{path}, {line}: its {field!r} is {'an' if kind[1][0] in 'aeiou' else 'a'} {kind[1]}, "
                           f"not text; fix or remove that row, or pass the text column with --text-field")
    what = "not a JSON object" if why.startswith("Column() changed from object") else \
        f"not valid JSON ({why[:where.start() if where else 200].rstrip('.')})"
    return SourceError(f"{path}, {line}: {what}; fix or remove it")


def _where(path: Path, row: int) -> str:
    """Where `path`'s `row`-th row (counted from 1) is: its line, where each line before it holds one row (blank
    lines none), else the row's number (pyarrow also reads a row over several lines, or two on one)."""
    with open(path, "rb") as f:
        seen = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            seen += 1
            if seen == row:
                return f"line {number}"
            try:
                json.loads(line.lstrip(b"\xef\xbb\xbf"))
            except ValueError:
                break
    return f"row {row}"


def _check_utf8(texts: Any, path: Path, field: str, before: int) -> None:
    """Refuse a pyarrow string array `texts` (rows `before` + 1 on of `path`) that holds bytes that are not UTF-8,
    naming the row: pyarrow's JSON reader takes them, datasets' later read fails naming no file."""
    try:
        texts.validate(full=True)
    except ValueError as e:  # ArrowInvalid: "Invalid UTF8 sequence at string index N"
        index = re.search(r"index (\d+)", str(e))
        line = _where(path, before + int(index[1]) + 1) if index else "a line"
        raise SourceError(f"{path}, {line}: its {field!r} is not UTF-8 text; fix or remove that row") from None


def _textless(path: Path, field: str, first: Any, count: int, noun: str) -> SourceError:
    """The error for a file none of whose `count` rows has text in `field`: the keys its `first` row has instead."""
    if isinstance(first, dict) and field not in first:
        return _no_text(str(path), field, list(first))
    return SourceError(f"{path}: every one of its {plural(count, noun)} has {field!r} null or missing; pass the "
                       f"text column with --text-field, or narrow --files")


def _check_json_array(path: Path, field: str) -> None:
    """_check_json for a .json file that holds one array: of rows, or of strings (datasets' "text" column)."""
    try:
        rows = json.loads(path.read_bytes())
    except ValueError as e:
        raise SourceError(f"{path}: not valid JSON ({str(e)[:200]}); fix or remove it") from None
    texts = 0
    for i, row in enumerate(rows, 1):
        if row is not None and not isinstance(row, (dict, str)):  # a null: a row with no text, as in .jsonl
            raise SourceError(f"{path}: item {i} is {str(row)[:60]!r} ({type(row).__name__}), not a JSON object; "
                              f"fix or remove it")
        text = row.get(field) if isinstance(row, dict) else row if field == "text" else None
        if text is not None and not isinstance(text, str):
            raise SourceError(f"{path}: item {i}'s {field!r} is {str(text)[:60]!r} ({type(text).__name__}), not "
                              f"text; fix or remove it, or pass the text column with --text-field")
        texts += text is not None
    if rows and not texts:
        raise _textless(path, field, rows[0], len(rows), "item")


def hub_corpus(dataset: str, subset: str | None = None, split: str = "train", text_field: str = "text",
               seed: int | None = 0, streaming: bool = False, buffer: int = SHUFFLE_BUFFER) -> Corpus:
    """The `text_field` of every row of a Hugging Face hub dataset (or a local dataset folder)."""
    datasets = import_optional("datasets", READERS_NEED, SourceError)

    def load():
        try:
            return datasets.load_dataset(dataset, subset, split=split, streaming=streaming)
        except datasets.exceptions.DatasetGenerationError as e:  # e.g. a local dataset folder's malformed file
            raise SourceError(f"dataset {dataset!r}: cannot read it ({str(e.__cause__ or e)[:300]}); fix or remove "
                              f"the bad file") from None
        except (ConnectionError, FileNotFoundError, ValueError) as e:
            error = ReadError if isinstance(e, ConnectionError) else SourceError
            raise error(f"cannot load Hugging Face dataset {dataset!r} (subset {subset!r}, split {split!r}): "
                        f"{str(e)[:300]}. Check the names, the network, or HF_DATASETS_OFFLINE with a "
                        f"filled cache (HF_HOME)") from e
    return _row_corpus(load, text_field, f"dataset {dataset!r}", seed, streaming, buffer)


def _row_corpus(load: Callable[[], Any], field: str, where: str, seed: int | None, streaming: bool, buffer: int,
                malformed: str | None = None) -> Corpus:
    return Corpus(lambda: _texts(load(), field, where, malformed, seed, buffer),
                  shuffle_buffer=buffer if streaming and seed is not None else None)


def _texts(rows: Any, field: str, where: str, malformed: str | None, seed: int | None,
           buffer: int) -> Iterator[str]:
    """The `field` strings of a Dataset or IterableDataset, shuffled by `seed` (None: as stored): a Dataset as a
    whole (a permutation of its indices), an IterableDataset within `buffer` rows."""
    datasets = import_optional("datasets", READERS_NEED, SourceError)

    if isinstance(rows, datasets.IterableDataset):  # the columns are known only row by row
        rows = rows.shuffle(seed=seed, buffer_size=buffer) if seed is not None else rows
        return text_column(rows, field, where, malformed)
    if field not in rows.column_names:
        raise _no_text(where, field, rows.column_names)
    if seed is not None:
        rows = rows.shuffle(seed=seed, keep_in_memory=True)  # its index: 8 bytes a row, not one more cache file
    batches = rows.select_columns([field]).iter(batch_size=BATCH_ROWS)
    return text_column(({field: text} for batch in batches for text in batch[field]), field, where, malformed,
                       rows.column_names)


def text_column(rows: Iterable[dict], field: str, where: str, malformed: str | None = None,
                columns: list[str] | None = None) -> Iterator[str]:
    """The `field` string of every row; a missing field is an error listing the `columns` there are (default:
    the row's). A row that cannot be read is an error, a ReadError where the reading failed (an OSError), else one
    that says `malformed`: how to fix the row."""
    rows = iter(rows)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ValueError, OSError) as e:  # e.g. pyarrow's ArrowInvalid (a ValueError) on a malformed line
            failed = f"{where}: cannot read a row ({str(e)[:300]})"
            if isinstance(e, OSError):
                raise ReadError(failed) from None
            raise SourceError(failed + (f"; {malformed}" if malformed else "")) from None
        if field not in row:
            raise _no_text(where, field, columns or sorted(row))
        text = row[field]
        if text is None:  # a null: a row with no text, as an empty string is (datasets hold both)
            yield ""
        elif not isinstance(text, str):
            raise SourceError(f"{where}: a row's {field!r} is {str(text)[:60]!r} ({type(text).__name__}), not text; "
                              f"fix or remove that row, or pass the text column with --text-field")
        else:
            yield text


def _no_text(where: str, field: str, columns: list[str]) -> SourceError:
    return SourceError(f"{where} has no column {field!r}; available columns: {sorted(columns)}. "
                       f"Pass the right one with --text-field")
