"""torch.compile of Muon's per-matrix math (optim.muon_compile): the Nesterov momentum, the Newton-Schulz or Polar
Express iteration, NorMuon's rescaling and the decay and update, each compiled once per function and reused.

The collectives stay outside: each compiled function is math between them. What changes from step to step (the
rate, the momentum, the decay) reaches the graphs as 0-dim tensors, inputs whose new values need no new graph;
everything else a graph depends on (shapes, splits, the iteration's coefficients) is fixed for a run, so each
function compiles once per shape it meets.
"""
from __future__ import annotations

from functools import cache
from typing import Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)


@cache
def compiled(fn: Fn) -> Fn:
    """fn under torch.compile, one wrapper per function: a whole graph (a graph break is an error, not a silent
    slow path) with static shapes, as record 46 compiles its Polar Express (dynamic shapes ran much slower there)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def chosen(fn: Fn, compile: bool) -> Fn:
    """fn compiled if `compile`, else fn itself (eager)."""
    return compiled(fn) if compile else fn
