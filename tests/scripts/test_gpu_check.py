"""scripts/gpu_check.sh: the CPU rehearsal runs every check for real, the budgets add up, and the verdicts can fail."""
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.val import PAD_TARGET
from model.fp8 import fp8_matmul, fp8_matmul_bounds, head_scales
from scripts.gpu_check import kernels as kernel_check, probe as train_probe, runner as gpu_check, verdicts
from scripts.gpu_check import sizes as check_sizes
from data.meta import read_meta
from data.shards import open_shard
from tests.helpers import ROOT, bf16_attention_error, demo_data, make_shards, run, stock_node
from trainer.config import parse_args as parse_train_args
from trainer.data import resolve_data, val_loader
from trainer.distributed import Dist

BF16_ATTENTION = bf16_attention_error()  # None where torch runs a masked bf16 attention on this CPU


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_check_on_a_stock_image_from_a_wheel_folder(tmp_path):
    out, record = tmp_path / "check.json", tmp_path / "record"
    # the one FAIL allowed: the kernels' bf16 attention where torch cannot run it on this CPU (a forced capability)
    unavailable = BF16_ATTENTION
    proc = run(["bash", "scripts/gpu_check.sh", "--cpu", "--json", str(out), "--work", str(tmp_path / "work"),
                "--record", str(record)], env=stock_node(tmp_path / "node"), timeout=480, check=not unavailable)
    assert proc.returncode == (1 if unavailable else 0), proc.stderr[-3000:]
    assert "from " + str(tmp_path / "node" / "wheels") + ", no index" in proc.stdout  # set up from the folder
    res = json.loads(out.read_text())
    checks = {r["check"]: r for r in res["checks"]}
    assert list(checks) == list(check_sizes.CHECKS)
    assert all(r["status"] == "ok" for r in checks.values()), {n: r.get("output_tail") for n, r in checks.items()}
    assert [v for v in res["verdicts"] if v["verdict"] == "FAIL"
            and not (unavailable and v["check"] == "kernels" and unavailable in v["measured"])] == []
    for name in gpu_check.TRAINING:
        r, probe = checks[name], checks[name]["probe"]
        assert probe["stage"] == "done" and r["steps"] >= 2 and r["peak_mem_gb"] > 0 and r["tok_s"] > 0
        phases = probe["phases"]["phases"]
        # every phase of the real step was marked, and the shares of a step add up to all of it
        assert {"data", "forward+backward", "adamw", "muon", "other", "flags", "idle"} <= set(phases), phases
        assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0)
        assert probe["eval"]["second"]["frames_compiled"] == 0
        assert f"| {name} |" in proc.stdout
        assert [v["verdict"] for v in res["verdicts"] if v["check"] == name][:2] == ["PASS", "PASS"]
        # the evals came halfway through the run (its steps on CPU) and training went on after them; every stage's
        # compile counts were taken, and both compile figures recorded for the next run's budgets
        assert probe["after_eval"]["steps"] >= 1 and probe["train_loop"]["steps"] >= 1
        for stage in (probe["warm_up"], probe["train_loop"], probe["eval"]["first"], probe["after_eval"]):
            assert stage["dynamic_graphs"] == stage["same_shape_graphs"] == 0
        assert set(probe["started"]) == {"warm_up", "eval"}
        assert r["compile_s"] is not None and r["eval_compile_s"] is not None and r["eval_first_s"] > 0
        assert (tmp_path / "work" / "runs" / name / "summary.json").exists()
    # no check saved a checkpoint or a resume state
    assert [*(tmp_path / "work").rglob("checkpoint*"), *(tmp_path / "work").rglob("resume")] == []
    # random tokens teach nothing; the real text does, at the speedrun's vocabulary (the record's, padded)
    assert checks["speedrun"]["init_loss"] == math.log(50304) and checks["hackathon"]["init_loss"] == math.log(32000)
    assert checks["speedrun"]["val_loss"] == pytest.approx(math.log(50304), abs=0.1)
    assert checks["hackathon"]["val_loss"] == pytest.approx(math.log(32000), abs=0.1)
    assert checks["text"]["init_loss"] == math.log(50304) and checks["text"]["val_loss"] < math.log(50304) - 1.5
    text_cfg = tomllib.loads((tmp_path / "work" / "runs" / "text" / "config.toml").read_text())
    assert text_cfg["model"]["vocab_size"] == 50304 and text_cfg["model"]["bos_id"] == 50256
    assert "reuses the speedrun's compiled graphs" in [v["what"] for v in res["verdicts"] if v["check"] == "text"]
    # each check trained the recipe it names, on the data built for it; the speedrun: one 48K sequence a step
    assert "configs/hackathon_32gpu.toml" in checks["hackathon"]["args"]
    assert checks["speedrun"]["probe"]["shape"]["grad_accum"] == 1
    summary = json.loads((tmp_path / "work" / "runs" / "text" / "summary.json").read_text())
    assert summary["config_name"] == "speedrun_8xh100" and summary["status"] == "completed"  # its steps, not the cap
    kernels = checks["kernels"]["kernels"]
    assert kernels["ring_speedrun"]["mismatches"] == kernels["ring_hackathon"]["mismatches"] == 0
    if unavailable is None:
        assert kernels["flex"]["ok"]["out"] and kernels["flex"]["shape"]["head_dim"] == 128
    # the float8 head's matmul ran its code path at a tiny shape, eager and compiled, and within its bound
    assert kernels["fp8"]["ok"] == {"eager": True, "compiled": True} and "fp8_compiled" in kernels["fp8"]["ms"]
    assert [v["verdict"] for v in res["verdicts"] if v["what"].startswith("FP8 head")] == ["PASS", "PASS", "n/a on CPU"]
    # the symmetric kernel, in Triton's interpreter, at two small stacks
    assert [v["verdict"] for v in res["verdicts"] if "symmetric" in v["what"] or "Polar" in v["what"]] == (
        ["PASS", "PASS", "n/a on CPU (interpreter)"] if find_spec("triton") else ["n/a"])
    # what re-tuning the configs needs, and the record
    assert res["retune"]["speedrun"]["tokens_per_s"] > 0 and res["retune"]["hackathon"]["seq_len"] == 128
    assert json.loads((record / "gpu_check.json").read_text()) == res
    assert "| check | what | verdict | measured | threshold |" in (record / "table.md").read_text()
    assert "Where a step's time goes" in proc.stdout


