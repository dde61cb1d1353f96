"""Record 46's speed pieces together through train.py (docs/PERFORMANCE.md, "Record 46's speed pieces"): two ranks
under torchrun with Muon, the float8 head, Muon's math compiled with its symmetric products in our Triton kernel (in
Triton's interpreter here: tests/conftest.py), the gradients sent in their weights' stored dtypes and AdamW's apart
from DDP's, each piece tested alone elsewhere, what each does (tests/model/test_fp8.py, tests/optim/test_compiled.py,
tests/optim/test_symmetric.py, tests/trainer/test_reduce_dtype.py, tests/trainer/test_adam_sync.py). Here: together
they train, and the run differs from the one without them.
bf16_stream is on too: a CPU run has no autocast, so it is the config's combination that is checked, not the key.
So is the record's bf16 storage (optim.bf16_storage), a fidelity piece: the checkpoint's tables and head hold bf16
values on both ranks' steps."""
import json
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from tests.helpers import demo_data, torchrun, train_args, train_values

# the attention gates, bf16-stored and Muon's, share DDP's buckets with fp32 matrices: the storage wire's mixed case
PIECES = ["--model.fp8_head=true", "--optim.muon_compile=true", "--train.reduce_dtype=storage",
          *(["--optim.muon_symmetric=true"] if find_spec("triton") else []),
          "--train.adam_sync=adam_steps", "--train.dtype=bfloat16", "--train.bf16_stream=true",
          "--optim.bf16_storage=true", "--model.attn_gate=true", "--optim.muon_gates=true"]
# 128 wide: Muon's matrices of 128 rows span two tiles, which the symmetric kernel takes (one it leaves to matmul)
MUON = ["--optim.name=muon", "--optim.embed_lr=0.01", "--train.max_steps=8", "--eval.tokens=2048",
        "--model.n_embd=128", "--model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = demo_data(tmp_path_factory.mktemp("demo"), tokens=120_000, val_tokens=10_000, shard_tokens=60_000)
    out = tmp_path_factory.mktemp("runs")
    torchrun(train_args(data, out, "with", *MUON, *PIECES), timeout=600)
    torchrun(train_args(data, out, "without", *MUON), timeout=300)
    return out


@pytest.mark.slow
def test_the_pieces_train_together_and_change_the_run(runs):
    summaries = {name: json.loads((runs / name / "summary.json").read_text()) for name in ("with", "without")}
    assert [s["status"] for s in summaries.values()] == ["completed", "completed"]
    assert summaries["with"]["steps"] == 8 and summaries["with"]["world_size"] == 2
    with_pieces, without = train_values(runs / "with"), train_values(runs / "without")
    assert all(np.isfinite(with_pieces)) and np.mean(with_pieces[-3:]) < with_pieces[0] - 0.5, with_pieces
    # the same first batch and weights: the float8 head's rounding moves even the first loss, by a few percent at most
    assert with_pieces != without
    assert abs(with_pieces[0] - without[0]) < 0.05 * without[0]
    # 8 steps later the roundings have moved the weights by a share of a step, not the learning: a piece that broke
    # the update (a lost gradient, a wrong scale) would leave the val loss nats apart, not a tenth
    assert abs(summaries["with"]["final_val_loss"] - summaries["without"]["final_val_loss"]) < 0.1
    config = (runs / "with" / "config.toml").read_text()
    assert all(line in config for line in ["fp8_head = true", "muon_compile = true", 'reduce_dtype = "storage"',
                                           'adam_sync = "adam_steps"', "bf16_stream = true", "bf16_storage = true"])
    assert ("muon_symmetric = true" in config) == bool(find_spec("triton"))
    weights = {name: torch.load(runs / name / "checkpoint.pt", weights_only=True)["model"] for name in summaries}
    for name, table in [(name, weights[name][key]) for name in weights for key in ("wte.weight", "lm_head.weight")]:
        assert torch.equal(table, table.bfloat16().float()) == (name == "with"), name
