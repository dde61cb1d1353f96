"""Corpus sources: each yields documents (strings) in a fixed order, so a run can be resumed by
skipping the documents it already consumed.

    stdlib_documents()                            the running Python's standard library (offline demo)
    file_documents(local_files("dir/*.jsonl"))    local .txt (one document per file), .jsonl, .parquet
    hf_documents("HuggingFaceFW/fineweb", "sample-10BT")
"""
from __future__ import annotations

import glob
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

# file suffix -> the `datasets` builder that reads it (None: read here, one document per file)
BUILDERS = {".txt": None, ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
THIRD_PARTY = {"site-packages", "dist-packages"}


class SourceError(ValueError):
    """A corpus that cannot be read as asked; the message names it and the fix."""


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library (no site-packages), in a fixed shuffled order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in THIRD_PARTY]  # pruned, not filtered: site-packages can be huge
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    # Shuffled with a fixed seed: in sorted order the val split (the stream's first tokens) held only the
    # `__future__` ... `_collections_abc` files, and neighbouring packages shared whole batches, so the val loss
    # swung +-0.3 with whatever package training was reading.
    random.Random(0).shuffle(files)
    return files


def stdlib_documents() -> Iterator[str]:
    """The offline demo corpus: one document per standard-library source file."""
    return read_text_files(stdlib_files())


def read_text_files(files: Iterable[Path]) -> Iterator[str]:
    """Each file's whole content as one document, undecodable bytes replaced."""
    # Read as bytes: text mode (and datasets' "text" builder) would turn "\r\n" into "\n".
    for path in files:
        yield Path(path).read_bytes().decode("utf-8", errors="replace")


def local_files(pattern: str) -> list[Path]:
    """The files a glob matches (`**` allowed), sorted; all must share one supported suffix."""
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
    if not files:
        raise SourceError(f"--files {pattern!r} matches no file; check the path (quote the glob for the shell)")
    suffixes = sorted({p.suffix for p in files})
    if len(suffixes) > 1 or suffixes[0] not in BUILDERS:
        raise SourceError(f"--files {pattern!r} matches files with suffixes {suffixes}; expected one of "
                          f"{sorted(BUILDERS)} — narrow the glob to one kind of file per run")
    return files


def file_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """Documents of local files of one kind: .txt whole, or `text_field` of each .jsonl/.parquet row."""
    builder = BUILDERS[files[0].suffix]
    if builder is None:
        return read_text_files(files)
    import datasets

    where = f"{files[0].parent}/*{files[0].suffix} ({len(files)} files)"
    try:  # streaming reads the files in the given order without writing an Arrow copy into the HF cache
        rows = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True)
    except (StopIteration, ValueError, OSError) as e:  # StopIteration: no row at all (empty files)
        raise SourceError(f"{where}: cannot read them ({str(e)[:300] or 'no rows'}); fix or remove the bad "
                          f"file") from None
    return text_column(rows, text_field, where, "fix or remove the bad file")


def hf_documents(dataset: str, subset: str | None = None, split: str = "train", text_field: str = "text",
                 streaming: bool = False) -> Iterator[str]:
    """Documents of a Hugging Face hub dataset, in its stored order."""
    import datasets

    try:
        rows = datasets.load_dataset(dataset, subset, split=split, streaming=streaming)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise SourceError(f"cannot load Hugging Face dataset {dataset!r} (subset {subset!r}, split {split!r}): "
                          f"{str(e)[:300]}. Check the names, the network, or HF_DATASETS_OFFLINE with a "
                          f"filled cache (HF_HOME)") from e
    return text_column(rows, text_field, f"dataset {dataset!r}",
                       "run the same command again: prepare resumes where it stopped")


def text_column(rows: Iterable[dict], field: str, where: str, unreadable: str) -> Iterator[str]:
    """The `field` string of every row; a missing field is an error listing the columns there are, and a row
    that cannot be read one that says `unreadable` (what to do about it)."""
    rows = iter(rows)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ValueError, OSError) as e:  # e.g. pyarrow's ArrowInvalid (a ValueError) on a malformed line
            raise SourceError(f"{where}: cannot read a row ({str(e)[:300]}); {unreadable}") from None
        text = row.get(field)
        if not isinstance(text, str):
            problem = "has no column" if field not in row else f"has a non-text value ({type(text).__name__}) in"
            raise SourceError(f"{where} {problem} {field!r}; available columns: {sorted(row)}. "
                              f"Pass the right one with --text-field")
        yield text
