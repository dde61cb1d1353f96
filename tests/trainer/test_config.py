"""trainer/config.py and trainer/starter.py: TOML files, overrides, the starter's flags, errors, the TOML writer."""
import dataclasses
import re
import sys
import tomllib
import typing

import pytest

from tests.helpers import ROOT, TRAIN, run
from trainer import starter
from trainer.config import (RESUME_BUDGET, RESUME_SAFE, SECTIONS, ConfigError, Group, keys_in, parse_args,
                            to_toml)

TINY = str(ROOT / "configs" / "tiny.toml")

# configs/speedrun_1gpu.toml resolved as it was when it was a full copy of speedrun_8xh100.toml (before `base`), on
# record 46's step schedule since
SPEEDRUN_1GPU = {
    "data": {"train": "shards/fineweb10B/fineweb_train_*.bin", "val": "shards/fineweb10B/fineweb_val_*.bin",
             "format": "header", "raw_dtype": "uint16", "bos_aligned": True, "shuffle": False, "shuffle_shards": 0,
             "sorted_shards": True, "doc_cut": 2048, "seed": 0, "vocab_check": True},
    "model": {"vocab_size": 50304, "block_size": 49152, "n_layer": 11, "n_head": 6, "n_embd": 768, "mlp_ratio": 4,
              "bias": False, "norm": "rmsnorm", "activation": "relu2", "rotary": True, "rope_base": 1024.0,
              "rope_truncate": True, "qk_norm": True, "attn_scale": 0.1, "attn_gate": True, "norm_gain": False,
              "embed_norm": True, "smear": True, "x0_mix": True, "x0_mix_init": 1.1, "tie_embeddings": False,
              "untie_at": 0.0, "zero_init_proj": True, "logit_softcap": 15.0, "fp8_head": False, "mtp_weights": [],
              "prefix_weight": 0.0, "value_embeds": 3, "value_embed_skip": 1, "value_scale": True, "bigram_hash": 0,
              "bigram_dim": 0, "bigram_signs": False, "ve_gate": False, "unet_skips": False, "skip_gate": False,
              "skip_connection": [3, 6], "backout": 8, "no_attention": [6], "no_mlp": [], "xsa": [], "mudd": [],
              "mudd_sources": [], "attention": "flex", "window": 1664, "window_start": 0,
              "window_stages": [384, 896, 1408], "window_block": 128, "window_pattern": "SSSLSSSSSSL",
              "window_past": True, "yarn": True,
              "doc_causal": True, "bos_id": 50256, "init_std": 0.018042, "embed_init_std": 1.0,
              "init": "uniform"},
    "optim": {"name": "muon", "lr": 0.0006, "weight_decay": 0.1, "betas": [0.65, 0.95], "eps": 6.103515625e-13,
              "eps_before_correction": True, "grad_clip": 0.0, "embed_lr": 0.6, "head_lr": 0.008, "scalar_lr": 0.04,
              "muon_lr": 0.023, "muon_momentum": 0.95, "muon_momentum_warmup_steps": 300, "muon_momentum_start": 0.85,
              "muon_momentum_cooldown_steps": 50, "muon_weight_decay": 0.0276, "ns_steps": 5, "adjust_lr": "none",
              "ns_coefficients": "polar_express", "ns_eps": 6.103515625e-11, "muon_cautious_wd": True,
              "muon_wd_lr_squared": True, "muon_fc_lr_scale": 2.0, "normuon": True, "normuon_beta2": 0.95,
              "normuon_attn_columns": True,
              "muon_gates": True, "muon_qk_pairs": False, "muon_compile": False, "muon_symmetric": False,
              "adam_every": 2, "bf16_storage": False},
    "train": {"batch_size": 1, "seq_len": 16384, "grad_accum": 8, "batch_stages": [1, 2, 3], "batch_stage_rows": True,
              "batch_stage_lr": [1.0, 1.51, 1.93], "batch_stage_lr_at": [0.33, 0.66], "stage_loss_scale": True,
              "parallel": "ddp", "reduce_dtype": "float32", "adam_sync": "every_step", "ddp_always": False,
              "compile": True, "dtype": "bfloat16", "bf16_stream": False, "budget_s": 1600.0, "plan": True,
              "timing": "exclude_warmup", "warmup_steps": 5, "max_steps": 2120, "schedule": "step",
              "extension_steps": 40, "lr_warmup_frac": 0.0, "lr_decay_frac": 0.55, "lr_final_frac": 0.1,
              "lr_final_of": "base", "seed": 0, "checkpoint_path": "",
              "checkpoint_every_s": 0.0, "save_checkpoint": True, "resume": "auto", "dist_timeout_s": 600.0,
              "warmup_timeout_s": 1800.0},
    "eval": {"every_steps": 250, "every_s": 0.0, "at_start": True, "tokens": 10485760, "seq_len": 262144,
             "batch_size": 1, "target_loss": 3.28, "stop_at_target": False, "target_time": "end", "final_window": 2560},
    "log": {"dir": "runs", "run_id": "", "track": "speedrun", "every_steps": 25, "wandb": False,
            "wandb_project": "shardrun", "wandb_run": ""},
}


