"""One process: two real training steps of a config, then print the peak of its live tensors and the estimate as JSON.

usage: python tests/workers/memory_worker.py --config configs/X.toml [--section.key=value ...]
The peak is tests/helpers.py's live_peak: a count of the steps' own tensors, the same on any machine and under any
load.
"""
from __future__ import annotations

import json
import sys

import torch

from model import get_model
from optim.groups import build_optimizers
from tests.helpers import live_peak
from trainer.config import Config, parse_args
from trainer.memory import estimate


def steps(cfg: Config) -> None:
    """Two training steps of cfg's model on a micro-batch (the second with the optimizer state in place)."""
    model = get_model(cfg.to_dict())
    optimizers = build_optimizers(model, cfg.optim)
    shape, vocab = (cfg.train.batch_size, cfg.train.seq_len), cfg.model.vocab_size
    for _ in range(2):
        _, loss = model(torch.randint(0, vocab, shape), torch.randint(0, vocab, shape), keep_logits=False)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cfg = parse_args(["--data.train=unused", *argv])
    print(json.dumps({"peak": live_peak(lambda: steps(cfg)), "estimate": sum(estimate(cfg, 1, False).values())}))


if __name__ == "__main__":
    main(sys.argv[1:])
