"""Run configuration: TOML files in configs/ mapped onto dataclasses, plus command-line overrides.

Precedence, lowest first:
    dataclass defaults
    < the starter's recipe flags (--seq_len, --batch_size, --grad_accum_steps, --max_steps)
    < the config file            (--config configs/X.toml, after the files its `base` chain names)
    < its [[plan]] row for the run's budget (trainer/plans.py)
    < the starter's run flags    (--data_dir, --checkpoint_path, --time_limit_min)
    < --section.key=value overrides

trainer/starter.py says what each starter flag sets, and which config it picks when no --config is given.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from model.config import GPTConfig, Group, choices, elements_are, field_value, grouped, value_type
from optim.config import OptimConfig, check_qk_pairs
from trainer import ROOT, plans, starter
from util.optional import import_optional

@dataclass
class DataConfig:
    train: str = ""              # glob of training shards
    val: str = ""                # glob of validation shards, or "holdout": the last eval.tokens of the train data
    format: Literal["auto", "header", "raw"] = "auto"  # "auto": an llm.c header where a file starts with its magic
    raw_dtype: Literal["uint16", "uint32"] = "uint16"  # dtype of headerless files
    bos_aligned: bool = False    # start every sequence at a document boundary
    shuffle: bool = True         # windows in a seeded random order over all shards; false: each shard front to back
    shuffle_shards: int = 0      # shuffle within this many shards at a time, each set read ahead whole; 0 = all
    # with shuffle = false: every epoch reads the shards in their sorted order, as modded-nanogpt does; false: in
    # an order seeded by data.seed and the epoch
    sorted_shards: bool = False
    # with bos_aligned and shuffle = false: each row is documents in order, each cut at this many tokens (the rest
    # skipped), the last where the row is full, as record 46's rows are; 0 = rows of consecutive tokens
    doc_cut: int = 0
    seed: int = 0                # seeds the order of the shards and of the windows, per epoch
    vocab_check: bool = grouped(True, "neutral")  # refuse token ids >= model.vocab_size

    @property
    def holdout(self) -> bool:
        """Whether the val set is the tail of the train data (val = "holdout") rather than files of its own."""
        return self.val == "holdout"


@dataclass
class TrainConfig:
    batch_size: int = 8          # sequences per micro-step per rank
    seq_len: int = 1024          # tokens per training sequence
    grad_accum: int = 1          # micro-steps per optimizer step (one gradient sync each step)
    # a batch schedule: len(list) equal stages of the run's progress (the LR schedule's), stage k accumulating
    # batch_stages[k] x grad_accum micro-steps of the same shape; [] = grad_accum throughout
    batch_stages: list[int] = field(default_factory=list)
    # true: stage k's rows are batch_stages[k] x seq_len tokens long instead, in grad_accum micro-steps (record
    # 46's, one compiled shape per stage); needs data.shuffle = false, whose stream goes on at any row length
    batch_stage_rows: bool = False
    # each stage's LR multiplier, applied on top of the LR schedule's; [] = 1.0 in every stage
    batch_stage_lr: list[float] = field(default_factory=list)
    # the progress past which the second, third, ... stage's LR multiplier takes over; [] = where its batch stage
    # starts. Record 46 raises its rate a little before its batch: [0.33, 0.66] against thirds
    batch_stage_lr_at: list[float] = field(default_factory=list)
    # true: each step's mean loss is scaled by its batch stage's tokens over the first stage's, so that its gradient
    # grows with the batch as a loss summed over the tokens does (record 46's, up to a constant: optim.eps there)
    stage_loss_scale: bool = False
    parallel: Literal["ddp", "fsdp"] = "ddp"  # ignored in a single process
    # the dtype gradients are summed in across ranks (DDP's all-reduce, FSDP2's reduce-scatter); each rank still
    # adds up its micro-steps in fp32. "bfloat16" halves the bytes sent, rounding every gradient to bf16 on the way;
    # "storage" (DDP, under optim.bf16_storage) sends each in its weight's stored dtype, as record 46: bf16 for the
    # tables, head and gates, fp32 for the block matrices and scalars
    reduce_dtype: Literal["float32", "bfloat16", "storage"] = "float32"
    # when AdamW's gradients cross the ranks under DDP: "every_step", in DDP's buckets with the others (held ones
    # too, under optim.adam_every); "adam_steps", on AdamW's steps only, each rank adding up its own in between, sent
    # after the backward while Muon steps (record 46's). With "adam_steps" the logged gradient norm counts each
    # rank's own AdamW gradients, before they are averaged
    adam_sync: Literal["every_step", "adam_steps"] = "every_step"
    # wrap in DDP even in one process: rehearses the multi-GPU path (graph split, bucket hooks, collectives)
    ddp_always: bool = grouped(False, "speed")
    # torch.compile the model (under FSDP2: each block, and the head with the loss); on CPU it needs a C++ compiler
    compile: bool = grouped(False, "speed")
    dtype: Literal["bfloat16", "float32"] = "bfloat16"  # autocast dtype on GPU; CPU always runs fp32
    # under bf16 autocast, the residual stream, the head's logits and the training loss in bf16 too, as record 46's
    # bf16 weights make them (evals still score fp32 logits); CPU runs fp32, where it changes nothing
    bf16_stream: bool = False
    budget_s: float = grouped(0.0, "budget")  # training-time budget; 0 = none
    plan: bool = True            # apply the config file's [[plan]] row for budget_s; false: the file's own keys
    timing: Literal["from_first_forward", "exclude_warmup"] = "from_first_forward"
    # untimed compile warm-up steps (exclude_warmup), state restored after; under batch_stage_rows, this many of
    # each row length still ahead
    warmup_steps: int = grouped(0, "speed")
    max_steps: int = grouped(0, "budget")  # upper bound on steps; 0 = none
    # "time": the LR follows the elapsed budget fraction (or max_steps if reached first); "step": over max_steps
    schedule: Literal["time", "step"] = "time"
    # a step schedule's steps after max_steps, at its end's LR, batch stage and window (record 46: 40)
    extension_steps: int = 0
    lr_warmup_frac: float = 0.0  # first fraction of the run with a linear LR warm-up
    lr_decay_frac: float = 0.3   # final fraction of the run over which the LR decays linearly
    lr_final_frac: float = 0.0   # LR multiplier at the end of the decay
    # what lr_final_frac is a fraction of: "stage", the batch stage's LR (batch_stage_lr multiplies the whole
    # schedule); "base", the base LR: each stage's rate decays to the same floor (record 46's get_lr)
    lr_final_of: Literal["stage", "base"] = "stage"
    seed: int = 0                # torch seed of the initialisation (the same on every rank)
    checkpoint_path: str = grouped("", "run")  # "" = <run folder>/checkpoint.pt
    # also save checkpoint + resume state every N seconds; 0 = at the end only
    checkpoint_every_s: float = grouped(0.0, "run")
    # false = no checkpoint.pt and no resume state at the end, e.g. benchmarks/checks; a run that saved its state
    # is not resumed with it false
    save_checkpoint: bool = grouped(True, "run")
    # "auto": if the run folder has complete state; "never": refuse a folder that holds a run; "overwrite": start
    # afresh, replacing what the folder holds
    resume: Literal["auto", "never", "must", "overwrite"] = grouped("auto", "run")
    # a collective stuck this long (lost peer) fails the run instead of hanging
    dist_timeout_s: float = grouped(600.0, "run")
    # the same during the untimed warm-up steps, which compile (exclude_warmup): a rank still compiling its first
    # graphs must not time out the ranks that wait for it in the first collective
    warmup_timeout_s: float = grouped(1800.0, "run")

    @property
    def steps(self) -> int:
        """The steps the run takes at most: max_steps, then a step schedule's extension_steps (0 = no cap)."""
        return self.max_steps + self.extension_steps if self.max_steps else 0

    def stage_shapes(self) -> list[tuple[int, int]]:
        """Each batch stage's (micro-steps, tokens per row) ([(grad_accum, seq_len)] without batch_stages)."""
        if self.batch_stage_rows:
            return [(self.grad_accum, self.seq_len * n) for n in self.batch_stages or [1]]
        return [(self.grad_accum * n, self.seq_len) for n in self.batch_stages or [1]]

    def tokens_by_stage(self, world_size: int) -> list[int]:
        """Training tokens of a step in each batch stage, over `world_size` ranks."""
        return [world_size * self.batch_size * micro_steps * row for micro_steps, row in self.stage_shapes()]

    def loss_scales(self) -> list[float]:
        """What each batch stage's mean loss is multiplied by before its backward: under stage_loss_scale its
        tokens over the first stage's (a loss summed over the tokens, record 46's, grows so), else 1."""
        tokens = self.tokens_by_stage(1)
        return [t / tokens[0] if self.stage_loss_scale else 1.0 for t in tokens]

    @property
    def longest_row(self) -> int:
        """The longest row any stage trains on."""
        return max(row for _, row in self.stage_shapes())

    @property
    def evals_on_clock(self) -> bool:
        """Whether evals take time from the budget: the hackathon's clock runs from the first forward through them."""
        return self.timing == "from_first_forward"


