"""train.py with a probe attached from outside: where a step's time goes, compile health, memory.

    python -m scripts.gpu_check.probe --probe-out OUT.json --config configs/speedrun_8xh100.toml [train.py arguments]

It runs train.main itself, so the step it times is the real one (train_step, the flag exchange, the log line),
not a copy, and train.py knows nothing of it: the probe is train.py's Hooks (around setup, warm_up, train and
evaluate), registers step hooks on the optimizers and puts pass-throughs in front of the loader and of the flag
exchange's all-reduce. Each of them marks a point of the step: a CUDA event on a GPU (read after the window, so nothing waits
for it), time.perf_counter() on CPU, where every op has finished when its call returns. The time from one mark
to the next is charged to the phase the first one opens:

    data               the loader's next(), per micro-batch (the host waits for the background thread)
    forward+backward   from a batch in hand to the next batch or the first optimizer step (grad norm included)
    adamw, muon, ...   each optimizer's step(), named by its class
    other              between those: zero_grad and the step's other host work
    flags              the stop/eval/save exchange (trainer/flags.py's start and collect)
    idle               from the exchange to the next step's first batch: the log line, the loop's bookkeeping,
                       the next step's set_lr. A GPU that the host keeps fed passes the two events back to
                       back, so this is the time the GPU waits on the host.

Over PROBE_STEPS steps after PROBE_SKIP: each phase's median and mean GPU milliseconds (and host ones), the
step's, tokens/s and MFU on the GPU's timeline, and memory. Compile health comes from dynamo's own books: graph
breaks (torch._dynamo.utils.counters), recompiles (its guard failures), frames compiled, and its record of each
compiled graph's sizes (a symbolic size: a dimension marked dynamic; one code compiled twice at the same sizes:
a recompile that no new shape asked for), for the warm-up, the timed loop, two evals run back to back, and the
training after them when the first eval comes inside the loop (eval.every_s); the second eval must compile
nothing, and the difference of their times is the eval's compile time. OUT.json is rewritten after every
stage, and at the start of the warm-up and of the first eval (their epoch seconds, in "started"), so a run
stopped by a timeout leaves what it had measured, and how long a compile in flight had run.
"""
from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch


import train as trainpy
from util.atomic import write_json
from data.shards import ShardError
from trainer.config import ConfigError
from trainer.metrics import peak_mem_gb
from trainer.state import Hooks

PROBE_SKIP = 3     # timed steps left out first: the first ones after warm-up's restore may still allocate
PROBE_STEPS = 30   # steps timed
GRAPHS_KEPT = 10_000  # compiled graphs dynamo keeps a record of (its default, 64, a long run can pass)
GB = 1e9


class Marks:
    """Points of the work in the order the device runs it: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def now(self) -> Any:
        """A mark here; records an event on CUDA and waits for nothing."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a: Any, b: Any) -> float:
        """Device seconds from mark a to mark b (on CUDA once both have passed: after a synchronize)."""
        return a.elapsed_time(b) / 1000 if self.cuda else b - a


def compile_state() -> dict:
    """Dynamo's running totals: graph breaks by reason, guard failures (recompiles) by code, frames compiled, and
    the graphs it compiled (compiled_graphs)."""
    from torch._dynamo.utils import counters, guard_failures

    return {"breaks": dict(counters["graph_break"]), "frames": counters["frames"]["ok"],
            "failures": {code: list(reasons) for code, reasons in guard_failures.items()},
            "graphs": compiled_graphs()}


def compiled_graphs() -> list[dict]:
    """Dynamo's record of each graph it compiled: an id, its code, its sizes (dynamo's graph_node_shapes: each
    node's sizes, a symbolic one as its name) and the nodes of symbolic size; sizes None where this torch does
    not record them. Records that name no code are left out: a backward's compile (its sizes are its forward's)
    and compile work done at run time (a kernel's first launch) are not frames that dynamo compiled."""
    from torch._dynamo.utils import get_compilation_metrics

    graphs = []
    for m in get_compilation_metrics():
        if getattr(m, "co_name", None) is None:
            continue
        shapes = getattr(m, "graph_node_shapes", None)
        graphs.append({"id": f"{m.compile_id}@{m.start_time}", "shapes": shapes,
                       "code": f"{m.co_name} ({Path(m.co_filename or '?').name}:{m.co_firstlineno})",
                       "symbolic": None if shapes is None else symbolic_nodes(shapes)})
    return graphs


