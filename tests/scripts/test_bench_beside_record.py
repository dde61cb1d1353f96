"""python -m scripts.bench.beside_record on CPU: the plan (each rewrite and override said), the data and shape
checks, the record's side refused without a GPU, our side run on a tiny shape, and the report against a record
log made here in its format."""
import json
import re
import sys

import pytest

from scripts.beside import report
from scripts.bench import beside_record
from tests.helpers import ROOT, run
from tests.scripts.beside_fixtures import record_log, record_script, record_shards

# A tiny shape of ours that matches the fixture's record: its rows (documents in sorted order, cut at 160 tokens),
# 8 micro-steps of one row of 320 tokens, rows x 1, 2, 3 by stage, evals in rows of 320 = 2,560 / 8 tokens; Muon,
# so that its steps are counted; extension steps, as the speedrun config has, which the harness cuts as it cuts the
# record's; an eval at step 0, as the speedrun config and the record have
TINY = '''base = "{root}/configs/tiny.toml"
[data]
bos_aligned = true
shuffle = false
sorted_shards = true
doc_cut = 160
[model]
vocab_size = 50257
block_size = 960
[optim]
name = "muon"
embed_lr = 0.01
[train]
batch_size = 1
seq_len = 320
grad_accum = 8
batch_stages = [1, 2, 3]
batch_stage_rows = true
extension_steps = 4
[eval]
seq_len = 320
batch_size = 1
at_start = true
'''


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """The fixture's record script and shards, a tiny config of ours, and the harness's arguments for them."""
    tmp = tmp_path_factory.mktemp("beside")
    record = record_script(tmp)
    data = record_shards(tmp / "data", [[300] * 300, [300] * 300], val_tokens=2560 * 2 + 100)
    config = tmp / "tiny_beside.toml"
    config.write_text(TINY.format(root=ROOT))
    args = ["--record", str(record), "--data", str(data), "--steps", "8", "--eval-every", "4", "--profile-steps", "1",
            "--work", str(tmp / "work"), "--out", str(tmp / "out"), "--ours-config", str(config)]
    return tmp, args


def harness(args, *extra, check=True):
    return run([sys.executable, "-m", "scripts.bench.beside_record", *args, *extra], check=check, timeout=600)


def test_the_plan_says_each_change_and_refuses_what_would_not_train_alike(bench, capsys):
    tmp, args = bench
    p = beside_record.plan(beside_record.parse_args(args))
    assert p.changes == {"num_scheduled_iterations": (90, 8), "num_extension_iterations": (10, 0),
                         "val_loss_every": (25, 4), "val_tokens": (10240, 5120)}  # 2 val batches fit the shard
    assert "    num_scheduled_iterations: int = 8  # steps of the schedule" in p.code
    assert p.record_warmup_steps == 40  # 10 warm-up steps at each of its 4 (batch, window) pairs
    lines = beside_record.say_plan(beside_record.parse_args(args), p)
    assert "  val_tokens: 10240 -> 5120" in lines
    assert any("--train.max_steps=8" in line and "--eval.tokens=5120" in line for line in lines)
    assert p.cfg.train.steps == 8  # no extension steps on either side
    with pytest.raises(beside_record.RecordError, match=r"\[2560, 5120, 7680\] tokens by stage, ours \[2560\]"):
        beside_record.plan(beside_record.parse_args([*args, "--ours-set", "train.batch_stages=[]", "--ours-set",
                                                     "train.batch_stage_rows=false"]))
    assert lines[-1].endswith("growing by stage; ours 8 micro-batches of 1 x 320 -> 8 micro-batches of 1 x 640 -> "
                              "8 micro-batches of 1 x 960")
    rows = beside_record.plan(beside_record.parse_args([*args, "--ours-set", "train.batch_stage_rows=false"]))
    assert beside_record.say_plan(beside_record.parse_args(args), rows)[-1].endswith(
        "ours 8 micro-batches of 1 x 320 -> 16 micro-batches of 1 x 320 -> 24 micro-batches of 1 x 320")
    with pytest.raises(beside_record.RecordError, match="forwards of 320 tokens"):
        beside_record.plan(beside_record.parse_args([*args, "--ours-set", "eval.batch_size=2"]))
    with pytest.raises(beside_record.RecordError, match="each cut at 160 tokens; ours has data.sorted_shards = True, "
                                                        "bos_aligned = True, doc_cut = 0"):
        beside_record.plan(beside_record.parse_args([*args, "--ours-set", "data.doc_cut=0"]))