def test_checks_runs_only_the_checks_named(tmp_path):
    out = tmp_path / "check.json"
    proc = run([sys.executable, "-m", "scripts.gpu_check", "--cpu", "--checks", "hackathon", "--json", str(out),
                "--work", str(tmp_path / "work")], timeout=300)
    assert [r["check"] for r in json.loads(out.read_text())["checks"]] == ["hackathon"], proc.stdout
    assert {v["check"] for v in json.loads(out.read_text())["verdicts"]} == {"hackathon"}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--checks", "hackathon,nosuch"])


@pytest.mark.parametrize("sizes", [check_sizes.GPU, check_sizes.CPU], ids=["gpu", "cpu"])
def test_budgets_add_up_within_the_deadline_and_the_shell_bound(sizes):
    parts = sum(sizes.timeout_s.values()) + len(sizes.timeout_s) * check_sizes.KILL_GRACE_S
    assert parts == sizes.planned_s() <= sizes.deadline_s
    # gpu_check.sh runs `bash run.sh gpu-check`, which bounds the Python body
    term, kill = map(int, re.search(r"gpu-check\) exec timeout --kill-after=(\d+) (\d+)",
                                    (ROOT / "run.sh").read_text()).groups()[::-1])
    # the outer TERM comes after the deadline and leaves the script its kill grace, and all ends within 540 s
    assert term > sizes.deadline_s and kill > check_sizes.KILL_GRACE_S and term + kill <= check_sizes.CALL_S == 540
    with pytest.raises(AssertionError):
        dataclasses.replace(sizes, timeout_s={**sizes.timeout_s, "speedrun": sizes.deadline_s})


def test_the_gpu_plan_runs_the_speedrun_first_with_room_for_its_cold_compile():
    assert check_sizes.CHECKS[0] == "speedrun" and list(check_sizes.GPU.timeout_s) == ["data", *check_sizes.CHECKS]
    assert check_sizes.GPU.timeout_s["speedrun"] >= 230  # a cold compile of its model and eval shape, and a margin
    # and no check saves a checkpoint; the speedrun row (and the text row, for its graphs) runs under DDP
    for name in gpu_check.TRAINING:
        cfg = parse_train_args(gpu_check.check_args(name, Path("/w"), check_sizes.GPU)[0])
        assert not cfg.train.save_checkpoint and cfg.train.resume == "never"
        assert cfg.train.ddp_always == (name != "hackathon")
        # its seconds pass every stage of the schedule, as a time schedule cuts them
        assert cfg.train.schedule == "time" and cfg.train.steps == 0


def test_loss_verdicts_catch_a_leaking_mask_and_a_model_that_does_not_learn():
    v = math.log(50257)
    assert verdicts.loss_verdict("speedrun", v + 0.01, v, 2.5)["verdict"] == "PASS"
    assert verdicts.loss_verdict("speedrun", v - 1.0, v, 2.5)["verdict"] == "FAIL"
    assert verdicts.loss_verdict("speedrun", None, v, 2.5)["verdict"] == "FAIL"
    assert verdicts.loss_verdict("text", 1.2, math.log(50257), 2.5)["verdict"] == "PASS"
    for bad in (0.01, 4.0, float("nan")):
        assert verdicts.loss_verdict("text", bad, math.log(50257), 2.5)["verdict"] == "FAIL"


