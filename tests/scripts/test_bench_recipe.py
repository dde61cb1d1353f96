"""The recipe configs say what their tracks need, and scripts/bench/recipe.py compares two real train.py runs."""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from model import get_model
from scripts.bench import recipe as bench_recipe
from tests.helpers import ROOT, run
from trainer.config import parse_args

GPT2 = ["speedrun_8xh100", "speedrun_1gpu", "baseline_8xh100"]
# The starter's submit.sh flags, exactly as the organizers pass them.
STARTER = ["--data_dir", "/home/data/", "--checkpoint_path", "checkpoint.pt", "--seq_len", "1024", "--batch_size", "8",
           "--grad_accum_steps", "4", "--max_steps", "5000", "--time_limit_min", "10"]
# eager: the benches' mechanics, without a compile in each run
TINY = ["model.n_embd=64", "model.n_layer=4", "model.value_embeds=0", "model.bigram_hash=0", "model.bigram_dim=0",
        "model.block_size=64", "train.seq_len=64", "train.batch_size=4", "eval.tokens=4096", "train.compile=false"]


def load(name: str, *extra: str):
    return parse_args(["--config", f"configs/{name}.toml", *extra])


def num_params(cfg) -> int:
    with torch.device("meta"):  # the 8-GPU models without allocating their weights
        return get_model(cfg.to_dict()).num_params()


def tokens_per_step(cfg, world: int) -> int:
    train = cfg.train
    return train.batch_size * train.seq_len * train.grad_accum * world


def test_speedrun_recipe_matches_the_record_runs():
    cfg = load("speedrun_8xh100")
    m, t, e = cfg.model, cfg.train, cfg.eval
    assert (m.vocab_size, m.n_layer, m.n_embd, m.padded_vocab) == (50304, 11, 768, 50304)
    assert m.rotary and m.qk_norm and m.norm == "rmsnorm" and m.activation == "relu2" and not m.tie_embeddings
    assert m.zero_init_proj and m.logit_softcap > 0 and m.value_embeds and m.backout
    assert m.attention == "flex" and m.doc_causal and 0 < m.window < t.seq_len and cfg.data.bos_aligned
    assert cfg.optim.name == "muon" and t.compile and t.dtype == "bfloat16"
    # its schedule in steps: 2,120, then 40 at the end's rate, batch and window; the budget a cap
    assert (t.schedule, t.max_steps, t.extension_steps, t.steps) == ("step", 2120, 40, 2160) and t.budget_s > 0
    assert t.timing == "exclude_warmup" and t.warmup_steps > 0 and t.seq_len <= m.block_size
    # record 46's batch schedule: 131,072 tokens a step, then twice and three times that
    assert tokens_per_step(cfg, 8) == 131_072 and t.batch_stages == [1, 2, 3]
    # timed as the records are: the whole schedule, where its final eval reaches the target; their evals' cadence
    assert (e.target_loss, e.tokens, e.target_time, e.stop_at_target) == (3.28, 10_485_760, "end", False)
    assert (e.every_steps, e.every_s) == (250, 0)
    assert cfg.data.train.endswith("fineweb_train_*.bin") and cfg.data.val.endswith("fineweb_val_*.bin")


def test_one_gpu_speedrun_is_the_eight_gpu_run_with_eight_times_the_accumulation():
    eight, one = load("speedrun_8xh100"), load("speedrun_1gpu")
    assert tokens_per_step(one, 1) == tokens_per_step(eight, 8)
    assert one.train.budget_s == 8 * eight.train.budget_s
    for section in ("data", "model", "optim", "eval"):
        assert getattr(one, section) == getattr(eight, section)


def test_gpt2_baseline_is_plain_gpt2_small_with_adamw():
    cfg, speedrun = load("baseline_8xh100"), load("speedrun_8xh100")
    gpt2 = cfg.model
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.bias, gpt2.tie_embeddings, gpt2.rotary) == (
        12, 12, 768, True, True, False)
    assert gpt2.norm == "layernorm" and gpt2.activation == "gelu" and cfg.optim.name == "adamw"
    assert 120e6 < num_params(cfg) < 130e6  # GPT-2 small: 124M
    assert tokens_per_step(cfg, 8) == 524_288  # llm.c's batch
    assert (cfg.eval.target_loss, cfg.eval.tokens, cfg.data.val) == (3.28, 10_485_760, speedrun.data.val)


