"""NorMuon: Muon's orthogonalised update rescaled per neuron by a running second moment, its norm kept.

For each matrix V (rows x cols) that Muon orthogonalises (each view of a split parameter), the neurons are its
rows when rows >= cols and its columns otherwise (the longer side counts the neurons, as the records decide):
    s_i = mean of V's squares along neuron i;   B <- lerp(B, s, 1 - beta2)
    V' = V / sqrt(B) (neuron by neuron);         V <- V' * ||V||_F / ||V'||_F
Once B tracks s, every neuron's update has the same RMS, and the matrix keeps the size of step Muon gave it.

A rank may hold only some rows (FSDP2): it adds up the squares of its rows, one all_reduce of those sums (all
parameters at once) gives every rank the whole matrices' statistics, and B is the same on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _by_neuron(shape: torch.Size, split: int) -> bool:
    """Whether the neurons of each [rows / split, cols] view are its rows (else its columns)."""
    return shape[0] // split >= shape[1]


def moment_shape(shape: torch.Size, split: int) -> tuple[int, int]:
    """The shape of a parameter's second moment: [split, rows of a view] or [split, cols]."""
    return (split, shape[0] // split) if _by_neuron(shape, split) else (split, shape[1])


def _square_sums(o: Tensor, shape: torch.Size, split: int, start: int) -> Tensor:
    """The sums of squares per neuron that this rank's rows o (rows start... of the parameter) contribute."""
    sq = o.float().square()
    sums = torch.zeros(moment_shape(shape, split), dtype=torch.float32, device=o.device)
    if _by_neuron(shape, split):
        sums.view(-1)[start:start + o.size(0)] = sq.sum(-1)
    else:
        view = torch.arange(start, start + o.size(0), device=o.device) // (shape[0] // split)
        sums.index_add_(0, view, sq)
    return sums


def _rescaled(o: Tensor, sums: Tensor, moment: Tensor, beta2: float, shape: torch.Size, split: int,
              start: int) -> Tensor:
    """o (fp32) rescaled per neuron by the updated second moment, each view keeping its Frobenius norm."""
    by_neuron = _by_neuron(shape, split)
    moment.lerp_(sums / (shape[1] if by_neuron else shape[0] // split), 1 - beta2)
    step = moment.clamp_min(1e-10).rsqrt()
    kept = sums.sum(-1, keepdim=True).sqrt() / (sums * step.square()).sum(-1, keepdim=True).sqrt().clamp_min(1e-10)
    scale = step * kept
    rows = torch.arange(start, start + o.size(0), device=o.device)
    factor = scale.view(-1)[rows, None] if by_neuron else scale[rows // (shape[0] // split)]
    return o.float() * factor


def normalize(updates: list[Tensor], shapes: list[torch.Size], splits: list[int], starts: list[int],
              moments: list[Tensor], beta2: list[float], group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """NorMuon of each update (this rank's rows of it, from row `starts[i]` of a parameter of global shape
    `shapes[i]`), advancing its second moment; `group`: the ranks that hold the other rows (None: all here)."""
    sums = [_square_sums(o, s, k, r) for o, s, k, r in zip(updates, shapes, splits, starts)]
    if group is not None:
        flat = torch.cat([s.view(-1) for s in sums])
        dist.all_reduce(flat, group=group)
        sums = [f.view_as(s) for f, s in zip(flat.split([s.numel() for s in sums]), sums)]
    return [_rescaled(*args) for args in zip(updates, sums, moments, beta2, shapes, splits, starts)]