def probe_result(**changes) -> dict:
    """A speedrun probe result as a clean GPU run would leave it, with `changes` on top."""
    clean = {"graph_breaks": 0, "recompiles": 0, "frames_compiled": 0, "break_reasons": [], "recompile_reasons": [],
             "dynamic_graphs": 0, "dynamic_reasons": [], "same_shape_graphs": 0, "same_shape_codes": []}
    probe = {"shape": {"compile": True, "batch_size": 12, "param_gb": 1.0},
             "device": {"name": "NVIDIA H100 80GB HBM3", "total_gb": 80.0}, "memory_static": {"static_gb": 3.0},
             "warm_up": {**clean, "seconds": 60.0, "steps": 5, "peak_gb": 30.0, "peak_reserved_gb": 40.0},
             "train_loop": {**clean, "steps": 50},
             "eval": {"first": {**clean, "frames_compiled": 1}, "second": dict(clean), "compile_s": 20.0},
             "after_eval": {**clean, "steps": 50},
             "phases": {"peak_gb": 28.0, "peak_reserved_gb": 40.0, "tok_s": 4e5, "mfu": 0.4, "step_ms_mean": 120.0,
                        "phases": {"data": {"share": 0.001}, "idle": {"share": 0.01}}}}
    for path, value in changes.items():
        *keys, last = path.split(".")
        node = probe
        for key in keys:
            node = node[key]
        node[last] = value
    return probe


def verdicts_of(probe: dict, cpu: bool = False) -> dict[str, str]:
    row = {"check": "speedrun", "status": "ok", "timeout_s": 165, "init_loss": math.log(50257), "probe": probe,
           **gpu_check.figures({"final_val_loss": 10.83}, probe, None, None)}
    return {v["what"]: v["verdict"] for v in verdicts.training_verdicts(row, check_sizes.GPU, cpu)}


def test_training_verdicts_pass_a_clean_run_and_name_what_is_wrong():
    clean = verdicts_of(probe_result())
    assert set(clean.values()) <= {"PASS", "info"}, clean
    assert len(clean) == 13
    dynamic = ["forward (gpt.py:300): l_idx_ [1, 's0']"]
    broken = {
        "graph breaks, training": probe_result(**{"train_loop.graph_breaks": 1}),
        "recompiles in the timed loop": probe_result(**{"train_loop.recompiles": 2}),
        # the eval's shape compiled with a symbolic sequence length: what dynamic=None does at the second shape
        "no graph marked dynamic": probe_result(**{"eval.first.dynamic_graphs": 1,
                                                   "eval.first.dynamic_reasons": dynamic}),
        "one graph per shape": probe_result(**{"warm_up.same_shape_graphs": 1}),
        "eval: one compiled shape, no graph break": probe_result(**{"eval.second.frames_compiled": 1}),
        "training resumes after the eval without a recompile": probe_result(**{"after_eval.recompiles": 1,
                                                                              "after_eval.frames_compiled": 1}),
        "MFU": probe_result(**{"phases.mfu": 0.2}),
        "GPU idle between steps, share of a step": probe_result(**{"phases.phases.idle.share": 0.05}),
        "data wait, share of a step": probe_result(**{"phases.phases.data.share": 0.02}),
        "peak memory (reserved)": probe_result(**{"phases.peak_reserved_gb": 79.0}),
    }
    for what, probe in broken.items():
        got = verdicts_of(probe)
        assert got[what] in ("FAIL", "SLOW"), (what, got)
        assert {k: v for k, v in got.items() if k != what} == {k: v for k, v in clean.items() if k != what}
    assert "s0" in {v["what"]: v for v in verdicts.training_verdicts(
        {"check": "speedrun", "status": "ok", "init_loss": 10.8, "probe": broken["no graph marked dynamic"]},
        check_sizes.GPU, False)}["no graph marked dynamic"]["measured"]
    # a stage that never came, or a torch that does not record graph sizes: said, not passed
    no_resume = probe_result()
    del no_resume["after_eval"]
    assert verdicts_of(no_resume)["training resumes after the eval without a recompile"] == "FAIL"
    unsized = verdicts_of(probe_result(**{"warm_up.dynamic_graphs": None, "warm_up.same_shape_graphs": None}))
    assert unsized["no graph marked dynamic"].startswith("n/a") and unsized["one graph per shape"].startswith("n/a")
    # on CPU the speed verdicts are not the GPU's
    assert verdicts_of(probe_result(**{"phases.mfu": 0.2}), cpu=True)["MFU"].startswith("n/a")
    assert verdicts_of(probe_result(eval_oom="CUDA out of memory", eval_oom_shape=[1, 262144])
                       )["eval at its configured shape fits"] == "FAIL"
    # a result the verdicts did not foresee is a FAIL line, not a crash that loses the single GPU run's JSON
    [odd] = verdicts.judged({"check": "speedrun", "status": "ok", "probe": {"warm_up": 3}}, check_sizes.GPU, False)
    assert odd["verdict"] == "FAIL" and odd["what"] == "verdicts"