def symbolic_nodes(shapes: str) -> list[str] | None:
    """The nodes of dynamo's graph_node_shapes (a dict's repr: node name -> sizes, an int each, or a symbolic
    size's name: 's0') that have a symbolic size, as "node [sizes]"; None if the text is not such a dict."""
    try:
        sizes = ast.literal_eval(shapes) if shapes else {}
        return [f"{node} {dims}" for node, dims in sizes.items() if any(isinstance(d, str) for d in dims)]
    except (ValueError, SyntaxError, TypeError, AttributeError):
        return None


def compile_delta(before: dict, after: dict) -> dict:
    """What dynamo did between two compile_state() snapshots: graph breaks, recompiles (with their first
    reasons), frames compiled, graphs of symbolic size (dynamic) and graphs of a code compiled again at sizes it
    already had in the stretch (same_shape); those two None where this torch does not record sizes."""
    breaks = {reason: n - before["breaks"].get(reason, 0) for reason, n in after["breaks"].items()
              if n > before["breaks"].get(reason, 0)}
    recompiles = [reason for code, reasons in after["failures"].items()
                  for reason in reasons[len(before["failures"].get(code, [])):]]
    seen = {g["id"] for g in before["graphs"]}
    new = [g for g in after["graphs"] if g["id"] not in seen]
    dynamic = [f"{g['code']}: {', '.join(g['symbolic'][:3])}" for g in new if g["symbolic"]]
    compiled, again = set(), []
    for g in new:
        if (g["code"], g["shapes"]) in compiled:
            again.append(g["code"])
        compiled.add((g["code"], g["shapes"]))
    sized = all(g["symbolic"] is not None for g in new)
    return {"graph_breaks": sum(breaks.values()), "recompiles": len(recompiles),
            "frames_compiled": after["frames"] - before["frames"],
            "break_reasons": [" ".join(reason.split())[:300] for reason in breaks][:5],
            "recompile_reasons": [" ".join(str(reason).split())[:300] for reason in recompiles][:5],
            "dynamic_graphs": len(dynamic) if sized else None, "dynamic_reasons": [r[:300] for r in dynamic][:5],
            "same_shape_graphs": len(again) if sized else None, "same_shape_codes": again[:5]}


def phase_summary(timeline: list[tuple[int, str, Any, float]], marks: Marks) -> dict:
    """Per-phase and per-step times of the steps that a later mark closes (the last step seen is left out)."""
    device: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    host: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (step, phase, mark, clock), (_, _, next_mark, next_clock) in zip(timeline, timeline[1:]):
        device[step][phase] += marks.seconds(mark, next_mark)
        host[step][phase] += next_clock - clock
    steps = sorted(device)[:-1] if timeline and timeline[-1][1] != "end" else sorted(device)
    if not steps:
        return {"steps": 0}
    phases = sorted({phase for s in steps for phase in device[s]})
    totals = [sum(device[s].values()) for s in steps]
    mean_total = statistics.fmean(totals)

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.fmean(values), 4)

    table = {}
    for phase in phases:
        values = [device[s].get(phase, 0.0) for s in steps]
        table[phase] = {"device_ms": round(1000 * statistics.median(values), 4), "device_ms_mean": ms(values),
                        "host_ms_mean": ms([host[s].get(phase, 0.0) for s in steps]),
                        "share": statistics.fmean(values) / mean_total if mean_total > 0 else None}
    return {"steps": len(steps), "first_step": steps[0], "phases": table,
            "step_ms": round(1000 * statistics.median(totals), 4), "step_ms_mean": ms(totals),
            "host_step_ms_mean": ms([sum(host[s].values()) for s in steps]), "window_s": sum(totals)}