@dataclass
class EvalConfig:
    every_steps: int = grouped(0, "eval")  # 0 = only at the end
    every_s: float = grouped(0.0, "eval")  # on the training clock; 0 = off
    at_start: bool = grouped(False, "eval")  # also before the first step (the records' eval at step 0)
    tokens: int = 1 << 20        # validation targets scored per eval (the data needs one token more)
    seq_len: int = 0             # tokens per eval sequence; 0 = train.seq_len; longer needs model.rotary
    batch_size: int = grouped(0, "neutral")  # 0 = train.batch_size
    target_loss: float = 0.0     # 0 = none
    stop_at_target: bool = False # stop training once the val loss reaches target_loss
    # the time to target: "first_eval", the clock at the first eval at or below target_loss; "end", the run's
    # training time if its final eval is (the speedrun records' measure: a fixed schedule, scored at its end)
    target_time: Literal["first_eval", "end"] = "first_eval"
    # > 0: the final eval's L layers attend this many tokens, its S layers and YaRN take the run's last window,
    # model.window (record 46: 2,560, with 768 and YaRN at 1,664); 0 = the last step's window
    final_window: int = 0


@dataclass
class LogConfig:
    dir: str = grouped("runs", "run")  # parent folder of the run folders
    # "" = <config name>-<torchrun run id, else timestamp-pid>; fix it to resume by name
    run_id: str = grouped("", "run")
    track: str = grouped("cpu", "neutral")  # leaderboard label: cpu | speedrun | hackathon | ...
    every_steps: int = grouped(10, "run")  # one console line and metrics.jsonl record every N steps
    wandb: bool = grouped(False, "run")  # also log to Weights & Biases (WANDB_MODE=offline|disabled need no network)
    wandb_project: str = grouped("shardrun", "run")  # wandb project
    wandb_run: str = grouped("", "run")  # "" = run_id


