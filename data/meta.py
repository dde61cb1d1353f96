"""meta.json, data.prepare's description of a folder of shards (tokenizer, vocab_size, eot_token, dtype, the
shards and their token counts, whether it finished), read in one place: every reader goes through read_meta."""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

META = "meta.json"


class MetaError(ValueError):
    """A meta.json that is not a JSON object; the message names the file and the fix, `problem` says what is
    wrong for a caller with its own fix."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}; re-run python -m data.prepare or delete the file")
        self.path, self.problem = path, problem


def read_meta(folder: str | Path, *, missing_ok: bool = True) -> dict:
    """The meta.json in `folder` as a dict; {} where there is none (with missing_ok=False: the OSError)."""
    path = Path(folder) / META
    if missing_ok and not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise MetaError(path, f"not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise MetaError(path, f"not a JSON object (a {type(meta).__name__})")
    return meta


def listed(meta: dict) -> dict[str, int]:
    """The shards a meta.json (as read_meta reads it) lists: file name -> token count; {} where it lists none."""
    shards = meta.get("shards")
    return {s["file"]: s["tokens"] for s in shards if isinstance(s, dict) and {"file", "tokens"} <= s.keys()
            } if isinstance(shards, list) else {}


def vouches(meta: dict, vocab_size: int, names: Iterable[str]) -> bool:
    """True when a meta.json (as read_meta reads it) lists each of the files `names` of its folder and promises
    their ids are all < vocab_size: a file it does not list (copied in, or another run's) is not its to vouch for."""
    declared, shards = meta.get("vocab_size"), listed(meta)
    return isinstance(declared, int) and declared <= vocab_size and all(name in shards for name in names)
