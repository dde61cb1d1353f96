"""A full disk: the failed write says so (path, bytes needed, bytes free) and leaves nothing half-written.

The kernel's own ENOSPC comes from /dev/full here (no mount needed), and from small tmpfs filesystems that
train.py and prepare fill for real, mounted in a private mount namespace (`unshare`; skipped where the machine
forbids it).
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from util.atomic import DiskFullError, atomic_path, existing_folder, write_json, write_text
from model import get_model
from tests.workers.fault_writer import CONFIG
from tests.helpers import run, tiny_args, tiny_data
from trainer.checkpoint import save_checkpoint, save_resume, save_space, tensor_bytes
from trainer.distributed import Dist


def test_a_write_goes_to_a_temporary_file_beside_the_target_then_replaces_it(tmp_path):
    path = tmp_path / "new" / "summary.json"
    write_text(tmp_path / "old.txt", "old")
    with atomic_path(tmp_path / "old.txt") as tmp:
        assert tmp.parent == tmp_path and tmp.name == f".old.txt.tmp{os.getpid()}"
        tmp.write_text("new")
        assert (tmp_path / "old.txt").read_text() == "old"  # a reader still sees the old file
    assert (tmp_path / "old.txt").read_text() == "new" and not tmp.exists()
    write_json(path, {"b": 1, "a": [2]})  # its folders are made for it
    assert path.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]


def test_existing_folder_is_the_nearest_folder_above_that_exists(tmp_path):
    assert existing_folder(tmp_path / "a" / "b" / "c.pt") == tmp_path
    (tmp_path / "a").mkdir()
    assert existing_folder(tmp_path / "a" / "b" / "c.pt") == tmp_path / "a"
    assert existing_folder("x.pt") == Path.cwd()


def test_a_failed_write_removes_its_file_and_the_folders_it_made(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="the writer failed"):
        with atomic_path(tmp_path / "resume" / "step0000001" / "rank0.pt") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("the writer failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    # a folder another writer has put a file in stays
    (tmp_path / "shared").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "shared" / "step1" / "rank0.pt") as tmp:
            (tmp_path / "shared" / "step1" / "rank1.pt").write_bytes(b"done")
            raise RuntimeError
    assert [p.name for p in (tmp_path / "shared" / "step1").iterdir()] == ["rank1.pt"]


def test_no_space_names_the_file_the_bytes_needed_and_free_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    model = get_model(CONFIG)
    save_checkpoint(path, CONFIG, model.state_dict(), step=1)
    good = path.read_bytes()
    # the temporary file this process will write is /dev/full: every write fails with the kernel's ENOSPC
    (tmp_path / f".checkpoint.pt.tmp{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(DiskFullError) as e:
        save_checkpoint(path, CONFIG, get_model(CONFIG).state_dict(), step=2)
    need, free = tensor_bytes(model.state_dict()), shutil.disk_usage(tmp_path).free
    message = str(e.value)
    assert message.startswith(f"{path}: no space left on device while writing it: it needs about {need:,} bytes, ")
    assert message.endswith("bytes are free there; free some space or write to another filesystem")
    said_free = int(re.search(r"([\d,]+) bytes are free", message).group(1).replace(",", ""))
    assert abs(said_free - free) < 50e6  # measured on the same filesystem a moment ago
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    (tmp_path / f".config.toml.tmp{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(DiskFullError, match=r"config\.toml: no space left on device while writing it: it needs "
                                            r"about 9 bytes"):
        write_text(tmp_path / "config.toml", "[log]\né\n")  # 9 bytes in UTF-8


def test_a_resume_save_first_frees_what_a_failed_save_left_and_keeps_the_complete_state(tmp_path):
    root = tmp_path / "resume"
    save_resume(tmp_path, Dist(), 5, {"step": 5}, {"train": {}}, replicated=False)
    done = (root / "done.json").read_text()
    (root / "step0000007").mkdir()  # another rank's file from a save that failed on rank 0
    (root / "step0000007" / "rank1.pt").write_bytes(b"x" * 1000)
    (root / "step0000009").mkdir()
    (root / "step0000009" / f".rank0.pt.tmp{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(DiskFullError, match=r"step0000009/rank0\.pt: no space left on device"):
        save_resume(tmp_path, Dist(), 9, {"step": 9}, {"train": {}}, replicated=False)
    assert sorted(p.name for p in root.iterdir()) == ["done.json", "step0000005", "step0000009"]
    assert (root / "done.json").read_text() == done and list((root / "step0000009").iterdir()) == []


def test_the_space_saves_need_counts_the_old_copies_that_stay_until_the_new_ones_are_complete(tmp_path):
    checkpoint, done = tmp_path / "checkpoint.pt", tmp_path / "run" / "resume" / "done.json"
    files = [(checkpoint, 600), (done, 1600)]  # written in this order, as train.py's save does
    assert save_space(files, 1) == {tmp_path: 2200}             # a fresh run that saves once: each file once
    assert save_space(files, 2) == {tmp_path: 600 + 2 * 1600}   # then the first resume state stays during the second
    # a resumed run: both old copies are on disk already, so the free space needs to hold the larger new file
    checkpoint.write_bytes(b"x")
    done.parent.mkdir(parents=True)
    done.write_text("{}")
    assert save_space(files, 1) == save_space(files, 2) == {tmp_path: 1600}
    # an old checkpoint.pt alone (a fresh run in an old folder): it stays while the new one is written
    done.unlink()
    assert save_space(files, 1) == {tmp_path: 1600} and save_space(files, 2) == {tmp_path: 2 * 1600}
    if os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:  # a checkpoint on another filesystem counts there
        elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm")) / "checkpoint.pt"
        try:
            assert save_space([(elsewhere, 600), (done, 1600)], 2) == {elsewhere.parent: 1200, done.parent: 3200}
        finally:
            elsewhere.parent.rmdir()


def unshare_tmpfs_reason() -> str | None:
    """Why a tmpfs cannot be mounted in a private mount namespace here, or None if it can."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare/mount refused: {probe.stderr.strip()[:200]}"


