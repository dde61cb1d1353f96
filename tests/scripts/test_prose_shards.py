"""python -m scripts.prose_shards: the prose paragraphs of HTML pages as short documents, and a package's .deb to
shards named as the record globs them (a .deb built here, so no archive is needed)."""
import json
import shutil
import subprocess
import sys

import pytest

from data.shards import open_shard
from scripts import prose_shards
from scripts.prose_shards import ProseError, html_pages, page_documents
from tests.helpers import gpt2_bpe, run

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
PAGE = f"""<html><head><title>Manual</title></head><body>
<div class="nav"><p>Next</p></div>
<p>{SENTENCE}</p>
<pre>for i in range(10): print(i)</pre>
<p>x = y[3] + f(z); return {{a: b}} # 0x1f</p>
<p>A   paragraph
   over <em>several</em> lines, with <a href="#">a link</a> in it.</p>
<p>{SENTENCE} {SENTENCE}</p>
</body></html>"""


def test_a_page_gives_its_prose_paragraphs_in_documents_cut_at_paragraph_ends():
    assert page_documents(PAGE) == [f"{SENTENCE}\n\nA paragraph over several lines, with a link in it.\n\n"
                                    f"{SENTENCE} {SENTENCE}"]
    short = page_documents(PAGE, doc_chars=120)
    assert short == [f"{SENTENCE}\n\nA paragraph over several lines, with a link in it.", f"{SENTENCE} {SENTENCE}"]
    assert page_documents("<p>Too short.</p><p>1 2 3 4 5 6 7 8</p>") == []


def test_translations_sources_and_indexes_are_left_out(tmp_path):
    for name in ("a/intro.html", "a/translations/zh/intro.html", "_sources/intro.html", "genindex.html", "b.html"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(PAGE)
    assert [p.relative_to(tmp_path).as_posix() for p in html_pages(tmp_path)] == ["a/intro.html", "b.html"]


def test_without_apt_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(prose_shards.shutil, "which", lambda name: None)
    with pytest.raises(ProseError, match="apt-get is not here.*copy the .deb files of mini-doc"):
        prose_shards.download(("mini-doc",), tmp_path)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb is needed to build a .deb")
def test_a_package_becomes_the_records_shards(tmp_path):
    bpe = gpt2_bpe()
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text("Package: mini-doc\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: tests <t@example.invalid>\nDescription: a manual\n")
    for i in range(40):
        page = root / "usr" / "share" / "doc" / "mini-doc" / "html" / f"page{i:02d}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(PAGE.replace("fox", f"fox number {i}"))
    (tmp_path / "work" / "debs").mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root),
                    str(tmp_path / "work" / "debs" / "mini-doc_1.0_all.deb")], check=True, capture_output=True)
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "scripts.prose_shards", "--tokenizer", str(bpe), "--packages", "mini-doc",
                "--work", str(tmp_path / "work"), "--out", str(out), "--val-tokens", "300", "--shard-tokens", "1000"])
    shards = out / "data" / "fineweb10B"
    assert proc.stdout.strip() == str(shards)
    names = sorted(p.name for p in shards.glob("*.bin"))
    assert names[0] == "fineweb_train_000001.bin" and names[-1] == "fineweb_val_000000.bin"
    val = open_shard(shards / "fineweb_val_000000.bin", fmt="header")
    assert len(val) == 300 and val[0] == 50256  # every document opens with <|endoftext|>
    meta = json.loads((shards / "meta.json").read_text())
    assert meta["documents"] == 40 and meta["tokenizer"] == str(bpe)
    corpus = json.loads((out / "corpus.json").read_text())
    assert corpus["packages"][0]["deb"] == "mini-doc_1.0_all.deb" and corpus["packages"][0]["documents"] == 40
    assert len(corpus["packages"][0]["sha256"]) == 64
