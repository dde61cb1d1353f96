"""torchrun worker: train.py's loop under DDP and then FSDP2, on gloo, with a head that unties from the embedding
(model.untie_at), the later tokens' and the prefix token's loss terms (model.mtp_weights, model.prefix_weight) and
AdamW every second step: a run straight through, and runs stopped before and after the untie, then resumed; then
a run straight through again under each, in float64.

usage: torchrun --nproc_per_node=2 tests/workers/untie_worker.py DATA_DIR OUT.pt
Rank 0 saves {parallel: {run: {"status", "losses", "state" (the full weights), "prefix_targets" (the table setup
filled), "tied" (each step, every rank's), "checkpoint_tied" (load_checkpoint's model of a stopped run: tied, and its
head equal to the embedding)}}}, the float64 runs as the runs "float64".
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import torch

import train
from tests.helpers import ROOT, save_on_rank_0
from trainer import distributed
from trainer.checkpoint import load_checkpoint
from trainer.config import parse_args
from trainer.exits import exiting_without_teardown

# 8 steps: the untie is due at 0.35 (step 3), which holds step 2's AdamW gradients, so it comes at step 4
ARGS = ("--optim.name=muon", "--optim.adam_every=2", "--optim.embed_lr=0.05", "--optim.head_lr=0.02",
        "--train.max_steps=8", "--model.untie_at=0.35", "--model.mtp_weights=[1.0, 0.5, 0.25]",
        "--model.prefix_weight=0.25", "--data.val=")
STOPS = (3, 6)  # after 3 steps, tied (AdamW holds gradients the head's joined); after 6, untied


def trained(data: Path, parallel: str, run_id: str, dist, stop: int | None = None) -> dict:
    """One run of train.py's loop in this process group (stopped by a SIGTERM after `stop` steps, and saved)."""
    tied = []
    real = train.train_step

    def step(run, batches, *args, **kwargs):
        out = real(run, batches, *args, **kwargs)
        tied.append(run.model.module.tied)
        if run.progress.step + 1 == stop:
            run.stop_requested.append(signal.SIGTERM)
        return out
    train.train_step = step
    cfg = parse_args(["--config", str(ROOT / "configs" / "tiny.toml"), f"--data.train={data}/*_train_*.bin",
                      f"--log.dir={data}/runs", f"--log.run_id={parallel}-{run_id}", f"--train.parallel={parallel}",
                      *ARGS])
    run = train.setup(cfg, dist)
    try:
        status = train.train(run)
        if status == "sigterm":
            train.save(run)
        lines = (run.run_dir / "metrics.jsonl").read_text().splitlines() if dist.master else []
        result = {"status": str(status), "losses": [r["loss"] for r in map(json.loads, lines) if r["type"] == "train"],
                  "state": run.model.full_state(), "prefix_targets": run.model.module.prefix_targets.tolist()}
    finally:
        train.train_step = real
        run.loader.close()
        run.log.close()
    every = [None] * dist.world_size
    torch.distributed.all_gather_object(every, tied)
    result["tied"] = every
    if status == "sigterm" and dist.master:
        model, _ = load_checkpoint(run.checkpoint_path)
        result["checkpoint_tied"] = (model.tied, torch.equal(model.lm_head.weight, model.wte.weight))
    return result


def main(data: str, out: str) -> None:
    dist = distributed.init(60)
    results: dict = {}
    for parallel in ("ddp", "fsdp"):
        runs = results[parallel] = {"straight": trained(Path(data), parallel, "straight", dist)}
        for stop in STOPS:
            runs[f"stopped{stop}"] = trained(Path(data), parallel, f"stop{stop}", dist, stop)
            runs[f"resumed{stop}"] = trained(Path(data), parallel, f"stop{stop}", dist)
    # The float64 runs tell the two parallel paths' arithmetic from their float32 rounding (the test says why)
    torch.set_default_dtype(torch.float64)
    for parallel in ("ddp", "fsdp"):
        results[parallel]["float64"] = trained(Path(data), parallel, "float64", dist)
    save_on_rank_0(results, out, dist.rank)
    distributed.close()


if __name__ == "__main__":
    with exiting_without_teardown():
        main(*sys.argv[1:])
