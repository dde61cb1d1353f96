"""train.ddp_always: one process wrapped in DDP over a gloo group of one trains exactly as the plain model does,
its gradients are views of DDP's buckets, and DDP and Muon's all_gather call no API that this torch deprecates."""
import gc
import sys
import warnings
from pathlib import Path

import pytest
import torch

from model import get_model
from optim.config import OptimConfig
from optim.groups import build_optimizers, step_optimizers
from tests.helpers import final_val_loss, run, tiny_args, tiny_data, train_values
from tests.workers.muon_worker import GPT_CONFIG
from trainer import distributed
from trainer.config import TrainConfig
from trainer.parallel import parallelize


def header(run_dir: Path) -> str:
    """The log's line that says how the model is wrapped."""
    return next(line for line in (run_dir / "log.txt").read_text().splitlines() if " params | " in line)


def test_ddp_always_wraps_one_process_and_trains_like_the_plain_model(tmp_path):
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    # Muon: its all_gather runs through the group; tiny.toml's 2 micro-steps: DDP's no_sync and its bucket hooks
    common = ("--optim.name=muon", "--train.max_steps=8")
    for run_id, extra in (("plain", ()), ("ddp", ("--train.ddp_always=true",))):
        run([sys.executable, *tiny_args(data, runs, run_id, *common, *extra)])
    assert "| 1 process, no wrapper |" in header(runs / "plain")
    assert "| 1 process, ddp |" in header(runs / "ddp")
    plain, ddp = train_values(runs / "plain"), train_values(runs / "ddp")
    assert len(plain) == 8 and ddp == pytest.approx(plain, rel=1e-6, abs=0)
    assert final_val_loss(runs / "ddp") == pytest.approx(final_val_loss(runs / "plain"), rel=1e-6, abs=0)


def two_steps_in_ddp(dist: distributed.Dist) -> str:
    """Two training steps of a GPT that parallelize wrapped for train.ddp_always, turning FutureWarnings into
    errors; what wraps it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = parallelize(get_model(GPT_CONFIG), TrainConfig(ddp_always=True), dist)
        optimizers = build_optimizers(model.module, OptimConfig(name="muon"))
        params = list(model.module.parameters())
        for step in range(2):  # the second backward after zero_grad dropped the gradients
            idx = torch.randint(0, GPT_CONFIG["vocab_size"], (2, 17))
            model(idx[:, :-1], idx[:, 1:])[1].backward()
            # gradient_as_bucket_view: the gradients live in DDP's few flat buckets, not one tensor each
            assert len({p.grad.untyped_storage().data_ptr() for p in params}) <= 2 < len(params)
            model.clip_grads(0.1)
            step_optimizers(optimizers, step)
            assert all(p.grad is None for p in params)
    return model.kind


def test_a_group_of_one_runs_ddp_and_muon_without_deprecation_warnings(monkeypatch):
    # torch 2.13 deprecates DDP's broadcast_buffers and all_gather_into_tensor; torch 2.6 lacks their successors
    monkeypatch.setattr(distributed, "_store", None)  # the group's store stays this test's
    dist = distributed.init(60.0, group_of_one=True)
    try:
        assert torch.distributed.get_world_size() == 1 and torch.distributed.get_backend() == "gloo"
        # DDP gone before its group: a reducer freed after destroy_process_group hung 1 run in ~10 here
        assert two_steps_in_ddp(dist) == "ddp"
        gc.collect()
    finally:
        distributed.close()
