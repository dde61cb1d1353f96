"""python -m scripts.fetch_fineweb: valid files are kept, and without network it fails fast naming the fix."""
import time

import numpy as np

from data.shards import write_shard
from tests.data.test_prepare import all_bytes, fetch


def test_fetch_keeps_valid_files_and_fails_fast_offline(tmp_path):
    out = tmp_path / "fineweb"
    no_network = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}  # a closed port: refused at once
    for env in ({"HF_HUB_OFFLINE": "1"}, no_network):
        t0 = time.time()
        proc = fetch(out, 2, env)
        assert proc.returncode == 1 and time.time() - t0 < 30, proc.stderr  # no retries; room for a busy machine
        assert "fineweb_val_000000.bin" in proc.stderr and "fineweb_train_000002.bin" in proc.stderr
        assert ("HF_HUB_OFFLINE" if env["HF_HUB_OFFLINE"] == "1" else "cannot reach http://127.0.0.1:9") in proc.stderr
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"):
        write_shard(out / name, np.arange(1000) % 50257, dtype=np.uint16)
    before = all_bytes(out)
    proc = fetch(out, 2, no_network)
    assert proc.returncode == 0, proc.stderr
    assert "0 downloaded, 3 already present" in proc.stderr and all_bytes(out) == before
    (out / "fineweb_train_000002.bin").write_bytes(before["fineweb_train_000002.bin"][:-2])  # truncated
    proc = fetch(out, 2, no_network)
    assert proc.returncode == 1 and "fineweb_train_000002.bin: truncated" in proc.stderr
    assert "fineweb_train_000001.bin" not in proc.stderr
