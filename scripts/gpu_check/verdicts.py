"""The GPU check's verdicts: each finding of a check judged against its threshold, as a PASS, FAIL, SLOW or
n/a line (n/a where a CPU rehearsal cannot say)."""
from __future__ import annotations

import math
from typing import Iterable

from scripts.gpu_check.sizes import Sizes

LEAK_FLOOR = 0.3  # nats per byte: a causal byte model cannot get this low in seconds; one that sees targets can
MFU_FLOOR = 0.30  # the MFU the speedrun's budget assumes (scripts/predict_speedrun.py)
DATA_WAIT_MAX = 0.01  # of a step: the loader must hide behind the GPU
IDLE_MAX = 0.03  # of a step: the GPU waiting on the host between steps
HACKATHON_COMPILE_MAX_S = 60.0  # 10% of its 600 s clock, on which compile counts
REUSE_MAX = 0.5  # of the speedrun's compile seconds: the text check loads its graphs, so it traces, not compiles
MEMORY_MAX = 0.90  # of the device's memory, reserved at the peak: above it a longer eval or a new shape OOMs


def first_given(*values):
    """The first value that is not None (a figure from the best source that has it)."""
    return next((v for v in values if v is not None), None)


def line(check: str, what: str, verdict: str, measured: str, threshold: str) -> dict:
    """One verdict line of the table."""
    return {"check": check, "what": what, "verdict": verdict, "measured": measured, "threshold": threshold}


def loss_verdict(name: str, val: float | None, init: float, text_max: float) -> dict:
    """The final val loss: text must fall (but not to ~0); random tokens must stay near ln(vocab)."""
    if name == "text":
        what, threshold = "val loss falls, but not to ~0 (a leaking mask)", f"{LEAK_FLOOR} < loss < {text_max}"
        ok = val is not None and math.isfinite(val) and LEAK_FLOOR < val < text_max
    else:
        # Random tokens hold no information: a loss well below ln(vocab) means the model saw targets.
        what, threshold = "random-token val loss: no future leak", f">= ln(V) - 0.1 = {init - 0.1:.3f}"
        ok = val is not None and math.isfinite(val) and val > init - 0.1
    return line(name, what, "PASS" if ok else "FAIL", "no val loss" if val is None else f"{val:.3f}", threshold)


def at_most(value: float | None, limit: float, cpu: bool) -> str:
    """PASS when value <= limit, else SLOW; n/a when there is no value or on CPU."""
    if value is None:
        return "n/a"
    verdict = "PASS" if value <= limit else "SLOW"
    return f"n/a on CPU ({verdict} there)" if cpu else verdict


def training_verdicts(row: dict, sizes: Sizes, cpu: bool) -> list[dict]:
    """Every verdict of one training check: it ran, its loss, its compile health, its speed and memory."""
    name, probe = row["check"], row.get("probe") or {}
    out = [line(name, "ran to the end", "PASS" if row["status"] == "ok" else "FAIL", row["status"],
                f"exit 0 within {row.get('timeout_s', '?')} s")]
    if "skipped" in row["status"]:
        return out
    out.append(loss_verdict(name, row.get("val_loss"), row["init_loss"], sizes.text_max_loss))
    return out + compile_verdicts(row, probe, cpu) + speed_verdicts(row, probe, cpu)