class Probe(Hooks):
    """The marks, snapshots and results of one probed train.py run (see the module docstring)."""

    def __init__(self, out: Path, skip: int = PROBE_SKIP, steps: int = PROBE_STEPS):
        self.out, self.skip, self.steps = out, skip, steps
        self.result: dict[str, Any] = {"stage": "start", "window": {"skip": skip, "steps": steps}}
        self.timeline: list[tuple[int, str, Any, float]] = []  # (step, phase it opens, device mark, host time)
        self.marks = Marks(False)
        self.run = None
        self.in_loop = False     # inside train.train
        self.recording = False   # inside train.train, before the window closed
        self.step = -1           # the timed loop's step being run
        self.new_step = True     # the next batch opens a step (set by the last optimizer's step)
        self.evals = 0
        self.loop_start: dict | None = None     # compile_state() at the timed loop's start
        self.resumed: tuple[dict, int] | None = None  # compile_state() and steps run when the loop resumed

    def save(self, stage: str) -> None:
        """Rewrite OUT.json with everything measured so far (rank 0)."""
        self.result["stage"] = stage
        if self.run is None or self.run.dist.master:
            write_json(self.out, self.result)

    # --- marks ------------------------------------------------------------------------------------------------
    def mark(self, phase: str) -> None:
        if self.recording and self.step >= self.skip:
            self.timeline.append((self.step, phase, self.marks.now(), time.perf_counter()))

    def before_batch(self) -> None:
        if self.in_loop and self.new_step:
            self.new_step = False
            self.step += 1
            if self.recording and self.step == self.skip + self.steps:
                self.mark("end")
                self.close_window()
        self.mark("data")

    def after_batch(self) -> None:
        self.mark("forward+backward")

    # --- the stages of a run ----------------------------------------------------------------------------------
    def setup(self, stage: Callable, cfg, dist):
        run = stage(cfg, dist)
        self.run, self.marks = run, Marks(dist.cuda)
        run.loader = Batches(run.loader, self)
        run.flags.reduce = Marked(run.flags.reduce, self)
        for opt in run.optimizers:
            name = type(opt).__name__.lower()
            opt.register_step_pre_hook(lambda *_, name=name: self.mark(name))
            opt.register_step_post_hook(lambda o, *_: self._after_optimizer(o))
        train, module = cfg.train, run.model.module
        self.result["shape"] = {
            "batch_size": train.batch_size, "seq_len": train.seq_len, "grad_accum": train.grad_accum,
            "world_size": dist.world_size, "tokens_per_step": run.tokens_per_step, "params": module.num_params(),
            "param_gb": sum(p.numel() * p.element_size() for p in module.parameters()) / GB,
            "flops_per_token": module.flops_per_token(train.seq_len), "compile": train.compile,
            "eval_batch": self.eval_shape(cfg)}
        self.result["device"] = {"name": torch.cuda.get_device_name(dist.device) if dist.cuda else "cpu",
                                 "total_gb": torch.cuda.get_device_properties(dist.device).total_memory / GB
                                 if dist.cuda else None}
        self._reset_peak()
        self.save("setup")
        return run

    def _after_optimizer(self, opt) -> None:
        self.mark("other")
        if opt is self.run.optimizers[-1]:
            self.new_step = True

    def started(self, stage: str) -> None:
        """Note when `stage` starts, on the wall clock a parent process shares, and write it out at once."""
        self.result.setdefault("started", {})[stage] = time.time()
        self.save(f"{stage} started")

    def warm_up(self, stage: Callable, run) -> None:
        self.started("warm_up")
        before, t0 = compile_state(), time.perf_counter()
        stage(run)
        self._sync()
        steps = run.clock.warmup_steps(run.progress.step)
        self.result["warm_up"] = {"seconds": time.perf_counter() - t0, "steps": steps,
                                  **compile_delta(before, compile_state()), **self._memory("peak")}
        self.save("warm_up")

    def train(self, stage: Callable, run) -> str:
        self._sync()
        self.result["memory_static"] = self._memory("static")
        self._reset_peak()
        self.loop_start = compile_state()
        self.in_loop = self.recording = self.new_step = True
        self.step = -1
        try:
            return stage(run)
        finally:
            self.in_loop = False
            if self.recording:  # the loop ended before the window did: summarise the steps it holds
                self.close_window()
            if self.resumed is None:
                self.loop_until_now()
            else:
                since, steps = self.resumed
                self.result["after_eval"] = {"steps": self.step + 1 - steps, **compile_delta(since, compile_state())}
            self.save("train")

    def loop_until_now(self) -> None:
        """The timed loop's steps and compile counts from its start to now."""
        self.result["train_loop"] = {"steps": self.step + 1, **compile_delta(self.loop_start, compile_state())}

    def close_window(self) -> None:
        """Stop marking, wait for the device once, and turn the marks into phase times."""
        self.recording = False
        self._sync()
        run, summary = self.run, phase_summary(self.timeline, self.marks)
        if summary["steps"]:
            tok_s = run.tokens_per_step * summary["steps"] / summary["window_s"]
            summary.update(tok_s=tok_s, mfu=run.mfu(tok_s))
        self.result["phases"] = {**summary, **self._memory("peak")}
        self.timeline.clear()
        self.save("window")

    def evaluate(self, stage: Callable, run) -> float:
        self.evals += 1
        if self.evals > 1:
            return stage(run)
        if self.in_loop:  # an eval inside the timed loop: the window and the loop's counts end here
            if self.recording:
                self.close_window()
            self.loop_until_now()
        self.started("eval")
        try:
            first = self._timed_eval(stage, run)
        except torch.cuda.OutOfMemoryError as e:
            # An eval longer than training's (eval.seq_len) that does not fit: say so, and score at the training
            # shape instead, so that the loss checks still get their number.
            if not self._train_shape_eval(run.cfg):
                raise
            self.result["eval_oom"] = " ".join(str(e).split())[:500]
            torch.cuda.empty_cache()
            first = self._timed_eval(stage, run)
        self.result["eval"] = {"first": first, "shape": self.eval_shape(run.cfg)}
        self.save("first eval")
        second = self._timed_eval(stage, run)
        self.result["eval"].update(second=second, compile_s=max(first["seconds"] - second["seconds"], 0.0))
        self.save("eval")
        if self.in_loop:  # training resumes: what it compiles from here is counted apart
            self.resumed = (compile_state(), self.step + 1)
        return first["val_loss"]

    @staticmethod
    def eval_shape(cfg) -> list[int]:
        """[rows, tokens] of an eval batch."""
        return list(cfg.eval_shape)

    def _train_shape_eval(self, cfg) -> bool:
        """Point the eval at the training batch shape; False if it is that shape already."""
        self.result["eval_oom_shape"] = self.eval_shape(cfg)
        if self.eval_shape(cfg) == [cfg.train.batch_size, cfg.train.seq_len]:
            return False
        cfg.eval.batch_size = cfg.eval.seq_len = 0
        return True

    def _timed_eval(self, stage: Callable, run) -> dict:
        self._reset_peak()
        before, t0 = compile_state(), time.perf_counter()
        val = stage(run)  # ends with .item(): the device has finished
        return {"seconds": time.perf_counter() - t0, "val_loss": val, **compile_delta(before, compile_state()),
                **self._memory("peak")}

    # --- devices ----------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.marks.cuda:
            torch.cuda.synchronize()

    def _reset_peak(self) -> None:
        if self.marks.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _memory(self, kind: str) -> dict:
        """Allocated memory now ("static") or its peak since the last reset, and the reserved peak (GB); on CPU
        the process's peak RSS."""
        if not self.marks.cuda:  # the process's peak RSS is all a CPU tells
            return {"static_gb": None} if kind == "static" else {"peak_gb": peak_mem_gb(self.run.dist)}
        if kind == "static":
            return {"static_gb": torch.cuda.memory_allocated() / GB}
        return {"peak_gb": torch.cuda.max_memory_allocated() / GB,
                "peak_reserved_gb": torch.cuda.max_memory_reserved() / GB}