def test_a_hackathon_compile_over_its_share_of_the_clock_is_slow():
    probe = probe_result(**{"warm_up.seconds": 90.0})
    row = {"check": "hackathon", "status": "ok", "init_loss": math.log(32000), "probe": probe,
           **gpu_check.figures({"final_val_loss": 10.4}, probe, None, None)}
    got = {v["what"]: v for v in verdicts.training_verdicts(row, check_sizes.GPU, False)}
    assert got["compile seconds (training; eval)"]["verdict"] == "SLOW"
    assert got["compile seconds (training; eval)"]["measured"].startswith("89.4")  # 90 s less 5 steps of 120 ms


def test_kernel_verdicts_fail_a_ring_mismatch_a_loose_kernel_and_an_error():
    ring = {"batches": 200, "mismatches": 0, "state_equal": True}
    flex = {"shape": {"head_dim": 128, "seq_len": 2048, "window": 1024, "doc_causal": True},
            "flex": {"out": 0.004, "dq": 0.005, "dk": 0.005, "dv": 0.005},
            "sdpa": {"out": 0.003, "dq": 0.004, "dk": 0.004, "dv": 0.004}, "compile_s": 30.0, "ms": {}}
    flex["tolerance"] = {k: kernel_check.tolerance(v) for k, v in flex["sdpa"].items()}
    flex["ok"] = {k: flex["flex"][k] <= flex["tolerance"][k] for k in flex["sdpa"]}
    errors = {"out": 0.04, "grad_x": 0.05, "grad_w": 0.05}
    fp8 = {"shape": {"rows": 16384, "width": 768, "vocab": 50304}, "bound": {"out": 0.2, "grad_x": 0.2, "grad_w": 0.2},
           "eager": errors, "compiled": errors, "ok": {"eager": True, "compiled": True}, "compile_s": 5.0,
           "ms": {"fp8": 4.0, "fp8_compiled": 3.0, "bf16": 6.0}, "speedup": 2.0}
    stack = {f"{name}{plain}": 0.004 for name in kernel_check.SYMMETRIC_ERRORS for plain in ("", "_plain")}
    symmetric = {"dtype": "bfloat16", "errors": {"40 x 768 x 768": stack, "22 x 768 x 3072": stack},
                 "ok": {"40 x 768 x 768": True, "22 x 768 x 3072": True}, "speedup": 1.2,
                 "ms": {"matmul": 6.0, "symmetric": 5.0}}

    def kernel_lines(kernels: dict) -> list[str]:
        return [v["verdict"] for v in verdicts.kernel_verdicts({"status": "ok", "kernels": kernels}, cpu=False)]

    fine = {"ring_speedrun": ring, "ring_hackathon": ring, "flex": flex, "fp8": fp8, "symmetric": symmetric}
    assert kernel_lines(fine) == ["PASS"] * 8 + ["info"] + ["PASS"] * 2 + ["info"]
    assert kernel_lines({**fine, "ring_speedrun": {**ring, "mismatches": 3}})[1] == "FAIL"
    loose = {**flex, "ok": {**flex["ok"], "dk": False}}
    assert kernel_lines({**fine, "flex": loose})[3:6] == ["PASS", "FAIL", "PASS"]
    assert kernel_lines({**fine, "flex": {"error": "OutOfResources: shared memory"}})[3:7] == ["FAIL", "PASS", "PASS",
                                                                                               "info"]
    # the float8 head: a compiled result past its bound, a compile that raised (the eager lines stay), a check
    # that raised (a CUDA layout error)
    assert kernel_lines({**fine, "fp8": {**fp8, "ok": {"eager": True, "compiled": False}}})[6:9] == ["PASS", "FAIL",
                                                                                                      "info"]
    assert kernel_lines({**fine, "fp8": {**fp8, "compiled": {"error": "BackendCompilerFailed: inductor"},
                                         "ok": {"eager": True, "compiled": False}}})[6:9] == ["PASS", "FAIL", "info"]
    failed = verdicts.kernel_verdicts({"status": "ok", "kernels": {**fine, "fp8": {
        "error": "RuntimeError: mat2 must be col_major"}}}, cpu=False)[6:7]
    assert [(v["verdict"], v["measured"]) for v in failed] == [("FAIL", "RuntimeError: mat2 must be col_major")]
    # the symmetric kernel: one stack past its tolerance; a node without Triton
    assert kernel_lines({**fine, "symmetric": {**symmetric, "ok": {**symmetric["ok"], "22 x 768 x 3072": False}}})[
        9:] == ["PASS", "FAIL", "info"]
    assert kernel_lines({**fine, "symmetric": {"status": "n/a: Triton is not installed"}})[9:] == ["n/a"]
    # a check stopped before a part: that part is a FAIL line, not a missing one
    assert kernel_lines({"ring_speedrun": ring}) == ["PASS", "PASS", "FAIL", "FAIL", "FAIL", "FAIL"]


