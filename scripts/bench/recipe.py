"""Does the modern recipe beat nanoGPT's CPU recipe? Both trained as the CPU track runs them, one after the other.

    python -m scripts.bench.recipe [--budget 80] [--data shards/demo] [--json bench.json]
    python -m scripts.bench.recipe --budget 20 --baseline-steps 300 --override eval.tokens=16384  # a quick look
    python -m scripts.bench.recipe --budget 60 --ab model.attn_scale=0.12   # configs/cpu.toml without / with

Trains configs/baseline_cpu.toml (nanoGPT's recipe: its 2,000 steps, however long they take) and then
configs/cpu.toml for --budget seconds, through train.py (subprocesses, no special path), on the same shards
(prepared with `python -m data.prepare --demo` if absent), at the same parameter count (checked within 15%)
and scored on the same val tokens. Each run gets the whole machine, launched as a user would: the baseline as
one process (nanoGPT's way; torch's default threads), the modern recipe as `bash run.sh` does, one process
per core of one thread each. Timing is `exclude_warmup` with one untimed warm-up step (first calls were
measured taking up to 40 s on a loaded machine: one-time costs, not the recipe), and the evals every
--eval-every s of training stop the clock. Reported: the baseline's training time T_b and final val loss,
the modern run's final val loss (the goal: below the baseline's), and when its evals first reached the
baseline's final loss, as a fraction of T_b (the goal: <= 0.5). The two runs' curves, against training time
and against tokens, go beside the --json file (bench.json -> bench.png), else to runs/bench-recipe-<time>.png.

--ab A/Bs one piece instead: configs/cpu.toml without and with the given overrides, both for --budget
seconds, side by side (at the same time, each one process on its share of the cores, so both see the same
machine load, which on a shared machine drifts more between minutes than between processes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from model.gpt import GPT
from trainer import ROOT
from util.atomic import write_json
from trainer.config import parse_args as parse_train_args
from trainer.data import resolve_data
from trainer.plots import plot_runs, read_run

RECIPES = {"baseline": "configs/baseline_cpu.toml", "modern": "configs/cpu.toml"}
PARAM_TOLERANCE = 0.15  # baseline_cpu.toml is nanoGPT's fixed 4 x 128 recipe: 845K parameters to cpu.toml's 935K
PREPARE = ["--demo", "--tokenizer", "bytes", "--val-tokens", "1000000", "--shard-tokens", "10000000"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m scripts.bench.recipe", description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=80.0,
                   help="training seconds of the modern recipe (the baseline trains its 2,000 steps); "
                        "with --ab, of both")
    p.add_argument("--baseline-steps", type=int, default=0,
                   help="train the baseline for this many steps instead of its config's 2,000 (a quick look)")
    p.add_argument("--data", type=Path, default=Path("shards/demo"), help="folder of *_train_*/*_val_* shards")
    p.add_argument("--eval-every", type=float, default=8.0, help="seconds of training between evals")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to both runs as --SECTION.KEY=VALUE (repeatable)")
    p.add_argument("--ab", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="A/B of one piece instead: both runs train configs/cpu.toml, the second with these "
                        "overrides, side by side")
    p.add_argument("--runs", type=Path, default=Path("runs"), help="log.dir of the two runs")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.budget <= 0 or args.eval_every <= 0 or args.baseline_steps < 0:
        p.error("--budget and --eval-every must be > 0, --baseline-steps >= 0")
    args.data, args.runs = args.data.resolve(), args.runs.resolve()  # the runs start in the repository root
    args.recipes = {"baseline": RECIPES["modern"], "modern": f"{RECIPES['modern']} + {' '.join(args.ab)}"} \
        if args.ab else RECIPES
    args.planned = False  # the recipes at their own shapes, their parameters alike (scripts/bench/budgets.py plans)
    return args


def ensure_data(folder: Path) -> None:
    """Prepare the demo corpus into `folder` unless it already holds train and val shards."""
    if list(folder.glob("*_train_*.bin")) and list(folder.glob("*_val_*.bin")):
        return
    print(f"bench: no shards in {folder}; preparing the demo corpus", file=sys.stderr)
    cmd = [sys.executable, "-m", "data.prepare", *PREPARE, "--out", str(folder)]
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise SystemExit(f"bench: `{' '.join(cmd)}` failed (its error is above); prepare {folder} by hand "
                         f"or point --data at a folder of shards")


def train_args(args: argparse.Namespace, recipe: str, run_id: str, budget_s: float, eval_every: float) -> list[str]:
    """train.py's arguments for one recipe: its config on the benchmark's data, evals every `eval_every` s of
    training (0: the final one only); `budget_s` for the modern recipe (the baseline's config sets its length in
    steps) or, with --ab, for both."""
    budget = [f"--train.budget_s={budget_s}"]
    if recipe == "baseline" and not args.ab:
        budget = [f"--train.max_steps={args.baseline_steps}"] if args.baseline_steps else []
    return ["--config", RECIPES["modern"] if args.ab else RECIPES[recipe], f"--data.train={args.data}/*_train_*.bin",
            f"--data.val={args.data}/*_val_*.bin", *budget, f"--train.plan={str(args.planned).lower()}",
            "--train.timing=exclude_warmup",
            "--train.warmup_steps=1", f"--eval.every_s={eval_every}", f"--log.dir={args.runs}",
            f"--log.run_id={run_id}", *(f"--{o}" for o in args.override + (args.ab if recipe == "modern" else []))]


def command(args: argparse.Namespace, recipe: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line of one run and the environment it adds."""
    cores = os.cpu_count() or 2
    if args.ab:  # side by side: one process each, on its share of the cores (2 threads each would oversubscribe)
        return [sys.executable, "train.py", *argv], {"OMP_NUM_THREADS": str(max(1, cores // len(RECIPES)))}
    if recipe == "baseline":  # as nanoGPT runs: one process, torch's threads
        return [sys.executable, "train.py", *argv], {}
    # as `bash run.sh` runs the CPU track
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cores}", "train.py",
            *argv], {"OMP_NUM_THREADS": "1"}


def param_count(argv: list[str]) -> tuple[int, int]:
    """(parameters, eval tokens) of the model a train.py command line would build."""
    cfg = parse_train_args(argv)
    resolve_data(cfg)
    return GPT(cfg.model).num_params(), cfg.eval.tokens


def check_comparable(argvs: dict[str, list[str]]) -> dict[str, int]:
    """Parameter counts per recipe; refuse recipes that differ by more than 15% or in eval tokens."""
    counts, evals = zip(*(param_count(a) for a in argvs.values()))
    if max(counts) > (1 + PARAM_TOLERANCE) * min(counts):
        raise SystemExit(f"bench: parameter counts {dict(zip(argvs, counts))} differ by more than "
                         f"{PARAM_TOLERANCE:.0%}; resize the [model] of {' or '.join(RECIPES.values())}")
    if len(set(evals)) > 1:
        raise SystemExit(f"bench: eval.tokens differ {dict(zip(argvs, evals))}; the losses would not be comparable")
    return dict(zip(argvs, counts))


def train_all(args: argparse.Namespace, argvs: dict[str, list[str]], run_ids: dict[str, str]) -> dict[str, float]:
    """Run every recipe's train.py, one after the other (with --ab at once); fail with a run's output tail.
    Returns the 1-minute load average as each run ended: the machine's other work, which the runs share."""
    args.runs.mkdir(parents=True, exist_ok=True)
    procs, loads = {}, {}
    for recipe, argv in argvs.items():
        cmd, env = command(args, recipe, argv)
        with open(args.runs / f"{run_ids[recipe]}.out", "w") as f:  # the child keeps its own copy of the descriptor
            procs[recipe] = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                             stdout=f, stderr=subprocess.STDOUT)
        if not args.ab:
            loads[recipe] = wait(args, recipe, procs[recipe], run_ids)
    if args.ab:
        loads = {r: wait(args, r, proc, run_ids) for r, proc in procs.items()}
    return loads