SECTIONS: dict[str, type] = {"data": DataConfig, "model": GPTConfig, "optim": OptimConfig,
                             "train": TrainConfig, "eval": EvalConfig, "log": LogConfig}


def keys_in(*groups: Group) -> frozenset[str]:
    """The "section.key" names of the fields in one of `groups`."""
    return frozenset(f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                     if f.metadata.get("group") in groups)


# the keys a resume may change; every other key, including one added later, refuses the resume
RESUME_SAFE = keys_in("run", "neutral", "eval", "speed")
RESUME_BUDGET = keys_in("budget")  # changed on resume only with --extend-budget


class Change(NamedTuple):
    """A key a resume changed (check_resume allowed it): its dotted name, saved value and new value."""
    key: str
    saved: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key}: saved {self.saved!r}, now {self.now!r}"


class ConfigError(ValueError):
    """A config file or override that does not match the dataclasses; the message names key and fix."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    name: str = "default"        # the config file's stem; not a section, not saved in config.toml
    starter: str = ""            # which starter flags were applied and which overridden ("" = none given)
    plan: str = ""               # which [[plan]] row the budget picked, and its keys ("" = none applied)
    extend_budget: bool = False  # --extend-budget: a resume may change RESUME_BUDGET keys; not saved either
    # "section.key" of every key a config file, a starter flag or an override set: the others hold their defaults
    given: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections as a plain dict (what config.toml and checkpoint["config"] hold). train.resume's "overwrite"
        and "must" (--overwrite, --resume) are this launch's, saved as "auto": a run's config.toml launched again
        (a record rerun from it) must not delete the run it names, nor refuse to start where that run is absent."""
        sections = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        if self.train.resume in ("overwrite", "must"):
            sections["train"]["resume"] = "auto"
        return sections

    @property
    def eval_shape(self) -> tuple[int, int]:
        """(rows, tokens) of an eval batch: eval.batch_size and eval.seq_len, 0 meaning the training shape's."""
        return self.eval.batch_size or self.train.batch_size, self.eval.seq_len or self.train.seq_len

    @property
    def compiled_keys(self) -> list[str]:
        """The keys that are on and have inductor compile: what a CPU without a C++ toolchain cannot run."""
        keys = {"train.compile": self.train.compile, "optim.muon_compile": self.optim.muon_compile}
        return [key for key, on in keys.items() if on]

    @property
    def holdout_tokens(self) -> int:
        """The tokens at the end of the train data that are the val set (eval.tokens under data.val = "holdout"),
        which training leaves out; 0 where the val set has files of its own."""
        return self.eval.tokens if self.data.holdout else 0


def _check_value(section: str, key: str, value: Any, hint: Any, where: str) -> Any:
    """Return `value` converted to the field's type, or raise naming the key and the expected type (or values)."""
    try:
        typed = field_value(hint, value)
    except TypeError as e:
        raise ConfigError(f"{where}: {section}.{key} must be {e}, got {value!r} ({type(value).__name__})") from None
    allowed = choices(hint)
    if allowed and typed not in allowed:
        raise ConfigError(f"{where}: {section}.{key} = {typed!r} is not one of {', '.join(allowed)}")
    return typed