def compile_verdicts(row: dict, probe: dict, cpu: bool) -> list[dict]:
    """Graph breaks, recompiles after warm-up, a static compile (no dynamic graph, one graph per shape), the
    evals and the training after them, and the compile seconds."""
    name, out = row["check"], []
    off = None if (probe.get("shape") or {}).get("compile") else "n/a: train.compile = false"
    warm, loop, ev, after = (probe.get(k) for k in ("warm_up", "train_loop", "eval", "after_eval"))
    if warm and loop:
        breaks = warm["graph_breaks"] + loop["graph_breaks"]
        reasons = (warm["break_reasons"] + loop["break_reasons"])[:1]
        out.append(line(name, "graph breaks, training", off or ("PASS" if breaks == 0 else "FAIL"),
                        f"{breaks}" + (f": {reasons[0][:160]}" if reasons else ""), "0"))
        why = loop["recompile_reasons"][:1]
        out.append(line(name, "recompiles in the timed loop", off or ("PASS" if loop["recompiles"] == 0 else "FAIL"),
                        f"{loop['recompiles']}" + (f": {why[0][:160]}" if why else ""), "0 after warm-up"))
    stages = [s for s in (warm, loop, (ev or {}).get("first"), (ev or {}).get("second"), after) if s]
    if stages:
        out += static_verdicts(name, stages, off)
    if ev:
        first, second = ev["first"], ev.get("second")
        one = second is not None and second["frames_compiled"] == 0 and second["recompiles"] == 0 \
            and first["graph_breaks"] == 0
        out.append(line(name, "eval: one compiled shape, no graph break", off or ("PASS" if one else "FAIL"),
                        f"first eval {first['frames_compiled']} frames, {first['graph_breaks']} breaks; "
                        + (f"second {second['frames_compiled']} frames, {second['recompiles']} recompiles"
                           if second else "no second eval"), "second eval compiles nothing; 0 breaks"))
        resumed = after is not None and after["frames_compiled"] == 0 and after["recompiles"] == 0
        why = (after or {}).get("recompile_reasons", [])[:1]
        out.append(line(name, "training resumes after the eval without a recompile",
                        off or ("PASS" if resumed else "FAIL"),
                        f"{after['steps']} steps: {after['frames_compiled']} frames, {after['recompiles']} recompiles"
                        + (f": {why[0][:160]}" if why else "") if after else "no step after the eval", "0 frames"))
    if probe.get("eval_oom"):
        out.append(line(name, "eval at its configured shape fits", "FAIL",
                        f"OOM at {probe.get('eval_oom_shape')}; scored at the training shape", "no OOM"))
    seconds = first_given(row.get("compile_s"), row.get("compile_s_min"))
    if seconds is not None:
        on_clock = name == "hackathon"  # compile counts on the hackathon's clock; the speedrun excludes it
        verdict = off or (at_most(seconds, HACKATHON_COMPILE_MAX_S, cpu) if on_clock else "info")
        out.append(line(name, "compile seconds (training; eval)", verdict,
                        f"{compile_cell(row, 'compile_s')}; {compile_cell(row, 'eval_compile_s')}",
                        f"<= {HACKATHON_COMPILE_MAX_S:.0f} s (on the clock)" if on_clock else "off the clock"))
    return out


def static_verdicts(name: str, stages: list[dict], off: str | None) -> list[dict]:
    """No graph of symbolic (dynamic) size and no code compiled twice at the same sizes, over the probe's
    stages (warm-up, timed loop, evals, training after them), as the model's dynamic=False promises."""
    out = []
    for key, reasons, what, threshold in (
            ("dynamic_graphs", "dynamic_reasons", "no graph marked dynamic", "0 graphs of symbolic size"),
            ("same_shape_graphs", "same_shape_codes", "one graph per shape", "0 codes compiled twice at one shape")):
        counts = [stage.get(key) for stage in stages]
        if None in counts:
            out.append(line(name, what, off or "n/a: this torch does not record graph sizes", "-", threshold))
            continue
        why = [r for stage in stages for r in stage[reasons]][:1]
        out.append(line(name, what, off or ("PASS" if sum(counts) == 0 else "FAIL"),
                        f"{sum(counts)}" + (f": {why[0][:160]}" if why else ""), threshold))
    return out


def reuse_verdict(text: dict, speedrun: dict) -> dict:
    """The text check against the speedrun: the same graphs, so it should load the speedrun's from the shared
    cache rather than compile its own (training and eval)."""
    off = None if ((text.get("probe") or {}).get("shape") or {}).get("compile") else "n/a: train.compile = false"
    pairs = [(text.get(k), speedrun.get(k)) for k in ("compile_s", "eval_compile_s")]
    known = [(own, theirs) for own, theirs in pairs if own is not None and theirs]
    verdict = off or ("n/a" if not known else
                      "PASS" if all(own <= REUSE_MAX * theirs for own, theirs in known) else "SLOW")
    return line("text", "reuses the speedrun's compiled graphs", verdict,
                "; ".join(f"{what} {fmt(own, '.1f')} s vs {fmt(theirs, '.1f')}"
                          for what, (own, theirs) in zip(("training", "eval"), pairs)),
                f"<= {REUSE_MAX:.0%} of the speedrun's compile seconds")