NO_TMPFS = unshare_tmpfs_reason()


def on_small_disk(disk: Path, argv: list[str], *, size: str, free: int | None = None) -> subprocess.CompletedProcess:
    """Run `argv` with a `size` tmpfs mounted on `disk`, all but `free` bytes of it taken by a file first (if
    given); afterwards the tmpfs's files (that one left out) are copied to `disk`/../after, since the tmpfs goes
    with the private mount namespace."""
    after = disk.parent / "after"
    disk.mkdir()
    after.mkdir()
    # a spare file of `free` bytes, the rest filled until the kernel says ENOSPC, then the spare removed
    fill = (f"head -c {free} /dev/zero > {disk}/.spare && (cat /dev/zero > {disk}/.filler 2>/dev/null; "
            f"rm {disk}/.spare) && " if free is not None else "")
    script = (f"mount -t tmpfs -o size={size} tmpfs {disk} && {fill}{shlex.join(argv)}; status=$?; "
              f"rm -f {disk}/.filler; cp -a {disk}/. {after}/; exit $status")
    return run(["unshare", "--mount", "--map-root-user", "sh", "-c", script], check=False)


def disk_full_line(path: str, error: str) -> str:
    """The pattern of util/atomic.py's DiskFullError message for a file that `path` (a pattern) matches, after `error`
    (the program's prefix)."""
    return (rf"{re.escape(error)}{path}: no space left on device while writing it: it needs about ([\d,]+) bytes, "
            r"([\d,]+) bytes are free there; free some space or write to another filesystem")


def saving_every_step(tmp_path: Path, run_id: str, size: str) -> tuple[subprocess.CompletedProcess, re.Match]:
    """The tiny config, saving after every step on a `size` tmpfs, which it fills: its process (exit 1, no
    traceback) and its warning line (groups: folder, bytes free, bytes needed, which save fails)."""
    data, disk = tiny_data(tmp_path / "data"), tmp_path / "disk"
    proc = on_small_disk(disk, [sys.executable, *tiny_args(data, disk, run_id, "--train.checkpoint_every_s=1e-9",
                                                           "--log.every_steps=0")], size=size)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warning = re.search(r"warning: (\S+) has ([\d,]+) bytes free, but the run's saves need about ([\d,]+) there "
                        r".*; its (\w+) save will fail", proc.stdout)
    assert warning and warning.group(1) == str(disk / run_id), proc.stdout[-3000:]
    return proc, warning


