"""The optimizer steps of a config's model with each optimizer key off and on, side by side in one process.

    python -m scripts.bench.optimizer                                      # speedrun_1gpu.toml on the GPU
    python -m scripts.bench.optimizer --variant optim.muon_symmetric --json optimizer.json
    python -m scripts.bench.optimizer --config configs/tiny.toml --cpu --optim.name=muon --model.n_embd=128  # CPU

Some keys change the optimizer step and nothing else (optim.muon_compile, optim.muon_symmetric, and the cost of
optim.bf16_storage's roundings): forward and backward are the same with them, so a training step gains what
Muon's and AdamW's steps gain, which this measures in a minute, with no model compile (a training run with and
one without would pay a cold compile each). Each variant builds the model from the same seed, gives every
parameter the same random gradient, steps each optimizer `--warmup` times (compiles, Triton's kernels) and
then `--steps` times in a row, as the training loop queues them after a backward (so a host slower than its GPU
shows), timed with CUDA events (on CPU, the clock). Per variant: Muon's and AdamW's milliseconds a step, a
training step's share of them (AdamW steps every optim.adam_every steps), its ratio to the plain config's, and
how far its weights ended from the plain config's (max |dw| / max |w|: the keys change roundings, not the math;
where cautious decay's sign test flips on a rounding, a weight differs by the rate x the decay: ~6e-4 here).
Other arguments are train.py's overrides of the config (`--optim.name=muon`, `--model.n_layer=4`); the keys above
are the bench's own, off in the plain config whatever the config says.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from trainer import ROOT
from trainer.config import Config, ConfigError, parse_args as parse_train_args
from util.atomic import write_json

KEYS = ("optim.muon_compile", "optim.muon_symmetric", "optim.bf16_storage")  # what changes the optimizer step only
DEFAULT_VARIANTS = ["optim.muon_compile", "optim.muon_symmetric", "optim.muon_compile,optim.muon_symmetric",
                    "optim.bf16_storage"]
GRAD_SCALE = 1e-3  # a gradient's size here does not change the time; only bf16_storage's roundings see it


def timed(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Milliseconds a step of `optimizer`, `steps` of them queued back to back."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        return 1000 * (time.perf_counter() - t0) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        optimizer.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def variant_config(config: str, overrides: list[str], keys: list[str], device: torch.device) -> Config:
    """The config with `keys` (of KEYS) on and the others off, checked as train.py checks it for `device`."""
    from trainer.parallel import check_kernels  # imports optim/symmetric.py: after main() chose the interpreter

    unknown = [key for key in keys if key not in KEYS]
    if unknown:
        sys.exit(f"bench optimizer: --variant {','.join(unknown)}: not one of the keys that change only the "
                 f"optimizer step ({', '.join(KEYS)})")
    try:
        cfg = parse_train_args(["--config", config, "--data.train=unused", *overrides,
                                *(f"--{key}={str(key in keys).lower()}" for key in KEYS)])
        check_kernels(cfg, device)
    except ConfigError as e:
        sys.exit(f"bench optimizer: {e} (the bench's own options: python -m scripts.bench.optimizer --help)")
    if cfg.optim.name != "muon":
        sys.exit(f"bench optimizer: {config} trains with optim.name = {cfg.optim.name!r}; its keys are Muon's: "
                 f"add --optim.name=muon")
    return cfg


def run_variant(cfg: Config, device: torch.device, steps: int, warmup: int) -> tuple[dict, list]:
    """({muon_ms, adamw_ms}, the weights after warmup + steps steps of each optimizer) of `cfg`'s optimizers."""
    from model.gpt import GPT
    from optim.compiled import compiled
    from optim.groups import build_optimizers

    torch._dynamo.reset()  # each variant compiles its own graphs, none left over from the one before
    compiled.cache_clear()
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    adamw, muon = build_optimizers(model, cfg.optim)
    gen = torch.Generator(device).manual_seed(0)
    for p in model.parameters():  # kept across the steps: every variant steps on the same gradients
        p.grad = GRAD_SCALE * torch.randn(p.shape, device=device, generator=gen)
    result = {}
    for name, optimizer in (("muon", muon), ("adamw", adamw)):
        for _ in range(warmup):
            optimizer.step()
        result[f"{name}_ms"] = timed(optimizer, steps, device)
    return result, [p.detach().to("cpu", copy=True) for p in model.parameters()]


def main(argv: list[str] | None = None) -> list[dict]:
    """Time the plain config and each variant; print the table, write --json."""
    p = argparse.ArgumentParser(prog="python -m scripts.bench.optimizer", description=__doc__.split("\n")[0],
                                allow_abbrev=False)  # the rest goes to train.py's parser: no prefix of ours
    p.add_argument("--config", default=str(ROOT / "configs" / "speedrun_1gpu.toml"))
    p.add_argument("--variant", action="append", metavar="KEYS",
                   help="comma-separated optim keys set to true together (repeat it; default: "
                        + "; ".join(DEFAULT_VARIANTS) + ")")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="a rehearsal on CPU (Triton's kernels in its interpreter)")
    p.add_argument("--json", type=Path)
    args, overrides = p.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the warm-up compiles what the variant compiles)")
    if args.cpu:  # before optim/symmetric.py's kernel is defined: Triton reads it then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("bench optimizer: no CUDA device; use --cpu for a rehearsal")
    device = torch.device("cpu" if args.cpu else "cuda")
    variants = [[]] + [[k for k in v.split(",") if k] for v in args.variant or DEFAULT_VARIANTS]
    configs = [variant_config(args.config, overrides, keys, device) for keys in variants]  # refused before any runs
    cfg = configs[0]
    rows, plain = [], None
    for keys, variant in zip(variants, configs):
        result, weights = run_variant(variant, device, args.steps, args.warmup)
        plain = plain or weights
        step_ms = result["muon_ms"] + result["adamw_ms"] / cfg.optim.adam_every
        drift = max(((w - p).abs().max() / p.abs().max().clamp(min=1e-30)).item()
                    for w, p in zip(weights, plain) if p.numel())
        rows.append({"variant": " + ".join(keys) or "plain", **result, "step_ms": step_ms,
                     "ratio": rows[0]["step_ms"] / step_ms if rows else 1.0, "weights_vs_plain": drift})
        if args.json:
            write_json(args.json, {"config": args.config, "device": str(device), "steps": args.steps,
                                   "adam_every": cfg.optim.adam_every, "rows": rows})
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    print(f"optimizer steps of {Path(args.config).name} on {name}, {args.steps} steps after {args.warmup} "
          f"(AdamW every {cfg.optim.adam_every}): ms a training step, plain / variant")
    print(f"{'variant':<45} {'muon ms':>9} {'adamw ms':>9} {'step ms':>9} {'speed':>7} {'weights vs plain':>17}")
    for r in rows:
        print(f"{r['variant']:<45} {r['muon_ms']:>9.2f} {r['adamw_ms']:>9.2f} {r['step_ms']:>9.2f} "
              f"{r['ratio']:>6.3f}x {r['weights_vs_plain']:>17.2e}")
    return rows


if __name__ == "__main__":
    main()
