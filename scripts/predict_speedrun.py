"""The speedrun on paper: FLOPs per token, tokens/s on 8 x H100 at an assumed MFU, time to 3.28, budget_s.

    python -m scripts.predict_speedrun                                # docs/PERFORMANCE.md's table
    python -m scripts.predict_speedrun --mfu 0.35                     # at another assumed MFU
    python -m scripts.predict_speedrun --measured runs/gpu_check.json  # + what scripts/gpu_check.sh measured
    python -m scripts.predict_speedrun --beside out/beside/beside.json  # + the time from the ratio to the record
    python -m scripts.predict_speedrun --shards                       # FineWeb train shards the budget needs

FLOPs per token are GPT.flops_per_token (6 per matmul weight, plus the causal, windowed attention; with doc_causal
an upper bound, since no document boundary is assumed inside a window), averaged over the run as its window grows.
The tokens to reach 3.28 are those of the modded-nanogpt record of this shape; ours may need more (its recipe
differs in details: docs/PERFORMANCE.md lists where).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch


from model.config import stage_of
from model.gpt import GPT
from model.masks import window_at
from trainer.config import Config, parse_args as parse_train_args
from trainer.mfu import PEAK_BF16_FLOPS, mfu

CONFIG = "configs/speedrun_8xh100.toml"
GPUS = 8
ASSUMED_MFU = 0.30  # below the ~40% the record reaches by this count (FP8 head, kernels we lack); one H200 measured
# 30.5% for the config of record 28's shape (records/gpu_check/)
BUDGET_MARGIN = 1.1  # budget_s = the predicted time x this, rounded up to 10 s: room for a slower machine
# KellerJordan/modded-nanogpt records/track_1_short/2025-11-29_BatchSizeSchedule, record 46: the record CONFIG follows
# (11 working layers of 768, 6 heads of 128, YaRN, smear, backout, NorMuon with cautious decay, AdamW every other
# step, 131,072 -> 262,144 -> 393,216 tokens a step in thirds of its 2,120 scheduled steps, then 40 more at the last;
# cooldown 0.55). Its README: 8 runs, mean 132.2 s and val loss 3.2782; log 10e8f7c6-7175-4467-bdb0-a5de25d771a6.txt:
# 2,160 steps (707 x 131,072 + 707 x 262,144 + 746 x 393,216 tokens) in 132,194 ms.
RECORD = {"name": "2025-11-29_BatchSizeSchedule", "steps": 2160, "tokens": 571_342_848, "train_s": 132.194}
# The same repository's README, record #89 (2026-07-17, 1.23 minutes): "under 75 seconds", "under 400M tokens".
CURRENT = "< 75 s, < 400M tokens"
SHARD_TOKENS = 100_000_000  # a FineWeb train shard (scripts/fetch_fineweb.py)
SHARD_MARGIN = 1.25  # a machine faster than predicted still sees no token twice
# CONFIG's rows (data.sorted_shards, data.doc_cut) read about this share of a shard's tokens, the rest of each cut
# document skipped: the "cut" line of python -m scripts.data_coverage --fineweb-like 20000000 --seq-len 16384
ROWS_READ = 0.91


def flops_per_token(cfg: Config) -> tuple[float, float]:
    """(training FLOPs per token, averaged over the run's tokens; its attention share): GPT.flops_per_token at
    each of 101 evenly spaced points of training progress (the window's schedule: linear growth, or
    model.window_stages; the rows of the batch stage there), each weighted by its stage's tokens per step."""
    with torch.device("meta"):  # the shapes without allocating the weights
        model = GPT(cfg.model)
    shapes = cfg.train.stage_shapes()
    stages = [shapes[stage_of(i / 100, len(shapes))] for i in range(101)]
    points = [(row, window_at(cfg.model, i / 100)) for i, (_, row) in enumerate(stages)]
    weights = [m * row for m, row in stages]
    flops = statistics.fmean([model.flops_per_token(*point) for point in points], weights=weights)
    attention = statistics.fmean([model.attention_flops_per_token(*point) for point in points], weights=weights)
    return flops, attention / flops


def params(cfg: Config) -> int:
    """The parameters of cfg's model (built on the meta device)."""
    with torch.device("meta"):
        return GPT(cfg.model).num_params()


def tokens_per_s(flops: float, assumed_mfu: float) -> float:
    """Predicted tokens/s on GPUS x H100 at `assumed_mfu`, for `flops` training FLOPs a token."""
    return assumed_mfu * GPUS * PEAK_BF16_FLOPS["H100"] / flops


def shards_needed(assumed_mfu: float = ASSUMED_MFU) -> int:
    """FineWeb train shards whose rows hold CONFIG's budget_s at the predicted tokens/s, x SHARD_MARGIN."""
    cfg = parse_train_args(["--config", CONFIG])
    tok_s = tokens_per_s(flops_per_token(cfg)[0], assumed_mfu)
    return math.ceil(cfg.train.budget_s * tok_s * SHARD_MARGIN / (SHARD_TOKENS * ROWS_READ))


def measured(path: Path | None) -> dict | None:
    """gpu_check's speedrun row (one GPU) from its --json file, or None."""
    if path is None:
        return None
    rows = [r for r in json.loads(path.read_text())["checks"] if r["check"] == "speedrun" and r.get("tok_s")]
    if not rows:
        raise SystemExit(f"{path}: no speedrun check with a tokens/s figure; run bash scripts/gpu_check.sh again")
    return rows[0]


def beside(path: Path | None) -> float | None:
    """Ours / the record's tokens/s on one GPU, from scripts.bench.beside_record's beside.json, or None."""
    if path is None:
        return None
    speed = json.loads(path.read_text()).get("speed") or {}
    record, ours = ((speed.get(side) or {}).get("tok_s") for side in ("record", "ours"))
    if not (record and ours):
        raise SystemExit(f"{path}: no tokens/s of both sides; run scripts.bench.beside_record to its shared evals")
    return ours / record


def table(assumed_mfu: float, gpu_check: dict | None = None, ratio: float | None = None) -> tuple[str, int]:
    """docs/PERFORMANCE.md's markdown table and the budget_s it suggests for configs/speedrun_8xh100.toml."""
    cfg = parse_train_args(["--config", CONFIG])
    flops, attention = flops_per_token(cfg)
    tok_s = tokens_per_s(flops, assumed_mfu)
    model_cfg = cfg.model
    peak = PEAK_BF16_FLOPS["H100"]
    tokens = RECORD["tokens"]
    budget = math.ceil(tokens / tok_s * BUDGET_MARGIN / 10) * 10
    got_mfu = got_tok_s = got_time = "not yet"
    shape = ((gpu_check or {}).get("probe") or {}).get("shape") or {}
    if gpu_check is not None and (shape.get("params"), shape.get("seq_len")) != (params(cfg), cfg.train.seq_len):
        # tokens/s do not carry over to another model or sequence length; its MFU is the best guess there is
        got_mfu = f"{gpu_check['mfu']:.0%} ({shape.get('params', 0) / 1e6:.0f}M params, seq {shape.get('seq_len')})"
    elif gpu_check is not None:  # one GPU measured: x 8 for the 8-GPU run, as if the all-reduce cost nothing
        got = GPUS * gpu_check["tok_s"]
        got_mfu, got_tok_s = f"{mfu(flops, got, peak, GPUS):.0%}", f"{got / 1e6:.2f}M"
        got_time = f"{tokens / got:.0f} s"
    record_mfu = mfu(flops, tokens / RECORD["train_s"], peak, GPUS)
    rows = [
        ("FLOPs per token (training)", f"{flops / 1e9:.3f} G", "",
         f"GPT.flops_per_token at each batch stage's rows "
         f"({' -> '.join(str(row) for _, row in cfg.train.stage_shapes())} tokens), mean over the run's tokens "
         f"through the window schedule "
         f"{' -> '.join(map(str, model_cfg.window_stages or [model_cfg.first_window or model_cfg.window]))} -> "
         f"{model_cfg.window} (causal; short layers half): "
         f"attention {attention:.0%} of it"),
        ("tokens to val loss 3.28", f"{tokens / 1e6:.0f}M", "",
         f"record {RECORD['name']}: {RECORD['steps']:,} steps, {tokens / RECORD['steps']:,.0f} tokens each on average"),
        ("MFU", f"{assumed_mfu:.0%} (assumed)", got_mfu,
         f"the record: {record_mfu:.0%} by this count ({1000 * RECORD['train_s'] / RECORD['steps']:.2f} ms a step)"),
        ("tokens/s on 8 x H100", f"{tok_s / 1e6:.2f}M", got_tok_s,
         f"{peak / 1e12:.0f} TFLOP/s bf16 per GPU; measured: scripts/gpu_check.sh's one GPU x 8"),
        ("time to 3.28", f"{tokens / tok_s:.0f} s", got_time,
         f"the record: {RECORD['train_s']:.1f} s; the current record: {CURRENT}"),
        ("train.budget_s", f"{budget}", "", f"the predicted time x {BUDGET_MARGIN}, rounded up to 10 s"),
    ]
    if ratio is not None:  # CONFIG takes the record's steps and tokens: its time scales by the speed alone
        rows.insert(-1, ("time to 3.28, beside the record", f"{RECORD['train_s'] / ratio:.0f} s", "",
                         f"the record's {RECORD['train_s']:.1f} s / ours-to-the-record's tokens/s on one GPU, "
                         f"{ratio:.3f} (scripts.bench.beside_record)"))
    lines = ["| configs/speedrun_8xh100.toml | *predicted* | measured | how |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {pred} | {got} | {how} |" for name, pred, got, how in rows]
    return "\n".join(lines), budget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mfu", type=float, default=ASSUMED_MFU, help="assumed model FLOPs utilisation (0-1)")
    p.add_argument("--measured", type=Path, help="scripts/gpu_check.sh's --json output: fills the measured column")
    p.add_argument("--beside", type=Path,
                   help="scripts.bench.beside_record's beside.json: predicts the time from the ratio to the record")
    p.add_argument("--shards", action="store_true",
                   help=f"print only the number of FineWeb train shards whose rows (~{round(100 * ROWS_READ)}%% "
                        f"of a shard) hold {CONFIG}'s budget at the predicted tokens/s, "
                        f"+ {round(100 * (SHARD_MARGIN - 1))}%% (run.sh's default)")
    args = p.parse_args()
    if args.shards:
        print(shards_needed(args.mfu))
        return
    text, budget = table(args.mfu, measured(args.measured), beside(args.beside))
    print(text)
    print(f"\nsuggested train.budget_s: {budget} (configs/speedrun_8xh100.toml), {GPUS * budget} "
          f"(configs/speedrun_1gpu.toml)")


if __name__ == "__main__":
    main()
