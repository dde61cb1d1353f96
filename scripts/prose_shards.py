"""English prose as GPT-2 shards, offline: the paragraphs of Debian's HTML manuals, in the llm.c format, named as
modded-nanogpt's record scripts glob them, small enough to travel with a GPU call.

    python -m scripts.gpt2_bpe --out gpt2_bpe
    python -m scripts.prose_shards --tokenizer gpt2_bpe --out shards/prose
    # -> shards/prose/data/fineweb10B/fineweb_val_000000.bin, fineweb_train_000001.bin, ... and meta.json;
    #    shards/prose/corpus.json: the packages (file names hold their versions) and their sha256

`apt-get download` fetches each package's .deb (no install, no root) into --work, where `dpkg-deb -x` unpacks it
while its pages are read.
A page's text is its <p> paragraphs whose words make up most of them (code, tables and navigation are left out),
cut at paragraph ends into documents of at most --doc-chars characters (about 1,500 GPT-2 tokens), as web pages
are short documents: a record's loader keeps only the first 2,048 tokens of a document. data.prepare shuffles
the documents (--seed) and writes the val shard first: its --val-tokens default is a val set of 2,097,152 targets,
the record's val_batch_size, plus the two tokens its loader reads around them.
"""
from __future__ import annotations

import argparse
import hashlib
import html.parser
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from data.prepare import PrepareError, main as prepare_main
from util.atomic import write_json, write_text

# Debian 12's manuals in HTML, English: the kernel's, Python's, PostgreSQL's, SQLite's, Git's, Debian's own, Rust's
# books and references, Django's, Octave's
PACKAGES = ("linux-doc-6.1", "python3.11-doc", "postgresql-doc-15", "sqlite3-doc", "git-doc", "debian-reference-en",
            "rust-doc", "python-django-doc", "octave-doc")
SKIP_PARTS = {"translations", "_sources", "_static", "genindex.html", "search.html", "py-modindex.html"}
MIN_WORDS = 5
WORDY = 0.8        # of a kept paragraph's characters, at least this share letters or spaces
DOC_CHARS = 6000   # ~1,450 GPT-2 tokens of English at ~4.1 characters a token
VAL_TOKENS = 2 * 2**20 + 2
SHARD_TOKENS = 5_000_000
APT_TIMEOUT_S = 600


class ProseError(RuntimeError):
    """The packages cannot be had or give no text; the message says what to do."""


class Paragraphs(html.parser.HTMLParser):
    """The text of each <p> element of a page, whitespace collapsed (a <p> inside another joins the outer one)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.parts, self.found = 0, [], []

    def handle_starttag(self, tag: str, attrs) -> None:
        self.depth += tag == "p"

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self.depth:
            self.depth -= 1
            if not self.depth:
                text = " ".join("".join(self.parts).split())
                self.parts = []
                if text:
                    self.found.append(text)

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def prose(paragraph: str) -> bool:
    """Whether a paragraph reads as prose: enough words, and mostly letters."""
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return len(paragraph.split()) >= MIN_WORDS and letters >= WORDY * len(paragraph)


def page_documents(page: str, doc_chars: int = DOC_CHARS) -> list[str]:
    """A page's prose paragraphs as documents of at most `doc_chars` characters, cut at paragraph ends (a longer
    paragraph is a document of its own)."""
    parser = Paragraphs()
    parser.feed(page)
    docs, current = [], []
    for para in filter(prose, parser.found):
        if current and sum(map(len, current)) + 2 * len(current) + len(para) > doc_chars:
            docs.append("\n\n".join(current))
            current = []
        current.append(para)
    return docs + (["\n\n".join(current)] if current else [])


def html_pages(tree: Path) -> list[Path]:
    """The HTML pages under an unpacked package, in a fixed order, without translations, sources and indexes."""
    return sorted(p for p in tree.rglob("*.html") if p.is_file() and not SKIP_PARTS & set(p.parts))


def download(packages: tuple[str, ...], debs: Path) -> list[Path]:
    """Each package's .deb in `debs` (apt-get download for the ones not there yet), in the order given."""
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        if shutil.which("apt-get") is None:
            raise ProseError("apt-get is not here: run this on Debian 12 (or copy the .deb files of "
                             f"{', '.join(missing)} into {debs})")
        proc = subprocess.run(["apt-get", "download", *missing], cwd=debs, capture_output=True, text=True,
                              timeout=APT_TIMEOUT_S)
        if proc.returncode != 0:
            raise ProseError(f"apt-get download {' '.join(missing)} failed: {proc.stderr.strip()[-400:]}; "
                             f"`apt-get update` first, or name packages this release has (--packages; "
                             f"apt-cache search doc)")
    return [sorted(debs.glob(f"{p}_*.deb"))[-1] for p in packages]


