"""Leaderboard: mean ± std of time-to-target and final val loss over the runs of one experiment.

    python -m scripts.leaderboard                             # this checkout's runs/ and records/
    python -m scripts.leaderboard runs/                       # every summary.json below runs/
    python -m scripts.leaderboard runs/a runs/b --target 3.28 --markdown
    python -m scripts.leaderboard records/8xh100 --pool-seeds --plot records.png

A row holds the runs whose resolved configs (the config.toml beside each summary.json) are identical
except for run-specific keys (RUN_SPECIFIC: where a run writes, how it is logged, checkpointed and resumed),
at the same world size, and whose resumes (summary.json's resume_changes) made the same changes that can move a
result (all but RESULT_NEUTRAL's): a run extended by --extend-budget is not pooled with runs given the longer
budget from the start. Which key is which, trainer/config.py declares on the key's field (`Group`). Different seeds make different rows unless --pool-seeds. The fingerprint column is
a hash of what a row's runs share; "differs" names each setting in which a row's runs depart from their config
file's own values (configs/<config>.toml with its base chain, as train.py reads it today; the code's defaults
for a run made without one), those that set budget, shape and batch first, clipped unless --all. A record
claim needs p < 0.01 that the mean final val loss is <= the target (one-sided one-sample t-test, the speedrun's
rule, computed by scipy.stats.ttest_1samp), so a p-value never mixes configs. A run is counted once: a
summary.json named twice, and a copy of one (records/ keeps copies of runs/' files), which is the same run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

from trainer import ROOT
from trainer.config import Config, ConfigError, apply_file, config_chain, keys_in
from trainer.plots import PlotError, image_format, plot_leaderboard
from util.optional import import_optional

# The summary.json keys this table reads (train.py writes them all, null when not applicable).
NEEDED_KEYS = ("run_id", "config_name", "track", "final_val_loss", "target_loss", "time_to_target_s",
               "world_size", "hardware", "torch_version")
COLUMNS = ("track", "config", "fingerprint", "runs", "run ids", "reached", "time to target (s)", "final val loss",
           "target", "p(mean<=target)", "hardware", "torch", "differs")
# Nothing a run trains depends on these (a save stops the training clock), so runs that differ only here repeat
# one experiment.
RUN_SPECIFIC = keys_in("run")
SEEDS = frozenset({"train.seed", "data.seed"})
# What a resume may change that cannot move a run's result, so that the run stays in the row of the config it
# ended with. Every other change sets the run apart: a budget extension (the LR schedule spans the new budget from
# the resume on), how fast the clock runs, and a key given no group.
RESULT_NEUTRAL = keys_in("run", "neutral")
# Evals off the training clock leave the trajectory alone (the time to target is read at them: from the resume
# on, at the new frequency)
EVAL_FREQUENCY = keys_in("eval")
DIFFERS_CHARS = 80  # the "differs" cell names settings up to this width, then counts the rest (unless --all)
RUN_IDS_CHARS = 40  # the same for the "run ids" cell
# What sets a row's budget, shape and batch: "differs" names these first, in this order, then the rest by name.
MOVES_RESULT = ("train.budget_s", "train.max_steps", "train.extension_steps", "train.schedule", "model.n_layer",
                "model.n_embd", "model.n_head", "model.vocab_size", "train.seq_len", "train.batch_size",
                "train.grad_accum", "train.batch_stages")
# Config file values train.py fills in at run time (model.vocab_size = 0: from meta.json): a run's resolved
# value does not depart from the file's.
FILLED_AT_RUN = {"model.vocab_size": 0}


class SummaryError(ValueError):
    """A summary.json that cannot be used; the message names the file and the fix."""


def find_summaries(paths: list[str | Path]) -> list[Path]:
    """Every summary.json named by `paths` (a summary file, a run folder, or a folder searched recursively). Below
    a folder, one without a config.toml beside it (a summary kept alone, as some records keep a side run's) is left
    out, and so is a folder with none yet (its runs still training), each said on stderr; a SummaryError where
    nothing is left. A run named itself must have its config.toml (load_summary)."""
    found: list[Path] = []
    notes: list[str] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise SummaryError(f"{p}: no such file or folder; pass a run folder or a summary.json path")
        hits = sorted(p.rglob("summary.json"))
        alone = [h for h in hits if h.parent != p and not (h.parent / "config.toml").exists()]
        if not hits:
            notes.append(f"{p}: no summary.json in this folder or below it yet (a run writes it when it stops)")
        elif alone:
            notes.append(f"left out {len(alone)} of the {len(hits)} summary.json below {p} that have no config.toml "
                         f"beside them, which puts a run in its row (e.g. {alone[0]}); copy it along to rank them")
        found.extend(h for h in hits if h not in alone)
    if not found:
        raise SummaryError("; ".join(notes) + "; nothing to rank: pass a run folder (runs/<run_id>) or a folder of "
                           "runs")
    for note in notes:
        print(f"leaderboard: {note}", file=sys.stderr)
    return _once(found)


def _once(paths: list[Path]) -> list[Path]:
    """`paths` with each run once: a file named twice (runs/ and runs/a, or two spellings of one folder) and a
    copy of a summary.json, said on stderr. A copy holds the same bytes; two runs never do, even under one run id
    (their losses and times differ), so the bytes tell a copy where a run id alone would not."""
    first: dict[bytes | Path, Path] = {}
    for path in paths:
        try:
            key: bytes | Path = path.read_bytes()
        except OSError:
            key = path.resolve()  # load_summary says why it cannot be read
        if key in first and first[key].resolve() != path.resolve():
            print(f"leaderboard: {path} is a copy of {first[key]} (the same bytes): counted once", file=sys.stderr)
        first.setdefault(key, path)
    return list(first.values())


def load_summary(path: Path) -> dict:
    """Read one summary.json, checking it is a JSON object holding the keys the table needs."""
    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SummaryError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise SummaryError(f"{path}: not valid JSON ({e}); train.py writes it atomically, so it was "
                           f"edited or copied incompletely — restore it from the run folder or remove it") from None
    if not isinstance(summary, dict):
        raise SummaryError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    missing = [k for k in NEEDED_KEYS if k not in summary]
    if missing:
        raise SummaryError(f"{path}: missing key(s) {', '.join(missing)}; it was not written by train.py "
                           f"(which writes every key, null when not applicable)")
    for key in ("final_val_loss", "target_loss", "time_to_target_s"):
        value = summary[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SummaryError(f"{path}: {key} must be a number or null, got {value!r}")
    changes = summary.setdefault("resume_changes", [])  # older summaries: written before resumes were recorded
    if not isinstance(changes, list) or not all(isinstance(c, dict) and {"key", "saved", "now"} <= c.keys()
                                                for c in changes):
        raise SummaryError(f"{path}: resume_changes must be a list of {{\"step\", \"key\", \"saved\", \"now\"}} "
                           f"objects, as train.py writes it; restore it from the run folder")
    summary["config"] = load_config(Path(path).parent / "config.toml")
    return summary


def _flat(sections: dict[str, Any]) -> dict[str, Any]:
    return {f"{name}.{key}": value for name, table in sections.items() if isinstance(table, dict)
            for key, value in table.items()}


def load_config(path: Path) -> dict[str, Any]:
    """A run's resolved config.toml as {"section.key": value}; keys it lacks (added to the code after the run)
    count at today's defaults, which keep the old behaviour."""
    try:
        saved = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SummaryError(f"{path}: missing; train.py writes it beside summary.json and the rows group runs by "
                           f"it: copy it along with the run's summary.json") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SummaryError(f"{path}: cannot read it ({e}); restore it from the run folder") from None
    return {**_flat(Config().to_dict()), **_flat(saved)}


def experiment(summary: dict, pool_seeds: bool = False) -> dict[str, Any]:
    """What makes a run comparable: its config without run-specific keys (and seeds, if pooled), world size, and
    the changes its resumes made that can move its result."""
    drop = RUN_SPECIFIC | (SEEDS if pool_seeds else frozenset())
    exp = {**{k: v for k, v in summary["config"].items() if k not in drop}, "world_size": summary["world_size"]}
    # not the step of the change: runs extended at the end of the same budget end it at different steps
    resumed = [f"{c['key']} {c['saved']}->{c['now']}" for c in summary["resume_changes"]
               if moves_result(c["key"], summary["config"])]
    return {**exp, "resumed": "; ".join(resumed)} if resumed else exp


def moves_result(key: str, config: dict[str, Any]) -> bool:
    """Whether a resume's change of `key` can move the result of a run that ended with `config` (RESULT_NEUTRAL)."""
    if key in EVAL_FREQUENCY:
        return config["train.timing"] == "from_first_forward"
    return key not in RESULT_NEUTRAL


def fingerprint(exp: dict[str, Any]) -> str:
    """8 hex digits naming an experiment (a hash of its settings)."""
    return hashlib.sha256(json.dumps(exp, sort_keys=True).encode()).hexdigest()[:8]


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; nan for a single value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan


def t_test_below(xs: list[float], target: float) -> tuple[float, float]:
    """One-sample t statistic and one-sided p-value for H1: mean(xs) < target (H0: mean >= target).

    Needs two or more values. With zero spread the mean either is below the target or is not: p is 0 or 1.
    """
    if len(xs) < 2:
        raise ValueError(f"a t-test needs at least 2 values, got {len(xs)}")
    if len(set(xs)) == 1:  # scipy warns of catastrophic cancellation and answers nan here
        return (-math.inf, 0.0) if xs[0] < target else (math.inf, 1.0)
    stats = import_optional("scipy.stats", "the leaderboard's t-test", SummaryError)
    result = stats.ttest_1samp(xs, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def _distinct(values) -> str:
    return "; ".join(sorted({str(v) for v in values if v is not None})) or "-"


def _mean_std_text(xs: list[float], digits: int) -> str:
    if not xs:
        return "-"
    mean, std = mean_std(xs)
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def reference(config_name: str) -> tuple[dict[str, Any], str]:
    """The config file's own values a run of `config_name` departs from ({"section.key": value}: the code's
    defaults under configs/<config_name>.toml and its base chain), and a phrase naming them."""
    path = ROOT / "configs" / f"{config_name}.toml"
    if not path.is_file():
        return _flat(Config().to_dict()), ("the code's defaults (no --config)" if config_name == Config().name else
                                           f"the code's defaults (no configs/{config_name}.toml here)")
    cfg = Config()
    try:
        apply_file(cfg, path)
        files = [file for file, _ in config_chain(path)]
    except ConfigError as e:
        return _flat(Config().to_dict()), f"the code's defaults (configs/{config_name}.toml cannot be read: {e})"
    bases = ", ".join(os.path.relpath(file, ROOT) for file in files[-2::-1])
    return _flat(cfg.to_dict()), f"configs/{config_name}.toml" + (f" over its base {bases}" if bases else "")


def differences(exp: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """"key=value" for each setting of experiment `exp` that is not `ref`'s, budget, shape and batch first (in
    MOVES_RESULT's order), then its resumes' changes, then the rest by name; world_size, which no config file
    sets, is left to the hardware column."""
    def departs(key: str) -> bool:
        return key in ref and exp[key] != ref[key] and not (key in FILLED_AT_RUN and ref[key] == FILLED_AT_RUN[key])

    first = [k for k in MOVES_RESULT if k in exp and departs(k)]
    rest = sorted(k for k in exp if k not in MOVES_RESULT and departs(k))
    resumed = [f"resumed={exp['resumed']}"] if "resumed" in exp else []
    return [f"{k}={exp[k]}" for k in first] + resumed + [f"{k}={exp[k]}" for k in rest]


def _clip(items: list[str], width: int | None) -> str:
    """The items joined by commas up to `width` characters (None: all of them), then how many more; "-" for
    none."""
    shown: list[str] = []
    for item in items:
        if shown and width is not None and len(", ".join([*shown, item])) > width:
            break
        shown.append(item)
    rest = len(items) - len(shown)
    return (", ".join(shown) + (f", ... ({rest} more)" if rest else "")) if items else "-"


def group_rows(summaries: list[dict], target: float | None = None, pool_seeds: bool = False,
               show_all: bool = False) -> list[dict]:
    """One table row per experiment: counts, run ids, mean ± std, p-value, hardware and torch versions,
    fingerprint, and its differences from its config file (every one with `show_all`, else clipped).

    `target` overrides each run's own target_loss for the p-value. Each row also carries "summaries" (its runs)
    and "goal" (the target as a number, or None) for the plot, and "reference" (what "differs" is measured from).
    """
    groups: dict[str, list[dict]] = defaultdict(list)
    exps = {}
    for s in summaries:
        exp = experiment(s, pool_seeds)
        exps[fingerprint(exp)] = exp
        groups[fingerprint(exp)].append(s)
    references = {name: reference(name) for name in sorted({str(s["config_name"]) for s in summaries})}
    rows = []
    for fp, runs in sorted(groups.items(), key=lambda g: (str(g[1][0]["track"]), str(g[1][0]["config_name"]),
                                                          -len(g[1]), g[0])):
        losses = [float(r["final_val_loss"]) for r in runs if r["final_val_loss"] is not None]
        scored = f" ({len(losses)} of {len(runs)} runs)" if 0 < len(losses) < len(runs) else ""  # e.g. stopped ones
        times = [float(r["time_to_target_s"]) for r in runs if r["time_to_target_s"] is not None]
        goal = target if target is not None else runs[0]["target_loss"]  # eval.target_loss: one per experiment
        p = t_test_below(losses, goal)[1] if goal is not None and len(losses) > 1 else None
        ref, where = references[str(runs[0]["config_name"])]
        rows.append({
            "track": _distinct(r["track"] for r in runs), "config": _distinct(r["config_name"] for r in runs),
            "fingerprint": fp, "runs": len(runs), "reached": len(times),
            "time to target (s)": _mean_std_text(times, 1),
            "final val loss": _mean_std_text(losses, 4) + scored,
            "target": f"{goal:g}" if goal is not None else "-",
            "p(mean<=target)": "n/a" if p is None else f"{p:.3g}",
            "hardware": _distinct(r["hardware"] for r in runs),
            "torch": _distinct(r["torch_version"] for r in runs),
            "run ids": _clip([str(r["run_id"]) for r in runs], None if show_all else RUN_IDS_CHARS),
            "differs": _clip(differences(exps[fp], ref), None if show_all else DIFFERS_CHARS),
            "summaries": runs, "goal": goal, "reference": where,
        })
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    """The rows as aligned plain text, or as a Markdown table."""
    cells = [list(COLUMNS)] + [[str(r[c]) for c in COLUMNS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "|".join("---" for _ in COLUMNS) + "|")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)


def reference_note(rows: list[dict], show_all: bool = False) -> str:
    """The line under the table that says what each config's "differs" cells are measured from."""
    wheres = dict.fromkeys(f"{r['config']}: {r['reference']}" for r in rows)
    clipped = "" if show_all else "; --all lists every one"
    return (f"differs: settings the runs set unlike their config file's own values (budget, shape and batch "
            f"first{clipped}), from {'; '.join(wheres)}")


def _checkout_folders() -> list[Path]:
    """This checkout's runs/ and records/ that exist, named as seen from here (as run.sh names them: relative
    in the checkout, else whole); a SummaryError where there are none."""
    folders = [ROOT / name for name in ("runs", "records") if (ROOT / name).is_dir()]
    if not folders:
        raise SummaryError(f"no runs/ or records/ folder in {ROOT} yet; train first or name folders")
    return [f.relative_to(ROOT) for f in folders] if Path.cwd().resolve() == ROOT else folders


def main(argv: list[str] | None = None) -> int:
    """Command line: print the leaderboard of the summaries found under the given paths."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="run folders, summary.json files, or folders searched recursively "
                                             "(default: this checkout's runs/ and records/)")
    ap.add_argument("--target", type=float, default=None,
                    help="val loss target for the p-value (default: the runs' own target_loss; "
                         "time to target is always the runs' own)")
    ap.add_argument("--pool-seeds", action="store_true",
                    help="runs that differ only in train.seed / data.seed share a row")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for records/README.md)")
    ap.add_argument("--all", action="store_true", dest="show_all",
                    help="list every run id and every difference from the config file (default: clipped)")
    ap.add_argument("--plot", type=Path, metavar="FILE",
                    help="also draw each run's time to target and final val loss against the target (in the format "
                         "of its suffix: .png, .svg, .pdf ...)")
    args = ap.parse_args(argv)
    try:
        if args.plot:
            image_format(args.plot)  # a name it cannot write is refused before the table
        summaries = [load_summary(p) for p in find_summaries(args.paths or _checkout_folders())]
        rows = group_rows(summaries, args.target, args.pool_seeds, args.show_all)
    except (SummaryError, PlotError) as e:
        print(f"leaderboard: {e}", file=sys.stderr)
        return 2
    print(format_table(rows, args.markdown))
    print(("\n" if args.markdown else "") + reference_note(rows, args.show_all))
    if args.plot:
        plot_leaderboard([{"name": f"{r['config']} {r['fingerprint']}", "target": r["goal"],
                           "runs": r["summaries"]} for r in rows], args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
