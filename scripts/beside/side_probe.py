"""One side of the side-by-side run: a training script run in this process, measured from outside, the same way
for the record's script and for train.py.

    python -m scripts.beside.side_probe --json probe.json --profile-from 42 --profile-steps 3 -- SCRIPT [ARGS ...]

It counts the training steps by the step calls of the optimizer whose class name holds "Muon" (it steps every
step on both sides; warm-up steps count too, so --profile-from is the warm-up's steps plus the timed steps to
skip), profiles --profile-steps steps from there with torch.profiler, and when the script ends (or fails) writes:
the seconds dynamo and inductor spent compiling (forward and backward graphs), peak memory, and each kernel
category's time per profiled step; a script that ends through os._exit (train.py does) writes them first. A kernel
launched inside an optimizer's step counts as optimizer; the others go by name (`CATEGORIES`).
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.optim.optimizer import register_optimizer_step_post_hook

from util.atomic import write_json

# First match wins; names of CUDA kernels (cuBLAS, CUTLASS, Triton, NCCL) and, on CPU, of aten ops.
CATEGORIES = (
    ("communication", r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_scatter|broadcast"),
    ("attention", r"flash|fmha|flex|attention|triton_tem"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$"),
    ("elementwise", r"triton_(poi|per|red)|elementwise|vectorized|reduce_kernel|unrolled|cat_|copy|fill|"
                    r"aten::(add|sub|mul|div|pow|exp|log|tanh|sigmoid|relu|where|neg|sqrt|rsqrt|clamp)"),
)
OPTIMIZER_RANGE = "Optimizer.step#"  # torch.optim runs every optimizer's step in a profiler range so named
ORDER = ("matmul", "attention", "optimizer", "communication", "elementwise", "other")


def category(name: str, in_optimizer: bool) -> str:
    """The kernel category of a kernel or op named `name`."""
    if in_optimizer:
        return "optimizer"
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name, re.I)), "other")


def _in_optimizer(event: FunctionEvent) -> bool:
    while event is not None:
        if event.name.startswith(OPTIMIZER_RANGE):
            return True
        event = event.cpu_parent
    return False


def kernel_table(events: list[FunctionEvent], steps: int) -> dict:
    """Milliseconds per step by category (device kernels where there are any, else the ops' own CPU time) and
    the three costliest names of each."""
    device = any(e.kernels for e in events)
    totals, names = defaultdict(float), defaultdict(lambda: defaultdict(float))
    for e in events:
        parts = [(k.name, k.duration) for k in e.kernels] if device else [(e.name, e.self_cpu_time_total)]
        optimizer = _in_optimizer(e) if parts else False
        for name, us in parts:
            cat = category(name, optimizer)
            totals[cat] += us / 1000 / steps
            names[cat][name] += us / 1000 / steps
    step_ms = sum(totals.values())
    return {"time": "device" if device else "cpu", "step_ms": step_ms,
            "rows": [{"category": cat, "ms": totals[cat], "share": totals[cat] / step_ms if step_ms else 0.0,
                      "top": sorted(names[cat].items(), key=lambda kv: -kv[1])[:3]} for cat in ORDER]}


class StepWatch:
    """Counts the Muon-type optimizer's steps and profiles steps [start, start + count) of them."""

    def __init__(self, start: int, count: int):
        self.start, self.count, self.steps = start, count, 0
        self.profiler: torch.profiler.profile | None = None
        self.table: dict | None = None

    def after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """The global optimizer post-step hook."""
        if "Muon" not in type(optimizer).__name__:
            return
        self.steps += 1
        if self.count and self.steps == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self.profiler is not None and self.steps == self.start + self.count:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self.table = kernel_table(list(self.profiler.events()), self.count)
            self.profiler = None


def measurements(watch: StepWatch, wall_s: float, error: str | None) -> dict:
    """What the probe writes: compile seconds (dynamo's and inductor's, backward graphs included), peak memory,
    the kernel table, the steps counted."""
    from torch._dynamo.utils import calculate_time_spent

    cuda = torch.cuda.is_available()
    return {"compile_s": calculate_time_spent().get("total_wall_time", 0.0), "wall_s": wall_s,
            "muon_steps": watch.steps, "profile": watch.table, "error": error,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m scripts.beside.side_probe`."""
    p = argparse.ArgumentParser(prog="python -m scripts.beside.side_probe", description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--profile-from", type=int, default=0, help="Muon steps before the profiled ones")
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("script", type=Path)
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    watch = StepWatch(args.profile_from, args.profile_steps)
    # a script that sets no handler of its own (train.py does) ends at a SIGTERM through `finally` below
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    register_optimizer_step_post_hook(watch.after_step)
    sys.argv = [str(args.script), *args.args]  # the script reads its own arguments, and the record its own code
    t0, error, end_now = time.perf_counter(), None, os._exit

    def report(error: str | None) -> None:
        write_json(args.json, measurements(watch, time.perf_counter() - t0, error))

    def exit_reporting(status: int) -> None:  # train.py ends through os._exit: no `finally` below runs then
        report(None if status == 0 else f"exit {status}")
        end_now(status)

    os._exit = exit_reporting
    try:
        runpy.run_path(str(args.script), run_name="__main__")
    except SystemExit as e:
        error = None if e.code in (None, 0) else f"exit {e.code}"
        raise
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"[:1000]
        raise
    finally:
        report(error)


if __name__ == "__main__":
    main()