def _apply(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    """Set cfg.<section>.<key> = value after checking that the key exists and the type fits."""
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section [{section}]; valid sections: {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(SECTIONS[section])
    fields = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if key not in fields:
        raise ConfigError(f"{where}: unknown key {section}.{key}; valid keys in [{section}]: {', '.join(fields)}")
    setattr(getattr(cfg, section), key, _check_value(section, key, value, hints[key], where))


def apply_file(cfg: Config, path: str | Path) -> set[str]:
    """Apply a TOML config file to `cfg`, its base first (see `config_chain`); return the keys set ("section.key")."""
    keys = set()
    for file, doc in config_chain(Path(path)):
        for section, table in doc.items():
            if section == "plan":  # rows for shorter budgets (trainer/plans.py), applied by parse_args
                continue
            for key, value in table.items():
                _apply(cfg, section, key, value, str(file))
                keys.add(f"{section}.{key}")
    return keys


def file_plans(path: str | Path) -> list[dict[str, Any]]:
    """The [[plan]] rows of a config file, or of the nearest base that has them, each key checked as a file's is."""
    for file, doc in reversed(config_chain(Path(path))):
        if "plan" in doc:
            try:
                rows = plans.read_plans(file, doc["plan"])
            except plans.PlanError as e:
                raise ConfigError(str(e)) from None
            for i, row in enumerate(rows, 1):
                for dotted, value in row["keys"].items():
                    _apply(Config(), *dotted.split(".", 1), value, f"{file}: [[plan]] up to {row['up_to_s']:g} s")
            return rows
    return []


def config_chain(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """`path` and the files its `base` keys name, farthest base first, each with its sections.

    `base = "other.toml"` (top level, a path relative to the file's folder) applies that file's sections before
    this file's; a base may have a base. A missing base or a cycle is an error naming the files.
    """
    chain = [(path, _read_config(path, named_by=None))]
    while (base := chain[-1][1].pop("base", None)) is not None:
        named_by = chain[-1][0]
        if not isinstance(base, str):
            raise ConfigError(f"{named_by}: base = {base!r} must be a file name, e.g. base = \"speedrun_8xh100.toml\" "
                              f"(a path relative to {named_by.parent})")
        path = named_by.parent / base
        if path.resolve() in [file.resolve() for file, _ in chain]:
            cycle = " -> ".join(str(file) for file in [*[file for file, _ in chain], path])
            raise ConfigError(f"{named_by}: base = {base!r} closes a cycle ({cycle}); remove one of these bases")
        chain.append((path, _read_config(path, named_by=named_by)))
    return chain[::-1]


def _read_config(path: Path, named_by: Path | None) -> dict[str, Any]:
    """One config file's top-level table (its sections and `base`); `named_by` is the file whose base it is."""
    try:
        text = path.read_text()
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a config file ({'a folder' if path.is_dir() else f'not UTF-8 text: {e}'}); "
                          f"name a .toml file") from None
    except FileNotFoundError:
        if named_by is not None:
            known = ", ".join(sorted(p.name for p in path.parent.glob("*.toml"))) or "none"
            raise ConfigError(f"{named_by}: base {path} not found (a base is a path relative to the file that names "
                              f"it; config files there: {known})") from None
        known = ", ".join(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.toml")))
        raise ConfigError(f"{path}: config file not found; available: {known}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    for section, table in doc.items():
        if not isinstance(table, dict) and section not in ("base", "plan"):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] (or base = \"file.toml\", or "
                              f"[[plan]] rows); valid sections: {', '.join(SECTIONS)}")
    return doc


def parse_value(text: str) -> Any:
    """A command-line value read as a TOML value (0.01, true, [1, 2], "x"), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(cfg: Config, dotted: str, text: str) -> None:
    """Apply one `--section.key=value` override (strings need no quotes)."""
    section, _, key = dotted.partition(".")
    if not key:
        raise ConfigError(f"command line: --{dotted} is not --section.key=value; "
                          f"valid sections: {', '.join(SECTIONS)}")
    value = parse_value(text)
    if section in SECTIONS and value_type(typing.get_type_hints(SECTIONS[section]).get(key)) is str:
        value = value if isinstance(value, str) else text  # --log.run_id=123 means the string "123"
    _apply(cfg, section, key, value, "command line")


def _argparser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a GPT (see train.py's docstring).", allow_abbrev=False,
                                epilog=overrides_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file in configs/")
    p.add_argument("--resume", action="store_true", help="continue the run in log.run_id (train.resume = must)")
    p.add_argument("--overwrite", action="store_true",
                   help="start the run in log.run_id afresh, replacing what its folder holds "
                        "(train.resume = overwrite)")
    p.add_argument("--extend-budget", action="store_true",
                   help="resume the run although train.budget_s or train.max_steps changed (see README)")
    starter.add_flags(p)
    return p


def overrides_help() -> str:
    """--help's account of the --section.key=value overrides: every section's keys, defaults and comments."""
    lines = ["overrides: --section.key=value (or --section.key value), applied after the config file; the value is",
             "read as TOML (0.01, true, [1, 2], \"x\"), and a string needs no quotes. The sections, their keys and",
             "defaults (the README's Configuration section says more):"]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]"]
        defaults, notes, hints = cls(), _field_comments(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            setting = f"{f.name} = {json.dumps(getattr(defaults, f.name))}"  # JSON's literals here are TOML's
            allowed = choices(hints[f.name])
            note = notes.get(f.name) or ("one of " + ", ".join(map(json.dumps, allowed)) if allowed else "")
            lines.append(f"  {setting:<34} {note}".rstrip())
    return "\n".join(lines)


def _field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the dataclass's source: the comment on the field's line, else the lines above."""
    notes, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        code, _, comment = line.strip().partition("# ")
        if not code:
            above = [*above, comment] if comment else []
        elif match := re.match(r"(\w+): ", code):
            notes[match.group(1)] = comment.strip() or " ".join(above)
            above = []
    return notes


def _split_overrides(rest: list[str]) -> list[tuple[str, str]]:
    """['--a.b=1', '--c.d', '2'] -> [('a.b', '1'), ('c.d', '2')]."""
    pairs, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"command line: unexpected argument {arg!r}; use --section.key=value "
                              f"(sections: {', '.join(SECTIONS)}) or see --help")
        if "=" in arg:
            key, _, value = arg[2:].partition("=")
            i += 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            key, value = arg[2:], rest[i + 1]
            i += 2
        else:
            raise ConfigError(f"command line: {arg} has no value; write {arg}=VALUE")
        pairs.append((key, value))
    return pairs


def parse_args(argv: list[str]) -> Config:
    """Build the run's Config from command-line arguments (see the module docstring for precedence)."""
    args, rest = _argparser().parse_known_args(argv)
    overrides = _split_overrides(rest)
    flags = starter.given(args)
    path = args.config or starter.default_config(flags)
    cfg, from_file = Config(), set()
    _apply_starter(cfg, flags, recipe=True)  # the starter's generic recipe, below the file
    if path is not None:
        from_file = apply_file(cfg, path)
        cfg.name = Path(path).stem
    _apply_starter(cfg, flags, recipe=False)  # its run flags, above the file
    if args.resume and args.overwrite:
        raise ConfigError("command line: --resume continues the run in log.run_id, --overwrite replaces it; pass one")
    if args.resume or args.overwrite:
        cfg.train.resume = "must" if args.resume else "overwrite"
    cfg.extend_budget = args.extend_budget
    for key, value in overrides:
        apply_override(cfg, key, value)
    run_flags = {key for flag, keys in flags.items() if flag not in starter.RECIPE for key in keys}
    command_line = {key for key, _ in overrides} | run_flags
    rows = file_plans(path) if path is not None and cfg.train.plan else []
    plan = plans.pick(rows, cfg.train.budget_s)
    if plan:  # over the file's keys, under the command line's
        for dotted, value in plan["keys"].items():
            if dotted not in command_line:
                _apply(cfg, *dotted.split(".", 1), value, f"{path}: [[plan]] up to {plan['up_to_s']:g} s")
        cfg.plan = plans.describe(plan, cfg.train.budget_s, command_line)
    elif rows and cfg.train.budget_s > 0:
        values = {f"{section}.{key}": getattr(getattr(cfg, section), key)
                  for section, key in (dotted.split(".", 1) for row in rows for dotted in row["keys"])}
        cfg.plan = plans.beyond(rows, cfg.train.budget_s, values)
    cfg.given = frozenset({*from_file, *(key for key, _ in overrides), *(k for keys in flags.values() for k in keys),
                           *(plan["keys"] if plan else ())})
    validate(cfg)
    if flags:
        cfg.starter = starter.report(cfg, args, flags, path, from_file, {key for key, _ in overrides})
    return cfg


def _apply_starter(cfg: Config, flags: dict[str, dict[str, Any]], *, recipe: bool) -> None:
    """Apply the keys of the starter `flags` that are its recipe flags (`recipe`) or its run flags (not `recipe`)."""
    for flag, keys in flags.items():
        if (flag in starter.RECIPE) == recipe:
            for dotted, value in keys.items():
                _apply(cfg, *dotted.split("."), value, f"--{flag}")


def validate(cfg: Config) -> None:
    """Refuse combinations that cannot run, naming the keys to change."""
    train = cfg.train
    try:  # the model's and optimizer's own checks, on copies (vocab_size 0 is resolved later, from meta.json)
        dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or 1)
        dataclasses.replace(cfg.optim)
        if cfg.optim.name == "muon" and cfg.optim.muon_qk_pairs:
            check_qk_pairs(cfg.model.n_head)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cfg.data.train:
        raise ConfigError("data.train is empty: set it to a glob of token shards (or pass --data_dir)")
    if cfg.data.sorted_shards and cfg.data.shuffle:
        raise ConfigError("data.sorted_shards reads each shard front to back in sorted order, but data.shuffle = "
                          "true shuffles the windows over all shards; set data.shuffle = false or data.sorted_shards "
                          "= false")
    if cfg.data.doc_cut > 0 and (cfg.data.shuffle or not cfg.data.bos_aligned):
        raise ConfigError(f"data.doc_cut = {cfg.data.doc_cut} cuts documents inside rows read in order from a BOS: "
                          f"set data.bos_aligned = true and data.shuffle = false, or data.doc_cut = 0")
    if train.budget_s < 0:
        raise ConfigError(f"train.budget_s = {train.budget_s} is negative; give seconds > 0 (or 0 for no budget "
                          f"with train.schedule = 'step')")
    if train.schedule == "time" and train.budget_s <= 0:
        raise ConfigError("train.schedule = 'time' needs train.budget_s > 0 (or set train.schedule = 'step')")
    if train.schedule == "step" and train.max_steps <= 0:
        raise ConfigError("train.schedule = 'step' needs train.max_steps > 0")
    if train.extension_steps and train.schedule != "step":
        raise ConfigError(f"train.extension_steps = {train.extension_steps} extends a step schedule past its end: "
                          f"set train.schedule = 'step' (with train.max_steps), or train.extension_steps = 0")
    cooldown = cfg.optim.muon_momentum_cooldown_steps
    if cooldown and train.schedule != "step":
        raise ConfigError(f"optim.muon_momentum_cooldown_steps = {cooldown} cools Muon's momentum over the run's "
                          f"last steps, which only a step schedule knows: set train.schedule = 'step' (with "
                          f"train.max_steps), or the cooldown to 0")
    # a zero dist_timeout_s would fail every collective at once; negative counts or periods mean nothing
    positive = ["train.batch_size", "train.seq_len", "train.grad_accum", "train.dist_timeout_s",
                "train.warmup_timeout_s", "eval.tokens"]
    not_negative = ["train.max_steps", "train.extension_steps", "train.warmup_steps", "train.checkpoint_every_s",
                    "eval.every_s", "eval.every_steps", "eval.batch_size", "eval.seq_len", "eval.final_window",
                    "data.shuffle_shards", "data.doc_cut", "log.every_steps"]
    for dotted in positive + not_negative + ["data.seed"]:
        section, key = dotted.split(".")
        value, floor = getattr(getattr(cfg, section), key), 0 if dotted in positive else -1
        if value <= floor:
            rule = "> 0" if floor == 0 else ">= 0 (0 = off)" if dotted in not_negative else ">= 0"
            raise ConfigError(f"{dotted} must be {rule}, got {value}")
    for section, values in cfg.to_dict().items():  # nan or inf would silently never stop, or never decay
        for key, value in values.items():
            if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, list)
                                                                          else [value])):
                raise ConfigError(f"{section}.{key} = {value} must hold finite numbers only")
    check_batch_stages(train)
    if train.batch_stage_rows and not train.batch_stages:
        raise ConfigError("train.batch_stage_rows = true lengthens each batch stage's rows, and train.batch_stages = "
                          "[] has no stages: give train.batch_stages (e.g. [1, 2, 3]) or set "
                          "train.batch_stage_rows = false")
    if train.stage_loss_scale and not train.batch_stages:
        raise ConfigError("train.stage_loss_scale = true scales each step's loss by its batch stage's tokens, and "
                          "train.batch_stages = [] has one stage: give train.batch_stages (e.g. [1, 2, 3]) or set "
                          "train.stage_loss_scale = false")
    if train.batch_stage_rows and cfg.data.shuffle:
        raise ConfigError("train.batch_stage_rows = true lengthens the rows stage by stage, and the shuffled stream's "
                          "slots have one length: set data.shuffle = false (the shards front to back), or "
                          "train.batch_stage_rows = false (longer stages in more micro-steps)")
    micro_steps = max(m for m, _ in train.stage_shapes())
    if train.reduce_dtype == "bfloat16" and train.parallel == "fsdp" and micro_steps > 1:
        # FSDP2 keeps an unsynced micro-step's gradient in its reduce dtype (MixedPrecisionPolicy's rule)
        raise ConfigError(f"train.reduce_dtype = 'bfloat16' under train.parallel = 'fsdp' would add up the "
                          f"{micro_steps} micro-steps of a step in bf16, since FSDP2 accumulates unsynced gradients "
                          f"in its reduce dtype; use train.parallel = 'ddp' (it accumulates in fp32 and sends bf16), "
                          f"train.grad_accum = 1 without train.batch_stages, or train.reduce_dtype = 'float32'")
    if train.reduce_dtype == "storage" and train.parallel != "ddp":
        raise ConfigError(f"train.reduce_dtype = 'storage' sends each gradient in the dtype its weight is stored in, "
                          f"through a hook on DDP's buckets, and train.parallel = {train.parallel!r} has none: set "
                          f"train.parallel = 'ddp', or train.reduce_dtype = 'float32' or 'bfloat16'")
    if train.reduce_dtype == "storage" and not cfg.optim.bf16_storage:
        raise ConfigError("train.reduce_dtype = 'storage' sends each gradient in the dtype its weight is stored in, "
                          "and without optim.bf16_storage every weight is stored in fp32: set optim.bf16_storage = "
                          "true, or train.reduce_dtype = 'float32' or 'bfloat16'")
    if train.adam_sync == "adam_steps" and (train.parallel != "ddp" or cfg.optim.name != "muon"
                                            or cfg.optim.grad_clip > 0):
        raise ConfigError(f"train.adam_sync = 'adam_steps' sends AdamW's gradients apart from DDP's, while Muon steps: "
                          f"it needs train.parallel = 'ddp' (got {train.parallel!r}), optim.name = 'muon' (got "
                          f"{cfg.optim.name!r}) and optim.grad_clip = 0 (got {cfg.optim.grad_clip}: the clip would "
                          f"read them before they are averaged); or set train.adam_sync = 'every_step'")
    if train.ddp_always and train.parallel != "ddp":
        raise ConfigError(f"train.ddp_always = true wraps even one process in DDP, and train.parallel = "
                          f"{train.parallel!r} shards with FSDP2 over several processes and wraps one in nothing: set "
                          f"train.parallel = 'ddp' or train.ddp_always = false")
    if train.warmup_steps and train.timing != "exclude_warmup":
        raise ConfigError(f"train.warmup_steps = {train.warmup_steps} runs untimed steps before the clock starts, "
                          f"which only train.timing = 'exclude_warmup' does, and train.timing = {train.timing!r} "
                          f"times every step from the first forward: set train.timing = 'exclude_warmup' or "
                          f"train.warmup_steps = 0")
    if train.bf16_stream and train.dtype != "bfloat16":
        raise ConfigError(f"train.bf16_stream = true keeps the residual stream and the logits in bf16 under bf16 "
                          f"autocast, and train.dtype = {train.dtype!r} runs none: set train.dtype = 'bfloat16' or "
                          f"train.bf16_stream = false")
    for key in ("lr_warmup_frac", "lr_decay_frac", "lr_final_frac"):
        if not 0 <= getattr(train, key) <= 1:
            raise ConfigError(f"train.{key} = {getattr(train, key)} must lie in [0, 1]")
    if not 0 <= train.lr_warmup_frac + train.lr_decay_frac <= 1:
        raise ConfigError("train.lr_warmup_frac + train.lr_decay_frac must lie in [0, 1]")
    if train.longest_row > cfg.model.block_size:
        rows = (f"train.seq_len x max(train.batch_stages) = {train.longest_row} (train.batch_stage_rows)"
                if train.batch_stage_rows else f"train.seq_len = {train.seq_len}")
        raise ConfigError(f"{rows} is longer than model.block_size = {cfg.model.block_size}; raise model.block_size "
                          f"or lower train.seq_len")
    rows = train.batch_size * train.seq_len  # a stage's rows under batch_stage_rows are multiples of these
    if cfg.model.fp8_head and rows % 16:
        raise ConfigError(f"model.fp8_head = true: the head's backward multiplies over a micro-step's tokens, "
                          f"train.batch_size x train.seq_len = {rows}, through torch._scaled_mm, whose CUDA kernels "
                          f"need a multiple of 16; change either, or set model.fp8_head = false")
    block = cfg.model.block_size
    if not cfg.model.rotary and cfg.eval.seq_len > block:
        raise ConfigError(f"eval.seq_len = {cfg.eval.seq_len} is longer than model.block_size = {block}, the size of "
                          f"the learned position table (model.rotary = false); lower eval.seq_len to at most {block}, "
                          f"raise model.block_size or use model.rotary = true")
    if cfg.eval.target_time == "end" and cfg.eval.stop_at_target:
        raise ConfigError("eval.target_time = 'end' times the whole run, scored by its final eval, and "
                          "eval.stop_at_target = true would stop it at the first eval at the target: set one of "
                          "eval.stop_at_target = false or eval.target_time = 'first_eval'")
    if cfg.eval.final_window and not cfg.model.window:
        raise ConfigError(f"eval.final_window = {cfg.eval.final_window} widens the final eval's windowed layers, and "
                          f"model.window = 0 attends everywhere: set eval.final_window = 0")
    if cfg.log.run_id and (Path(cfg.log.run_id).name != cfg.log.run_id or cfg.log.run_id.startswith(".")):
        raise ConfigError(f"log.run_id = {cfg.log.run_id!r} must be a plain folder name (no '/')")


