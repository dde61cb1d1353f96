"""Atomic file writes: a reader sees the old file or the new one, never half of either."""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from util.exceptions import chain

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
TMP = ".tmp"  # atomic_path writes `name` as .<name>.tmp<pid> beside it


def remove_left_behind(folder: Path, name: str | None = None, recursive: bool = False) -> None:
    """Delete the temporary files of atomic_path's writes (of the file `name`; None: of any) in `folder` (and below
    it) that a killed process left: a kill during a save leaves one as large as the file. Only where no writer runs."""
    for path in (folder.rglob if recursive else folder.glob)(f".{glob.escape(name) if name else '*'}{TMP}*"):
        if path.name.rsplit(TMP, 1)[-1].isdigit():
            path.unlink(missing_ok=True)


class DiskFullError(OSError):
    """A write that found no space left; the message names the file, the bytes it needed and the bytes free."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it over `path`.

    On an exception the temporary file and the folders made for it are removed and `path` keeps its previous
    content. A full disk raises DiskFullError, which gives `size` (the bytes the file needs, if known) and the
    bytes free. The temporary name is unique per process so concurrent writers never share one.
    """
    path = Path(path)
    made = []  # the folders this write creates, deepest first
    for folder in [path.parent, *path.parent.parents]:
        if folder.exists():
            break
        made.append(folder)
    tmp = path.with_name(f".{path.name}{TMP}{os.getpid()}")
    # the cleanup runs inside, so the free bytes the error gives are measured after the partial file is gone
    with reporting_full_disk(path, size):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            for folder in made:
                with contextlib.suppress(OSError):  # not empty: another rank's file is in it
                    folder.rmdir()
            raise


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike, size: int | None = None) -> Iterator[None]:
    """Turn a full disk met inside the block into a DiskFullError naming `path`, its `size` (the bytes being
    written, if known) and the bytes free; any other exception passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise  # a nested write has named its own file already
    except BaseException as e:
        code = _no_space(e)
        if code is None:
            raise
        raise _disk_full(Path(path), size, code) from e


def _no_space(e: BaseException) -> int | None:
    """ENOSPC or EDQUOT if `e` or an exception behind it is one (torch.save hides the OSError), else None."""
    return next((c.errno for c in chain(e) if isinstance(c, OSError) and c.errno in NO_SPACE), None)


def _disk_full(path: Path, size: int | None, code: int) -> DiskFullError:
    """The error for a write of `path` that hit `code` (ENOSPC/EDQUOT), with the bytes free there now."""
    free = shutil.disk_usage(existing_folder(path)).free
    need = f"it needs about {size:,} bytes, " if size is not None else ""
    err = DiskFullError(f"{path}: {os.strerror(code).lower()} while writing it: {need}{free:,} bytes are free "
                        f"there; free some space or write to another filesystem")
    err.errno = code
    return err


def existing_folder(path: str | os.PathLike) -> Path:
    """The nearest folder above `path` that exists (that this process can see exists): where a write of `path`
    will take its space from."""
    return next(p for p in Path(path).absolute().parents if os.path.exists(p))


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8), atomically."""
    data = text.encode()
    with atomic_path(path, size=len(data)) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as pretty JSON, atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