def test_the_fp8_check_passes_the_float8_head_and_fails_a_result_off_by_more_than_its_rounding():
    cfg = parse_train_args(["--config", "configs/speedrun_1gpu.toml"])
    res = kernel_check.guarded(kernel_check.fp8_check, cfg, torch.device("cpu"), True)
    assert res["ok"] == {"eager": True, "compiled": True}, res
    assert all(0 < res["eager"][name] < res["bound"][name] < 0.5 for name in res["bound"]), res
    assert set(res["ms"]) == {"fp8", "fp8_compiled", "bf16"} and res["speedup"] > 0
    # the same operands and references, a product half again too large: every result past its bound
    x, w, grad = kernel_check.fp8_operands(*kernel_check.FP8_CPU_SHAPE, torch.device("cpu"))
    s = head_scales(x.size(1), x.size(0))
    off = kernel_check.fp8_errors(lambda x, w: 1.5 * fp8_matmul(x, w, s), x, w, grad,
                                  fp8_matmul_bounds(x, w, grad, s))
    assert all(off[name] > res["bound"][name] for name in res["bound"]), (off, res["bound"])


def test_the_symmetric_check_passes_the_kernel_and_its_errors_show_a_product_off_by_more_than_a_rounding():
    """In Triton's interpreter at two small fp32 stacks; then the kernel's results with the tiles below the diagonal
    off by 1% of the largest value."""
    cfg = parse_train_args(["--config", "configs/speedrun_1gpu.toml"])
    res = kernel_check.guarded(kernel_check.symmetric_check, cfg, torch.device("cpu"), True)
    assert res["ok"] == {"2 x 128 x 160": True, "1 x 192 x 200": True}, res
    assert set(res["ms"]) == {"matmul", "symmetric"} and res["speedup"] > 0
    product = torch.ops.shardrun.symmetric_product

    def off(x, alpha, c, beta):
        out = product(x, alpha, c, beta)
        return out + 0.01 * out.abs().amax() * torch.ones_like(out).tril(-1)
    x = torch.randn(1, 70, 100, generator=torch.Generator().manual_seed(0))
    errors = kernel_check.symmetric_errors(x / torch.linalg.matrix_norm(x, ord=2), off)
    assert all(errors[name] > kernel_check.tolerance(errors[f"{name}_plain"]) for name in ("gram", "square", "poly"))


def test_muon_stacks_are_the_speedrun_models_matrices_by_shape():
    """Record 46's model: Q, K, V and the output projection [768, 768] in 10 blocks of attention, the MLP's fc and
    proj in 11, the Muon-stepped attention gates, the smear gate."""
    stacks = kernel_check.muon_stacks(parse_train_args(["--config", "configs/speedrun_1gpu.toml"]))
    assert stacks == {(768, 768): 40, (768, 3072): 22, (6, 12): 10, (1, 12): 1}


def test_compile_counts_see_a_graph_break_and_a_recompile():
    def broken(x):
        y = x * 2
        warnings.warn("dynamo cannot trace this")  # a graph break, as a warning inside the model's mask would be
        return y + 1

    torch._dynamo.reset()
    try:
        step = torch.compile(broken, backend="eager")
        s0 = train_probe.compile_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(torch.ones(3))
            s1 = train_probe.compile_state()
            step(torch.ones(3))  # the same call again: nothing new
            s2 = train_probe.compile_state()
            with torch.no_grad():
                step(torch.ones(3))  # a guard fails: grad mode changed
        s3 = train_probe.compile_state()
        first, again, no_grad = (train_probe.compile_delta(a, b) for a, b in ((s0, s1), (s1, s2), (s2, s3)))
        assert first["graph_breaks"] >= 1 and first["frames_compiled"] >= 2 and first["recompiles"] == 0
        assert "warn" in first["break_reasons"][0]
        assert again == {**again, "graph_breaks": 0, "recompiles": 0, "frames_compiled": 0}
        assert no_grad["recompiles"] >= 1 and "grad_mode" in no_grad["recompile_reasons"][0]
        # over the whole stretch, the same sizes compiled again for a reason that is not a shape
        whole = train_probe.compile_delta(s0, s3)
        assert first["same_shape_graphs"] == 0 and whole["same_shape_graphs"] >= 1 and whole["dynamic_graphs"] == 0
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [None, False])
def test_compile_counts_see_a_graph_marked_dynamic(dynamic):
    # dynamo's default (dynamic=None) compiles a second shape with a symbolic size; dynamic=False gives it its own
    # static graph
    torch._dynamo.reset()
    try:
        step = torch.compile(lambda x: (x * 2).sum(-1), backend="eager", dynamic=dynamic)
        s0 = train_probe.compile_state()
        step(torch.ones(2, 8))
        step(torch.ones(2, 16))
        got = train_probe.compile_delta(s0, train_probe.compile_state())
        assert got["frames_compiled"] == 2 and got["same_shape_graphs"] == 0
        assert got["dynamic_graphs"] == (1 if dynamic is None else 0)
        assert bool(got["dynamic_reasons"]) == (dynamic is None)
    finally:
        torch._dynamo.reset()


