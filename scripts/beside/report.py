"""The side-by-side report of `python -m scripts.bench.beside_record`, from what both sides left in its work folder:
work/record/ (the record's logs/*.txt, probe.json, standin.json) and work/ours/ (run/ as train.py writes it,
probe.json). Writes table.md, beside.json, loss.png and both logs (the record's without its code: its sha256 and
length stand for it) to the output folder, and returns table.md's text.

tokens/s count the same timed steps on both sides: from the first shared eval after step 0 to the last, each side's
training time between them (its evals excluded: both stop their clocks for them).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from scripts.beside.record_script import SEPARATOR, RecordRun, parse_log, step_tokens
from scripts.beside.side_probe import ORDER
from trainer.plots import _figure, _save, read_run
from util.atomic import write_json, write_text

# Record 46's bm_sizes: 10 of its 12 blocks attend, each call building its mask on the stand-in
RECORD_ATTENTION_CALLS = 10
RECORD_MICRO_STEPS = 8
# FlashAttention 3 saved record 46 4.3 s of ~168 s against FlexAttention (its README): the record's own tokens/s
# would be this much higher than on the stand-in's FlexAttention
FA3_SPEEDUP = 168 / (168 - 4.3)


def record_log(work: Path) -> Path | None:
    """The newest log the record's script wrote (logs/<run id>.txt in its working folder)."""
    logs = sorted((work / "record" / "logs").glob("*.txt"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def without_code(text: str) -> str:
    """A record log with its code (above the first line of 100 '=') replaced by its sha256 and length."""
    lines = text.split("\n")
    if SEPARATOR not in lines:
        return text
    cut = lines.index(SEPARATOR)
    code = "\n".join(lines[:cut]) + "\n"
    digest = hashlib.sha256(code.encode()).hexdigest()
    return f"(the record's code, {cut} lines, sha256 {digest}: not kept here)\n" + "\n".join(lines[cut:])


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def window(shared: list[int]) -> tuple[int, int] | None:
    """The timed steps both sides count: (first shared eval after step 0, last); None with fewer than two. Step 0
    starts none: the warm-up's first steps and the profiled ones come after it."""
    later = [s for s in shared if s > 0]
    return (later[0], later[-1]) if len(later) > 1 else None


def speeds(hp: dict, rec: RecordRun, ours: dict[int, dict], span: tuple[int, int]) -> dict:
    """Tokens, seconds and tokens/s of each side over the steps of `span`."""
    s0, s1 = span
    rec_ms = {step: ms for step, _, ms in rec.evals}
    rec_tokens = sum(step_tokens(hp, s) for s in range(s0, s1))
    rec_s = (rec_ms[s1] - rec_ms[s0]) / 1000
    our_tokens, our_s = ours[s1]["tokens"] - ours[s0]["tokens"], ours[s1]["elapsed_s"] - ours[s0]["elapsed_s"]
    return {"steps": [s0, s1],
            "record": {"tokens": rec_tokens, "s": rec_s, "tok_s": rec_tokens / rec_s if rec_s else None},
            "ours": {"tokens": our_tokens, "s": our_s, "tok_s": our_tokens / our_s if our_s else None}}


def mask_cost(hp: dict, standin: dict, span: tuple[int, int] | None, record_s: float | None) -> dict | None:
    """What the stand-in's block-mask builds cost the record's steps of `span`: per step at each micro-batch size
    (a build per attention call of each micro-step), in all, and as a share of the record's time over them."""
    if not standin.get("mask_ms") or span is None:
        return None
    per_step = {int(n): RECORD_MICRO_STEPS * RECORD_ATTENTION_CALLS * ms for n, ms in standin["mask_ms"].items()}
    total = sum(per_step.get(step_tokens(hp, s) // RECORD_MICRO_STEPS, 0.0) for s in range(*span)) / 1000
    return {"ms_per_step": per_step, "s": total, "share": total / record_s if record_s else None}


def ratio(ours: float | None, record: float | None) -> float | None:
    """ours / record, where both were measured."""
    return ours / record if ours and record else None


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def loss_png(out: Path, rec: RecordRun, ours: dict[int, dict]) -> Path:
    """Both sides' val loss against the step, on one axis."""
    fig, (ax,) = _figure(1)
    for label, points, style in (("record's script (FlexAttention stand-in)", [(s, v) for s, v, _ in rec.evals], "o-"),
                                 ("ours (train.py)", [(s, r["val_loss"]) for s, r in sorted(ours.items())], "s-")):
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.set_title("the record's script beside ours on one GPU: the same shards, steps, tokens and val set")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / "loss.png")


def results(work: Path, hp: dict, plan_lines: list[str], status: dict[str, str]) -> tuple[dict, RecordRun, dict]:
    """beside.json's values from both sides' folders, with the record's parsed log and our evals by step."""
    log = record_log(work)
    rec = parse_log(log.read_text(errors="replace")) if log else RecordRun()
    ours_dir = work / "ours" / "run"
    ours = {r["step"]: r for r in read_run(ours_dir).evals} if (ours_dir / "metrics.jsonl").is_file() else {}
    rec_val = {step: loss for step, loss, _ in rec.evals}
    shared = sorted(set(rec_val) & set(ours))
    span = window(shared)
    speed = speeds(hp, rec, ours, span) if span else None
    standin = _json(work / "record" / "standin.json")
    res = {"status": status, "plan": plan_lines, "shared_evals": [
        {"step": s, "record": rec_val[s], "ours": ours[s]["val_loss"], "delta": ours[s]["val_loss"] - rec_val[s]}
        for s in shared], "span": span, "speed": speed,
        "probes": {side: _json(work / side / "probe.json") for side in ("record", "ours")}, "standin": standin,
        "mask": mask_cost(hp, standin, span, speed["record"]["s"] if speed else None), "fa3_speedup": FA3_SPEEDUP}
    return res, rec, ours


def table_text(res: dict) -> str:
    """table.md: the plan, the shared evals, the measures and their ratios, the stand-in's figures, the kernels."""
    speed, span, probes, mask, standin = res["speed"], res["span"], res["probes"], res["mask"], res["standin"]
    lines = [*res["plan"], "", f"status: {', '.join(f'{k} {v}' for k, v in res['status'].items()) or 'report only'}",
             "", "| step | record val loss | ours | Δ (ours − record) |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['record']:.4f} | {r['ours']:.4f} | {r['delta']:+.4f} |" for r in res["shared_evals"]]
    rec_tok, our_tok = (speed["record"]["tok_s"], speed["ours"]["tok_s"]) if speed else (None, None)
    rows = [("tokens/s" + (f" (steps {span[0]}–{span[1]})" if span else ""), rec_tok, our_tok, ",.0f"),
            ("compile s", probes["record"].get("compile_s"), probes["ours"].get("compile_s"), ".1f"),
            ("peak allocated MiB", probes["record"].get("peak_allocated_mib"),
             probes["ours"].get("peak_allocated_mib"), ",.0f")]
    lines += ["", "| measure | record | ours | ours / record |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {_fmt(r, spec)} | {_fmt(o, spec)} | {_fmt(ratio(o, r), '.3f')} |"
              for name, r, o, spec in rows]
    measured = ratio(our_tok, rec_tok)
    lines += ["", "The record ran on the kernels stand-in (FlexAttention in place of FlashAttention 3). FA3 saved "
              f"record 46 4.3 s of ~168 s against FlexAttention: with it the record's tokens/s would be "
              f"x{FA3_SPEEDUP:.3f}, ours / record {_fmt(measured and measured / FA3_SPEEDUP, '.3f')} "
              f"(measured: {_fmt(measured, '.3f')})."]
    if mask:
        lines.append(f"The stand-in builds its block mask at every attention call, which FA3 does not: "
                     f"{mask['s']:.2f} s of the record's {speed['record']['s']:.2f} s over those steps "
                     f"({_fmt(mask['share'], '.1%')}; per step: "
                     + ", ".join(f"{ms:.1f} ms at {n:,}-token rows" for n, ms in mask["ms_per_step"].items()) + ").")
    if standin.get("error"):
        lines.append(f"The stand-in's GPU check failed: {standin['error']}")
    if standin.get("check"):
        lines.append("The stand-in on this GPU against float64 (output and gradients, largest error): "
                     + ", ".join(f"{k} {v:.2e}" for k, v in standin["check"].items()) + ".")
    lines += ["", "| kernels per step | record ms | share | ours ms | share |", "|---|---:|---:|---:|---:|"]
    tables = {side: {r["category"]: r for r in (probes[side].get("profile") or {}).get("rows", [])}
              for side in probes}
    for cat in ORDER:
        cells = [(_fmt(t[cat]["ms"], ".1f"), _fmt(t[cat]["share"], ".1%")) if cat in t else ("n/a", "n/a")
                 for t in (tables["record"], tables["ours"])]
        lines.append(f"| {cat} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} |")
    return "\n".join(lines) + "\n"


def write(out: Path, work: Path, hp: dict, plan_lines: list[str], status: dict[str, str]) -> str:
    """Write the report into `out` (table.md, beside.json, loss.png, both logs); its table as text."""
    res, rec, ours = results(work, hp, plan_lines, status)
    text = table_text(res)
    write_text(out / "table.md", text)
    write_json(out / "beside.json", res)
    if (log := record_log(work)) is not None:
        write_text(out / "record_log.txt", without_code(log.read_text(errors="replace")))
    if (work / "ours" / "run" / "log.txt").is_file():
        write_text(out / "ours_log.txt", (work / "ours" / "run" / "log.txt").read_text(errors="replace"))
    if rec.evals or ours:
        loss_png(out, rec, ours)
    return text