def wait(args: argparse.Namespace, recipe: str, proc: subprocess.Popen, run_ids: dict[str, str]) -> float:
    """Wait for one run; the load average as it ended, or exit with the tail of its output if it failed."""
    if proc.wait() != 0:
        out = args.runs / f"{run_ids[recipe]}.out"
        raise SystemExit(f"bench: the {recipe} run ({args.recipes[recipe]}) exited {proc.returncode}; "
                         f"its output ({out}) ends with:\n{out.read_text()[-4000:]}")
    return os.getloadavg()[0]


def time_to_reach(run_dir: Path, loss: float) -> float | None:
    """Training seconds at the first eval of the run with val loss <= `loss` (None if never)."""
    return next((r["elapsed_s"] for r in read_run(run_dir).evals if r["val_loss"] <= loss), None)


def results(args: argparse.Namespace, run_ids: dict[str, str], params: dict[str, int],
            loads: dict[str, float]) -> dict:
    """The numbers of the benchmark, from the runs' summary.json and metrics.jsonl."""
    summaries = {r: json.loads((args.runs / run_ids[r] / "summary.json").read_text()) for r in RECIPES}
    target, baseline_time = summaries["baseline"]["final_val_loss"], summaries["baseline"]["train_time_s"]
    reached = time_to_reach(args.runs / run_ids["modern"], target)
    keys = ("run_id", "final_val_loss", "final_val_bpb", "steps", "tokens_seen", "tokens_per_s", "train_time_s",
            "world_size", "git_commit")
    return {"budget_s": args.budget, "eval_every_s": args.eval_every, "overrides": args.override, "ab": args.ab,
            "cpu_count": os.cpu_count(),
            "recipes": {r: {"config": args.recipes[r], "params": params[r], **{k: summaries[r][k] for k in keys},
                            "load_avg_1m": loads[r]} for r in RECIPES},
            "baseline_time_s": baseline_time, "modern_below_baseline": summaries["modern"]["final_val_loss"] < target,
            "modern_time_to_baseline_final_s": reached,
            "ratio_to_baseline_time": None if reached is None else reached / baseline_time}