@pytest.mark.skipif(NO_TMPFS is not None, reason=f"cannot mount a small filesystem: {NO_TMPFS}")
def test_training_on_a_full_filesystem_warns_first_then_stops_and_leaves_no_partial_state(tmp_path):
    # 2 MB: the first save's checkpoint.pt (0.5 MB) fits, its resume state (model + Adam moments, 1.6 MB) not
    proc, warning = saving_every_step(tmp_path, "full", "2m")
    assert warning.group(4) == "first"
    last = proc.stderr.strip().splitlines()[-1]
    # the first save is due after step 1, and on CPU the flags are read at once: it comes after step 1
    rank0 = tmp_path / "disk" / "full" / "resume" / "step0000001" / "rank0.pt"
    assert re.fullmatch(disk_full_line(re.escape(str(rank0)), "train.py: disk full: "), last), last
    # no half-written file, no empty resume/step0000001/; the checkpoint written before it is whole
    run_dir = tmp_path / "after" / "full"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoint.pt", "config.toml", "log.txt",
                                                         "metrics.jsonl"]
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    get_model(ckpt["config"]).load_state_dict(ckpt["model"])
    assert ckpt["step"] == 1


@pytest.mark.skipif(NO_TMPFS is not None, reason=f"cannot mount a small filesystem: {NO_TMPFS}")
def test_a_run_that_saves_twice_is_warned_when_the_second_save_does_not_fit(tmp_path):
    # 3 MiB: one save (checkpoint.pt 0.6 MB + resume state 1.6 MB) fits, but the second holds the first's resume
    # state until its own is complete (3.9 MB)
    proc, warning = saving_every_step(tmp_path, "twice", "3m")
    free, need = (int(warning.group(i).replace(",", "")) for i in (2, 3))
    assert warning.group(4) == "second" and 2.2e6 < free < need < 4e6
    last = proc.stderr.strip().splitlines()[-1]
    resume = re.escape(str(tmp_path / "disk" / "twice" / "resume"))
    failed = re.fullmatch(disk_full_line(rf"{resume}/(step\d+)/rank0\.pt", "train.py: disk full: "), last)
    assert failed, last  # as warned: not the first save (step 1, complete in the run folder), a later one
    done = json.loads((tmp_path / "after" / "twice" / "resume" / "done.json").read_text())
    assert done["step"] == 1 and failed.group(1) != "step0000001"


@pytest.mark.skipif(NO_TMPFS is not None, reason=f"cannot mount a small filesystem: {NO_TMPFS}")
def test_a_full_disk_under_the_run_log_names_the_file_and_the_bytes(tmp_path):
    data, disk = tiny_data(tmp_path / "data"), tmp_path / "disk"
    # three 4 KiB pages free: the run folder's lock takes one, config.toml one, log.txt's first lines the third, and
    # metrics.jsonl's first record finds none
    proc = on_small_disk(disk, [sys.executable, *tiny_args(data, disk, "log")], size="256k", free=12288)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    said = re.fullmatch(disk_full_line(re.escape(str(disk / "log" / "metrics.jsonl")), "train.py: disk full: "),
                        last)
    assert said, last
    record = (tmp_path / "after" / "log" / "metrics.jsonl").read_text()
    assert record == "" and 100 < int(said.group(1).replace(",", "")) < 400  # step 1's record, one JSON line
    assert "run log " in (tmp_path / "after" / "log" / "log.txt").read_text()


@pytest.mark.skipif(NO_TMPFS is not None, reason=f"cannot mount a small filesystem: {NO_TMPFS}")
def test_prepare_on_a_full_filesystem_says_so_in_one_line_and_keeps_what_it_finished(tmp_path):
    disk = tmp_path / "disk"

    def prepare(out: Path) -> list[str]:
        return [sys.executable, "-m", "data.prepare", "--demo", "--tokenizer", "bytes", "--out", str(out),
                "--max-tokens", "200000", "--val-tokens", "20000", "--shard-tokens", "50000", "--workers", "1"]

    # 128 KiB: the val shard (20,000 tokens: 41 KB) fits, the first train shard (50,000: 101 KB) not
    proc = on_small_disk(disk, prepare(disk / "demo"), size="128k")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    said = re.fullmatch(disk_full_line(re.escape(str(disk / "demo" / "demo_train_000001.bin")), "prepare: error: ")
                        + r"; kept 1 shard written so far: the same command, run again, continues after the "
                          r"last", last)
    assert said and said.group(1) == f"{1024 + 2 * 50000:,}", last  # the header and 50,000 uint16 tokens
    out = tmp_path / "after" / "demo"
    assert sorted(p.name for p in out.iterdir()) == ["demo_val_000000.bin", "meta.json"]
    assert json.loads((out / "meta.json").read_text())["shards"] == [{"file": "demo_val_000000.bin", "tokens": 20000}]
    # as the message says: where there is space, the same command goes on from the val shard
    assert "-> " in run(prepare(out)).stderr
    assert [s["tokens"] for s in json.loads((out / "meta.json").read_text())["shards"]] == [20000, *[50000] * 3, 30000]