def test_compile_counts_judge_a_graph_whose_backward_was_compiled_too():
    # AOTAutograd logs the backward's compile as a record of its own, with no code and no sizes: a training
    # step's graphs are still judged (on the GPU, torch 2.11 said "does not record graph sizes" before)
    torch._dynamo.reset()
    try:
        layer = torch.compile(torch.nn.Linear(8, 8), backend="aot_eager", dynamic=False)
        s0 = train_probe.compile_state()
        layer(torch.ones(2, 8)).sum().backward()
        got = train_probe.compile_delta(s0, train_probe.compile_state())
        assert got["frames_compiled"] == 1 and got["dynamic_graphs"] == 0 and got["same_shape_graphs"] == 0
    finally:
        torch._dynamo.reset()


def test_the_text_check_is_judged_on_reusing_the_speedruns_graphs():
    compiled = {"probe": {"shape": {"compile": True}}}
    speedrun = {"check": "speedrun", "compile_s": 120.0, "eval_compile_s": 40.0, **compiled}
    reused = verdicts.reuse_verdict({"check": "text", "compile_s": 20.0, "eval_compile_s": 6.0, **compiled}, speedrun)
    assert reused["verdict"] == "PASS" and reused["measured"] == "training 20.0 s vs 120.0; eval 6.0 s vs 40.0"
    own = verdicts.reuse_verdict({"check": "text", "compile_s": 20.0, "eval_compile_s": 35.0, **compiled}, speedrun)
    assert own["verdict"] == "SLOW"
    eager = verdicts.reuse_verdict({"check": "text", "compile_s": 1.0, "probe": {"shape": {"compile": False}}},
                                    speedrun)
    assert eager["verdict"].startswith("n/a")
    # judged with the rows before it; a skipped speedrun leaves nothing to compare
    text = {"check": "text", "status": "ok", "init_loss": math.log(50257), "probe": probe_result(),
            **gpu_check.figures({"final_val_loss": 1.5}, probe_result(), None, None)}
    whats = [v["what"] for v in verdicts.judged(text, check_sizes.GPU, False, [{"status": "ok", **speedrun}])]
    assert whats[-1] == "reuses the speedrun's compiled graphs"
    skipped = {"check": "speedrun", "status": "skipped: out of time"}
    assert "reuses the speedrun's compiled graphs" not in [v["what"] for v in verdicts.judged(
        text, check_sizes.GPU, False, [skipped])]


def test_a_compile_cut_short_by_the_timeout_reports_how_long_it_had_run():
    t = 1000.0
    in_warm_up = gpu_check.compiles_cut_short({"started": {"warm_up": t}}, t + 250.0)
    assert in_warm_up == {"compile_s_min": 250.0}
    in_eval = gpu_check.compiles_cut_short({"started": {"warm_up": t, "eval": t + 150}, "warm_up": {}}, t + 250.0)
    assert in_eval == {"eval_compile_s_min": 100.0}
    done = {"started": {"warm_up": t, "eval": t + 150}, "warm_up": {}, "eval": {"first": {}}}
    assert gpu_check.compiles_cut_short(done, t + 250.0) == {}
    row = {"check": "speedrun", "status": "timeout after 260 s", **in_warm_up}
    assert verdicts.compile_cell(row, "compile_s") == "> 250" and verdicts.compile_cell(row, "eval_compile_s") == "-"


def test_phases_are_charged_to_the_mark_that_opens_them():
    marks = train_probe.Marks(cuda=False)
    timeline = [(0, "data", 0.0, 0.0), (0, "forward+backward", 0.5, 0.5), (0, "adamw", 2.5, 2.5),
                (0, "idle", 3.0, 3.0), (1, "data", 4.0, 4.0), (1, "forward+backward", 4.0, 4.0),
                (1, "adamw", 6.0, 6.0), (1, "idle", 6.5, 6.5)]
    closed = train_probe.phase_summary(timeline + [(2, "end", 7.0, 7.0)], marks)
    assert closed["steps"] == 2 and closed["step_ms_mean"] == 3500
    assert closed["phases"]["forward+backward"]["device_ms_mean"] == 2000
    assert closed["phases"]["idle"]["device_ms"] == pytest.approx(750)  # median of 1 s and 0.5 s
    assert closed["phases"]["data"]["share"] == pytest.approx(0.25 / 3.5)
    assert sum(p["share"] for p in closed["phases"].values()) == pytest.approx(1.0)
    open_ended = train_probe.phase_summary(timeline, marks)  # the last step has no end: left out
    assert open_ended["steps"] == 1 and open_ended["step_ms_mean"] == 4000


