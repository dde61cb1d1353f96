"""train.reduce_dtype = "bfloat16": on 2 gloo ranks, DDP (two micro-steps, the first unsynced) and FSDP2 send the
gradients in bf16 while each rank adds up its micro-steps in fp32, a non-finite gradient still reaches the norm,
and a short run trains as the fp32 one does, within what bf16 rounding explains. Under optim.bf16_storage the
bf16-stored weights' micro-steps add up in bf16 on each rank, and DDP's fp32 wire averages those bf16 sums; under
reduce_dtype = "storage" DDP's wire averages them in bf16 and every other gradient in fp32, whatever shares a bucket.

Where the bound comes from: bf16 keeps 8 significant bits, so rounding moves x by at most u |x|, u = 2^-8.
DDP's hook rounds each rank's fp32 sum g_r, halves it (exact), and gloo rounds the sum of the two halves; so
    |synced - (g_0 + g_1) / 2| <= u (1 + u) (|g_0| + |g_1|) / 2 + u |(g_0 + g_1) / 2|.
"""
from itertools import pairwise

import pytest
import torch

from tests.helpers import ROOT, final_val_loss, tiny_args, tiny_data, torchrun, train_values
from trainer.config import ConfigError, parse_args

U = 2.0 ** -8  # bf16's unit roundoff


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reduce") / "results.pt"
    torchrun([ROOT / "tests" / "workers" / "reduce_worker.py", out], env={"PYTHONPATH": str(ROOT)})
    return torch.load(out, weights_only=True)


