"""A modded-nanogpt record's script and log, read as text: its code (a log opens with it, above a line of 100 "="),
its `Hyperparameters` dataclass (read, and rewritten field by field with the rest of the file left byte for byte),
the batch schedule and eval steps those fields give, and the lines its run logs.

The record's own rules, restated from its code: a step's tokens are `train_bs_schedule[int(len * step /
num_scheduled_iterations)]` before `num_scheduled_iterations` and `train_bs_extension` after; it evaluates at step 0,
every `val_loss_every` steps and after its last (`num_iterations`), and logs each as
`step:S/N val_loss:L train_time:Tms step_avg:Ams`, with T the synchronized training time, evals excluded.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

SEPARATOR = "=" * 100
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:\S+ms$", re.M)
STEP_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:\S+ms$", re.M)
PEAK_LINE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB$", re.M)
_ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: a / b}


class RecordError(ValueError):
    """A record's script or log that this harness cannot read; the message names the file and the fix."""


def record_code(path: Path) -> str:
    """The record's code: a log's text above its first line of 100 '=', or a .py file whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if SEPARATOR in lines:
        return "\n".join(lines[:lines.index(SEPARATOR)]) + "\n"
    if path.suffix == ".py":
        return text
    raise RecordError(f"{path}: no line of 100 '=' (a record's log has its code above one) and not a .py file: "
                      f"pass the record's log .txt or its train_gpt.py")


def _hyperparameters_class(code: str, path: Path) -> ast.ClassDef:
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise RecordError(f"{path}: its code does not parse as Python ({e.msg}, line {e.lineno}): a cut log?") from None
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters"]
    if not found:
        raise RecordError(f"{path}: no class Hyperparameters at the top level of its code: is it a record's script "
                          f"from 2024-11 on?")
    return found[0]


def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
    return {n.target.id: n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and n.value is not None}


def _value(node: ast.expr, known: dict[str, object]) -> object:
    """A field's default when it is plain arithmetic on literals and earlier fields; None otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(e, known) for e in node.elts]
        return None if None in items else (tuple(items) if isinstance(node, ast.Tuple) else items)
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand, known)
        return -inner if isinstance(inner, (int, float)) else None
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _value(node.left, known), _value(node.right, known)
        if isinstance(left, (int, float)) and isinstance(right, (int, float)):
            return _ARITHMETIC[type(node.op)](left, right)
    return None


def hyperparameters(code: str, path: Path) -> dict[str, object]:
    """Each Hyperparameters field and its default (None where it is not plain arithmetic, e.g. a uuid)."""
    known: dict[str, object] = {}
    for name, node in _fields(_hyperparameters_class(code, path)).items():
        known[name] = _value(node.value, known)
    return known


def rewrite(code: str, changes: dict[str, object], path: Path) -> str:
    """`code` with the defaults of the named Hyperparameters fields replaced by these values' reprs; every other
    character kept."""
    fields = _fields(_hyperparameters_class(code, path))
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise RecordError(f"{path}: its Hyperparameters have no field {', '.join(unknown)} (they have "
                          f"{', '.join(fields)}): this harness knows record 46's script and its neighbours")
    starts = [0]
    for line in code.splitlines(keepends=True):
        starts.append(starts[-1] + len(line.encode()))
    raw = code.encode()
    spans = sorted(((starts[n.value.lineno - 1] + n.value.col_offset, starts[n.value.end_lineno - 1]
                     + n.value.end_col_offset, name) for name, n in fields.items() if name in changes), reverse=True)
    for begin, end, name in spans:  # ast's offsets count UTF-8 bytes; from the end, so earlier ones stay valid
        raw = raw[:begin] + repr(changes[name]).encode() + raw[end:]
    return raw.decode()


def step_tokens(hp: dict, step: int) -> int:
    """The tokens of step `step` (0-based) by the record's batch schedule."""
    scheduled = hp["num_scheduled_iterations"]
    if step >= scheduled:
        return hp["train_bs_extension"]
    stages = hp["train_bs_schedule"]
    return stages[int(len(stages) * step / scheduled)]


def eval_steps(hp: dict) -> list[int]:
    """The steps after which the record evaluates: 0, every val_loss_every, and the last."""
    last, every = hp["num_iterations"], hp["val_loss_every"]
    return sorted({0, last, *(range(0, last, every) if every > 0 else ())})


@dataclass
class RecordRun:
    """What a record's log says of its run: each eval's (step, val loss, training ms), each step's training ms
    (not synchronized: the host's clock after it queued the step), its steps, its peak memory in MiB."""
    evals: list[tuple[int, float, int]] = field(default_factory=list)
    step_ms: dict[int, int] = field(default_factory=dict)
    steps: int | None = None
    peak_allocated_mib: int | None = None
    peak_reserved_mib: int | None = None


def parse_log(text: str) -> RecordRun:
    """The record's log lines below its code (a partial log gives what it has)."""
    lines = text.split("\n")
    body = "\n".join(lines[lines.index(SEPARATOR) + 1:]) if SEPARATOR in lines else text
    run = RecordRun()
    for m in VAL_LINE.finditer(body):
        run.evals.append((int(m[1]), float(m[3]), int(m[4])))
        run.steps = int(m[2])
    for m in STEP_LINE.finditer(body):
        run.step_ms[int(m[1])] = int(m[3])
        run.steps = int(m[2])
    if peak := PEAK_LINE.search(body):
        run.peak_allocated_mib, run.peak_reserved_mib = int(peak[1]), int(peak[2])
    return run
