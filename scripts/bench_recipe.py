"""Does the modern recipe beat GPT-2 + AdamW on the CPU track? Both trained for the same time, side by side.

    python -m scripts.bench_recipe [--budget 120] [--data shards/demo] [--json bench.json]
    python -m scripts.bench_recipe --budget 30 --override train.batch_size=4 --override eval.tokens=8192
    python -m scripts.bench_recipe --budget 60 --ab model.attn_scale=0.12   # configs/cpu.toml without / with

Trains configs/baseline_cpu.toml and configs/cpu.toml through train.py (subprocesses, no special path) on
the same shards (prepared with `python -m data.prepare --demo` if absent), at the same parameter count
(checked within 15%) and budget. The two runs go at the same time, each on half the cores: they see the
same machine load, which on a shared machine drifts more between minutes than between processes. Timing is
`exclude_warmup` with one untimed warm-up step (first calls were measured taking up to 40 s on a loaded
machine: one-time costs, not the recipe), and the periodic evals (every --eval-every s of training) stop the
clock. Reported: each final val loss, and when the modern run's evals first reached the baseline's final
loss, as a fraction of the budget (the goal: <= 0.5). The two runs' curves, against training time and against
tokens, go beside the --json file (bench.json -> bench.png), else to runs/bench-recipe-<time>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run by path (python scripts/x.py), not as python -m scripts.x: the root is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atomic import write_json
from model import get_model
from trainer.config import parse_args as parse_train_args
from trainer.data import resolve_data
from trainer.plots import plot_runs

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"baseline": "configs/baseline_cpu.toml", "modern": "configs/cpu.toml"}
PARAM_TOLERANCE = 0.15  # baseline_cpu.toml is nanoGPT's fixed 4 x 128 recipe: 845K parameters to cpu.toml's 935K
PREPARE = ["--demo", "--tokenizer", "bytes", "--val-tokens", "1000000", "--shard-tokens", "10000000"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m scripts.bench_recipe", description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=120.0, help="training seconds of each recipe")
    p.add_argument("--data", type=Path, default=Path("shards/demo"), help="folder of *_train_*/*_val_* shards")
    p.add_argument("--eval-every", type=float, default=6.0, help="seconds of training between evals")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed to both runs as --SECTION.KEY=VALUE (repeatable)")
    p.add_argument("--ab", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="A/B of one piece instead: both runs train configs/cpu.toml, the second with these overrides")
    p.add_argument("--runs", type=Path, default=Path("runs"), help="log.dir of the two runs")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.budget <= 0 or args.eval_every <= 0:
        p.error("--budget and --eval-every must be > 0")
    args.data, args.runs = args.data.resolve(), args.runs.resolve()  # the runs start in the repository root
    args.recipes = {"baseline": RECIPES["modern"], "modern": f"{RECIPES['modern']} + {' '.join(args.ab)}"} \
        if args.ab else RECIPES
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


def train_args(args: argparse.Namespace, recipe: str, run_id: str) -> list[str]:
    """train.py's arguments for one recipe: its config on the benchmark's data, budget and eval cadence."""
    return ["--config", RECIPES["modern"] if args.ab else RECIPES[recipe], f"--data.train={args.data}/*_train_*.bin",
            f"--data.val={args.data}/*_val_*.bin", f"--train.budget_s={args.budget}",
            "--train.timing=exclude_warmup", "--train.warmup_steps=1", f"--eval.every_s={args.eval_every}",
            f"--log.dir={args.runs}", f"--log.run_id={run_id}",
            *(f"--{o}" for o in args.override + (args.ab if recipe == "modern" else []))]


def param_count(argv: list[str]) -> tuple[int, int]:
    """(parameters, eval tokens) of the model a train.py command line would build."""
    cfg = parse_train_args(argv)
    resolve_data(cfg)
    return get_model(cfg.to_dict()).num_params(), cfg.eval.tokens


def check_comparable(argvs: dict[str, list[str]]) -> dict[str, int]:
    """Parameter counts per recipe; refuse recipes that differ by more than 15% or in eval tokens."""
    counts, evals = zip(*(param_count(a) for a in argvs.values()))
    if max(counts) > (1 + PARAM_TOLERANCE) * min(counts):
        raise SystemExit(f"bench: parameter counts {dict(zip(argvs, counts))} differ by more than "
                         f"{PARAM_TOLERANCE:.0%}; resize the [model] of {' or '.join(RECIPES.values())}")
    if len(set(evals)) > 1:
        raise SystemExit(f"bench: eval.tokens differ {dict(zip(argvs, evals))}; the losses would not be comparable")
    return dict(zip(argvs, counts))


def train_all(args: argparse.Namespace, argvs: dict[str, list[str]], run_ids: dict[str, str]) -> None:
    """Run every recipe's train.py at once, each on its share of the cores; fail with a run's output tail."""
    # A share of the cores each: 2 threads per run on 2 cores would oversubscribe them.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // len(argvs))),
           "PYTHONUNBUFFERED": "1"}
    args.runs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for recipe, argv in argvs.items():
        out = args.runs / f"{run_ids[recipe]}.out"
        with open(out, "w") as f:  # the child keeps its own copy of the descriptor
            procs[recipe] = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, env=env, stdout=f,
                                             stderr=subprocess.STDOUT)
    for recipe, proc in procs.items():
        if proc.wait() != 0:
            out = args.runs / f"{run_ids[recipe]}.out"
            raise SystemExit(f"bench: the {recipe} run ({args.recipes[recipe]}) exited {proc.returncode}; "
                             f"its output ({out}) ends with:\n{out.read_text()[-4000:]}")


def time_to_reach(run_dir: Path, loss: float) -> float | None:
    """Training seconds at the first eval of the run with val loss <= `loss` (None if never)."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "eval" and record["val_loss"] <= loss:
            return record["elapsed_s"]
    return None