def table(res: dict) -> str:
    """The results as a Markdown table, then the headline lines."""
    rows = ["| recipe | config | params | processes | steps | tokens | s | tok/s | load | final val loss | bits/byte |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["recipes"].items():
        bpb = "-" if r["final_val_bpb"] is None else f"{r['final_val_bpb']:.4f}"
        rows.append(f"| {name} | {r['config']} | {r['params']:,} | {r['world_size']} | {r['steps']} | "
                    f"{r['tokens_seen']:,} | {r['train_time_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['load_avg_1m']:.1f} | {r['final_val_loss']:.4f} | {bpb} |")
    base, modern = res["recipes"]["baseline"], res["recipes"]["modern"]
    if res["ab"]:
        return "\n".join(rows) + (f"\n\nwith {' '.join(res['ab'])}: final val loss {modern['final_val_loss']:.4f}, "
                                  f"without: {base['final_val_loss']:.4f} "
                                  f"({modern['final_val_loss'] - base['final_val_loss']:+.4f}); load average (1 min) "
                                  f"{base['load_avg_1m']:.1f} as the runs ended, on {res['cpu_count']} cores\n")
    t, ratio = res["modern_time_to_baseline_final_s"], res["ratio_to_baseline_time"]
    reached = "never" if t is None else f"after {t:.1f} s = {ratio:.2f} x the baseline's {res['baseline_time_s']:.1f} s"
    below = "below" if res["modern_below_baseline"] else "NOT below"
    return "\n".join(rows) + (
        f"\n\nmodern recipe: final val loss {modern['final_val_loss']:.4f} after {modern['train_time_s']:.1f} s, "
        f"{below} the baseline's {base['final_val_loss']:.4f} (goal: below); its evals reached that loss {reached} "
        f"(goal <= 0.5); load average (1 min) {base['load_avg_1m']:.1f} and {modern['load_avg_1m']:.1f} as the runs "
        f"ended, on {res['cpu_count']} cores\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.bench.recipe`."""
    args = parse_args(argv)
    ensure_data(args.data)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_ids = {r: f"bench-{r}-{stamp}" for r in RECIPES}
    argvs = {r: train_args(args, r, run_ids[r], args.budget, args.eval_every) for r in RECIPES}
    params = check_comparable(argvs)
    length = f"both for {args.budget:g} s" if args.ab else \
        f"the baseline for its steps, then the modern recipe for {args.budget:g} s"
    print(f"bench: {', '.join(f'{r} {n:,} params' for r, n in params.items())}; training {length} ...", file=sys.stderr)
    loads = train_all(args, argvs, run_ids)
    res = results(args, run_ids, params, loads)
    # beside the JSON: modern and baseline on one axis, against training time and against tokens
    res["figure"] = str(args.json.with_suffix(".png") if args.json else args.runs / f"bench-recipe-{stamp}.png")
    plot_runs([args.runs / run_ids[r] for r in RECIPES], res["figure"], x=("time", "tokens"))
    print(table(res) + f"curves: {res['figure']}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