def test_file_and_overrides_in_both_spellings():
    cfg = parse_args(["--config", TINY, "--data.train=x/*.bin", "--optim.lr=0.01", "--model.n_layer", "4",
                      "--train.budget_s=5", "--log.run_id=123", "--optim.betas=[0.8, 0.9]"])
    assert cfg.name == "tiny"
    assert cfg.model.n_embd == 64 and cfg.model.n_layer == 4  # file value, then override
    assert cfg.optim.lr == 0.01 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.train.budget_s == 5.0 and isinstance(cfg.train.budget_s, float)  # int accepted for a float
    assert cfg.log.run_id == "123"  # a str field keeps the text even when it parses as a number


@pytest.mark.parametrize("args, needles", [
    (["--train.nope=1"], ["unknown key train.nope", "batch_size", "budget_s"]),
    (["--nosection.x=1"], ["unknown section [nosection]", "data, model, optim, train, eval, log"]),
    (["--train.batch_size=big"], ["train.batch_size must be int", "'big'"]),
    (["--train.compile=1"], ["train.compile must be bool"]),
    (["--train.parallel=zero3"], ["train.parallel", "ddp, fsdp"]),
    (["--model.init=gaussian"], ["model.init = 'gaussian' is not one of normal, uniform"]),
    (["--model.n_head=3"], ["n_embd=64 must be a multiple of n_head=3"]),
    (["--train.max_steps=0"], ["train.schedule = 'step' needs train.max_steps > 0"]),
    (["--train.budget_s=-5"], ["train.budget_s = -5.0 is negative", "seconds > 0"]),
    (["--train.schedule=time", "--train.budget_s=0"], ["train.schedule = 'time' needs train.budget_s > 0"]),
    (["--train.seq_len"], ["--train.seq_len has no value"]),
    (["--train.budget_s", "--log.run_id=x"], ["--train.budget_s has no value; write --train.budget_s=VALUE"]),
    (["--train.schedule=time", "--train.budget_s=nan"], ["train.budget_s = nan must hold finite numbers only"]),
    (["--train.batch_stage_lr=[nan, 1.0]"], ["train.batch_stage_lr = [nan, 1.0] must hold finite numbers only"]),
    (["--optim.betas=[0.9, 1.0]"], ["optim config: betas=[0.9, 1.0] must be a list of two floats in [0, 1)"]),
    (["--optim.lr=0"], ["optim config: lr=0.0 must be > 0"]),
    (["--optim.muon_weight_decay=-1"], ["optim config: muon_weight_decay=-1.0 must be >= 0 (0 = no decay)"]),
    (["--optim.eps=-1"], ["optim config: eps=-1.0 must be > 0"]),
    (["--data.seed=-1"], ["data.seed must be >= 0, got -1"]),
    (["--train.lr_final_frac=-1"], ["train.lr_final_frac = -1.0 must lie in [0, 1]"]),
    (["--train.lr_warmup_frac=-0.5", "--train.lr_decay_frac=1.5"], ["train.lr_warmup_frac = -0.5 must lie in"]),
    (["--train.seq_len=128"], ["train.seq_len = 128 is longer than model.block_size = 64"]),
    (["--model.n_head=0"], ["n_head, n_embd and mlp_ratio must be positive"]),
    (["--model.mlp_ratio=0"], ["n_head, n_embd and mlp_ratio must be positive"]),
    (["stray"], ["unexpected argument 'stray'"]),
    (["--eval.target_time=end", "--eval.stop_at_target=true"],
     ["eval.target_time = 'end' times the whole run, scored by its final eval, and eval.stop_at_target = true"]),
    (["--eval.final_window=64", "--model.window=0"], [("eval.final_window = 64 widens the final eval's windowed "
                                                       "layers, and model.window = 0 attends everywhere")]),
    (["--eval.final_window=-1"], ["eval.final_window must be >= 0 (0 = off), got -1"]),
    (["--data.doc_cut=-1", "--data.shuffle=false"], ["data.doc_cut must be >= 0 (0 = off), got -1"]),
    (["--data.doc_cut=32"], ["data.doc_cut = 32 cuts documents inside rows read in order from a BOS",
                             "data.bos_aligned = true and data.shuffle = false"]),
    (["--data.doc_cut=32", "--data.shuffle=false", "--data.bos_aligned=false"], ["data.doc_cut = 32 cuts"]),
    (["--train.reduce_dtype=float16"], ["train.reduce_dtype = 'float16' is not one of float32, bfloat16"]),
    (["--train.reduce_dtype=bfloat16", "--train.parallel=fsdp"],  # tiny.toml's grad_accum = 2
     [("train.reduce_dtype = 'bfloat16' under train.parallel = 'fsdp' would add up the 2 micro-steps of a step in "
       "bf16"), "use train.parallel = 'ddp'", "train.grad_accum = 1 without train.batch_stages"]),
    (["--train.reduce_dtype=bfloat16", "--train.parallel=fsdp", "--train.grad_accum=1", "--train.batch_stages=[1, 3]"],
     ["would add up the 3 micro-steps of a step in bf16"]),
    (["--model.fp8_head=true", "--model.tie_embeddings=false", "--train.batch_size=3", "--train.seq_len=30"],
     ["model.fp8_head = true", "train.batch_size x train.seq_len = 90", "multiple of 16"]),
    (["--optim.name=muon", "--optim.adjust_lr=bogus"],
     ["command line: optim.adjust_lr = 'bogus' is not one of original, match_rms_adamw, none"]),
    (["--optim.name=muon", "--optim.ns_coefficients=polar_express", "--optim.ns_steps=3"],
     ["optim config: ns_coefficients='polar_express' needs ns_steps >= 5, got 3"]),
    (["--optim.name=muon", "--optim.ns_steps=0"], ["optim config: ns_steps=0 must be >= 1"]),
    (["--optim.muon_momentum=1.5"], ["optim config: muon_momentum=1.5 must be in [0, 1), e.g. 0.95"]),
    (["--optim.name=muon", "--optim.muon_qk_pairs=true", "--model.n_head=1"],
     ["optim.muon_qk_pairs pairs adjacent heads, so it needs an even model.n_head, got 1; use an even n_head or "
      "optim.muon_qk_pairs = false"]),
    (["--model.rotary=true", "--model.rope_base=0"], ["model config: rope_base=0.0 must be > 0"]),
    (["--model.init_std=-1"], ["model config: init_std=-1.0 must be >= 0"]),
    (["--log.every_steps=-3"], ["log.every_steps must be >= 0 (0 = off), got -3"]),
    (['--optim.betas=["a", "b"]'], ["optim config: betas=['a', 'b'] must be a list of two floats in [0, 1)"]),
    (["--optim.betas=[[1], [2]]"], ["optim config: betas=[[1], [2]] must be a list of two floats"]),
    (["--train.batch_stages=[1, 2]", "--train.batch_stage_lr=[1, 2]", '--train.batch_stage_lr_at=["a"]'],
     ["train.batch_stage_lr_at = ['a'] must give, for train.batch_stage_lr = [1, 2], the progress"]),
    (["--train.ddp_always=true", "--train.parallel=fsdp"],
     ["train.ddp_always = true wraps even one process in DDP, and train.parallel = 'fsdp' shards with FSDP2",
      "set train.parallel = 'ddp' or train.ddp_always = false"]),
    (["--train.warmup_steps=2"], ["train.warmup_steps = 2 runs untimed steps before the clock starts, which only "
                                  "train.timing = 'exclude_warmup' does, and train.timing = 'from_first_forward'",
                                  "set train.timing = 'exclude_warmup' or train.warmup_steps = 0"]),
    (["--train.bf16_stream=true", "--train.dtype=float32"], [
        "train.bf16_stream = true keeps the residual stream and the logits in bf16 under bf16 autocast, and "
        "train.dtype = 'float32' runs none", "set train.dtype = 'bfloat16' or train.bf16_stream = false"]),
])
def test_bad_overrides_name_the_key(args, needles):
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", TINY, "--data.train=x", *args])
    for needle in needles:
        assert needle in str(e.value)