def results(args: argparse.Namespace, run_ids: dict[str, str], params: dict[str, int]) -> dict:
    """The numbers of the benchmark, from the runs' summary.json and metrics.jsonl."""
    summaries = {r: json.loads((args.runs / run_ids[r] / "summary.json").read_text()) for r in RECIPES}
    target = summaries["baseline"]["final_val_loss"]
    reached = time_to_reach(args.runs / run_ids["modern"], target)
    keys = ("run_id", "final_val_loss", "final_val_bpb", "steps", "tokens_seen", "tokens_per_s", "train_time_s")
    return {"budget_s": args.budget, "eval_every_s": args.eval_every, "overrides": args.override,
            "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
            "recipes": {r: {"config": args.recipes[r], "params": params[r], **{k: summaries[r][k] for k in keys}}
                        for r in RECIPES},
            "modern_time_to_baseline_final_s": reached,
            "ratio_to_budget": None if reached is None else reached / args.budget}


def table(res: dict) -> str:
    """The results as a Markdown table, then the headline line."""
    rows = ["| recipe | config | params | steps | tokens | tok/s | final val loss | bits/byte |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["recipes"].items():
        bpb = "-" if r["final_val_bpb"] is None else f"{r['final_val_bpb']:.4f}"
        rows.append(f"| {name} | {r['config']} | {r['params']:,} | {r['steps']} | {r['tokens_seen']:,} | "
                    f"{r['tokens_per_s']:,.0f} | {r['final_val_loss']:.4f} | {bpb} |")
    t, ratio = res["modern_time_to_baseline_final_s"], res["ratio_to_budget"]
    reached = "never (within the budget)" if t is None else f"after {t:.1f} s = {ratio:.2f} x the budget (goal <= 0.5)"
    return "\n".join(rows) + (f"\n\nmodern recipe reached the baseline's final val loss {reached}; "
                              f"budget {res['budget_s']:g} s each, load average {res['load_avg_1m']:.1f} "
                              f"on {res['cpu_count']} cores\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.bench_recipe`."""
    args = parse_args(argv)
    ensure_data(args.data)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_ids = {r: f"bench-{r}-{stamp}" for r in RECIPES}
    argvs = {r: train_args(args, r, run_ids[r]) for r in RECIPES}
    params = check_comparable(argvs)
    print(f"bench: {', '.join(f'{r} {n:,} params' for r, n in params.items())}; training both for "
          f"{args.budget:g} s ...", file=sys.stderr)
    train_all(args, argvs, run_ids)
    res = results(args, run_ids, params)
    # beside the JSON: modern and baseline on one axis, against training time and against tokens
    res["figure"] = str(args.json.with_suffix(".png") if args.json else args.runs / f"bench-recipe-{stamp}.png")
    plot_runs([args.runs / run_ids[r] for r in RECIPES], res["figure"], x=("time", "tokens"))
    print(table(res) + f"curves: {res['figure']}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