def check_batch_stages(train: TrainConfig) -> None:
    """Refuse a batch schedule whose stages are not positive whole multiples, or whose LR multipliers are not one
    positive number per stage."""
    stages, stage_lr = train.batch_stages, train.batch_stage_lr
    if not (elements_are(stages, int) and all(n > 0 for n in stages)):
        raise ConfigError(f"train.batch_stages = {stages} must hold positive integers, each stage's micro-steps as "
                          f"a multiple of train.grad_accum, e.g. [1, 2, 3] (or [] for no batch schedule)")
    if not (elements_are(stage_lr, int, float) and all(m > 0 for m in stage_lr)):
        raise ConfigError(f"train.batch_stage_lr = {stage_lr} must hold positive numbers, each stage's LR "
                          f"multiplier, e.g. [1.0, 1.52, 1.73] (or [] for 1.0 in every stage)")
    if stage_lr and len(stage_lr) != len(stages):
        raise ConfigError(f"train.batch_stage_lr = {stage_lr} must give one LR multiplier for each stage of "
                          f"train.batch_stages = {stages}, or be [] for 1.0 in every stage")
    starts = train.batch_stage_lr_at
    if starts and not (stage_lr and len(starts) == len(stages) - 1 and elements_are(starts, int, float)
                       and 0 < starts[0] and all(a < b for a, b in zip(starts, [*starts[1:], 1]))):
        raise ConfigError(f"train.batch_stage_lr_at = {starts} must give, for train.batch_stage_lr = {stage_lr}, "
                          f"the progress at which each stage after the first takes over, rising within (0, 1), "
                          f"e.g. [0.33, 0.66] for three stages (or [] for where the batch stages start)")


