"""scripts/bench/loader.py on tiny sizes: every row prints, and its targets with it."""
import json
import sys

import pytest

from tests.helpers import run


@pytest.mark.slow  # ~30 s, most of it importing torch on a busy 2-core machine


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, "-m", "scripts.bench.loader", "--size-gb", "0.01", "--skip-big", "--seconds", "0.1",
                "--rounds", "1", "--pairs", "2", "--track-s", "0", "--tmp", str(tmp_path), "--json", str(out)],
               timeout=300)
    result = json.loads(out.read_text())
    assert "| measure | before | after | target |" in proc.stdout and "PASS" in proc.stdout
    for name in ("before", "after"):  # today's loader and the one it replaced, side by side
        r = result[name]
        assert min(r[k] for k in ("shuffled_warm", "shuffled_cold", "sequential_warm", "shuffled_k1_cold")) > 0
        assert "1GB_shuffled_bos" in r["first_batch_ms"] and "main_thread_slowdown" in r
    assert result["reference"]["memcpy"] > 0
    assert not [p for p in tmp_path.iterdir() if p != out], "the generated shards must be removed"


def test_the_loader_before_trains_under_todays_train_py(tmp_path, monkeypatch):
    """The data-wait row runs train.py with the loader of BEFORE in place: it takes today's call and steps."""
    import train
    import trainer.data
    from scripts.bench.loader import before_module
    from tests.helpers import growing_window_run

    before = before_module()
    monkeypatch.setattr(trainer.data, "TokenLoader", before.TokenLoader)
    run = growing_window_run(tmp_path, "--train.max_steps=3")
    try:
        assert type(run.loader) is before.TokenLoader and train.train(run) == "completed"
    finally:
        run.loader.close()
        run.log.close()
    assert run.progress.step == 3 and run.loader.wait_s >= 0