def test_hackathon_recipe_and_the_organizers_flags():
    for cfg in (load("hackathon_32gpu"), parse_args(STARTER)):
        t, m = cfg.train, cfg.model
        assert (t.budget_s, t.timing, t.schedule) == (600, "from_first_forward", "time")
        assert (cfg.data.format, cfg.data.val, m.vocab_size, m.padded_vocab) == ("raw", "holdout", 32000, 32000)
        assert t.checkpoint_path == "checkpoint.pt" and t.compile and t.checkpoint_every_s == 0
        assert cfg.eval.every_s == 0 and cfg.eval.every_steps == 0
        assert (m.n_layer, m.n_embd, m.rotary, cfg.optim.name) == (12, 768, True, "muon")
        assert tokens_per_step(cfg, 32) == 2 ** 20 and t.seq_len == 1024  # the evaluation's sequence length
        assert not m.doc_causal and not cfg.data.bos_aligned  # the corpus' separator token is unknown
    starter = parse_args(STARTER)
    assert starter.data.train == "/home/data/chunk_*.bin" and starter.train.max_steps == 0  # the clock ends it


def test_cpu_recipes_compare_like_with_like():
    """At the shape cpu.toml keeps for budgets beyond its [[plan]] rows (what the recipe bench trains), the two
    recipes' parameters are alike; both are scored on the same val tokens."""
    modern, base = load("cpu", "--train.plan=false"), load("baseline_cpu")
    for cfg in (modern, base):
        cfg.model.vocab_size = 257  # what shards/demo/meta.json gives
    assert abs(num_params(modern) / num_params(base) - 1) < bench_recipe.PARAM_TOLERANCE
    assert (modern.data, modern.eval.tokens) == (base.data, base.eval.tokens)
    assert modern.train.budget_s == 180 and modern.train.timing == "exclude_warmup"
    assert modern.optim.name == "muon" and base.optim.name == "adamw" and modern.model.attention == "sdpa"


def test_cpu_baseline_is_nanogpts_cpu_recipe():
    """karpathy/nanoGPT's README CPU command on config/train_shakespeare_char.py, with train.py's defaults."""
    cfg = load("baseline_cpu")
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.bias) == (4, 4, 128, 64, False)
    assert (m.norm, m.activation, m.rotary, m.tie_embeddings) == ("layernorm", "gelu", False, True)
    assert (o.name, o.lr, o.betas, o.weight_decay, o.grad_clip) == ("adamw", 1e-3, [0.9, 0.99], 0.1, 1.0)
    assert (tokens_per_step(cfg, 1), t.seq_len, t.schedule, t.max_steps, t.budget_s) == (12 * 64, 64, "step", 2000, 0)
    assert t.lr_warmup_frac * t.max_steps == 100 and t.lr_warmup_frac + t.lr_decay_frac == 1 and t.lr_final_frac == 0.1


def test_ab_trains_cpu_toml_without_and_with_the_piece():
    args = bench_recipe.parse_args(["--ab", "model.attn_scale=0.12", "--override", "eval.tokens=8192"])
    base, piece = (bench_recipe.train_args(args, r, r, args.budget, args.eval_every) for r in ("baseline", "modern"))
    assert base[:2] == piece[:2] == ["--config", "configs/cpu.toml"]
    assert piece == base[:-2] + ["--log.run_id=modern", "--eval.tokens=8192", "--model.attn_scale=0.12"]
    assert args.recipes["modern"] == "configs/cpu.toml + model.attn_scale=0.12"


def test_the_baseline_trains_its_steps_and_the_modern_recipe_its_budget_as_run_sh_runs_it():
    args = bench_recipe.parse_args(["--budget", "80"])
    base, modern = (bench_recipe.train_args(args, r, r, args.budget, args.eval_every) for r in ("baseline", "modern"))
    assert not any(a.startswith(("--train.budget_s", "--train.max_steps")) for a in base)  # its config's 2,000
    assert "--train.budget_s=80.0" in modern
    assert "--train.max_steps=300" in bench_recipe.train_args(bench_recipe.parse_args(["--baseline-steps", "300"]),
                                                               "baseline", "b", 80.0, 8.0)
    # the recipes at their own shapes, parameters alike: no [[plan]] row for the budget (scripts/bench/budgets.py's)
    assert "--train.plan=false" in modern and "--train.plan=false" in base
    (base_cmd, base_env), (modern_cmd, modern_env) = (bench_recipe.command(args, r, []) for r in ("baseline", "modern"))
    assert base_cmd[1:] == ["train.py"] and base_env == {}
    assert modern_cmd[1:3] == ["-m", "torch.distributed.run"] and f"--nproc_per_node={os.cpu_count()}" in modern_cmd
    assert modern_env == {"OMP_NUM_THREADS": "1"}


SMALL_DEMO = ["--max-tokens", "200000", "--val-tokens", "20000", "--shard-tokens", "100000", "--workers", "1"]


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory) -> Path:
    """A small demo corpus, made by the bench's own preparation step (later flags win over PREPARE's)."""
    out = tmp_path_factory.mktemp("data") / "demo"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_recipe, "PREPARE", [*bench_recipe.PREPARE, *SMALL_DEMO])
        bench_recipe.ensure_data(out)
    return out