def test_bad_files_name_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.toml: config file not found; available: .*tiny\.toml"):
        parse_args(["--config", str(tmp_path / "missing.toml")])
    (tmp_path / "folder.toml").mkdir()
    (tmp_path / "utf16.toml").write_bytes("[train]\n".encode("utf-16"))
    for name, what in (("folder.toml", "a folder"), ("utf16.toml", "not UTF-8 text")):
        with pytest.raises(ConfigError, match=rf"{name}: not a config file \({what}.*\); name a .toml file"):
            parse_args(["--config", str(tmp_path / name)])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbatch_sise = 4\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key train\.batch_sise; valid keys in \[train\]: "
                                          r"batch_size"):
        parse_args(["--config", str(bad)])
    bad.write_text("[eval]\ntokens = '4k'\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: eval\.tokens must be int, got '4k'"):
        parse_args(["--config", str(bad)])
    bad.write_text("lr = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: top-level key 'lr' must be a \[section\]"):
        parse_args(["--config", str(bad)])
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        parse_args(["--config", str(bad)])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path):
    cfg = parse_args(["--config", str(path), "--data.train=x"])
    resolved = cfg.to_dict()
    assert tomllib.loads(to_toml(resolved)) == resolved


def test_a_config_applies_its_base_first_then_its_own_keys(tmp_path):
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases" / "a.toml").write_text("[model]\nn_layer = 3\nn_head = 2\n[train]\nbatch_size = 5\n"
                                               "seq_len = 16\nbudget_s = 1\n")
    (tmp_path / "bases" / "b.toml").write_text('base = "a.toml"\n[model]\nn_head = 4\n')  # beside it
    (tmp_path / "c.toml").write_text('base = "bases/b.toml"\n[train]\nbatch_size = 7\n')  # a chain: c, b, a
    cfg = parse_args(["--config", str(tmp_path / "c.toml"), "--data.train=x", "--train.batch_size=9"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.train.seq_len, cfg.train.batch_size) == (3, 4, 16, 9)
    assert cfg.name == "c" and "base" not in tomllib.loads(to_toml(cfg.to_dict()))  # config.toml: resolved
    # a key a base sets is the file's: the starter's generic shape gives way to it
    cfg = parse_args(["--config", str(tmp_path / "c.toml"), "--data.train=x", "--seq_len", "32"])
    assert cfg.train.seq_len == 16 and "overridden by" in cfg.starter


def test_a_bad_base_is_refused_naming_the_files(tmp_path):
    def refused(text: str, base_text: str = "") -> str:
        (tmp_path / "base.toml").write_text(base_text)
        (tmp_path / "top.toml").write_text(text)
        with pytest.raises(ConfigError) as e:
            parse_args(["--config", str(tmp_path / "top.toml"), "--data.train=x"])
        return str(e.value)

    top, base = tmp_path / "top.toml", tmp_path / "base.toml"
    assert refused('base = "nope.toml"').startswith(f"{top}: base {tmp_path / 'nope.toml'} not found")
    assert "config files there: base.toml, top.toml" in refused('base = "nope.toml"')
    assert refused('base = "base.toml"', "[train]\nbatch_sise = 4\n").startswith(
        f"{base}: unknown key train.batch_sise; valid keys in [train]: batch_size")
    assert refused('base = "base.toml"', 'base = "top.toml"\n') == (
        f"{base}: base = 'top.toml' closes a cycle ({top} -> {base} -> {top}); remove one of these bases")
    assert refused('base = "top.toml"').startswith(f"{top}: base = 'top.toml' closes a cycle ({top} -> {top})")
    assert refused("base = 3").startswith(f"{top}: base = 3 must be a file name, e.g. base = \"speedrun_8xh100.toml\"")


def test_the_one_gpu_speedrun_is_its_base_with_two_values_changed():
    assert tomllib.loads((ROOT / "configs" / "speedrun_1gpu.toml").read_text())["base"] == "speedrun_8xh100.toml"
    assert parse_args(["--config", "configs/speedrun_1gpu.toml"]).to_dict() == SPEEDRUN_1GPU


def test_toml_writer_quotes_and_numbers():
    table = {"s": {"a": 'q"uo\\te\nnew', "b": 1e-5, "c": -3, "d": True, "e": [1, 2.5, "x"], "f": "é",
                   "g": float("inf")}}
    assert tomllib.loads(to_toml(table)) == table
    with pytest.raises(TypeError):  # TOML has no null
        to_toml({"s": {"k": None}})


def test_starter_flags_map_onto_the_config(tmp_path):
    argv = ["--data_dir", str(tmp_path), "--checkpoint_path", "ck.pt", "--seq_len", "32", "--batch_size", "3",
            "--grad_accum_steps", "5", "--max_steps", "5000", "--time_limit_min", "0.5"]
    cfg = parse_args(["--config", TINY, *argv])
    assert cfg.data.train == str(tmp_path / "chunk_*.bin")
    assert (cfg.data.format, cfg.data.val) == ("raw", "holdout")
    assert cfg.train.checkpoint_path == "ck.pt" and cfg.train.budget_s == 30.0
    # the time limit is what binds: the LR decays on the clock, whatever tiny.toml's step schedule says
    assert cfg.train.schedule == "time"
    # tiny.toml sets batch_size, seq_len, grad_accum and max_steps: the tuned file wins over the generic starter's
    assert (cfg.train.batch_size, cfg.train.seq_len, cfg.train.grad_accum, cfg.train.max_steps) == (4, 64, 2, 30)
    # ... but the starter's recipe fills keys the file leaves unset
    other = tmp_path / "other.toml"
    other.write_text('[eval]\ntokens = 4096\n')
    cfg = parse_args(["--config", str(other), *argv])
    assert (cfg.train.batch_size, cfg.train.seq_len, cfg.train.grad_accum, cfg.train.max_steps) == (3, 32, 5, 5000)
    # and explicit --section.key overrides beat the starter's flags
    cfg = parse_args(["--config", str(other), *argv, "--train.budget_s=7"])
    assert cfg.train.budget_s == 7.0


def test_starter_flags_pick_the_hackathon_config_when_it_exists(tmp_path, monkeypatch):
    hack = tmp_path / "hackathon_32gpu.toml"
    monkeypatch.setattr(starter, "HACKATHON_CONFIG", hack)
    cfg = parse_args(["--data_dir", str(tmp_path), "--time_limit_min", "10"])
    assert cfg.name == "default" and cfg.train.budget_s == 600.0
    hack.write_text("[model]\nn_layer = 3\n")
    cfg = parse_args(["--data_dir", str(tmp_path), "--time_limit_min", "10"])
    assert cfg.name == "hackathon_32gpu" and cfg.model.n_layer == 3


def test_resume_and_overwrite_flags_set_train_resume_and_exclude_each_other():
    base = ["--config", "configs/tiny.toml", "--data.train=x"]
    assert parse_args([*base, "--resume"]).train.resume == "must"
    assert parse_args([*base, "--overwrite"]).train.resume == "overwrite"
    with pytest.raises(ConfigError, match="--resume continues the run in log.run_id, --overwrite replaces it"):
        parse_args([*base, "--resume", "--overwrite"])


def test_help_explains_the_overrides_with_every_key_before_torch_is_imported():
    probe = ("import runpy, sys\n"
             f"sys.argv = [{TRAIN!r}, '--help']\n"
             "try:\n"
             f"    runpy.run_path({TRAIN!r}, run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print('exit', e.code, 'torch imported:', 'torch' in sys.modules)\n")
    proc = run([sys.executable, "-c", probe])
    assert proc.stdout.endswith("exit 0 torch imported: False\n") and proc.stderr == "", proc.stderr
    assert "overrides: --section.key=value (or --section.key value), applied after the config file" in proc.stdout
    for section, cls in SECTIONS.items():
        keys = re.findall(r"^  (\w+) = ", proc.stdout.split(f"\n[{section}]\n", 1)[1].split("\n\n", 1)[0], re.M)
        assert keys == [f.name for f in dataclasses.fields(cls)], section
    # the default and the comment of the dataclass field; a key without a comment lists its values
    assert re.search(r"^  budget_s = 0\.0 +training-time budget; 0 = none$", proc.stdout, re.M)
    assert re.search(r'^  timing = "from_first_forward" +one of "from_first_forward", "exclude_warmup"$',
                     proc.stdout, re.M)


def test_the_key_groups_are_the_fields_metadata_and_nest():
    by_group = {group: keys_in(group) for group in typing.get_args(Group)}
    declared = {f"{section}.{f.name}": f.metadata["group"] for section, cls in SECTIONS.items()
                for f in dataclasses.fields(cls) if "group" in f.metadata}
    assert {key for keys in by_group.values() for key in keys} == declared.keys()
    assert RESUME_SAFE == declared.keys() - by_group["budget"]
    assert RESUME_BUDGET == {"train.budget_s", "train.max_steps"}
    assert by_group["speed"] == {"train.compile", "train.warmup_steps", "train.ddp_always", "model.attention",
                                 "optim.muon_compile", "optim.muon_symmetric"}
    assert by_group["neutral"] == {"data.vocab_check", "log.track", "eval.batch_size"}
    assert by_group["eval"] == {"eval.every_steps", "eval.every_s", "eval.at_start"}


def test_the_eval_shape_and_the_holdout_are_resolved_on_the_config():
    cfg = parse_args(["--config", TINY, "--data.train=x", "--train.batch_size=3", "--train.seq_len=32"])
    assert (cfg.eval.batch_size, cfg.eval.seq_len) == (0, 0) and cfg.eval_shape == (3, 32)
    cfg.eval.batch_size, cfg.eval.seq_len = 2, 48
    assert cfg.eval_shape == (2, 48)
    assert not cfg.data.holdout and cfg.holdout_tokens == 0
    cfg.data.val = "holdout"
    assert cfg.data.holdout and cfg.holdout_tokens == cfg.eval.tokens