def test_tokens_per_second_count_from_the_first_eval_after_step_0_to_the_last(bench, capsys):
    # the profiled steps come after step 0's eval, before the next: they are never timed
    assert report.window([0, 4, 8]) == (4, 8) and report.window([0, 4]) is None and report.window([]) is None
    tmp, args = bench
    with pytest.raises(SystemExit):
        beside_record.parse_args([*args, "--steps", "7"])
    assert "--steps must be at least twice --eval-every" in capsys.readouterr().err


def test_data_the_record_would_run_out_of_is_refused_and_epochs_give_it_more(bench):
    tmp, args = bench
    proc = harness([*args, "--steps", "400", "--eval-every", "100"], check=False)
    assert proc.returncode == 1
    given = re.search(r"the record's loader gets (\d+) of the 400 steps from these shards \(1 epoch\(s\)\) and would "
                      r"then wait for ever: lower --steps, raise --epochs", proc.stderr)
    assert given
    # twice the shards, both sides: the steps past one epoch are read, and the plan is said before the CPU refusal
    steps = int(given[1]) + 1
    proc = harness([*args, "--steps", str(steps), "--eval-every", "10", "--epochs", "2", "--side", "record"],
                   check=False)
    assert f"the record's loader reads all {steps} steps from the shards read 2 times in a row" in proc.stdout
    assert f"--data.train={tmp / 'work' / 'epoch_links'}/data/fineweb10B/fineweb_train_*.bin" in proc.stdout
    assert proc.returncode == 1 and "the record's script needs CUDA" in proc.stderr