def speed_verdicts(row: dict, probe: dict, cpu: bool) -> list[dict]:
    """MFU, data wait, the GPU's idle gap and the memory peak (performance: judged on a GPU only)."""
    name, out = row["check"], []
    if row.get("mfu") is not None or cpu:
        out.append(line(name, "MFU", "n/a on CPU" if cpu else ("PASS" if row["mfu"] >= MFU_FLOOR else "SLOW"),
                        f"{fmt(row.get('mfu'), '.1%')} at {fmt(row.get('tok_s'), ',.0f')} tok/s",
                        f">= {MFU_FLOOR:.0%}"))
    for key, what, limit in (("data_wait_frac", "data wait, share of a step", DATA_WAIT_MAX),
                             ("idle_frac", "GPU idle between steps, share of a step", IDLE_MAX)):
        if row.get(key) is not None:
            out.append(line(name, what, at_most(row[key], limit, cpu), f"{row[key]:.2%}", f"<= {limit:.0%}"))
    total = (probe.get("device") or {}).get("total_gb")
    stages = (probe.get("warm_up"), probe.get("phases"), (probe.get("eval") or {}).get("first"))
    reserved = max((s or {}).get("peak_reserved_gb", 0) for s in stages)
    if total:
        out.append(line(name, "peak memory (reserved)", at_most(reserved / total, MEMORY_MAX, cpu),
                        f"{reserved:.1f} of {total:.0f} GB", f"<= {MEMORY_MAX:.0%}"))
    return out


def kernel_verdicts(row: dict, cpu: bool) -> list[dict]:
    """The verdicts of scripts/gpu_check/kernels.py's results."""
    k, status = row.get("kernels") or {}, row["status"]
    out = [line("kernels", "ran to the end", "PASS" if status == "ok" else "FAIL", status,
                f"exit 0 within {row.get('timeout_s', '?')} s")]
    for key, what in (("ring_speedrun", "pinned ring = CPU path, speedrun shape (BOS-aligned)"),
                      ("ring_hackathon", "pinned ring = CPU path, hackathon shape")):
        r = k.get(key)
        if (missing := not_run(r, what, status)) is not None:
            out.append(missing)
            continue
        ok = r["mismatches"] == 0 and r["state_equal"]
        state = "equal" if r["state_equal"] else "differs"
        out.append(line("kernels", what, "PASS" if ok else "FAIL",
                        f"{r['batches'] - r['mismatches']}/{r['batches']} equal, state {state}"
                        + (" (CPU vs CPU, all held)" if cpu else ""), "byte for byte"))
    return (out + flex_verdicts(k.get("flex"), status, cpu) + fp8_verdicts(k.get("fp8"), status, cpu)
            + symmetric_verdicts(k.get("symmetric"), status, cpu))


def not_run(result: dict | None, what: str, status: str) -> dict | None:
    """The line of a kernel check that did not run: not reached or raised (FAIL), or n/a here; None if it ran."""
    if result is None:
        return line("kernels", what, "FAIL", f"not reached: {status}", "runs")
    if "error" in result or "status" in result:
        return line("kernels", what, "FAIL" if "error" in result else "n/a",
                    (result.get("error") or result.get("status"))[:200], "runs")
    return None


def flex_verdicts(flex: dict | None, status: str, cpu: bool) -> list[dict]:
    """FlexAttention against SDPA: output, gradients, its backward's compile and speed."""
    if (missing := not_run(flex, "FlexAttention vs SDPA (bf16)", status)) is not None:
        return [missing]
    tol, errs, ok = flex["tolerance"], flex["flex"], flex["ok"]
    shape = flex["shape"]
    at = f"head {shape['head_dim']}, T {shape['seq_len']}, window {shape['window']}, doc mask {shape['doc_causal']}"
    out = [line("kernels", f"flex = SDPA, output ({at})", "PASS" if ok["out"] else "FAIL",
                f"{errs['out']:.4f} (SDPA {flex['sdpa']['out']:.4f})", f"<= {tol['out']:.4f}")]
    grads = ("dq", "dk", "dv")
    worst = max(grads, key=lambda g: errs[g] / tol[g])
    verdict = "n/a on CPU (no flex backward)" if cpu else "PASS" if all(ok[g] for g in grads) else "FAIL"
    out.append(line("kernels", "flex = SDPA, q/k/v gradients", verdict,
                    f"worst {worst} {errs[worst]:.4f} (SDPA {flex['sdpa'][worst]:.4f})", f"<= {tol[worst]:.4f}"))
    if cpu:
        out.append(line("kernels", "flex backward compiles (head 128, doc mask)", "n/a on CPU", "-", "compiles"))
    else:
        ms = flex.get("ms", {})
        out.append(line("kernels", "flex backward compiles (head 128, doc mask)", "PASS",
                        f"{flex['compile_s']:.1f} s; fwd+bwd {fmt(ms.get('flex'), '.2f')} ms vs SDPA dense mask "
                        f"{fmt(ms.get('sdpa'), '.2f')} ms", "compiles and runs"))
    return out