def resume_changes(saved: dict[str, dict[str, Any]], cfg: Config) -> tuple[list[Change], list[Change]]:
    """The keys `cfg` changes from the config `saved` with a resume state: (allowed, refused), as check_resume
    judges them."""
    defaults, changes, refused = Config().to_dict(), [], []
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key, defaults[section][key])
            if old == value:
                continue
            change = Change(f"{section}.{key}", old, value)
            if change.key in RESUME_SAFE or (change.key in RESUME_BUDGET and cfg.extend_budget):
                changes.append(change)
            else:
                refused.append(change)
    return changes, refused


def check_resume(saved: dict[str, dict[str, Any]], cfg: Config, where: str) -> list[Change]:
    """Refuse to resume the state saved under `saved` with `cfg` if a key outside RESUME_SAFE changed (or one
    of RESUME_BUDGET without cfg.extend_budget); return the allowed changes.

    A key the saved config lacks (added to the code since) counts as its default; a key the code no longer has
    is ignored. `where` names the saved run in the error.
    """
    changes, refused = resume_changes(saved, cfg)
    if refused:
        lines = [f"  {change}" + (" (or pass --extend-budget to train the saved run longer)"
                                  if change.key in RESUME_BUDGET else "") for change in refused]
        saved_args = " ".join(shlex.quote(f"--{change.key}={_arg_text(change.saved)}") for change in refused)
        raise ConfigError("\n".join([
            f"{where}: the run's resume state was saved under another config, and these keys decide the model, "
            f"the data stream, the optimizer state or the schedule:", *lines,
            f"Either start a new run (another --log.run_id) or resume with the saved values ({saved_args}); "
            f"nothing in {where} was changed"]))
    return changes


def _arg_text(value: Any) -> str:
    """`value` as --section.key=VALUE text that apply_override reads back equal."""
    return value if isinstance(value, str) else json.dumps(value)  # JSON numbers, booleans, lists are TOML


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """The sections as TOML text (tomllib reads it back equal)."""
    return import_optional("tomli_w", "writing config.toml", ConfigError).dumps(sections)