def test_a_check_killed_mid_run_still_reports_what_it_measured(tmp_path):
    # the probe's JSON after its window and metrics.jsonl are what a timeout leaves: SIGKILL, no summary.json
    make_shards(tmp_path, [60_000], vocab=257)
    out, runs = tmp_path / "probe.json", tmp_path / "runs"
    cmd = [sys.executable, "-m", "scripts.gpu_check.probe", f"--probe-out={out}", "--probe-skip=1", "--probe-steps=3",
           "--config", "configs/tiny.toml", f"--data.train={tmp_path}/test_train_*.bin", "--data.val=",
           "--model.vocab_size=257", "--optim.name=muon", "--train.max_steps=100000", f"--log.dir={runs}",
           "--log.run_id=k", "--log.every_steps=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while gpu_check.read_json(out).get("stage") != "window" and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    probe = gpu_check.read_json(out)
    assert probe.get("stage") == "window", err.decode()[-3000:]
    with open(runs / "k" / "metrics.jsonl", "a") as f:
        f.write('{"type": "train", "step": 99, "tok_s')  # a line cut by the kill
    got = gpu_check.figures({}, probe, *gpu_check.steady(runs / "k"))
    assert not (runs / "k" / "summary.json").exists()
    assert got["tok_s"] == probe["phases"]["tok_s"] > 0 and got["step_ms"] > 0 and got["steps"] is None
    assert probe["phases"]["steps"] == 3 and set(probe["phases"]["phases"]) >= {"adamw", "muon", "flags"}
    assert gpu_check.steady(runs / "k")[0] > 0


def test_ring_check_catches_batches_overwritten_in_their_buffer(tmp_path):
    make_shards(tmp_path, [30_000, 30_000])
    data = parse_train_args(["--config", "configs/speedrun_8xh100.toml"]).data
    files, cpu = str(tmp_path / "test_train_*.bin"), torch.device("cpu")
    ok = kernel_check.ring_check(files, 2, 64, data, None, cpu, n=50)  # every batch held as it came
    assert ok["mismatches"] == 0 and ok["state_equal"]
    lengths = []  # and the second half in rows three times as long (train.batch_stage_rows)
    grown = kernel_check.ring_check(files, 2, 64, data, None, cpu, n=50, longer=192,
                                    keep=lambda b: lengths.append(b[0].size(1)) or b)
    assert grown["mismatches"] == 0 and grown["state_equal"] and lengths == [64] * 25 + [192] * 25
    # held in one reused buffer, as a staging buffer refilled before its copy ran would leave them
    shared = [torch.empty(2, 64, dtype=torch.int64) for _ in range(2)]
    overwritten = kernel_check.ring_check(files, 2, 64, data, None, cpu, n=50,
                                          keep=lambda b: tuple(s.copy_(t) for s, t in zip(shared, b)))
    assert overwritten["mismatches"] > 40


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.skipif(bool(BF16_ATTENTION), reason=f"torch's bf16 attention on this CPU: {BF16_ATTENTION}")
def test_flex_tolerance_catches_a_mask_one_token_off():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from model.masks import attention_mask, flex_mask_mod
    gen = torch.Generator().manual_seed(0)
    B, H, T, D, window = 1, 2, 256, 128, 64
    idx = kernel_check.documents(B, T, 50256, 3, gen)
    q, k, v, dy = (torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16) for _ in range(4))
    ref = kernel_check.reference(q, k, v, dy, attention_mask(idx, window, True, 50256))
    sdpa = kernel_check.attention_errors(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(idx, window, True, 50256)),
        q, k, v, dy, ref, grads=True)
    tolerance = kernel_check.tolerance(sdpa["out"])
    for w, within in ((window, True), (window + 1, False)):
        mask = create_block_mask(flex_mask_mod(idx, w, True, 50256), B, None, T, T, device="cpu")
        err = kernel_check.attention_errors(lambda q, k, v: flex_attention(q, k, v, block_mask=mask),
                                            q, k, v, dy, ref, grads=False)
        assert (err["out"] <= tolerance) == within, (w, err, tolerance)


def test_record_folder_is_named_by_date_and_gpu_and_never_taken_by_a_rehearsal():
    env = {"device": "NVIDIA H100 80GB HBM3"}
    path = gpu_check.record_dir("auto", env, cpu=False)
    assert path.parent == ROOT / "records" / "gpu_check"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_NVIDIA-H100-80GB-HBM3", path.name)
    assert gpu_check.record_dir("/tmp/x", env, cpu=True) == Path("/tmp/x")
    with pytest.raises(SystemExit, match="rehearsal"):
        gpu_check.record_dir("auto", env, cpu=True)