def test_ensure_data_prepares_the_demo_corpus_when_absent(small_demo):
    meta = json.loads((small_demo / "meta.json").read_text())
    assert meta["complete"] and meta["tokenizer"] == "bytes" and meta["tokens"] == 200_000
    assert list(small_demo.glob("demo_train_*.bin")) and list(small_demo.glob("demo_val_*.bin"))
    before = (small_demo / "meta.json").stat().st_mtime_ns
    bench_recipe.ensure_data(small_demo)  # present: left alone (the default PREPARE would refuse this folder)
    assert (small_demo / "meta.json").stat().st_mtime_ns == before


def test_a_failed_preparation_stops_the_bench_with_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_recipe, "PREPARE", [*bench_recipe.PREPARE, "--max-tokens", "5000", "--workers", "1"])
    with pytest.raises(SystemExit, match="data.prepare .* failed"):
        bench_recipe.ensure_data(tmp_path / "demo")  # 5,000 tokens cannot fill a 1M-token val split


def test_unequal_models_are_refused(small_demo, tmp_path):
    args = bench_recipe.parse_args(["--data", str(small_demo), "--runs", str(tmp_path)])
    argvs = {r: bench_recipe.train_args(args, r, r, args.budget, args.eval_every) for r in bench_recipe.RECIPES}
    argvs["modern"].append("--model.n_layer=8")
    with pytest.raises(SystemExit, match="parameter counts .* differ by more than 15%"):
        bench_recipe.check_comparable(argvs)


def test_time_to_reach_reads_the_first_eval_at_or_below(tmp_path):
    lines = [{"type": "train", "step": 1, "loss": 1.0, "elapsed_s": 1.0},
             {"type": "eval", "step": 2, "val_loss": 3.0, "elapsed_s": 5.0},
             {"type": "eval", "step": 4, "val_loss": 2.5, "elapsed_s": 10.0},
             {"type": "eval", "step": 6, "val_loss": 2.4, "elapsed_s": 15.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert bench_recipe.time_to_reach(tmp_path, 2.5) == 10.0
    assert bench_recipe.time_to_reach(tmp_path, 3.5) == 5.0
    assert bench_recipe.time_to_reach(tmp_path, 2.0) is None


@pytest.mark.slow
def test_bench_trains_both_recipes_for_real(small_demo, tmp_path):
    out = tmp_path / "bench.json"
    proc = run([sys.executable, "-m", "scripts.bench.recipe", "--budget", "8", "--eval-every", "2",
                "--baseline-steps", "30", "--data", str(small_demo), "--runs", str(tmp_path / "runs"),
                "--json", str(out), *(f"--override={o}" for o in TINY)], timeout=300, cwd=ROOT)
    res = json.loads(out.read_text())
    base, modern = res["recipes"]["baseline"], res["recipes"]["modern"]
    assert abs(modern["params"] / base["params"] - 1) < 0.10
    summaries = {}
    for r in (base, modern):
        summaries[r["run_id"]] = summary = json.loads((tmp_path / "runs" / r["run_id"] / "summary.json").read_text())
        assert summary["final_val_loss"] == r["final_val_loss"] and math.isfinite(r["final_val_loss"])
        assert r["final_val_loss"] < math.log(257)  # both learned something
    # the baseline its steps in one process; the modern recipe its budget as run.sh runs it, a process per core
    assert (summaries[base["run_id"]]["steps"], base["world_size"]) == (30, 1)
    # the stop follows the ranks' latest clock; the summary's time is rank 0's, behind it by as much as the machine
    # delayed rank 0's start (on a loaded CI machine, ~0.1 s)
    assert summaries[modern["run_id"]]["train_time_s"] >= 8 - 0.5 and modern["world_size"] == os.cpu_count()
    assert res["baseline_time_s"] == base["train_time_s"]
    assert res["modern_below_baseline"] == (modern["final_val_loss"] < base["final_val_loss"])
    reached = bench_recipe.time_to_reach(tmp_path / "runs" / modern["run_id"], base["final_val_loss"])
    assert res["modern_time_to_baseline_final_s"] == reached
    if reached is not None:
        assert res["ratio_to_baseline_time"] == pytest.approx(reached / base["train_time_s"])
    assert "| baseline |" in proc.stdout and "| modern |" in proc.stdout and "the baseline's" in proc.stdout
    figure = out.with_suffix(".png")  # beside the JSON: both recipes, against time and against tokens
    assert res["figure"] == str(figure) and f"curves: {figure}" in proc.stdout
    assert imread(figure).shape[:2] == (600, 2000)