@pytest.mark.slow
def test_on_cpu_the_record_side_is_refused_and_ours_runs_and_the_report_reads_both(bench):
    tmp, args = bench
    proc = harness([*args, "--side", "record"], check=False)
    assert proc.returncode == 1 and "the record's script needs CUDA" in proc.stderr
    assert "  num_scheduled_iterations: 90 -> 8" in proc.stdout  # the plan is said before the refusal
    proc = harness([*args, "--side", "ours", "--epochs", "2"])  # ours reads the shards through the epochs' links
    assert "the record's loader reads all 8 steps from the shards read 2 times in a row" in proc.stdout
    probe = json.loads((tmp / "work" / "ours" / "probe.json").read_text())
    assert probe["muon_steps"] == 8 and probe["error"] is None
    assert probe["profile"]["time"] == "cpu" and probe["profile"]["step_ms"] > 0
    evals = [json.loads(line) for line in (tmp / "work" / "ours" / "run" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, 4, 8]
    record_log(tmp / "work" / "record" / "logs" / "rec.txt", {0: (10.83, 0), 4: (9.0, 600), 8: (8.0, 1400)}, 8)
    proc = harness([*args, "--side", "report"])
    table = (tmp / "out" / "table.md").read_text()
    assert table in proc.stdout
    ours = {e["step"]: e for e in evals}
    assert f"| 4 | 9.0000 | {ours[4]['val_loss']:.4f} | {ours[4]['val_loss'] - 9:+.4f} |" in table
    assert f"| 8 | 8.0000 | {ours[8]['val_loss']:.4f} |" in table
    assert f"| 0 | 10.8300 | {ours[0]['val_loss']:.4f} |" in table and ours[0]["tokens"] == 0
    res = json.loads((tmp / "out" / "beside.json").read_text())
    # the same timed steps, 4 to 8 (the eval at step 0 starts none: the profiled steps follow it): 2 steps of 5,120
    # tokens and 2 of 7,680 by the record's schedule, in 0.8 s
    assert res["speed"]["steps"] == [4, 8] and res["speed"]["record"]["tokens"] == 25600
    assert res["speed"]["record"]["tok_s"] == pytest.approx(25600 / 0.8)
    assert res["speed"]["ours"]["tokens"] == ours[8]["tokens"] - ours[4]["tokens"] == 25600
    assert "| tokens/s (steps 4–8) | 32,000 |" in table and "| compile s | n/a |" in table
    kept = (tmp / "out" / "record_log.txt").read_text()
    assert "Hyperparameters" not in kept and kept.startswith("(the record's code, ")
    assert "step:8/8 val_loss:8.0000" in kept and (tmp / "out" / "ours_log.txt").is_file()
    assert (tmp / "out" / "loss.png").stat().st_size > 10_000


def test_a_side_past_its_timeout_is_stopped_and_its_probe_still_writes(tmp_path):
    from tests.scripts.test_beside_side_probe import SCRIPT

    script = tmp_path / "train_like.py"
    script.write_text(SCRIPT)
    cmd = beside_record.probe_cmd(tmp_path / "probe.json", 0, 0, script, str(tmp_path / "argv.txt"), "hang")
    console = tmp_path / "side" / "console.txt"
    # 45 s: torch's import and six steps, several times slower on a busy machine, come before the hang
    assert beside_record.run_side(cmd, ROOT, {"PYTHONPATH": str(ROOT)}, console, timeout=45) == "timeout"
    res = json.loads((tmp_path / "probe.json").read_text())
    assert res["error"] == "exit 143" and res["muon_steps"] == 6 and "steps done" in console.read_text()


# What the record's side gives its script, checked by a CPU script in the record's place (require_cuda is the main's
# gate): torchrun's variables at world size 1, DATA_PATH, the kernels stand-in on its path, its own folder to write
# logs/ in, the probe around it
IN_PLACE = '''import os, sys, uuid
from pathlib import Path
import torch
from kernels import get_kernel
attend = get_kernel("varunneal/flash-attention-3").flash_attn_interface.flash_attn_varlen_func
assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
assert Path(os.environ["DATA_PATH"], "data", "fineweb10B", "fineweb_val_000000.bin").is_file()
code = open(sys.argv[0]).read()
class NorMuon(torch.optim.SGD):
    pass
w = torch.nn.Parameter(torch.randn(64, 64))
opt = NorMuon([w], lr=0.01)
q = torch.randn(128, 2, 32)
cu = torch.tensor([0, 50, 128, 128], dtype=torch.int32)
for step in range(40 + 8):  # 40 warm-up steps, then the 8 timed ones
    with torch.no_grad():
        attend(q, q, q, cu, cu, 128, 128, causal=True, softmax_scale=0.1, window_size=(16, 0))
    (w @ w).sum().backward()
    opt.step()
    opt.zero_grad()
os.makedirs("logs", exist_ok=True)
with open(f"logs/{uuid.uuid4()}.txt", "w") as log:
    print(code + "=" * 100, file=log)
    for step, loss in ((0, 10.8), (4, 9.0), (8, 8.0)):
        print(f"step:{step}/8 val_loss:{loss:.4f} train_time:{step * 100}ms step_avg:100.00ms", file=log)
'''


def test_the_records_side_gives_its_script_what_it_reads(bench):
    import dataclasses

    tmp, args = bench
    parsed = beside_record.parse_args([*args, "--work", str(tmp / "in_place")])
    p = dataclasses.replace(beside_record.plan(parsed), code=IN_PLACE)
    assert beside_record.run_record(parsed, p, 120) == "ok", (tmp / "in_place" / "record" / "console.txt").read_text()
    console = (tmp / "in_place" / "record" / "console.txt").read_text()
    assert "kernels stand-in: varunneal/flash-attention-3 -> FlexAttention" in console
    probe = json.loads((tmp / "in_place" / "record" / "probe.json").read_text())
    assert probe["muon_steps"] == 48 and probe["error"] is None and probe["profile"]["step_ms"] > 0
    assert report.record_log(tmp / "in_place") is not None