class Batches:
    """run.loader's stand-in: the same object for everything (state_dict, close, ...), with a mark before and
    after each batch."""

    def __init__(self, loader, probe: Probe):
        self._loader, self._probe, self._it = loader, probe, None

    def __iter__(self) -> Batches:
        self._it = iter(self._loader)
        return self

    def __next__(self):
        self._probe.before_batch()
        batch = next(self._it)
        self._probe.after_batch()
        return batch

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class Marked:
    """The flag exchange's all-reduce with a mark before and after each call: its time is the "flags" phase."""

    def __init__(self, reduce, probe: Probe):
        self._reduce, self._probe = reduce, probe

    def start(self, *args):
        self._probe.mark("flags")
        self._reduce.start(*args)
        self._probe.mark("idle")

    def collect(self):
        self._probe.mark("flags")
        values = self._reduce.collect()
        self._probe.mark("idle")
        return values


def main(argv: list[str]) -> None:
    """Run train.py's main on the arguments that are not the probe's."""
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check.probe", description=__doc__.split("\n")[0],
                                epilog="every other argument goes to train.py", allow_abbrev=False)
    p.add_argument("--probe-out", type=Path, required=True, help="the probe's JSON")
    p.add_argument("--probe-skip", type=int, default=PROBE_SKIP, help="timed steps before the window")
    p.add_argument("--probe-steps", type=int, default=PROBE_STEPS, help="steps in the window")
    args, train_argv = p.parse_known_args(argv)
    probe = Probe(args.probe_out, args.probe_skip, args.probe_steps)
    from torch._dynamo import utils

    if hasattr(utils, "set_compilation_metrics_limit"):  # an older torch keeps its 64
        utils.set_compilation_metrics_limit(GRAPHS_KEPT)
    try:
        trainpy.main(trainpy.parse_args(train_argv), hooks=probe)
    except (ConfigError, ShardError) as e:
        sys.exit(f"train.py: {e}")
    probe.save("done")


if __name__ == "__main__":
    main(sys.argv[1:])