@pytest.mark.parametrize("name, sizes, batch", [("speedrun", check_sizes.CPU, (2, 128)),
                                               ("hackathon", check_sizes.GPU, (32, 1024))])
def test_eval_tokens_give_whole_batches_of_the_eval_shape(tmp_path, name, sizes, batch):
    argv = gpu_check.check_args(name, Path("/w"), sizes)[0]
    tokens = gpu_check.eval_tokens(argv, 3)
    assert tokens == 3 * batch[0] * batch[1]
    # what train.py's evals then read: exactly 3 batches, with no target left out
    cfg = parse_train_args([*argv, f"--eval.tokens={tokens}"])
    [val] = make_shards(tmp_path, [tokens + 1], vocab=257, header=cfg.data.format != "raw")
    got = [y for _, y in val_loader(cfg, Dist(), [str(val)])]
    assert len(got) == 3 and all(y.shape == batch and (y != PAD_TARGET).all() for y in got)


@pytest.mark.parametrize("sizes", [check_sizes.CPU, check_sizes.GPU])
def test_each_checks_val_data_holds_its_eval(sizes):
    # eval_tokens targets need one token more (the first is an input only); the hackathon's holdout needs its
    # chunk to keep one token for training
    held = {"speedrun": sizes.val_tokens, "hackathon": sizes.train_tokens,
            "text": int(sizes.demo_args[sizes.demo_args.index("--val-tokens") + 1])}
    for name, tokens in held.items():
        assert gpu_check.eval_tokens(gpu_check.check_args(name, Path("/w"), sizes)[0], sizes.eval_batches) < tokens


def test_the_demo_corpus_is_renumbered_to_the_speedruns_vocabulary(tmp_path):
    prepared = demo_data(tmp_path / "bytes", tokens=60_000, val_tokens=20_000, shard_tokens=20_000)
    work = tmp_path / "w"
    (work / "data" / "demo").mkdir(parents=True)
    (work / "data" / "demo" / "demo_train_000009.bin").write_bytes(b"stale")  # an earlier build's: must not stay
    for _ in range(2):  # a rerun in the same --work folder rebuilds it the same
        gpu_check.at_gpt2_ids(prepared, work / "data" / "demo")
    src, meta = read_meta(prepared), read_meta(work / "data" / "demo")
    assert sorted(p.name for p in (work / "data" / "demo").glob("*.bin")) == sorted(s["file"] for s in src["shards"])
    before, after = (np.concatenate([open_shard(folder / shard["file"]) for shard in src["shards"]])
                     for folder in (prepared, work / "data" / "demo"))
    assert (after == np.where(before == 256, 50256, before)).all() and (after == 50256).sum() > 1
    assert meta["vocab_size"] == 50257 and meta["eot_token"] == 50256 and "tokenizer" not in meta
    assert "settings" not in meta and meta["bytes_per_token"] == src["bytes_per_token"]
    # train.py takes it at the speedrun's vocabulary (GPT-2's padded, which meta.json vouches for) and document
    # token, as the text check runs it
    argv = gpu_check.check_args("text", work, check_sizes.CPU)[0]
    cfg = parse_train_args(argv)
    files, val_files, got = resolve_data(cfg)
    assert cfg.model.vocab_size == 50304 and cfg.model.bos_id == 50256 and got == meta and len(val_files) == 1


def test_random_documents_look_like_fineweb_shards():
    tokens = gpu_check.random_documents(2_000_000, 50256, np.random.default_rng(0))
    starts = np.flatnonzero(tokens == 50256)
    assert starts[0] == 0 and tokens.max() <= 50256 and tokens.min() >= 0
    assert len(tokens) / len(starts) == pytest.approx(gpu_check.MEAN_DOC_TOKENS, rel=0.1)


def test_a_check_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    t0 = time.time()
    rc, _ = gpu_check.run_bounded(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "out.log", 3,
                                  check_sizes.CPU, tmp_path)  # 3 s: time for bash to start and write the pid
    assert rc == "timeout" and time.time() - t0 < 12
    assert gone(int(pid_file.read_text()))


def test_a_check_in_flight_is_killed_when_the_script_is_stopped(tmp_path):
    # gpu_check.sh's outer timeout SIGTERMs the script, whose handler exits: the check's group must go too
    pid_file = tmp_path / "child.pid"
    previous = signal.signal(signal.SIGALRM, lambda *_: sys.exit("stopped"))
    signal.alarm(4)  # time for bash to start and write the pid
    try:
        with pytest.raises(SystemExit):
            gpu_check.run_bounded(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], tmp_path / "out.log", 50,
                                  check_sizes.CPU, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert gone(int(pid_file.read_text()))


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """True once `pid` no longer runs (absent, or a zombie waiting for init to reap it)."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_to_use_cpu_mode():
    proc = run(["bash", "scripts/gpu_check.sh"], env={"PYTHON": sys.executable}, check=False, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr and "--cpu" in proc.stderr
