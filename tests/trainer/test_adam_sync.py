"""train.adam_sync = "adam_steps" (record 46's: AdamW's gradients cross the ranks on AdamW's steps only), on 2 gloo
ranks: DDP leaves AdamW's parameters alone, each rank holds its own sum of their gradients between AdamW's steps,
and sync_apart averages it as DDP averages its buckets (each rank's share divided by the world size, then summed,
in the wire's dtype: under "storage" bf16 for the bf16-stored tables, fp32 for the rest); a train.py run killed
while its ranks hold gradients of their own resumes exactly.

The comparisons are exact on any machine: every gradient compared is computed by the same code in processes alike
(torchrun's workers, one thread each: tests/conftest.py), and halving and a sum of two values are one rounding
whatever the order; the bf16 wire's rounding is restated, not bounded."""
import json

import pytest
import torch

from tests.helpers import ROOT, tiny_args, tiny_data, torchrun, train_values
from trainer.config import ConfigError, parse_args

TINY = ["--config", "configs/tiny.toml", "--data.train=x"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("adam_sync") / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "adam_sync_worker.py", out], env={"PYTHONPATH": str(ROOT)})
    return torch.load(out, weights_only=True)


def average(g0: torch.Tensor, g1: torch.Tensor, wire: str) -> torch.Tensor:
    """Two ranks' gradients averaged as the wire gives them back: each divided by 2 (exact), summed, in its dtype."""
    if wire == "float32":
        return g0 / 2 + g1 / 2
    return (g0.bfloat16().float() / 2 + g1.bfloat16().float() / 2).bfloat16().float()


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16", "storage"])
def test_adamw_gradients_stay_each_ranks_own_until_adamw_steps_then_cross_as_ddp_would_send_them(two_ranks,
                                                                                                  reduce_dtype):
    local, ranks, stored = two_ranks["local"], two_ranks[reduce_dtype], set(two_ranks["stored"])
    names = set(ranks[0]["apart"])
    assert {"wte.weight", "skip_lambda", "backout_lambda"} <= names and ranks[0]["muon"]
    assert not names & ranks[0]["muon"].keys() and ranks[0]["marked"]
    assert "wte.weight" in stored and not stored & ranks[0]["muon"].keys()  # the Muon matrices: fp32 under storage

    def wire(n: str) -> str:
        return reduce_dtype if reduce_dtype != "storage" else "bfloat16" if n in stored else "float32"
    for n in names:
        for rank, got in enumerate(ranks):  # the first step's backward: no AdamW step, nothing sent
            assert torch.equal(got["held"][n], local[rank][0][n]), n
        assert not torch.equal(ranks[0]["held"][n], ranks[1]["held"][n]) or not local[0][0][n].any(), n
        sums = [local[r][0][n] + local[r][1][n] for r in range(2)]  # what each rank adds up over the two steps
        assert torch.equal(ranks[0]["synced"][n], average(*sums, wire(n))), n
        assert torch.equal(ranks[1]["synced"][n], ranks[0]["synced"][n]), n
    for n, g in ranks[0]["muon"].items():  # DDP's own, at every backward
        expected = average(local[0][1][n], local[1][1][n], wire(n))
        assert torch.equal(g, expected) and torch.equal(g, ranks[1]["muon"][n]), n


def test_a_run_killed_while_its_ranks_hold_their_own_gradients_resumes_exactly(tmp_path):
    """optim.adam_every = 2 on 2 ranks: every rank SIGKILLed right after the resume state of step 3 is saved (AdamW's
    gradients of step 3 wait for step 4, each rank's its own) resumes with them and ends as the run that went
    straight through: the same losses, step by step."""
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    args = ["--optim.name=muon", "--optim.adam_every=2", "--optim.embed_lr=0.05", "--train.max_steps=6",
            "--train.adam_sync=adam_steps"]
    env = {"PYTHONPATH": str(ROOT)}
    torchrun(tiny_args(data, runs, "straight", *args), env=env)
    die = [ROOT / "tests" / "workers" / "die_at.py", "trainer.checkpoint:save_resume", "step=3"]
    proc = torchrun([*die, *tiny_args(data, runs, "crash", *args, "--train.checkpoint_every_s=1e-9")], check=False,
                    env=env)
    assert proc.returncode != 0 and "exitcode: -9" in proc.stderr, proc.stderr[-5000:]
    folder = runs / "crash" / "resume" / json.loads((runs / "crash" / "resume" / "done.json").read_text())["dir"]
    states = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]
    own = [s["own_grads"] for s in states]
    assert folder.name == "step0000003" and own[0].keys() == own[1].keys() and "wte.weight" in own[0]
    assert not torch.equal(own[0]["wte.weight"], own[1]["wte.weight"])  # each rank's own, both written
    assert "grads" not in states[1] and not states[0]["grads"]  # Muon's were dropped; nothing else is held
    torchrun(tiny_args(data, runs, "crash", *args), env=env)
    assert "resumed at step 3" in (runs / "crash" / "log.txt").read_text()
    assert train_values(runs / "crash") == train_values(runs / "straight")


@pytest.mark.parametrize("args, needle", [
    (["--train.parallel=fsdp"], "it needs train.parallel = 'ddp' (got 'fsdp')"),
    (["--optim.name=adamw"], "optim.name = 'muon' (got 'adamw')"),
    (["--optim.name=muon", "--optim.grad_clip=1.0"], "optim.grad_clip = 0 (got 1.0: the clip would read them"),
])
def test_adam_steps_is_refused_where_it_cannot_work(args, needle):
    with pytest.raises(ConfigError, match="train.adam_sync = 'adam_steps' sends AdamW's gradients apart"):
        parse_args([*TINY, "--train.adam_sync=adam_steps", *args])
    with pytest.raises(ConfigError) as refused:
        parse_args([*TINY, "--train.adam_sync=adam_steps", *args])
    assert needle in str(refused.value)