def summed(micro_steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A rank's gradients added up over its micro-steps in order, as autograd adds them into .grad (in the
    tensors' dtype)."""
    total = dict(micro_steps[0])
    for grads in micro_steps[1:]:
        total = {name: total[name] + grads[name] for name in total}
    return total


def as_the_wire_rounds(g0: torch.Tensor, g1: torch.Tensor) -> torch.Tensor:
    """The average of two ranks' fp32 gradients as the bf16 wire gives it back: each rounded to bf16 and halved,
    the halves summed and rounded again."""
    return (g0.bfloat16().float() / 2 + g1.bfloat16().float() / 2).bfloat16().float()


@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_the_synced_gradient_is_the_fp32_average_rounded_as_the_bf16_wire_rounds_it(two_ranks, case):
    g0, g1 = map(summed, two_ranks["local"][case])
    bf16, fp32 = two_ranks["synced"][case, "bfloat16"], two_ranks["synced"][case, "float32"]
    assert bf16.keys() == fp32.keys() == g0.keys()
    changed = total = 0
    for name in g0:
        a, b = g0[name].double(), g1[name].double()
        mean = (a + b) / 2
        bound = U * (1 + U) * (a.abs() + b.abs()) / 2 + U * mean.abs()
        assert ((bf16[name].double() - mean).abs() <= bound).all(), name
        assert torch.equal(bf16[name], as_the_wire_rounds(g0[name], g1[name])), name
        assert bf16[name].dtype == torch.float32  # back in fp32, for clipping and the optimizers
        # the fp32 reduce: one fp32 rounding of the sum
        assert ((fp32[name].double() - mean).abs() <= 2.0 ** -23 * (a.abs() + b.abs())).all(), name
        changed, total = changed + (bf16[name] != fp32[name]).sum().item(), total + mean.numel()
    assert changed > 0.9 * total  # nearly every fp32 average has bits below bf16's 8


def bf16_sums(two_ranks: dict) -> list[dict[str, torch.Tensor]]:
    """Each rank's DDP gradients as optim.bf16_storage leaves them for the wire: the stored weights' micro-steps
    rounded and added in bf16 tensors, as the record's .grad adds them; the rest in fp32."""
    stored = set(two_ranks["stored"])
    return [summed([{name: g.bfloat16() if name in stored else g for name, g in grads.items()} for grads in micro])
            for micro in two_ranks["local"]["ddp"]]


def test_under_bf16_storage_ddp_averages_each_ranks_bf16_sum_of_its_rounded_micro_steps(two_ranks):
    """The tables' gradients (the head tied to the token table): on each rank both micro-steps rounded to bf16 and
    added in bf16 before the wire, the two ranks' sums averaged in fp32; the rest as without it."""
    stored = set(two_ranks["stored"])
    got, plain = two_ranks["synced"]["ddp", "bf16_storage"], two_ranks["synced"]["ddp", "float32"]
    assert {"wte.weight", "wpe.weight"} == stored and got.keys() == plain.keys()
    ranks = bf16_sums(two_ranks)
    for name in got:
        mean = sum(r[name].double() for r in ranks) / 2
        bound = 2.0 ** -22 * sum(r[name].double().abs() for r in ranks)  # the fp32 average's rounding, and room
        assert ((got[name].double() - mean).abs() <= bound).all(), name
        assert torch.equal(got[name], plain[name]) == (name not in stored), name


@pytest.mark.parametrize("variant, kinds", [("storage", [(False, True)]), ("storage_each", [(False,), (True,)])])
def test_the_storage_wire_sends_the_bf16_stored_weights_sums_in_bf16_and_the_rest_in_fp32(two_ranks, variant, kinds):
    """One bucket holding both kinds (the tiny model's, under parallelize), and a bucket for each parameter: the
    stored weights' bf16 sums averaged as the bf16 wire rounds them, every other gradient bit-equal to the fp32
    wire's."""
    stored = set(two_ranks["stored"])
    got, plain = two_ranks["synced"]["ddp", variant], two_ranks["synced"]["ddp", "float32"]
    assert two_ranks["buckets"][variant] == kinds and got.keys() == plain.keys()
    r0, r1 = bf16_sums(two_ranks)
    for name in got:
        expected = as_the_wire_rounds(r0[name].float(), r1[name].float()) if name in stored else plain[name]
        assert torch.equal(got[name], expected), name
    assert not all(torch.equal(got[name], plain[name]) for name in stored)
    # each value crosses once, in its wire's dtype: no gradient twice, none of the bf16 ones in fp32
    assert two_ranks["sent"][variant] == sum(g.numel() * (2 if name in stored else 4) for name, g in got.items())


def test_the_storage_wire_needs_ddp_and_bf16_storage():
    args = ["--config", "configs/tiny.toml", "--data.train=x", "--train.reduce_dtype=storage"]
    with pytest.raises(ConfigError, match="without optim.bf16_storage every weight is stored in fp32: set "
                                          "optim.bf16_storage = true, or train.reduce_dtype = 'float32' or"):
        parse_args(args)
    with pytest.raises(ConfigError, match="through a hook on DDP's buckets, and train.parallel = 'fsdp' has none"):
        parse_args([*args, "--optim.bf16_storage=true", "--train.parallel=fsdp"])
    assert parse_args([*args, "--optim.bf16_storage=true"]).train.reduce_dtype == "storage"


def test_under_bf16_storage_fsdp2_rounds_the_ranks_average_as_it_joins_the_sharded_grad(two_ranks):
    """FSDP2's sharded weights see only the hook after the sum (FSDP2 calls it after its reduce-scatter): the stored
    weights' gradients are the fp32 average rounded to bf16; the rest as without it."""
    stored = set(two_ranks["stored"])
    got, plain = two_ranks["synced"]["fsdp", "bf16_storage"], two_ranks["synced"]["fsdp", "float32"]
    assert got.keys() == plain.keys() and stored <= got.keys()
    for name in got:
        assert torch.equal(got[name], plain[name].bfloat16().float() if name in stored else plain[name]), name
    assert not all(torch.equal(plain[name], got[name]) for name in stored)  # the average had bits below bf16's


def test_a_nan_gradient_on_one_rank_survives_the_bf16_wire_into_the_norm(two_ranks):
    # the non-finite guard (trainer/flags.py) reads this norm on the steps that take it (a clip, or a log due)
    assert not torch.isfinite(torch.tensor(two_ranks["nan_norm"]))


def test_fsdp_with_one_micro_step_takes_bf16_reduction():
    cfg = parse_args(["--config", "configs/tiny.toml", "--data.train=x", "--train.parallel=fsdp",
                      "--train.grad_accum=1", "--train.reduce_dtype=bfloat16"])
    assert cfg.train.reduce_dtype == "bfloat16"


CLIP = 0.2  # below the tiny run's gradient norms (0.3 to 0.5)


def test_a_run_reducing_in_bf16_trains_as_the_fp32_one_within_the_rounding(tmp_path):
    """Two ranks, two micro-steps a step, AdamW with every step's gradient clipped (to 0.2). The wire
    moves each synced gradient by about 2u of itself at most where the ranks' gradients agree in sign (above), and
    AdamW's update m / sqrt(v) by about 2u; to first order each step's loss moves by at most
    2u of what the updates so far moved it. The fp32 run's summed step-to-step loss changes stand in for that
    movement; each batch's own difference in them only widens the bound."""
    data, runs = tiny_data(tmp_path / "data"), tmp_path / "runs"
    for reduce_dtype in ("float32", "bfloat16"):
        torchrun(tiny_args(data, runs, reduce_dtype, "--train.max_steps=12", f"--optim.grad_clip={CLIP}",
                           f"--train.reduce_dtype={reduce_dtype}"), env={"PYTHONPATH": str(ROOT)})
    fp32, bf16 = train_values(runs / "float32"), train_values(runs / "bfloat16")
    assert min(train_values(runs / "bfloat16", "grad_norm")) > CLIP  # so every step clips
    assert len(fp32) == len(bf16) == 12 and fp32[0] == bf16[0]  # the same start: no update yet
    for k in range(1, 12):
        moved = sum(abs(b - a) for a, b in pairwise(fp32[:k + 1]))
        assert abs(bf16[k] - fp32[k]) <= 2 * U * moved, k
    assert bf16 != fp32  # the wire did round
    moved = sum(abs(b - a) for a, b in pairwise(fp32))
    assert abs(final_val_loss(runs / "bfloat16") - final_val_loss(runs / "float32")) <= 2 * U * moved