def unpack(deb: Path, tree: Path) -> None:
    """`dpkg-deb -x` into `tree`."""
    proc = subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], capture_output=True, text=True,
                          timeout=APT_TIMEOUT_S)
    if proc.returncode != 0:
        raise ProseError(f"{deb}: dpkg-deb -x failed ({proc.stderr.strip()[-300:]}); delete it to fetch it again")


def write_documents(debs: list[Path], work: Path, doc_chars: int) -> dict:
    """Unpack each .deb, write its pages' documents as work/docs/<package>/<n>.txt; the corpus description."""
    docs_dir = work / "docs"
    if docs_dir.exists():
        shutil.rmtree(docs_dir)  # derived from the .debs: remade whole, so a changed setting leaves nothing stale
    corpus = {"doc_chars": doc_chars, "packages": []}
    for deb in debs:
        name = deb.name.split("_")[0]
        count = chars = 0
        # unpacked only while read: a manual's tree holds links into the system it was built for, dangling here
        with tempfile.TemporaryDirectory(dir=work) as tree:
            unpack(deb, Path(tree))
            for page in html_pages(Path(tree)):
                for doc in page_documents(page.read_text(encoding="utf-8", errors="replace"), doc_chars):
                    write_text(docs_dir / name / f"{count:06d}.txt", doc)
                    count, chars = count + 1, chars + len(doc)
        corpus["packages"].append({"deb": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                                   "documents": count, "characters": chars})
        print(f"prose_shards: {deb.name}: {count:,} documents, {chars:,} characters", file=sys.stderr)
    if not any(p["documents"] for p in corpus["packages"]):
        raise ProseError(f"no prose paragraphs in {', '.join(d.name for d in debs)}: are these HTML manuals?")
    return corpus


def build(args: argparse.Namespace) -> Path:
    """Fetch, extract and tokenize; return the folder the record's script reads (DATA_PATH/data/fineweb10B)."""
    corpus = write_documents(download(tuple(args.packages.split(",")), args.work / "debs"), args.work,
                             args.doc_chars)
    shards = args.out / "data" / "fineweb10B"
    prepare_main(["--files", str(args.work / "docs"), "--tokenizer", args.tokenizer, "--name", "fineweb",
                  "--out", str(shards), "--val-tokens", str(args.val_tokens), "--shard-tokens",
                  str(args.shard_tokens), "--seed", str(args.seed), *(["--overwrite"] if args.overwrite else [])])
    write_json(args.out / "corpus.json", corpus)
    return shards


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.prose_shards`."""
    p = argparse.ArgumentParser(prog="python -m scripts.prose_shards", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="GPT-2's BPE folder (python -m scripts.gpt2_bpe) or 'gpt2'")
    p.add_argument("--out", type=Path, default=Path("shards/prose"),
                   help="DATA_PATH: the shards go to OUT/data/fineweb10B/, as the record's script globs them")
    p.add_argument("--work", type=Path, default=Path(".cache/prose"), help="downloaded .debs and the documents")
    p.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated Debian packages of HTML manuals")
    p.add_argument("--doc-chars", type=int, default=DOC_CHARS, help="most characters in a document")
    p.add_argument("--val-tokens", type=int, default=VAL_TOKENS)
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    p.add_argument("--seed", type=int, default=0, help="the documents' shuffled order")
    p.add_argument("--overwrite", action="store_true", help="replace shards of other settings in the output")
    args = p.parse_args(argv)
    try:
        print(build(args))
    except (ProseError, PrepareError) as e:
        sys.exit(f"prose_shards: error: {e}")


if __name__ == "__main__":
    main()
