"""One process: two real training steps of a config, then print the peak of its live tensors and the estimate as JSON.

usage: python tests/workers/memory_worker.py --config configs/X.toml [--section.key=value ...]
The peak is the largest sum of the bytes torch's CPU allocator holds for tensors, replayed from the profiler's
allocation and free events in order: a count of the step's own tensors, the same on any machine and under any
load, where the process's resident memory also holds the allocator's slack and the libraries' pages.
"""
from __future__ import annotations

import json
import sys
from itertools import accumulate

import torch
from torch.profiler import ProfilerActivity, profile

from model import get_model
from optim.groups import build_optimizers
from trainer.config import Config, parse_args
from trainer.memory import estimate


def steps(cfg: Config) -> None:
    """Two training steps of cfg's model on a micro-batch (the second with the optimizer state in place)."""
    model = get_model(cfg.to_dict())
    optimizers = build_optimizers(model, cfg.optim)
    shape, vocab = (cfg.train.batch_size, cfg.train.seq_len), cfg.model.vocab_size
    for _ in range(2):
        _, loss = model(torch.randint(0, vocab, shape), torch.randint(0, vocab, shape))
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)


def live_peak(cfg: Config) -> int:
    """The most bytes of tensors alive at once during `steps(cfg)`."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        steps(cfg)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return max(accumulate(n for _, n in events))


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = parse_args(["--data.train=unused", *argv])
    print(json.dumps({"peak": live_peak(cfg), "estimate": sum(estimate(cfg, 1, False).values())}))


if __name__ == "__main__":
    main(sys.argv[1:])