def fp8_verdicts(fp8: dict | None, status: str, cpu: bool) -> list[dict]:
    """The FP8 head's matmul against float64, eager and compiled, within the float8 rounding bound, and its speed
    against the bf16 head's (a measurement, no threshold)."""
    if (missing := not_run(fp8, "FP8 head matmul = float64 (model/fp8.py)", status)) is not None:
        return [missing]
    shape, bound = fp8["shape"], fp8["bound"]
    at = f"{shape['rows']:,} x {shape['width']} @ {shape['vocab']:,}"
    names, out = ("out", "grad_x", "grad_w"), []  # in this order: the JSON's keys come back sorted
    for run, what in (("eager", f"FP8 head matmul = float64, output and gradients ({at})"),
                      ("compiled", "FP8 head matmul = float64, compiled (fullgraph=True)")):
        errs = fp8[run]
        if "error" in errs:
            out.append(line("kernels", what, "FAIL", errs["error"][:200], "compiles and runs"))
            continue
        out.append(line("kernels", what, "PASS" if fp8["ok"][run] else "FAIL",
                        ", ".join(f"{name} {errs[name]:.4f}" for name in names),
                        "<= " + ", ".join(f"{bound[name]:.4f}" for name in names) + " (float8 rounding)"))
    ms = fp8["ms"]
    out.append(line("kernels", "FP8 head fwd+bwd vs bf16 head", "n/a on CPU" if cpu else "info",
                    f"{ms['fp8']:.2f} ms eager, {fmt(ms.get('fp8_compiled'), '.2f')} compiled "
                    f"({fp8['compile_s']:.1f} s to compile) vs bf16 {ms['bf16']:.2f} ms: "
                    f"{fp8['speedup']:.2f} x bf16's speed",
                    "measured: the key's gain"))
    return out


def symmetric_verdicts(sym: dict | None, status: str, cpu: bool) -> list[dict]:
    """The symmetric-product kernel against float64 at each of Muon's stacks it takes, within twice the plain
    matmuls' error and a bf16 step, and Polar Express's time with it against without (a measurement, no
    threshold)."""
    if (missing := not_run(sym, "symmetric products = float64 (optim/symmetric.py)", status)) is not None:
        return [missing]
    out = []
    for stack, errs in sym["errors"].items():
        out.append(line("kernels", f"symmetric products = float64, {stack} ({sym['dtype']})",
                        "PASS" if sym["ok"][stack] else "FAIL",
                        ", ".join(f"{what} {errs[name]:.4f} ({errs[name + '_plain']:.4f})" for name, what in
                                  (("gram", "X X^T"), ("square", "A A^T"), ("poly", "b A + c A^2"),
                                   ("iteration", "Polar Express"))),
                        "<= 2 x the plain matmuls' (in brackets) + 2^-8"))
    ms = sym["ms"]
    out.append(line("kernels", "Polar Express of every stack, with the kernel vs without",
                    "n/a on CPU (interpreter)" if cpu else "info",
                    f"{ms['symmetric']:.2f} vs {ms['matmul']:.2f} ms: {sym['speedup']:.2f} x, eager",
                    "measured: the key's gain"))
    return out


# --- the report ---------------------------------------------------------------------------------------------
def fmt(value, spec: str, scale: float = 1) -> str:
    return "-" if value is None else format(scale * value, spec)


def compile_cell(row: dict, key: str) -> str:
    """A compile's seconds; for one a timeout cut short, "> " the seconds it had run."""
    if row.get(key) is not None:
        return f"{row[key]:.1f}"
    return "-" if row.get(f"{key}_min") is None else f"> {row[f'{key}_min']:.0f}"


def judged(row: dict, sizes: Sizes, cpu: bool, earlier: Iterable[dict] = ()) -> list[dict]:
    """The verdicts of one check (the text check's also against the speedrun's among the `earlier` rows); a
    result this script did not foresee is a FAIL line, never a lost run."""
    try:
        if row["check"] == "kernels":
            return kernel_verdicts(row, cpu)
        out = training_verdicts(row, sizes, cpu)
        if row["check"] == "text" and "skipped" not in row["status"]:
            out += [reuse_verdict(row, r) for r in earlier if r["check"] == "speedrun" and "skipped" not in r["status"]]
        return out
    except Exception as e:  # noqa: BLE001 - the GPU run is a single shot: report, keep the JSON
        return [line(row["check"], "verdicts", "FAIL", f"{type(e).__name__}: {e}"[:300], "computed")]
